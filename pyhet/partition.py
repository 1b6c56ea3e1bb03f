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


# ================================================================================================
# Partitioning with a cost model: device i takes t_i(k) = overhead_i + k / speed_i seconds for k
# kernels of a layer (overhead: what it pays whatever its share, such as moving the layer's
# input to a GPU). The best split makes every device that takes part finish at the same time T:
# k_i = (T - overhead_i) * speed_i, at most cap_i (memory); a device with overhead_i >= T is
# left out, since any share would make the step slower.


def balanced(total: int, speeds, overheads=None, caps=None) -> list[int]:
    """Kernels per device minimising max_i t_i(k_i), whole numbers summing to `total`."""
    n = len(speeds)
    speeds = [float(s) for s in speeds]
    overheads = [0.0] * n if overheads is None else [max(0.0, float(o)) for o in overheads]
    caps = [total] * n if caps is None else [max(0, min(total, int(c))) for c in caps]
    if any(not math.isfinite(s) or s < 0 for s in speeds) or not any(
            s > 0 and c > 0 for s, c in zip(speeds, caps)):
        raise ValueError(f"no device can take kernels: speeds {speeds}, memory caps {caps}")
    if sum(c for s, c in zip(speeds, caps) if s > 0) < total:
        raise ValueError(f"the devices' memory holds {sum(caps)} kernels of this layer, "
                         f"{total} are needed")

    def share(T):
        return [min(c, max(0.0, (T - o) * s)) for s, o, c in zip(speeds, overheads, caps)]

    lo, hi = 0.0, max(o for o in overheads) + total / max(speeds)
    while sum(share(hi)) < total:
        hi *= 2
    for _ in range(100):  # bisection on the common finishing time T
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(share(mid)) < total else (lo, mid)
    exact = share(hi)
    scale = total / sum(exact)
    exact = [e * scale for e in exact]
    counts = [min(c, math.floor(e)) for e, c in zip(exact, caps)]
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    short = total - sum(counts)
    for i in order:
        if short == 0:
            break
        if counts[i] < caps[i] and speeds[i] > 0:
            counts[i] += 1
            short -= 1
    return counts


def predicted_time(counts, speeds, overheads=None) -> float:
    """max_i t_i(k_i) under the cost model (devices without kernels cost nothing)."""
    overheads = overheads or [0.0] * len(counts)
    return max((o + k / s) if k else 0.0 for k, s, o in zip(counts, speeds, overheads))


# ================================================================================================
# Dynamic balancing: re-measure each device's speed from its busy time in every step and move
# kernels when the devices stay out of balance.


