package cuda

import (
	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/shm"
)

// For the tests: what package reduction reaches through the Sharer, on a
// Runtime of the test's choosing.

func (b *Buffer) Export() (gpushare.Handle, error)              { return b.exportIPC() }
func (r *Runtime) Import(h gpushare.Handle) (*Buffer, error)    { return r.importIPC(h) }
func (b *Buffer) Share() (sh gpushare.Slab, ok bool, err error) { return b.share() }

func (r *Runtime) ImportBlock(dev int, blk *shm.Block, size int64, memFD int) (*Buffer, error) {
	return r.importBlock(dev, blk, size, memFD)
}

// NewTestRuntime returns a Runtime of its own on the process's driver,
// the stand-in's in the tests; with legacy, every device shares by
// legacy CUDA IPC. t's cleanup closes it.
func NewTestRuntime(t interface{ Cleanup(func()) }, legacy bool) *Runtime {
	d, err := load()
	if err != nil {
		panic(err)
	}
	r := newRuntime(d)
	r.legacy = legacy
	t.Cleanup(r.Close)
	return r
}
