"""SIGINT and SIGTERM while training: the step under way is finished, then the run stops.

Outside the step loop (loading data, calibrating, evaluating, saving) a signal stops the run at
once. Inside it, the first signal is noted and the devices are woken (an emulated slow device
stops idling), so that the step ends within moments; the loop then writes a checkpoint of that
step, if it has a checkpoint folder, and raises pyhet.errors.Interrupted. A second signal stops
the run at once.
"""

from __future__ import annotations

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
