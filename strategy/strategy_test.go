package strategy_test

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/strategy"
)

func TestMain(m *testing.M) {
	reexec.Register("strategy.print", printStrategy)
	testmain.Run(m)
}

// printStrategy prints the strategy this process started with, and the
// error its environment gave, if any.
func printStrategy() int {
	errText := "<nil>"
	if err := strategy.EnvError(); err != nil {
		errText = err.Error()
	}
	os.Stdout.WriteString(string(strategy.Get()) + "\n" + errText + "\n")
	return 0
}

func TestDefault(t *testing.T) {
	if os.Getenv(strategy.EnvVar) != "" {
		t.Skipf("%s is set in the environment", strategy.EnvVar)
	}
	assert.Equal(t, strategy.FileDescriptor, strategy.Get())
	assert.Equal(t, []strategy.Strategy{strategy.FileDescriptor, strategy.FileSystem}, strategy.All())
}

func TestSetGetParse(t *testing.T) {
	old := strategy.Get()
	t.Cleanup(func() { _ = strategy.Set(old) })

	for _, s := range strategy.All() {
		p, err := strategy.Parse(s.String())
		require.NoError(t, err)
		require.Equal(t, s, p)
		require.NoError(t, strategy.Set(p))
		assert.Equal(t, s, strategy.Get())
	}

	_, err := strategy.Parse("shared_pointer")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "file_descriptor")
	assert.Contains(t, err.Error(), "file_system")

	before := strategy.Get()
	assert.Error(t, strategy.Set("bogus"))
	assert.Equal(t, before, strategy.Get(), "a failed Set changes nothing")
}

func TestEnvSeedsProcess(t *testing.T) {
	run := func(value string) (string, string) {
		cmd, err := reexec.Command(context.Background(), "strategy.print")
		require.NoError(t, err)
		cmd.Env = append(cmd.Env, strategy.EnvVar+"="+value)
		out, err := cmd.Output()
		require.NoError(t, err)
		lines := strings.SplitN(strings.TrimSpace(string(out)), "\n", 2)
		require.Len(t, lines, 2)
		return lines[0], lines[1]
	}
	got, errText := run("file_system")
	assert.Equal(t, "file_system", got)
	assert.Equal(t, "<nil>", errText)

	got, errText = run("nonsense")
	assert.Equal(t, "file_descriptor", got, "a bad value leaves the default")
	assert.Contains(t, errText, "unknown sharing strategy \"nonsense\"")
}
