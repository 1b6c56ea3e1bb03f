"""SGD with momentum and weight decay, updating exactly as torch.optim.SGD does
(dampening 0, no Nesterov):

    d = g + weight_decay * p
    v = d                      on the first step
    v = momentum * v + d       after it
    p = p - lr * v

Works on NumPy or CuPy arrays, so each device updates the parameters it holds: in place, or
into other arrays, leaving the old state as it was (a device keeps it until the step is
committed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


# the smallest float32 > 0 (a subnormal): float32, the weights' type, holds a smaller rate as
# 0 or as this one (which is then not the rate asked for)
FLOAT32_TINY = 1.401298464324817e-45


@dataclass(frozen=True)
class SGDConfig:
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self):
        # an infinite lr or weight decay makes every weight it touches infinite or NaN at once
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if self.lr < FLOAT32_TINY:
            raise ValueError(f"lr must be a number that float32, the weights' type, holds as > 0 "
                             f"(at least {FLOAT32_TINY:.2g}), got {self.lr}")
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


def sgd_update_into(p, g, v, cfg: SGDConfig, p_out=None, v_out=None):
    """The update of sgd_update written to p_out and v_out (arrays of p's shape, or None: new
    ones; given, they share no memory with p, g or v), leaving p and v as they were. Returns
    (p_out, v_out). With momentum 0 the buffer is kept as it was, as sgd_update (and
    torch.optim.SGD) keep it: v_out a copy of v (a buffer apart, as the staged state's always
    is), None where there is none. (v_out was None: a later step with momentum started afresh
    on the conv layers alone, and a checkpoint held the fc layers' buffers without theirs,
    which resuming took for a damaged file.)"""
    if any(a is not None and a.dtype != p.dtype for a in (g, v, p_out, v_out)):
        return _by_expressions(p, g, v, cfg, p_out, v_out)
    # the rule's terms computed in place, in its order of operations (the same numbers as its
    # expressions): one temporary of p's size at a time beside the five arrays (a GPU's memory
    # holds no more, where `momentum * v + d` and `p - lr * d` took two at once, three with
    # weight decay)
    if cfg.weight_decay:
        d = p * cfg.weight_decay
        d += g
    else:
        d = g
    if cfg.momentum:
        v_out = _into(v_out, d if v is None else v)
        if v is not None:
            v_out *= cfg.momentum
            v_out += d
        d = v_out          # (the weight decay's temporary goes here)
    else:
        v_out = None if v is None else _into(v_out, v)
    p_out = _into(p_out, p)
    if d is g or d is v_out:
        p_out -= cfg.lr * d
    else:                  # the weight decay's temporary, scaled where it is
        d *= cfg.lr
        p_out -= d
    return p_out, v_out


def _by_expressions(p, g, v, cfg: SGDConfig, p_out=None, v_out=None):
    """sgd_update_into on arrays of several dtypes: the rule's expressions as written (NumPy's
    promotions, each output rounded once to its own dtype)."""
    d = g + cfg.weight_decay * p if cfg.weight_decay else g
    if cfg.momentum:
        v_out = _into(v_out, d if v is None else cfg.momentum * v + d)
        d = v_out
    else:
        v_out = None if v is None else _into(v_out, v)
    return _into(p_out, p - cfg.lr * d), v_out


def _into(dst, value):
    """value written into dst (same shape), or a copy of it when dst is None."""
    if dst is None:
        return value.copy()
    dst[...] = value
    return dst
