package shm

import (
	"github.com/tensormp/tensormp/internal/fd"
)

// HoldByte takes the write lock on byte b of the file behind f, without
// waiting, through a description of the file of its own (see reopen),
// which it returns, the caller's: the lock lasts while that description
// is open, and the kernel drops it when the holder closes it or dies. It
// returns nil if another description holds the byte. Package sock's lanes
// keep their roles so.
func HoldByte(f *fd.FD, b int64) (*fd.FD, error) { return holdByte(f, b, lockWrite) }

// ShareByte is HoldByte with a read lock, which other descriptions may
// hold too: it fails only if one holds the byte's write lock.
func ShareByte(f *fd.FD, b int64) (*fd.FD, error) { return holdByte(f, b, lockRead) }

// ByteHeld reports whether a description of the file behind f other than
// f's own holds a lock on byte b.
func ByteHeld(f *fd.FD, b int64) (bool, error) {
	raw, err := f.Lend()
	if err != nil {
		return false, err
	}
	defer f.Return()
	_, _, held, err := lockInWay(raw, b, 1)
	return held, err
}

func holdByte(f *fd.FD, b int64, lock func(fd int, off, n int64) (bool, error)) (*fd.FD, error) {
	raw, err := f.Lend()
	if err != nil {
		return nil, err
	}
	defer f.Return()
	own, err := reopen(raw)
	if err != nil {
		return nil, err
	}
	held := fd.New(own)
	ok, err := lock(own, b, 1)
	if err != nil || !ok {
		_ = held.Close()
		return nil, err
	}
	return held, nil
}
