"""SGD with momentum and weight decay, updating exactly as torch.optim.SGD does
(dampening 0, no Nesterov):

    d = g + weight_decay * p
    v = d                      on the first step
    v = momentum * v + d       after it
    p = p - lr * v

Works in place on NumPy or CuPy arrays, so each device updates the parameters it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SGDConfig:
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self):
        # an infinite lr or weight decay makes every weight it touches infinite or NaN at once
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight decay must be a finite number >= 0, got "
                             f"{self.weight_decay}")


def sgd_update(p, g, v, cfg: SGDConfig):
    """Update parameter p in place from its gradient g; v is its momentum buffer or None on the
    first step. Returns the momentum buffer to keep (None when momentum is 0)."""
    d = g + cfg.weight_decay * p if cfg.weight_decay else g
    if cfg.momentum:
        if v is None:
            v = d.copy()
        else:
            v *= cfg.momentum
            v += d
        d = v
    p -= cfg.lr * d
    return v
