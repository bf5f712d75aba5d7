// Package cudatest gives tests a GPU: a test that needs one skips, saying
// why, on a host without one, and fails instead when FERRY_REQUIRE_GPU=1
// (as make test-gpu sets it), so a GPU run cannot pass by skipping.
package cudatest

import (
	"errors"
	"os"
	"testing"

	"github.com/ferry-project/ferry/cuda"
)

// RequireEnv names the variable that turns a missing GPU into a failure.
const RequireEnv = "FERRY_REQUIRE_GPU"

// Required reports whether this run must have a GPU.
func Required() bool { return os.Getenv(RequireEnv) == "1" }

// Probe says why there is no usable GPU here, or nil when cuda:0 exists.
func Probe() error {
	drv, err := cuda.Load()
	if err != nil {
		return err
	}
	n, err := drv.DeviceCount()
	if err == nil && n == 0 {
		err = cuda.ErrNoDevice
	}
	return err
}

// Require skips the test, or fails it under FERRY_REQUIRE_GPU=1, unless
// cuda:0 exists.
func Require(tb testing.TB) {
	tb.Helper()
	if err := Probe(); err != nil {
		if (errors.Is(err, cuda.ErrNoDriver) || errors.Is(err, cuda.ErrNoDevice)) && !Required() {
			tb.Skipf("no GPU here (%v); make test-gpu runs this on a host with one", err)
		}
		tb.Fatalf("no usable GPU: %v", err)
	}
}

// Device opens cuda:0 for the test and closes it when the test ends.
func Device(tb testing.TB) *cuda.Device {
	tb.Helper()
	Require(tb)
	drv, err := cuda.Load()
	var dev *cuda.Device
	if err == nil {
		dev, err = drv.Open(0)
	}
	if err != nil {
		tb.Fatalf("opening cuda:0: %v", err)
	}
	tb.Cleanup(func() {
		if err := dev.Close(); err != nil {
			tb.Errorf("closing %v: %v", dev.Info(), err)
		}
	})
	return dev
}

// NeedsNoGPU skips a test of the behaviour on hosts without a GPU when
// this host has one.
func NeedsNoGPU(tb testing.TB) {
	tb.Helper()
	if Probe() == nil {
		tb.Skip("a GPU is present: this test is for hosts without one")
	}
}
