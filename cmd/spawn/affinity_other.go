//go:build !linux

package main

import "errors"

// CPUs are chosen on Linux only, where the bench's floors are measured.

func allowedCPUs() ([]int, error) { return nil, errors.ErrUnsupported }

func pinProcess([]int) (restore func() error, err error) { return nil, errors.ErrUnsupported }
