package cuda

import (
	"errors"
	"strings"
	"testing"
)

// TestNoDriverIsAnError checks that a machine without libcuda.so.1 gets
// ErrNoDriver, not a crash or a build failure.
func TestNoDriverIsAnError(t *testing.T) {
	d, err := openLibcuda()
	if err == nil {
		n, _ := d.DeviceCount()
		t.Skipf("a CUDA driver is installed here (%d devices); the no-driver path cannot be observed", n)
	}
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("openLibcuda() = %v, want an error wrapping ErrNoDriver", err)
	}
	t.Log(err)
}

func TestErrorNamesTheCall(t *testing.T) {
	err := error(&Error{Call: "cuMemAlloc_v2", Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY", Msg: "out of memory"})
	want := "cuda: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
	if err.Error() != want {
		t.Fatalf("got %q, want %q", err, want)
	}
	fault := &Error{Call: "cuCtxSynchronize", Code: 700, Name: "CUDA_ERROR_ILLEGAL_ADDRESS", Msg: "an illegal memory access was encountered"}
	if !fault.Sticky() || !strings.Contains(fault.Error(), "broken for good") {
		t.Fatalf("%q is not reported as breaking the context", fault)
	}
}
