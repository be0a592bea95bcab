/*
 * A stand-in for NVIDIA's CUDA driver library, libcuda.so.1, for machines
 * without a GPU. It exports the driver calls tensormp uses, with the
 * signatures of cuda.h, and behaves as the real driver does wherever a
 * program can tell, and more strictly wherever the real driver's behaviour
 * is unspecified:
 *
 *   - device work (memset, copies from pageable host memory, device to
 *     device copies, event records) is queued and runs later, in order,
 *     per context, as on the legacy default stream;
 *   - memory unmapped or freed under queued work faults the context that
 *     queued it, and the fault is sticky until the context is destroyed;
 *   - VMM memory is accessible only to the devices cuMemSetAccess named;
 *   - ordinals are per process (CUDA_VISIBLE_DEVICES), while everything
 *     that crosses processes names the physical device;
 *   - device memory is shared between processes through files of a state
 *     directory, and lives exactly as long as the kernel says a process
 *     holds it: by a lock of an open file description, by a mapping, or by
 *     an exported descriptor, so that a killed process lets go of its
 *     memory as it does on a GPU.
 *
 * Configuration, read once at cuInit:
 *   TMSTUB_DIR        state directory shared by the processes of one machine
 *                     (required: without it cuInit says there is no device)
 *   TMSTUB_DEVICES    physical devices, default 1
 *   TMSTUB_NO_VMM=1   devices without virtual memory management or POSIX
 *                     descriptor export (attributes 102 and 103 read 0)
 *   TMSTUB_DELAY_US   how long after enqueue device work runs, default 500
 *   TMSTUB_MEMORY     bytes per device, default 8 GiB
 *   CUDA_VISIBLE_DEVICES as the real driver reads it
 *
 * The state directory holds, per physical device p:
 *   dev<p>.mem   the device's memory: a sparse file
 *   dev<p>.tab   its allocation table, changed under flock
 *   dev<p>.mode  its compute mode, as text (missing: 0, default)
 *   dev<p>.excl  the file whose flock marks a process holding a context
 * and events.tab, the table of interprocess events.
 *
 * Everything runs under one process-wide mutex; one worker thread, with
 * every signal blocked, runs the queued work of every context.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- cuda.h types and values ------------------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef struct tm_ctx *CUcontext;
typedef struct tm_event *CUevent;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int type;
	int requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_ILLEGAL_ADDRESS = 700,
	CUDA_ERROR_NOT_PERMITTED = 800,
	CUDA_ERROR_NOT_SUPPORTED = 801,
	CUDA_ERROR_UNKNOWN = 999,
};

enum {
	ATTR_COMPUTE_MODE = 20,
	ATTR_VMM_SUPPORTED = 102,
	ATTR_POSIX_FD_SUPPORTED = 103,
	COMPUTE_MODE_EXCLUSIVE_PROCESS = 3,
	ALLOCATION_PINNED = 1,
	HANDLE_TYPE_POSIX_FD = 1,
	LOCATION_DEVICE = 1,
	ACCESS_NONE = 0,
	ACCESS_READ = 1,
	ACCESS_READWRITE = 3,
	GRANULARITY_MINIMUM = 0,
	GRANULARITY_RECOMMENDED = 1,
	EVENT_BLOCKING_SYNC = 1,
	EVENT_DISABLE_TIMING = 2,
	EVENT_INTERPROCESS = 4,
	IPC_LAZY_ENABLE_PEER_ACCESS = 1,
};

/* The VMM granularity of current GPUs, and the page of the host. */
#define GRANULE (2ULL << 20)
#define PAGE 4096ULL
#define MAXDEV 64
/* Room for a path in the state directory. */
#define PATHLEN (PATH_MAX + 64)

/* ---- shared tables ----------------------------------------------------- */

/*
 * dev<p>.tab: a header and a fixed array of entries, each a range of the
 * device's memory file. An entry is "used" while its range is allocated;
 * it is freed by a sweep once no open file description holds a lock on
 * any byte of it (see sweep). The layout is read by the Go package too
 * (Held): keep the two in step.
 */
#define TAB_MAGIC 0x3154425554534d54ULL /* "TMSTUBT1" */
#define TAB_ENTRIES 4096
enum { KIND_VMM = 1, KIND_LEGACY = 2 };
struct tab_entry {
	uint64_t off;         /* offset in dev<p>.mem, the allocation's identity */
	uint64_t span;        /* bytes it occupies */
	uint64_t gen;         /* generation: a reused range is a new allocation */
	int32_t kind;         /* KIND_VMM or KIND_LEGACY */
	int32_t owner;        /* legacy: the pid that allocated it */
	int32_t named;        /* legacy: not freed by its owner yet */
	int32_t used;
	uint64_t owner_start; /* legacy: the owner's start time, against pid reuse */
};
struct tab {
	uint64_t magic;
	uint64_t next_gen;
	uint64_t reserved[6];
	struct tab_entry e[TAB_ENTRIES];
};

/* The Go package reads these offsets (held_linux.go). */
_Static_assert(sizeof(struct tab_entry) == 48 && offsetof(struct tab_entry, used) == 36, "table entry layout");
_Static_assert(offsetof(struct tab, e) == 64, "table header layout");

/* events.tab: one slot per interprocess event, its counts changed atomically. */
#define EV_SLOTS 4096
struct ev_slot {
	uint64_t gen;
	int32_t owner;
	int32_t used;
	uint64_t owner_start;
	uint64_t recorded;  /* records enqueued */
	uint64_t completed; /* records run */
	int32_t failed;     /* a record was dropped by a fault: it never completes */
	int32_t pad;
};
struct evtab {
	uint64_t magic;
	uint64_t next_gen;
	uint64_t reserved[6];
	struct ev_slot s[EV_SLOTS];
};

/* ---- process state ----------------------------------------------------- */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv; /* the worker: work was queued (monotonic clock) */
static pthread_cond_t done_cv; /* queued work ran or was dropped; a context was destroyed */

static struct {
	int loaded;
	int ok; /* TMSTUB_DIR names a directory */
	char dir[PATH_MAX];
	int ndev;
	int novmm;
	int nopeer; /* no device can reach another's memory (PCIe without peer-to-peer) */
	int64_t delay_ns;
	long long memory;
	int nvis;
	int vis[MAXDEV];   /* ordinal -> physical */
	int ord[MAXDEV];   /* physical -> ordinal, -1 if not visible */
} cfg;

static int inited;
static unsigned long long self_start;
static int self_pid;

struct phys {
	int statefd; /* dev<p>.mem: this process's locks and mappings, -1 until used */
	int tabfd;
	struct tab *tab;
	dev_t st_dev;
	ino_t st_ino;
};
static struct phys phys[MAXDEV];

static int evtabfd = -1;
static struct evtab *evtab;

/* An allocation this process holds: one OFD read lock on its range, on
 * its device's state descriptor, while refs > 0. */
struct aref {
	int phys;
	uint64_t off, span, gen;
	int refs;
	struct aref *next;
};
static struct aref *arefs;

struct op;

/* A primary context, one per ordinal, refcounted by Retain and Release. */
struct tm_ctx {
	int ordinal, phys;
	int refs;
	int destroying;
	CUresult sticky;
	int exclfd;
	long long ops;
	struct op *qhead, *qtail; /* the legacy default stream */
	struct op *shead, *stail; /* another library's non-blocking stream (tmstub_side_memset) */
};
static struct tm_ctx ctxs[MAXDEV];
static __thread struct tm_ctx *cur;

enum { OP_MEMSET = 1, OP_HTOD, OP_DTOD, OP_RECORD };
struct op {
	int kind;
	struct tm_ctx *ctx;
	int64_t due;
	int dphys, sphys;
	uint64_t doff, soff;
	size_t n;
	unsigned char val;
	void *buf;             /* OP_HTOD: the staged source */
	uintptr_t dva, sva;    /* the device addresses touched, 0 for none */
	struct tm_event *ev;   /* OP_RECORD */
	uint64_t target;
	struct op *next;
};

struct tm_event {
	struct tm_ctx *ctx;
	unsigned flags;
	uint64_t recorded, completed;
	int slot;         /* interprocess: its slot, else -1 */
	uint64_t gen;
	int opened;       /* opened from another process's handle */
	int owner;
	unsigned long long owner_start;
	int pending;      /* queued records and waiters that keep it */
	int dead;         /* destroyed; freed when pending drops to 0 */
	struct tm_event *next;
};
static struct tm_event *events;

/* cuMemAlloc memory and opened legacy IPC memory: mapped PROT_NONE at
 * a fresh address, so that a device pointer is a real host address that
 * the host cannot touch, as on a discrete GPU. */
struct lalloc {
	uintptr_t ptr;
	size_t size, maplen;
	struct aref *a;
	struct tm_ctx *ctx;
	struct lalloc *next;
};
static struct lalloc *lallocs;

struct ipcopen {
	uintptr_t ptr;
	size_t size, maplen;
	struct aref *a;
	struct tm_ctx *ctx;
	int count;
	int phys;
	uint64_t off, gen;
	struct ipcopen *next;
};
static struct ipcopen *ipcopens;

struct vhandle {
	unsigned long long id;
	struct aref *a;
	int imported;
	CUmemAllocationProp prop;
	struct vhandle *next;
};
static struct vhandle *vhandles;
static unsigned long long next_handle = 0x7a5700000001ULL;

struct resv {
	uintptr_t base;
	size_t size;
	struct resv *next;
};
static struct resv *resvs;

struct vmap {
	uintptr_t ptr;
	size_t size;
	struct aref *a;
	uint64_t rd, wr; /* physical devices allowed to read, to write */
	struct vmap *next;
};
static struct vmap *vmaps;

static long long syncs;
static int shm_made;
static int worker_started;

/* ---- small helpers ----------------------------------------------------- */

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn)
{
	return a < b + bn && b < a + an;
}

static void path_of(char *buf, size_t n, const char *name, int p)
{
	if (p >= 0)
		snprintf(buf, n, "%s/dev%d.%s", cfg.dir, p, name);
	else
		snprintf(buf, n, "%s/%s", cfg.dir, name);
}

static int flock_retry(int fd, int op)
{
	int r;
	while ((r = flock(fd, op)) < 0 && errno == EINTR)
		;
	return r;
}

static int ofd_lock(int fd, short type, uint64_t off, uint64_t len)
{
	struct flock fl;
	memset(&fl, 0, sizeof fl);
	fl.l_type = type;
	fl.l_whence = SEEK_SET;
	fl.l_start = (off_t)off;
	fl.l_len = (off_t)len;
	for (;;) {
		if (fcntl(fd, F_OFD_SETLK, &fl) == 0)
			return 0;
		if (errno != EINTR)
			return -1;
	}
}

