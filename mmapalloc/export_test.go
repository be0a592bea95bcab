package mmapalloc

// SetRefsForTest overwrites a RefCount segment's shared reference count.
func SetRefsForTest(a *Allocation, n int32) { a.hdr().refs.Store(n) }
