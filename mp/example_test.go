package mp_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// Workers are registered before mp.Init runs (here in init; TestMain calls
// Init), in every process of the program.
func init() {
	mp.Register("example.fill", exampleFill)
	mp.Register("example.shard", exampleShard)
	mp.Register("example.fail", exampleFail)
}

// exampleFill writes 10*(rank+1) into its own element of the parent's
// tensor: ExampleSpawn.
func exampleFill(ctx context.Context, w *mp.Worker) error {
	var x *tensor.Tensor
	if err := w.Args(&x); err != nil {
		return err
	}
	// Each rank writes its own element, in the parent's memory.
	return tensor.Set[float32](x, float32(10*(w.Rank()+1)), w.Rank())
}

// exampleShard says which files its shard names: ExampleWithRankArgs.
func exampleShard(ctx context.Context, w *mp.Worker) error {
	var a shard
	if err := w.Args(&a); err != nil {
		return err
	}
	return a.Out.Put(ctx, fmt.Sprintf("rank %d reads %s", w.Rank(), strings.Join(a.Files, ", ")))
}

// exampleFail fails at once: ExampleGroup_Context.
func exampleFail(ctx context.Context, w *mp.Worker) error {
	return errors.New("out of data")
}

type shard struct {
	Out   *mp.Queue
	Files []string
}

// Workers share a tensor with the parent: what they write, the parent
// sees, with no copy.
func ExampleSpawn() {
	x, err := tensor.Zeros(tensor.Float32, 3)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer x.Release()
	g, err := mp.Spawn(context.Background(), "example.fill", 3, mp.WithArgs(x))
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := g.Join(); err != nil {
		fmt.Println(err)
		return
	}
	v, _ := tensor.Values[float32](x)
	fmt.Println(v)
	// Output: [10 20 30]
}

// Each worker gets arguments of its own: here a shard of the files.
func ExampleWithRankArgs() {
	ctx := context.Background()
	out, err := mp.NewQueue()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer out.Close()
	files := [][]string{{"a.bin", "b.bin"}, {"c.bin"}}
	err = mp.Run(ctx, "example.shard", 2, mp.WithRankArgs(func(rank int) any {
		return shard{Out: out, Files: files[rank]}
	}))
	if err != nil {
		fmt.Println(err)
		return
	}
	var lines []string
	for range 2 {
		var s string
		if err := out.Get(ctx, &s); err != nil {
			fmt.Println(err)
			return
		}
		lines = append(lines, s)
	}
	slices.Sort(lines)
	fmt.Println(strings.Join(lines, "\n"))
	// Output:
	// rank 0 reads a.bin, b.bin
	// rank 1 reads c.bin
}

// A Get under the group's context does not wait for a worker that has
// failed: it returns at the failure, which is the context's cause.
func ExampleGroup_Context() {
	q, err := mp.NewQueue()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer q.Close()
	g, err := mp.Spawn(context.Background(), "example.fail", 1)
	if err != nil {
		fmt.Println(err)
		return
	}
	var v int
	fmt.Println(q.Get(g.Context(), &v)) // no worker will put anything
	var we *mp.WorkerError
	if errors.As(context.Cause(g.Context()), &we) {
		fmt.Printf("worker %d failed: %s\n", we.Rank, we.Msg)
	}
	_ = g.Join()
	// Output:
	// context canceled
	// worker 0 failed: out of data
}

// A queue with a capacity holds that many messages, across processes;
// TryPut and TryGet do not wait (torch's put_nowait and get_nowait).
func ExampleWithCapacity() {
	ctx := context.Background()
	q, err := mp.NewQueue(mp.WithCapacity(2))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer q.Close()
	for i := range 3 {
		fmt.Println("put", i, q.TryPut(ctx, i))
	}
	var v int
	if err := q.Get(ctx, &v); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("got", v)
	fmt.Println("put 3", q.TryPut(ctx, 3))
	// Output:
	// put 0 <nil>
	// put 1 <nil>
	// put 2 mp: queue full
	// got 0
	// put 3 <nil>
}
