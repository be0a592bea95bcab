package reduction

import (
	"errors"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// ErrMalformed is wrapped by every error for a received message that
// cannot be decoded for what it holds: bytes that are not one well-formed
// value, tensor metadata that is not well formed or does not fit the
// memory it names, descriptors that are not what the metadata says or
// that no tensor uses, a value of a type other than the one decoded into.
// A peer that errs, or lies, gets this error and takes nothing from the
// receiver; mp.ErrMalformed is the same error. A failure of the
// receiving machine (out of descriptors, of memory, of shared-memory
// space) does not wrap it: the sizes a message names are checked
// against the memory it sends before anything is mapped or allocated,
// so such a failure is the receiver's own.
var ErrMalformed = errors.New("malformed message")

// malformed returns err, a decode's failure, marked as the message's
// fault (ErrMalformed) unless it is the machine's (see local). Its text
// is err's.
func malformed(err error) error {
	if err == nil || errors.Is(err, ErrMalformed) || local(err) {
		return err
	}
	return malformedError{err}
}

// local reports whether err is a failure of the machine rather than of a
// message: no descriptor, memory (host or device) or shared-memory space
// left.
func local(err error) bool {
	return fd.OutOfDescriptors(err) || errors.Is(err, unix.ENOMEM) || errors.Is(err, unix.ENOSPC) || errors.Is(err, shm.ErrNoSpace)
}

// malformedError is a decode's failure that is the message's fault.
type malformedError struct{ err error }

func (e malformedError) Error() string   { return e.err.Error() }
func (e malformedError) Unwrap() []error { return []error{e.err, ErrMalformed} }
