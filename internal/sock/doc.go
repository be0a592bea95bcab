// Package sock is package mp's transport: the descriptors its queues,
// pipes, endpoints and control sockets wait on, and the wire format of
// their messages, as the standard library keeps internal/poll under os
// and net.
//
// A Conn holds one descriptor: most often an end of an AF_UNIX
// SOCK_SEQPACKET socket (Pair, or an endpoint's connection from
// Listener.Accept or Dial), whose messages it sends and receives whole,
// each in one sendmsg with its descriptors (SCM_RIGHTS, received
// close-on-exec). A payload over 64 KiB spills into a sealed memfd the
// receiver maps in place (1 GiB at most), and descriptors beyond the 253
// one message carries travel through a carrier socket sent in it; a
// message tensormp did not frame is an error wrapping ErrMalformed. The
// same waiting serves a Listener's listening socket and the two ends of a
// bounded queue's Places, a pipe.
//
// A call that must wait first waits in the kernel, where readiness wakes
// its thread directly; a receive waits in the receive call itself, for up
// to a millisecond, and then polls. At most four callers of a process
// wait in the kernel at once; the others park on the package's one
// poller (an epoll instance, and a goroutine for the life of the
// process). Close and a context's end interrupt a receive call with
// SIGURG to its thread.
//
// A Lane is the shared-memory path beside a socket: a ring of messages in
// a sealed memfd, published and taken with atomic operations on words both
// processes map, and a Bell on which a side that has nothing to do spins
// briefly (yielding the CPU first, and as it spins, when both sides run on
// that one CPU), then sleeps on a futex, woken by the other side only when
// it sleeps. A Lane carries bytes only. A Way puts one beside the socket
// of a pipe's direction (NewWay) or of a queue (NewFairWay). Its writer
// sends by it, when it holds the writer's role and the entry fits (and,
// for a queue, handsOver finds the reader ready for it, or, for a tensor
// sent by a process that is answering, the reader comes back to the lane
// while the writer spins for it: see awaitReader), what needs no
// descriptor: values with no tensor, tensors of pooled blocks the writer's
// own pool made, in segments the reader pins, lent until the reader holds
// them (see way_pins.go), and tensors of pooled blocks the reader made,
// sent back to it, which the reader holds while they wait (see
// way_returns.go). Everything else goes by the socket, whose descriptors
// are the message's holds in flight.
//
// Ownership: a Conn owns its descriptor until Close, which waits for the
// calls using it; a received message's descriptors are the receiver's; a
// sent message's stay the sender's. The wait slots' eventfds and the
// poller's epoll descriptor belong to the package for the life of the
// process. A Lane's memory descriptor is its creator's; each Lane owns
// its mapping until Close. Errors speak as package mp's, whose they are: ErrClosed and
// ErrMalformed are mp.ErrClosed and mp.ErrMalformed.
package sock
