// Package strategy holds the process-wide sharing strategy: how a CPU
// tensor's shared memory is named when it crosses to another process.
//
// Under FileDescriptor (the Linux default) a segment's name is unlinked as
// soon as it is created and the segment travels as a file descriptor
// passed with SCM_RIGHTS: nothing is ever left in the shared-memory
// directory. Under FileSystem a segment travels by name and carries a
// reference count; the last process to release it unlinks it. The value is
// seeded from TENSORMP_SHARING_STRATEGY at start-up, which is how a spawned
// worker inherits its parent's strategy.
package strategy

import (
	"fmt"
	"os"
	"strings"
	"sync/atomic"
)

// Strategy names a way of sharing CPU tensors between processes.
type Strategy string

// The sharing strategies.
const (
	FileDescriptor Strategy = "file_descriptor"
	FileSystem     Strategy = "file_system"
)

// EnvVar is the environment variable that seeds the process strategy.
const EnvVar = "TENSORMP_SHARING_STRATEGY"

var all = []Strategy{FileDescriptor, FileSystem}

// current is 0 for FileDescriptor and 1 for FileSystem; an index, so that
// reading it is one atomic load.
var current atomic.Uint32

// envErr records a bad TENSORMP_SHARING_STRATEGY seen at start-up. It is
// written once during package initialisation and only read afterwards.
var envErr error

func init() {
	s := platformDefault
	if v, ok := os.LookupEnv(EnvVar); ok && v != "" {
		parsed, err := Parse(v)
		if err != nil {
			envErr = fmt.Errorf("%s: %w", EnvVar, err)
		} else {
			s = parsed
		}
	}
	current.Store(index(s))
}

func index(s Strategy) uint32 {
	if s == FileSystem {
		return 1
	}
	return 0
}

// All returns the strategies this build knows, the default first.
func All() []Strategy { return []Strategy{platformDefault, other(platformDefault)} }

func other(s Strategy) Strategy {
	if s == FileSystem {
		return FileDescriptor
	}
	return FileSystem
}

// Parse turns a strategy's name into a Strategy. An unknown name is an
// error that lists the valid ones.
func Parse(name string) (Strategy, error) {
	for _, s := range all {
		if string(s) == name {
			return s, nil
		}
	}
	names := make([]string, len(all))
	for i, s := range all {
		names[i] = string(s)
	}
	return "", fmt.Errorf("strategy: unknown sharing strategy %q (valid: %s)", name, strings.Join(names, ", "))
}

// Valid reports whether s is one of All.
func (s Strategy) Valid() bool { return s == FileDescriptor || s == FileSystem }

// String returns the strategy's name.
func (s Strategy) String() string { return string(s) }

// Get returns the process's current strategy.
func Get() Strategy { return all[current.Load()] }

// Set changes the process's strategy. Tensors already shared keep the
// segment they have; the next tensor shared uses s.
func Set(s Strategy) error {
	if !s.Valid() {
		_, err := Parse(string(s))
		return err
	}
	current.Store(index(s))
	return nil
}

// EnvError returns the error found in TENSORMP_SHARING_STRATEGY at
// start-up, or nil. A bad value leaves the platform default in force;
// programs that want to refuse it check this once in main.
func EnvError() error { return envErr }
