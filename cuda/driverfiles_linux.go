//go:build cgo && linux

package cuda

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/tensormp/tensormp/internal/leftover"
)

// A worker killed while it had GPU memory exported cannot remove its
// driver files: the process that reaps it does (package mp).
func init() { leftover.Register(removeDriverFiles) }

// removeOwnDriverFiles removes the files libcuda made in /dev/shm for
// this process's interprocess events. The driver removes them itself only
// when the context that made them is destroyed, which never happens while
// another library in the process (PyTorch, say) still holds the device's
// primary context. It is for a process about to exit: an event handle
// sent earlier can no longer be opened once its file is gone.
func removeOwnDriverFiles(d Driver) {
	if _, ok := d.(libcuda); !ok {
		return // a fake, or a driver a program brought: its files are its own
	}
	removeDriverFiles(os.Getpid())
}

// removeDriverFiles removes the files libcuda made in /dev/shm for the
// interprocess events of process pid, named cuda.shm.<n>.<pid in
// hex>.<n>: this process's, or a dead child's that is not yet reaped.
// Other processes' files are never touched.
func removeDriverFiles(pid int) {
	const dir = "/dev/shm"
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	hex := strconv.FormatInt(int64(pid), 16)
	for _, e := range entries {
		f := strings.Split(e.Name(), ".")
		if len(f) == 5 && f[0] == "cuda" && f[1] == "shm" && f[3] == hex {
			_ = os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}
