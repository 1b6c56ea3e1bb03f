"""Calibration: each device's speed on the real layer shapes, measured before training.

Letters as in pyhet.geometry; N is the batch size the devices are timed at.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from .devices import Device
from .geometry import GPU_OUTPUTS, ConvGeometry
from .links import link_cost, link_phase_cost
from .partition import (_bounded_speedup, among_own, balanced_phases, local_phases, local_split,
                        phases_time, split_phases, split_waits, with_local_split)
from .workers import Worker


@dataclass
class Calibration:
    """Per layer and device: kernels per second, fixed overhead per step (s), memory cap: the
    cost model t(k) = overhead + k / speed of the whole step, compute and link together. For a
    device with a link (on another rank), `parts` keeps the two apart: its compute alone
    (kernels/s, overhead s) and its link's fixed and per-kernel seconds (pyhet.links); and
    `phases` splits every device's model of that layer into the forward and the backward,
    which the partition then uses (partition(), predicted())."""
    speeds: dict      # layer -> [kernels/s per device]
    overheads: dict   # layer -> [s per device]
    caps: dict        # layer -> [max kernels per device]
    parts: dict | None = None  # layer -> [None, or {compute and link figures} per device]
    # layer -> [compute time all at once / alone, per device]: the lower of two together
    # trials where the first put the layer whole on one device; on a crowded machine, busy
    # time in the split run as a step runs it over the fit (_crowded_split)
    contention: dict | None = None
    # layer -> [[seconds per kernel, fixed seconds, 1 if the fixed part was shared with the
    # host group else 0] alone, per device]: what pyhet plan needs to place a device elsewhere
    fits: dict | None = None
    # layer -> [forward speeds, forward overheads, backward speeds, backward overheads], for
    # the layers where a device has a link (pyhet.partition.balanced_phases)
    phases: dict | None = None
    # layer -> [a device's typical time for the whole layer on its own over its cost model's
    # (its best time alone), per device]: measured for a single device of this process whose
    # memory holds the layer (_whole_layer); of several devices, each one's typical time alone
    # over its best in its trials (_spreads), or, where the layer is short, its run of the whole
    # layer as a step runs it (_small_wholes); with fastest_whole, the device fastest alone
    # at a long layer's run of it (_fastest_whole); a device of another rank's raised by its
    # run of a short layer whole (_linked_wholes). A device running a layer on its own is predicted
    # at its model times this (alone_seconds). Missing: not measured (see whole_factor)
    whole: dict | None = None
    # layer -> the layer's waits between phases beyond what its contention carries: where
    # devices of this process run a layer together, it lasts
    # longer than its busiest device (each phase waits for all: hand-offs, devices out of step);
    # the contention takes that up to WAITS_IN_CONTENTION, and the layer's time split over
    # several devices (predicted) the rest. Of a short layer, its split run as a step runs it
    # over the split's predicted time (_short_splits); where devices of other ranks take
    # part, of a split that gives them kernels (a split among this process's devices alone
    # takes local_waits: pyhet.partition.split_waits). A DDP replica, or a device copied
    # elsewhere, takes the contention alone. Missing: 1
    waits: dict | None = None
    # the master's own work of a step (the fc layers, the loss, their update) timed on this
    # machine at this batch size, where pyhet plan's master is here (inside training steps
    # where they are short: model.time_in_step; else model.time_head); else None
    master_s: float | None = None
    # that work timed in a loop of its own (model.time_head), with master_s: the rate of a
    # DDP replica's fc layers, which follow its own conv layers without waiting for devices
    head_s: float | None = None
    # with master_s, per device: True where it computes on this machine's CPU cores (not a
    # GPU), whose rate on the conv layers the master's rate on the fc layers is set against
    cpu_like: list | None = None
    # layer -> (kernels per device, seconds): each conv layer's calls timed inside those
    # training steps (model.time_in_step) with the calibration's partition, where they ran;
    # pyhet plan takes the layer at that time (its prediction of the calibrated devices times
    # that over its model's, pyhet.plan.Cluster.in_step). Training does not use it. Else None
    in_step: dict | None = None
    # with in_step, layer -> (kernels per device, seconds): each layer that partition splits
    # over several devices, timed in other training steps whole on the device calibration
    # predicts fastest at it alone (pyhet.report._whole_in_step), which each device alone
    # takes in pyhet plan (pyhet.plan.Cluster.in_step_alone). Else None
    in_step_alone: dict | None = None
    # layer -> where devices of other ranks take part, the waits of a short layer's split among
    # this process's devices alone, run as a step runs it (_short_splits), which such a
    # split takes (pyhet.partition.split_waits); `waits` are then those of a split that gives
    # devices of other ranks kernels. Missing: 1
    local_waits: dict | None = None
    # layer -> where devices of other ranks take part, per device its contention in a split
    # among this process's devices alone (the others idle: _together of those alone, timed as
    # the trial over all times them; at most their contention), which such a split takes
    # (local_speedup); a device of another rank: its contention. Missing: contention's
    local_contention: dict | None = None

    def whole_factor(self, layer: str, i: int) -> float:
        """Device i's typical time for a layer on its own over its model's: as measured
        (`whole`); where not, a single device's contention (its typical time over its best),
        else 1."""
        measured = (self.whole or {}).get(layer)
        if measured is not None:
            return measured[i]
        slower = (self.contention or {}).get(layer)
        return slower[0] if slower is not None and len(slower) == 1 else 1.0

    def phases_of(self, layer: str) -> list:
        """[(speeds, overheads)] of the layer's phases: the forward and the backward where a
        device has a link (its input and input gradient move in one phase each), else one."""
        ph = (self.phases or {}).get(layer)
        if ph is None:
            return [(self.speeds[layer], self.overheads[layer])]
        return [(ph[0], ph[1]), (ph[2], ph[3])]

    def partition(self, layer: str, total: int, caps=None) -> list:
        """Kernels per device of the layer under this cost model (ValueError if none fits): the
        best split, or the whole layer on one device where that device, with the machine to
        itself, is predicted faster than the split (devices that share a machine slow each
        other only while they all compute)."""
        caps = self.caps[layer] if caps is None else caps
        counts = with_local_split(balanced_phases(total, self.phases_of(layer), caps), total,
                                  self.phases_of(layer), caps, self.linked(layer),
                                  lambda kk: self.predicted(layer, kk),
                                  speedup=self.local_speedup(layer))
        alone = self.alone_seconds(layer, total)
        fits = [i for i, c in enumerate(caps) if c >= total]
        if alone is not None and fits:
            i = min(fits, key=lambda j: alone[j])
            if alone[i] <= self.predicted(layer, counts):
                counts = [total if j == i else 0 for j in range(len(counts))]
        return counts

    def predicted(self, layer: str, counts) -> float:
        """The layer's predicted seconds a step with these kernels per device."""
        alone = self.alone_seconds(layer, sum(counts))
        busy = [i for i, k in enumerate(counts) if k]
        if alone is not None and len(busy) == 1:
            return alone[busy[0]]   # one device on its own: its typical time alone
        return phases_time(counts, self.split_phases(layer, counts)) * split_waits(
            (self.waits or {}).get(layer, 1.0), counts, self.linked(layer),
            (self.local_waits or {}).get(layer))

    def split_phases(self, layer: str, counts) -> list:
        """The phases that price this split of the layer: phases_of, each device's compute
        local_speedup times faster where the split is among this process's devices alone
        beside devices of other ranks (pyhet.partition.split_phases)."""
        return split_phases(self.phases_of(layer), counts, self.linked(layer),
                            self.local_speedup(layer))

    def local_speedup(self, layer: str):
        """Per device, how much faster it computes in a split of the layer among this
        process's devices alone than in one over all (its contention over its local
        contention), or None where not timed."""
        local = (self.local_contention or {}).get(layer)
        slower = (self.contention or {}).get(layer)
        if local is None or slower is None:
            return None
        # within the dynamic balancer's bounds: idle devices slow no one
        return _bounded_speedup([c / lc for c, lc in zip(slower, local)])

    def linked(self, layer: str):
        """Per device, whether it has a link (another rank) on this layer, or None where the
        calibration does not say (no parts)."""
        parts = (self.parts or {}).get(layer)
        return None if parts is None else [p is not None for p in parts]

    def alone_seconds(self, layer: str, total: int):
        """Each device's seconds for all `total` kernels of the layer on its own (its fit
        alone: its whole fixed work, no contention, times its whole-layer factor; plus its
        link), or None without fits."""
        rows = (self.fits or {}).get(layer)
        if rows is None:
            return None
        parts = (self.parts or {}).get(layer) or [None] * len(rows)
        return [(intercept + total * slope) * self.whole_factor(layer, i) +
                (0.0 if p is None else p["link_fixed_s"] + total * p["link_s_per_kernel"])
                for i, ((slope, intercept, _), p) in enumerate(zip(rows, parts))]

    def as_dict(self, devices) -> dict:
        out = {}
        for layer in self.speeds:
            out[layer] = {}
            for i, d in enumerate(devices):
                row = {"kernels_per_s": round(self.speeds[layer][i], 3),
                       "overhead_s": round(self.overheads[layer][i], 6),
                       "memory_cap": self.caps[layer][i]}
                if self.contention is not None:
                    row["contention"] = round(self.contention[layer][i], 4)
                if (self.whole or {}).get(layer) is not None:
                    row["whole_layer"] = round(self.whole[layer][i], 4)
                if (self.waits or {}).get(layer) is not None:
                    row["waits"] = round(self.waits[layer], 4)
                if (self.local_waits or {}).get(layer) is not None:
                    row["local_waits"] = round(self.local_waits[layer], 4)
                local = (self.local_contention or {}).get(layer)
                linked = self.linked(layer) or [False] * len(devices)
                if local is not None and not linked[i]:
                    row["local_contention"] = round(local[i], 4)
                part = (self.parts or {}).get(layer, [None] * len(devices))[i]
                if part is not None:
                    row.update({k: round(v, 9 if k == "link_s_per_kernel" else 6)
                                for k, v in part.items()})
                out[layer][d.name] = row
        return out


