//go:build linux

package dist

import (
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/mmapalloc"
)

// shmFree returns the bytes free in the shared-memory directory, the
// tmpfs (RAM) received bodies are taken from.
func shmFree() (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(mmapalloc.Dir(), &st); err != nil {
		return 0, err
	}
	return st.Bavail * uint64(st.Bsize), nil
}
