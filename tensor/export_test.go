package tensor

// Armed returns how many storages the safety net holds.
func Armed() int { return safety.len() }

// Young reports whether r still holds its Storage strongly.
func Young(r *StorageRef) bool { return r.young.Load() != nil }
