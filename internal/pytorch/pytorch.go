// Package pytorch finds the Python interpreter that tensormp's Python
// side runs on: a Python 3 that imports torch and NumPy. The tests, the
// bench and the example look for it the same way, so that the first
// python3 on PATH, which may have neither, is not taken blindly.
package pytorch

import (
	"errors"
	"fmt"
	"os/exec"
	"strings"
)

// EnvVar names the interpreter to try first.
const EnvVar = "TENSORMP_PYTHON"

// Hint says how to get an interpreter Find accepts.
const Hint = "Debian: apt-get install python3-torch python3-numpy; or set " + EnvVar

// Candidates returns where Find looks, in order: $TENSORMP_PYTHON when
// set (env is os.Getenv's value), then /usr/bin/python3 (Debian's, where
// its python3-torch is), then python3 on PATH.
func Candidates(env string) []string {
	var c []string
	if env != "" {
		c = append(c, env)
	}
	return append(c, "/usr/bin/python3", "python3")
}

// Find returns the first of candidates that imports torch and NumPy, or
// an error that names them all and says why each failed.
func Find(candidates ...string) (string, error) {
	var whys []string
	for _, c := range candidates {
		err := Check(c)
		if err == nil {
			return c, nil
		}
		whys = append(whys, err.Error())
	}
	return "", fmt.Errorf("no Python 3 with torch and NumPy (%s): %s", Hint, strings.Join(whys, "; "))
}

// Check reports whether python runs and imports torch and NumPy.
func Check(python string) error {
	out, err := exec.Command(python, "-c", "import torch, numpy").CombinedOutput()
	if err == nil {
		return nil
	}
	var xe *exec.ExitError
	if errors.As(err, &xe) {
		// The interpreter ran: its last line says what it could not import.
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		return fmt.Errorf("%s: %s", python, lines[len(lines)-1])
	}
	return fmt.Errorf("%s: %w", python, err)
}
