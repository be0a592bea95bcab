package reduction_test

import (
	"fmt"

	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

// A producer puts a batch in shared memory and encodes it; a consumer,
// normally in another process that received the bytes and descriptors
// over a socket, rebuilds it on the same memory and writes into it.
func ExampleMarshal() {
	type batch struct {
		Step   int
		Images *tensor.Tensor
	}
	images, _ := tensor.Arange(tensor.Float32, 6)
	images, _ = images.Reshape(2, 3)
	defer images.Release()

	data, fds, err := reduction.Marshal(batch{Step: 7, Images: images})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("shared:", images.IsShared(), "descriptors:", len(fds))

	// The descriptors are ours: a socket would carry them to another
	// process; here the decoder takes them over.
	var got batch
	if err := reduction.Unmarshal(data, fds, &got); err != nil {
		fmt.Println(err)
		return
	}
	_ = tensor.Set[float32](got.Images, 100, 1, 2)
	v, _ := tensor.At[float32](images, 1, 2)
	fmt.Println("step", got.Step, "shape", got.Images.Shape(), "producer sees", v)
	// Output:
	// shared: true descriptors: 1
	// step 7 shape [2 3] producer sees 100
}