def _trial_kernels(device: Device, K: int, cap: int) -> int:
    """The larger of a device's two trial sizes (the other is a quarter of it), at most the
    `cap` kernels its memory holds. On a cpu device, enough kernels for the GEMMs to run at
    speed and to outweigh the fixed costs (the slope of the two-count fit is a difference of
    two timings: at 128 and 32 kernels the timing noise of a shared machine, about 10% a trial,
    moves it by a few percent). On a GPU, the whole layer: its time is far from linear in the
    kernels until they fill its multiprocessors (on an H200 the paper network's conv2 at batch
    16 took 7-8 ms whether of 16 or of 1,500 kernels, and a fit through 64 and 256 kernels put
    the whole layer at 28 ms), so it is timed where it will work, at the whole layer and a
    quarter of it, which its speed makes cheap."""
    return max(1, min(K, cap) if device.kind == "gpu" else min(K, cap, 128))


def _time_block(device: Device, g: ConvGeometry, k: int, x, rng, need_dx: bool) -> float:
    """Seconds of compute for one forward and backward of k kernels of layer g on the batch x
    (the device's own work, emulated slowness included; for a device on another rank, its
    rank's time, without the messages)."""
    layer = f"calibrate/{g.name}"
    w = (rng.standard_normal((k, g.C, g.R, g.S)) * 0.1).astype(np.float32)
    device.call("calibration", device.load_shard, layer, g, w, np.zeros(k, np.float32))
    dout = np.ones(g.out_batch_shape(k, x.shape[0]), np.float32)
    t0 = device.compute_s
    device.call("calibration", device.conv_forward, layer, x)
    device.call("calibration", device.conv_backward, layer, dout, "own" if need_dx else "none")
    # the trial layer stays until the layer's calibration ends (calibrate drops it), and with it
    # the device's work arrays: a trial that made them afresh would time their page faults
    return device.compute_s - t0


