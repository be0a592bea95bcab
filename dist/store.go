package dist

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/vmihailenco/msgpack/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Store actions: the names of the DoAction calls rank 0 serves.
const (
	actionSet   = "tensormp.store.set"
	actionGet   = "tensormp.store.get"
	actionAdd   = "tensormp.store.add"
	actionWait  = "tensormp.store.wait"
	actionCheck = "tensormp.store.check"
)

// storeReq is the body of a store action.
type storeReq struct {
	//lint:ignore U1000 the tag tells msgpack to use the array form
	_msgpack struct{} `msgpack:",as_array"`

	Keys    []string
	Value   []byte
	Delta   int64
	Timeout time.Duration // get, wait: how long to wait; 0: the store's default
}

// storeData is rank 0's key-value store: TCPStore's contract (set, get
// and wait block until keys exist, add counts).
type storeData struct {
	mu      sync.Mutex
	kv      map[string][]byte
	changed chan struct{} // closed and replaced at every change
}

func newStoreData() *storeData {
	return &storeData{kv: map[string][]byte{}, changed: make(chan struct{})}
}

func (s *storeData) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *storeData) set(k string, v []byte) {
	s.mu.Lock()
	s.kv[k] = slices.Clone(v)
	s.notifyLocked()
	s.mu.Unlock()
}

func (s *storeData) add(k string, d int64) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var n int64
	if v, ok := s.kv[k]; ok {
		if err := unmarshal(v, &n); err != nil {
			return 0, fmt.Errorf("dist: store key %q holds no counter", k)
		}
	}
	n += d
	b, _ := msgpack.Marshal(n)
	s.kv[k] = b
	s.notifyLocked()
	return n, nil
}

// wait blocks until every key exists, and returns their values.
func (s *storeData) wait(ctx context.Context, keys []string) ([][]byte, error) {
	for {
		s.mu.Lock()
		var vals [][]byte
		missing := 0
		for _, k := range keys {
			v, ok := s.kv[k]
			if !ok {
				missing++
			}
			vals = append(vals, v)
		}
		ch := s.changed
		s.mu.Unlock()
		if missing == 0 {
			return vals, nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// missing returns the keys that do not exist.
func (s *storeData) missing(keys []string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, k := range keys {
		if _, ok := s.kv[k]; !ok {
			out = append(out, k)
		}
	}
	return out
}

// doAction serves a store action.
func (s *storeData) doAction(ctx context.Context, a *flight.Action, defTimeout time.Duration) ([][]byte, error) {
	var req storeReq
	if err := unmarshal(a.Body, &req); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "malformed %s request: %v", a.Type, err)
	}
	switch a.Type {
	case actionSet:
		if len(req.Keys) != 1 {
			return nil, status.Errorf(codes.InvalidArgument, "set of %d keys", len(req.Keys))
		}
		s.set(req.Keys[0], req.Value)
		return nil, nil
	case actionAdd:
		if len(req.Keys) != 1 {
			return nil, status.Errorf(codes.InvalidArgument, "add to %d keys", len(req.Keys))
		}
		n, err := s.add(req.Keys[0], req.Delta)
		if err != nil {
			return nil, status.Error(codes.FailedPrecondition, err.Error())
		}
		b, _ := msgpack.Marshal(n)
		return [][]byte{b}, nil
	case actionGet, actionWait:
		d := req.Timeout
		if d <= 0 {
			d = defTimeout
		}
		wctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		vals, err := s.wait(wctx, req.Keys)
		if err != nil {
			return nil, status.Errorf(codes.DeadlineExceeded, "keys %q still missing after %v", s.missing(req.Keys), d)
		}
		if a.Type == actionWait {
			return nil, nil
		}
		return vals, nil
	case actionCheck:
		b, _ := msgpack.Marshal(s.missing(req.Keys))
		return [][]byte{b}, nil
	}
	return nil, status.Errorf(codes.Unimplemented, "unknown action %q", a.Type)
}

// Store is a client of the group's key-value store on rank 0, with
// torch's TCPStore contract: Get and Wait block until their keys are set
// or their time runs out, Add keeps a counter. Every rank has one, from
// Group.Store.
type Store struct {
	g *Group
}

// Set sets key to value.
func (s *Store) Set(ctx context.Context, key string, value []byte) error {
	_, err := s.do(ctx, actionSet, storeReq{Keys: []string{key}, Value: value})
	return err
}

// Get returns key's value, waiting until it is set, for at most timeout
// (0: the group's timeout) and while ctx lasts.
func (s *Store) Get(ctx context.Context, key string, timeout time.Duration) ([]byte, error) {
	vals, err := s.do(ctx, actionGet, storeReq{Keys: []string{key}, Timeout: timeout})
	if err != nil {
		return nil, err
	}
	if len(vals) != 1 {
		return nil, fmt.Errorf("dist: store get %q: %d values", key, len(vals))
	}
	return vals[0], nil
}

// Add adds delta to the counter at key (0 when unset) and returns the sum.
func (s *Store) Add(ctx context.Context, key string, delta int64) (int64, error) {
	return s.add(ctx, key, delta)
}

func (s *Store) add(ctx context.Context, key string, delta int64, copts ...grpc.CallOption) (int64, error) {
	vals, err := s.do(ctx, actionAdd, storeReq{Keys: []string{key}, Delta: delta}, copts...)
	if err != nil {
		return 0, err
	}
	var n int64
	if len(vals) != 1 || unmarshal(vals[0], &n) != nil {
		return 0, fmt.Errorf("dist: store add %q: a malformed answer", key)
	}
	return n, nil
}

// Wait waits until every key is set, for at most timeout (0: the group's
// timeout) and while ctx lasts.
func (s *Store) Wait(ctx context.Context, timeout time.Duration, keys ...string) error {
	_, err := s.do(ctx, actionWait, storeReq{Keys: keys, Timeout: timeout})
	return err
}

// Missing returns which of keys are not set, without waiting.
func (s *Store) Missing(ctx context.Context, keys ...string) ([]string, error) {
	vals, err := s.do(ctx, actionCheck, storeReq{Keys: keys})
	if err != nil {
		return nil, err
	}
	var out []string
	if len(vals) != 1 || unmarshal(vals[0], &out) != nil {
		return nil, errors.New("dist: store check: a malformed answer")
	}
	return out, nil
}

func (s *Store) do(ctx context.Context, typ string, req storeReq, copts ...grpc.CallOption) ([][]byte, error) {
	body, err := msgpack.Marshal(&req)
	if err != nil {
		return nil, err
	}
	c, err := s.g.client(0)
	if err != nil {
		return nil, err
	}
	ctx, cancel := s.g.opContext(ctx)
	defer cancel()
	stream, err := c.DoAction(ctx, &flight.Action{Type: typ, Body: body}, copts...)
	if err != nil {
		return nil, s.g.peerErr(0, typ, err)
	}
	var vals [][]byte
	for {
		r, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return vals, nil
			}
			return nil, s.g.peerErr(0, typ, err)
		}
		vals = append(vals, r.Body)
	}
}
