package device

import (
	"context"
	"fmt"
	"sync/atomic"
)

// The process default lives in one atomic word: the type in the high 32
// bits, the index in the low 32. Reading it is a single atomic load.
var defaultPlace atomic.Uint64

func pack(p Place) uint64   { return uint64(p.typ)<<32 | uint64(uint32(p.index)) }
func unpack(v uint64) Place { return Place{typ: Type(v >> 32), index: int32(uint32(v))} }

// Default returns the process default place: layer one of the device
// state. It is the CPU until SetDefault changes it.
func Default() Place { return unpack(defaultPlace.Load()) }

// SetDefault changes the process default place. Every goroutine whose
// context carries no scope sees the new place from then on. It returns an
// error for an invalid place.
func SetDefault(p Place) error {
	if !p.Valid() {
		return fmt.Errorf("device: cannot make invalid place %s the default", p)
	}
	defaultPlace.Store(pack(p))
	return nil
}

// scopeKey is the context key of layer two; a zero-size key makes the
// lookup allocation-free.
type scopeKey struct{}

// With returns a context whose scope is p: layer two of the device state.
// Current on the returned context, or on any context derived from it,
// reports p whatever the process default is. Other goroutines, holding
// other contexts, are not affected.
func With(ctx context.Context, p Place) context.Context {
	return context.WithValue(ctx, scopeKey{}, p)
}

// Current returns the place in effect for ctx: its innermost scope, or the
// process default when no scope was set. A nil ctx means no scope.
func Current(ctx context.Context) Place {
	if ctx != nil {
		if p, ok := ctx.Value(scopeKey{}).(Place); ok {
			return p
		}
	}
	return Default()
}

// Scoped reports whether ctx carries a scope of its own.
func Scoped(ctx context.Context) bool {
	if ctx == nil {
		return false
	}
	_, ok := ctx.Value(scopeKey{}).(Place)
	return ok
}

// Do runs fn with a context scoped to p: the Go form of a "with place:"
// block. The caller's context is never modified, so the outer place is in
// effect again once fn returns, and also when fn panics (the panic goes on
// to the caller). An invalid p is an error and fn does not run.
func Do(ctx context.Context, p Place, fn func(ctx context.Context) error) error {
	if !p.Valid() {
		return fmt.Errorf("device: cannot run under invalid place %s", p)
	}
	return fn(With(ctx, p))
}

// Bind returns a function that runs fn under p: the Go form of a place
// decorator. The returned function may be called from any goroutine, any
// number of times; each call gets a context scoped to p derived from the
// context it is given, and the caller's place is untouched.
//
//	load := device.Bind(device.CPU(), loadBatch)
//	batch, err := load(ctx, path)
func Bind[A, R any](p Place, fn func(ctx context.Context, arg A) (R, error)) func(context.Context, A) (R, error) {
	return func(ctx context.Context, arg A) (R, error) {
		if !p.Valid() {
			var zero R
			return zero, fmt.Errorf("device: cannot run under invalid place %s", p)
		}
		return fn(With(ctx, p), arg)
	}
}
