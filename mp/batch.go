package mp

import (
	"context"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// PutMany sends the values of batch to q as one message, for producers
// that hand over many tensors at a time (a DataLoader's worker, say): one
// system call for the lot, and one descriptor for all the tensors that
// share a segment, instead of one of each per tensor. It takes one place
// of a queue with a capacity, and waits as Put does.
//
// The receiver takes the whole batch with GetMany (or with Get into a
// *[]T).
func PutMany[T any](ctx context.Context, q *Queue, batch []T) error {
	return q.Put(ctx, batch)
}

// GetMany receives the next message and appends its values to batch: all
// of a batch that PutMany sent, or the one value that Put sent. It returns
// the extended slice, so that a consumer can reuse one slice:
//
//	b, err = mp.GetMany(ctx, q, b[:0])
//
// It waits as Get does. On error, batch is returned unchanged.
func GetMany[T any](ctx context.Context, q *Queue, batch []T) ([]T, error) {
	m, err := q.take(ctx, true)
	if err != nil {
		return batch, err
	}
	defer m.Done()
	if len(m.Data) == 0 || !(msgpcode.IsFixedArray(m.Data[0]) || m.Data[0] == msgpcode.Array16 || m.Data[0] == msgpcode.Array32) {
		var zero T
		batch = append(batch, zero) // decoded in place: a T of its own would escape
		if err := decodeMsg(m, &batch[len(batch)-1]); err != nil {
			batch[len(batch)-1] = zero
			return batch[:len(batch)-1], err
		}
		return batch, nil
	}
	got := batch[len(batch):] // empty, with the room batch has left
	if err := decodeMsg(m, &got); err != nil {
		clear(batch[len(batch):cap(batch)]) // no half-decoded values left behind
		return batch, err
	}
	return append(batch, got...), nil // a copy onto itself when got used batch's room
}
