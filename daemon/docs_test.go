package daemon

import (
	"context"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/ferry-project/ferry/api"
)

// These tests hold the docs to what the daemon does: each fails when a
// line of docs/api.md names a metric or an error code the daemon does not
// have, or the daemon has one the docs do not name.

func readDoc(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", path))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// docMetric is one row of docs/api.md's metrics table.
type docMetric struct {
	typ    string
	labels []string
}

func docMetrics(t *testing.T) map[string]docMetric {
	row := regexp.MustCompile("(?m)^\\| `(ferry_[a-z0-9_]+)` \\| ([a-z]+) \\|\\s*([a-z_, ]*?)\\s*\\|")
	out := map[string]docMetric{}
	for _, m := range row.FindAllStringSubmatch(readDoc(t, "docs/api.md"), -1) {
		var labels []string
		for _, l := range strings.Split(m[3], ",") {
			if l = strings.TrimSpace(l); l != "" {
				labels = append(labels, l)
			}
		}
		slices.Sort(labels)
		if _, dup := out[m[1]]; dup {
			t.Errorf("docs/api.md documents %s twice", m[1])
		}
		out[m[1]] = docMetric{typ: m[2], labels: labels}
	}
	if len(out) == 0 {
		t.Fatal("docs/api.md has no metrics table")
	}
	return out
}

// exposed is what a scrape shows of ferry's own metrics, as the docs
// describe them.
func exposed(fams map[string]*dto.MetricFamily) map[string]docMetric {
	out := map[string]docMetric{}
	for name, f := range fams {
		if !strings.HasPrefix(name, "ferry_") {
			continue
		}
		var labels []string
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(labels, l.GetName()) {
					labels = append(labels, l.GetName())
				}
			}
		}
		slices.Sort(labels)
		out[name] = docMetric{typ: strings.ToLower(f.GetType().String()), labels: labels}
	}
	return out
}

func sameMetrics(t *testing.T, when string, doc, got map[string]docMetric) {
	t.Helper()
	for name, d := range doc {
		g, ok := got[name]
		switch {
		case !ok:
			t.Errorf("%s: docs/api.md documents %s, which /metrics does not show", when, name)
		case g.typ != d.typ || !slices.Equal(g.labels, d.labels):
			t.Errorf("%s: %s is a %s with labels %v; docs/api.md says a %s with labels %v", when, name, g.typ, g.labels, d.typ, d.labels)
		}
	}
	for name := range got {
		if _, ok := doc[name]; !ok {
			t.Errorf("%s: /metrics shows %s, which docs/api.md's metrics table does not document", when, name)
		}
	}
}

// TestMetricsMatchTheDocs: the table in docs/api.md is what /metrics
// shows from a daemon's start (every series there, zero-valued) and after
// a transfer, and every ferry_ metric the README or docs/ name exists.
func TestMetricsMatchTheDocs(t *testing.T) {
	doc := docMetrics(t)
	dir := t.TempDir()
	_, sc := serveTestDaemon(t, dir, "snd", nil)
	_, rc := serveTestDaemon(t, dir, "rcv", nil)
	sameMetrics(t, "at start", doc, exposed(scrapeSocket(t, sc)))

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := sc.Stage(ctx, "m1", []int64{4096}, "u8", strings.NewReader(strings.Repeat("x", 4096)), 4096); err != nil {
		t.Fatal(err)
	}
	slot, err := rc.Receive(ctx, "m1", 4096)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sc.Send(ctx, "m1", api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key}); err != nil {
		t.Fatal(err)
	}
	sameMetrics(t, "after a transfer, sender", doc, exposed(scrapeSocket(t, sc)))
	sameMetrics(t, "after a transfer, receiver", doc, exposed(scrapeSocket(t, rc)))

	mention := regexp.MustCompile(`\bferry_[a-z0-9_]*[a-z0-9]\b`)
	files, _ := filepath.Glob("../docs/*.md")
	for _, f := range append(files, "../README.md") {
		rel, _ := filepath.Rel("..", f)
		for _, name := range mention.FindAllString(readDoc(t, rel), -1) {
			if _, ok := doc[name]; !ok {
				t.Errorf("%s names %s, which is not a metric (docs/api.md's table)", rel, name)
			}
		}
	}
}

// TestErrorCodesMatchTheDocs: the error table in docs/api.md pairs each
// code with the status api.StatusOf gives it, and lists exactly the codes
// the daemon's code can answer with.
func TestErrorCodesMatchTheDocs(t *testing.T) {
	row := regexp.MustCompile("(?m)^\\| (\\d{3}) \\| `([a-z_]+)` \\|")
	documented := map[string]int{}
	for _, m := range row.FindAllStringSubmatch(readDoc(t, "docs/api.md"), -1) {
		status, _ := strconv.Atoi(m[1])
		if _, dup := documented[m[2]]; dup {
			t.Errorf("docs/api.md documents the code %s twice", m[2])
		}
		documented[m[2]] = status
	}
	used := codesUsed(t)
	for code, status := range documented {
		if !used[code] {
			t.Errorf("docs/api.md documents the error code %s, which the daemon never answers with", code)
		} else if want := api.StatusOf(code); want != status {
			t.Errorf("docs/api.md pairs %s with %d; the daemon answers it with %d", code, status, want)
		}
	}
	for code := range used {
		if _, ok := documented[code]; !ok {
			t.Errorf("the daemon answers with the error code %s, which docs/api.md's error table does not document", code)
		}
	}
}

// codesUsed reads the daemon's source for the api.Code constants it
// names, and api's for their values.
func codesUsed(t *testing.T) map[string]bool {
	fset := token.NewFileSet()
	values := map[string]string{}
	f, err := parser.ParseFile(fset, "../api/api.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	ast.Inspect(f, func(n ast.Node) bool {
		if vs, ok := n.(*ast.ValueSpec); ok && len(vs.Values) == len(vs.Names) {
			for i, name := range vs.Names {
				if lit, ok := vs.Values[i].(*ast.BasicLit); ok && strings.HasPrefix(name.Name, "Code") {
					values[name.Name], _ = strconv.Unquote(lit.Value)
				}
			}
		}
		return true
	})
	used := map[string]bool{}
	files, _ := filepath.Glob("*.go")
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if sel, ok := n.(*ast.SelectorExpr); ok {
				if x, ok := sel.X.(*ast.Ident); ok && x.Name == "api" && strings.HasPrefix(sel.Sel.Name, "Code") {
					v, known := values[sel.Sel.Name]
					if !known {
						t.Fatalf("%s names api.%s, which api/api.go does not define", path, sel.Sel.Name)
					}
					used[v] = true
				}
			}
			return true
		})
	}
	return used
}
