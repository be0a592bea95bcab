package tensor

import "github.com/tensormp/tensormp/device"

// Armed returns how many storages the safety net holds.
func Armed() int { return safety.len() }

// Young reports whether r still holds its Storage strongly.
func Young(r *StorageRef) bool { return r.young.Load() != nil }

// Sweep runs one sweep of the safety net now, as the runtime does after
// a collection.
func Sweep() { safety.sweep() }

// Sweeps returns how many sweeps of the safety net have begun.
func Sweeps() uint32 { return safety.sweeps.Load() }

// BareStorage allocates the heap objects NewStorage makes for a Storage
// of nbytes and sets their pointers as armAs does (the Storage with its
// spare Tensor, and its memory's record with the Storage's reference),
// and does nothing else: no memory, no slot in the safety net.
func BareStorage(nbytes int64) *Storage {
	s := allocStorage(device.CPU(), nbytes)
	am := &armedMemory{}
	am.ref.young.init(s)
	s.ref.init(&am.ref)
	s.mem.init(&am.memory)
	return s
}
