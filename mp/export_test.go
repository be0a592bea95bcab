package mp

import (
	"errors"
	"os"
	"strconv"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/sock"
)

// BackstopFailsEnv, in a process of this test binary's environment, as
// BackstopFailsEnv=n, makes its backstop's wait fail n times with an
// error of its own (as one whose receive cannot park fails) before it
// waits for real; backstopFailures counts those failures.
const BackstopFailsEnv = "TENSORMP_TEST_BACKSTOP_FAILS"

var backstopFailures atomic.Int64

func init() {
	n, err := strconv.ParseInt(os.Getenv(BackstopFailsEnv), 10, 64)
	if err != nil || n <= 0 {
		return
	}
	wait := backstopWait
	backstopWait = func(ctl *sock.Conn) error {
		if backstopFailures.Load() < n {
			backstopFailures.Add(1)
			return errors.New("a wait that failed, for a test")
		}
		return wait(ctl)
	}
}

// BackstopFailures returns how many times this worker's backstop wait
// failed for a test (see BackstopFailsEnv).
func BackstopFailures() int { return int(backstopFailures.Load()) }

// ShutControlReads shuts the reading side of w's control socket, as a
// parent gone ends it: the worker's backstop, waiting there, sees the
// socket's end.
func ShutControlReads(w *Worker) error {
	d, err := w.ctl.Dup()
	if err != nil {
		return err
	}
	defer d.Close()
	return unix.Shutdown(d.Num(), unix.SHUT_RD)
}

// Waiting returns how many calls of this process wait on q now: Gets for
// a message, and Puts for room (in the socket, or for a place).
func Waiting(q *Queue) (gets, puts int) {
	gets = q.gets.Waiting()
	puts = q.puts.Waiting()
	if q.places != nil {
		puts += q.places.Waiting()
	}
	return gets, puts
}

// PoolHeld returns how many chunks each of p's workers holds now: given
// to it, not yet answered.
func PoolHeld(p *Pool) []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	held := make([]int, len(p.workers))
	for i, s := range p.workers {
		held[i] = len(s.held)
	}
	return held
}