static int pwrite_all(int fd, const void *buf, size_t n, uint64_t off)
{
	const char *p = buf;
	while (n > 0) {
		ssize_t w = pwrite(fd, p, n, (off_t)off);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		p += w;
		n -= (size_t)w;
		off += (uint64_t)w;
	}
	return 0;
}

static int pread_all(int fd, void *buf, size_t n, uint64_t off)
{
	char *p = buf;
	while (n > 0) {
		ssize_t r = pread(fd, p, n, (off_t)off);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		p += r;
		n -= (size_t)r;
		off += (uint64_t)r;
	}
	return 0;
}

static int fill(int fd, uint64_t off, size_t n, unsigned char v)
{
	static unsigned char chunk[1 << 16];
	memset(chunk, v, sizeof chunk);
	while (n > 0) {
		size_t k = n < sizeof chunk ? n : sizeof chunk;
		if (pwrite_all(fd, chunk, k, off) < 0)
			return -1;
		off += k;
		n -= k;
	}
	return 0;
}

/* proc_alive reports whether process pid, started at start (clock ticks
 * after boot, /proc/<pid>/stat field 22), still runs: not gone, not a
 * zombie, not another process that reused the pid. */
static int proc_stat(int pid, unsigned long long *start, char *state)
{
	char path[64], buf[1024];
	snprintf(path, sizeof path, "/proc/%d/stat", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	char *p = strrchr(buf, ')');
	if (!p || p[1] != ' ')
		return -1;
	p += 2;
	*state = *p;
	for (int field = 3; field < 22 && *p; p++)
		if (*p == ' ')
			field++;
	*start = strtoull(p, NULL, 10);
	return 0;
}

static int proc_alive(int pid, unsigned long long start)
{
	unsigned long long s;
	char st;
	if (pid <= 0 || proc_stat(pid, &s, &st) < 0)
		return 0;
	return s == start && st != 'Z' && st != 'X';
}

/* ---- configuration ----------------------------------------------------- */

/* uuid_of gives physical device p its UUID: a first byte that differs
 * per device (so that short prefixes of the string form are unique, as
 * they are between real GPUs), then "tmstub-gpu-" and the index. */
static void uuid_of(int p, unsigned char out[16])
{
	char b[32];
	snprintf(b, sizeof b, "tmstub-gpu-%04d", p);
	out[0] = (unsigned char)(0x10 + p);
	memcpy(out + 1, b, 15);
}

/* uuid_string writes the form nvidia-smi and CUDA_VISIBLE_DEVICES use:
 * GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx. */
static void uuid_string(int p, char out[41])
{
	unsigned char u[16];
	uuid_of(p, u);
	char *s = out + sprintf(out, "GPU-");
	for (int i = 0; i < 16; i++) {
		if (i == 4 || i == 6 || i == 8 || i == 10)
			*s++ = '-';
		s += sprintf(s, "%02x", u[i]);
	}
}

static long long env_ll(const char *name, long long def)
{
	const char *v = getenv(name);
	if (!v || !*v)
		return def;
	char *end;
	errno = 0;
	long long x = strtoll(v, &end, 10);
	if (errno || *end)
		return def;
	return x;
}

/* visible_entry returns the physical device an entry of
 * CUDA_VISIBLE_DEVICES names, or -1 if it is invalid: an index, or a
 * unique prefix of a device's UUID string. */
static int visible_entry(const char *s, size_t n)
{
	if (n == 0)
		return -1;
	int digits = 1;
	for (size_t i = 0; i < n; i++)
		if (s[i] < '0' || s[i] > '9')
			digits = 0;
	if (digits) {
		if (n > 4)
			return -1;
		int p = 0;
		for (size_t i = 0; i < n; i++)
			p = p * 10 + (s[i] - '0');
		return p < cfg.ndev ? p : -1;
	}
	if (n < 5 || strncmp(s, "GPU-", 4) != 0)
		return -1;
	int found = -1;
	for (int p = 0; p < cfg.ndev; p++) {
		char u[41];
		uuid_string(p, u);
		if (n <= strlen(u) && strncmp(u, s, n) == 0) {
			if (found >= 0)
				return -1; /* ambiguous */
			found = p;
		}
	}
	return found;
}

static void load_config(void)
{
	if (cfg.loaded)
		return;
	cfg.loaded = 1;
	self_pid = getpid();
	char st;
	proc_stat(self_pid, &self_start, &st);

	const char *dir = getenv("TMSTUB_DIR");
	struct stat sb;
	cfg.ok = dir && *dir && strlen(dir) < sizeof cfg.dir - 32 && stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode);
	if (cfg.ok)
		snprintf(cfg.dir, sizeof cfg.dir, "%s", dir);
	long long nd = env_ll("TMSTUB_DEVICES", 1);
	cfg.ndev = nd < 0 ? 0 : nd > MAXDEV ? MAXDEV : (int)nd;
	const char *nv = getenv("TMSTUB_NO_VMM");
	cfg.novmm = nv && *nv && strcmp(nv, "0") != 0;
	const char *np = getenv("TMSTUB_NO_PEER");
	cfg.nopeer = np && *np && strcmp(np, "0") != 0;
	long long d = env_ll("TMSTUB_DELAY_US", 500);
	cfg.delay_ns = (d < 0 ? 0 : d) * 1000LL;
	long long m = env_ll("TMSTUB_MEMORY", 8LL << 30);
	cfg.memory = m > 0 ? m : 8LL << 30;

	for (int p = 0; p < MAXDEV; p++) {
		cfg.ord[p] = -1;
		phys[p].statefd = -1;
		phys[p].tabfd = -1;
	}
	/* CUDA_VISIBLE_DEVICES: unset means every device; otherwise the
	 * entries in order, up to the first invalid or repeated one. */
	const char *v = getenv("CUDA_VISIBLE_DEVICES");
	if (!v) {
		for (int p = 0; p < cfg.ndev; p++)
			cfg.vis[cfg.nvis++] = p;
	} else {
		const char *s = v;
		while (cfg.nvis < cfg.ndev) {
			const char *e = strchr(s, ',');
			size_t n = e ? (size_t)(e - s) : strlen(s);
			int p = visible_entry(s, n);
			if (p < 0 || cfg.ord[p] >= 0)
				break;
			cfg.ord[p] = cfg.nvis;
			cfg.vis[cfg.nvis++] = p;
			if (!e)
				break;
			s = e + 1;
		}
	}
	for (int i = 0; i < cfg.nvis; i++) {
		cfg.ord[cfg.vis[i]] = i;
		ctxs[i].ordinal = i;
		ctxs[i].phys = cfg.vis[i];
		ctxs[i].exclfd = -1;
	}
}

__attribute__((constructor)) static void stub_init(void)
{
	pthread_condattr_t a;
	pthread_condattr_init(&a);
	pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
	pthread_cond_init(&work_cv, &a);
	pthread_condattr_destroy(&a);
	pthread_cond_init(&done_cv, NULL);
}

/* ---- files of the state directory -------------------------------------- */

/* map_table opens (creating) a table file and maps it shared. */
static void *map_table(const char *path, size_t size, int *fdp)
{
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return NULL;
	struct stat sb;
	flock_retry(fd, LOCK_EX);
	if (fstat(fd, &sb) < 0 || ((size_t)sb.st_size < size && ftruncate(fd, (off_t)size) < 0)) {
		flock_retry(fd, LOCK_UN);
		close(fd);
		return NULL;
	}
	void *t = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (t == MAP_FAILED) {
		flock_retry(fd, LOCK_UN);
		close(fd);
		return NULL;
	}
	uint64_t *magic = t;
	if (*magic != TAB_MAGIC)
		*magic = TAB_MAGIC;
	flock_retry(fd, LOCK_UN);
	*fdp = fd;
	return t;
}

/* phys_open opens device p's memory file, this process's one state
 * descriptor for it, and its table. */
static CUresult phys_open(int p)
{
	struct phys *d = &phys[p];
	if (d->statefd >= 0)
		return CUDA_SUCCESS;
	char path[PATHLEN];
	path_of(path, sizeof path, "mem", p);
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return CUDA_ERROR_UNKNOWN;
	struct stat sb;
	if (fstat(fd, &sb) < 0) {
		close(fd);
		return CUDA_ERROR_UNKNOWN;
	}
	path_of(path, sizeof path, "tab", p);
	d->tab = map_table(path, sizeof(struct tab), &d->tabfd);
	if (!d->tab) {
		close(fd);
		return CUDA_ERROR_UNKNOWN;
	}
	d->st_dev = sb.st_dev;
	d->st_ino = sb.st_ino;
	d->statefd = fd;
	return CUDA_SUCCESS;
}

static CUresult evtab_open(void)
{
	if (evtab)
		return CUDA_SUCCESS;
	char path[PATHLEN];
	path_of(path, sizeof path, "events.tab", -1);
	evtab = map_table(path, sizeof(struct evtab), &evtabfd);
	return evtab ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
}

static int read_mode(int p)
{
	char path[PATHLEN], buf[32];
	path_of(path, sizeof path, "mode", p);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	return atoi(buf);
}

/* The file the real driver keeps in /dev/shm for a process's
 * interprocess events, from its first one until its last primary
 * context reference is released; a killed process leaves it. */
static void shm_path(char *buf, size_t n)
{
	snprintf(buf, n, "/dev/shm/cuda.shm.0.%x.1", (unsigned)self_pid);
}

static void shm_make(void)
{
	if (shm_made)
		return;
	char path[64];
	shm_path(path, sizeof path);
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd >= 0) {
		close(fd);
		shm_made = 1;
	}
}

/* ---- the allocation tables --------------------------------------------- */

static void tab_lock(int p) { flock_retry(phys[p].tabfd, LOCK_EX); }
static void tab_unlock(int p) { flock_retry(phys[p].tabfd, LOCK_UN); }

/* sweep frees the entries of device p that no process holds: none of
 * whose bytes any open file description has locked. The test uses a
 * description that never holds a lock, since a description's own locks
 * never conflict with it. Freed memory is given back to the file system,
 * as a GPU's memory is to its driver. Called with the table locked. */
static void sweep(int p)
{
	char path[PATHLEN];
	path_of(path, sizeof path, "mem", p);
	int probe = open(path, O_RDONLY | O_CLOEXEC);
	if (probe < 0)
		return;
	struct tab *t = phys[p].tab;
	for (int i = 0; i < TAB_ENTRIES; i++) {
		struct tab_entry *e = &t->e[i];
		if (!e->used)
			continue;
		struct flock fl;
		memset(&fl, 0, sizeof fl);
		fl.l_type = F_WRLCK;
		fl.l_whence = SEEK_SET;
		fl.l_start = (off_t)e->off;
		fl.l_len = (off_t)e->span;
		if (fcntl(probe, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK) {
			fallocate(phys[p].statefd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)e->off, (off_t)e->span);
			memset(e, 0, sizeof *e);
		}
	}
	close(probe);
}

