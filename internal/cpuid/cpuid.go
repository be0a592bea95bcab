// Package cpuid asks the processor which instructions it has, with the
// CPUID instruction where there is one (amd64); elsewhere it says none.
// Packages sock and cacheline ask it before they use an instruction that
// not every processor of an architecture has.
package cpuid

// Reg is one of the four registers CPUID answers in.
type Reg int

// The registers, in the order CPUID fills them.
const (
	EAX Reg = iota
	EBX
	ECX
	EDX
)
