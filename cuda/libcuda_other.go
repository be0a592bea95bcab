//go:build !cgo || !linux

package cuda

import "fmt"

func openLibcuda() (driver, error) {
	return nil, fmt.Errorf("%w: built without cgo or not on Linux", ErrNoDriver)
}

func removeOwnDriverFiles(driver) {}
