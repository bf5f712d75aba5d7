package transport

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"
)

// pieces is a Body lending bufs in turn, then nothing; fail, when set,
// is its answer once bufs run out.
func pieces(fail error, bufs ...[]byte) Body {
	return func() ([]byte, error) {
		if len(bufs) == 0 {
			return nil, fail
		}
		b := bufs[0]
		bufs = bufs[1:]
		return b, nil
	}
}

// ReadBody fills a Body's pieces in order; a Body that lends more or
// fewer bytes than the write has, or fails to place them, is a
// PlaceError, and a stream that ends early is not.
func TestReadBody(t *testing.T) {
	boom := errors.New("copy failed")
	for _, c := range []struct {
		name  string
		sent  string
		n     uint64
		body  func() ([]byte, Body)
		place bool   // a PlaceError
		want  string // in the error; "" for none
	}{
		{"pieces", "0123456789", 10, func() ([]byte, Body) {
			all := make([]byte, 10)
			return all, pieces(nil, all[:4:4], all[4:])
		}, false, ""},
		{"whole", "0123456789", 10, func() ([]byte, Body) {
			a := make([]byte, 10)
			return a, Whole(a)
		}, false, ""},
		{"too much", "0123456789", 10, func() ([]byte, Body) { return nil, pieces(nil, make([]byte, 11)) }, true, "lent 11 bytes"},
		{"too little", "0123456789", 10, func() ([]byte, Body) { return nil, pieces(nil, make([]byte, 4)) }, true, "took 4 bytes of a 10-byte write"},
		{"not placed", "0123456789", 10, func() ([]byte, Body) { return nil, pieces(boom, make([]byte, 4)) }, true, "copy failed"},
		{"cut short", "01234", 10, func() ([]byte, Body) { return nil, pieces(nil, make([]byte, 10)) }, false, "read 5 of a 10-byte body"},
	} {
		t.Run(c.name, func(t *testing.T) {
			rx, tx := net.Pipe()
			defer rx.Close()
			go func() {
				tx.Write([]byte(c.sent))
				tx.Close()
			}()
			got, body := c.body()
			err := ReadBody(rx, c.n, body, 5*time.Second)
			if c.want == "" {
				if err != nil || string(got) != c.sent {
					t.Fatalf("read %q, %v; want %q", got, err, c.sent)
				}
				return
			}
			var pe *PlaceError
			if err == nil || !strings.Contains(err.Error(), c.want) || errors.As(err, &pe) != c.place {
				t.Fatalf("err %v (a PlaceError: %t); want one saying %q, a PlaceError: %t", err, errors.As(err, &pe), c.want, c.place)
			}
			if c.name == "not placed" && !errors.Is(err, boom) {
				t.Fatalf("%v does not wrap the Body's error", err)
			}
		})
	}
}
