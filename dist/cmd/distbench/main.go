// Command distbench measures package dist between two processes over
// loopback (or the address given), beside two floors of the same path in
// the same run: raw TCP with 64 MiB writes, and gRPC, the engine dist
// rides, alone.
//
// Cases, all one way, parent receiving:
//
//	tcp       raw TCP, 64 MiB writes into a pre-faulted buffer
//	grpc      gRPC streams of -chunk byte messages, one on each of -conns
//	          connections, with dist's windows and buffers and no copy
//	          outside gRPC (grpc.go)
//	dist_put  the child Puts tensors on a queue the parent owns (by
//	          reference: the child copies each into an offer, the
//	          parent's Get pulls it)
//	dist_get  the parent Gets tensors from a queue the child owns
//
// per_s is bytes per second at the receiver, from its first byte to its
// last; cpu_s_per_gib is the CPU time of both processes (user + system)
// per GiB moved; ratio_of_tcp and ratio_of_grpc divide per_s by the
// floors'. The four cases run in turn -rounds times, and each figure is
// the median over the rounds (a ratio, the median of each round's own):
// on loopback one run's rates stray by a fifth from the next's, the
// floors' too. The grpc and dist cases start the clock after the first
// -warm tensors, once the connection is up and the shared-memory pools of
// both ends have grown to what the stream keeps in flight (the putter's
// offers and queue, the getter's destination blocks): the floor's
// buffers are faulted in before its clock starts too. The child's copies
// of its tensors into its own queue (dist_get) are not counted: they are
// the owner's local Put, not the transfer.
//
// Usage:
//
//	go run ./cmd/distbench [-bytes N] [-n reps] [-rounds N] [-warm N] [-chunk N] [-conns N] [-addr IP] [-json]
//	                       [-child-netns NS -child-addr IP]
//
// With -child-netns (as root) the child runs in network namespace NS
// (ip netns exec) and binds -child-addr: run distbench itself in the
// other end's namespace to measure across a veth pair.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/dist"
	"github.com/tensormp/tensormp/tensor"
)

// chunk is the record-batch size both ends use.
var chunk int

// warm is the number of tensors each dist case sends before its clock
// starts.
var warm int

// conns is the connections a pull (and the grpc floor) uses.
var conns int

// childNetns and childAddr place the child in another network namespace.
var childNetns, childAddr string

type result struct {
	Case       string  `json:"case"`
	Bytes      int     `json:"bytes"`
	PerS       float64 `json:"per_s"`
	CPUPerGiB  float64 `json:"cpu_s_per_gib"`
	RatioOfTCP float64 `json:"ratio_of_tcp,omitempty"`
	// RatioOfGRPC, for the dist cases, is PerS over the grpc case's.
	RatioOfGRPC float64 `json:"ratio_of_grpc,omitempty"`
	// Rounds is the number of rounds the figures are the medians of.
	Rounds int `json:"rounds"`
}

func main() {
	if os.Getenv(childEnv) != "" {
		os.Exit(child())
	}
	size := flag.Int("bytes", 64<<20, "tensor size in bytes")
	n := flag.Int("n", 16, "tensors per case")
	rounds := flag.Int("rounds", 5, "times every case is measured, in turn; each figure is the median")
	addr := flag.String("addr", "127.0.0.1", "the address both ends use")
	asJSON := flag.Bool("json", false, "one JSON object per line")
	flag.IntVar(&chunk, "chunk", dist.DefaultChunk, "bytes per record batch")
	flag.IntVar(&warm, "warm", 4, "tensors sent in each dist case before the clock starts")
	flag.IntVar(&conns, "conns", dist.DefaultPullConns, "connections a pull uses, and the grpc floor")
	flag.StringVar(&childNetns, "child-netns", "", "network namespace to run the child in (root)")
	flag.StringVar(&childAddr, "child-addr", "", "the child's address (default: -addr)")
	flag.Parse()
	if warm < 1 || *n <= warm {
		fmt.Fprintf(os.Stderr, "distbench: -warm must be at least 1 and less than -n (%d)\n", *n)
		os.Exit(2)
	}
	if *rounds < 1 {
		fmt.Fprintln(os.Stderr, "distbench: -rounds must be positive")
		os.Exit(2)
	}
	if conns < 1 || conns > dist.MaxPullConns {
		fmt.Fprintf(os.Stderr, "distbench: -conns must be 1 to %d\n", dist.MaxPullConns)
		os.Exit(2)
	}
	if err := run(*size, *n, *rounds, *addr, *asJSON); err != nil {
		fmt.Fprintln(os.Stderr, "distbench:", err)
		os.Exit(1)
	}
}

