// Package dist carries tensors between processes on different hosts, over
// Apache Arrow Flight: a group of ranks started by the launcher the user
// already has (torchrun, Slurm, Kubeflow, MPI, or explicit options),
// queues and pipes between them, and failures that reach every rank as
// errors, never as hangs.
//
// Across hosts a tensor is a copy: writes on the receiver do not reach the
// sender. It arrives in a pooled shared-memory block of the receiving
// host, so handing it on to local workers over an mp.Queue copies nothing.
// Everything on one host stays with package mp.
//
// dist is a module of its own, so that programs on one host never build
// Arrow or gRPC.
package dist
