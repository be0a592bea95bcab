package device_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
)

func TestParse(t *testing.T) {
	npu, err := device.RegisterType("my_npu")
	require.NoError(t, err)

	cases := []struct {
		in   string
		want string
		kind device.Type
		idx  int
	}{
		{"cpu", "cpu", device.TypeCPU, 0},
		{"cpu:0", "cpu", device.TypeCPU, 0},
		{"gpu", "gpu:0", device.TypeGPU, 0},
		{"gpu:3", "gpu:3", device.TypeGPU, 3},
		{"cuda:1", "gpu:1", device.TypeGPU, 1},
		{"GPU:2", "gpu:2", device.TypeGPU, 2},
		{"my_npu:0", "my_npu:0", npu, 0},
		{"my_npu:7", "my_npu:7", npu, 7},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			p, err := device.Parse(c.in)
			require.NoError(t, err)
			assert.Equal(t, c.want, p.String())
			assert.Equal(t, c.kind, p.Type())
			assert.Equal(t, c.idx, p.Index())
			assert.True(t, p.Valid())
			back, err := device.Parse(p.String())
			require.NoError(t, err)
			assert.Equal(t, p, back, "String and Parse round trip")
		})
	}
}

func TestParseErrors(t *testing.T) {
	cases := []struct {
		in, msg string
	}{
		{"", "empty place"},
		{"gpu:-1", "negative index"},
		{"gpu:x", `bad index "x"`},
		{"gpu:", `bad index ""`},
		{"gpu:99999999999", "bad index"},
		{"tpu:0", `unknown device type "tpu"`},
		{"cpu:1", "only index 0"},
		{":0", `unknown device type ""`},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			_, err := device.Parse(c.in)
			require.Error(t, err)
			assert.Contains(t, err.Error(), c.msg)
		})
	}
	_, err := device.Parse("tpu:0")
	assert.Contains(t, err.Error(), "registered: cpu, gpu", "the error lists what is valid")
}

func TestRegisterType(t *testing.T) {
	a, err := device.RegisterType("test_xpu")
	require.NoError(t, err)
	b, err := device.RegisterType("test_xpu")
	require.NoError(t, err)
	assert.Equal(t, a, b, "registering twice gives the same type")
	assert.Contains(t, device.TypeNames(), "test_xpu")

	p, err := device.Custom("test_xpu", 2)
	require.NoError(t, err)
	assert.Equal(t, "test_xpu:2", p.String())
	assert.Equal(t, "test_xpu", p.Kind())

	for _, bad := range []string{"", "cuda", "9npu", "My_NPU", "npu:0", "a/b", "_x"} {
		_, err := device.RegisterType(bad)
		assert.Error(t, err, "RegisterType(%q)", bad)
	}
	_, err = device.Custom("never_registered", 0)
	assert.ErrorContains(t, err, "unknown device type")
	_, err = device.Custom("test_xpu", -1)
	assert.ErrorContains(t, err, "out of range")
}

func TestRegisterTypeConcurrent(t *testing.T) {
	var wg sync.WaitGroup
	got := make([]device.Type, 16)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			typ, err := device.RegisterType("race_kind")
			assert.NoError(t, err)
			got[i] = typ
			_, err = device.Parse(fmt.Sprintf("race_kind:%d", i))
			assert.NoError(t, err)
		}()
	}
	wg.Wait()
	for _, typ := range got {
		assert.Equal(t, got[0], typ)
	}
}

func TestPlaceText(t *testing.T) {
	b, err := device.GPU(4).MarshalText()
	require.NoError(t, err)
	var p device.Place
	require.NoError(t, p.UnmarshalText(b))
	assert.Equal(t, device.GPU(4), p)
	_, err = device.GPU(-1).MarshalText()
	assert.Error(t, err)
	assert.False(t, device.GPU(-1).Valid())
	assert.Error(t, p.UnmarshalText([]byte("gpu:x")))
	assert.Equal(t, device.CPU(), device.Place{}, "the zero place is the CPU")
}

// setDefault changes the process default for one test and restores it.
func setDefault(t *testing.T, p device.Place) {
	t.Helper()
	old := device.Default()
	require.NoError(t, device.SetDefault(p))
	t.Cleanup(func() { _ = device.SetDefault(old) })
}

func TestDefaultAndScope(t *testing.T) {
	setDefault(t, device.GPU(1))
	ctx := context.Background()
	assert.Equal(t, device.GPU(1), device.Current(ctx), "no scope: the default")
	assert.False(t, device.Scoped(ctx))
	//lint:ignore SA1012 Current documents what a nil context means
	assert.Equal(t, device.GPU(1), device.Current(nil))

	inner := device.With(ctx, device.CPU())
	assert.Equal(t, device.CPU(), device.Current(inner))
	assert.True(t, device.Scoped(inner))
	assert.Equal(t, device.GPU(1), device.Current(ctx), "the outer context is unchanged")

	require.NoError(t, device.SetDefault(device.GPU(2)))
	assert.Equal(t, device.CPU(), device.Current(inner), "a scope ignores the default")
	assert.Equal(t, device.GPU(2), device.Current(ctx))
	assert.Error(t, device.SetDefault(device.GPU(-1)))
	assert.Equal(t, device.GPU(2), device.Default())
}

func TestChildGoroutineInheritsDefault(t *testing.T) {
	setDefault(t, device.GPU(3))
	done := make(chan device.Place)
	go func() { done <- device.Current(context.Background()) }()
	assert.Equal(t, device.GPU(3), <-done)
}

