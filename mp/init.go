package mp

import (
	"fmt"
	"os"
	"strings"
	"sync/atomic"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/session"
	"github.com/tensormp/tensormp/internal/sock"
)

// initHint is the fix for a worker process whose main did not start with
// Init: without it, the worker would run the program's main again, and
// spawn again.
const initHint = session.InitHint

// initCalled is set by Init, in every process.
var initCalled atomic.Bool

// Init must be the first thing main (or TestMain) does. In a process that
// Spawn started, it runs the worker and exits; in a keeper process it
// keeps the session and exits; in the program's own process it returns.
//
// A worker process that reaches Spawn, NewQueue, NewPipe or StartSession
// without Init having run fails at once, and so does one whose worker
// was registered after Init: the parent's Join returns the reason.
func Init() {
	initCalled.Store(true)
	if name, ok := os.LookupEnv(reexec.EnvVar); ok && strings.HasPrefix(name, workerPrefix) && !reexec.Registered(name) {
		failSetup(fmt.Sprintf("no worker registered as %q when mp.Init ran: call mp.Register in an init function or before mp.Init in main", strings.TrimPrefix(name, workerPrefix)))
	}
	reexec.Main()
}

// checkInit fails a worker or keeper process that calls op before Init
// has run: it is running the program's main instead of its job, and would
// start workers and keepers of its own.
func checkInit(op string) {
	if initCalled.Load() {
		return
	}
	name, ok := os.LookupEnv(reexec.EnvVar)
	switch {
	case !ok:
	case name == session.KeeperName:
		session.FailKeeper(fmt.Sprintf("the session keeper reached %s before mp.Init ran: %s", op, initHint))
	case strings.HasPrefix(name, workerPrefix):
		failSetup(fmt.Sprintf("worker %q reached %s before mp.Init ran: %s", strings.TrimPrefix(name, workerPrefix), op, initHint))
	}
}

// failSetup reports why a worker process cannot run to its parent, on the
// control socket, and on stderr, and exits with code 2.
func failSetup(reason string) {
	fmt.Fprintf(os.Stderr, "tensormp: %s\n", reason)
	if ctl, err := sock.New(fd.New(ctlFD), "control"); err == nil {
		_ = report(ctl, result{Failed: true, Err: reason})
	}
	os.Exit(2)
}
