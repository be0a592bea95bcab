package main

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"

	"golang.org/x/sys/unix"
)

// allowedCPUs returns, in order, the CPUs the calling thread may run on:
// the process's, as long as nothing gave its threads different ones.
func allowedCPUs() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("sched_getaffinity: %w", err)
	}
	cpus := make([]int, 0, set.Count())
	for c := 0; len(cpus) < cap(cpus); c++ {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

// pinProcess runs every thread of this process on cpus alone, and so the
// threads they start later, and lowers GOMAXPROCS to as many, which the
// runtime would do itself within a second. restore gives every thread
// back the CPUs the calling thread had, and GOMAXPROCS its value: to the
// runtime's keeping again if it was the runtime's default, else as set.
func pinProcess(cpus []int) (restore func() error, err error) {
	if len(cpus) == 0 {
		return nil, errors.New("pinning to no CPU")
	}
	var was, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err != nil {
		return nil, fmt.Errorf("sched_getaffinity: %w", err)
	}
	for _, c := range cpus {
		set.Set(c)
	}
	if err := setProcessAffinity(&set); err != nil {
		return nil, errors.Join(fmt.Errorf("pinning to CPUs %v: %w", cpus, err), setProcessAffinity(&was))
	}
	procs := runtime.GOMAXPROCS(0)
	lowered := procs > len(cpus)
	if lowered {
		runtime.GOMAXPROCS(len(cpus))
	}
	return func() error {
		err := setProcessAffinity(&was)
		switch {
		case !lowered:
		case os.Getenv("GOMAXPROCS") == "" && procs == was.Count():
			// It was the runtime's own (as far as the CPUs tell: a
			// cgroup's quota may lower it): the runtime's again,
			// which it keeps up to date from now on.
			runtime.SetDefaultGOMAXPROCS()
		default:
			runtime.GOMAXPROCS(procs)
		}
		return err
	}, nil
}

// setProcessAffinity gives every thread of this process the CPUs of set.
// A thread started meanwhile by one not yet done shows in the next
// listing; the last finds none new, and threads started after it inherit
// set from their starter.
func setProcessAffinity(set *unix.CPUSet) error {
	done := map[int]bool{}
	for {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return fmt.Errorf("listing this process's threads: %w", err)
		}
		more := false
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil || done[tid] {
				continue
			}
			// A thread that exited since the listing (ESRCH) needs nothing.
			if err := unix.SchedSetaffinity(tid, set); err != nil && err != unix.ESRCH {
				return fmt.Errorf("sched_setaffinity of thread %d: %w", tid, err)
			}
			done[tid], more = true, true
		}
		if !more {
			return nil
		}
	}
}
