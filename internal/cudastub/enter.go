package cudastub

import (
	"os"
	"strconv"
	"strings"
)

// environ returns the environment of the re-executed process: this
// one's, less LD_LIBRARY_PATH and the stand-in's variables, plus the library
// directory lib in front of the library path, the state directory, the
// configuration, and c.Env last (where a key repeats, the last wins).
func (c Config) environ(lib, state string) []string {
	var env []string
	old := ""
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		switch {
		case k == "LD_LIBRARY_PATH":
			old = v
		case k == EnvDir || k == EnvDevices || k == EnvNoVMM || k == EnvNoPeer || k == EnvDelayUS || k == EnvMemory:
		default:
			env = append(env, kv)
		}
	}
	path := lib
	if old != "" {
		path += ":" + old
	}
	devices := c.Devices
	if devices <= 0 {
		devices = 1
	}
	delay := c.Delay
	if delay <= 0 {
		delay = DefaultDelay
	}
	memory := c.Memory
	if memory <= 0 {
		memory = DefaultMemory
	}
	env = append(env,
		"LD_LIBRARY_PATH="+path,
		EnvDir+"="+state,
		EnvDevices+"="+strconv.Itoa(devices),
		EnvDelayUS+"="+strconv.FormatInt(delay.Microseconds(), 10),
		EnvMemory+"="+strconv.FormatInt(memory, 10),
	)
	if c.NoPeer {
		env = append(env, EnvNoPeer+"=1")
	}
	if c.NoVMM {
		env = append(env, EnvNoVMM+"=1")
	}
	return append(env, c.Env...)
}