def _together(devices, g: ConvGeometry, x, need_dx: bool, fits: list, caps: list, seed: int,
              rounds: int, apart: bool = False) -> tuple:
    """(how much slower each device computes when they all run at once on their shares, the
    layer's waits beyond them): over
    `rounds` rounds in which every device runs, at the same time, a trial of about the kernels
    the partition will give it, its median time then over its time alone as fitted (at least
    MIN_CONTENTION: a share can take Strassen's scheme where the trials did not; a single
    device at least 1). Devices that share a machine slow each other (memory bandwidth, the
    cache they share, a clock that drops when more cores run, the cores a serving rank's
    messages take), as they do in every step, and more so at the sizes of a real share than of
    a short trial; the median is a typical time where the fit is of the best ones alone. A
    single device runs its trial size: its typical time over its best.

    Devices of this process (no link) run the layer together as a training step does
    (_layer_trial: the phases, each waiting for all, and the update), and a device's time there
    is its busy time in the layer; where the layer outlasts its busiest device (out of step
    phase by phase), every device's ratio is scaled by that too, up to WAITS_IN_CONTENTION, so
    that the slowest device's predicted time is the layer's; what is beyond it, the median over
    the rounds, is returned beside the ratios (Calibration.waits: a split layer's time takes it,
    a DDP replica's contention does not). Devices with a link (another rank) run a trial each,
    at once (no waits: 1).

    Alike devices (_alike: the same SPEC in the same group) are slowed alike, but a device's own
    median is still as noisy as a few trials, which would tilt the partition between them: they
    take the median of all their ratios. Unlike devices can be slowed unlike: a device emulated at
    half speed (@0.5) idles half of its time, so the others are slowed only while it computes,
    while it computes beside them all the time, and its idling, a multiple of its compute,
    grows with it. fits: (seconds per kernel, fixed seconds) of each device alone; caps: the
    kernels each device's memory holds; apart: devices of this process timed as those beside
    devices of other ranks are, a trial each at once (the ratios then of the same kind as
    theirs: Calibration.local_contention)."""
    if len(devices) == 1:
        kernels = [_trial_kernels(devices[0], g.K, caps[0])]
    else:   # about each device's share: kernels in proportion to its speed alone
        rates = [1.0 / slope for slope, _ in fits]
        kernels = [max(1, min(g.K, cap, round(g.K * r / sum(rates))))
                   for r, cap in zip(rates, caps)]
    ratios, beyond = [[] for _ in devices], []
    if all(d.link is None for d in devices) and not apart:
        # devices of this process: the trial is the layer as training runs it
        trial = replace(g, name=f"calibrate/{g.name}/together", K=sum(kernels))
        one_group = len(devices) > 1 and all(d.group == "host" for d in devices)
        for busy, wall in _layer_trial(devices, trial, kernels, x, need_dx, rounds, seed):
            # the barriers between phases: the layer lasts longer than its busiest device
            # where the devices are out of step phase by phase; all are charged alike
            waste = max(1.0, wall / max(max(busy), 1e-12))
            beyond.append(waste / min(WAITS_IN_CONTENTION, waste))
            waste = min(WAITS_IN_CONTENTION, waste)
            for i, (k, t) in enumerate(zip(kernels, busy)):
                slope, intercept = fits[i]
                if k > 0:   # its time as the cost model gives it, from its fit alone
                    fitted = k * (slope + intercept / trial.K) if one_group else \
                        k * slope + intercept / _group_size(devices, devices[i])
                    ratios[i].append(t * waste / fitted)
        ratios = [r or [1.0] for r in ratios]
    else:
        workers = []
        try:
            workers = [Worker(f"pyhet-trial-{i}") for i in range(len(devices))]
            for r in range(rounds):
                rngs = [np.random.default_rng((seed, r, i)) for i in range(len(devices))]
                times = [w.result() for w in [
                    workers[i].submit(_time_block, devices[i], g, kernels[i], x, rngs[i],
                                      need_dx) for i in range(len(devices))]]
                for i, t in enumerate(times):
                    slope, intercept = fits[i]
                    ratios[i].append(t / (intercept + kernels[i] * slope))
        finally:
            for w in workers:
                w.shutdown(wait=True)

    return (_pooled(devices, ratios, 1.0 if len(devices) == 1 else MIN_CONTENTION),
            min(MAX_CONTENTION, float(np.median(beyond))) if beyond else 1.0)


def _pooled(devices, ratios: list, low: float) -> list:
    """Per device, the median of its alike devices' ratios (`ratios`: a list per device)
    within [low, MAX_CONTENTION]; None where they have none."""
    pooled = {}
    for d, r in zip(devices, ratios):
        pooled.setdefault(_alike(d), []).extend(r)
    return [min(MAX_CONTENTION, max(low, float(np.median(pooled[_alike(d)]))))
            if pooled[_alike(d)] else None for d in devices]


def _whole_layer(device: Device, g: ConvGeometry, x, need_dx: bool, model_s: float,
                 seed: int, budget_s: float | None = None) -> float:
    """The device's typical time for the whole layer g, as a training step runs it (after its
    warm-ups, the median of three runs where they take at most `budget_s` together by
    `model_s` (default WHOLE_BUDGET_S), and of more where they take less than TRIAL_BUDGET_S
    together, else one), over
    its cost model's best time alone, `model_s`, within [0.5, 2]: the layer's whole-layer
    factor of a single device. The model is fitted on the best of trials of a few kernels;
    the whole layer can run faster (a cpu device's GEMM runs products whose every dimension is
    at least 768 by Strassen's scheme, about 6% faster, which the trials are too small for) or
    slower (a typical time rather than the best; the update and the step's hand-offs; caches
    that hold a trial's operands and not the layer's)."""
    trial = replace(g, name=f"calibrate/{g.name}/whole")
    # the median of three where that is cheap enough: one run of a second moved by 10% on a
    # shared machine, and a single device's plan is this time
    rounds = 3 if 3 * model_s <= (WHOLE_BUDGET_S if budget_s is None else budget_s) else 1
    times = [max(busy[0], wall)
             for busy, wall in _layer_trial([device], trial, [g.K], x, need_dx, rounds, seed)]
    return min(2.0, max(0.5, float(np.median(times)) / model_s))


