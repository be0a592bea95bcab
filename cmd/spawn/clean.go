package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/mp"
)

const cleanHelp = `Removes the tensormp_ segments of sessions that have no live process left
(a program killed before its session keeper could run, say), printing
each one. Segments of live sessions and files tensormp did not make are
never touched.`

// cleanFlags defines clean's flags on fs and returns what runs it once
// they are parsed.
func cleanFlags(fs *flag.FlagSet) func(stdout, stderr io.Writer) int {
	dryRun := fs.Bool("n", false, "dry run: print what would be removed, remove nothing")
	dir := fs.String("dir", mmapalloc.Dir(), "shared-memory directory to clean")
	return func(stdout, stderr io.Writer) int {
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
}
