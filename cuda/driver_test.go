package cuda

import (
	"errors"
	"strings"
	"testing"
	"unsafe"

	"github.com/ferry-project/ferry/internal/dl"
)

func TestLoadOfAMissingLibraryIsErrNoDriverNamingIt(t *testing.T) {
	_, err := load("libcuda-ferry-missing.so.1")
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("want ErrNoDriver, got %v", err)
	}
	if errors.Is(err, ErrNoDevice) || errors.Is(err, ErrCUDA) {
		t.Fatalf("a missing library must be only ErrNoDriver: %v", err)
	}
	if !strings.Contains(err.Error(), "libcuda-ferry-missing.so.1") || !strings.Contains(err.Error(), "cannot open shared object file") {
		t.Fatalf("message %q does not name the library and dlerror's reason", err)
	}
}

// On a host without the NVIDIA driver (CI, this project's machines), Load
// itself must fail cleanly, not crash: the real libcuda.so.1 lookup.
func TestLoadWithoutADriverFailsCleanly(t *testing.T) {
	d, err := Load()
	if err == nil {
		t.Skipf("a CUDA driver is present here (CUDA %s): this test is for hosts without one", d.Version())
	}
	if !errors.Is(err, ErrNoDriver) && !errors.Is(err, ErrNoDevice) {
		t.Fatalf("want ErrNoDriver or ErrNoDevice, got %v", err)
	}
	if errors.Is(err, ErrNoDriver) && !strings.Contains(err.Error(), Library) {
		t.Fatalf("message %q does not name %s", err, Library)
	}
	if _, err2 := Load(); err2 != err {
		t.Fatalf("the second Load returned %v, want the first result again", err2)
	}
}

// resolve runs against libc, a real library, for real dlsym successes and
// misses.
func TestResolveFillsTheTableAndNamesEveryMissingSymbol(t *testing.T) {
	libc, err := dl.Open("libc.so.6")
	if err != nil {
		t.Fatal(err)
	}
	defer libc.Close()

	var strlen, getpid, optional unsafe.Pointer
	err = resolve(libc, []symbol{
		{names: []string{"strlen"}, dst: &strlen},
		{names: []string{"getpid_ferry_v9", "getpid"}, dst: &getpid}, // the first present name wins
		{names: []string{"ferry_optional_missing"}, optional: true, dst: &optional},
	})
	if err != nil {
		t.Fatal(err)
	}
	if strlen == nil || getpid == nil || optional != nil {
		t.Fatalf("strlen=%v getpid=%v optional=%v", strlen, getpid, optional)
	}
	if want, _ := libc.Sym("getpid"); getpid != want {
		t.Fatal("the fallback name was not the one resolved")
	}

	var a, b, c unsafe.Pointer
	err = resolve(libc, []symbol{
		{names: []string{"ferry_missing_a"}, dst: &a},
		{names: []string{"strlen"}, dst: &b},
		{names: []string{"ferry_missing_b_v2", "ferry_missing_b"}, dst: &c},
	})
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("want ErrNoDriver, got %v", err)
	}
	for _, want := range []string{"libc.so.6", "ferry_missing_a", "ferry_missing_b_v2 or ferry_missing_b", "newer"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q does not say %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "strlen") {
		t.Errorf("message %q names a symbol that was found", err)
	}
}

// The table is ferry's contract with the driver: the versioned names cuda.h
// maps the API to, each entry filling its own slot.
func TestSymbolTableUsesTheVersionedDriverNames(t *testing.T) {
	var s symbols
	table := s.table()
	seen := map[*unsafe.Pointer]bool{}
	names := map[string]bool{}
	for _, e := range table {
		if e.dst == nil || len(e.names) == 0 || seen[e.dst] {
			t.Fatalf("bad entry %+v", e)
		}
		seen[e.dst] = true
		for _, n := range e.names {
			names[n] = e.optional
		}
	}
	for _, want := range []string{
		"cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuDeviceTotalMem_v2",
		"cuDevicePrimaryCtxRelease_v2", "cuIpcOpenMemHandle_v2", "cuDeviceGetUuid_v2", "cuMemHostAlloc",
		"cuPointerSetAttribute", "cuIpcGetMemHandle", "cuDeviceGetPCIBusId",
	} {
		if opt, ok := names[want]; !ok || opt {
			t.Errorf("%s is not a required symbol of the table", want)
		}
	}
	if opt, ok := names["cuMemGetHandleForAddressRange"]; !ok || !opt {
		t.Error("cuMemGetHandleForAddressRange must be optional (drivers before CUDA 11.7 lack it)")
	}
	if unsafe.Sizeof(s) != uintptr(len(table))*unsafe.Sizeof(unsafe.Pointer(nil)) {
		t.Error("a field of symbols has no table entry")
	}
}

func TestFormatUUIDLikeNvidiaSMI(t *testing.T) {
	b := []byte{0x8f, 0x2e, 0x11, 0x0a, 0x3c, 0x4d, 0x5e, 0x6f, 0x70, 0x81, 0x92, 0xa3, 0xb4, 0xc5, 0xd6, 0xe7}
	if got, want := formatUUID(b), "GPU-8f2e110a-3c4d-5e6f-7081-92a3b4c5d6e7"; got != want {
		t.Fatalf("formatUUID = %q, want %q", got, want)
	}
}

func TestBusIDsAreWrittenAsSysfsNamesThem(t *testing.T) {
	for in, want := range map[string]string{
		"0000:3B:00.0":     "0000:3b:00.0",
		"00000000:3B:00.0": "0000:3b:00.0",
		"0001:c1:1f.7":     "0001:c1:1f.7",
		"garbage":          "garbage",
	} {
		if got := sysfsBusID(in); got != want {
			t.Errorf("sysfsBusID(%q) = %q, want %q", in, got, want)
		}
	}
}
