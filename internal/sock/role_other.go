//go:build !linux

package sock

import "github.com/tensormp/tensormp/internal/fd"

// takeRole returns nil: without lanes, nobody holds a role.
func takeRole(f *fd.FD, b int64) (*fd.FD, error) { return nil, nil }
