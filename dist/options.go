package dist

import (
	"crypto/tls"
	"time"
)

// Option configures Init.
type Option func(*options)

type options struct {
	rank, world int
	store       string
	addr        string
	timeout     time.Duration
	heartbeat   time.Duration
	chunk       int
	maxValue    int64
	refAbove    int64
	lease       time.Duration
	pullConns   int
	noLocal     bool
	serverTLS   *tls.Config
	clientTLS   *tls.Config
	token       string
	getenv      func(string) string
}

// WithRank sets this process's rank and the group's size, overriding a
// launcher's environment.
func WithRank(rank, world int) Option {
	return func(o *options) { o.rank, o.world = rank, world }
}

// WithStore sets where rank 0 serves the group's store, host:port.
func WithStore(addr string) Option { return func(o *options) { o.store = addr } }

// WithAddr sets the IP address this rank listens on. By default a rank
// listens on loopback, or, under a launcher, on the address its host
// uses to reach rank 0 (TENSORMP_DIST_ADDR overrides both).
func WithAddr(ip string) Option { return func(o *options) { o.addr = ip } }

// WithTimeout bounds how long the group may take to form, and a store
// Get or Wait that names no bound of its own. The default is 5 minutes.
func WithTimeout(d time.Duration) Option { return func(o *options) { o.timeout = d } }

// WithHeartbeat sets how often ranks and rank 0 tell each other they are
// alive. A rank not heard from for three intervals is lost: a process
// that dies is noticed at once (its connection closes), one whose host
// or link goes away within 3 × d. The default is 1 second.
func WithHeartbeat(d time.Duration) Option { return func(o *options) { o.heartbeat = d } }

// WithChunk sets the size of the record batches tensors travel in
// (default DefaultChunk, 1 MiB).
func WithChunk(n int) Option { return func(o *options) { o.chunk = n } }

// WithMaxValue bounds the bytes of tensors one received value may hold
// (default: what the shared-memory directory has free). A value is given
// its memory when its first message announces its size, before its bytes
// arrive; the bound keeps a peer from making this host allocate more.
func WithMaxValue(n int64) Option { return func(o *options) { o.maxValue = n } }

// WithTLS serves and dials with TLS: server is this rank's listener's
// configuration, client the one it dials its peers with.
func WithTLS(server, client *tls.Config) Option {
	return func(o *options) { o.serverTLS, o.clientTLS = server, client }
}

// WithToken makes every call carry "authorization: Bearer token", as
// Flight's token authentication does, and refuses calls that do not.
func WithToken(token string) Option { return func(o *options) { o.token = token } }

// WithReferenceAbove sends a queued value whose tensors come to n bytes or
// more by reference (default DefaultReferenceAbove; 0: never): its owner
// queues a ticket, and the getter pulls the tensors from the putter. A
// queue's owner also lends a value that large, which it holds itself, to
// a getter on another host, which pulls it the same way.
func WithReferenceAbove(n int64) Option { return func(o *options) { o.refAbove = n } }

// WithSameHostShortcut turns the same-host shortcut on (the default) or
// off: with it, a Pipe between ranks of one host is an mp.Pipe, and a
// Put or Get on a queue whose owner is another rank of this host goes
// over one.
func WithSameHostShortcut(on bool) Option { return func(o *options) { o.noLocal = !on } }

// WithLease sets how long a putter keeps a value by reference that nobody
// renews (default DefaultLease). The queue's owner renews its values
// every third of it, so a lease ends only when the owner is gone or the
// value was dropped.
func WithLease(d time.Duration) Option { return func(o *options) { o.lease = d } }

// WithPullConns sets over how many connections a getter pulls a value by
// reference from its putter (default DefaultPullConns; at most
// MaxPullConns). Each connection carries every n-th chunk of the value,
// so that receiving, which one gRPC connection does on one goroutine,
// runs on several cores. The extra connections are dialled at the first
// pull from a rank.
func WithPullConns(n int) Option { return func(o *options) { o.pullConns = n } }

// DefaultPullConns is the connections a pull uses unless WithPullConns
// says otherwise.
const DefaultPullConns = 2

// MaxPullConns bounds WithPullConns.
const MaxPullConns = 16
