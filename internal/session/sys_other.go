//go:build !linux

package session

import "golang.org/x/sys/unix"

const streamType = unix.SOCK_STREAM
