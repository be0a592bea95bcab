package reduction

// For the external tests: the stand-in's device that shares memory in
// slabs (see gpuConfig).
var SlabGPU = slabGPU

// GPUConfig is the machine the tests play on the stand-in driver.
var GPUConfig = gpuConfig
