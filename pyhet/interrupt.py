"""SIGINT and SIGTERM while training: the step under way is finished, then the run stops.

Outside the step loop (loading data, calibrating, evaluating, saving) a signal stops the run at
once. Inside it, the first signal is noted and the devices are woken (an emulated slow device
stops idling), so that the step ends within moments; the loop then writes a checkpoint of that
step, if it has a checkpoint folder, and raises pyhet.errors.Interrupted. A second signal stops
the run at once.
"""

from __future__ import annotations

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


class HeldSigint:
    """SIGINT held back for the length of a `with` block, then handled as it would have been:
    a step's commit (every layer's new weights made current, then the fc layers' update) is
    never cut in two by Ctrl-C, which would leave some layers a step ahead of the others. Only
    in the main thread, where Python runs handlers, and where the handler is Python's (one set
    outside Python is left alone). A signal that comes while the block raises is dropped: the
    error ends the call anyway."""

    __slots__ = ("_old", "_got")

    def __enter__(self):
        self._old, self._got = None, None
        if threading.current_thread() is threading.main_thread():
            old = signal.getsignal(signal.SIGINT)
            if old is not None:
                self._old = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame):
        self._got = (signum, frame)

    def __exit__(self, kind, value, tb):
        old = self._old
        if old is None:
            return
        signal.signal(signal.SIGINT, old)
        got = self._got   # read after the handler is back: a signal in between is not lost
        if got is None or kind is not None:
            return
        if callable(old):
            old(*got)                        # default_int_handler: KeyboardInterrupt
        elif old == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)
