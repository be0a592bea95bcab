// Package cudashm names the files the CUDA driver keeps in /dev/shm for
// a process's interprocess events and memory handles. The driver removes
// them only when the process gives its context back, so a process that
// is killed, or exits without doing so, leaves them; package cuda removes
// them for it (through package leftover), the stand-in driver of the
// tests (internal/cudastub) makes them as the real one does, and the
// tests look for them.
package cudashm

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Dir is where the driver keeps its files.
const Dir = "/dev/shm"

// Name returns the path of file n of process pid: cuda.shm.<n>.<pid in
// hex>.<n>. The driver names its files after its process's id as that
// process sees it: a process of another pid namespace sharing /dev/shm
// may name its files with the same number.
func Name(pid, n int) string {
	return filepath.Join(Dir, "cuda.shm.0."+strconv.FormatInt(int64(pid), 16)+"."+strconv.Itoa(n))
}

// Of lists the paths of process pid's files.
func Of(pid int) []string {
	entries, err := os.ReadDir(Dir)
	if err != nil {
		return nil
	}
	hex := strconv.FormatInt(int64(pid), 16)
	var files []string
	for _, e := range entries {
		if f := strings.Split(e.Name(), "."); len(f) == 5 && f[0] == "cuda" && f[1] == "shm" && f[3] == hex {
			files = append(files, filepath.Join(Dir, e.Name()))
		}
	}
	return files
}
