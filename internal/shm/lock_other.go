//go:build !linux

package shm

// Blocks are shared through OFD locks, which only Linux has; no segment
// can be made elsewhere, so these are never reached with a real segment.

func lockRead(fd int, off, n int64) (bool, error)  { return false, ErrUnsupported }
func lockWrite(fd int, off, n int64) (bool, error) { return false, ErrUnsupported }
func unlock(fd int, off, n int64) error            { return ErrUnsupported }
func lockInWay(fd int, off, n int64) (from, to int64, held bool, err error) {
	return 0, 0, false, ErrUnsupported
}
func reopen(fd int) (int, error)                { return -1, ErrUnsupported }
func checkSealed(fd int) error                  { return ErrUnsupported }
func removeIfAbandoned(path string, id ID) bool { return true }
func statName(path string) (ID, bool)           { return ID{}, false }
