// Command example shares a Go tensor with a PyTorch process without a
// copy: it listens on a named endpoint, starts consumer.py, sends it a
// tensor, and prints the tensor after PyTorch has doubled it in place.
//
// From the repository's root, with torch and the tensormp package
// installed for python3 (or $PYTHON):
//
//	python3 -m pip install ./python
//	go run ./python/example
//
// (Or, without installing it, with the library built into the package's
// folder: PYTHONPATH=python go run ./python/example.)
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/exec"
	"strconv"
	"time"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

func main() {
	mp.Init()
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	addr := "@tensormp-example-" + strconv.Itoa(os.Getpid())
	l, err := mp.Listen(addr) // only processes of this user may connect
	if err != nil {
		return err
	}
	defer l.Close()

	python := os.Getenv("PYTHON")
	if python == "" {
		python = "python3"
	}
	cmd := exec.CommandContext(ctx, python, "python/example/consumer.py", addr)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	defer cmd.Wait()

	p, peer, err := l.Accept(ctx)
	if err != nil {
		return err
	}
	defer p.Close()
	fmt.Println("go: python connected, pid", peer.PID)

	x, err := tensor.On(device.CPU()).Shared().Arange(tensor.Float32, 6)
	if err != nil {
		return err
	}
	defer x.Release()
	if x, err = x.Reshape(2, 3); err != nil {
		return err
	}
	if err := p.Send(ctx, map[string]any{"weights": x, "step": 1}); err != nil {
		return err
	}
	var reply string
	if err := p.Recv(ctx, &reply); err != nil {
		return err
	}
	vs, err := tensor.Values[float32](x)
	if err != nil {
		return err
	}
	fmt.Printf("go: python says %q; the tensor in Go's memory is now %v\n", reply, vs)
	return nil
}
