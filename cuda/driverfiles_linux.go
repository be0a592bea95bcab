//go:build cgo && linux

package cuda

import (
	"os"

	"github.com/tensormp/tensormp/internal/cudashm"
	"github.com/tensormp/tensormp/internal/leftover"
)

// A process killed, or one that exited without giving its context back,
// cannot remove its driver files: the process that learns of its death
// does (package mp, through package leftover).
func init() { leftover.Register(removeDriverFiles) }

// removeOwnDriverFiles removes the files libcuda made in /dev/shm for
// this process's interprocess events. The driver removes them itself only
// when the context that made them is destroyed, which never happens while
// another library in the process (PyTorch, say) still holds the device's
// primary context. It is for a process about to exit: an event handle
// sent earlier can no longer be opened once its file is gone.
func removeOwnDriverFiles(driver) {
	for _, f := range cudashm.Of(os.Getpid()) {
		_ = os.Remove(f)
	}
}

// removeDriverFiles removes the files the CUDA driver made in /dev/shm
// for the interprocess events of process pid, once no live process has
// pid. It lists them first and then checks (leftover.Dead), so that a
// process that took pid over after that one died keeps what it makes.
func removeDriverFiles(pid int) {
	files := cudashm.Of(pid)
	if len(files) == 0 || !leftover.Dead(pid) {
		return
	}
	for _, f := range files {
		_ = os.Remove(f)
	}
}
