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
	"strings"

	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// A command is one of spawn's subcommands: a row of commands.
type command struct {
	name  string
	args  string // what follows the name in its usage line; "[flags]" if empty
	short string // its line in spawn's usage
	long  string // what "spawn <name> -h" prints above the flags
	// flags defines the command's flags on fs and returns what runs the
	// command once they are parsed. run parses them, and prints the
	// command's usage on -h or a flag it does not know.
	flags func(fs *flag.FlagSet) func(stdout, stderr io.Writer) int
}

// commands are spawn's subcommands, in the order its usage lists them.
// The first runs when none is named.
var commands []*command

func init() {
	// Set here, not where declared: help's run reads commands.
	commands = []*command{
		{name: "demo", short: "share tensors with worker processes and verify them", long: demoHelp, flags: demoFlags},
		{name: "bench", short: "measure hand-off latency, throughput and descriptors held", long: benchHelp + "\n\n" + deviceHelp + "\n\n" + loaderHelp + "\n\n" + pythonHelp, flags: benchFlags},
		{name: "clean", short: "remove segments of sessions with no live process", long: cleanHelp, flags: cleanFlags},
		{name: "help", args: "[command]", short: "show this help, or a command's: spawn help demo", long: helpHelp, flags: helpFlags},
	}
}

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

// run runs the command args name, with the rest of args, and returns the
// exit status: 0, 1 where the command failed, 2 for a bad command line.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		return commands[0].run(nil, stdout, stderr)
	}
	name := args[0]
	switch name {
	case "-h", "-help", "--help":
		name = "help"
	}
	for _, c := range commands {
		if c.name == name {
			return c.run(args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "spawn: unknown command %q\n\n%s", args[0], usage())
	return 2
}

// run parses c's flags from args and runs c.
func (c *command) run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	run := c.flags(fs)
	fs.Usage = func() {
		line := c.args
		if line == "" {
			line = "[flags]"
		}
		fmt.Fprintf(stderr, "usage: spawn %s %s\n\n%s\n", c.name, line, c.long)
		hasFlags := false
		fs.VisitAll(func(*flag.Flag) { hasFlags = true })
		if hasFlags {
			fmt.Fprint(stderr, "\nflags:\n")
			fs.PrintDefaults()
		}
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	return run(stdout, stderr)
}

// usage is spawn's usage, a line for each of its commands.
func usage() string {
	var b strings.Builder
	b.WriteString("usage: spawn <command> [flags]\n\ncommands:\n")
	for i, c := range commands {
		fmt.Fprintf(&b, "  %-8s %s", c.name, c.short)
		if i == 0 {
			b.WriteString(" (default)")
		}
		b.WriteString("\n")
	}
	b.WriteString(`
Run "spawn <command> -h" for a command's flags.
Environment: TENSORMP_SHARING_STRATEGY, TENSORMP_SHM_DIR, TENSORMP_LOG.
`)
	return b.String()
}

const helpHelp = `Prints spawn's commands, or, given a command's name, what that command
does and its flags, as "spawn <command> -h" does.`

// helpFlags defines help's flags, of which it has none, and returns what
// runs it.
func helpFlags(fs *flag.FlagSet) func(stdout, stderr io.Writer) int {
	return func(stdout, stderr io.Writer) int {
		if fs.NArg() == 0 {
			fmt.Fprint(stdout, usage())
			return 0
		}
		return run([]string{fs.Arg(0), "-h"}, stdout, stderr)
	}
}