static uint64_t used_bytes(int p)
{
	uint64_t n = 0;
	for (int i = 0; i < TAB_ENTRIES; i++)
		if (phys[p].tab->e[i].used)
			n += phys[p].tab->e[i].span;
	return n;
}

static int cmp_off(const void *a, const void *b)
{
	const struct tab_entry *x = *(struct tab_entry *const *)a, *y = *(struct tab_entry *const *)b;
	return x->off < y->off ? -1 : x->off > y->off;
}

/* tab_alloc finds room first-fit for span bytes aligned to align, after
 * a sweep, and fills in a new entry. Called with the table locked. */
static CUresult tab_alloc(int p, uint64_t span, uint64_t align, struct tab_entry **out)
{
	struct tab *t = phys[p].tab;
	sweep(p);
	if ((long long)(used_bytes(p) + span) > cfg.memory || span > (uint64_t)cfg.memory)
		return CUDA_ERROR_OUT_OF_MEMORY;
	static struct tab_entry *sorted[TAB_ENTRIES];
	int n = 0;
	struct tab_entry *slot = NULL;
	for (int i = 0; i < TAB_ENTRIES; i++) {
		if (t->e[i].used)
			sorted[n++] = &t->e[i];
		else if (!slot)
			slot = &t->e[i];
	}
	if (!slot)
		return CUDA_ERROR_OUT_OF_MEMORY;
	qsort(sorted, (size_t)n, sizeof sorted[0], cmp_off);
	uint64_t at = 0;
	for (int i = 0; i < n; i++) {
		if (at + span <= sorted[i]->off)
			break;
		uint64_t end = sorted[i]->off + sorted[i]->span;
		if (end > at)
			at = (end + align - 1) / align * align;
	}
	struct stat sb;
	if (fstat(phys[p].statefd, &sb) < 0)
		return CUDA_ERROR_UNKNOWN;
	if ((uint64_t)sb.st_size < at + span && ftruncate(phys[p].statefd, (off_t)(at + span)) < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	memset(slot, 0, sizeof *slot);
	slot->off = at;
	slot->span = span;
	slot->gen = ++t->next_gen;
	slot->used = 1;
	*out = slot;
	return CUDA_SUCCESS;
}

static struct tab_entry *tab_find(int p, uint64_t off)
{
	for (int i = 0; i < TAB_ENTRIES; i++) {
		struct tab_entry *e = &phys[p].tab->e[i];
		if (e->used && e->off == off)
			return e;
	}
	return NULL;
}

/* ---- holding allocations ----------------------------------------------- */

/* aref_get takes a reference on an allocation for this process, locking
 * its range on the state descriptor at the first. Locks of one open file
 * description merge, so the process counts its references itself. */
static struct aref *aref_get(int p, const struct tab_entry *e)
{
	for (struct aref *a = arefs; a; a = a->next)
		if (a->phys == p && a->off == e->off && a->gen == e->gen) {
			a->refs++;
			return a;
		}
	struct aref *a = calloc(1, sizeof *a);
	if (!a)
		return NULL;
	if (ofd_lock(phys[p].statefd, F_RDLCK, e->off, e->span) < 0) {
		free(a);
		return NULL;
	}
	a->phys = p;
	a->off = e->off;
	a->span = e->span;
	a->gen = e->gen;
	a->refs = 1;
	a->next = arefs;
	arefs = a;
	return a;
}

static void aref_put(struct aref *a)
{
	if (--a->refs > 0)
		return;
	ofd_lock(phys[a->phys].statefd, F_UNLCK, a->off, a->span);
	for (struct aref **pp = &arefs; *pp; pp = &(*pp)->next)
		if (*pp == a) {
			*pp = a->next;
			break;
		}
	free(a);
}

/* new_alloc allocates span bytes of device p, held by this process,
 * filled with garbage: device memory is not cleared. */
static CUresult new_alloc(int p, uint64_t span, int kind, struct aref **out)
{
	CUresult r = phys_open(p);
	if (r)
		return r;
	tab_lock(p);
	struct tab_entry *e;
	r = tab_alloc(p, span, kind == KIND_VMM ? GRANULE : PAGE, &e);
	if (r) {
		tab_unlock(p);
		return r;
	}
	e->kind = kind;
	if (kind == KIND_LEGACY) {
		e->owner = self_pid;
		e->owner_start = self_start;
		e->named = 1;
	}
	struct aref *a = aref_get(p, e);
	if (!a) {
		memset(e, 0, sizeof *e);
		tab_unlock(p);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	tab_unlock(p);
	if (fill(phys[p].statefd, a->off, a->span, 0xab) < 0) {
		aref_put(a);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*out = a;
	return CUDA_SUCCESS;
}

/* ---- the queues -------------------------------------------------------- */

static void free_op(struct op *o)
{
	free(o->buf);
	free(o);
}

static void event_finalize(struct tm_event *e);

static void record_done(struct op *o, int ran)
{
	struct tm_event *e = o->ev;
	if (ran && e->completed < o->target)
		e->completed = o->target;
	if (e->slot >= 0 && evtab) {
		struct ev_slot *s = &evtab->s[e->slot];
		if (__atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) == e->gen) {
			if (ran)
				__atomic_add_fetch(&s->completed, 1, __ATOMIC_RELEASE);
			else
				__atomic_store_n(&s->failed, 1, __ATOMIC_RELEASE);
		}
	}
	e->pending--;
	if (e->dead && e->pending == 0)
		event_finalize(e);
}

/* drop_from drops from its queue the operation from and every one after
 * it, and leaves the queue's tail right. */
static void drop_from(struct op **head, struct op **tail, struct op *from)
{
	struct op **pp = head;
	while (*pp && *pp != from)
		pp = &(*pp)->next;
	struct op *o = *pp;
	*pp = NULL;
	*tail = NULL;
	for (struct op *q = *head; q; q = q->next)
		*tail = q;
	while (o) {
		struct op *next = o->next;
		if (o->kind == OP_RECORD)
			record_done(o, 0);
		free_op(o);
		o = next;
	}
}

static int queued_in(struct op *head, struct op *o)
{
	for (; head; head = head->next)
		if (head == o)
			return 1;
	return 0;
}

/* fault gives context c a sticky error, as a GPU fault does: from, the
 * first queued operation to drop, and every one after it in its stream
 * never run, nor does the other stream's queued work; NULL (a fault
 * found at enqueue) drops nothing. */
static void fault(struct tm_ctx *c, CUresult code, struct op *from)
{
	if (!c->sticky)
		c->sticky = code;
	if (from && queued_in(c->shead, from)) {
		drop_from(&c->shead, &c->stail, from);
		drop_from(&c->qhead, &c->qtail, c->qhead);
	} else if (from) {
		drop_from(&c->qhead, &c->qtail, from);
		drop_from(&c->shead, &c->stail, c->shead);
	}
	pthread_cond_broadcast(&done_cv);
}

/* drop_touching models the GPU's MMU fault: unmapping device memory
 * does not wait for the work queued on it (cuMemUnmap and cuMemRelease
 * are not cudaFree), so a queued operation that touches [va, va+n)
 * faults when it runs. The call itself succeeds. cuMemFree and
 * cuIpcCloseMemHandle are held to the same rule, more strictly than the
 * real driver, which in practice waits in cuMemFree but does not
 * promise to: code must synchronize before it lets go of memory. */
static void drop_touching(uintptr_t va, size_t n)
{
	for (int i = 0; i < cfg.nvis; i++) {
		struct tm_ctx *c = &ctxs[i];
		for (int side = 0; side < 2; side++) {
			for (struct op *o = side ? c->shead : c->qhead; o; o = o->next) {
				if ((o->dva && overlaps(o->dva, o->n, va, n)) || (o->sva && overlaps(o->sva, o->n, va, n))) {
					fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, o);
					break;
				}
			}
		}
	}
}

static void run_op(struct op *o)
{
	int bad = 0;
	switch (o->kind) {
	case OP_MEMSET:
		bad = fill(phys[o->dphys].statefd, o->doff, o->n, o->val) < 0;
		break;
	case OP_HTOD:
		bad = pwrite_all(phys[o->dphys].statefd, o->buf, o->n, o->doff) < 0;
		break;
	case OP_DTOD: {
		size_t chunk = o->n < (1u << 20) ? o->n : (1u << 20);
		char *b = malloc(chunk);
		if (!b) {
			bad = 1;
			break;
		}
		for (size_t done = 0; done < o->n && !bad; done += chunk) {
			size_t k = o->n - done < chunk ? o->n - done : chunk;
			bad = pread_all(phys[o->sphys].statefd, b, k, o->soff + done) < 0 ||
			      pwrite_all(phys[o->dphys].statefd, b, k, o->doff + done) < 0;
		}
		free(b);
		break;
	}
	case OP_RECORD:
		record_done(o, 1);
		break;
	}
	if (bad)
		fault(o->ctx, CUDA_ERROR_UNKNOWN, o->ctx->qhead ? o->ctx->qhead : o->ctx->shead);
}

/* The worker runs every context's queue: each operation no earlier than
 * the delay after it was queued, each queue in order. */
static void *worker(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&mu);
	for (;;) {
		struct op *best = NULL;
		for (int i = 0; i < cfg.nvis; i++) {
			if (ctxs[i].qhead && (!best || ctxs[i].qhead->due < best->due))
				best = ctxs[i].qhead;
			if (ctxs[i].shead && (!best || ctxs[i].shead->due < best->due))
				best = ctxs[i].shead;
		}
		if (!best) {
			pthread_cond_wait(&work_cv, &mu);
			continue;
		}
		int64_t now = now_ns();
		if (best->due > now) {
			struct timespec ts = {(time_t)(best->due / 1000000000LL), (long)(best->due % 1000000000LL)};
			pthread_cond_timedwait(&work_cv, &mu, &ts);
			continue;
		}
		struct tm_ctx *c = best->ctx;
		if (best == c->shead) {
			c->shead = best->next;
			if (!c->shead)
				c->stail = NULL;
		} else {
			c->qhead = best->next;
			if (!c->qhead)
				c->qtail = NULL;
		}
		best->next = NULL;
		run_op(best);
		free_op(best);
		pthread_cond_broadcast(&done_cv);
	}
	return NULL;
}