class Balancer:
    """Watches one layer. Each step, observe(counts, busy_times) updates a speed estimate per
    device (kernels per second of busy time) and returns new counts when moving kernels is
    predicted to shorten the layer by more than `threshold`, else None.

    Devices are judged against each other: what slows every device alike (the machine, other
    work) only rescales all estimates slowly. Guards against oscillation on noisy timings: a
    single measurement moves an estimate only a little (exponential average), and one that
    differs from the estimate by more than `jump` (or three times the device's own timing
    noise) is held back: it is an outlier, or the start of a real change of speed, which is
    confirmed by `confirm` such measurements in a row, all the same way, and then replaces the
    estimate by their median. No move is made while a measurement is held back; a move needs
    its predicted gain, which must also beat the timing noise, in `patience` consecutive steps;
    the step right after a move is not measured (it may carry the move's own cost); a
    device that has kernels keeps at least one, so that it is still measured; and no device
    is given more kernels than its memory cap (`caps`), nor any when it has been left out.

    The model t(k) = overhead + k / speed keeps the calibrated overhead; where fixed costs per
    call dominate (tiny layers), a device looks slower the fewer kernels it has, and the
    partition approaches equal busy times over a few moves.
    """

    def __init__(self, total: int, speeds, overheads=None, caps=None, threshold: float = 0.04,
                 smoothing: float = 0.3, patience: int = 2, jump: float = 0.15,
                 confirm: int = 3):
        self.total = total
        self.speeds = [float(s) for s in speeds]
        self.overheads = list(overheads) if overheads else [0.0] * len(speeds)
        # the most kernels each device's memory holds (as the static plan uses them)
        self.caps = [int(c) for c in caps] if caps is not None else [total] * len(speeds)
        self.threshold, self.smoothing, self.patience = threshold, smoothing, patience
        self.jump, self.confirm = jump, confirm
        self._recent = [[] for _ in speeds]
        self._pending = [False for _ in speeds]
        self._noise = [0.0 for _ in speeds]
        self._strikes = 0
        self._skip = 0

    def leave_out(self, devices) -> None:
        """Never give these devices (indices) kernels again (they failed); the next step is
        not measured (it carries the failure's cost)."""
        for i in devices:
            self.caps[i] = 0
            self._recent[i], self._pending[i] = [], False
        self._strikes, self._skip = 0, 1

    def _measure(self, i, m):
        est = self.speeds[i]
        recent = (self._recent[i] + [m])[-self.confirm:]
        self._recent[i] = recent
        self._pending[i] = False
        # what counts as a jump grows with the device's own timing noise (3 times its mean
        # relative deviation), so that a noisy device does not keep holding moves back
        jump = max(self.jump, 3 * self._noise[i])
        if est <= 0:
            self.speeds[i] = m
        elif len(recent) == self.confirm and (all(r > est * (1 + jump) for r in recent) or
                                              all(r < est * (1 - jump) for r in recent)):
            self.speeds[i] = sorted(recent)[len(recent) // 2]
            self._recent[i] = []
        elif abs(m - est) > jump * est:
            self._pending[i] = True  # an outlier, or the start of a real change: wait and see
        else:
            self._noise[i] = 0.7 * self._noise[i] + 0.3 * abs(m - est) / est
            self.speeds[i] = (1 - self.smoothing) * est + self.smoothing * m

    def state(self) -> dict:
        """The estimates worth keeping across a restart (a checkpoint's): speeds and noise."""
        return {"speeds": list(self.speeds), "noise": list(self._noise)}

    def restore(self, state: dict) -> None:
        """Take up estimates of state() again (those of another device count are ignored)."""
        if len(state.get("speeds", ())) == len(self.speeds):
            self.speeds = [float(v) for v in state["speeds"]]
            self._noise = [float(v) for v in state.get("noise", self._noise)]

    def observe(self, counts, busy) -> list[int] | None:
        if self._skip:
            self._skip -= 1
            return None
        # speeds measured in this step (kernels per second of busy time); the overhead is
        # taken off, but never more than half the time (a bad overhead must not blow them up)
        measured = {i: k / max(t - self.overheads[i], 0.5 * t)
                    for i, (k, t) in enumerate(zip(counts, busy)) if k > 0 and t > 0}
        # What changes every device alike (the machine, the network's phase) is a drift, not a
        # change of balance: each device is judged against the others, and the common factor
        # moves all estimates slowly.
        drift = 1.0
        known = [i for i in measured if self.speeds[i] > 0]
        if len(known) >= 2:
            drift = sum(measured[i] for i in known) / sum(self.speeds[i] for i in known)
        for i, m in measured.items():
            self._measure(i, m / drift)
        if len(known) >= 2:
            scale = 1 - self.smoothing + self.smoothing * drift
            self.speeds = [v * scale for v in self.speeds]
        target = balanced(self.total, self.speeds, self.overheads, self.caps)
        for i, k in enumerate(counts):  # keep measuring every device that takes part
            if k > 0 and target[i] == 0 and self.caps[i] > 0:
                target[max(range(len(target)), key=lambda j: target[j])] -= 1
                target[i] = 1
        now = predicted_time(counts, self.speeds, self.overheads)
        best = predicted_time(target, self.speeds, self.overheads)
        # the gain must also beat what the speed estimates' own noise could make up
        threshold = max(self.threshold, max(self._noise))
        if target != list(counts) and best < now * (1 - threshold) and not any(self._pending):
            self._strikes += 1
        else:
            self._strikes = 0
        if self._strikes >= self.patience:
            self._strikes = 0
            self._skip = 1
            return target
        return None
