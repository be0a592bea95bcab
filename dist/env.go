package dist

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// launch is what dist.Init learns from the launcher that started the
// process, or from explicit options.
type launch struct {
	launcher  string // "torchrun", "slurm", "kubeflow", "mpi" or "explicit"
	rank      int
	world     int
	localRank int
	store     string // rank 0's store, host:port
	bind      string // the address this rank's server listens on, without port
	remote    bool   // a launcher spread the ranks: listen beyond loopback
}

// EnvError is a launcher environment dist.Init cannot use: a variable
// missing, malformed or contradicting another.
type EnvError struct {
	Launcher string // which launcher's environment it looked like
	Var      string // the variable at fault
	Err      error
}

func (e *EnvError) Error() string {
	return fmt.Sprintf("dist: %s environment: %s: %v", e.Launcher, e.Var, e.Err)
}

func (e *EnvError) Unwrap() error { return e.Err }

var errMissing = errors.New("not set")

// detect reads the launcher's environment, in the order torchrun, Slurm,
// MPI, Kubeflow-style MASTER_ADDR/RANK; ok is false when none is present.
func detect(getenv func(string) string) (l launch, ok bool, err error) {
	has := func(k string) bool { return getenv(k) != "" }
	switch {
	case has("TORCHELASTIC_RUN_ID") || has("LOCAL_WORLD_SIZE") && has("GROUP_RANK"):
		l, err = fromTorchrun(getenv)
	case has("SLURM_PROCID"):
		l, err = fromSlurm(getenv)
	case has("OMPI_COMM_WORLD_RANK") || has("PMI_RANK"):
		l, err = fromMPI(getenv)
	case has("RANK") || has("WORLD_SIZE") || has("MASTER_ADDR"):
		l, err = fromMaster("kubeflow", getenv)
	default:
		return launch{}, false, nil
	}
	if err != nil {
		return launch{}, true, err
	}
	l.remote = true
	if name := getenv("TENSORMP_DIST_IFNAME"); name != "" {
		ip, err := ifaceAddr(name)
		if err != nil {
			return launch{}, true, &EnvError{l.launcher, "TENSORMP_DIST_IFNAME", err}
		}
		l.bind = ip
	}
	if a := getenv("TENSORMP_DIST_ADDR"); a != "" {
		if net.ParseIP(a) == nil {
			return launch{}, true, &EnvError{l.launcher, "TENSORMP_DIST_ADDR", fmt.Errorf("%q is not an IP address", a)}
		}
		l.bind = a
	}
	return l, true, nil
}

func fromTorchrun(getenv func(string) string) (launch, error) {
	l, err := fromMaster("torchrun", getenv)
	if err != nil {
		return l, err
	}
	if l.localRank, err = envInt(getenv, "torchrun", "LOCAL_RANK", 0, l.world); err != nil {
		return l, err
	}
	return l, nil
}

// fromMaster reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which
// torchrun and Kubeflow's PyTorchJob set alike. torchrun's agent may
// serve its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): the
// group's store then takes the next port, unless TENSORMP_DIST_PORT names
// one.
func fromMaster(name string, getenv func(string) string) (launch, error) {
	l := launch{launcher: name}
	var err error
	if l.world, err = envInt(getenv, name, "WORLD_SIZE", 1, 1<<20); err != nil {
		return l, err
	}
	if l.rank, err = envInt(getenv, name, "RANK", 0, l.world-1); err != nil {
		return l, err
	}
	host := getenv("MASTER_ADDR")
	if host == "" {
		return l, &EnvError{name, "MASTER_ADDR", errMissing}
	}
	port, err := storePort(getenv, name, "MASTER_PORT")
	if err != nil {
		return l, err
	}
	if strings.EqualFold(getenv("TORCHELASTIC_USE_AGENT_STORE"), "true") && getenv("TENSORMP_DIST_PORT") == "" {
		port++
	}
	l.store = net.JoinHostPort(host, strconv.Itoa(port))
	return l, nil
}

// fromSlurm reads srun's task variables. The store is on the first host
// of the job's node list, at TENSORMP_DIST_PORT or MASTER_PORT.
func fromSlurm(getenv func(string) string) (launch, error) {
	const name = "slurm"
	l := launch{launcher: name}
	var err error
	if l.world, err = envInt(getenv, name, "SLURM_NTASKS", 1, 1<<20); err != nil {
		return l, err
	}
	if l.rank, err = envInt(getenv, name, "SLURM_PROCID", 0, l.world-1); err != nil {
		return l, err
	}
	if getenv("SLURM_LOCALID") != "" {
		if l.localRank, err = envInt(getenv, name, "SLURM_LOCALID", 0, l.world-1); err != nil {
			return l, err
		}
	}
	host := getenv("MASTER_ADDR")
	if host == "" {
		nodes := getenv("SLURM_JOB_NODELIST")
		if nodes == "" {
			nodes = getenv("SLURM_NODELIST")
		}
		if host, err = firstNode(nodes); err != nil {
			return l, &EnvError{name, "SLURM_JOB_NODELIST", err}
		}
	}
	port, err := storePort(getenv, name, "MASTER_PORT")
	if err != nil {
		return l, err
	}
	l.store = net.JoinHostPort(host, strconv.Itoa(port))
	return l, nil
}

