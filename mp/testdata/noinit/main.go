// Command noinit is a program that gets mp.Init wrong, for package mp's
// tests. Its first argument says how:
//
//	spawn  main never calls Init: each child runs main again
//	exit   main never calls Init, and a child's main returns at once
//	late   main registers its worker after Init
//
// It prints Run's error and exits 1 if Run failed. Should tensormp fail to
// stop it, a child of a child refuses to run (exit code 99): the test
// fails instead of filling the machine with processes.
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/tensormp/tensormp/mp"
)

func work(ctx context.Context, w *mp.Worker) error { return nil }

func main() {
	if os.Getenv("NOINIT_GRANDCHILD") != "" {
		os.Exit(99)
	}
	if os.Getenv("NOINIT_CHILD") != "" {
		os.Setenv("NOINIT_GRANDCHILD", "1")
	}
	os.Setenv("NOINIT_CHILD", "1")
	mode := os.Getenv("NOINIT_MODE")
	switch mode {
	case "late":
		mp.Init()
		mp.Register("work", work)
	case "exit":
		if os.Getenv("NOINIT_GRANDCHILD") != "" {
			return // a child's main that returns before doing anything
		}
		mp.Register("work", work)
	default:
		mp.Register("work", work)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := mp.Run(ctx, "work", 2); err != nil {
		fmt.Printf("run: %v\n", err)
		os.Exit(1)
	}
}
