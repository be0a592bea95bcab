// Package drv is a thin binding to the CUDA driver calls, for the tests
// of package cudastub: it reaches libcuda.so.1 (the stand-in, in those
// tests) through dlopen, as package cuda does, and returns each call's
// CUresult as a plain int so that tests can check exact codes. Each
// function is the driver call it is named after, with the arguments the
// tests vary; the current context is per OS thread, so callers lock
// theirs. It exists only on Linux with cgo.
package drv
