//go:build !linux

package strategy

// platformDefault is file_system where tensormp has no descriptor passing.
const platformDefault = FileSystem