def _spreads(devices, times: dict, trials: list) -> list:
    """Of several devices, each one's typical time on its own over its best (the median over
    the best of its rounds of its larger trial, within [1, 2]; alike devices the median of
    theirs): the whole-layer factor of a device that runs a layer alone among several. Its
    cost model is its best time alone, and its contention is measured beside the others. A
    single H200's typical time was 1.46 times its best in one run's calibration (its layers
    are milliseconds of launches from Python), where a cpu device's is within a few
    percent."""
    own = [float(np.median(times[t]) / max(min(times[t]), 1e-12)) for t in trials]
    pooled = {}
    for d, r in zip(devices, own):
        pooled.setdefault(_alike(d), []).append(r)
    return [min(2.0, max(1.0, float(np.median(pooled[_alike(d)])))) for d in devices]


def _small_wholes(factors: list, devices, g: ConvGeometry, x, need_dx: bool, fits, memory,
                  seed: int) -> None:
    """Of several devices, each one's whole-layer factor (in `factors`, in place) timed on the
    whole layer as a training step runs it (_whole_layer) where that layer is short (its model
    at most SMALL_WHOLE_S): one device of this process alike its others (alike devices share
    it). There a step's hand-offs to the device and back, which its trials of a few kernels do
    not time, are a large part of the layer (the default network's conv1 at batch 4 on a cpu:1
    of a pair: 1.64-1.72 ms in a step, 1.23-1.39 ms by its trials' spread); a long layer takes
    its trials' spread (_spreads), where they are noise."""
    done = {}
    for i, d in enumerate(devices):
        slope, intercept = fits[i]
        model_s = intercept + g.K * slope
        if d.link is not None or memory[i] < g.K or model_s > SMALL_WHOLE_S:
            continue
        if _alike(d) not in done:
            done[_alike(d)] = _whole_layer(d, g, x, need_dx, model_s, seed)
        factors[i] = done[_alike(d)]


def _fastest_whole(factors: list, devices, g: ConvGeometry, x, need_dx: bool, fits, memory,
                   seed: int, budget_s: float | None) -> None:
    """Of several devices, the one of this process whose memory holds the layer g and that is
    predicted fastest at it alone (its model times its factor in `factors`) runs it whole as a
    step runs it (_whole_layer), where that layer is longer than _small_wholes times: that is
    its whole-layer factor (in `factors`, in place; alike devices share it), and the time
    pyhet plan gives the best single device. Its model is fitted on trials of a few kernels,
    which miss what the whole layer runs (a GEMM whose every dimension is at least 768 takes
    Strassen's scheme, and larger products run faster): a `cpu:1` of a pair was 5.16 s a step
    of the paper network at batch 16 by its fit and trials' spread, 4.77 s measured alone, and
    the pair 2.17 times as fast as one of them by the plan (1.95 measured). Where the device
    so timed is then predicted slower than another kind's, whose factor is its trials' spread,
    that one is timed so too, until the fastest has been (at most once for each kind). The
    pick is the layer's: where the fastest device differs between layers, the plan's best
    single device's other layers are those of _small_wholes, else its trials' spread."""
    own = [i for i, d in enumerate(devices) if d.link is None and memory[i] >= g.K]
    if not own:
        return
    model = {i: fits[i][1] + g.K * fits[i][0] for i in own}
    timed = set()
    while True:
        best = min(own, key=lambda i: model[i] * factors[i])
        # (a short layer: timed whole by _small_wholes, where calibration ran together trials)
        if _alike(devices[best]) in timed or model[best] <= SMALL_WHOLE_S:
            return
        factor = _whole_layer(devices[best], g, x, need_dx, model[best], seed, budget_s)
        timed.add(_alike(devices[best]))
        for i in own:
            if _alike(devices[i]) == _alike(devices[best]):
                factors[i] = factor


def _group_size(devices, d) -> int:
    """The devices that share d's im2col and input gradient (d's group of this process)."""
    return 1 if d.group is None else sum(e.group == d.group for e in devices)


def _layer_trial(devices, g: ConvGeometry, counts, x, need_dx: bool, rounds: int, seed: int,
                 budget_s: float | None = None):
    """[(busy seconds of each device, wall seconds)] of `rounds` runs of layer g with
    `counts` kernels per device (a device of another rank: its rank's compute, without the
    messages), as a training step runs it (pyhet.parallel.PartitionedConv:
    the shared im2col, the forward, the backward with its input gradient, the update staged;
    each phase waits for every device), after WARM_UPS runs that warm it up (the page faults
    of its buffers, and of those that take turns with them); and of more runs, up to
    5 * rounds, while they take less than `budget_s` together (default TRIAL_BUDGET_S): a layer
    of a few milliseconds is as cheap to time ten times as a big one once, and its median over
    three runs moves by 10-20% on a shared machine. Its shards are dropped after."""
    from .optim import SGDConfig
    from .parallel import PartitionedConv

    rng = np.random.default_rng((seed, g.K))
    w = (rng.standard_normal(g.weight_shape) * 0.1).astype(np.float32)
    layer = PartitionedConv(g, w, np.zeros(g.K, np.float32), devices, counts, need_dx)
    dout = np.ones(g.out_batch_shape(g.K, x.shape[0]), np.float32)
    budget_s = TRIAL_BUDGET_S if budget_s is None else budget_s
    out = []
    try:
        for r in range(5 * rounds + WARM_UPS):
            if r >= rounds + WARM_UPS and sum(wall for _, wall in out) >= budget_s:
                break
            before = [d.compute_by_tag.get(g.name, 0.0) for d in devices]
            t0 = time.perf_counter()
            layer.forward(x)
            layer.backward(dout)
            layer.step(SGDConfig())
            layer.commit()
            wall = time.perf_counter() - t0
            if r >= WARM_UPS:
                out.append(([d.compute_by_tag.get(g.name, 0.0) - b
                             for d, b in zip(devices, before)], wall))
    finally:
        for d in devices:
            d.call("calibration", d.drop_shard, g.name)
    return out


def _alike(d) -> tuple:
    """What alike devices share: the same SPEC (without its rank) in the same group (this
    process's host group, or one rank's), and a link or none alike."""
    return (d.spec.kind, d.spec.arg, d.spec.speed, d.group, d.link is None)


