package tensor

// Armed returns how many storages the safety net holds.
func Armed() int { return safety.len() }

// Young reports whether r still holds its Storage strongly.
func Young(r *StorageRef) bool { return r.young.Load() != nil }

// Sweep runs one sweep of the safety net now, as the runtime does after
// a collection.
func Sweep() { safety.sweep() }

// Sweeps returns how many sweeps of the safety net have begun.
func Sweeps() uint32 { return safety.sweeps.Load() }
