//go:build cgo && linux

package cuda

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/reexec"
)

func init() {
	// cuda.facts prints deviceFacts of device 0, a line each: its last
	// fact can break the process's context for good.
	reexec.Register("cuda.facts", func() int {
		d, err := load()
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		lines, err := deviceFacts(d, 0)
		for _, l := range lines {
			fmt.Println(l)
		}
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		return 0
	})
}

// TestGPUDeviceFacts prints, a line each, what the driver answers to the
// questions its documentation leaves open (see deviceFacts); tests/gpu.sh
// runs it on a GPU. On the stand-in, the answers are the strict ones it
// was built to give.
func TestGPUDeviceFacts(t *testing.T) {
	cmd, err := reexec.Command(context.Background(), "cuda.facts")
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		t.Log(l)
	}
	require.NoError(t, err)
	if !cudastub.Active() {
		return // a real driver's answers are reported, not judged
	}
	for _, want := range []string{
		"exported descriptor close-on-exec: false",
		"importing one's own export: works",
		"requestedHandleTypes 0, location type 1 id 0",
		"cuMemGetAddressRange of a host pointer: fails",
		"cuMemUnmap after the last context reference is released: fails: cuda: cuMemUnmap: CUDA_ERROR_INVALID_CONTEXT",
		"the next cuCtxSynchronize fails: cuda: cuCtxSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS",
	} {
		assert.Contains(t, string(out), want)
	}
}