func TestDoNestingAndPanic(t *testing.T) {
	setDefault(t, device.GPU(0))
	ctx := context.Background()
	var seen []device.Place
	err := device.Do(ctx, device.CPU(), func(ctx context.Context) error {
		seen = append(seen, device.Current(ctx))
		err := device.Do(ctx, device.GPU(5), func(ctx context.Context) error {
			seen = append(seen, device.Current(ctx))
			return errors.New("inner failed")
		})
		seen = append(seen, device.Current(ctx))
		return err
	})
	assert.EqualError(t, err, "inner failed", "Do returns fn's error")
	assert.Equal(t, []device.Place{device.CPU(), device.GPU(5), device.CPU()}, seen)
	assert.Equal(t, device.GPU(0), device.Current(ctx))

	outer := device.With(ctx, device.GPU(7))
	func() {
		defer func() { assert.Equal(t, "boom", recover()) }()
		_ = device.Do(outer, device.CPU(), func(ctx context.Context) error {
			panic("boom")
		})
	}()
	assert.Equal(t, device.GPU(7), device.Current(outer), "the outer place is in effect after a panic")

	ran := false
	err = device.Do(ctx, device.GPU(-1), func(context.Context) error { ran = true; return nil })
	assert.Error(t, err)
	assert.False(t, ran)
}

func TestBind(t *testing.T) {
	setDefault(t, device.GPU(0))
	where := func(ctx context.Context, tag string) (string, error) {
		return tag + "@" + device.Current(ctx).String(), nil
	}
	onCPU := device.Bind(device.CPU(), where)
	ctx := device.With(context.Background(), device.GPU(2))
	got, err := onCPU(ctx, "a")
	require.NoError(t, err)
	assert.Equal(t, "a@cpu", got)
	assert.Equal(t, device.GPU(2), device.Current(ctx), "the caller's place is untouched")

	nested := device.Bind(device.GPU(1), func(ctx context.Context, tag string) (string, error) {
		inner, err := onCPU(ctx, tag)
		return inner + "," + device.Current(ctx).String(), err
	})
	got, err = nested(context.Background(), "b")
	require.NoError(t, err)
	assert.Equal(t, "b@cpu,gpu:1", got, "the outer binding is restored when the inner returns")

	_, err = device.Bind(device.GPU(-1), where)(ctx, "c")
	assert.Error(t, err)

	func() {
		defer func() { assert.NotNil(t, recover()) }()
		_, _ = device.Bind(device.CPU(), func(context.Context, int) (int, error) { panic("x") })(ctx, 1)
	}()
	assert.Equal(t, device.GPU(2), device.Current(ctx))
}

// TestScopeIsolationRace is the concurrency test of the dual-layer state:
// 64 goroutines each scope their own place and check it 10,000 times while
// another goroutine keeps changing the process default. No goroutine may
// see another's place, and one that scoped nothing sees only defaults.
func TestScopeIsolationRace(t *testing.T) {
	const workers, iters = 64, 10000
	old := device.Default()
	t.Cleanup(func() { _ = device.SetDefault(old) })

	defaults := []device.Place{device.CPU(), device.GPU(0), device.GPU(1), device.GPU(2)}
	isDefault := func(p device.Place) bool {
		for _, d := range defaults {
			if p == d {
				return true
			}
		}
		return false
	}

	stop := make(chan struct{})
	var changer sync.WaitGroup
	changer.Add(1)
	go func() {
		defer changer.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			_ = device.SetDefault(defaults[i%len(defaults)])
		}
	}()

	var wg sync.WaitGroup
	errs := make(chan string, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := context.Background()
			mine := device.GPU(1000 + w)
			for i := range iters {
				if w%8 == 0 {
					// These goroutines set nothing: they must see a default.
					if p := device.Current(base); !isDefault(p) {
						errs <- fmt.Sprintf("goroutine %d saw %s, not a default", w, p)
						return
					}
					continue
				}
				ctx := device.With(base, mine)
				if i%2 == 1 {
					ctx = device.With(ctx, device.GPU(100000+w))
					if p := device.Current(ctx); p != device.GPU(100000+w) {
						errs <- fmt.Sprintf("goroutine %d saw %s in its nested scope", w, p)
						return
					}
					continue
				}
				if p := device.Current(ctx); p != mine {
					errs <- fmt.Sprintf("goroutine %d saw %s, want %s", w, p, mine)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	changer.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

func BenchmarkCurrent(b *testing.B) {
	b.Run("default", func(b *testing.B) {
		ctx := context.Background()
		b.ReportAllocs()
		var p device.Place
		for b.Loop() {
			p = device.Current(ctx)
		}
		_ = p
	})
	b.Run("scoped", func(b *testing.B) {
		ctx := device.With(context.Background(), device.GPU(1))
		b.ReportAllocs()
		var p device.Place
		for b.Loop() {
			p = device.Current(ctx)
		}
		_ = p
	})
}

func TestCurrentAllocatesNothing(t *testing.T) {
	ctx := device.With(context.Background(), device.GPU(1))
	assert.Zero(t, testing.AllocsPerRun(100, func() { _ = device.Current(ctx) }))
	assert.Zero(t, testing.AllocsPerRun(100, func() { _ = device.Current(context.Background()) }))
}

func ExampleBind() {
	preprocess := device.Bind(device.CPU(), func(ctx context.Context, n int) (string, error) {
		return fmt.Sprintf("%d items on %s", n, device.Current(ctx)), nil
	})
	ctx := device.With(context.Background(), device.GPU(0))
	out, _ := preprocess(ctx, 3)
	fmt.Println(out)
	fmt.Println(device.Current(ctx))
	// Output:
	// 3 items on cpu
	// gpu:0
}
