package cudastub

import (
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
)

//go:embed c/libcuda.c
var source []byte

// cflags are the flags the library is built with.
var cflags = []string{
	"-std=gnu11", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread",
	"-Wl,-soname," + LibName,
}

var built = sync.OnceValues(build)

// Dir builds libcuda.so.1 from the embedded source with the C compiler
// (`go env CC`, else $CC, else "cc"), once per source content and
// compiler, and returns the directory holding it. The library is cached
// under os.UserCacheDir()/tensormp/cudastub-<sha256 prefix>/, written
// under a temporary name and renamed, so concurrent test binaries are
// safe. Errors say what failed, the compiler's output included.
func Dir() (string, error) { return built() }

// compiler returns the C compiler command, split into words.
func compiler() []string {
	if out, err := exec.Command("go", "env", "CC").Output(); err == nil {
		if f := strings.Fields(string(out)); len(f) > 0 {
			return f
		}
	}
	if f := strings.Fields(os.Getenv("CC")); len(f) > 0 {
		return f
	}
	return []string{"cc"}
}

func build() (string, error) {
	cc := compiler()
	h := sha256.New()
	h.Write(source)
	for _, w := range append(append([]string{}, cc...), cflags...) {
		h.Write([]byte{0})
		h.Write([]byte(w))
	}
	sum := hex.EncodeToString(h.Sum(nil))[:16]

	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	dir := filepath.Join(base, "tensormp", "cudastub-"+sum)
	lib := filepath.Join(dir, LibName)
	if _, err := os.Stat(lib); err == nil {
		return dir, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("cudastub: making the cache directory: %w", err)
	}
	src, err := os.CreateTemp(dir, ".libcuda-*.c")
	if err != nil {
		return "", fmt.Errorf("cudastub: writing the source: %w", err)
	}
	defer os.Remove(src.Name())
	_, werr := src.Write(source)
	if cerr := src.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return "", fmt.Errorf("cudastub: writing the source: %w", werr)
	}
	out, err := os.CreateTemp(dir, ".libcuda-*.so")
	if err != nil {
		return "", fmt.Errorf("cudastub: making the output file: %w", err)
	}
	_ = out.Close()
	defer os.Remove(out.Name())

	args := append(append(append([]string{}, cc[1:]...), cflags...), "-o", out.Name(), src.Name())
	cmd := exec.Command(cc[0], args...)
	if msg, err := cmd.CombinedOutput(); err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			return "", fmt.Errorf("cudastub: no C compiler: %w", err)
		}
		return "", fmt.Errorf("cudastub: building %s with %s: %v\n%s", LibName, strings.Join(cc, " "), err, msg)
	}
	if err := os.Chmod(out.Name(), 0o755); err != nil {
		return "", fmt.Errorf("cudastub: %w", err)
	}
	if err := os.Rename(out.Name(), lib); err != nil {
		return "", fmt.Errorf("cudastub: installing %s: %w", lib, err)
	}
	return dir, nil
}
