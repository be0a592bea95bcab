// Command spawn runs tensormp's demonstration and housekeeping jobs.
//
//	spawn demo    spawn workers and hand them tensors under each strategy
//	spawn bench   measure hand-off latency, throughput and descriptors held
//	spawn clean   remove segments of sessions with no live process
//	spawn help    explain the subcommands and their flags
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

const demoHelp = `Spawns worker processes, sends them tensors of several dtypes and sizes
through a queue under each sharing strategy, has every worker check the
values and overwrite them in place, and checks in the parent that each
tensor came back on the same shared memory with the workers' writes.
Prints the number of tensors, bytes and the median round trip per
strategy, and how many tensormp_ segments /dev/shm held before and after.
Exits non-zero on any mismatch or leftover segment.`

const cleanHelp = `Removes the tensormp_ segments of sessions that have no live process left
(a program killed before its session keeper could run, say), printing
each one. Segments of live sessions and files tensormp did not make are
never touched.`

const usage = `usage: spawn <command> [flags]

commands:
  demo     share tensors with worker processes and verify them (default)
  bench    measure hand-off latency, throughput and descriptors held
  clean    remove segments of sessions with no live process
  help     show this help, or a command's: spawn help demo

Run "spawn <command> -h" for a command's flags.
Environment: TENSORMP_SHARING_STRATEGY, TENSORMP_SHM_DIR, TENSORMP_LOG.
`

func main() {
	mp.Init()
	code := run(os.Args[1:], os.Stdout, os.Stderr)
	// bench -pydevice cuda:N sent GPU memory: the driver's files for it
	// go with the contexts.
	if err := tensor.CloseBackends(); err != nil {
		fmt.Fprintln(os.Stderr, "spawn:", err)
	}
	os.Exit(code)
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		return runDemo(nil, stdout, stderr)
	}
	switch args[0] {
	case "demo":
		return runDemo(args[1:], stdout, stderr)
	case "clean":
		return runClean(args[1:], stdout, stderr)
	case "bench":
		return runBench(args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		if len(args) > 1 {
			return run([]string{args[1], "-h"}, stdout, stderr)
		}
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "spawn: unknown command %q\n\n%s", args[0], usage)
	return 2
}

func runClean(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("clean", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dryRun := fs.Bool("n", false, "dry run: print what would be removed, remove nothing")
	dir := fs.String("dir", mmapalloc.Dir(), "shared-memory directory to clean")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: spawn clean [flags]\n\n%s\n\nflags:\n", cleanHelp)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	removed, err := mp.Clean(*dir, *dryRun)
	verb := "removed"
	if *dryRun {
		verb = "would remove"
	}
	for _, name := range removed {
		fmt.Fprintf(stdout, "%s %s\n", verb, name)
	}
	fmt.Fprintf(stdout, "%s %d entries from %s\n", verb, len(removed), *dir)
	if err != nil {
		fmt.Fprintln(stderr, "spawn clean:", err)
		return 1
	}
	return 0
}