static CUresult start_worker(void)
{
	if (worker_started)
		return CUDA_SUCCESS;
	/* Blocked signals are inherited: the worker must not take the
	 * signals the Go runtime (or any host program) sends its threads. */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	pthread_attr_t at;
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	pthread_t t;
	int r = pthread_create(&t, &at, worker, NULL);
	pthread_attr_destroy(&at);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (r)
		return CUDA_ERROR_OUT_OF_MEMORY;
	worker_started = 1;
	return CUDA_SUCCESS;
}

/* An operation takes time as the device's does: it lands (runs here) no
 * earlier than the delay after it was queued, and no earlier than its own
 * length after the one before it in the queue landed, at 10 bytes a
 * nanosecond (a memset of 256 MiB takes 27 ms): a big piece of work is
 * still under way a while after the call that queued it returned. */
static void enqueue_on(struct tm_ctx *c, struct op *o, struct op **head, struct op **tail)
{
	int64_t start = now_ns() + cfg.delay_ns;
	if (*tail && (*tail)->due > start)
		start = (*tail)->due;
	o->ctx = c;
	o->due = start + (int64_t)(o->n / 10);
	o->next = NULL;
	if (*tail)
		(*tail)->next = o;
	else
		*head = o;
	*tail = o;
	if (o->kind != OP_RECORD)
		c->ops++;
	pthread_cond_signal(&work_cv);
}

/* enqueue queues o on the context's legacy default stream. */
static void enqueue(struct tm_ctx *c, struct op *o) { enqueue_on(c, o, &c->qhead, &c->qtail); }

/* drain_legacy waits for the legacy default stream: what
 * cuStreamSynchronize(0) and a copy to pageable host memory wait for.
 * Work on a non-blocking stream is not ordered with it. */
static void drain_legacy(struct tm_ctx *c)
{
	while (c->qhead)
		pthread_cond_wait(&done_cv, &mu);
}

/* drain waits for every stream of the context. */
static void drain(struct tm_ctx *c)
{
	while (c->qhead || c->shead)
		pthread_cond_wait(&done_cv, &mu);
}

/* ---- contexts ---------------------------------------------------------- */

static CUresult begin(void)
{
	pthread_mutex_lock(&mu);
	if (!inited) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_NOT_INITIALIZED;
	}
	return CUDA_SUCCESS;
}

#define LOCKED(call)                              \
	do {                                      \
		CUresult r_ = begin();            \
		if (r_)                           \
			return r_;                \
		r_ = (call);                      \
		pthread_mutex_unlock(&mu);        \
		return r_;                        \
	} while (0)

static int valid_ctx_ptr(struct tm_ctx *c)
{
	for (int i = 0; i < cfg.nvis; i++)
		if (c == &ctxs[i])
			return 1;
	return 0;
}

/* need_ctx returns the context current on this thread, for every call
 * that acts on it: none, or one destroyed since, is INVALID_CONTEXT, and
 * one with a sticky error gives that error. */
static CUresult need_ctx(struct tm_ctx **out)
{
	struct tm_ctx *c = cur;
	if (!c || !valid_ctx_ptr(c) || c->refs <= 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (c->sticky)
		return c->sticky;
	*out = c;
	return CUDA_SUCCESS;
}

static int valid_ordinal(int d) { return d >= 0 && d < cfg.nvis; }

static int total_refs(void)
{
	int n = 0;
	for (int i = 0; i < cfg.nvis; i++)
		n += ctxs[i].refs;
	return n;
}

static void lalloc_free(struct lalloc *l);
static void ipcopen_free(struct ipcopen *o);
static void event_unlink(struct tm_event *e);

/* teardown runs when a primary context's last reference is released:
 * its queue has drained; the driver frees what the context owns. */
static void teardown(struct tm_ctx *c)
{
	for (struct lalloc *l = lallocs, *next; l; l = next) {
		next = l->next;
		if (l->ctx == c)
			lalloc_free(l);
	}
	for (struct ipcopen *o = ipcopens, *next; o; o = next) {
		next = o->next;
		if (o->ctx == c)
			ipcopen_free(o);
	}
	for (struct tm_event *e = events, *next; e; e = next) {
		next = e->next;
		if (e->ctx == c)
			event_unlink(e);
	}
	c->sticky = 0;
	if (c->exclfd >= 0) {
		close(c->exclfd);
		c->exclfd = -1;
	}
	if (total_refs() == 0 && shm_made) {
		char path[64];
		shm_path(path, sizeof path);
		unlink(path);
		shm_made = 0;
	}
}

static CUresult ctx_retain(CUcontext *pctx, CUdevice dev)
{
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	if (!valid_ordinal(dev))
		return CUDA_ERROR_INVALID_DEVICE;
	struct tm_ctx *c = &ctxs[dev];
	while (c->destroying)
		pthread_cond_wait(&done_cv, &mu);
	if (c->refs == 0) {
		CUresult r = phys_open(c->phys);
		if (r)
			return r;
		r = start_worker();
		if (r)
			return r;
		/* Compute mode: an exclusive-process device refuses a context
		 * to a second process while one holds one. The flock is the
		 * holding, and the kernel drops it when the holder dies. */
		char path[PATHLEN];
		path_of(path, sizeof path, "excl", c->phys);
		int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
		if (fd < 0)
			return CUDA_ERROR_UNKNOWN;
		if (read_mode(c->phys) == COMPUTE_MODE_EXCLUSIVE_PROCESS) {
			if (flock_retry(fd, LOCK_EX | LOCK_NB) < 0) {
				close(fd);
				return CUDA_ERROR_DEVICE_UNAVAILABLE;
			}
		} else {
			flock_retry(fd, LOCK_SH | LOCK_NB);
		}
		c->exclfd = fd;
		c->sticky = 0;
	}
	c->refs++;
	*pctx = c;
	return CUDA_SUCCESS;
}

static CUresult ctx_release(CUdevice dev)
{
	if (!valid_ordinal(dev))
		return CUDA_ERROR_INVALID_DEVICE;
	struct tm_ctx *c = &ctxs[dev];
	if (c->refs <= 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (--c->refs > 0)
		return CUDA_SUCCESS;
	/* Destroying a context waits for its work first. */
	c->destroying = 1;
	drain(c);
	teardown(c);
	c->destroying = 0;
	pthread_cond_broadcast(&done_cv);
	return CUDA_SUCCESS;
}

static CUresult ctx_set(CUcontext c)
{
	if (!c) {
		cur = NULL;
		return CUDA_SUCCESS;
	}
	if (!valid_ctx_ptr(c) || c->refs <= 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	cur = c;
	return CUDA_SUCCESS;
}

static CUresult ctx_sync(void)
{
	struct tm_ctx *c = cur;
	if (!c || !valid_ctx_ptr(c) || c->refs <= 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	syncs++;
	if (c->sticky)
		return c->sticky;
	drain(c);
	return c->sticky;
}

/* ---- finding device memory --------------------------------------------- */

struct where {
	int phys;
	uint64_t off;
	struct vmap *m; /* VMM memory: its mapping; NULL for cuMemAlloc or IPC memory */
};

static int inside(uintptr_t base, size_t size, uintptr_t p, size_t n)
{
	return p >= base && n <= size && p - base <= size - n;
}

/* find locates [p, p+n) inside one allocation or mapping this process
 * knows, else INVALID_VALUE. */
static CUresult find(uintptr_t p, size_t n, struct where *w)
{
	if (p + n < p)
		return CUDA_ERROR_INVALID_VALUE;
	for (struct lalloc *l = lallocs; l; l = l->next)
		if (inside(l->ptr, l->size, p, n)) {
			*w = (struct where){l->a->phys, l->a->off + (p - l->ptr), NULL};
			return CUDA_SUCCESS;
		}
	for (struct ipcopen *o = ipcopens; o; o = o->next)
		if (inside(o->ptr, o->size, p, n)) {
			*w = (struct where){o->a->phys, o->a->off + (p - o->ptr), NULL};
			return CUDA_SUCCESS;
		}
	for (struct vmap *m = vmaps; m; m = m->next)
		if (inside(m->ptr, m->size, p, n)) {
			*w = (struct where){m->a->phys, m->a->off + (p - m->ptr), m};
			return CUDA_SUCCESS;
		}
	return CUDA_ERROR_INVALID_VALUE;
}

/* find_prefix locates the allocation or mapping holding p and returns in
 * *k how much of [p, p+n) it holds: a range of VMM memory may go on into
 * the next mapping of its reservation, as the GPU's page tables let a
 * copy do (PyTorch's expandable segments rely on it). */
static CUresult find_prefix(uintptr_t p, size_t n, struct where *w, size_t *k)
{
	for (struct lalloc *l = lallocs; l; l = l->next)
		if (inside(l->ptr, l->size, p, 1)) {
			*w = (struct where){l->a->phys, l->a->off + (p - l->ptr), NULL};
			*k = n < l->size - (p - l->ptr) ? n : l->size - (p - l->ptr);
			return CUDA_SUCCESS;
		}
	for (struct ipcopen *o = ipcopens; o; o = o->next)
		if (inside(o->ptr, o->size, p, 1)) {
			*w = (struct where){o->a->phys, o->a->off + (p - o->ptr), NULL};
			*k = n < o->size - (p - o->ptr) ? n : o->size - (p - o->ptr);
			return CUDA_SUCCESS;
		}
	for (struct vmap *m = vmaps; m; m = m->next)
		if (inside(m->ptr, m->size, p, 1)) {
			*w = (struct where){m->a->phys, m->a->off + (p - m->ptr), m};
			*k = n < m->size - (p - m->ptr) ? n : m->size - (p - m->ptr);
			return CUDA_SUCCESS;
		}
	return CUDA_ERROR_INVALID_VALUE;
}

/* allowed reports whether context c's device may read (or write) the
 * memory w: VMM memory only where cuMemSetAccess said so; cuMemAlloc
 * and IPC memory from any device, as unified addressing copies do. */
static int allowed(const struct where *w, struct tm_ctx *c, int write)
{
	if (!w->m)
		return 1;
	uint64_t bit = 1ULL << c->phys;
	return ((write ? w->m->wr : w->m->rd) & bit) != 0;
}

/* ---- memory calls ------------------------------------------------------ */

static CUresult mem_alloc(CUdeviceptr *dptr, size_t n)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!dptr || n == 0)
		return CUDA_ERROR_INVALID_VALUE;
	uint64_t span = (n + PAGE - 1) / PAGE * PAGE;
	struct lalloc *l = calloc(1, sizeof *l);
	if (!l)
		return CUDA_ERROR_OUT_OF_MEMORY;
	struct aref *a;
	r = new_alloc(c->phys, span, KIND_LEGACY, &a);
	if (r) {
		free(l);
		return r;
	}
	void *m = mmap(NULL, span, PROT_NONE, MAP_SHARED, phys[c->phys].statefd, (off_t)a->off);
	if (m == MAP_FAILED) {
		aref_put(a);
		free(l);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	l->ptr = (uintptr_t)m;
	l->size = n;
	l->maplen = span;
	l->a = a;
	l->ctx = c;
	l->next = lallocs;
	lallocs = l;
	*dptr = l->ptr;
	return CUDA_SUCCESS;
}

static void unname(struct aref *a)
{
	int p = a->phys;
	tab_lock(p);
	struct tab_entry *e = tab_find(p, a->off);
	if (e && e->gen == a->gen)
		e->named = 0;
	tab_unlock(p);
}

static void lalloc_free(struct lalloc *l)
{
	drop_touching(l->ptr, l->size);
	munmap((void *)l->ptr, l->maplen);
	unname(l->a);
	aref_put(l->a);
	for (struct lalloc **pp = &lallocs; *pp; pp = &(*pp)->next)
		if (*pp == l) {
			*pp = l->next;
			break;
		}
	free(l);
}

static CUresult mem_free(CUdeviceptr p)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	for (struct lalloc *l = lallocs; l; l = l->next)
		if (l->ptr == p) {
			lalloc_free(l);
			return CUDA_SUCCESS;
		}
	return CUDA_ERROR_INVALID_VALUE;
}

static CUresult mem_set(CUdeviceptr p, unsigned char v, size_t n)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (n == 0)
		return CUDA_SUCCESS;
	struct where w;
	if ((r = find(p, n, &w)))
		return r;
	if (!allowed(&w, c, 1)) {
		fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, NULL);
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	}
	struct op *o = calloc(1, sizeof *o);
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o->kind = OP_MEMSET;
	o->dphys = w.phys;
	o->doff = w.off;
	o->n = n;
	o->val = v;
	o->dva = p;
	enqueue(c, o);
	return CUDA_SUCCESS;
}

