package mp

// Waiting returns how many calls of this process wait on q now: Gets for
// a message, and Puts for room (in the socket, or for a place).
func Waiting(q *Queue) (gets, puts int) {
	gets = int(q.out.waiting.Load())
	puts = int(q.in.waiting.Load())
	if q.free != nil {
		puts += int(q.free.waiting.Load())
	}
	return gets, puts
}

// PipeWaiting returns how many calls of this process wait on p now.
func PipeWaiting(p *Pipe) int { return int(p.c.waiting.Load()) }

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
