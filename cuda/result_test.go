package cuda

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestResultNamesAreKnownWithoutTheDriver(t *testing.T) {
	for r, want := range map[Result]string{
		Success:          "CUDA_SUCCESS",
		ErrorOutOfMemory: "CUDA_ERROR_OUT_OF_MEMORY",
		ErrorStubLibrary: "CUDA_ERROR_STUB_LIBRARY",
		ErrorNoDevice:    "CUDA_ERROR_NO_DEVICE",
		Result(101):      "CUDA_ERROR_INVALID_DEVICE",
		Result(801):      "CUDA_ERROR_NOT_SUPPORTED",
		201:              "CUDA_ERROR_INVALID_CONTEXT",
		999:              "CUDA_ERROR_UNKNOWN",
	} {
		if got := r.String(); got != want {
			t.Errorf("Result(%d).String() = %q, want %q", int32(r), got, want)
		}
		if loaded.Load() == nil && r.Error() != want {
			t.Errorf("Result(%d).Error() = %q without a driver, want %q", int32(r), r.Error(), want)
		}
	}
	if loaded.Load() == nil {
		if got := Result(4242).String(); got != "CUDA_ERROR_4242" {
			t.Errorf("an unknown code is named %q, want CUDA_ERROR_4242", got)
		}
	}
}

func TestErrorsSortIntoNoDriverNoDeviceAndTheRest(t *testing.T) {
	cases := []struct {
		r    Result
		kind error
	}{
		{ErrorStubLibrary, ErrNoDriver},
		{ErrorNoDevice, ErrNoDevice},
		{ErrorOutOfMemory, ErrCUDA},
		{Result(101), ErrCUDA},
		{Result(801), ErrCUDA},
	}
	for _, c := range cases {
		err := fmt.Errorf("cuda:0: %w", check("cuSomething", c.r))
		for _, kind := range []error{ErrNoDriver, ErrNoDevice, ErrCUDA} {
			if errors.Is(err, kind) != (kind == c.kind) {
				t.Errorf("%v: errors.Is(%v) = %v", c.r, kind, !(kind == c.kind))
			}
		}
		if !errors.Is(err, c.r) {
			t.Errorf("errors.Is(err, %v) is false: the Result must be matchable", c.r)
		}
		var ce *Error
		if !errors.As(err, &ce) || ce.Call != "cuSomething" || ce.Result != c.r {
			t.Errorf("errors.As: %+v", ce)
		}
		if !strings.Contains(err.Error(), "cuSomething: "+c.r.String()) {
			t.Errorf("message %q does not name the call and the code", err)
		}
	}
	if check("cuInit", Success) != nil {
		t.Error("check(CUDA_SUCCESS) is not nil")
	}
}