// fromMPI reads Open MPI's or PMI's rank and size. MPI says nothing of a
// store, so MASTER_ADDR and MASTER_PORT (or TENSORMP_DIST_PORT) must.
func fromMPI(getenv func(string) string) (launch, error) {
	const name = "mpi"
	l := launch{launcher: name}
	rankVar, sizeVar := "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
	if getenv(rankVar) == "" {
		rankVar, sizeVar = "PMI_RANK", "PMI_SIZE"
	}
	var err error
	if l.world, err = envInt(getenv, name, sizeVar, 1, 1<<20); err != nil {
		return l, err
	}
	if l.rank, err = envInt(getenv, name, rankVar, 0, l.world-1); err != nil {
		return l, err
	}
	if v := getenv("OMPI_COMM_WORLD_LOCAL_RANK"); v != "" {
		if l.localRank, err = envInt(getenv, name, "OMPI_COMM_WORLD_LOCAL_RANK", 0, l.world-1); err != nil {
			return l, err
		}
	}
	host := getenv("MASTER_ADDR")
	if host == "" {
		return l, &EnvError{name, "MASTER_ADDR", fmt.Errorf("%w: MPI names no store, so MASTER_ADDR and MASTER_PORT must", errMissing)}
	}
	port, err := storePort(getenv, name, "MASTER_PORT")
	if err != nil {
		return l, err
	}
	l.store = net.JoinHostPort(host, strconv.Itoa(port))
	return l, nil
}

// storePort is TENSORMP_DIST_PORT if set, else the launcher's variable.
func storePort(getenv func(string) string, name, v string) (int, error) {
	if getenv("TENSORMP_DIST_PORT") != "" {
		v = "TENSORMP_DIST_PORT"
	}
	return envInt(getenv, name, v, 1, 65535)
}

// envInt reads variable v as an integer in [lo, hi].
func envInt(getenv func(string) string, name, v string, lo, hi int) (int, error) {
	s := getenv(v)
	if s == "" {
		return 0, &EnvError{name, v, errMissing}
	}
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, &EnvError{name, v, fmt.Errorf("%q is not an integer", s)}
	}
	if n < lo || n > hi {
		return 0, &EnvError{name, v, fmt.Errorf("%d is outside [%d, %d]", n, lo, hi)}
	}
	return n, nil
}

// firstNode returns the first host of a Slurm node list such as
// "gpu[03-05,9],login1": "gpu03".
func firstNode(list string) (string, error) {
	list = strings.TrimSpace(list)
	if list == "" {
		return "", errMissing
	}
	end := len(list)
	if i := strings.IndexAny(list, ",["); i >= 0 {
		end = i
	}
	prefix := list[:end]
	if end == len(list) || list[end] == ',' {
		if prefix == "" {
			return "", fmt.Errorf("%q starts with an empty host", list)
		}
		return prefix, nil
	}
	rest := list[end+1:]
	rb := strings.IndexByte(rest, ']')
	if rb < 0 {
		return "", fmt.Errorf("%q has an unclosed range", list)
	}
	first := rest[:rb]
	if i := strings.IndexAny(first, ",-"); i >= 0 {
		first = first[:i]
	}
	if first == "" || strings.Trim(first, "0123456789") != "" {
		return "", fmt.Errorf("%q has a malformed range", list)
	}
	return prefix + first, nil
}

// ifaceAddr returns the first IPv4 address of the network interface
// called name (then its first address of any kind), as GLOO_SOCKET_IFNAME
// picks one.
func ifaceAddr(name string) (string, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return "", err
	}
	addrs, err := ifc.Addrs()
	if err != nil {
		return "", err
	}
	var first string
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		if ipn.IP.To4() != nil {
			return ipn.IP.String(), nil
		}
		if first == "" {
			first = ipn.IP.String()
		}
	}
	if first == "" {
		return "", fmt.Errorf("interface %s has no address", name)
	}
	return first, nil
}

// routeTo returns the local address this host uses to reach addr
// (host:port), for ranks that must listen where their peers can reach
// them. No packet is sent.
func routeTo(addr string) (string, error) {
	c, err := net.Dial("udp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	return c.LocalAddr().(*net.UDPAddr).IP.String(), nil
}

// hostID names this host for the same-host check: TENSORMP_DIST_HOST if
// set (tests pretend to be several hosts), else the hostname and boot id.
func hostID() string {
	if h := os.Getenv("TENSORMP_DIST_HOST"); h != "" {
		return h
	}
	name, _ := os.Hostname()
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return name + "/" + strings.TrimSpace(string(boot))
}
