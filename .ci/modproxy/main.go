// Command modproxy writes a Go module proxy, in the layout GOPROXY=file://
// reads, that serves the modules in the given directories, as they are
// in the working tree, at one version: what a user who fetches them at
// that version would get once it is tagged. CI builds a fresh module
// against it, with the Go toolchain alone, to check that the modules
// install as the README says.
//
//	modproxy -version v0.1.0 -out DIR MODULEDIR...
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/zip"
)

func main() {
	version := flag.String("version", "", "the version to serve the modules at")
	out := flag.String("out", "", "the proxy's directory")
	flag.Parse()
	if *version == "" || *out == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: modproxy -version VERSION -out DIR MODULEDIR...")
		os.Exit(2)
	}
	for _, dir := range flag.Args() {
		if err := serve(*out, dir, *version); err != nil {
			fmt.Fprintln(os.Stderr, "modproxy:", err)
			os.Exit(1)
		}
	}
}

// serve writes the module in dir into the proxy at out, at version.
func serve(out, dir, version string) error {
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return err
	}
	path := modfile.ModulePath(gomod)
	if path == "" {
		return fmt.Errorf("%s/go.mod names no module", dir)
	}
	mv := module.Version{Path: path, Version: version}
	escaped, err := module.EscapePath(path)
	if err != nil {
		return err
	}
	at := filepath.Join(out, escaped, "@v")
	if err := os.MkdirAll(at, 0o755); err != nil {
		return err
	}
	info, err := json.Marshal(map[string]string{"Version": version, "Time": time.Now().UTC().Format(time.RFC3339)})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(at, version+".info"), info, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(at, version+".mod"), gomod, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(at, "list"), []byte(version+"\n"), 0o644); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(at, version+".zip"))
	if err != nil {
		return err
	}
	if err := zip.CreateFromDir(f, mv, dir); err != nil {
		_ = f.Close()
		return fmt.Errorf("zipping %s: %w", dir, err)
	}
	return f.Close()
}
