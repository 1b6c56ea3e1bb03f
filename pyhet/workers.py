"""Worker threads that a Ctrl-C cannot wedge: each device's work runs on a thread of its own,
handed over and waited for here.

concurrent.futures' executors and futures wait and hand over work with Python-level locks
(threading.Condition): a KeyboardInterrupt that lands in their Python code, between taking a
lock and the block that gives it back, leaves the lock held, and the next piece of work (or
the interpreter's exit, which joins the executors' threads) waits for it forever. Here the
thread that hands work over and waits for it makes one blocking call, a C lock's acquire,
which a signal interrupts whole (the lock left as it was), and reads the outcome, which the
worker stores before it releases that lock. The worker threads are daemons, so that the
interpreter's exit never waits on one (concurrent.futures' exit hook also stopped every
executor before Python joined the program's own threads: a thread still training then
failed); their owners stop and join them (Device.close, a Network's finalizer). A program that
exits without that (an exception or Ctrl-C past its clean-up, a device never closed) has them
stopped at its exit: _stop_at_exit.
"""

from __future__ import annotations

import _thread
import atexit
import queue
import sys
import threading
import time
import traceback
import weakref
from typing import Callable

from .interrupt import HeldSignals

_PENDING = object()
# how long the interpreter's exit waits, in all, for the workers' work under way to end
EXIT_WAIT_S = 30.0


class Work:
    """A piece of work handed to a Worker, as a concurrent.futures.Future is: result(),
    exception(), done(), add_done_callback()."""

    __slots__ = ("_fn", "_args", "_outcome", "_done", "_guard", "_callbacks")

    def __init__(self, fn: Callable, args: tuple):
        self._fn, self._args = fn, args
        self._outcome = _PENDING          # (True, value) or (False, exception), once done
        self._done = _thread.allocate_lock()
        self._done.acquire()              # released by the worker once the outcome is set
        self._guard = _thread.allocate_lock()
        self._callbacks: list | None = []

    def _run(self) -> None:
        try:
            outcome = (True, self._fn(*self._args))
        except BaseException as e:        # (on a worker: KeyboardInterrupt never comes here)
            outcome = (False, e)
        self._fn = self._args = None
        with self._guard:
            self._outcome = outcome
            callbacks, self._callbacks = self._callbacks, None
        self._done.release()
        for callback in callbacks:
            _call_back(callback, self)

    def _cancel(self, error: BaseException) -> None:
        """Done with `error`, never run (dropped at the interpreter's exit): whoever waits on
        it wakes (another worker, say, whose own piece then ends)."""
        self._fn = self._args = None
        with self._guard:
            if self._outcome is not _PENDING:
                return
            self._outcome = (False, error)
            callbacks, self._callbacks = self._callbacks, None
        self._done.release()
        for callback in callbacks:
            _call_back(callback, self)

    def done(self) -> bool:
        return self._outcome is not _PENDING

    def _wait(self) -> None:
        if self._outcome is _PENDING:
            # the one blocking call: a signal ends it with the lock not taken, and a signal
            # right after it finds the outcome already set (so a later wait returns at once);
            # given back for any other thread waiting too
            self._done.acquire()
            self._done.release()

    def result(self):
        """The work's value, or its exception raised; waits for it."""
        self._wait()
        ok, value = self._outcome
        if ok:
            return value
        raise value

    def exception(self) -> BaseException | None:
        """The work's exception, or None; waits for it."""
        self._wait()
        ok, value = self._outcome
        return None if ok else value

    def add_done_callback(self, fn: Callable[["Work"], None]) -> None:
        """fn(work) on the worker once it is done, or at once where it is done already."""
        with self._guard:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        _call_back(fn, self)


def _call_back(fn, work: Work) -> None:
    try:
        fn(work)
    except Exception:     # as concurrent.futures does: said, not raised into the worker
        sys.stderr.write(f"pyhet: an error in a callback of {work!r}:\n"
                         f"{traceback.format_exc()}")


