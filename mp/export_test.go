package mp

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