TRIAL_BUDGET_S = 0.3   # a layer trial's runs go on to this many seconds (_layer_trial)
# Runs of a layer trial before the timed ones: the first touches the work arrays, the second the
# arrays that take turns with them (the update's staged state, a host group's second weight
# array), whose page faults made the first timed run of the paper network's conv2 9-36% slower
WARM_UPS = 2
WHOLE_BUDGET_S = 4.0   # a single device's whole-layer runs: three where they fit (_whole_layer)
# pyhet plan's: its prediction is all it is run for, and a single device's plan, and the best
# single device beside described copies of it, are this time (one run of the paper network's
# conv2 on a 2-core Zen 1 VM moved by 10% from one plan to the next: 0.89-0.99 of its model)
PLAN_WHOLE_BUDGET_S = 30.0
# A layer trial's wall time over its busiest device's that its contention takes; beyond it,
# the layer's waits (Calibration.waits)
WAITS_IN_CONTENTION = 1.5
# A layer whose model on one device is at most this long is timed whole on each device of
# several, as a step runs it (_small_wholes)
SMALL_WHOLE_S = 0.05
MAX_CONTENTION = 4.0   # a ratio beyond this is a disturbance of the machine, not contention
# A device can run its share faster among the others than its fit alone says: the layer as a
# step runs it can take Strassen's scheme where the trials are too small for it (a host
# group's shares, from 256 kernels, 7-9% faster on their products). Below this: noise.
MIN_CONTENTION = 0.9
# a device's contention with the devices of other ranks idle counts where it is at least this
# factor below its contention with them computing (Calibration.local_contention)
LOCAL_SPEEDUP_NOISE = 1.05