/* A copy from pageable host memory is staged at the call and lands
 * later: the call returns before the DMA to device memory completes. */
static CUresult mem_htod(CUdeviceptr dst, const void *src, size_t n)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (n == 0)
		return CUDA_SUCCESS;
	if (!src)
		return CUDA_ERROR_INVALID_VALUE;
	struct where w;
	if ((r = find(dst, n, &w)))
		return r;
	if (!allowed(&w, c, 1)) {
		fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, NULL);
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	}
	struct op *o = calloc(1, sizeof *o);
	void *buf = malloc(n);
	if (!o || !buf) {
		free(o);
		free(buf);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	memcpy(buf, src, n);
	o->kind = OP_HTOD;
	o->dphys = w.phys;
	o->doff = w.off;
	o->n = n;
	o->buf = buf;
	o->dva = dst;
	enqueue(c, o);
	return CUDA_SUCCESS;
}

/* A copy to pageable host memory waits for the context's queued work,
 * then copies. */
static CUresult mem_dtoh(void *dst, CUdeviceptr src, size_t n)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (n == 0)
		return CUDA_SUCCESS;
	if (!dst)
		return CUDA_ERROR_INVALID_VALUE;
	struct where w;
	if ((r = find(src, n, &w)))
		return r;
	if (!allowed(&w, c, 0)) {
		fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, NULL);
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	}
	drain_legacy(c);
	if (c->sticky)
		return c->sticky;
	if (c->refs <= 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	/* The memory may have gone while this call waited. */
	if ((r = find(src, n, &w)))
		return r;
	if (!allowed(&w, c, 0)) {
		fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, NULL);
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	}
	if (pread_all(phys[w.phys].statefd, dst, n, w.off) < 0)
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

/* A device-to-device copy may cross from one mapping into the next of
 * the same reservation (only VMM memory has such neighbours): it is
 * checked whole, then queued as one operation per piece, in order. */
static CUresult mem_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (n == 0)
		return CUDA_SUCCESS;
	if (dst + n < dst || src + n < src)
		return CUDA_ERROR_INVALID_VALUE;
	for (int pass = 0; pass < 2; pass++) {
		for (size_t done = 0; done < n;) {
			struct where wd, ws;
			size_t kd, ks;
			if ((r = find_prefix(dst + done, n - done, &wd, &kd)) ||
			    (r = find_prefix(src + done, n - done, &ws, &ks)))
				return r;
			if ((kd < n - done && !wd.m) || (ks < n - done && !ws.m))
				return CUDA_ERROR_INVALID_VALUE; /* only mappings have neighbours */
			size_t k = kd < ks ? kd : ks;
			if (pass == 0) {
				if (!allowed(&wd, c, 1) || !allowed(&ws, c, 0)) {
					fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, NULL);
					return CUDA_ERROR_ILLEGAL_ADDRESS;
				}
			} else {
				struct op *o = calloc(1, sizeof *o);
				if (!o)
					return CUDA_ERROR_OUT_OF_MEMORY;
				o->kind = OP_DTOD;
				o->dphys = wd.phys;
				o->doff = wd.off;
				o->sphys = ws.phys;
				o->soff = ws.off;
				o->n = k;
				o->dva = dst + done;
				o->sva = src + done;
				enqueue(c, o);
			}
			done += k;
		}
	}
	return CUDA_SUCCESS;
}

/* For cuMemAlloc and IPC memory the range is the allocation; for VMM
 * memory it is only the mapping (the physical chunk) holding the
 * pointer, as real drivers report: adjacent mappings of one reservation
 * are separate ranges. */
static CUresult mem_range(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	uintptr_t b = 0;
	size_t s = 0;
	int found = 0;
	for (struct lalloc *l = lallocs; l && !found; l = l->next)
		if (inside(l->ptr, l->size, p, 1))
			b = l->ptr, s = l->size, found = 1;
	for (struct ipcopen *o = ipcopens; o && !found; o = o->next)
		if (inside(o->ptr, o->size, p, 1))
			b = o->ptr, s = o->size, found = 1;
	for (struct vmap *m = vmaps; m && !found; m = m->next)
		if (inside(m->ptr, m->size, p, 1))
			b = m->ptr, s = m->size, found = 1;
	if (!found)
		return CUDA_ERROR_INVALID_VALUE;
	if (base)
		*base = b;
	if (size)
		*size = s;
	return CUDA_SUCCESS;
}

/* Free memory is device-wide: what every process's allocations leave. */
static CUresult mem_info(size_t *freep, size_t *totalp)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!freep || !totalp)
		return CUDA_ERROR_INVALID_VALUE;
	int p = c->phys;
	tab_lock(p);
	sweep(p);
	uint64_t used = used_bytes(p);
	tab_unlock(p);
	*totalp = (size_t)cfg.memory;
	*freep = used >= (uint64_t)cfg.memory ? 0 : (size_t)((uint64_t)cfg.memory - used);
	return CUDA_SUCCESS;
}

/* ---- legacy IPC -------------------------------------------------------- */

#define IPC_MEM_MAGIC 0x4d4350494255534dULL /* "MSUBIPCM" */
#define IPC_EV_MAGIC 0x5645435049425553ULL  /* "SUBIPCEV" */
struct ipc_mem {
	uint64_t magic;
	int32_t phys, owner;
	uint64_t off, gen, size, owner_start;
	char pad[16];
};
struct ipc_ev {
	uint64_t magic;
	int32_t slot, owner;
	uint64_t gen, owner_start;
	char pad[32];
};
_Static_assert(sizeof(struct ipc_mem) == 64, "CUipcMemHandle is 64 bytes");
_Static_assert(sizeof(struct ipc_ev) == 64, "CUipcEventHandle is 64 bytes");

static CUresult ipc_get_mem(CUipcMemHandle *h, CUdeviceptr p)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	for (struct lalloc *l = lallocs; l; l = l->next)
		if (l->ptr == p) {
			struct ipc_mem m = {IPC_MEM_MAGIC, l->a->phys, self_pid, l->a->off, l->a->gen, l->size, self_start, {0}};
			memcpy(h, &m, sizeof m);
			return CUDA_SUCCESS;
		}
	return CUDA_ERROR_INVALID_VALUE;
}

static CUresult ipc_open_mem(CUdeviceptr *pdptr, CUipcMemHandle h, unsigned flags)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	struct ipc_mem m;
	memcpy(&m, &h, sizeof m);
	if (!pdptr || (flags & ~(unsigned)IPC_LAZY_ENABLE_PEER_ACCESS) || m.magic != IPC_MEM_MAGIC ||
	    m.phys < 0 || m.phys >= cfg.ndev)
		return CUDA_ERROR_INVALID_VALUE;
	/* The real driver refuses to open a handle in the process that made it. */
	if (m.owner == self_pid)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (cfg.ord[m.phys] < 0)
		return CUDA_ERROR_INVALID_DEVICE;
	/* Opening one handle again gives the same mapping, counted. */
	for (struct ipcopen *o = ipcopens; o; o = o->next)
		if (o->phys == m.phys && o->off == m.off && o->gen == m.gen) {
			o->count++;
			*pdptr = o->ptr;
			return CUDA_SUCCESS;
		}
	if ((r = phys_open(m.phys)))
		return r;
	struct ipcopen *o = calloc(1, sizeof *o);
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	tab_lock(m.phys);
	struct tab_entry *e = tab_find(m.phys, m.off);
	/* The memory lives only while its exporter does, and until it is freed. */
	if (!e || e->gen != m.gen || e->kind != KIND_LEGACY || !e->named || e->owner != m.owner ||
	    !proc_alive(m.owner, m.owner_start)) {
		tab_unlock(m.phys);
		free(o);
		return CUDA_ERROR_INVALID_HANDLE;
	}
	struct aref *a = aref_get(m.phys, e);
	tab_unlock(m.phys);
	if (!a) {
		free(o);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	void *p = mmap(NULL, a->span, PROT_NONE, MAP_SHARED, phys[m.phys].statefd, (off_t)a->off);
	if (p == MAP_FAILED) {
		aref_put(a);
		free(o);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	o->ptr = (uintptr_t)p;
	o->size = m.size <= a->span ? m.size : a->span;
	o->maplen = a->span;
	o->a = a;
	o->ctx = c;
	o->count = 1;
	o->phys = m.phys;
	o->off = m.off;
	o->gen = m.gen;
	o->next = ipcopens;
	ipcopens = o;
	*pdptr = o->ptr;
	return CUDA_SUCCESS;
}

static void ipcopen_free(struct ipcopen *o)
{
	drop_touching(o->ptr, o->size);
	munmap((void *)o->ptr, o->maplen);
	aref_put(o->a);
	for (struct ipcopen **pp = &ipcopens; *pp; pp = &(*pp)->next)
		if (*pp == o) {
			*pp = o->next;
			break;
		}
	free(o);
}

static CUresult ipc_close_mem(CUdeviceptr p)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	for (struct ipcopen *o = ipcopens; o; o = o->next)
		if (o->ptr == p) {
			if (--o->count == 0)
				ipcopen_free(o);
			return CUDA_SUCCESS;
		}
	return CUDA_ERROR_INVALID_VALUE;
}

