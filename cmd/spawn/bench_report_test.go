package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBenchTableFloors: the table divides the round trips by each round
// trip floor of their strategy and size, the streams by the socket's
// alone, and says "-" where a floor was not measured.
func TestBenchTableFloors(t *testing.T) {
	fd := func(c string, bytes int64, p50, perS float64) benchResult {
		return benchResult{Strategy: "file_descriptor", Case: c, Bytes: bytes, P50us: p50, P99us: p50, PerS: perS}
	}
	rs := []benchResult{
		fd("floor_roundtrip", 4096, 10, 0), fd("floor_futex_roundtrip", 4096, 5, 0), fd("floor_spin_roundtrip", 4096, 0.5, 0),
		fd("roundtrip", 4096, 20, 0), fd("first_share", 4096, 40, 0),
		fd("floor_roundtrip", 1<<20, 8, 0), fd("floor_futex_roundtrip", 1<<20, 4, 0), // no spin floor
		fd("roundtrip", 1<<20, 16, 0),
		fd("floor_stream", 4096, 0, 400), fd("stream", 4096, 0, 100),
		{Strategy: "file_system", Case: "roundtrip", Bytes: 4096, P50us: 30}, // no floor of its strategy
	}
	var out bytes.Buffer
	printBenchTable(&out, rs)
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, len(rs)+1)
	header := strings.Fields(lines[0])
	assert.Equal(t, []string{"fds", "x", "socket", "x", "futex", "x", "spin"}, header[len(header)-7:])
	want := [][3]string{
		{"-", "-", "-"}, {"-", "-", "-"}, {"-", "-", "-"},
		{"2.00", "4.00", "40.00"}, {"4.00", "8.00", "80.00"},
		{"-", "-", "-"}, {"-", "-", "-"},
		{"2.00", "4.00", "-"},
		{"-", "-", "-"}, {"4.00", "-", "-"},
		{"-", "-", "-"},
	}
	for i, w := range want {
		f := strings.Fields(lines[i+1])
		assert.Equal(t, w[:], f[len(f)-3:], "%s", lines[i+1])
	}
}