class Worker:
    """One daemon thread running the Work handed to it by submit(), in order. Its thread starts
    with the Worker (RuntimeError where the process cannot start one); shutdown() ends it after
    the work already handed over, and so does the Worker's end as an object (the thread holds
    only its queue, as concurrent.futures' threads do)."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None,
                 wake: Callable[[], None] | None = None):
        # wake: cuts short what the work under way waits for (an emulated device's idling),
        # called at the interpreter's exit
        self._wake = wake
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._closing = _thread.allocate_lock()    # a submit and a shutdown, one at a time
        # the thread holds the weak reference (so its callback comes also where the Worker
        # goes in a cycle's collection, which drops the weak references it holds unheard)
        end = weakref.ref(self, lambda _, q=self._queue: q.put(None))
        self._thread = threading.Thread(target=_serve, args=(self._queue, initializer, name, end),
                                        name=name, daemon=True)
        with HeldSignals():   # Thread.start waits on a Condition, which an interrupt can break
            self._thread.start()
        _register_exit()
        _LIVE.add(self)

    def submit(self, fn: Callable, *args) -> Work:
        work = Work(fn, args)
        with self._closing:     # (a shutdown between the check and the put stranded the work)
            if self._closed:
                raise RuntimeError(f"{self._thread.name}: cannot take work after shutdown")
            self._queue.put(work)
        return work

    def shutdown(self, wait: bool = True) -> None:
        """No more work; the thread ends once the work handed over is done (joined if wait)."""
        with self._closing:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        if wait and self._thread is not threading.current_thread():
            # after the interpreter's exit stopped the workers, no wait past its deadline
            self._thread.join(None if _exit_deadline is None else
                              max(0.0, _exit_deadline - time.monotonic()))

    def _settle(self) -> "Work | None":
        """The interpreter's exit (_stop_at_exit): the work handed over but not started is
        dropped (done with an error), the work under way is woken (an emulated device's
        idling cut short), and a marker is handed over that is done once the worker is idle;
        the worker keeps taking work (a Network's finalizer closes its devices after this).
        None where the thread has ended."""
        if not self._thread.is_alive():
            return None
        with self._closing:
            dropped = []
            while True:
                try:
                    dropped.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            marker = Work(lambda: None, ())
            self._queue.put(marker)
            if None in dropped:        # a shutdown under way: the thread still ends after
                self._queue.put(None)
        for work in dropped:
            if work is not None:
                work._cancel(RuntimeError(f"{self._thread.name}: work dropped at the "
                                          f"interpreter's exit"))
        if self._wake is not None:
            try:
                self._wake()
            except Exception:    # (what is left of the program at its exit)
                pass
        return marker

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown(wait=True)


_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()
# set by _stop_at_exit: a shutdown after it (a Network's finalizer, whichever of the two
# atexit runs first) waits no longer than the exit's own wait
_exit_deadline: float | None = None


def _stop_at_exit() -> None:
    """At the interpreter's exit (after the program's own threads were joined, before Python
    finalizes): the work not started on any worker is dropped, and the work under way waited
    for, up to EXIT_WAIT_S in all. A worker thread that came back from the core's C++ code
    into a finalizing interpreter was ended there by pthread_exit, whose unwinding through the
    core's frames aborted the process ("terminate called without an active exception",
    status 134): a program that exited while a device computed, as one interrupted before it
    closed its devices. The work dropped ends with an error, so that a worker waiting on
    another's (a rank's group of devices, calibration's trials) ends too; an emulated
    device's idling is cut short (the Worker's wake). This runs before the Networks'
    finalizers (registered after weakref.finalize's own hook: _register_exit), which then
    close their devices on idle workers, each shutdown waiting no longer than this did. A
    second Ctrl-C here stops the waiting."""
    global _exit_deadline
    _exit_deadline = time.monotonic() + EXIT_WAIT_S
    try:
        waits = [(w, w._settle()) for w in list(_LIVE)]
        for w, marker in waits:
            if marker is not None and w._thread is not threading.current_thread():
                left = max(0.0, _exit_deadline - time.monotonic())
                if marker._done.acquire(timeout=left):
                    marker._done.release()
        late = [w._thread.name for w, marker in waits
                if marker is not None and not marker.done() and w._thread.is_alive()]
        if late:
            sys.stderr.write(f"pyhet: warning: at the interpreter's exit, {', '.join(late)} "
                             f"still computing after {EXIT_WAIT_S:g} s; the process may end "
                             f"abruptly\n")
    except KeyboardInterrupt:
        pass


class _Anchor:
    """An object that lives as long as the module (a weakref.finalize needs one)."""


_ANCHOR = _Anchor()
_registered = False


def _register_exit() -> None:
    """_stop_at_exit as an atexit hook, once, after weakref.finalize's own (made here where
    no finalizer made it yet), so that it runs before every Network's finalizer (atexit runs
    the last registered first)."""
    global _registered
    if _registered:
        return
    weakref.finalize(_ANCHOR, int).atexit = False
    atexit.register(_stop_at_exit)
    _registered = True


def _serve(work_queue: queue.SimpleQueue, initializer, name: str, end) -> None:
    del end     # held by the thread's arguments, not here
    if initializer is not None:
        try:
            initializer()
        except Exception:    # the work goes on without it, said
            sys.stderr.write(f"pyhet: {name}'s set-up failed:\n{traceback.format_exc()}")
    while True:
        work = work_queue.get()
        if work is None:
            return
        work._run()
        del work      # its arrays go as soon as it is done, not with the next one
