// Package leakcheck finds what a test leaves behind: descriptors the
// process did not hold before (named with where they were taken, when
// fd.Trace is on), mappings of segments and lanes, this session's
// segments still present in the shared-memory directory, and goroutines
// still running.
// A Snapshot (Take) is what the process held at one moment, and its
// Leaks what it holds more once things settle: testmain.Run takes one
// around every test binary's tests, and Check around one test.
package leakcheck

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// settle is how long Check waits for cleanups (GC safety nets, exiting
// helpers) before it calls something a leak.
const settle = 3 * time.Second

var warmUp = sync.OnceFunc(func() {
	// The runtime opens its poller's descriptors on first use; make
	// that happen before any snapshot so they are not taken for leaks.
	r, w, err := os.Pipe()
	if err == nil {
		_ = r.Close()
		_ = w.Close()
	}
})

// Check snapshots what the process holds (Take) and registers a cleanup
// that fails t if, once the test is over and settled, it holds more: a
// descriptor open that was not before, a segment or a lane mapped more
// often than before, a segment of this session in the shared-memory
// directory that was not before, or a goroutine started since that is
// still running.
func Check(t testing.TB) {
	t.Helper()
	s, err := Take()
	if err != nil {
		t.Fatalf("leakcheck: %v", err)
	}
	t.Cleanup(func() {
		for _, leak := range s.Leaks(settle) {
			t.Errorf("leakcheck: %s", leak)
		}
	})
}

// A Snapshot is what the process holds at one moment: its descriptors,
// its mappings of segments, this session's segments and its goroutines.
type Snapshot struct {
	fds        map[int]string
	mappings   int
	segments   []string
	goroutines map[uint64]string
}

// Take snapshots what the process holds, after trimming the segments kept
// for reuse.
func Take() (Snapshot, error) {
	warmUp()
	shm.Trim()
	var s Snapshot
	var err error
	if s.fds, err = FDs(); err != nil {
		return s, err
	}
	if s.mappings, err = Mappings(); err != nil {
		return s, err
	}
	if s.segments, err = Segments(); err != nil {
		return s, err
	}
	s.goroutines = goroutines()
	return s, nil
}

// Leaks waits up to settle for what was taken since s to be given back
// (garbage-collection safety nets, exiting helpers, goroutines on their
// way out), and returns what still is, one line for each kind, with
// where a leaked descriptor was opened when fd.Trace was on.
func (s Snapshot) Leaks(settle time.Duration) []string {
	deadline := time.Now().Add(settle)
	for {
		runtime.GC()
		// Segments kept for reuse are not leaks; blocks still counted by
		// someone keep theirs from being trimmed.
		shm.Trim()
		leaks, err := s.leaks()
		if err != nil {
			return []string{err.Error()}
		}
		if len(leaks) == 0 || time.Now().After(deadline) {
			return leaks
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (s Snapshot) leaks() ([]string, error) {
	var out []string
	after, err := FDs()
	if err != nil {
		return nil, err
	}
	if leaked := newFDs(s.fds, after); len(leaked) > 0 {
		out = append(out, "descriptors leaked: "+strings.Join(leaked, ", "))
	}
	mappings, err := Mappings()
	if err != nil {
		return nil, err
	}
	if n := mappings - s.mappings; n > 0 {
		out = append(out, fmt.Sprintf("%d more segment mappings than before", n))
	}
	segs, err := Segments()
	if err != nil {
		return nil, err
	}
	segs = slices.DeleteFunc(segs, func(name string) bool { return slices.Contains(s.segments, name) })
	if len(segs) > 0 {
		var b strings.Builder
		fmt.Fprintf(&b, "segments left in %s: %s", shm.Dir(), strings.Join(segs, ", "))
		for _, name := range segs {
			fmt.Fprintf(&b, "\n\t%s: %s", name, describe(name))
		}
		out = append(out, b.String())
	}
	if g := newGoroutines(s.goroutines, goroutines()); len(g) > 0 {
		out = append(out, fmt.Sprintf("%d goroutines still running:\n\n%s", len(g), strings.Join(g, "\n\n")))
	}
	return out, nil
}

// FDs returns the process's open descriptors and what each refers to,
// leaving out the one FDs itself uses to read the list, and those the
// stand-in CUDA driver keeps for itself (cudastub.OwnFDs), as the real
// one keeps its device files.
func FDs() (map[int]string, error) {
	driver := cudastub.OwnFDs()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil, fmt.Errorf("listing descriptors: %w", err)
	}
	fds := make(map[int]string, len(entries))
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil || slices.Contains(driver, n) {
			continue
		}
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil {
			continue // the directory descriptor, closed by now
		}
		fds[n] = target
	}
	return fds, nil
}

// Count returns how many descriptors the process holds, leaving out
// those its packages keep for its life (fd.KeepForLife), which a package
// opens at its first use: a count taken before a test and one after
// differ only by what the test left open.
func Count() int {
	fds, err := FDs()
	if err != nil {
		return -1
	}
	n := 0
	for k := range fds {
		if !fd.Lifelong(k) {
			n++
		}
	}
	return n
}

func newFDs(before, after map[int]string) []string {
	var out []string
	for n, target := range after {
		if old, ok := before[n]; ok && old == target {
			continue
		}
		if strings.HasSuffix(target, "/fd") && strings.HasPrefix(target, "/proc/") || fd.Lifelong(n) {
			continue
		}
		line := fmt.Sprintf("%d -> %s", n, target)
		if origin, ok := fd.Origin(n); ok {
			line += ", opened at" + origin
		}
		out = append(out, line)
	}
	slices.Sort(out)
	return out
}

// Segments lists this session's segments present in the shared-memory
// directory.
func Segments() ([]string, error) {
	entries, err := os.ReadDir(shm.Dir())
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", shm.Dir(), err)
	}
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), shm.SessionPrefix()) {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// laneName is the name of a lane's memfd, as sock.CreateLane names it
// (which sock's TestLaneMappingIsCounted checks against Mappings).
const laneName = "tensormp-lane"

// Mappings counts the process's mappings of tensormp segments, unlinked
// ones included, and of lanes.
func Mappings() (int, error) {
	data, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return 0, fmt.Errorf("reading mappings: %w", err)
	}
	// A mapping whose slot table is protected apart from its data shows
	// as two areas: an area that continues the one before it (same file,
	// next address, next offset) is the same mapping. A memfd shows as
	// /memfd:tensormp_..., a lane's as /memfd:tensormp-lane.
	n := 0
	var prevEnd, prevOff uint64
	var prevFile string
	for line := range strings.Lines(string(data)) {
		f := strings.Fields(line) // range perms offset dev inode path
		if len(f) < 6 || !strings.Contains(line, "/"+shm.NamePrefix) && !strings.Contains(line, "/memfd:"+shm.NamePrefix) && !strings.Contains(line, "/memfd:"+laneName) {
			prevFile = ""
			continue
		}
		lo, hi, _ := strings.Cut(f[0], "-")
		start, _ := strconv.ParseUint(lo, 16, 64)
		end, _ := strconv.ParseUint(hi, 16, 64)
		off, _ := strconv.ParseUint(f[2], 16, 64)
		file := f[3] + " " + f[4]
		if file != prevFile || start != prevEnd || off != prevOff {
			n++
		}
		prevFile, prevEnd, prevOff = file, end, off+(end-start)
	}
	return n, nil
}