/* ---- events ------------------------------------------------------------ */

static int valid_event(struct tm_event *e)
{
	for (struct tm_event *x = events; x; x = x->next)
		if (x == e)
			return 1;
	return 0;
}

static void event_finalize(struct tm_event *e)
{
	if (e->slot >= 0 && !e->opened && evtab) {
		flock_retry(evtabfd, LOCK_EX);
		struct ev_slot *s = &evtab->s[e->slot];
		if (s->gen == e->gen) {
			s->used = 0;
			__atomic_store_n(&s->gen, ++evtab->next_gen, __ATOMIC_RELEASE);
		}
		flock_retry(evtabfd, LOCK_UN);
	}
	free(e);
}

/* event_unlink destroys e: it is gone for the caller at once, and freed
 * once no queued record or waiter refers to it. */
static void event_unlink(struct tm_event *e)
{
	for (struct tm_event **pp = &events; *pp; pp = &(*pp)->next)
		if (*pp == e) {
			*pp = e->next;
			break;
		}
	e->dead = 1;
	if (e->pending == 0)
		event_finalize(e);
}

static struct tm_event *event_new(struct tm_ctx *c, unsigned flags)
{
	struct tm_event *e = calloc(1, sizeof *e);
	if (!e)
		return NULL;
	e->ctx = c;
	e->flags = flags;
	e->slot = -1;
	e->next = events;
	events = e;
	return e;
}

static CUresult event_create(CUevent *pe, unsigned flags)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!pe || (flags & ~(unsigned)(EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING | EVENT_INTERPROCESS)))
		return CUDA_ERROR_INVALID_VALUE;
	/* An interprocess event must not record timing. */
	if ((flags & EVENT_INTERPROCESS) && !(flags & EVENT_DISABLE_TIMING))
		return CUDA_ERROR_INVALID_VALUE;
	int slot = -1;
	uint64_t gen = 0;
	if (flags & EVENT_INTERPROCESS) {
		if ((r = evtab_open()))
			return r;
		flock_retry(evtabfd, LOCK_EX);
		for (int i = 0; i < EV_SLOTS && slot < 0; i++) {
			struct ev_slot *s = &evtab->s[i];
			if (!s->used || !proc_alive(s->owner, s->owner_start)) {
				slot = i;
				s->used = 1;
				s->owner = self_pid;
				s->owner_start = self_start;
				s->recorded = 0;
				s->completed = 0;
				s->failed = 0;
				gen = ++evtab->next_gen;
				__atomic_store_n(&s->gen, gen, __ATOMIC_RELEASE);
			}
		}
		flock_retry(evtabfd, LOCK_UN);
		if (slot < 0)
			return CUDA_ERROR_OUT_OF_MEMORY;
		shm_make();
	}
	struct tm_event *e = event_new(c, flags);
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->slot = slot;
	e->gen = gen;
	e->owner = self_pid;
	e->owner_start = self_start;
	*pe = e;
	return CUDA_SUCCESS;
}

static CUresult event_record(CUevent e, CUstream s)
{
	if (s)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!valid_event(e))
		return CUDA_ERROR_INVALID_HANDLE;
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	/* The event and the stream must belong to one context. */
	if (e->ctx != c)
		return CUDA_ERROR_INVALID_HANDLE;
	struct op *o = calloc(1, sizeof *o);
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o->kind = OP_RECORD;
	o->ev = e;
	o->target = ++e->recorded;
	e->pending++;
	if (e->slot >= 0) {
		struct ev_slot *sl = &evtab->s[e->slot];
		if (__atomic_load_n(&sl->gen, __ATOMIC_ACQUIRE) == e->gen)
			__atomic_add_fetch(&sl->recorded, 1, __ATOMIC_RELEASE);
	}
	enqueue(c, o);
	return CUDA_SUCCESS;
}

static CUresult event_sync(CUevent e)
{
	if (!valid_event(e))
		return CUDA_ERROR_INVALID_HANDLE;
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (e->ctx->sticky)
		return e->ctx->sticky;
	if (!e->opened) {
		uint64_t target = e->recorded;
		e->pending++;
		while (e->completed < target && !e->ctx->sticky)
			pthread_cond_wait(&done_cv, &mu);
		r = e->ctx->sticky;
		if (--e->pending == 0 && e->dead)
			event_finalize(e);
		return r;
	}
	/* Opened from another process: wait for the records made before
	 * this call, and give up with an error, not a hang, when the owner
	 * is gone with a record unfinished. */
	struct ev_slot *s = &evtab->s[e->slot];
	uint64_t target = __atomic_load_n(&s->recorded, __ATOMIC_ACQUIRE);
	e->pending++;
	r = CUDA_SUCCESS;
	for (;;) {
		if (__atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) != e->gen)
			break; /* destroyed by its owner: its last record stands */
		if (__atomic_load_n(&s->completed, __ATOMIC_ACQUIRE) >= target)
			break;
		if (__atomic_load_n(&s->failed, __ATOMIC_ACQUIRE) || !proc_alive(e->owner, e->owner_start)) {
			r = CUDA_ERROR_UNKNOWN;
			break;
		}
		pthread_mutex_unlock(&mu);
		struct timespec ts = {0, 200000};
		nanosleep(&ts, NULL);
		pthread_mutex_lock(&mu);
	}
	if (--e->pending == 0 && e->dead)
		event_finalize(e);
	return r;
}

static CUresult event_destroy(CUevent e)
{
	if (!valid_event(e))
		return CUDA_ERROR_INVALID_HANDLE;
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	event_unlink(e);
	return CUDA_SUCCESS;
}

static CUresult ipc_get_event(CUipcEventHandle *h, CUevent e)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	if (!valid_event(e) || e->slot < 0 || e->opened)
		return CUDA_ERROR_INVALID_HANDLE;
	struct ipc_ev m = {IPC_EV_MAGIC, e->slot, self_pid, e->gen, self_start, {0}};
	memcpy(h, &m, sizeof m);
	return CUDA_SUCCESS;
}

static CUresult ipc_open_event(CUevent *pe, CUipcEventHandle h)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	struct ipc_ev m;
	memcpy(&m, &h, sizeof m);
	if (!pe || m.magic != IPC_EV_MAGIC || m.slot < 0 || m.slot >= EV_SLOTS)
		return CUDA_ERROR_INVALID_VALUE;
	if (m.owner == self_pid)
		return CUDA_ERROR_INVALID_CONTEXT;
	if ((r = evtab_open()))
		return r;
	struct ev_slot *s = &evtab->s[m.slot];
	if (__atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) != m.gen || s->owner != m.owner ||
	    !proc_alive(m.owner, m.owner_start))
		return CUDA_ERROR_INVALID_HANDLE;
	struct tm_event *e = event_new(c, EVENT_DISABLE_TIMING | EVENT_INTERPROCESS);
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->slot = m.slot;
	e->gen = m.gen;
	e->opened = 1;
	e->owner = m.owner;
	e->owner_start = m.owner_start;
	*pe = e;
	return CUDA_SUCCESS;
}

/* ---- virtual memory management ----------------------------------------- */

static struct vhandle *handle_of(unsigned long long id)
{
	for (struct vhandle *h = vhandles; h; h = h->next)
		if (h->id == id)
			return h;
	return NULL;
}

static CUresult check_prop(const CUmemAllocationProp *prop)
{
	if (!prop || prop->type != ALLOCATION_PINNED || prop->location.type != LOCATION_DEVICE)
		return CUDA_ERROR_INVALID_VALUE;
	if (!valid_ordinal(prop->location.id))
		return CUDA_ERROR_INVALID_DEVICE;
	return CUDA_SUCCESS;
}

static struct vhandle *handle_new(struct aref *a, int imported)
{
	struct vhandle *h = calloc(1, sizeof *h);
	if (!h)
		return NULL;
	h->id = next_handle++;
	h->a = a;
	h->imported = imported;
	h->next = vhandles;
	vhandles = h;
	return h;
}

static CUresult vmm_create(CUmemGenericAllocationHandle *out, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!out || flags)
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = check_prop(prop)))
		return r;
	if (prop->requestedHandleTypes != 0 && prop->requestedHandleTypes != HANDLE_TYPE_POSIX_FD)
		return CUDA_ERROR_NOT_SUPPORTED;
	/* A device without VMM support (attribute 102 reads 0) refuses it all. */
	if (cfg.novmm)
		return CUDA_ERROR_NOT_SUPPORTED;
	if (size == 0 || size % GRANULE)
		return CUDA_ERROR_INVALID_VALUE;
	struct aref *a;
	if ((r = new_alloc(cfg.vis[prop->location.id], size, KIND_VMM, &a)))
		return r;
	struct vhandle *h = handle_new(a, 0);
	if (!h) {
		aref_put(a);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	h->prop = *prop;
	*out = h->id;
	return CUDA_SUCCESS;
}

static CUresult vmm_release(CUmemGenericAllocationHandle id)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	struct vhandle *h = handle_of(id);
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	for (struct vhandle **pp = &vhandles; *pp; pp = &(*pp)->next)
		if (*pp == h) {
			*pp = h->next;
			break;
		}
	aref_put(h->a);
	free(h);
	return CUDA_SUCCESS;
}

/* An export is a new open file description of the device's memory file:
 * every export of every allocation of a device is the same inode, as
 * every real export is an open of /dev/nvidiactl. The description holds
 * its own lock on the allocation, so it keeps the memory alive after the
 * handles, the mappings and the exporting process are gone; its file
 * position names the allocation. The real driver promises no
 * close-on-exec, so there is none. */
