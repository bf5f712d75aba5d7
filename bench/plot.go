package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/ferry-project/ferry/internal/size"
)

// cdfPoints bounds the points of one CDF line, so an SVG of a long run
// stays small; the tail is kept exactly.
const cdfPoints = 400

// Plot draws rep to path, a .png or .svg: for a transfer sweep,
// throughput against block size (a line per concurrency) beside the
// latency CDF of each size at the lowest concurrency; for api, the latency
// CDF of each operation and concurrency.
func (rep Report) Plot(path string) error {
	format := strings.TrimPrefix(strings.ToLower(filepath.Ext(path)), ".")
	if format != "png" && format != "svg" {
		return fmt.Errorf("--plot %s: name a .png or .svg file", path)
	}
	if len(rep.Rows) == 0 {
		return fmt.Errorf("--plot: ferrybench %s has nothing to plot", rep.Command)
	}
	var plots []*plot.Plot
	if rep.Command == "transfer" {
		p, err := throughputPlot(rep)
		if err != nil {
			return err
		}
		plots = append(plots, p)
	}
	cdf, err := cdfPlot(rep)
	if err != nil {
		return err
	}
	plots = append(plots, cdf)

	c, err := draw.NewFormattedCanvas(vg.Length(len(plots))*16*vg.Centimeter, 12*vg.Centimeter, format)
	if err != nil {
		return err
	}
	tiles := draw.Tiles{Rows: 1, Cols: len(plots), PadX: vg.Centimeter, PadTop: 2 * vg.Millimeter,
		PadBottom: 2 * vg.Millimeter, PadLeft: 2 * vg.Millimeter, PadRight: 4 * vg.Millimeter}
	canvases := plot.Align([][]*plot.Plot{plots}, tiles, draw.New(c))
	for i, p := range plots {
		p.Draw(canvases[0][i])
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return f.Close()
}

// sizeTicks marks a log-scale axis at the block sizes measured.
type sizeTicks []int64

func (s sizeTicks) Ticks(lo, hi float64) []plot.Tick {
	var ts []plot.Tick
	for _, n := range s {
		if v := float64(n); v >= lo && v <= hi {
			ts = append(ts, plot.Tick{Value: v, Label: size.Format(n)})
		}
	}
	return ts
}

func throughputPlot(rep Report) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("ferry %s throughput", rep.Rows[0].Op)
	p.X.Label.Text = "block size"
	p.Y.Label.Text = "GB/s"
	p.X.Scale = plot.LogScale{}
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	p.Legend.Left = true
	var sizes sizeTicks
	var concs []int
	for _, r := range rep.Rows {
		if !slices.Contains(sizes, r.Size) {
			sizes = append(sizes, r.Size)
		}
		if !slices.Contains(concs, r.Concurrency) {
			concs = append(concs, r.Concurrency)
		}
	}
	p.X.Tick.Marker = sizes
	for i, c := range concs {
		var xys plotter.XYs
		for _, r := range rep.Rows {
			if r.Concurrency == c {
				xys = append(xys, plotter.XY{X: float64(r.Size), Y: r.GBps})
			}
		}
		line, points, err := plotter.NewLinePoints(xys)
		if err != nil {
			return nil, err
		}
		line.Color, points.Color = plotutil.Color(i), plotutil.Color(i)
		line.Dashes = plotutil.Dashes(i / len(plotutil.DefaultColors))
		points.Shape = plotutil.Shape(i)
		p.Add(line, points)
		p.Legend.Add(fmt.Sprintf("concurrency %d", c), line, points)
	}
	p.Y.Min = 0
	return p, nil
}

func cdfPlot(rep Report) (*plot.Plot, error) {
	p := plot.New()
	p.X.Label.Text = "latency (µs, log scale)"
	p.Y.Label.Text = "fraction of operations ≤ latency"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min, p.Y.Max = 0, 1
	p.Add(plotter.NewGrid())
	// Curves rise on the right; the top left stays free for the legend.
	p.Legend.Top = true
	p.Legend.Left = true
	rows := rep.Rows
	if rep.Command == "transfer" {
		lowest := rows[0].Concurrency
		for _, r := range rows {
			lowest = min(lowest, r.Concurrency)
		}
		rows = slices.DeleteFunc(slices.Clone(rows), func(r Row) bool { return r.Concurrency != lowest })
		p.Title.Text = fmt.Sprintf("%s latency CDF, concurrency %d", rows[0].Op, lowest)
	} else {
		p.Title.Text = "control-plane latency CDF"
	}
	for i, r := range rows {
		if len(r.samples) == 0 {
			continue
		}
		line, err := plotter.NewLine(cdf(r))
		if err != nil {
			return nil, err
		}
		line.Color = plotutil.Color(i)
		line.Dashes = plotutil.Dashes(i / len(plotutil.DefaultColors)) // past the palette, dash
		line.Width = vg.Points(1.5)
		p.Add(line)
		label := size.Format(r.Size)
		if rep.Command != "transfer" {
			label = fmt.Sprintf("%s x%d", r.Op, r.Concurrency)
		}
		p.Legend.Add(label, line)
	}
	return p, nil
}

// cdf is the empirical CDF of a row's sorted samples in µs.
func cdf(r Row) plotter.XYs {
	n := len(r.samples)
	step := max(n/cdfPoints, 1)
	var xys plotter.XYs
	for i := 0; i < n; i += step {
		xys = append(xys, plotter.XY{X: micros(r.samples[i]), Y: float64(i+1) / float64(n)})
	}
	if (n-1)%step != 0 {
		xys = append(xys, plotter.XY{X: micros(r.samples[n-1]), Y: 1})
	}
	return xys
}
