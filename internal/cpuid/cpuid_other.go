//go:build !amd64

package cpuid

// Has reports false: there is no CPUID here.
func Has(leaf, sub uint32, reg Reg, bit int) bool { return false }
