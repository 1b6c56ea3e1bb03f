"""Timing the named parts of a piece of work (a training step, a layer's phases)."""

from __future__ import annotations

import time
from contextlib import contextmanager


class PartTimer:
    """Sums the wall time spent in each named part: ``with timer("forward"): ...``."""

    def __init__(self):
        self.parts: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0
