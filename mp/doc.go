// Package mp runs Go functions in worker processes and moves values with
// tensors between them without copying: the Go counterpart of
// torch.multiprocessing.
//
// Go cannot fork, so a worker is the program itself started again: Register
// names a worker function, Init (first in main) runs it in the child, and
// Spawn starts n of them, each with a control socket on fd 3. Join reports
// the first failure as a *WorkerError (the worker returned an error) or an
// *ExitError (it exited non-zero or was killed); the first failure stops the
// others with SIGTERM, which cancels a worker's context and, if the worker
// has not returned after a grace period, kills it. Workers die with
// their parent (Pdeathsig, set from one locked OS thread, and EOF on the
// control socket as a backstop).
//
// Queue and Pipe carry any value the reduction codec encodes over
// SOCK_SEQPACKET sockets, each message in one sendmsg with its descriptors
// (SCM_RIGHTS, received close-on-exec), so a sender may exit as soon as Put
// returns. Payloads over 64 KiB spill into a sealed memfd that the
// receiver reads in place (1 GiB at most), and more than 253 descriptors
// travel through a carrier socket, still in that one message. A message
// tensormp did not frame is an error wrapping ErrMalformed, and the queue
// goes on.
//
// Each direction of a Pipe made by NewPipe also has a lane: a ring in a
// sealed memfd beside the socket, with a futex doorbell. The first process
// to send on an end and the first to receive on the other take its two
// roles (OFD locks, dropped by the kernel when a holder dies), and a value
// with no tensor, queue or pipe in it that fits an entry goes through
// memory, with no system call while both sides are awake. So does a
// tensor of a block of the sending process's pool whose segment the
// receiving process maps already: the receiver pins each segment it is
// sent a block of by descriptor, and lists it in the lane; the sender names
// the next blocks of it by identity alone, and lends each block to its
// message (its pool does not reuse the slot, even once released) until
// the receiver has taken its own hold (a lock on the block's slot, taken
// for a run of the lane's blocks in one call), or is gone. A sender
// killed with tensors in the lane costs nothing, since only it reuses its
// slots and the receiver's mapping keeps the memory; a receiver killed
// with tensors untaken gives them back within milliseconds. A tensor sent
// back to the process that made it (a worker's answer that is the tensor
// it was given) goes through memory too, named by identity: its producer,
// the receiver, keeps the block from reuse while the message waits, so
// the sender may exit first. The rest goes by the
// socket in order with it (see internal/sock.Way, and way_pins.go and
// way_returns.go there for the invariants). A receiver waits on the lane
// (spinning, then asleep on the doorbell in a thread of its own) for up
// to 100 ms, and at most eight receivers of a process at once, Gets of
// queues included; the others wait on their socket (see below), and the
// sender's next entry wakes them there with a frame that carries no
// message, or, if that wake is lost (its sender killed first, another
// process receiving on the same end took it), they look at the lane
// again within as long as they have waited, 10 ms at first, a second at
// most. A sender that waits for room in a full lane sleeps on it in the
// same way while it holds one of those eight waits (past 100 ms only
// while no other wait was refused one meanwhile); the others sleep on a
// timer and look at the lane again within as long as they have waited,
// 0.1 ms at first, a second at most, and so see room that late at most.
//
// A Queue made by NewQueue has such a lane too, which a putting process
// uses only to hand a value to a getting process that waits in Get with
// nothing before it, or, with no tensor in it, to the queue's only
// getting process (a process that has just received a message, and so
// is likely answering it, spins for up to 50 µs for that getter to come
// back to Get before it gives up the lane for a tensor): a value put
// while the getter is busy and another may get goes by the socket, from
// which any getter takes it, so the lane keeps no value from a free
// getter (see internal/sock.NewFairWay). Neither does it let a value
// overtake one that another process finished putting before it. A getter
// waits on the lane for up to 100 ms, and at most eight getters of a
// process at once, as a Pipe's receiver does; the others wait on their
// socket.
//
// A call that must wait first waits in the kernel, where readiness wakes
// its thread directly; a receive waits in the receive call itself, for up
// to a millisecond, and then polls. At most four callers of a process wait
// in the kernel at once: the others park on the package's one poller, and
// one that has waited over a millisecond gives its place to a caller that
// needs it, so a thousand blocked Gets hold a few threads, not a
// thousand. Close and a context's end interrupt a receive call with
// SIGURG to its thread, which the Go runtime already uses for preemption;
// a program that asks os/signal for SIGURG sees these too.
//
// A Pool keeps worker processes that run functions registered with
// RegisterFunc over many items (Map, Imap, ImapUnordered, Apply), and
// replaces a worker that dies; package loader builds torch's DataLoader
// on Spawn and Queue.
//
// Ownership: a Queue or Pipe owns its socket descriptors in each process
// that holds it, until Close, and its lanes' memory descriptors, their
// mappings and, once taken, its roles' descriptions and the segments its
// receiving side pins (until Close); one sent in a
// message travels as a duplicate the message owns. Every process of a program belongs to one session; its
// two keepers, either of which suffices, remove the session's file_system
// segments, and the CUDA driver's files of its members, once every member
// has exited, however it died; a killed keeper is replaced by the process
// that started the session. The session lock must be this user's own
// (mode 0600). An endpoint's connection removes the driver's files of the
// process at its other end once that process dies.
// Clean removes what sessions with no live member left behind: regular
// files whose whole name is one tensormp gives, nothing else.
package mp
