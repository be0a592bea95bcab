//go:build linux

package sock_test

import (
	"context"
	"testing"
)

// BenchmarkLaneSendRecv is a lane's own cost per message of 64 bytes, in
// one process with nobody asleep: a Send and a Recv, no system call.
func BenchmarkLaneSendRecv(b *testing.B) {
	_, l := newLane(b)
	ctx := context.Background()
	alive := func() error { return nil }
	msg := make([]byte, 64)
	var buf []byte
	var err error
	b.ReportAllocs()
	for b.Loop() {
		if err := l.Send(ctx, msg, alive); err != nil {
			b.Fatal(err)
		}
		if buf, err = l.Recv(ctx, buf, alive); err != nil {
			b.Fatal(err)
		}
	}
}