def calibrate(devices, geometries, batch: int, seed: int = 0, rounds: int = 5,
              together: int = 3, whole_budget_s: float | None = None,
              fastest_whole: bool = False) -> Calibration:
    """Each device's speed on each conv layer (ConvGeometry) at this batch size, from a warm,
    short run on the real shapes.

    The devices are timed one at a time (so that devices sharing cores or memory bandwidth do
    not disturb each other), in rounds (d0 d1 ... d0 d1 ...) after two warm-up runs each, and
    the best time of each of the `rounds` is kept, so that a drift of the machine hits all of
    them alike; alike devices of this process (the same SPEC) take the mean of their best
    times. These best times alone give the devices' relative speeds. Then, in `together` more
    rounds (more where they are short: _layer_trial), all devices run a trial of about their
    share at once, and each device's compute time is scaled by its median ratio of that to its
    fitted time alone (`contention`, see _together): what the devices cost each other in a real
    step, and a typical time rather than the best one, so that the predicted step time is what a
    step takes.

    Each device is timed alone at two kernel counts, and t(k) = intercept + k / slope fitted
    through them; the intercept is its fixed work (its own im2col and col2im of the whole
    layer). A device outside the host group (a GPU, a device on another rank) pays it whatever
    its share: overhead = intercept. The devices of the host group share one im2col and one
    input gradient, each doing a part in proportion to its kernels. Where every device is of the
    host group, device i's time is then k_i / slope_i + intercept_i * k_i / K, proportional to
    its share: no overhead, and speed = 1 / (1 / slope + intercept / K). Beside other devices,
    the group's fixed part is paid whatever the group's share of the kernels, and each host
    device carries an equal part of it as its overhead.

    The cpu devices of another rank are a group of their own (they share an im2col on their
    rank), fitted the same way. A device on another rank is timed by its rank (compute alone);
    its link (device.link, as measured at start-up) adds a fixed and a per-kernel time by
    pyhet.links, and the sum is its cost model. The members of a group send their slices over
    one link in one message, so each is charged the group's fixed traffic and its per-kernel
    traffic as many times as the group has members (the others' kernels travel with its own:
    exact when their shares are equal). The first layer needs no input gradient (nothing before
    it learns), so it is timed and its traffic counted without one. Beside devices of other
    ranks on this machine, the devices of this process also run a together trial of their own
    (the others idle): their contention in a split among them alone
    (Calibration.local_contention), which computes faster than the together trial over all
    puts it where the other ranks share this machine's cores.

    A single device also times each whole layer as a step runs it (_whole_layer), three times
    where three take at most `whole_budget_s` together (default WHOLE_BUDGET_S; pyhet plan's
    is PLAN_WHOLE_BUDGET_S), else once. With `fastest_whole` (pyhet plan's), of several devices,
    the one of this process predicted fastest at a layer alone times it whole so too
    (_fastest_whole): the best single device's time.
    """
    rng = np.random.default_rng(seed)
    speeds, overheads, caps, parts, contention, fitted, phases = {}, {}, {}, {}, {}, {}, {}
    whole = {}   # layer -> [whole-layer factor per device] (_whole_layer, _spreads)
    waits = {}   # layer -> its waits beyond the contention (Calibration.waits)
    local_waits = {}   # layer -> the waits of its split among this process's devices alone
    local_contention = {}   # layer -> contention there (Calibration.local_contention)
    models = {}   # layer -> what _layer_model (and a second together trial) needs
    for index, g in enumerate(geometries):
        need_dx = index > 0
        x = rng.standard_normal(g.x_shape(batch)).astype(np.float32)
        memory = []   # the kernels each device's memory holds (before the trials take some)
        for d in devices:
            free = d.free_memory()
            memory.append(g.K if free is None else int(
                max(0, free * 0.8 - g.fixed_bytes(batch)) // g.bytes_per_kernel(
                    batch, GPU_OUTPUTS if d.kind == "gpu" else 2)))
        one_group = len({d.group for d in devices}) == 1 and devices[0].group is not None
        larger = [_trial_kernels(d, g.K, memory[i]) for i, d in enumerate(devices)]
        # alike devices of this process (the same SPEC, neither pinned to a core: the same
        # hardware) share the mean of their best times, so that timing noise does not tilt the
        # partition between them (a mean: the best of all their trials would favour them over
        # a device alone of its kind); they run the same trials, of the fewest kernels any of
        # them was given (their memory read a moment apart can hold a kernel more or less)
        alike = {}
        for i, d in enumerate(devices):
            if d.link is None:
                alike.setdefault(_alike(d), []).append(i)
        for members in alike.values():
            fewest = min(larger[j] for j in members)
            for j in members:
                larger[j] = fewest
        trials = []  # (device index, kernels)
        for i, kb in enumerate(larger):
            trials.append((i, kb))
            if kb // 4 >= 1 and kb // 4 < kb:
                trials.append((i, kb // 4))
        for i, k in trials:  # warm-up: page faults, thread pools, GPU kernels, clocks
            for _ in range(2):
                _time_block(devices[i], g, k, x, rng, need_dx)
        times = {t: [] for t in trials}
        for _ in range(rounds):
            for i, k in trials:
                times[(i, k)].append(_time_block(devices[i], g, k, x, rng, need_dx))
        best = {t: min(ts) for t, ts in times.items()}
        shared = {(i, k): float(np.mean([best[(j, k)] for j in members]))
                  for members in alike.values() for i, k in trials if i in members}
        best.update(shared)
        fits = []   # (seconds per kernel, fixed seconds) of each device alone
        for i, (d, kb) in enumerate(zip(devices, larger)):
            tb = best[(i, kb)]
            fit = (tb / kb, 0.0)
            if (i, kb // 4) in best and kb // 4 < kb:
                ka, ta = kb // 4, best[(i, kb // 4)]
                slope = (tb - ta) / (kb - ka)
                # else noise: keep k / t. A GPU's time can be almost all fixed (launches,
                # transfers, multiprocessors left idle by a small layer): its fit may say so,
                # and where its quarter timed as slow as its whole (or its fixed part came out
                # above that), it is taken as that much fixed, not as proportional to k, the
                # worst model of such a GPU.
                most = 0.98 if d.kind == "gpu" else 0.9
                if slope > 0 and 0 <= tb - kb * slope < most * tb:
                    fit = (slope, tb - kb * slope)
                elif d.kind == "gpu" and (slope <= 0 or tb - kb * slope >= most * tb):
                    fit = ((1 - most) * tb / kb, most * tb)
            fits.append(fit)
        slower, beyond = (_together(devices, g, x, need_dx, fits, memory, seed, together)
                          if together > 0 else ([1.0] * len(devices), 1.0))
        if len(devices) > 1 and beyond > 1.0:
            waits[g.name] = beyond
        own = [i for i, d in enumerate(devices) if d.link is None and memory[i] > 0]
        if together > 0 and len(own) > 1 and any(d.link is not None and d.on_master_machine
                                                 for d in devices):
            # a split among this process's devices alone: their contention with the devices
            # of other ranks idle, where some of those share this machine's cores, timed as
            # the trial over all timed them (a trial each, at once), so that the two differ
            # by the others' idling alone; not above it (idle devices slow no one), nor
            # below it by less than LOCAL_SPEEDUP_NOISE. Ranks on other machines slow these
            # devices no more while they compute (the master sleeps while it waits for their
            # replies): no trial, their contention
            here, _ = _together([devices[i] for i in own], g, x, need_dx,
                                [fits[i] for i in own], [memory[i] for i in own], seed,
                                together, apart=True)
            local_contention[g.name] = list(slower)
            for j, i in enumerate(own):
                # a ratio within the trials' noise is none (the lower of two noisy medians
                # would lean every split towards the master's devices)
                if here[j] * LOCAL_SPEEDUP_NOISE < slower[i]:
                    local_contention[g.name][i] = here[j]
        for d in devices:   # the trial layer, and the work arrays it kept
            d.call("calibration", d.drop_shard, f"calibrate/{g.name}")
        contention[g.name] = slower
        if len(devices) == 1 and memory[0] >= g.K and devices[0].link is None:
            slope, intercept = fits[0]
            if larger[0] < g.K:
                whole[g.name] = [_whole_layer(devices[0], g, x, need_dx,
                                              intercept + g.K * slope, seed, whole_budget_s)]
            else:   # the together trial ran the whole layer: its typical time over its best
                whole[g.name] = [min(2.0, slower[0])]
        elif len(devices) > 1:
            whole[g.name] = _spreads(devices, times, list(enumerate(larger)))
            if together > 0:
                _small_wholes(whole[g.name], devices, g, x, need_dx, fits, memory, seed)
            if fastest_whole:
                _fastest_whole(whole[g.name], devices, g, x, need_dx, fits, memory, seed,
                               whole_budget_s)
        fitted[g.name] = [[slope, intercept, int(d.group == "host")]
                          for (slope, intercept), d in zip(fits, devices)]
        models[g.name] = (devices, g, batch, need_dx, fits, memory, one_group)
        _layer_model(*models[g.name], slower, speeds, overheads, caps, parts, phases)
    cal = Calibration(speeds, overheads, caps, parts, contention, fitted, phases or None,
                      whole or None, waits or None, local_waits=local_waits or None,
                      local_contention=local_contention or None)
    # layer -> (its split, [wall times]) where the split ran as a step runs it
    splits = {}
    if together > 0:
        for index, g in enumerate(geometries):
            _linked_wholes(cal, devices, g, batch, index > 0, seed, together)
            for counts in _short_splits(cal, g):
                wall = _median_wall(devices, g, "split", counts, batch, index > 0, seed,
                                    together)
                into = local_waits if among_own(counts, cal.linked(g.name)) else waits
                if into is waits:
                    splits[g.name] = (counts, [wall])
                _set_waits(into, g.name, _split_waits_of(cal, g.name, counts, wall))
        cal = replace(cal, waits=waits or None, local_waits=local_waits or None)
        if _crowds(devices):
            for g in geometries:
                _crowded_split(cal, models[g.name], contention, speeds, overheads, caps, parts,
                               phases, waits, local_contention, seed, together)
            cal = replace(cal, waits=waits or None)
    for index, g in enumerate(geometries):
        _, _, _, need_dx, fits, memory, _ = models[g.name]
        if together > 0 and _alone_by_one_trial(cal, devices, g, memory):
            # the whole layer on one device, where the others could take kernels: a decision
            # as costly as it is rare, and a together trial that a moment's disturbance of the
            # machine slowed (the pair 1.55 and 1.80 times their fits, d0 0.9-1.35 in others)
            # takes it for a whole run; a second trial, and the lower of the two figures (a
            # disturbance only slows)
            x = np.random.default_rng((seed, index)).standard_normal(
                g.x_shape(batch)).astype(np.float32)   # (any input: a trial of its time)
            again, beyond = _together(devices, g, x, need_dx, fits, memory, seed + 1, together)
            contention[g.name] = [min(a, b) for a, b in zip(contention[g.name], again)]
            _layer_model(*models[g.name], contention[g.name], speeds, overheads, caps, parts,
                         phases)
            if g.name in splits:   # the split again, its waits by the faster of the two
                counts, walls = splits[g.name]
                walls.append(_median_wall(devices, g, "split", counts, batch, need_dx,
                                          seed + 1, together))
                _set_waits(waits, g.name, _split_waits_of(cal, g.name, counts, min(walls)))
            elif g.name in waits:
                waits[g.name] = min(waits[g.name], beyond)
    return Calibration(speeds, overheads, caps, parts, contention, fitted, phases or None,
                       whole or None, waits or None, local_waits=local_waits or None,
                       local_contention=local_contention or None)


def _linked_wholes(cal: Calibration, devices, g: ConvGeometry, batch: int, need_dx: bool,
                   seed: int, rounds: int) -> None:
    """Each device of another rank whose memory holds the layer g and whose time alone on it
    is predicted at most SMALL_WHOLE_S: the whole layer run on it as a step runs it
    (_layer_trial, every phase's messages there and back), the median of its runs less its
    link's predicted time, over its model alone, raises its whole-layer factor
    (Calibration.whole, in place; at most MAX_CONTENTION), which its time alone takes: a short
    layer's messages and the serving rank's hand-offs, which its trials do not time, made a
    device of another rank on the same machine look as fast alone as the master's own, and
    one calibration in two put a layer whole on it."""
    if (all(d.link is None for d in devices) or g.name not in (cal.fits or {})
            or g.name not in (cal.whole or {})):
        return
    alone = cal.alone_seconds(g.name, g.K)
    for i, d in enumerate(devices):
        part = (cal.parts or {}).get(g.name, [None] * len(devices))[i]
        if d.link is None or part is None or cal.caps[g.name][i] < g.K or not (
                0 < alone[i] <= SMALL_WHOLE_S):
            continue
        slope, intercept, _ = cal.fits[g.name][i]
        link_s = part["link_fixed_s"] + g.K * part["link_s_per_kernel"]
        counts = [g.K if j == i else 0 for j in range(len(devices))]
        wall = _median_wall(devices, g, f"whole-{i}", counts, batch, need_dx, seed, rounds)
        factor = (wall - link_s) / max(intercept + g.K * slope, 1e-12)
        cal.whole[g.name][i] = min(MAX_CONTENTION, max(cal.whole[g.name][i], factor))


def _short_splits(cal: Calibration, g: ConvGeometry) -> list:
    """The splits of a short layer (each predicted at most SMALL_WHOLE_S, over at least two
    devices) that calibration runs as a step runs them (_median_wall): the best split over
    all devices, and where devices of other ranks take part, the best among this process's
    devices alone too. The wall time of each over its predicted time is its waits
    (_split_waits_of: Calibration.waits, or local_waits of a split among this process's devices
    in a cluster with devices of other ranks), which the split's time takes, so that a device
    alone, or the other split, is preferred where the split is slower: a short layer's phases
    each wait on a message's latency there and back, and on the serving rank's hand-offs,
    which the devices' trials, one at a time and at once, do not time (the four-layer
    16C3p1-P2-32C3p1s2-32C3p1-48C3p1-P2-64N at batch 64 split over two ranks of `cpu:1` on one
    2-core machine ran 27 ms a step, where its split was predicted 20 ms and one device alone
    takes 19.6 ms); and where a device's share is a kernel or two, its time is its products'
    fixed part, each of them reading the layer's whole input (of the default network's conv1
    at batch 64, one kernel on a `cpu:1@0.15` beside a `cpu:1` took 13.5 ms a step against the
    7 ms its together trial of two kernels gave it, and the split 14.7 ms against 9.6 ms for
    the `cpu:1` alone)."""
    try:
        full = balanced_phases(g.K, cal.phases_of(g.name), cal.caps[g.name])
    except ValueError:
        return []
    local = local_split(g.K, local_phases(cal.phases_of(g.name), cal.local_speedup(g.name)),
                        cal.caps[g.name], cal.linked(g.name))
    out = []
    for counts in (full, local):
        if (counts is not None and counts not in out and sum(1 for c in counts if c) > 1
                and 0 < phases_time(counts, cal.split_phases(g.name, counts)) <= SMALL_WHOLE_S):
            out.append(counts)
    return out


def _crowds(devices) -> bool:
    """Whether devices of other ranks share the master's machine and the job's cpu threads
    there outnumber its cores (Device.crowded), so that its devices take turns on the cores."""
    return any(d.link is not None and d.on_master_machine for d in devices) and any(
        d.crowded for d in devices)


def _crowded_split(cal: Calibration, model: tuple, contention: dict, speeds: dict,
                   overheads: dict, caps: dict, parts: dict, phases: dict, waits: dict,
                   local_contention: dict, seed: int, rounds: int) -> None:
    """On a crowded machine (_crowds), the layer's split under the cost model, where it gives
    kernels to a device of another rank on the master's machine and is longer than
    SMALL_WHOLE_S (a shorter one's split is timed by _short_splits, for its waits only), run
    as a step runs it
    (_layer_trial): each device's contention there (its compute time over its fit's, the
    median of the runs, alike devices pooled) replaces the one of its trial at once, the
    layer's cost model is made again (into the dicts, in place), and the split's wall time over
    that model is the layer's waits (in `waits`). Where the job's threads there outnumber the
    cores, which device runs when is the scheduler's, and follows the step's pattern: the
    master's messages, each phase waiting for all, a device emulated at half speed idling
    between its calls. Its trials at once, a trial each, knew none of it: three processes of
    `0/cpu:1,1/cpu:1@0.5,2/cpu:1@0.5` on 2 cores had the ranks' devices at about 1.5 times
    their fits there and at 1.6-1.9 in their split run so; partitioned by the first, the ranks'
    devices were busy 89-97% of the step and the master's waited for them 0.5-0.7 s of 4.7
    (the paper network at batch 16; by the second 0.02-0.29 s of 3.8-4.1). Where the layer
    has a local contention (`local_contention`, in place), a device's that is not below its
    new contention by LOCAL_SPEEDUP_NOISE is that contention (idle ranks slow no one), and a
    device of another rank's is its contention, as calibrate made them."""
    devices, g, batch, need_dx, fits, memory, one_group = model
    try:
        counts = cal.partition(g.name, g.K)
    except ValueError:
        return
    if (sum(1 for c in counts if c) < 2
            or not any(c and d.link is not None and d.on_master_machine
                       for c, d in zip(counts, devices))
            or phases_time(counts, cal.split_phases(g.name, counts)) <= SMALL_WHOLE_S):
        return
    x = np.random.default_rng((seed, g.K, 1)).standard_normal(
        g.x_shape(batch)).astype(np.float32)
    trial = replace(g, name=f"calibrate/{g.name}/crowded")
    runs = _layer_trial(devices, trial, counts, x, need_dx, rounds, seed)
    ratios = [[busy[i] / (k * fits[i][0] + fits[i][1] / _group_size(devices, d))
               for busy, _ in runs] if k else [] for i, (d, k) in enumerate(zip(devices, counts))]
    slower = [c if m is None or not k else m for c, m, k in
              zip(contention[g.name], _pooled(devices, ratios, MIN_CONTENTION), counts)]
    contention[g.name] = slower
    local = local_contention.get(g.name)
    if local is not None:
        for i, d in enumerate(devices):
            if d.link is not None or local[i] * LOCAL_SPEEDUP_NOISE >= slower[i]:
                local[i] = slower[i]
    _layer_model(*model, slower, speeds, overheads, caps, parts, phases)
    _set_waits(waits, g.name, _split_waits_of(cal, g.name, counts,
                                              float(np.median([wall for _, wall in runs]))))


def _set_waits(waits: dict, layer: str, value: float) -> None:
    """The layer's waits in `waits` where above 1; else none (1)."""
    if value > 1.0:
        waits[layer] = value
    else:
        waits.pop(layer, None)


def _split_waits_of(cal: Calibration, layer: str, counts, wall: float) -> float:
    """A split's waits (Calibration.waits): its wall time as a step runs it over its predicted
    time under the cost model, within [1, MAX_CONTENTION]."""
    model_s = phases_time(counts, cal.split_phases(layer, counts))
    return min(MAX_CONTENTION, max(1.0, wall / max(model_s, 1e-12)))


def _median_wall(devices, g: ConvGeometry, what: str, counts, batch: int, need_dx: bool,
                 seed: int, rounds: int) -> float:
    """The median wall time of layer g run with `counts` kernels per device as a step runs it
    (_layer_trial, as `calibrate/<layer>/<what>`), on any input of its shape."""
    x = np.random.default_rng((seed, g.K, len(what))).standard_normal(
        g.x_shape(batch)).astype(np.float32)
    trial = replace(g, name=f"calibrate/{g.name}/{what}")
    return float(np.median([wall for _, wall in _layer_trial(devices, trial, counts, x, need_dx,
                                                             rounds, seed)]))


def _alone_by_one_trial(cal: Calibration, devices, g: ConvGeometry, memory) -> bool:
    """Whether the calibration puts the whole layer on one device of this process where
    another could take kernels: a split that its together trial found slower than that device
    alone."""
    if len(devices) < 2 or any(d.link is not None for d in devices):
        return False
    try:
        counts = cal.partition(g.name, g.K)
    except ValueError:
        return False
    return sum(1 for c in counts if c) == 1 and sum(1 for m in memory if m > 0) > 1


def _layer_model(devices, g: ConvGeometry, batch: int, need_dx: bool, fits, memory,
                 one_group: bool, slower, speeds, overheads, caps, parts, phases) -> None:
    """The layer's cost model per device (speed, overhead, cap, compute and link parts, and
    where a device has a link its phases) from its fits alone and its contention `slower`,
    into the calibration's dicts."""
    def group_size(d):   # the devices that share d's im2col and input gradient
        return _group_size(devices, d)

    speeds[g.name], overheads[g.name], caps[g.name], parts[g.name] = [], [], [], []
    split = [[], [], [], []]   # forward speeds and overheads, backward speeds and overheads
    forward = g.forward_share(need_dx)
    for i, d in enumerate(devices):
        slope, intercept = fits[i]
        if one_group:   # the fixed work is shared in proportion to the kernels
            speed, overhead = 1.0 / (slope + intercept / g.K), 0.0
        else:
            speed, overhead = 1.0 / slope, intercept / group_size(d)
        speed, overhead = speed / slower[i], overhead * slower[i]
        cap = memory[i]
        part = None
        links = ((0.0, 0.0), (0.0, 0.0))
        if d.link is not None:   # compute plus communication
            fixed_s, per_kernel_s = link_cost(d.link, g, batch, need_dx)
            per_kernel_s *= group_size(d)
            links = [(f, p * group_size(d))
                     for f, p in link_phase_cost(d.link, g, batch, need_dx)]
            part = {"compute_kernels_per_s": speed, "compute_overhead_s": overhead,
                    "link_fixed_s": fixed_s, "link_s_per_kernel": per_kernel_s}
        for j, (share, (fixed, per)) in enumerate(zip((forward, 1 - forward), links)):
            split[2 * j].append(1.0 / (share / speed + per))
            split[2 * j + 1].append(share * overhead + fixed)
        if part is not None:
            speed = 1.0 / (1.0 / speed + part["link_s_per_kernel"])
            overhead = overhead + part["link_fixed_s"]
        speeds[g.name].append(speed)
        overheads[g.name].append(overhead)
        caps[g.name].append(min(g.K, cap))
        parts[g.name].append(part)
    if any(d.link is not None for d in devices):
        phases[g.name] = split
