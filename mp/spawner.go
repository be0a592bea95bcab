package mp

import (
	"os/exec"
	"runtime"
	"sync"
)

// The spawner thread. The kernel sends Pdeathsig when the thread that
// forked a child exits, not the process (golang/go#27505), and the Go
// runtime may end an OS thread at any time; so every worker is started
// from one goroutine that is locked to its OS thread and never returns.
var (
	spawnerOnce sync.Once
	spawnerReq  chan func()
)

// startOnSpawnerThread starts cmd from the spawner thread, which it
// starts first if need be, and returns Start's error.
func startOnSpawnerThread(cmd *exec.Cmd) error {
	spawnerOnce.Do(func() {
		spawnerReq = make(chan func())
		go spawner(spawnerReq)
	})
	errc := make(chan error, 1)
	spawnerReq <- func() { errc <- cmd.Start() }
	return <-errc
}

// spawner runs the functions of reqs, for the life of the process, on the
// OS thread it locks.
func spawner(reqs <-chan func()) {
	runtime.LockOSThread()
	for f := range reqs {
		f()
	}
}
