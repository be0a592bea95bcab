package leftover

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"strconv"
	"syscall"
)

// Dead reports whether no live process has pid now: none has it, or a
// zombie does (dead, waiting to be reaped), or the process found was
// reaped as its state was read. A process whose state cannot be read
// otherwise counts as live.
func Dead(pid int) bool {
	if pid <= 0 {
		return false
	}
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
		// ESRCH: the process the open found was reaped before the read.
		// A process that has pid now took it after the open, so after
		// anything the caller listed before calling (see the package
		// comment): it made none of that.
		return true
	}
	if err != nil {
		return false
	}
	// The state follows the command name, which may hold spaces and
	// parentheses: it comes after the last ')'.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return false
	}
	switch stat[i+2] {
	case 'Z', 'X':
		return true
	}
	return false
}
