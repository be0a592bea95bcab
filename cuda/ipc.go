package cuda

import (
	"errors"
	"fmt"

	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/shm"
)

// export is what a producer keeps for an allocation it has sent.
type export struct {
	mem   ipcMemHandle
	event cuEvent
	evh   ipcEventHandle
	token *shm.Block // the producer's own hold, for the allocation's life
}

// openedMem is one IPC handle opened in this process, shared by every
// buffer received on it.
type openedMem struct {
	dev   int
	ptr   DevicePtr
	size  int64 // the allocation's size, checked against every import
	event cuEvent
	users int // guarded by Runtime.mu
	// own is set for an allocation this process made and exported,
	// received back: the driver refuses a process its own handles, so
	// nothing is opened, and the buffer reaches the allocation directly
	// (the token it holds keeps it out of the limbo's collection).
	own bool
}

// exportIPC describes b for another process by IPC handle and takes a ticket
// on its token for the message (h.Ticket); the receiver attaches the token
// and imports with it. The work queued on b so far is marked by an event
// the receiver waits for. A buffer received from another process can be
// exported again: the third process opens the original allocation.
func (b *Buffer) exportIPC() (gpushare.Handle, error) {
	if b.freed.Load() {
		return gpushare.Handle{}, errors.New("cuda: exporting a freed buffer")
	}
	if b.size == 0 {
		return gpushare.Handle{}, errors.New("cuda: exporting an empty buffer")
	}
	if b.block != nil {
		return gpushare.Handle{}, errors.New("cuda: a buffer in a device slab travels by Share, not by IPC handle")
	}
	if b.from != nil {
		tk, err := b.token.Ticket()
		if err != nil {
			return gpushare.Handle{}, fmt.Errorf("cuda: exporting a received buffer: %w", err)
		}
		h := b.desc
		h.Token, h.Ticket = b.token, tk
		return h, nil
	}
	e, err := b.exec()
	if err != nil {
		return gpushare.Handle{}, err
	}
	b.rt.mu.Lock()
	defer b.rt.mu.Unlock()
	if b.export == nil {
		token, err := shm.DefaultPool().Alloc(8)
		if err != nil {
			return gpushare.Handle{}, fmt.Errorf("cuda: making the reference token: %w", err)
		}
		x := &export{token: token}
		err = e.Do(func() error {
			var err error
			if x.mem, err = b.rt.drv.IPCGetMemHandle(b.base); err != nil {
				return err
			}
			if x.event, err = b.rt.drv.EventCreateInterprocess(); err != nil {
				return err
			}
			if x.evh, err = b.rt.drv.IPCGetEventHandle(x.event); err != nil {
				_ = b.rt.drv.EventDestroy(x.event)
				return err
			}
			return nil
		})
		if err != nil {
			_ = token.Release()
			return gpushare.Handle{}, err
		}
		b.export = x
		b.rt.exported[x.mem] = b
	}
	x := b.export
	if err := e.Do(func() error { return b.rt.drv.EventRecord(x.event) }); err != nil {
		return gpushare.Handle{}, err
	}
	tk, err := x.token.Ticket()
	if err != nil {
		return gpushare.Handle{}, err
	}
	return gpushare.Handle{Device: b.dev, Mem: x.mem, Event: x.evh, Offset: int64(b.ptr - b.base), Size: b.size, Token: x.token, Ticket: tk}, nil
}

// importIPC opens a buffer another process exported, once per allocation
// per process, and waits for the work the producer queued on it. The
// buffer takes over h.Token, the receiver's own hold on the token: its
// Release releases it.
func (r *Runtime) importIPC(h gpushare.Handle) (*Buffer, error) {
	if h.Token == nil {
		return nil, errors.New("cuda: import without a reference token")
	}
	if h.Offset < 0 || h.Size <= 0 || h.Offset > 1<<50 || h.Size > 1<<50 {
		return nil, fmt.Errorf("cuda: import of %d bytes at offset %d", h.Size, h.Offset)
	}
	e, err := r.execs.Get(h.Device)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	o := r.opened[h.Mem]
	if mine := r.exported[h.Mem]; mine != nil && o == nil {
		o = &openedMem{dev: mine.dev, ptr: mine.base, size: mine.size, own: true}
	}
	if o == nil {
		o = &openedMem{dev: h.Device}
		err = e.Do(func() error {
			var err error
			if o.ptr, err = r.drv.IPCOpenMemHandle(h.Mem); err != nil {
				return err
			}
			if _, o.size, err = r.drv.MemGetAddressRange(o.ptr); err != nil {
				_ = r.drv.IPCCloseMemHandle(o.ptr)
				return err
			}
			if o.event, err = r.drv.IPCOpenEventHandle(h.Event); err != nil {
				_ = r.drv.IPCCloseMemHandle(o.ptr)
				return err
			}
			return nil
		})
		if err != nil {
			r.mu.Unlock()
			return nil, fmt.Errorf("cuda: opening an IPC handle on gpu:%d: %w", h.Device, err)
		}
		r.opened[h.Mem] = o
	}
	if h.Offset > o.size-h.Size {
		if o.users == 0 && !o.own {
			delete(r.opened, h.Mem)
			_ = e.Do(func() error {
				return errors.Join(r.drv.IPCCloseMemHandle(o.ptr), r.drv.EventDestroy(o.event))
			})
		}
		r.mu.Unlock()
		return nil, fmt.Errorf("cuda: import of %d bytes at offset %d from an allocation of %d", h.Size, h.Offset, o.size)
	}
	o.users++
	r.mu.Unlock()

	b := &Buffer{rt: r, dev: h.Device, ptr: o.ptr + DevicePtr(h.Offset), size: h.Size, from: o, token: h.Token, desc: h}
	b.desc.Token, b.desc.Ticket = nil, nil
	if o.own {
		return b, nil // this process's own work is ordered on its own stream
	}
	if err := e.Do(func() error { return r.drv.EventSynchronize(o.event) }); err != nil {
		_ = b.Release()
		return nil, fmt.Errorf("cuda: waiting for the producer's work on gpu:%d: %w", h.Device, err)
	}
	return b, nil
}

// closeOpened gives back a received buffer's token and closes its IPC
// handle when it was the last of this process's buffers on it.
func (r *Runtime) closeOpened(b *Buffer) error {
	err := b.token.Release()
	if b.from.own {
		r.CollectLimbo()
		return err
	}
	r.mu.Lock()
	o := b.from
	o.users--
	last := o.users == 0
	if last {
		delete(r.opened, b.desc.Mem)
	}
	r.mu.Unlock()
	if !last {
		return err
	}
	e, xerr := r.execs.Get(o.dev)
	if xerr != nil {
		return errors.Join(err, xerr)
	}
	return errors.Join(err, e.Do(func() error {
		return errors.Join(r.drv.IPCCloseMemHandle(o.ptr), r.drv.EventDestroy(o.event))
	}))
}

// Opened returns how many IPC handles this process has open.
func (r *Runtime) Opened() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.opened)
}
