package main

import (
	"encoding/json"
	"fmt"
	"io"
	"time"
)

// resultLog keeps a bench's results, and prints each as it comes, a JSON
// object a line, with json.
type resultLog struct {
	rs   []benchResult
	json bool
	w    io.Writer
	cpus int // -cpus, given to each result
}

func (l *resultLog) emit(r benchResult) {
	r.CPUs = l.cpus
	l.rs = append(l.rs, r)
	if l.json {
		b, _ := json.Marshal(r)
		fmt.Fprintln(l.w, string(b))
	}
}

// benchResult is one line of -json output.
type benchResult struct {
	Strategy string  `json:"strategy"`
	Case     string  `json:"case"`
	Bytes    int64   `json:"bytes"`
	P50us    float64 `json:"p50_us,omitempty"`
	P99us    float64 `json:"p99_us,omitempty"`
	PerS     float64 `json:"per_s,omitempty"`
	Batch    int     `json:"batch,omitempty"` // tensors per message
	Held     int     `json:"held,omitempty"`  // tensors the receiver holds
	FDs      int     `json:"fds,omitempty"`
	Device   string  `json:"device,omitempty"` // where -python's tensors are, when not the CPU
	CPUs     int     `json:"cpus,omitempty"`   // -cpus: 1, both processes pinned to one CPU; 2, to one each
}

// floorOf names the floor case that bounds a case.
var floorOf = map[string]string{
	"roundtrip":    "floor_roundtrip",
	"first_share":  "floor_roundtrip",
	"stream":       "floor_stream",
	"stream_batch": "floor_stream_batch",
}

// vsFloor returns how many times its floor r costs: a time over the
// floor's, or the floor's rate over r's. It is 0 without a floor.
func vsFloor(r benchResult, rs []benchResult) float64 {
	name, ok := floorOf[r.Case]
	if !ok {
		return 0
	}
	for _, f := range rs {
		if f.Strategy != r.Strategy || f.Case != name || f.Bytes != r.Bytes {
			continue
		}
		switch {
		case r.P50us > 0 && f.P50us > 0:
			return r.P50us / f.P50us
		case r.PerS > 0 && f.PerS > 0:
			return f.PerS / r.PerS
		}
	}
	return 0
}

func printBenchTable(w io.Writer, rs []benchResult) {
	t := newTable(w, "strategy", "case", "device", "bytes", "p50", "p99", "per second", "held", "fds", "x floor")
	defer t.flush()
	for _, r := range rs {
		col := func(v float64, f func(float64) string) string {
			if v == 0 {
				return "-"
			}
			return f(v)
		}
		us := func(v float64) string { return formatDuration(time.Duration(v * 1000)) }
		n := func(v float64) string { return fmt.Sprintf("%.0f", v) }
		fds := "-"
		if r.Case == "fds" {
			fds = fmt.Sprint(r.FDs)
		}
		t.row(r.Strategy, r.Case, deviceOf(r), formatBytes(r.Bytes), col(r.P50us, us), col(r.P99us, us),
			col(r.PerS, n), col(float64(r.Held), n), fds, col(vsFloor(r, rs), func(v float64) string { return fmt.Sprintf("%.2f", v) }))
	}
}
