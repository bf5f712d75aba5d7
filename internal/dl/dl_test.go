package dl

import (
	"errors"
	"strings"
	"testing"
)

// libc is on every machine that runs ferry, so the real dlopen/dlsym path
// is exercised here whether or not a GPU driver is present.
const libc = "libc.so.6"

func TestOpenMissingLibraryNamesItAndTheReason(t *testing.T) {
	_, err := Open("libferry-no-such-library.so.1")
	var de *Error
	if !errors.As(err, &de) {
		t.Fatalf("want *dl.Error, got %v", err)
	}
	if de.Op != "open" || de.Library != "libferry-no-such-library.so.1" {
		t.Fatalf("wrong fields: %+v", de)
	}
	for _, want := range []string{"libferry-no-such-library.so.1", "cannot open shared object file"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("error %q does not say %q", err, want)
		}
	}
}

func TestSymFindsRealSymbolsAndNamesMissingOnes(t *testing.T) {
	lib, err := Open(libc)
	if err != nil {
		t.Fatal(err)
	}
	defer lib.Close()
	if lib.Name() != libc {
		t.Fatalf("Name() = %q", lib.Name())
	}
	for _, name := range []string{"strlen", "dlopen", "getpid"} {
		p, err := lib.Sym(name)
		if err != nil || p == nil {
			t.Fatalf("Sym(%s) = %v, %v", name, p, err)
		}
	}
	_, err = lib.Sym("ferry_no_such_symbol")
	var de *Error
	if !errors.As(err, &de) || de.Op != "symbol" || de.Symbol != "ferry_no_such_symbol" {
		t.Fatalf("want a symbol error naming ferry_no_such_symbol, got %v", err)
	}
	if !strings.Contains(err.Error(), "undefined symbol") || !strings.Contains(err.Error(), libc) {
		t.Fatalf("error %q does not carry dlerror's reason and the library", err)
	}
}

func TestClosedLibraryRefusesLookups(t *testing.T) {
	lib, err := Open(libc)
	if err != nil {
		t.Fatal(err)
	}
	if err := lib.Close(); err != nil {
		t.Fatal(err)
	}
	if err := lib.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := lib.Sym("strlen"); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("Sym after Close = %v, want a 'closed' error", err)
	}
}
