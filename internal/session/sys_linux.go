package session

import "golang.org/x/sys/unix"

// streamType makes close-on-exec SOCK_STREAM sockets.
const streamType = unix.SOCK_STREAM | unix.SOCK_CLOEXEC
