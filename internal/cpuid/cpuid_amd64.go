package cpuid

// Has reports whether bit of register reg is set in CPUID's answer for
// leaf and subleaf sub; false for a leaf beyond the highest of its range
// (basic or extended) that the processor answers, for which an Intel
// processor answers with the highest basic leaf's bits.
func Has(leaf, sub uint32, reg Reg, bit int) bool { return has(cpuid, leaf, sub, reg, bit) }

// has is Has with ask for the instruction.
func has(ask func(leaf, sub uint32) (a, b, c, d uint32), leaf, sub uint32, reg Reg, bit int) bool {
	top, _, _, _ := ask(leaf&0x80000000, 0)
	if leaf > top {
		return false
	}
	a, b, c, d := ask(leaf, sub)
	return [4]uint32{a, b, c, d}[reg]&(1<<bit) != 0
}

// cpuid is the instruction, in cpuid_amd64.s.
func cpuid(leaf, sub uint32) (a, b, c, d uint32)
