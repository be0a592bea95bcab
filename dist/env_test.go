package dist

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestDetectLaunchers(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want launch
	}{
		{"torchrun", map[string]string{
			"TORCHELASTIC_RUN_ID": "job", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
			"GROUP_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
		}, launch{launcher: "torchrun", rank: 3, world: 4, localRank: 1, store: "node0:29500", remote: true}},
		{"torchrun with the agent's store", map[string]string{
			"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
			"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
		}, launch{launcher: "torchrun", rank: 0, world: 2, store: "node0:29501", remote: true}},
		{"slurm", map[string]string{
			"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-05,9],login1",
			"MASTER_PORT": "29600",
		}, launch{launcher: "slurm", rank: 5, world: 8, localRank: 1, store: "gpu03:29600", remote: true}},
		{"slurm with TENSORMP_DIST_PORT", map[string]string{
			"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "a1,b2", "TENSORMP_DIST_PORT": "7000",
		}, launch{launcher: "slurm", rank: 0, world: 1, store: "a1:7000", remote: true}},
		{"kubeflow", map[string]string{
			"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
		}, launch{launcher: "kubeflow", rank: 2, world: 3, store: "job-master-0:23456", remote: true}},
		{"open mpi", map[string]string{
			"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
			"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
		}, launch{launcher: "mpi", rank: 1, world: 2, localRank: 1, store: "10.0.0.1:1234", remote: true}},
		{"pmi", map[string]string{"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
			launch{launcher: "mpi", rank: 0, world: 2, store: "h:1", remote: true}},
		{"interface", map[string]string{"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "1", "RANK": "0", "TENSORMP_DIST_IFNAME": "lo"},
			launch{launcher: "kubeflow", world: 1, store: "h:1", bind: "127.0.0.1", remote: true}},
		{"bind address", map[string]string{"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "1", "RANK": "0", "TENSORMP_DIST_ADDR": "127.0.0.3"},
			launch{launcher: "kubeflow", world: 1, store: "h:1", bind: "127.0.0.3", remote: true}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, ok, err := detect(envOf(c.env))
			require.NoError(t, err)
			assert.True(t, ok)
			assert.Equal(t, c.want, got)
		})
	}
	_, ok, err := detect(envOf(nil))
	assert.False(t, ok, "no launcher")
	assert.NoError(t, err)
}

func TestDetectMalformed(t *testing.T) {
	cases := []struct {
		name, varName string
		env           map[string]string
	}{
		{"rank past world", "RANK", map[string]string{"TORCHELASTIC_RUN_ID": "j", "RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}},
		{"world not a number", "WORLD_SIZE", map[string]string{"TORCHELASTIC_RUN_ID": "j", "RANK": "0", "WORLD_SIZE": "four", "MASTER_ADDR": "h", "MASTER_PORT": "1"}},
		{"no master", "MASTER_ADDR", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}},
		{"port out of range", "MASTER_PORT", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}},
		{"negative rank", "RANK", map[string]string{"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}},
		{"slurm without tasks", "SLURM_NTASKS", map[string]string{"SLURM_PROCID": "0"}},
		{"slurm node list", "SLURM_JOB_NODELIST", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[03-05", "MASTER_PORT": "1"}},
		{"slurm empty range", "SLURM_JOB_NODELIST", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[]", "MASTER_PORT": "1"}},
		{"mpi without a store", "MASTER_ADDR", map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}},
		{"mpi size zero", "OMPI_COMM_WORLD_SIZE", map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}},
		{"no such interface", "TENSORMP_DIST_IFNAME", map[string]string{"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TENSORMP_DIST_IFNAME": "tensormp-none0"}},
		{"bind not an ip", "TENSORMP_DIST_ADDR", map[string]string{"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TENSORMP_DIST_ADDR": "eth0"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, ok, err := detect(envOf(c.env))
			assert.True(t, ok, "a launcher environment, though a bad one")
			var ee *EnvError
			require.True(t, errors.As(err, &ee), "got %v", err)
			assert.Equal(t, c.varName, ee.Var)
			assert.Contains(t, err.Error(), c.varName)
		})
	}
}

func TestFirstNode(t *testing.T) {
	for in, want := range map[string]string{"n1": "n1", "n1,n2": "n1", "gpu[7-9]": "gpu7", "gpu[010,12]x": "gpu010", "a[3]": "a3"} {
		got, err := firstNode(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{"", ",n1", "gpu[", "gpu[a-b]"} {
		_, err := firstNode(in)
		assert.Error(t, err, in)
	}
}
