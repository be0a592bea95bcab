package mp

import (
	"errors"
	"os"
	"strconv"
	"sync/atomic"

	"github.com/tensormp/tensormp/internal/sock"
)

// backstopFailures counts the failures that backstopFailing made.
var backstopFailures atomic.Int32

// A worker whose environment has TENSORMP_TEST_BACKSTOP_FAILS=n has its
// backstop's wait fail n times with an error of its own (as one whose
// receive cannot park fails) before it waits for real.
func init() {
	n, err := strconv.Atoi(os.Getenv("TENSORMP_TEST_BACKSTOP_FAILS"))
	if err != nil || n <= 0 {
		return
	}
	wait := backstopWait
	backstopWait = func(ctl *sock.Conn) error {
		if backstopFailures.Load() < int32(n) {
			backstopFailures.Add(1)
			return errors.New("a wait that failed, for a test")
		}
		return wait(ctl)
	}
}

// BackstopFailures returns how many times this worker's backstop wait
// failed for a test (see TENSORMP_TEST_BACKSTOP_FAILS).
func BackstopFailures() int { return int(backstopFailures.Load()) }

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
