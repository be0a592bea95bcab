//go:build !amd64

package cacheline

import "unsafe"

// Nothing is asked for here.
func forWrite(unsafe.Pointer)            {}
func forRead(unsafe.Pointer)             {}
func writeAhead(unsafe.Pointer, uintptr) {}