func run(size, n, rounds int, addr string, asJSON bool) error {
	var all [][]result
	for range rounds {
		rs, err := round(size, n, addr)
		if err != nil {
			return err
		}
		all = append(all, rs)
	}
	results := medians(all)
	if asJSON {
		enc := json.NewEncoder(os.Stdout)
		for _, r := range results {
			if err := enc.Encode(r); err != nil {
				return err
			}
		}
		return nil
	}
	fmt.Printf("medians of %d rounds\n", rounds)
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "case\tbytes\tMB/s\tCPU-s/GiB\tof tcp\tof grpc\t")
	percent := func(r float64) string {
		if r == 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f%%", 100*r)
	}
	for _, r := range results {
		fmt.Fprintf(w, "%s\t%d\t%.0f\t%.2f\t%s\t%s\t\n", r.Case, r.Bytes, r.PerS/1e6, r.CPUPerGiB, percent(r.RatioOfTCP), percent(r.RatioOfGRPC))
	}
	return w.Flush()
}

// round measures every case once, the floors first, and returns their
// results in that order, with each case's ratios to this round's floors.
func round(size, n int, addr string) ([]result, error) {
	tcp, err := benchTCP(size, n, addr)
	if err != nil {
		return nil, fmt.Errorf("tcp: %w", err)
	}
	grpcFloor, err := benchGRPC(size, n, addr)
	if err != nil {
		return nil, fmt.Errorf("grpc: %w", err)
	}
	grpcFloor.RatioOfTCP = grpcFloor.PerS / tcp.PerS
	results := []result{tcp, grpcFloor}
	for _, c := range []string{"dist_put", "dist_get"} {
		r, err := benchDist(c, size, n, addr)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", c, err)
		}
		r.RatioOfTCP = r.PerS / tcp.PerS
		r.RatioOfGRPC = r.PerS / grpcFloor.PerS
		results = append(results, r)
	}
	return results, nil
}

// medians returns each case's medians over rounds, which all list the
// same cases in the same order.
func medians(rounds [][]result) []result {
	out := make([]result, len(rounds[0]))
	for i := range out {
		median := func(f func(result) float64) float64 {
			vs := make([]float64, len(rounds))
			for k, rs := range rounds {
				vs[k] = f(rs[i])
			}
			slices.Sort(vs)
			m := len(vs) / 2
			if len(vs)%2 == 0 {
				return (vs[m-1] + vs[m]) / 2
			}
			return vs[m]
		}
		out[i] = result{
			Case:        rounds[0][i].Case,
			Bytes:       rounds[0][i].Bytes,
			PerS:        median(func(r result) float64 { return r.PerS }),
			CPUPerGiB:   median(func(r result) float64 { return r.CPUPerGiB }),
			RatioOfTCP:  median(func(r result) float64 { return r.RatioOfTCP }),
			RatioOfGRPC: median(func(r result) float64 { return r.RatioOfGRPC }),
			Rounds:      len(rounds),
		}
	}
	return out
}

// cpu returns the process's CPU time so far.
func cpu() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// childEnv names the case a child runs: this program, started again with
// it set, is the other end of that case.
const childEnv = "DISTBENCH_CASE"

