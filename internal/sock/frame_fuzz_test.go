//go:build linux

package sock

import (
	"bytes"
	"os"
	"slices"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// The kinds of descriptor a fuzzed message brings, one byte each.
const (
	kindPlain   = iota // an eventfd
	kindSealed         // a sealed segment of fuzzSpill bytes, as a spill is
	kindCarrier        // a carrier socket holding two eventfds
	kindMemfd          // an unsealed, writable segment of fuzzSpill bytes
	kindsCount
)

// fuzzSpill is the size of the segments a fuzzed message brings: the
// smallest payload that spills.
const fuzzSpill = maxInline + 1

// fuzzFDs makes the descriptors kinds names, owned by the caller.
func fuzzFDs(t testing.TB, kinds []byte) []int {
	t.Helper()
	var fds []int
	for _, k := range kinds {
		var f int
		var err error
		switch k % kindsCount {
		case kindPlain:
			f, err = unix.Eventfd(0, unix.EFD_CLOEXEC)
		case kindSealed:
			f, err = shm.SealedCopy(make([]byte, fuzzSpill))
		case kindCarrier:
			f, err = fuzzCarrier()
		case kindMemfd:
			if f, err = unix.MemfdCreate("fuzz", unix.MFD_CLOEXEC); err == nil {
				err = unix.Ftruncate(f, fuzzSpill)
			}
		}
		if err != nil {
			fd.CloseAll(fds)
			t.Fatalf("making a descriptor of kind %d: %v", k%kindsCount, err)
		}
		fds = append(fds, f)
	}
	return fds
}

// fuzzCarrier returns a carrier socket holding two eventfds, as frame
// makes one.
func fuzzCarrier() (int, error) {
	var two [2]int
	for i := range two {
		f, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		if err != nil {
			fd.CloseAll(two[:i])
			return -1, err
		}
		two[i] = f
	}
	defer fd.CloseAll(two[:])
	return sendCarried(two[:])
}

// openFDs returns the descriptors open in this process, but for the one
// it reads them through.
func openFDs(t testing.TB) []int {
	t.Helper()
	dir, err := os.Open("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	names, err := dir.Readdirnames(-1)
	if err != nil {
		t.Fatal(err)
	}
	var fds []int
	for _, name := range names {
		if n, err := strconv.Atoi(name); err == nil && n != int(dir.Fd()) {
			fds = append(fds, n)
		}
	}
	return fds
}

// leaked returns the descriptors open now that were not in before, but
// for keep.
func leaked(t testing.TB, before, keep []int) []int {
	var out []int
	for _, n := range openFDs(t) {
		if !slices.Contains(before, n) && !slices.Contains(keep, n) {
			out = append(out, n)
		}
	}
	return out
}

// FuzzUnframe feeds unframe what a peer may send: any bytes, with any
// descriptors of the kinds a frame holds. It must never panic; whatever
// it refuses is closed, and whatever it accepts is the caller's alone;
// and a message it accepts is one frame would make again: framed anew
// and unframed, it gives the same payload and as many descriptors.
func FuzzUnframe(f *testing.F) {
	// Frames the encoder makes: inline, with descriptors, spilled.
	for _, c := range []struct {
		data []byte
		nfds int
	}{
		{nil, 0},
		{[]byte("hello"), 0},
		{[]byte("with descriptors"), 3},
		{bytes.Repeat([]byte{7}, maxInline), 1},
		{bytes.Repeat([]byte{7}, fuzzSpill), 0},
		{bytes.Repeat([]byte{7}, fuzzSpill), 2},
	} {
		fds := fuzzFDs(f, make([]byte, c.nfds))
		h, payload, rights, made, err := frame(c.data, fds, nil)
		if err != nil {
			f.Fatal(err)
		}
		msg := make([]byte, headerLen, headerLen+len(payload))
		h.put(msg)
		msg = append(msg, payload...)
		kinds := make([]byte, len(rights))
		if h.flags&flagSpill != 0 {
			kinds[0] = kindSealed
		}
		f.Add(msg, kinds)
		fd.CloseAll(made)
		fd.CloseAll(fds)
	}
	// A carrier, as frame makes one for more than a message carries.
	carrier := make([]byte, headerLen)
	header{flags: flagCarrier, direct: 1, carried: 2}.put(carrier)
	f.Add(carrier, []byte{kindCarrier, kindPlain})
	spilledCarrier := make([]byte, headerLen)
	header{flags: flagSpill | flagCarrier, carried: 2, spilled: fuzzSpill}.put(spilledCarrier)
	f.Add(spilledCarrier, []byte{kindSealed, kindCarrier})
	// Hostile ones: truncated, miscounted, lying about their spill.
	hostile := func(h header, tail string) []byte {
		b := make([]byte, headerLen)
		h.put(b)
		return append(b, tail...)
	}
	f.Add(hostile(header{direct: 2}, "x"), []byte{kindPlain})
	f.Add(hostile(header{flags: flagSpill, spilled: fuzzSpill}, ""), []byte{})
	f.Add(hostile(header{flags: flagSpill, spilled: fuzzSpill}, "inline too"), []byte{kindSealed})
	f.Add(hostile(header{flags: flagSpill, spilled: 1 << 40}, ""), []byte{kindSealed})
	f.Add(hostile(header{flags: flagSpill, spilled: fuzzSpill}, ""), []byte{kindMemfd})
	f.Add(hostile(header{flags: flagSpill, spilled: 2 * fuzzSpill}, ""), []byte{kindSealed})
	f.Add(hostile(header{flags: flagCarrier, carried: 5}, ""), []byte{kindCarrier})
	f.Add(hostile(header{flags: flagCarrier, carried: 2}, ""), []byte{kindPlain})
	f.Add(hostile(header{carried: 3}, ""), []byte{})
	f.Add(hostile(header{flags: 0x80}, ""), []byte{})
	// A wake (no message), and ones that carry something all the same.
	f.Add(hostile(header{flags: flagWake}, ""), []byte{})
	f.Add(hostile(header{flags: flagWake}, "x"), []byte{})
	f.Add(hostile(header{flags: flagWake, direct: 1}, ""), []byte{kindPlain})
	f.Add(hostile(header{flags: flagWake | flagSpill, spilled: fuzzSpill}, ""), []byte{kindSealed})
	f.Add(hostile(header{}, ""), []byte{kindSealed, kindCarrier, kindMemfd})

	f.Fuzz(func(t *testing.T, msg, kinds []byte) {
		// What a receive hands unframe: a header at least, a message
		// buffer at most, and what one control message carries.
		if len(msg) < headerLen || len(msg) > headerLen+maxInline || len(kinds) > 8 {
			return
		}
		before := openFDs(t)
		rights := fuzzFDs(t, kinds)
		payload, fds, spill, _, err := unframe(msg, rights)
		if err != nil {
			fd.CloseAll(fds) // as a receive does
			if l := leaked(t, before, nil); len(l) > 0 {
				t.Fatalf("refused (%v), and left descriptors %v open", err, l)
			}
			return
		}
		got := slices.Clone(payload)
		defer func() {
			fd.CloseAll(fds)
			if spill != nil {
				_ = shm.Unmap(spill)
			}
			if l := leaked(t, before, nil); len(l) > 0 {
				t.Fatalf("accepted, and left descriptors %v open", l)
			}
		}()
		if l := leaked(t, before, fds); len(l) > 0 {
			t.Fatalf("accepted, and left descriptors %v open beside the %d it returned", l, len(fds))
		}

		// Framed anew and unframed, as a send and a receive would.
		h, payload2, rights2, made, err := frame(got, fds, nil)
		if err != nil {
			t.Fatalf("an accepted message of %d bytes and %d descriptors does not frame: %v", len(got), len(fds), err)
		}
		msg2 := make([]byte, headerLen, headerLen+len(payload2))
		h.put(msg2)
		msg2 = append(msg2, payload2...)
		sent := make([]int, len(rights2)) // what the kernel would give the receiver
		for i, r := range rights2 {
			if sent[i], err = unix.FcntlInt(uintptr(r), unix.F_DUPFD_CLOEXEC, 0); err != nil {
				t.Fatal(err)
			}
		}
		fd.CloseAll(made)
		back, fds2, spill2, _, err := unframe(msg2, sent)
		if err != nil {
			fd.CloseAll(fds2)
			t.Fatalf("a message framed anew is refused: %v", err)
		}
		defer fd.CloseAll(fds2)
		if spill2 != nil {
			defer shm.Unmap(spill2)
		}
		if !bytes.Equal(back, got) {
			t.Errorf("framed anew, %d payload bytes came back as %d others", len(got), len(back))
		}
		if len(fds2) != len(fds) {
			t.Errorf("framed anew, %d descriptors came back as %d", len(fds), len(fds2))
		}
	})
}
