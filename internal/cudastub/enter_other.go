//go:build !linux

package cudastub

// Enter does nothing on systems other than Linux, where the stand-in
// cannot run: Active then reports false, and tests that need it skip.
func Enter(cfg Config) { _ = cfg }