// startChild starts the child for case c and returns it.
func startChild(c string, size, n int, target string) (*childProc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), childEnv+"="+c, "DISTBENCH_SIZE="+strconv.Itoa(size),
		"DISTBENCH_N="+strconv.Itoa(n), "DISTBENCH_TARGET="+target, "DISTBENCH_CHUNK="+strconv.Itoa(chunk),
		"DISTBENCH_WARM="+strconv.Itoa(warm), "DISTBENCH_CONNS="+strconv.Itoa(conns),
		"DISTBENCH_ADDR="+childAddr)
	if childNetns != "" {
		ip, err := exec.LookPath("ip")
		if err != nil {
			return nil, err
		}
		cmd.Args = append([]string{ip, "netns", "exec", childNetns, cmd.Path}, cmd.Args[1:]...)
		cmd.Path = ip
	}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &childProc{wait: cmd.Wait}, nil
}

type childProc struct{ wait func() error }

// listenFor listens on addr and starts case c's child, which dials it.
func listenFor(c string, size, n int, addr string) (net.Listener, *childProc, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		return nil, nil, err
	}
	ch, err := startChild(c, size, n, l.Addr().String())
	if err != nil {
		_ = l.Close()
		return nil, nil, err
	}
	return l, ch, nil
}

func benchTCP(size, n int, addr string) (result, error) {
	l, ch, err := listenFor("tcp", size, n, addr)
	if err != nil {
		return result{}, err
	}
	defer l.Close()
	c, err := l.Accept()
	if err != nil {
		return result{}, err
	}
	defer c.Close()
	buf := make([]byte, size)
	for i := range buf {
		buf[i] = 1 // pre-faulted
	}
	var start time.Time
	var cpu0 time.Duration
	for i := range n {
		if i == 0 {
			// The first byte starts the clock.
			if _, err := io.ReadFull(c, buf[:1]); err != nil {
				return result{}, err
			}
			start, cpu0 = time.Now(), cpu()
			if _, err := io.ReadFull(c, buf[1:]); err != nil {
				return result{}, err
			}
			continue
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			return result{}, err
		}
	}
	elapsed, used := time.Since(start), cpu()-cpu0
	var childCPU int64
	if err := binary.Read(c, binary.LittleEndian, &childCPU); err != nil {
		return result{}, err
	}
	if err := ch.wait(); err != nil {
		return result{}, err
	}
	return newResult("tcp", size, n, elapsed, used+time.Duration(childCPU)), nil
}

func newResult(c string, size, n int, elapsed, used time.Duration) result {
	total := float64(size) * float64(n)
	return result{Case: c, Bytes: size, PerS: total / elapsed.Seconds(), CPUPerGiB: used.Seconds() / (total / (1 << 30))}
}

func benchDist(c string, size, n int, addr string) (result, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		return result{}, err
	}
	store := l.Addr().String()
	_ = l.Close()
	ch, err := startChild(c, size, n, store)
	if err != nil {
		return result{}, err
	}
	ctx := context.Background()
	g, q, _, err := join(ctx, c, 0, store, addr)
	if err != nil {
		return result{}, err
	}
	defer g.Close()
	var start time.Time
	var cpu0 time.Duration
	for i := range n {
		if i == warm {
			// The first tensors warm the pools and the connection.
			start, cpu0 = time.Now(), cpu()
		}
		var x *tensor.Tensor
		if err := q.Get(ctx, &x); err != nil {
			return result{}, err
		}
		if x.Nbytes() != int64(size) {
			return result{}, fmt.Errorf("got %d bytes, sent %d", x.Nbytes(), size)
		}
		_ = x.Release()
	}
	elapsed, used := time.Since(start), cpu()-cpu0
	if err := g.Store().Set(ctx, "distbench/taken", []byte("yes")); err != nil {
		return result{}, err
	}
	v, err := g.Store().Get(ctx, "distbench/cpu", 0)
	if err != nil {
		return result{}, err
	}
	childCPU, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil {
		return result{}, err
	}
	if err := g.Close(); err != nil {
		return result{}, err
	}
	if err := ch.wait(); err != nil {
		return result{}, err
	}
	return newResult(c, size, n-warm, elapsed, used+time.Duration(childCPU)), nil
}

