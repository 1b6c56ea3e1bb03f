"""SIGINT and SIGTERM while training: the step under way is finished, then the run stops.

Outside the step loop (loading data, calibrating, evaluating, saving) a signal stops the run at
once. Inside it, the first signal is noted and the devices are woken (an emulated slow device
stops idling), so that the step ends within moments; the loop then writes a checkpoint of that
step, if it has a checkpoint folder, and raises pyhet.errors.Interrupted. A second signal stops
the run at once.
"""

from __future__ import annotations

import _signal
import os
import signal
import threading

from .errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interruption:
    """The handlers of SIGINT and SIGTERM for the length of a `with` block (only in the main
    thread, where Python runs handlers; elsewhere it does nothing)."""

    def __init__(self):
        self.signum = None        # the signal that asked to stop, once one has
        self.deferring = False    # True inside the step loop: finish the step first
        self.devices = []         # woken by the first signal
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum, frame):
        if self.deferring and self.signum is None:
            self.signum = signum
            for d in self.devices:
                wake = getattr(d, "wake", None)     # a device on another rank has none
                if wake is not None:
                    wake()
            return
        raise Interrupted(signum)

    def check(self, detail: str | None = None) -> None:
        """Raise Interrupted if a signal asked to stop (detail: what was done about it)."""
        if self.signum is not None:
            raise Interrupted(self.signum, detail)


# every signal a Python handler could be set for (as ints: signal.getsignal's enum lookups
# of 60 signals took 40 us, _signal's 1.5)
_CATCHABLE = tuple(sorted(int(s) for s in signal.valid_signals()
                          if s not in (signal.SIGKILL, signal.SIGSTOP)))


class HeldSignals:
    """Signals held back for the length of a `with` block, then handled as they would have
    been: a step's commit (every layer's new weights made current, then the fc layers'
    update), or a move of kernels between devices, is never cut in two by Ctrl-C, or by a
    handler of another signal that raises (a program's timeout on SIGALRM, its SIGTERM handler
    calling sys.exit), which would leave some layers a step ahead of the others. SIGINT, and
    every signal whose handler is a Python function; only in the main thread, where Python runs
    handlers (one set outside Python is left alone). Where the block raises, a SIGINT that came
    meanwhile is dropped (the error ends the call anyway), and the other signals' handlers run,
    whatever they raise dropped too."""

    __slots__ = ("_old", "_got", "_holding")

    def __enter__(self):
        self._old, self._got, self._holding = {}, [], True
        if threading.current_thread() is threading.main_thread():
            try:
                for s in _CATCHABLE:
                    old = _signal.getsignal(s)
                    if callable(old) or (s == signal.SIGINT and old is not None):
                        self._old[s] = old          # noted first: put back whatever comes
                        signal.signal(s, self._note)
            except BaseException:   # a handler not yet held raised: none is left held
                self._put_back()
                raise
        return self

    def _put_back(self) -> None:
        try:
            # SIGINT's handler put back last: the one likeliest to raise as it comes back
            for s in sorted(self._old, key=lambda s: s == signal.SIGINT):
                signal.signal(s, self._old[s])
        finally:
            self._holding = False

    def _note(self, signum, frame):
        if self._holding:
            self._got.append((signum, frame))
            return
        # the hold is over, but a handler that raised as it came back cut short the putting
        # back of the others: this one passes the signal on
        old = self._old[signum]
        if callable(old):
            old(signum, frame)
        elif old == signal.SIG_DFL:
            signal.signal(signum, old)
            os.kill(os.getpid(), signum)

    def __exit__(self, kind, value, tb):
        if not self._old:
            return
        self._put_back()
        got = self._got   # read after the handlers are back: a signal in between is not lost
        if not got:
            return
        if kind is not None:       # the block's error goes on; the others' handlers run
            for signum, frame in got:
                if signum != signal.SIGINT and callable(self._old[signum]):
                    try:
                        self._old[signum](signum, frame)
                    except Exception:
                        pass
            return
        for signum, frame in got:             # as they came (the first that raises ends it)
            old = self._old[signum]
            if callable(old):
                old(signum, frame)            # default_int_handler: KeyboardInterrupt
            elif old == signal.SIG_DFL:       # (SIGINT's only)
                os.kill(os.getpid(), signum)