static CUresult vmm_export(void *shareable, CUmemGenericAllocationHandle id, int type, unsigned long long flags)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!shareable || flags || type != HANDLE_TYPE_POSIX_FD)
		return CUDA_ERROR_INVALID_VALUE;
	struct vhandle *h = handle_of(id);
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	/* Only a handle made to be exported as a descriptor may be; an
	 * imported one is read pessimistically as not (see vmm_props). */
	if (h->imported || !(h->prop.requestedHandleTypes & HANDLE_TYPE_POSIX_FD))
		return CUDA_ERROR_INVALID_VALUE;
	char path[64];
	snprintf(path, sizeof path, "/proc/self/fd/%d", phys[h->a->phys].statefd);
	int fd = open(path, O_RDWR);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (ofd_lock(fd, F_RDLCK, h->a->off, h->a->span) < 0 || lseek(fd, (off_t)h->a->off, SEEK_SET) < 0) {
		close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*(int *)shareable = fd;
	return CUDA_SUCCESS;
}

static CUresult vmm_import(CUmemGenericAllocationHandle *out, void *os_handle, int type)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!out || type != HANDLE_TYPE_POSIX_FD)
		return CUDA_ERROR_INVALID_VALUE;
	int fd = (int)(intptr_t)os_handle;
	struct stat sb;
	if (fd < 0 || fstat(fd, &sb) < 0)
		return CUDA_ERROR_INVALID_VALUE;
	/* Only a descriptor of this machine's device memory. */
	int p = -1;
	for (int i = 0; i < cfg.ndev && p < 0; i++) {
		char path[PATHLEN];
		struct stat ps;
		path_of(path, sizeof path, "mem", i);
		if (stat(path, &ps) == 0 && ps.st_dev == sb.st_dev && ps.st_ino == sb.st_ino)
			p = i;
	}
	if (p < 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (cfg.ord[p] < 0)
		return CUDA_ERROR_INVALID_DEVICE;
	off_t pos = lseek(fd, 0, SEEK_CUR);
	if (pos < 0)
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = phys_open(p)))
		return r;
	tab_lock(p);
	struct tab_entry *e = tab_find(p, (uint64_t)pos);
	if (!e || e->kind != KIND_VMM) {
		tab_unlock(p);
		return CUDA_ERROR_INVALID_VALUE;
	}
	struct aref *a = aref_get(p, e);
	tab_unlock(p);
	if (!a)
		return CUDA_ERROR_OUT_OF_MEMORY;
	struct vhandle *h = handle_new(a, 1);
	if (!h) {
		aref_put(a);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*out = h->id;
	return CUDA_SUCCESS;
}

/* The properties of a created handle are what was asked for; those of
 * an imported one report no requested handle types, the pessimistic
 * reading (the documentation promises nothing there), and the device as
 * this process numbers it. */
static CUresult vmm_props(CUmemAllocationProp *prop, CUmemGenericAllocationHandle id)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!prop)
		return CUDA_ERROR_INVALID_VALUE;
	struct vhandle *h = handle_of(id);
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	if (h->imported) {
		memset(prop, 0, sizeof *prop);
		prop->type = ALLOCATION_PINNED;
	} else {
		*prop = h->prop;
	}
	prop->location.type = LOCATION_DEVICE;
	prop->location.id = cfg.ord[h->a->phys];
	return CUDA_SUCCESS;
}

static CUresult vmm_granularity(size_t *g, const CUmemAllocationProp *prop, int option)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!g || (option != GRANULARITY_MINIMUM && option != GRANULARITY_RECOMMENDED))
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = check_prop(prop)))
		return r;
	*g = GRANULE;
	return CUDA_SUCCESS;
}

static CUresult vmm_reserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags)
{
	(void)addr; /* a hint, which the driver may ignore */
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!ptr || flags || size == 0 || size % GRANULE || (align & (align - 1)))
		return CUDA_ERROR_INVALID_VALUE;
	size_t a = align > GRANULE ? align : GRANULE;
	struct resv *v = calloc(1, sizeof *v);
	if (!v)
		return CUDA_ERROR_OUT_OF_MEMORY;
	char *m = mmap(NULL, size + a, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (m == MAP_FAILED) {
		free(v);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	uintptr_t base = ((uintptr_t)m + a - 1) / a * a;
	if (base > (uintptr_t)m)
		munmap(m, base - (uintptr_t)m);
	uintptr_t end = (uintptr_t)m + size + a;
	if (end > base + size)
		munmap((void *)(base + size), end - (base + size));
	v->base = base;
	v->size = size;
	v->next = resvs;
	resvs = v;
	*ptr = base;
	return CUDA_SUCCESS;
}

static CUresult vmm_address_free(CUdeviceptr ptr, size_t size)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	for (struct resv **pp = &resvs; *pp; pp = &(*pp)->next) {
		struct resv *v = *pp;
		if (v->base != ptr || v->size != size)
			continue;
		for (struct vmap *m = vmaps; m; m = m->next)
			if (overlaps(m->ptr, m->size, v->base, v->size))
				return CUDA_ERROR_INVALID_VALUE; /* still mapped */
		munmap((void *)v->base, v->size);
		*pp = v->next;
		free(v);
		return CUDA_SUCCESS;
	}
	return CUDA_ERROR_INVALID_VALUE;
}

static CUresult vmm_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle id,
                        unsigned long long flags)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	/* "offset: currently must be zero"; "flags: currently must be zero". */
	if (offset || flags || size == 0 || size % GRANULE || ptr % GRANULE)
		return CUDA_ERROR_INVALID_VALUE;
	struct vhandle *h = handle_of(id);
	if (!h || size > h->a->span)
		return CUDA_ERROR_INVALID_VALUE;
	int reserved = 0;
	for (struct resv *v = resvs; v && !reserved; v = v->next)
		reserved = inside(v->base, v->size, ptr, size);
	if (!reserved)
		return CUDA_ERROR_INVALID_VALUE;
	for (struct vmap *m = vmaps; m; m = m->next)
		if (overlaps(m->ptr, m->size, ptr, size))
			return CUDA_ERROR_INVALID_VALUE;
	struct vmap *m = calloc(1, sizeof *m);
	if (!m)
		return CUDA_ERROR_OUT_OF_MEMORY;
	/* PROT_NONE: the host cannot touch device memory; no device may
	 * either until cuMemSetAccess. */
	void *p = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, phys[h->a->phys].statefd, (off_t)h->a->off);
	if (p == MAP_FAILED) {
		free(m);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	h->a->refs++;
	m->ptr = ptr;
	m->size = size;
	m->a = h->a;
	m->next = vmaps;
	vmaps = m;
	return CUDA_SUCCESS;
}

static CUresult vmm_unmap(CUdeviceptr ptr, size_t size)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	for (struct vmap **pp = &vmaps; *pp; pp = &(*pp)->next) {
		struct vmap *m = *pp;
		if (m->ptr != ptr || m->size != size)
			continue;
		drop_touching(m->ptr, m->size);
		/* The reservation stays: put inaccessible memory back. */
		mmap((void *)m->ptr, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
		*pp = m->next;
		aref_put(m->a);
		free(m);
		return CUDA_SUCCESS;
	}
	return CUDA_ERROR_INVALID_VALUE;
}

static CUresult vmm_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
	struct tm_ctx *c;
	CUresult r = need_ctx(&c);
	if (r)
		return r;
	if (!desc || count == 0)
		return CUDA_ERROR_INVALID_VALUE;
	struct vmap *m = NULL;
	for (struct vmap *x = vmaps; x && !m; x = x->next)
		if (x->ptr == ptr && x->size == size)
			m = x;
	if (!m)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < count; i++) {
		if (desc[i].location.type != LOCATION_DEVICE)
			return CUDA_ERROR_INVALID_VALUE;
		if (!valid_ordinal(desc[i].location.id))
			return CUDA_ERROR_INVALID_DEVICE;
		int f = desc[i].flags;
		if (f != ACCESS_NONE && f != ACCESS_READ && f != ACCESS_READWRITE)
			return CUDA_ERROR_INVALID_VALUE;
		/* A device that cannot reach the memory's device as a peer
		 * cannot be given access to it. */
		if (cfg.nopeer && f != ACCESS_NONE && cfg.vis[desc[i].location.id] != m->a->phys)
			return CUDA_ERROR_INVALID_DEVICE;
	}
	for (size_t i = 0; i < count; i++) {
		uint64_t bit = 1ULL << cfg.vis[desc[i].location.id];
		int f = desc[i].flags;
		m->rd = (f & ACCESS_READ) ? m->rd | bit : m->rd & ~bit;
		m->wr = f == ACCESS_READWRITE ? m->wr | bit : m->wr & ~bit;
	}
	return CUDA_SUCCESS;
}

/* ---- devices ----------------------------------------------------------- */

static CUresult dev_count(int *n)
{
	if (!n)
		return CUDA_ERROR_INVALID_VALUE;
	*n = cfg.nvis;
	return CUDA_SUCCESS;
}

static CUresult dev_get(CUdevice *d, int ordinal)
{
	if (!d)
		return CUDA_ERROR_INVALID_VALUE;
	if (!valid_ordinal(ordinal))
		return CUDA_ERROR_INVALID_DEVICE;
	*d = ordinal;
	return CUDA_SUCCESS;
}

/* Only the attributes the stand-in models: asking any other is an error,
 * so that code cannot come to depend on an answer nobody checked. */
static CUresult dev_attr(int *v, int attr, CUdevice d)
{
	if (!v)
		return CUDA_ERROR_INVALID_VALUE;
	if (!valid_ordinal(d))
		return CUDA_ERROR_INVALID_DEVICE;
	switch (attr) {
	case ATTR_COMPUTE_MODE:
		*v = read_mode(cfg.vis[d]);
		return CUDA_SUCCESS;
	case ATTR_VMM_SUPPORTED:
	case ATTR_POSIX_FD_SUPPORTED:
		*v = !cfg.novmm;
		return CUDA_SUCCESS;
	}
	return CUDA_ERROR_INVALID_VALUE;
}

static CUresult dev_uuid(CUuuid *u, CUdevice d)
{
	if (!u)
		return CUDA_ERROR_INVALID_VALUE;
	if (!valid_ordinal(d))
		return CUDA_ERROR_INVALID_DEVICE;
	uuid_of(cfg.vis[d], (unsigned char *)u->bytes);
	return CUDA_SUCCESS;
}

static CUresult dev_peer(int *can, CUdevice d, CUdevice peer)
{
	if (!can)
		return CUDA_ERROR_INVALID_VALUE;
	if (!valid_ordinal(d) || !valid_ordinal(peer))
		return CUDA_ERROR_INVALID_DEVICE;
	*can = d != peer && !cfg.nopeer;
	return CUDA_SUCCESS;
}

/* ---- the exported driver calls ----------------------------------------- */

EXPORT CUresult cuInit(unsigned int flags)
{
	pthread_mutex_lock(&mu);
	load_config();
	CUresult r = CUDA_SUCCESS;
	if (flags)
		r = CUDA_ERROR_INVALID_VALUE;
	else if (!cfg.ok || cfg.nvis == 0)
		r = CUDA_ERROR_NO_DEVICE;
	else
		inited = 1;
	pthread_mutex_unlock(&mu);
	return r;
}

