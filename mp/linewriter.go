package mp

import (
	"bytes"
	"io"
	"sync"
)

// lineWriter passes whole lines to w, so that the output of several
// workers writing at once interleaves by line, never inside one.
type lineWriter struct {
	w   io.Writer
	mu  *sync.Mutex // shared by the writers of one destination
	buf []byte
	own sync.Mutex
}

func newLineWriter(w io.Writer, mu *sync.Mutex) *lineWriter { return &lineWriter{w: w, mu: mu} }

func (l *lineWriter) Write(p []byte) (int, error) {
	l.own.Lock()
	defer l.own.Unlock()
	l.buf = append(l.buf, p...)
	if i := bytes.LastIndexByte(l.buf, '\n'); i >= 0 {
		l.mu.Lock()
		_, err := l.w.Write(l.buf[:i+1])
		l.mu.Unlock()
		l.buf = append(l.buf[:0], l.buf[i+1:]...)
		if err != nil {
			return len(p), nil // a broken destination must not break the worker's pipe
		}
	}
	return len(p), nil
}

func (l *lineWriter) flush() {
	l.own.Lock()
	defer l.own.Unlock()
	if len(l.buf) > 0 {
		l.mu.Lock()
		_, _ = l.w.Write(append(l.buf, '\n'))
		l.mu.Unlock()
		l.buf = l.buf[:0]
	}
}
