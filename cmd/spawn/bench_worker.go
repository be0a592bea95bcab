package main

import (
	"context"
	"fmt"
	"os"
	"runtime/pprof"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// benchMsg is what the bench worker receives: a command and a tensor.
type benchMsg struct {
	Op    string // "echo", "pipe", "pipecount", "pipetrip", "pipetensors", "count", "hold", "release", "floor", "stop"
	N     int
	Batch int         // tensors per message for "count" and "pipetensors"
	Floor floorSocket // the floor socket's worker end, for "floor"
	Page  floorSocket // the floor page's memfd, for "floor"
	// The lanes' memory, to the worker and from it, for "floor".
	LaneTo, LaneFrom floorSocket
}

type benchArgs struct {
	In, Out *mp.Queue
	Pipe    *mp.Pipe // the worker's end of pipe_roundtrip's pipe
	Profile string   // where the worker writes its CPU profile, if anywhere
	Pin     []int    // the CPUs the worker pins itself to; none, unpinned
}

// floorSocket carries one descriptor in a message: the worker's end of
// the floor's socket pair, the floor page's memfd, or a loader pipe's
// writing end.
type floorSocket struct{ f *fd.FD }

func (s floorSocket) encode(enc *msgpack.Encoder) ([]byte, error) {
	if s.f == nil {
		return nil, nil
	}
	i, err := carry.AddFD(enc, s.f)
	if err != nil {
		return nil, err
	}
	return []byte{byte(i)}, nil
}

func decodeFloorSocket(dec *msgpack.Decoder, n int) (floorSocket, error) {
	payload, err := carry.ReadExt(dec, n)
	if err != nil || len(payload) == 0 {
		return floorSocket{}, err
	}
	f, err := carry.TakeFD(dec, int(payload[0]))
	return floorSocket{f}, err
}

// Close closes the socket, if any.
func (s floorSocket) Close() error {
	if s.f == nil {
		return nil
	}
	return s.f.Close()
}

const floorExt int8 = 0x62 // 'b'

func init() {
	mp.Register("bench", benchWorker)
	carry.Register(floorExt, floorSocket.encode, decodeFloorSocket)
}

// benchWorker echoes tensors, counts streamed ones, or holds them and
// reports its descriptor count; it serves the floor's socket and page
// beside.
func benchWorker(ctx context.Context, w *mp.Worker) error {
	var a benchArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	if len(a.Pin) > 0 {
		// For its life: nothing to restore.
		if _, err := pinProcess(a.Pin); err != nil {
			return fmt.Errorf("bench worker: %w", err)
		}
	}
	if a.Profile != "" {
		stop, err := startProfile(a.Profile)
		if err != nil {
			return err
		}
		defer stop()
	}
	var last *tensor.Tensor // keeps the echoed storage mapped between trips
	var batch []*tensor.Tensor
	for {
		var m benchMsg
		if err := a.In.Get(ctx, &m); err != nil {
			return err
		}
		switch m.Op {
		case "echo":
			// N round trips of a bare tensor, as the floor's carry a bare
			// record: what is measured is the hand-off, not this loop's
			// commands.
			for range m.N {
				var x *tensor.Tensor
				if err := a.In.Get(ctx, &x); err != nil {
					return err
				}
				last = x
				if err := a.Out.Put(ctx, x); err != nil {
					return err
				}
			}
		case "pipe":
			for range m.N {
				var n int
				if err := a.Pipe.Recv(ctx, &n); err != nil {
					return err
				}
				if err := a.Pipe.Send(ctx, n); err != nil {
					return err
				}
			}
		case "pipecount":
			for range m.N {
				var n int
				if err := a.Pipe.Recv(ctx, &n); err != nil {
					return err
				}
			}
			if err := a.Pipe.Send(ctx, m.N); err != nil {
				return err
			}
		case "pipetrip":
			// Each tensor taken is answered with one of this process's.
			y, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
			if err != nil {
				return err
			}
			for range m.N {
				var x *tensor.Tensor
				if err = a.Pipe.Recv(ctx, &x); err != nil {
					break
				}
				_ = x.Release()
				if err = a.Pipe.Send(ctx, y); err != nil {
					break
				}
			}
			_ = y.Release()
			if err != nil {
				return err
			}
		case "pipetensors":
			for got := 0; got < m.N; {
				var err error
				if m.Batch == 1 {
					var x *tensor.Tensor
					err = a.Pipe.Recv(ctx, &x)
					batch = append(batch[:0], x)
				} else {
					err = a.Pipe.Recv(ctx, &batch)
				}
				if err != nil {
					return err
				}
				if err := releaseAll(batch); err != nil {
					return err
				}
				got += len(batch)
			}
			if err := a.Pipe.Send(ctx, m.N); err != nil {
				return err
			}
		case "count":
			for got := 0; got < m.N; {
				var err error
				if batch, err = mp.GetMany(ctx, a.In, batch[:0]); err != nil {
					return err
				}
				if err := releaseAll(batch); err != nil {
					return err
				}
				got += len(batch)
			}
			if err := a.Out.Put(ctx, m.N); err != nil {
				return err
			}
		case "hold":
			held := make([]*tensor.Tensor, 0, m.N)
			for range m.N {
				var x *tensor.Tensor
				if err := a.In.Get(ctx, &x); err != nil {
					return err
				}
				held = append(held, x)
			}
			if err := a.Out.Put(ctx, countFDs()); err != nil {
				return err
			}
			for _, x := range held {
				_ = x.Release()
			}
		case "release":
			if last != nil {
				_ = last.Release()
				last = nil
			}
			if err := a.Out.Put(ctx, 0); err != nil {
				return err
			}
		case "floor":
			// Served until the parent closes its end; a failure closes
			// this end, which the parent's next floor call reports.
			// serveFutex borrows the socket from serveFloor.
			if m.Page.f != nil {
				go func() { _ = serveFutex(m.Floor.f, m.Page.f) }()
			}
			if m.LaneTo.f != nil && m.LaneFrom.f != nil {
				go func() { _ = serveLanes(m.Floor.f, m.LaneTo.f, m.LaneFrom.f) }()
			}
			go func() { _ = serveFloor(m.Floor.f) }()
		case "stop":
			return nil
		}
	}
}

// releaseAll releases the tensors of batch, clearing it for the next.
func releaseAll(batch []*tensor.Tensor) error {
	for i, x := range batch {
		if err := x.Release(); err != nil {
			return err
		}
		batch[i] = nil
	}
	return nil
}

// startProfile starts a CPU profile written to path; stop ends it.
func startProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}, nil
}

func countFDs() int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(entries) - 1 // the directory's own descriptor
}