EXPORT CUresult cuDeviceGetCount(int *n) { LOCKED(dev_count(n)); }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) { LOCKED(dev_get(d, ordinal)); }
EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) { LOCKED(dev_attr(v, attr, d)); }
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { LOCKED(dev_uuid(u, d)); }
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { LOCKED(dev_uuid(u, d)); }
EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) { LOCKED(dev_peer(can, d, peer)); }
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { LOCKED(ctx_retain(c, d)); }
EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice d) { LOCKED(ctx_release(d)); }
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { LOCKED(ctx_release(d)); }

static CUresult ctx_get(CUcontext *c)
{
	if (!c)
		return CUDA_ERROR_INVALID_VALUE;
	*c = cur;
	return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *c) { LOCKED(ctx_get(c)); }
EXPORT CUresult cuCtxSetCurrent(CUcontext c) { LOCKED(ctx_set(c)); }
EXPORT CUresult cuCtxSynchronize(void) { LOCKED(ctx_sync()); }

static CUresult stream_sync(CUstream s)
{
	/* Only the legacy default stream can be named here. */
	if (s)
		return CUDA_ERROR_INVALID_HANDLE;
	struct tm_ctx *c = cur;
	if (!c || !valid_ctx_ptr(c) || c->refs <= 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	syncs++;
	if (c->sticky)
		return c->sticky;
	drain_legacy(c);
	return c->sticky;
}
EXPORT CUresult cuStreamSynchronize(CUstream s) { LOCKED(stream_sync(s)); }

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { LOCKED(mem_alloc(p, n)); }
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { LOCKED(mem_free(p)); }
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) { LOCKED(mem_set(p, v, n)); }
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { LOCKED(mem_htod(dst, src, n)); }
EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { LOCKED(mem_dtoh(dst, src, n)); }
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { LOCKED(mem_dtod(dst, src, n)); }
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) { LOCKED(mem_range(base, size, p)); }
EXPORT CUresult cuMemGetInfo_v2(size_t *freep, size_t *total) { LOCKED(mem_info(freep, total)); }

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) { LOCKED(ipc_get_mem(h, p)); }
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) { LOCKED(ipc_open_mem(p, h, flags)); }
EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) { LOCKED(ipc_close_mem(p)); }

EXPORT CUresult cuEventCreate(CUevent *e, unsigned int flags) { LOCKED(event_create(e, flags)); }
EXPORT CUresult cuEventRecord(CUevent e, CUstream s) { LOCKED(event_record(e, s)); }
EXPORT CUresult cuEventSynchronize(CUevent e) { LOCKED(event_sync(e)); }
EXPORT CUresult cuEventDestroy_v2(CUevent e) { LOCKED(event_destroy(e)); }
EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e) { LOCKED(ipc_get_event(h, e)); }
EXPORT CUresult cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle h) { LOCKED(ipc_open_event(e, h)); }

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) { LOCKED(vmm_create(h, size, prop, flags)); }
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { LOCKED(vmm_release(h)); }
EXPORT CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags) { LOCKED(vmm_export(shareable, h, type, flags)); }
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type) { LOCKED(vmm_import(h, os, type)); }
EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) { LOCKED(vmm_props(prop, h)); }
EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) { LOCKED(vmm_granularity(g, prop, option)); }
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) { LOCKED(vmm_reserve(p, size, align, addr, flags)); }
EXPORT CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { LOCKED(vmm_address_free(p, size)); }
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags) { LOCKED(vmm_map(p, size, offset, h, flags)); }
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t size) { LOCKED(vmm_unmap(p, size)); }
EXPORT CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc, size_t count) { LOCKED(vmm_set_access(p, size, desc, count)); }

/* ---- error names: these need no cuInit --------------------------------- */

static const struct {
	int code;
	const char *name, *text;
} errors[] = {
	{0, "CUDA_SUCCESS", "no error"},
	{1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	{2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	{3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	{4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
	{46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
	{100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	{101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
	{201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
	{208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
	{211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
	{214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
	{400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	{500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	{600, "CUDA_ERROR_NOT_READY", "device not ready"},
	{700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
	{709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
	{719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
	{800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
	{801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	{999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_text(CUresult code, const char **out, int name)
{
	if (!out)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
		if (errors[i].code == code) {
			*out = name ? errors[i].name : errors[i].text;
			return CUDA_SUCCESS;
		}
	*out = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorName(CUresult code, const char **s) { return error_text(code, s, 1); }
EXPORT CUresult cuGetErrorString(CUresult code, const char **s) { return error_text(code, s, 0); }

/* ---- introspection, for tests ------------------------------------------ */

EXPORT const char *tmstub_version(void) { return "tmstub 1"; }

#define INTROSPECT(expr)                      \
	do {                                  \
		pthread_mutex_lock(&mu);      \
		load_config();                \
		long long v_ = (expr);        \
		pthread_mutex_unlock(&mu);    \
		return v_;                    \
	} while (0)

static long long count_list(void *head, size_t next_off)
{
	long long n = 0;
	for (char *p = head; p; p = *(char **)(p + next_off))
		n++;
	return n;
}

static long long ipc_opened(void)
{
	long long n = 0;
	for (struct ipcopen *o = ipcopens; o; o = o->next)
		n += o->count;
	return n;
}

/* Primary-context references this process holds on an ordinal, -1 for
 * an ordinal it does not have. */
EXPORT long long tmstub_contexts(int ordinal) { INTROSPECT(valid_ordinal(ordinal) ? ctxs[ordinal].refs : -1); }
EXPORT long long tmstub_allocs(void) { INTROSPECT(count_list(lallocs, offsetof(struct lalloc, next))); }
EXPORT long long tmstub_handles(void) { INTROSPECT(count_list(vhandles, offsetof(struct vhandle, next))); }
EXPORT long long tmstub_mappings(void) { INTROSPECT(count_list(vmaps, offsetof(struct vmap, next))); }
EXPORT long long tmstub_ipc_opened(void) { INTROSPECT(ipc_opened()); }
EXPORT long long tmstub_events(void) { INTROSPECT(count_list(events, offsetof(struct tm_event, next))); }
EXPORT long long tmstub_syncs(void) { INTROSPECT(syncs); }
EXPORT long long tmstub_ops(int ordinal) { INTROSPECT(valid_ordinal(ordinal) ? ctxs[ordinal].ops : -1); }
EXPORT long long tmstub_sticky(int ordinal) { INTROSPECT(valid_ordinal(ordinal) ? ctxs[ordinal].sticky : -1); }
/* The physical device of an ordinal, -1 for one this process lacks. */
EXPORT long long tmstub_physical(int ordinal) { INTROSPECT(valid_ordinal(ordinal) ? cfg.vis[ordinal] : -1); }

/* tmstub_side_memset queues a memset of n bytes at ptr with v on a
 * stream of another library's, non-blocking (PyTorch's, say), of the
 * context current on the calling thread: cuStreamSynchronize(0) and
 * copies to the host do not wait for it, cuCtxSynchronize does. It
 * returns what cuMemsetD8Async would. */
EXPORT int tmstub_side_memset(unsigned long long ptr, unsigned long long n, int v)
{
	CUresult r = begin();
	if (r)
		return r;
	struct tm_ctx *c;
	if ((r = need_ctx(&c)))
		goto out;
	struct where w;
	if ((r = find((uintptr_t)ptr, (size_t)n, &w)))
		goto out;
	if (!allowed(&w, c, 1)) {
		fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, NULL);
		r = CUDA_ERROR_ILLEGAL_ADDRESS;
		goto out;
	}
	struct op *o = calloc(1, sizeof *o);
	if (!o) {
		r = CUDA_ERROR_OUT_OF_MEMORY;
		goto out;
	}
	o->kind = OP_MEMSET;
	o->dphys = w.phys;
	o->doff = w.off;
	o->n = (size_t)n;
	o->val = (unsigned char)v;
	o->dva = (uintptr_t)ptr;
	enqueue_on(c, o, &c->shead, &c->stail);
out:
	pthread_mutex_unlock(&mu);
	return r;
}

/* tmstub_own_fds writes up to max of the descriptors the stand-in keeps
 * for itself (state files, tables, exclusive-mode locks), as the real
 * driver keeps /dev/nvidia* open, and returns how many there are: a leak
 * check excuses exactly these. Exports are not among them. */
EXPORT int tmstub_own_fds(int *out, int max)
{
	int n = 0;
	pthread_mutex_lock(&mu);
#define OWN(fd)                          \
	do {                             \
		if ((fd) >= 0) {         \
			if (n < max)     \
				out[n] = (fd); \
			n++;             \
		}                        \
	} while (0)
	load_config();
	OWN(evtabfd);
	for (int p = 0; p < cfg.ndev; p++) {
		OWN(phys[p].statefd);
		OWN(phys[p].tabfd);
	}
	for (int i = 0; i < cfg.nvis; i++)
		OWN(ctxs[i].exclfd);
#undef OWN
	pthread_mutex_unlock(&mu);
	return n;
}

EXPORT int tmstub_set_memory(long long bytes)
{
	if (bytes <= 0)
		return -1;
	pthread_mutex_lock(&mu);
	load_config();
	cfg.memory = bytes;
	pthread_mutex_unlock(&mu);
	return 0;
}

EXPORT int tmstub_set_delay_us(long long us)
{
	if (us < 0)
		return -1;
	pthread_mutex_lock(&mu);
	load_config();
	cfg.delay_ns = us * 1000LL;
	pthread_mutex_unlock(&mu);
	return 0;
}

/* tmstub_set_compute_mode writes a physical device's compute mode for
 * every process of the machine, replacing the file whole. */
EXPORT int tmstub_set_compute_mode(int p, int mode)
{
	pthread_mutex_lock(&mu);
	load_config();
	int r = -1;
	if (cfg.ok && p >= 0 && p < cfg.ndev) {
		char path[PATHLEN], tmp[PATHLEN + 16], buf[16];
		path_of(path, sizeof path, "mode", p);
		snprintf(tmp, sizeof tmp, "%s.%d", path, self_pid);
		int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (fd >= 0) {
			int n = snprintf(buf, sizeof buf, "%d\n", mode);
			r = pwrite_all(fd, buf, (size_t)n, 0);
			close(fd);
			if (r == 0)
				r = rename(tmp, path);
			if (r < 0)
				unlink(tmp);
		}
	}
	pthread_mutex_unlock(&mu);
	return r;
}
