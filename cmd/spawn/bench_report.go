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

// floorKinds are the floors the table divides cases by, a column each.
var floorKinds = []string{"socket", "futex", "spin"}

// roundTripFloors name the round trip floors, by kind.
var roundTripFloors = map[string]string{
	"socket": "floor_roundtrip",
	"futex":  "floor_futex_roundtrip",
	"spin":   "floor_spin_roundtrip",
}

// floorOf names the floor cases that bound a case, by kind.
var floorOf = map[string]map[string]string{
	"roundtrip":    roundTripFloors,
	"first_share":  roundTripFloors,
	"stream":       {"socket": "floor_stream"},
	"stream_batch": {"socket": "floor_stream_batch"},
	// The lane carries the floors' messages: bounded by the same floors.
	"lane_roundtrip": roundTripFloors,
	"pipe_roundtrip": roundTripFloors,
	"pipe_stream":    {"socket": "floor_stream"},
	// A tensor by a pipe: each way, a shared 4 KiB tensor of the sender's.
	"pipe_tensor_roundtrip":    roundTripFloors,
	"pipe_tensor_stream":       {"socket": "floor_stream"},
	"pipe_tensor_stream_batch": {"socket": "floor_stream_batch"},
	"lane_stream":              {"socket": "floor_stream"},
	"lane_stream_batch":        {"socket": "floor_stream_batch"},
}

// vsFloor returns r over its floor of kind: its time over the floor's, or
// the floor's rate over its rate. It is 0 without that floor.
func vsFloor(r benchResult, kind string, rs []benchResult) float64 {
	name, ok := floorOf[r.Case][kind]
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
	header := []string{"strategy", "case", "device", "bytes", "p50", "p99", "per second", "held", "fds"}
	for _, k := range floorKinds {
		header = append(header, "x "+k)
	}
	t := newTable(w, header...)
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
		row := []string{r.Strategy, r.Case, deviceOf(r), formatBytes(r.Bytes), col(r.P50us, us), col(r.P99us, us),
			col(r.PerS, n), col(float64(r.Held), n), fds}
		for _, k := range floorKinds {
			row = append(row, col(vsFloor(r, k, rs), func(v float64) string { return fmt.Sprintf("%.2f", v) }))
		}
		t.row(row...)
	}
}
