// Package dist carries tensors between processes on different hosts, over
// Apache Arrow Flight.
//
// A group is formed by Init from the launcher the user already has
// (torchrun --no-python, Slurm srun, Kubeflow's PyTorchJob, MPI, or
// WithRank and WithStore): rank 0 serves the group's store (Group.Store,
// torch's TCPStore contract) and every rank registers there. The shape to
// use is one rank per host, each spawning its host's workers with package
// mp: hand-offs on a host stay on mp's descriptor path.
//
// Group.Queue and Group.Pipe carry any value package reduction carries,
// tensors anywhere inside. Across hosts a tensor is a copy: writes on the
// receiver do not reach the sender. It arrives in a pooled shared-memory
// block of the receiving host, copied once from gRPC's buffers, so handing
// it on to local workers over an mp.Queue copies nothing more. On the wire
// a value is a FlightData whose app_metadata carries the encoded value,
// then its storages as Arrow IPC record batches of one uint8 column, 1 MiB
// each (WithChunk); the sender lends the storages' memory to gRPC without
// copying it.
//
// Between two ranks of one host, Pipes and queue operations take a
// shortcut: an mp.Pipe over the ranks' named endpoints, on which tensors
// are shared as between mp's processes, not copied
// (WithSameHostShortcut). A Put on a queue whose owner is on the same
// host leaves the tensors in the putter's memory; the owner, and a getter
// of that host, map it.
//
// A queued value of WithReferenceAbove bytes or more (default 8 MiB) goes
// by reference: its putter keeps a copy under a lease (WithLease) that the
// queue's owner renews, the owner queues a Flight ticket, and the getter
// pulls the tensors from the putter with DoGet. Its tensors cross the
// network once; a value whose lease ran out fails one Get with
// ErrLeaseExpired. A queue's owner likewise lends a value that large,
// which it holds itself, to a getter on another host for the time of its
// Get. A getter pulls over WithPullConns connections (default 2), each
// carrying every other chunk, so that receiving, which gRPC does on one
// goroutine per connection, runs on more than one core.
//
// Failures are errors, never hangs. Every rank watches rank 0 over a
// stream with heartbeats (WithHeartbeat, default 1 s): a rank whose
// process dies is noticed when its connection closes, one whose host or
// link goes away within three heartbeats. The group's first failure
// cancels Group.Context on every rank and Group.Wait returns it: a
// *PeerError (errors.Is(err, ErrPeerLost)), a *RankError from Abort, or
// ErrStoreLost when rank 0 is gone. There is no elastic membership: the
// launcher's restart policy restarts the group.
//
// dist is a module of its own, so that programs on one host never build
// Arrow or gRPC.
package dist