// join makes this process rank r of the two and opens case c's queue:
// owned by the parent for dist_put, by the child for dist_get.
func join(ctx context.Context, c string, r int, store, addr string) (*dist.Group, *dist.Queue, int, error) {
	// Both ends run on one machine: the same-host shortcut, which would
	// skip the network, is off, as between two hosts.
	g, err := dist.Init(ctx, dist.WithRank(r, 2), dist.WithStore(store), dist.WithAddr(addr), dist.WithTimeout(time.Minute),
		dist.WithChunk(chunk), dist.WithPullConns(conns), dist.WithSameHostShortcut(false))
	if err != nil {
		return nil, nil, 0, err
	}
	owner := 0
	if c == "dist_get" {
		owner = 1
	}
	q, err := g.Queue(ctx, "bench", dist.WithOwner(owner), dist.WithCapacity(2))
	if err != nil {
		_ = g.Close()
		return nil, nil, 0, err
	}
	return g, q, owner, nil
}

// child is the sending end.
func child() int {
	size, _ := strconv.Atoi(os.Getenv("DISTBENCH_SIZE"))
	n, _ := strconv.Atoi(os.Getenv("DISTBENCH_N"))
	target := os.Getenv("DISTBENCH_TARGET")
	chunk, _ = strconv.Atoi(os.Getenv("DISTBENCH_CHUNK"))
	warm, _ = strconv.Atoi(os.Getenv("DISTBENCH_WARM"))
	conns, _ = strconv.Atoi(os.Getenv("DISTBENCH_CONNS"))
	var err error
	switch c := os.Getenv(childEnv); c {
	case "tcp":
		err = childTCP(size, n, target)
	case "grpc":
		err = childGRPC(size, n, target)
	default:
		err = childDist(c, size, n, target)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "distbench child:", err)
		return 1
	}
	return 0
}

func childTCP(size, n int, target string) error {
	c, err := net.Dial("tcp", target)
	if err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, size)
	for i := range buf {
		buf[i] = byte(i)
	}
	cpu0 := cpu()
	for range n {
		if _, err := c.Write(buf); err != nil {
			return err
		}
	}
	return binary.Write(c, binary.LittleEndian, int64(cpu()-cpu0))
}

func childDist(c string, size, n int, store string) error {
	ctx := context.Background()
	host := os.Getenv("DISTBENCH_ADDR")
	if host == "" {
		host, _, _ = net.SplitHostPort(store)
	}
	g, q, owner, err := join(ctx, c, 1, store, host)
	if err != nil {
		return err
	}
	defer g.Close()
	x, err := tensor.On(device.CPU()).Shared().Full(tensor.Uint8, 7, size)
	if err != nil {
		return err
	}
	defer x.Release()
	if owner == 1 {
		// The owner's own Put copies into its queue on this thread;
		// serving the parent runs on others meanwhile.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
	}
	var local, cpu0 time.Duration
	for i := range n {
		if i == warm {
			cpu0 = cpu()
		}
		before := threadCPU()
		if err := q.Put(ctx, x); err != nil {
			return err
		}
		if owner == 1 && i >= warm {
			local += threadCPU() - before // the owner's own copy into its queue
		}
	}
	if owner == 1 {
		// The queue is here: stay until the parent has taken everything.
		if _, err := g.Store().Get(ctx, "distbench/taken", 0); err != nil {
			return err
		}
	}
	counted := cpu() - cpu0 - local
	if err := g.Store().Set(ctx, "distbench/cpu", []byte(strconv.FormatInt(int64(counted), 10))); err != nil {
		return err
	}
	return g.Close()
}
