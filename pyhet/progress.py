"""A small progress bar on stderr: one bar per epoch with the loss and images/s.

On a terminal the bar redraws in place; otherwise (a log file, CI) it prints one line per
epoch when the epoch ends, so logs stay readable.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str, stream=None, enabled: bool = True):
        self.total, self.desc = total, desc
        self.stream = stream if stream is not None else sys.stderr
        # no stderr (closed when the process started), or one that fails: no bar, and the
        # training it reports on goes on
        self.enabled = enabled and self.stream is not None
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.n, self.t0, self._last = 0, time.perf_counter(), 0.0
        self.info = ""

    def update(self, n: int = 1, **info):
        self.n += n
        self.info = "  ".join(f"{k} {v}" for k, v in info.items())
        now = time.perf_counter()
        if self.tty and (now - self._last > 0.1 or self.n >= self.total):
            self._last = now
            self._draw(end="")

    def _draw(self, end):
        width = 24
        done = int(width * self.n / max(self.total, 1))
        bar = "#" * done + "-" * (width - done)
        elapsed = time.perf_counter() - self.t0
        line = f"{self.desc} [{bar}] {self.n}/{self.total}  {self.info}  {elapsed:.1f}s"
        try:
            self.stream.write(("\r" if self.tty else "") + line + end)
            self.stream.flush()
        except (OSError, ValueError):      # a full disk, a closed stream
            self.enabled = self.tty = False

    def close(self):
        if self.enabled:
            self._draw(end="\n")