// describe says what keeps a segment left behind: its size, whether the
// process that made it lives, the kernel's locks on it and the processes
// that have it open or mapped.
func describe(name string) string {
	path := filepath.Join(shm.Dir(), name)
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return err.Error()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d bytes, inode %d", st.Size, st.Ino)
	if n, ok := shm.ParseName(name); ok && n.Pid > 0 {
		fmt.Fprintf(&b, "; its maker %d ", n.Pid)
		if unix.Kill(n.Pid, 0) == nil {
			b.WriteString("lives")
		} else {
			b.WriteString("is gone")
		}
	}
	ino := ":" + strconv.FormatUint(st.Ino, 10) + " "
	if locks, err := os.ReadFile("/proc/locks"); err == nil {
		for line := range strings.Lines(string(locks)) {
			if strings.Contains(line, ino) {
				fmt.Fprintf(&b, "; lock %s", strings.TrimSpace(line))
			}
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		var how []string
		fds, _ := os.ReadDir(p + "/fd")
		for _, fd := range fds {
			if target, err := os.Readlink(p + "/fd/" + fd.Name()); err == nil && strings.HasSuffix(target, name) {
				how = append(how, "fd "+fd.Name())
			}
		}
		if maps, err := os.ReadFile(p + "/maps"); err == nil && strings.Contains(string(maps), name) {
			how = append(how, "mapped")
		}
		if len(how) > 0 {
			fmt.Fprintf(&b, "; process %s: %s", filepath.Base(p), strings.Join(how, ", "))
		}
	}
	return b.String()
}

// Free gives back what a decoded value holds, for a test that decoded a
// hostile message and keeps none of it, or that made values it lets go of
// together: it releases every tensor and storage and closes every queue
// and pipe inside v, through slices, arrays, maps and pointers to them of
// any element type (what msgpack decodes into an any, and a test's own
// []*tensor.Tensor). Struct fields it does not look into.
func Free(v any) {
	switch x := v.(type) {
	case interface{ Release() error }:
		if !isNil(x) {
			_ = x.Release()
		}
		return
	case io.Closer:
		if !isNil(x) {
			_ = x.Close()
		}
		return
	}
	r := reflect.ValueOf(v)
	switch r.Kind() {
	case reflect.Slice, reflect.Array, reflect.Map:
		if holdsNothing(r.Type().Elem()) {
			return // bytes, numbers, strings: not walked one by one
		}
	}
	switch r.Kind() {
	case reflect.Slice, reflect.Array:
		for i := range r.Len() {
			free(r.Index(i))
		}
	case reflect.Map:
		for it := r.MapRange(); it.Next(); {
			free(it.Value())
		}
	case reflect.Pointer:
		if !r.IsNil() {
			free(r.Elem())
		}
	}
}

// holdsNothing reports whether a value of type t can hold nothing Free
// gives back: a boolean, a number or a string with no Release or Close
// of its own.
func holdsNothing(t reflect.Type) bool {
	k := t.Kind()
	if k != reflect.String && (k < reflect.Bool || k > reflect.Complex128) {
		return false
	}
	return !t.Implements(releaser) && !t.Implements(closer)
}

var (
	releaser = reflect.TypeFor[interface{ Release() error }]()
	closer   = reflect.TypeFor[io.Closer]()
)

// free is Free of an element of a value Free walks.
func free(r reflect.Value) {
	if r.CanInterface() {
		Free(r.Interface())
	}
}

// isNil reports whether v holds a nil pointer.
func isNil(v any) bool {
	r := reflect.ValueOf(v)
	return r.Kind() == reflect.Pointer && r.IsNil()
}
