"""How many kernels each device gets.

The basic rule is the paper's: a share proportional to the device's speed, rounded to whole
kernels exactly by the largest-remainder method, so the counts always sum to the layer's size.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np


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
    counts = [min(c, math.floor(e * scale)) for e, c in zip(exact, caps)]
    # each of these finishes by T: the whole-kernel split is the best one once the kernels left
    # go to the devices that finish them first
    return _fill(counts, total, caps, [(speeds, overheads)])


def _fill(counts, total: int, caps, phases, among=None, weighed: bool = True) -> list[int]:
    """counts, less than `total` in all by fewer kernels than there are devices, made up to it
    one kernel at a time, each to the device that would finish it first: the one whose time
    for one kernel more (over the phases, [(speeds, overheads)]) is least. With one phase,
    from counts that all finish by the exact split's time, this gives the best split (giving
    them by the largest remainder of the exact shares does not: it ignores the speeds).
    `among`: the devices that take kernels while one of them can (the others after): with two
    phases, a device the exact split leaves out may finish one kernel first over both phases
    and still lengthen the phase its fixed cost falls in (a linked device's forward). With two
    phases each kernel goes to the device that lengthens their sum least (_fill_weighed), where
    the kernels to give times the devices are at most FILL_WEIGHED_LIMIT (and `weighed`)."""
    counts = [int(k) for k in counts]

    def finish(i, k):
        return sum(o[i] + k / s[i] for s, o in phases)

    able = [i for i, k in enumerate(counts) if k < caps[i] and all(s[i] > 0 for s, _ in phases)]
    first = set(range(len(counts)) if among is None else among)
    groups = [[i for i in able if i in first], [i for i in able if i not in first]]
    short = total - sum(counts)
    if weighed and len(phases) > 1 and short * len(able) <= FILL_WEIGHED_LIMIT:
        return _fill_weighed(counts, short, caps, phases, groups)
    for group in groups:
        heap = [(finish(i, counts[i] + 1), i) for i in group]
        heapq.heapify(heap)
        while short > 0 and heap:
            _, i = heapq.heappop(heap)
            counts[i] += 1
            short -= 1
            if counts[i] < caps[i]:
                heapq.heappush(heap, (finish(i, counts[i] + 1), i))
    return counts


FILL_WEIGHED_LIMIT = 1 << 20   # kernels to give times devices weighed, where all are weighed

# the dynamic balancer takes a local speedup (Balancer.local_speedup) within these: at least 1
# (devices that idle slow no one), at most above the most calibration gives (its contention's
# bounds, 4 over 0.9)
LOCAL_SPEEDUP_BOUNDS = (1.0, 5.0)


def _fill_weighed(counts, short: int, caps, phases, groups) -> list[int]:
    """_fill over two phases, each kernel to the device that lengthens sum_p max_i t_pi the
    least (ties: the one that finishes it first over both): the first to finish over both
    phases may be one whose phase-one time is already the longest, while another device
    still has room in both."""
    k = np.asarray(counts, float)
    cap = np.asarray(caps, float)
    sp = [(np.asarray(s, float), np.asarray(o, float)) for s, o in phases]

    def times(kk, at=slice(None)):   # (phases, devices): t_pi(kk_i) of the devices `at`
        return np.array([o[at] + kk / np.where(s[at] > 0, s[at], 1.0) for s, o in sp])

    now = np.where(k > 0, times(k), 0.0).max(axis=1)      # each phase's longest time
    for group in groups:
        idx = np.asarray(group, np.int64)
        while short > 0 and len(idx):
            t = times(k[idx] + 1, idx)                     # (phases, group)
            cost = np.maximum(t, now[:, None]).sum(axis=0)
            j = np.lexsort((t.sum(axis=0), cost))[0]
            i = idx[j]
            k[i] += 1
            short -= 1
            now = np.maximum(now, t[:, j])
            if k[i] >= cap[i]:
                idx = np.delete(idx, j)
    return [int(v) for v in k]


def predicted_time(counts, speeds, overheads=None) -> float:
    """max_i t_i(k_i) under the cost model (devices without kernels cost nothing)."""
    overheads = overheads or [0.0] * len(counts)
    return max((o + k / s) if k else 0.0 for k, s, o in zip(counts, speeds, overheads))


# ================================================================================================
# Partitioning over phases. A layer's step has two phases with a barrier between them: the
# forward (the master needs every device's output before the fc layers), then the backward
# and update. A device behind a link pays moving the layer's input in its forward and the input
# gradient back in its backward, fixed costs the other devices do not have, so its share can
# fit one phase and not the other. The best split then minimises the sum of the phases' slowest
# times, sum_p max_i t_pi(k_i), with t_pi(k) = overhead_pi + k / speed_pi as above. Where the
# phases are proportional (no device has a link) the two models agree but for the rounding to
# whole kernels; callers then keep the single-phase split.


def balanced_phases(total: int, phases, caps=None, every_split: bool = True) -> list[int]:
    """Kernels per device minimising the sum over phases of max_i t_pi(k_i): phases is a list
    of one or two (speeds, overheads), whole numbers summing to `total`.

    Two phases: every device that takes part finishes phase one by T1 and phase two by T2;
    for each T1 the least T2 that holds `total` kernels is exact (the kernels held by time T
    are piecewise linear in T), and the T1 that minimises T1 + T2 is found by a scan and a
    golden-section search. The shares are then rounded down, made up to `total` one kernel at
    a time to the device that lengthens the phases' sum least (first among those the exact
    split gives kernels: _fill), and single kernels moved between
    devices while that shortens the predicted time (up to 16 devices); with every_split, a
    layer of at most EVERY_SPLIT_LIMIT whole-kernel splits has them all weighed (milliseconds:
    the dynamic balancer, which asks every step, goes without)."""
    if len(phases) == 1:
        return balanced(total, *phases[0], caps)
    if len(phases) != 2:
        raise ValueError(f"one or two phases were expected, got {len(phases)}")
    total = int(total)
    (s1, o1), (s2, o2) = ([np.asarray(v, float) for v in ph] for ph in phases)
    n = len(s1)
    cap = (np.full(n, float(total)) if caps is None else
           np.clip(np.floor(np.asarray(caps, float)), 0, total))
    if not (np.all(np.isfinite(s1) & np.isfinite(s2)) and np.all(s1 >= 0) and np.all(s2 >= 0)):
        raise ValueError(f"speeds must be finite and >= 0: {s1.tolist()}, {s2.tolist()}")
    if np.isnan(o1).any() or np.isnan(o2).any():
        raise ValueError(f"overheads must be numbers: {o1.tolist()}, {o2.tolist()}")
    # an infinite overhead: the device can never finish a share
    able = (s1 > 0) & (s2 > 0) & (cap > 0) & np.isfinite(o1) & np.isfinite(o2)
    o1 = np.where(able, np.maximum(o1, 0.0), 0.0)
    o2 = np.where(able, np.maximum(o2, 0.0), 0.0)
    if not able.any():
        raise ValueError(f"no device can take kernels: speeds {s1.tolist()}, {s2.tolist()}, "
                         f"memory caps {cap.tolist()}")
    if cap[able].sum() < total:
        raise ValueError(f"the devices' memory holds {int(cap[able].sum())} kernels of this "
                         f"layer, {total} are needed")
    s1, s2, cap = np.where(able, s1, 1.0), np.where(able, s2, 1.0), np.where(able, cap, 0.0)

    def held(t, s, o, c):   # kernels each device finishes by time t, at most c
        return np.minimum(c, np.maximum(0.0, (t - o) * s))

    def least_t2(t1):
        c = held(t1, s1, o1, cap)
        return _least_time(s2, o2, c, total)

    t1_lo = _least_time(s1, o1, cap, total)                       # phase one alone
    k2 = held(_least_time(s2, o2, cap, total), s2, o2, cap)      # phase two alone
    t1_hi = max(t1_lo, float(np.max(np.where(k2 > 0, o1 + k2 / s1, 0.0))))
    # a scan first (the overheads can make the sum bend more than once), then a golden-section
    # search between the neighbours of the scan's best point
    grid = np.linspace(t1_lo, t1_hi, 33)
    cost = [t + least_t2(t) for t in grid]
    j = int(np.argmin(cost))
    best, t1 = cost[j], grid[j]
    a, b = grid[max(0, j - 1)], grid[min(len(grid) - 1, j + 1)]
    golden = (math.sqrt(5) - 1) / 2
    c, d = b - golden * (b - a), a + golden * (b - a)
    fc, fd = c + least_t2(c), d + least_t2(d)
    for _ in range(80):
        if b - a <= 1e-12 * max(1.0, b):
            break
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - golden * (b - a)
            fc = c + least_t2(c)
        else:
            a, c, fc = c, d, fd
            d = a + golden * (b - a)
            fd = d + least_t2(d)
    for t, f in ((c, fc), (d, fd)):
        if f < best:
            best, t1 = f, t
    exact = np.minimum(held(t1, s1, o1, cap), held(least_t2(t1), s2, o2, cap))
    exact = exact * (total / exact.sum())
    counts = [int(min(cap[i], math.floor(exact[i]))) for i in range(n)]
    phases = [(np.where(able, s1, 0.0).tolist(), o1.tolist()),
              (np.where(able, s2, 0.0).tolist(), o2.tolist())]
    # the leftover kernels given two ways, the better kept: each to the device that lengthens
    # the phases' sum least, first among those the exact split gives kernels; and each to the
    # first to finish it over both phases (which may lengthen the phase a linked device's fixed
    # cost falls in, but from where single moves sometimes end better)
    ways = [_fill(counts, total, cap, phases, among=np.flatnonzero(exact > 0).tolist()),
            _fill(counts, total, cap, phases, weighed=False)]
    if n <= 16:
        ways = [_polish(w, phases, cap) for w in ways]
    counts = min(ways, key=lambda w: phases_time(w, phases))
    # a small layer over few devices: every split weighed (the moves of single kernels can
    # stop short of the best one where a device's overhead is a step of its own)
    return _every_split(total, phases, cap, counts) if every_split else counts


EVERY_SPLIT_LIMIT = 5000     # splits weighed at once at most (a few milliseconds)


def _every_split(total: int, phases, caps, counts) -> list[int]:
    """The split of least phases_time among all of `total` kernels over the devices (within
    caps; none on a device that cannot run), where there are at most EVERY_SPLIT_LIMIT of
    them; else `counts`. Ties keep `counts`."""
    n = len(caps)
    if n < 2 or math.comb(total + n - 1, n - 1) > EVERY_SPLIT_LIMIT:
        return counts
    # every split, by stars and bars: n - 1 bars among total + n - 1 places
    bars = np.array(list(itertools.combinations(range(total + n - 1), n - 1)), np.int64)
    edges = np.concatenate([np.full((len(bars), 1), -1), bars,
                            np.full((len(bars), 1), total + n - 1)], axis=1)
    splits = np.diff(edges, axis=1) - 1                     # (splits, n)
    can = np.array([caps[i] if all(sp[i] > 0 for sp, _ in phases) else 0 for i in range(n)])
    splits = splits[(splits <= can).all(axis=1)]
    if len(splits) == 0:
        return counts
    times = np.zeros(len(splits))
    for speeds, overheads in phases:
        s, o = np.asarray(speeds, float), np.asarray(overheads, float)
        t = np.where(splits > 0, o + splits / np.where(s > 0, s, 1.0), 0.0)
        times += t.max(axis=1)
    j = int(np.argmin(times))
    if times[j] < phases_time(counts, phases) * (1 - 1e-12):
        return [int(k) for k in splits[j]]
    return counts


def _least_time(speeds, overheads, caps, total) -> float:
    """The least T at which devices of t(k) = overhead + k / speed, each at most caps[i]
    kernels, hold `total` kernels in all (inf: never). The kernels held by T are piecewise
    linear in T, bending where a device starts (T = overhead) or fills (overhead + cap/speed)."""
    use = caps > 0
    if caps[use].sum() < total * (1 - 1e-12):
        return math.inf
    s, o, c = speeds[use], overheads[use], caps[use]
    full = o + c / s
    points = np.unique(np.concatenate([o, full]))
    # a device holds its cap exactly from its fill point on: (full - o) * s may come out a
    # little short of it (o far above c / s), and a total missed by that rounding would be met
    # only at a later, wrong point
    held = np.where(points[:, None] >= full[None, :], c[None, :],
                    np.minimum(c[None, :], np.maximum(0.0, (points[:, None] - o[None, :]) *
                                                      s[None, :]))).sum(axis=1)
    j = int(np.searchsorted(held, total * (1 - 1e-12)))
    if j >= len(points):
        return float(points[-1])
    if j == 0:
        return float(points[0])
    t0, h0, t1, h1 = points[j - 1], held[j - 1], points[j], held[j]
    return float(t0 + (t1 - t0) * (total - h0) / (h1 - h0)) if h1 > h0 else float(t1)


def _polish(counts, phases, caps, moves: int = 64) -> list[int]:
    """Move single kernels between devices while that shortens phases_time."""
    counts = list(counts)
    now = phases_time(counts, phases)
    for _ in range(moves):
        best = None
        for i in range(len(counts)):
            if counts[i] == 0:
                continue
            for j in range(len(counts)):
                if j == i or counts[j] >= caps[j] or phases[0][0][j] <= 0:
                    continue
                counts[i] -= 1
                counts[j] += 1
                t = phases_time(counts, phases)
                counts[i] += 1
                counts[j] -= 1
                if t < now - 1e-12 and (best is None or t < best[0]):
                    best = (t, i, j)
        if best is None:
            break
        now, i, j = best
        counts[i] -= 1
        counts[j] += 1
    return counts


def phases_time(counts, phases) -> float:
    """sum_p max_i t_pi(k_i) under the cost model (devices without kernels cost nothing)."""
    return sum(predicted_time(counts, speeds, overheads) for speeds, overheads in phases)


def split_waits(waits: float, counts, linked=None, local_waits: float | None = None) -> float:
    """The factor a layer's split time takes for its waits between phases
    (pyhet.calibrate.Calibration.waits) with these kernels per device: 1 where one device
    holds every kernel. linked: per device, whether it has a link (another rank). Where some
    device has one, `waits` are those of a split that gives devices of other ranks kernels, and
    a split among devices of this process alone takes `local_waits` (its own, timed where the
    layer is short: it waits on no message, but on its devices' hand-offs and fixed parts;
    None: not timed, 1)."""
    if sum(1 for k in counts if k) < 2:
        return 1.0
    if among_own(counts, linked):
        return 1.0 if local_waits is None else float(local_waits)
    return float(waits)


def among_own(counts, linked) -> bool:
    """Whether these kernels per device are a split among the devices without a link (of this
    process) in a cluster where some device has one (linked: per device, or None)."""
    return (linked is not None and any(linked)
            and not any(v and k for v, k in zip(linked, counts)))


def local_phases(phases, speedup) -> list:
    """[(speeds, overheads)] per phase of a split among the devices without a link, where
    others have one: each device's compute `speedup` times faster (its contention with every
    device computing over its contention beside those without a link alone,
    pyhet.calibrate.Calibration.local_speedup; None: the same phases). Devices that share a
    machine with devices of other ranks slow down less while those idle."""
    if speedup is None:
        return phases
    return [([v * f for v, f in zip(sp, speedup)], [o / f for o, f in zip(ov, speedup)])
            for sp, ov in phases]


def split_phases(phases, counts, linked, speedup) -> list:
    """The phases that price this split: local_phases where it is among the devices without
    a link (among_own), else `phases`."""
    return local_phases(phases, speedup) if among_own(counts, linked) else phases


def with_local_split(counts, total: int, phases, caps, linked, seconds,
                     every_split: bool = True, speedup=None):
    """`counts`, or the best split among the devices without a link (local_split, on their
    local_phases by `speedup`) where `seconds` (a function of kernels per device) predicts it
    faster: a split that gives devices of other ranks kernels waits on their messages
    (split_waits), and where they share this machine, keeps its cores busier."""
    local = local_split(total, local_phases(phases, speedup), caps, linked, every_split)
    return local if local is not None and seconds(local) < seconds(counts) else counts


def local_split(total: int, phases, caps, linked, every_split: bool = True):
    """The best split of the layer among the devices without a link (balanced_phases with the
    others' caps 0), or None: no device has a link, or those without one cannot hold the layer
    or are fewer than two. Where a split that gives devices of other ranks kernels waits on
    their messages (split_waits), this one does not, and can be the faster."""
    if linked is None or not any(linked) or sum(1 for v in linked if not v) < 2:
        return None
    cut = [0 if v else c for c, v in zip(caps, linked)]
    if sum(cut) < total:
        return None
    try:
        counts = balanced_phases(total, phases, cut, every_split=every_split)
    except ValueError:
        return None
    return counts if sum(1 for k in counts if k) > 1 else None


def _bounded_speedup(values) -> list:
    """A local speedup per device within LOCAL_SPEEDUP_BOUNDS."""
    low, high = LOCAL_SPEEDUP_BOUNDS
    return [min(high, max(low, float(v))) for v in values]


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
    device that has kernels keeps at least one in a split, so that it is still measured (not
    where the layer goes to one device alone, nor a device of another rank where the split is
    among devices of this process alone); and no device
    is given more kernels than its memory cap (`caps`), nor any when it has been left out.

    The model t(k) = overhead + k / speed keeps the calibrated overhead; where fixed costs per
    call dominate (tiny layers), a device looks slower the fewer kernels it has, and the
    partition approaches equal busy times over a few moves.

    phases: the calibration's [(speeds, overheads)] of the layer's forward and backward, where
    a device has a link (balanced_phases); each device's phase speeds then follow its measured
    speed in proportion to its calibrated one. alone: each device's calibrated seconds for the
    whole layer on its own; where the best of them (longer if the device slowed) beats the
    split, the target is that device alone (pyhet.calibrate.Calibration.partition). While one
    device runs the layer alone, its busy time updates its time alone (as an average from the
    calibrated one), not its speed in a split, and the others' estimates stay: the split comes
    back when that time turns out longer than the split's. fixed: the
    seconds of each device's overhead that its link takes (moving the layer's input and input
    gradient, as the link was measured); they are taken off its busy time before the guard
    against a bad overhead, which would otherwise hold a device whose link time dominates its
    step far below its speed. waits: the layer's waits between phases where it is split
    (pyhet.calibrate.Calibration.waits), which a split's time takes, as calibration's partition
    does: a short layer over ranks whose split waits on every phase's messages stays on one
    device (split by the devices' busy times alone it went back and forth between splits 1.4
    times as slow as that device's step); linked: per device, whether it has a link (another
    rank), with which a split among devices of this process alone takes `local_waits`
    (Calibration.local_waits) where some device has one (split_waits), and is weighed beside
    the split over all; local_speedup: per device, how much faster it computes in such a split
    (Calibration.local_speedup, local_phases: devices of other ranks on this machine idle
    there), by which its speed measured in one is taken back to a split over all.
    """

    def __init__(self, total: int, speeds, overheads=None, caps=None, threshold: float = 0.04,
                 smoothing: float = 0.3, patience: int = 2, jump: float = 0.15,
                 confirm: int = 3, phases=None, fixed=None, alone=None, waits: float = 1.0,
                 linked=None, local_waits: float | None = None, local_speedup=None):
        self.total = total
        self.waits = float(waits)
        self.linked = None if linked is None else [bool(v) for v in linked]
        self.local_waits = None if local_waits is None else float(local_waits)
        self.local_speedup = (None if local_speedup is None or self.linked is None else
                              _bounded_speedup(local_speedup))
        self.speeds = [float(s) for s in speeds]
        self.overheads = list(overheads) if overheads else [0.0] * len(speeds)
        self._calibrated = list(self.speeds)
        self.fixed = [float(f) for f in fixed] if fixed is not None else [0.0] * len(speeds)
        self._alone = None if alone is None else [float(t) for t in alone]
        self._alone_seen = [None] * len(speeds)   # seconds for the layer alone, in training
        self._phases = None if phases is None or len(phases) < 2 else [
            ([float(v) for v in sp], [float(v) for v in ov]) for sp, ov in phases]
        # the most kernels each device's memory holds (as the static plan uses them)
        self.caps = [int(c) for c in caps] if caps is not None else [total] * len(speeds)
        self.threshold, self.smoothing, self.patience = threshold, smoothing, patience
        self.jump, self.confirm = jump, confirm
        self._recent = [[] for _ in speeds]
        self._pending = [False for _ in speeds]
        self._noise = [0.0 for _ in speeds]
        self._strikes = 0
        self._skip = 0

    def model(self) -> list:
        """[(speeds, overheads)] per phase as now estimated (one phase without a link)."""
        if self._phases is None:
            return [(self.speeds, self.overheads)]
        scale = [s / c if c > 0 else 0.0 for s, c in zip(self.speeds, self._calibrated)]
        return [([v * f for v, f in zip(sp, scale)], ov) for sp, ov in self._phases]

    def partition(self) -> list[int]:
        """The best kernels per device under the current estimates."""
        model = self.model()
        counts = with_local_split(
            balanced_phases(self.total, model, self.caps, every_split=False),
            self.total, model, self.caps, self.linked, self.time, every_split=False,
            speedup=self.local_speedup)
        fits = [i for i, c in enumerate(self.caps) if c >= self.total and self.speeds[i] > 0]
        if self._alone is not None and fits and sum(1 for k in counts if k) > 1:
            # by more than the threshold: a split that times about the same is kept (both
            # are estimates, and a move of a whole layer is dear to undo)
            i = min(fits, key=self._alone_now)
            if self._alone_now(i) < self.time(counts) * (1 - self.threshold):
                counts = [self.total if j == i else 0 for j in range(len(counts))]
        return counts

    def _alone_now(self, i: int) -> float:
        """Device i's time for the whole layer on its own: as measured in training where it
        has run the layer (nearly) alone; else as calibrated, longer if it has slowed since.
        Not shorter if it runs faster in a split: that is mostly the others' contention
        falling off (a device beside it that idles), which its time on its own has already."""
        if self._alone_seen[i] is not None:
            return self._alone_seen[i]
        return self._alone[i] * max(1.0, self._calibrated[i] / self.speeds[i])

    def _alone_device(self, counts):
        """The device that runs the layer on its own with these counts (it has every kernel),
        or None. A split that leaves the others a kernel each is a split: their kernel costs
        the layer their products' fixed part, each reading the layer's whole input, and the
        waits between its phases (of the default network's conv1 at batch 64, 31 kernels on a
        `cpu:1` and one on a `cpu:1@0.15` took 14.7 ms, the `cpu:1` alone 9.6 ms)."""
        if self._alone is None or len(counts) < 2:
            return None
        i = max(range(len(counts)), key=lambda j: counts[j])
        if self.speeds[i] <= 0 or counts[i] != self.total:
            return None
        return i

    def time(self, counts) -> float:
        """The layer's predicted seconds with these kernels per device, as now estimated."""
        i = self._alone_device(counts)
        if i is not None:
            return self._alone_now(i)
        phases = split_phases(self.model(), counts, self.linked, self.local_speedup)
        return phases_time(counts, phases) * split_waits(self.waits, counts, self.linked,
                                                         self.local_waits)

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
        """The estimates worth keeping across a restart (a checkpoint's): speeds, noise and
        the times alone seen in training."""
        return {"speeds": list(self.speeds), "noise": list(self._noise),
                "alone_seen": list(self._alone_seen)}

    def restore(self, state: dict) -> None:
        """Take up estimates of state() again (those of another device count are ignored)."""
        if len(state.get("speeds", ())) == len(self.speeds):
            self.speeds = [float(v) for v in state["speeds"]]
            self._noise = [float(v) for v in state.get("noise", self._noise)]
            seen = state.get("alone_seen")
            if seen is not None and len(seen) == len(self.speeds):
                self._alone_seen = [None if v is None else float(v) for v in seen]

    def observe(self, counts, busy) -> list[int] | None:
        if self._skip:
            self._skip -= 1
            return None
        # speeds measured in this step (kernels per second of busy time); the overhead is
        # taken off, but never more than half the time (a bad overhead must not blow them up),
        # after the link's fixed time (unless the link was far faster than measured)
        measured = {}
        alone = self._alone_device(counts)
        # in a split among this process's devices alone, a device computes local_speedup
        # times faster than in one over all, whose figures the estimates are
        local_now = self.local_speedup is not None and among_own(counts, self.linked)
        faster = self.local_speedup if local_now else [1.0] * len(counts)
        if alone is None:
            for i, (k, t) in enumerate(zip(counts, busy)):
                if k > 0 and t > 0:
                    own = max(t - self.fixed[i], 0.1 * t)
                    overhead = (self.overheads[i] - self.fixed[i]) / faster[i]
                    measured[i] = k / max(own - overhead, 0.5 * own) / faster[i]
        else:
            # a device that runs the layer on its own gives its time alone, not its speed in a
            # split (which contention sets); the others' estimates stay
            t = busy[alone]
            if t > 0:
                # from the time as calibrated (or last seen), so that one slow step moves it
                # only a little
                prior = self._alone_now(alone)
                self._alone_seen[alone] = (1 - self.smoothing) * prior + self.smoothing * t
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
            # the same in a split among this process's devices alone, where the devices of
            # other ranks are not measured: a machine that slows slows them too (moving the
            # measured devices' alone priced a split over all faster than it ran, and the
            # balancer moved to it; moving the speedup instead took it below 1, and the split
            # was then priced with the slowdown twice once the split over all had measured
            # it). The speedup stays as calibrated (timed as the contention over all is).
            self.speeds = [v * scale for v in self.speeds]
        target = self.partition()
        # keep measuring every device that takes part in a split; a layer that goes to one
        # device alone leaves the others none (a kernel each would measure nothing of their
        # speed, and cost the layer its fixed part and waits: _alone_device), and a split among
        # devices of this process alone leaves out the devices of other ranks (a kernel on one
        # would cost the split their messages' waits)
        split = sum(1 for k in target if k) > 1
        local = among_own(target, self.linked)
        for i, k in enumerate(counts):
            if (split and k > 0 and target[i] == 0 and self.caps[i] > 0
                    and not (local and self.linked[i])):
                target[max(range(len(target)), key=lambda j: target[j])] -= 1
                target[i] = 1
        now, best = self.time(counts), self.time(target)
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
