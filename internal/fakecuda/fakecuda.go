// Package fakecuda builds a stand-in libcuda.so.1 for tests on hosts
// without a GPU (testdata/fakecuda.c): it has the driver's real signatures
// and versioned names, so ferry's whole call path runs for real, through
// dlopen, in-process or in a ferryd started with LD_LIBRARY_PATH pointing
// at it. make test-gpu runs the same path on the real driver.
package fakecuda

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// Variants of the fake, as its source describes them.
const (
	Working  = ""
	NoDevice = "FAKE_NO_DEVICE"
	Stub     = "FAKE_STUB"
	Old      = "FAKE_OLD"
	Broken   = "FAKE_BROKEN"
)

// PrebuiltEnv names a directory holding the Working variant built
// already (libcuda.so.1), for a host without gcc: the soft-RoCE VM.
const PrebuiltEnv = "FERRY_FAKECUDA"

// Build compiles the variant into a new directory as libcuda.so.1 and
// returns that directory (for Working, $FERRY_FAKECUDA when set). The
// test skips, saying why, without gcc or the source (a test binary
// carried to another host).
func Build(tb testing.TB, variant string) string {
	tb.Helper()
	if dir := os.Getenv(PrebuiltEnv); dir != "" && variant == Working {
		return dir
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		tb.Skip("gcc is not installed (make deps installs it)")
	}
	_, self, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(self), "testdata", "fakecuda.c")
	if _, err := os.Stat(src); err != nil {
		tb.Skipf("the fake driver's source is not here: %v", err)
	}
	dir := tb.TempDir()
	args := []string{"-shared", "-fPIC", "-Wall", "-o", filepath.Join(dir, "libcuda.so.1"), src}
	if variant != "" {
		args = append(args, "-D"+variant)
	}
	if out, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
		tb.Fatalf("compiling the fake driver: %v\n%s", err, out)
	}
	return dir
}
