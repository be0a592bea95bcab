//go:build !linux

package main

import "time"

// threadCPU returns the process's CPU time so far: without a per-thread
// count, the owner's own Put is counted with whatever ran beside it.
func threadCPU() time.Duration { return cpu() }
