// Package apileak is a fixture of TestPublicAPICheckSeesInferredAndAliasedTypes:
// exported declarations that show a type of an internal package, and one
// that does not.
package apileak

import "github.com/tensormp/tensormp/internal/shm"

// Inferred's type, *shm.Pool, is inferred from its value.
var Inferred = shm.DefaultPool()

// Direct names the internal type.
func Direct() *shm.Pool { return nil }

// Laundered names it through an unexported alias of another file.
func Laundered() *pool { return nil }

// ErrFine holds an internal package's value of a public type, error.
var ErrFine error = shm.ErrNoExtent
