"""How many kernels each device gets.

The basic rule is the paper's: a share proportional to the device's speed, rounded to whole
kernels exactly by the largest-remainder method, so the counts always sum to the layer's size.
"""

from __future__ import annotations

import math


def proportional(total: int, weights) -> list[int]:
    """Split `total` kernels in proportion to `weights` (>= 0, not all 0), largest remainder.

    Ties in the remainders go to the earlier device, so the result is deterministic.
    """
    weights = [float(w) for w in weights]
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {weights}")
    s = sum(weights)
    exact = [total * w / s for w in weights]
    counts = [math.floor(e) for e in exact]
    short = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:short]:
        counts[i] += 1
    return counts


def even(total: int, n: int) -> list[int]:
    """The same share for every device (as even as whole kernels allow)."""
    return proportional(total, [1.0] * n)
