package fd

import (
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// Tracing records, for every descriptor New takes while it is on, where
// it was taken, so that a report of a leaked descriptor can say (Origin).
// Test binaries turn it on (Trace); it costs a stack walk per New.
var tracing struct {
	on      atomic.Bool
	origins sync.Map // raw descriptor number → the stack of its New
}

// Trace turns tracing on for the life of the process.
func Trace() { tracing.on.Store(true) }

// Origin returns where the FD now holding raw was taken by New, if
// tracing was on then and it is still open.
func Origin(raw int) (string, bool) {
	s, ok := tracing.origins.Load(raw)
	if !ok {
		return "", false
	}
	return s.(string), true
}

// traced records the caller of New as raw's origin.
func traced(raw int) {
	if !tracing.on.Load() {
		return
	}
	pcs := make([]uintptr, 16)
	n := runtime.Callers(3, pcs) // above traced and New
	frames := runtime.CallersFrames(pcs[:n])
	var b strings.Builder
	for {
		f, more := frames.Next()
		if strings.HasPrefix(f.Function, "testing.") || strings.HasPrefix(f.Function, "runtime.") {
			break
		}
		b.WriteString("\n\t")
		b.WriteString(f.Function)
		b.WriteString(" (")
		b.WriteString(f.File)
		b.WriteString(":")
		b.WriteString(strconv.Itoa(f.Line))
		b.WriteString(")")
		if !more {
			break
		}
	}
	tracing.origins.Store(raw, b.String())
}

// untraced forgets raw's origin; it is called before raw is closed or
// handed over, while no other New can be given the number.
func untraced(raw int) {
	if tracing.on.Load() {
		tracing.origins.Delete(raw)
	}
}
