//go:build cgo && linux

package cuda

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// removeOwnDriverFiles removes the files libcuda made in /dev/shm for
// this process's interprocess events, named cuda.shm.<n>.<pid in hex>.<n>.
// The driver removes them itself only when the context that made them is
// destroyed, which never happens while another library in the process
// (PyTorch, say) still holds the device's primary context. It is for a
// process about to exit: an event handle sent earlier can no longer be
// opened once its file is gone. Other processes' files are never touched.
func removeOwnDriverFiles(d Driver) {
	if _, ok := d.(libcuda); !ok {
		return // a fake, or a driver a program brought: its files are its own
	}
	const dir = "/dev/shm"
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	pid := strconv.FormatInt(int64(os.Getpid()), 16)
	for _, e := range entries {
		f := strings.Split(e.Name(), ".")
		if len(f) == 5 && f[0] == "cuda" && f[1] == "shm" && f[3] == pid {
			_ = os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}
