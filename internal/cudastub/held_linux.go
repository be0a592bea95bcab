//go:build linux

package cudastub

import (
	"bufio"
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// The layout of a device's allocation table, dev<p>.tab: a header, then
// fixed entries (struct tab and struct tab_entry in c/libcuda.c).
const (
	tabMagic     = 0x3154425554534d54
	tabHeader    = 64
	tabEntrySize = 48
	tabEntries   = 4096
	tabSize      = tabHeader + tabEntrySize*tabEntries
)

// allocation is a used table entry: a range of its device's memory file.
type allocation struct{ off, span uint64 }

// memFile is a physical device's memory file and its allocations.
type memFile struct {
	dev, ino uint64
	allocs   []allocation
}

// Held returns how many bytes of device memory the processes pids hold
// between them now, each allocation counted once, as a GPU driver's
// accounting would show them: what their descriptors of a device's
// memory file hold locked (an exported descriptor, or a process's own
// state descriptor) and what they map. It works on any process of the
// machine the calling process plays (TMSTUB_DIR), and on dead ones (0);
// it returns -1 in a process where TMSTUB_DIR is unset.
func Held(pids ...int) int64 {
	dir := os.Getenv(EnvDir)
	if dir == "" {
		return -1
	}
	files := readMemFiles(dir)
	seen := map[[2]uint64]bool{}
	var bytes int64
	// count counts the allocations of device p that [lo, hi) touches.
	count := func(p int, lo, hi uint64) {
		for _, a := range files[p].allocs {
			k := [2]uint64{uint64(p), a.off}
			if a.off < hi && lo < a.off+a.span && !seen[k] {
				seen[k] = true
				bytes += int64(a.span)
			}
		}
	}
	byIno := func(dev, ino uint64) int {
		for p, f := range files {
			if f.ino == ino && f.dev == dev {
				return p
			}
		}
		return -1
	}
	for _, pid := range pids {
		proc := "/proc/" + strconv.Itoa(pid)
		fds, _ := os.ReadDir(proc + "/fd")
		for _, fd := range fds {
			var st syscall.Stat_t
			if syscall.Stat(proc+"/fd/"+fd.Name(), &st) != nil {
				continue
			}
			p := byIno(uint64(st.Dev), st.Ino)
			if p < 0 {
				continue
			}
			for _, r := range lockedRanges(proc + "/fdinfo/" + fd.Name()) {
				count(p, r[0], r[1])
			}
		}
		maps, err := os.Open(proc + "/maps")
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(maps)
		for sc.Scan() {
			// start-end perms offset major:minor inode path
			f := strings.Fields(sc.Text())
			if len(f) < 6 {
				continue
			}
			lohi := strings.SplitN(f[0], "-", 2)
			mm := strings.SplitN(f[3], ":", 2)
			if len(lohi) != 2 || len(mm) != 2 {
				continue
			}
			lo, err1 := strconv.ParseUint(lohi[0], 16, 64)
			hi, err2 := strconv.ParseUint(lohi[1], 16, 64)
			off, err3 := strconv.ParseUint(f[2], 16, 64)
			major, err4 := strconv.ParseUint(mm[0], 16, 32)
			minor, err5 := strconv.ParseUint(mm[1], 16, 32)
			ino, err6 := strconv.ParseUint(f[4], 10, 64)
			if err1 != nil || err2 != nil || err3 != nil || err4 != nil || err5 != nil || err6 != nil {
				continue
			}
			if p := byIno(unix.Mkdev(uint32(major), uint32(minor)), ino); p >= 0 {
				count(p, off, off+(hi-lo))
			}
		}
		_ = maps.Close()
	}
	return bytes
}

// lockedRanges returns the byte ranges [start, end) that the open file
// description behind a descriptor holds record locks on, from its fdinfo:
// "lock:	1: OFDLCK ADVISORY  READ -1 fe:00:1234 4096 12287".
func lockedRanges(fdinfo string) [][2]uint64 {
	data, err := os.ReadFile(fdinfo)
	if err != nil {
		return nil
	}
	var ranges [][2]uint64
	for line := range strings.Lines(string(data)) {
		rest, ok := strings.CutPrefix(line, "lock:")
		if !ok || strings.Contains(rest, "->") {
			continue // not a lock, or a waiter
		}
		f := strings.Fields(rest)
		if len(f) < 8 || (f[1] != "OFDLCK" && f[1] != "POSIX") {
			continue
		}
		start, err := strconv.ParseUint(f[len(f)-2], 10, 64)
		if err != nil {
			continue
		}
		end := uint64(math.MaxUint64)
		if f[len(f)-1] != "EOF" {
			e, err := strconv.ParseUint(f[len(f)-1], 10, 64)
			if err != nil {
				continue
			}
			end = e + 1
		}
		ranges = append(ranges, [2]uint64{start, end})
	}
	return ranges
}

// readMemFiles reads the state directory's device memory files and
// their tables, indexed by physical device.
func readMemFiles(dir string) map[int]memFile {
	files := map[int]memFile{}
	names, _ := filepath.Glob(filepath.Join(dir, "dev*.mem"))
	for _, name := range names {
		p, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(filepath.Base(name), "dev"), ".mem"))
		if err != nil {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat(name, &st) != nil {
			continue
		}
		files[p] = memFile{dev: uint64(st.Dev), ino: st.Ino, allocs: readTable(filepath.Join(dir, "dev"+strconv.Itoa(p)+".tab"))}
	}
	return files
}

// readTable returns the used entries of an allocation table, read under
// a shared lock (writers hold it exclusive).
func readTable(path string) []allocation {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	for {
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_SH); err != syscall.EINTR {
			break
		}
	}
	buf := make([]byte, tabSize)
	n, _ := f.ReadAt(buf, 0)
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	if n < tabSize || binary.LittleEndian.Uint64(buf) != tabMagic {
		return nil
	}
	var allocs []allocation
	for i := range tabEntries {
		e := buf[tabHeader+i*tabEntrySize:]
		if binary.LittleEndian.Uint32(e[36:]) != 0 { // used
			allocs = append(allocs, allocation{off: binary.LittleEndian.Uint64(e), span: binary.LittleEndian.Uint64(e[8:])})
		}
	}
	return allocs
}
