package cuda

import (
	"errors"

	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

func init() { gpushare.Register(sharer{}) }

// sharer sends and receives the buffers of the process's Runtime, for
// package reduction (see internal/gpushare).
type sharer struct{}

func (sharer) Share(b tensor.Buffer) (gpushare.Slab, bool, error) {
	buf, ok := b.(*Buffer)
	if !ok {
		return gpushare.Slab{}, false, gpushare.ErrForeign
	}
	return buf.share()
}

func (sharer) Export(b tensor.Buffer) (gpushare.Handle, error) {
	buf, ok := b.(*Buffer)
	if !ok {
		return gpushare.Handle{}, gpushare.ErrForeign
	}
	return buf.exportIPC()
}

func (sharer) Import(h gpushare.Handle) (tensor.Buffer, error) {
	r, err := Default()
	if err != nil {
		return nil, err
	}
	return nilIfFailed(r.importIPC(h))
}

func (sharer) ImportBlock(dev int, blk *shm.Block, size int64, memFD int) (tensor.Buffer, error) {
	r, err := Default()
	if err != nil {
		return nil, err
	}
	return nilIfFailed(r.importBlock(dev, blk, size, memFD))
}

func (sharer) SameSlab(b tensor.Buffer, memFD int) error {
	buf, ok := b.(*Buffer)
	if !ok || buf.block == nil {
		return gpushare.ErrForeign
	}
	s, _ := buf.block.Extent().(*slab)
	if s == nil {
		return errors.New("cuda: a buffer whose slab is gone")
	}
	return s.describedBy(memFD)
}

func (sharer) UUID(dev int) ([16]byte, error) {
	r, err := Default()
	if err != nil {
		return [16]byte{}, err
	}
	return r.UUID(dev)
}

func (sharer) Ordinal(uuid [16]byte) (int, error) {
	r, err := Default()
	if err != nil {
		return 0, err
	}
	return r.Ordinal(uuid)
}

// nilIfFailed returns b as a tensor.Buffer, or a nil interface when err is
// set: a nil *Buffer in an interface is not nil.
func nilIfFailed(b *Buffer, err error) (tensor.Buffer, error) {
	if err != nil {
		return nil, err
	}
	return b, nil
}
