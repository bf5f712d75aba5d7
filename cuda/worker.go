package cuda

import (
	"errors"
	"runtime"
	"sync"
)

// errClosed is returned for calls on a closed Device.
var errClosed = errors.New("device is closed")

// worker runs a device's CUDA calls on one OS thread. A CUDA context is
// current per thread, and Go moves goroutines between threads at will; so
// one goroutine locks a thread, makes the device's primary context current
// there once, and runs every call submitted to it.
type worker struct {
	mu     sync.RWMutex
	closed bool
	jobs   chan func()
}

// startWorker starts the thread and runs setup on it first; if setup
// fails, the thread ends and the error is returned.
func startWorker(setup func() error) (*worker, error) {
	w := &worker{jobs: make(chan func())}
	errc := make(chan error)
	go func() {
		// Never unlocked: the thread exits with the goroutine, taking its
		// context binding with it, instead of returning to Go's pool.
		runtime.LockOSThread()
		if err := setup(); err != nil {
			errc <- err
			return
		}
		errc <- nil
		for job := range w.jobs {
			job()
		}
	}()
	if err := <-errc; err != nil {
		return nil, err
	}
	return w, nil
}

// do runs f on the worker's thread and returns its error.
func (w *worker) do(f func() error) error {
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.closed {
		return errClosed
	}
	done := make(chan error, 1)
	w.jobs <- func() { done <- f() }
	return <-done
}

// stop runs last on the thread, then ends it; later calls get errClosed.
func (w *worker) stop(last func() error) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil
	}
	done := make(chan error, 1)
	w.jobs <- func() { done <- last() }
	err := <-done
	w.closed = true
	close(w.jobs)
	return err
}
