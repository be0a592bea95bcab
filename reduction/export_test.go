package reduction

// For the external tests: the fake driver the GPU tests run on, and its
// device that shares memory in slabs.
var (
	UseFakeGPU = useFakeGPU
	SlabGPU    = slabGPU
)
