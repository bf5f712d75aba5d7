// Package dl loads a shared library at run time (dlopen) and looks up its
// symbols (dlsym), turning dlerror's text into Go errors. ferry loads
// libcuda.so.1 this way: most hosts that run ferryd have no NVIDIA driver,
// and a binary linked against the library would not even start there.
package dl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

// dlerror's message is per thread and the next dl call overwrites it, so
// each helper copies it out before returning to Go, where the goroutine may
// move to another thread.
static void ferry_dlerror(char *msg, size_t len) {
	const char *e = dlerror();
	snprintf(msg, len, "%s", e ? e : "unknown error");
}

static void *ferry_dlopen(const char *name, int flags, char *msg, size_t len) {
	dlerror();
	void *h = dlopen(name, flags);
	if (!h) ferry_dlerror(msg, len);
	return h;
}

// A symbol's value may legitimately be NULL, so failure is told by dlerror.
static void *ferry_dlsym(void *h, const char *name, int *failed, char *msg, size_t len) {
	dlerror();
	void *p = dlsym(h, name);
	const char *e = dlerror();
	*failed = e != NULL;
	if (e) snprintf(msg, len, "%s", e);
	return p;
}

static int ferry_dlclose(void *h, char *msg, size_t len) {
	dlerror();
	int rc = dlclose(h);
	if (rc) ferry_dlerror(msg, len);
	return rc;
}
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

// Error is a failed dlopen, dlsym or dlclose with dlerror's message.
type Error struct {
	Op      string // "open", "symbol" or "close"
	Library string
	Symbol  string // for "symbol"
	Message string // dlerror's text
}

func (e *Error) Error() string {
	if e.Op == "symbol" {
		return fmt.Sprintf("dlsym %s in %s: %s", e.Symbol, e.Library, e.Message)
	}
	return fmt.Sprintf("dl%s %s: %s", e.Op, e.Library, e.Message)
}

// Lib is an open shared library.
type Lib struct {
	name string

	mu sync.Mutex
	h  unsafe.Pointer // nil once closed
}

const msgLen = 512

// Open loads the library with every symbol bound now (RTLD_NOW), so a
// library that cannot be completed fails here rather than at a first call,
// and keeps its symbols out of the global namespace (RTLD_LOCAL).
func Open(name string) (*Lib, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var msg [msgLen]C.char
	h := C.ferry_dlopen(cname, C.RTLD_NOW|C.RTLD_LOCAL, &msg[0], msgLen)
	if h == nil {
		return nil, &Error{Op: "open", Library: name, Message: C.GoString(&msg[0])}
	}
	return &Lib{name: name, h: h}, nil
}

// Name is the name the library was opened by.
func (l *Lib) Name() string { return l.name }

// Sym returns the address of the named symbol.
func (l *Lib) Sym(name string) (unsafe.Pointer, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.h == nil {
		return nil, &Error{Op: "symbol", Library: l.name, Symbol: name, Message: "library is closed"}
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var msg [msgLen]C.char
	var failed C.int
	p := C.ferry_dlsym(l.h, cname, &failed, &msg[0], msgLen)
	if failed != 0 {
		return nil, &Error{Op: "symbol", Library: l.name, Symbol: name, Message: C.GoString(&msg[0])}
	}
	return p, nil
}

// Close unloads the library; later calls do nothing. Addresses obtained
// from Sym must not be used afterwards.
func (l *Lib) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.h == nil {
		return nil
	}
	var msg [msgLen]C.char
	rc := C.ferry_dlclose(l.h, &msg[0], msgLen)
	l.h = nil
	if rc != 0 {
		return &Error{Op: "close", Library: l.name, Message: C.GoString(&msg[0])}
	}
	return nil
}
