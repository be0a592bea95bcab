//go:build !(cgo && linux)

package cudastub

import "time"

// Active reports whether this process runs on the stand-in: never
// without cgo on Linux.
func Active() bool { return false }

func Contexts(ordinal int) int { return -1 }
func Allocs() int              { return -1 }
func Handles() int             { return -1 }
func Mappings() int            { return -1 }
func IPCOpened() int           { return -1 }
func Events() int              { return -1 }
func Syncs() int               { return -1 }
func Ops(ordinal int) int      { return -1 }
func Sticky(ordinal int) int   { return -1 }
func Physical(ordinal int) int { return -1 }

func SetMemory(bytes int64) { panic("cudastub: SetMemory in a process not on the stand-in") }

func SetDelay(d time.Duration) { panic("cudastub: SetDelay in a process not on the stand-in") }

func SetComputeMode(physical, mode int) {
	panic("cudastub: SetComputeMode in a process not on the stand-in")
}

func OwnFDs() []int { return nil }

func SideMemset(ptr uint64, n int64, v byte) int { return -1 }
