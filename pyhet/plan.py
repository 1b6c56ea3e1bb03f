"""`pyhet plan`: the partition and predicted step time of a cluster, without training.

The devices are those calibrated here (a Calibration, as `pyhet devices` gives it) and devices
described by their figures (`--describe`), on this machine or behind a link. Every device
gets, per conv layer, the cost model of pyhet.partition: t(k) = overhead + k / speed, plus its
link's fixed and per-kernel time (pyhet.links). The master's non-conv work (the fc layers, the
loss, their update) is as timed on this machine where its devices are calibrated here
(Calibration.master_s), else modelled by the fc layers' FLOPs at the master's rate.

The same cluster is also modelled under data parallelism (DDP): every device a full replica on
its share of the batch in whole images (at most one replica per image), the gradients of every
weight all-reduced each step by a ring. The replicas
compute at pyhet's speed, or at `ddp_speed` times it: the framework that runs DDP has its own
(PyTorch's CPU step is about 0.8 of pyhet's on one core here, `pyhet bench step`).

Letters as in pyhet.geometry; N is the batch size.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, replace

from .calibrate import Calibration
from .errors import DeviceError, UsageError, shown
from .geometry import GPU_OUTPUTS, NetGeometry
from .links import Link, link_cost, link_phase_cost
from .partition import among_own, balanced_phases, phases_time, split_waits, with_local_split

DEFAULT_LATENCY_S = 50e-6     # a link given by its bandwidth alone: one-way latency
MEMORY_SHARE = 0.8            # of a device's memory that kernels may take (as calibrate does)

# ================================================================================================
# The description grammar: sizes, bandwidths, latencies, devices


# ASCII digits only (\d would take other scripts' digits too, which float() reads)
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?"
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTES = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_MEMORY = {"": 1, "b": 1, **{p + s: 2 ** (10 * (i + 1)) for i, p in enumerate("kmgt")
                            for s in ("", "b", "ib")}}
_SECONDS = {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _quantity(text: str, units: dict, what: str, example: str) -> float:
    m = re.fullmatch("(-?)" + _NUMBER + r"\s*([a-z]*)(?:/s)?", text.strip().lower())
    value = float(f"{m[2]}e{m[3] or 0}") if m else 0.0
    if m and m[1] and m[4] in units and value != 0:
        raise UsageError(f"{what} {shown(text)}: is negative; expected a value such as {example}")
    if not m or m[1] or m[4] not in units:
        raise UsageError(f"{what} {shown(text)}: expected a number and a unit such as {example}")
    value *= units[m[4]]
    if not math.isfinite(value):
        raise UsageError(f"{what} {shown(text)}: expected a finite number")
    return value


def _cut(text: str) -> str:
    """A value as given, cut short past 60 characters (shown's form then)."""
    return text if len(text) <= 60 else shown(text)


def _plain(text: str, what: str, whole: bool = False) -> float:
    """A number without a unit (gflops=, factor=; count= a whole one) -> float (int)."""
    # a leading + as float() takes it; a count of at most 18 digits (int() refuses 4,300)
    m = re.fullmatch(r"\+?([0-9]{1,18})" if whole else r"\+?" + _NUMBER,
                     text.strip().lower())
    if not m:
        raise UsageError(f"{what}={_cut(text)}: expected " + ("a whole number such as 4" if whole
                                                         else "a number such as 2.5 or 1e3"))
    if whole:
        return int(m[1])
    value = float(f"{m[1]}e{m[2] or 0}")
    if not math.isfinite(value):
        raise UsageError(f"{what}={_cut(text)}: expected a finite number")
    return value


# The ranges a described quantity must lie in: wider than any hardware, narrow enough that the
# model's sums stay finite numbers (a latency of 1e300 s made the partition NaN)
GFLOPS_RANGE = (1e-6, 1e9)   # a kiloFLOP/s to an exaFLOP/s
FACTOR_RANGE = (1e-6, 1e6)
BANDWIDTH_RANGE = (1 / 8, 1e15)   # bytes/s: 1 bit/s to a petabyte/s
MAX_SECONDS = 3600.0         # a latency or fixed work of at most an hour


def parse_bandwidth(text: str) -> float:
    """'10gbit' (bits/s: bit, kbit, mbit, gbit, tbit) or '1.2GB' (bytes/s) -> bytes/s (> 0)."""
    units = {**{k: v / 8 for k, v in _BITS.items()}, **_BYTES}
    unit = re.fullmatch(r".*?([A-Za-z]*)(?:/s)?", text.strip(), re.S)[1]
    if unit.endswith("b"):      # 100Mb: megabits to some, megabytes to others
        raise UsageError(f"bandwidth {shown(text)}: a lowercase b is ambiguous; write bits as "
                         f"{unit[:-1].lower()}bit or bytes as {unit[:-1].upper()}B")
    v = _quantity(text, units, "bandwidth", "10gbit or 1.2GB")
    if v <= 0:
        raise UsageError(f"bandwidth {shown(text)}: must be > 0")
    if not BANDWIDTH_RANGE[0] <= v <= BANDWIDTH_RANGE[1]:
        raise UsageError(f"bandwidth {shown(text)}: expected 1bit to 1000TB (a second)")
    return v


def parse_latency(text: str, what: str = "latency") -> float:
    """'50us', '1ms', '0.002' (seconds) -> s (0 to MAX_SECONDS)."""
    v = _quantity(text, _SECONDS, what, "50us, 1ms or 0.002")
    if not 0 <= v <= MAX_SECONDS:
        raise UsageError(f"{what} {shown(text)}: expected 0 to {MAX_SECONDS:g} s")
    return v


def parse_memory(text: str) -> float:
    """'80G', '512M' -> bytes (> 0): binary units whatever the spelling, K, KB and KiB (any
    case) all 2**10, M 2**20, G 2**30, T 2**40 (a bandwidth's GB is 10**9 bytes/s); a bare
    number or B is bytes."""
    v = _quantity(text, _MEMORY, "memory", "80G or 512M")
    if v <= 0:
        raise UsageError(f"memory {shown(text)}: must be > 0")
    return v


def parse_link(text: str) -> Link:
    """'BANDWIDTH[@LATENCY]', e.g. '10gbit@20us'; the latency defaults to 50 us."""
    bw, at, lat = text.strip().partition("@")
    if at and not lat.strip():
        raise UsageError("no latency after @ (leave out @ for 50us)")
    return Link(parse_latency(lat) if at else DEFAULT_LATENCY_S, parse_bandwidth(bw))


def _sig(seconds: float) -> float:
    """A figure to nine significant digits (nine decimals made 0.0 of the times of
    fast described devices, and their ratios of the speedup)."""
    return float(f"{seconds:.9g}")


def seconds_text(seconds: float) -> str:
    """'50us', '1.5ms', '2s'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds / 1e-9:g}ns" if seconds else "0s"


def link_names(links) -> list:
    """The names of a sweep's links (None: 'own'): by bandwidth, and with the latency where two
    share a bandwidth (their columns and rows would be one)."""
    names = ["own" if lk is None else link_name(lk) for lk in links]
    if len(set(names)) < len(names):
        names = ["own" if lk is None else f"{link_name(lk)}@{seconds_text(lk.latency_s)}"
                 for lk in links]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UsageError(f"--link: {', '.join(twice)} given twice")
    return names


def link_name(link: Link | None) -> str:
    if link is None:
        return "local"
    if link.bandwidth_bytes_per_s is None:   # as measured: too fast to time
        return "untimed bandwidth"
    bits = 8 * link.bandwidth_bytes_per_s
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


@dataclass(frozen=True)
class Described:
    """A device that is not here: its rate (GFLOP/s, or a factor of a calibrated device),
    memory (bytes), fixed compute overhead per layer and step (s), link (None: on the master's
    machine) and how many such devices there are."""
    name: str
    gflops: float | None = None
    like: str | None = None
    factor: float = 1.0
    memory: float | None = None
    overhead_s: float | None = None
    link: Link | None = None
    count: int = 1


DESCRIBE_KEYS = ("gflops", "like", "factor", "mem", "overhead", "bw", "lat", "count")


def parse_describe(text: str) -> list[Described]:
    """'NAME:key=value,...;NAME:...' (keys in DESCRIBE_KEYS) -> [Described]."""
    out = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        name, colon, body = entry.partition(":")
        name = name.strip()
        where = f"--describe {shown(entry)}"
        if not colon or not re.fullmatch(r"[A-Za-z][\w.-]*", name):
            raise UsageError(f"{where}: expected NAME:key=value,... with a NAME such as gpu-a")
        fields = {}
        for item in (i.strip() for i in body.split(",") if i.strip()):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq and key in DESCRIBE_KEYS:
                raise UsageError(f"{where}: field {shown(item)} has no value; expected "
                                 f"{key}=VALUE")
            if not eq or key not in DESCRIBE_KEYS:
                raise UsageError(f"{where}: unknown field {shown(item)}; expected key=value with "
                                 f"key one of {', '.join(DESCRIBE_KEYS)}")
            if key in fields:
                raise UsageError(f"{where}: {shown(key)} is given twice")
            fields[key] = value.strip()
        try:
            d = Described(
                name,
                gflops=_plain(fields["gflops"], "gflops") if "gflops" in fields else None,
                like=fields.get("like"),
                factor=_plain(fields.get("factor", "1"), "factor"),
                memory=parse_memory(fields["mem"]) if "mem" in fields else None,
                overhead_s=(parse_latency(fields["overhead"], "overhead")
                            if "overhead" in fields else None),
                link=(Link(parse_latency(fields.get("lat", "50us")), parse_bandwidth(fields["bw"]))
                      if "bw" in fields else None),
                count=_plain(fields.get("count", "1"), "count", whole=True))
        except (ValueError, OverflowError) as e:
            raise UsageError(f"{where}: {e}") from None
        moved = d.gflops is None and d.like is None and set(fields) <= {"bw", "lat"}
        if moved and d.link is None:
            raise UsageError(f"{where}: give its speed as gflops=G or like=DEVICE, or, for a "
                             f"calibrated device of that name, its link as bw= (and lat=)")
        if not moved and (d.gflops is None) == (d.like is None):
            raise UsageError(f"{where}: give its speed as gflops=G, or as like=DEVICE "
                             f"(a calibrated device) with an optional factor=F" +
                             (", not both" if d.gflops is not None else ""))
        if "factor" in fields and d.like is None:
            raise UsageError(f"{where}: factor= scales the speed of the device named by like=; "
                             f"with gflops=, give the rate itself")
        if "lat" in fields and d.link is None:
            raise UsageError(f"{where}: lat= needs bw= (the link's bandwidth)")
        for label, v, (low, high) in (("gflops", d.gflops, GFLOPS_RANGE),
                                      ("factor", d.factor, FACTOR_RANGE)):
            if v is not None and not (math.isfinite(v) and low <= v <= high):
                raise UsageError(f"{where}: {label} must be {low:g} to {high:g}, got {v:g}")
        if d.count < 1:
            raise UsageError(f"{where}: count must be >= 1, got {d.count}")
        out.append(d)
    if not out:
        raise UsageError(f"--describe {shown(text)}: no device described")
    return out


def _entry_name(d: Described, j: int, own_count: bool) -> str:
    """The name of the j-th device of a described entry: NAME where the entry is one device
    (count=1, not in a sweep), else NAME.j (in a sweep, j counts every device)."""
    return d.name if d.count == 1 and own_count else f"{d.name}.{j}"


def described_names(described) -> list:
    """The names of the described devices, as a plan (not a sweep) gives them."""
    return [_entry_name(d, j, True) for d in described if d.gflops is not None or
            d.like is not None for j in range(d.count)]


def check_distinct(names) -> None:
    """UsageError where two devices share a name: a plan's table and JSON name each once."""
    twice = [n for n, c in Counter(names).items() if c > 1]
    if twice:
        raise UsageError(f"--describe: two devices named {shown(twice[0])} (the devices: "
                         f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}); give "
                         f"each its own NAME")


# ================================================================================================
# A cluster: per layer and device, the cost model's figures


@dataclass(frozen=True)
class Cost:
    """One device on one layer: compute t(k) = overhead + k / speed, at most `cap` kernels, and
    its link's fixed and per-kernel seconds (0 for a device on the master's machine)."""
    speed: float
    overhead: float
    cap: int
    link_fixed: float = 0.0
    link_per_kernel: float = 0.0
    contention: float = 1.0   # its compute time among the others over alone (calibration's)
    # its typical compute time for a layer on its own over its model alone (calibration's
    # whole-layer factor, Calibration.whole_factor, for figures measured as a step runs a
    # share; 1 for a described device, and where build_cluster folds it into the figures)
    whole: float = 1.0
    forward_share: float = 1 / 3   # the forward's share of its compute (ConvGeometry's)
    link_forward: tuple = (0.0, 0.0)   # the link's fixed and per-kernel seconds of the forward

    def phases(self) -> list:
        """[(speed, overhead)] of the forward and of the backward with the update, compute and
        link together (pyhet.partition.balanced_phases)."""
        f, (fixed, per) = self.forward_share, self.link_forward
        return [(1.0 / (f / self.speed + per), f * self.overhead + fixed),
                (1.0 / ((1 - f) / self.speed + self.link_per_kernel - per),
                 (1 - f) * self.overhead + self.link_fixed - fixed)]

    @property
    def has_link(self) -> bool:
        return self.link_fixed > 0 or self.link_per_kernel > 0

    @property
    def total_speed(self) -> float:
        return 1.0 / (1.0 / self.speed + self.link_per_kernel)

    @property
    def total_overhead(self) -> float:
        return self.overhead + self.link_fixed

    def compute_s(self, k: int) -> float:
        return self.overhead + k / self.speed if k else 0.0

    def alone(self) -> "Cost":
        """The device with the machine to itself: its compute without the others' contention."""
        return replace(self, speed=self.speed * self.contention,
                       overhead=self.overhead / self.contention, contention=1.0)

    def link_s(self, k: int) -> float:
        return self.link_fixed + k * self.link_per_kernel if k else 0.0


# A layer's time in steps over its model's (Cluster.in_step) is taken within these: beyond them
# the steps or the calibration met a disturbance of the machine
IN_STEP_BOUNDS = (0.25, 4.0)


@dataclass
class Cluster:
    names: list           # device names
    links: list           # Link or None per device
    costs: dict           # layer -> [Cost per device]
    # each device's compute rate (GFLOP/s, on the network's largest layer), fixed work apart:
    # what the model runs its fc layers at (ddp, default_master_gflops)
    gflops: list
    master_s: float | None = None   # the master's own work of a step, timed here (or None)
    # per device: computes on CPU cores like this machine's (a calibrated cpu or numpy device,
    # or a copy of one); and the calibrated ones' rate together (GFLOP/s), which the timed
    # master's rate on the fc layers is set against (ddp)
    cpu_like: list | None = None
    cpu_gflops: float | None = None
    # layer -> [Cost or None per device]: a calibrated device's compute on its own in its
    # process (its whole fixed work, where in the cluster it shares it with its host group;
    # its link is the cluster's), for the best single device; None: the cluster's costs
    alone: dict | None = None
    # each device's GFLOP/s as the plan shows it (_gflops: a calibrated device's whole-layer
    # rate, a described one's as given); None: gflops
    shown_gflops: list | None = None
    # the master's own work timed in a loop of its own (Calibration.head_s): a DDP replica's
    # fc layers' rate; None: master_s
    head_s: float | None = None
    # layer -> its waits between phases beyond its devices' contention, where it is split over
    # several devices (Calibration.waits, of the calibrated devices where nothing else joins
    # them); missing: 1
    waits: dict | None = None
    # layer -> with waits, those of a split among the devices without a link, where others have
    # one (Calibration.local_waits); missing: 1
    local_waits: dict | None = None
    # layer -> per device, how much faster it computes in a split among the devices without a
    # link, where others have one (Calibration.local_speedup, the others idle; _local_factor);
    # missing: 1
    local_speedup: dict | None = None
    # layer -> the calibrated devices' time for it inside training steps over this model's
    # prediction of it (Calibration.in_step: short steps, the devices of other ranks behind
    # their measured links, nothing else joining them; within IN_STEP_BOUNDS), which a layer's
    # predicted time takes, so that the partition timed is predicted at its time in steps. It
    # was timed on the calibration's partition, which may differ from the plan's
    # (partition_of): by a kernel or two on devices of unequal speeds, or on one device where
    # the plan splits the layer (the plan's takes the same factor), or split where the plan
    # puts it on one device (that takes in_step_alone). Missing: 1
    in_step: dict | None = None
    # layer -> the same for the layer whole on one device, where the calibration's partition
    # split it (Calibration.in_step_alone): the factor of a layer on one device (each device
    # alone, a DDP replica, a plan that puts it on one device), which makes no hand-off between
    # devices (on steps of 2 ms a split's factor made a pair's best single device slower than
    # a single device's own plan). Missing: in_step's
    in_step_alone: dict | None = None
    # per device, the link it shares with others (the devices of one rank send over their
    # rank's, the layer's input once): equal keys, one link; None: each device its own
    link_groups: list | None = None
    # the master's own network interface (bytes/s), which every link's bytes cross: a layer
    # takes at least its bytes over it (layer_traffic); None: the links independent
    master_bandwidth: float | None = None
    batch: int | None = None        # the batch size the costs are of
    # per device where described devices join calibrated ones: {layer: (split, whole)}, the
    # factors of time in steps its figures carry (_carrying: a share's, the layer whole on it),
    # or None (a device described by its rate); None: none carried
    carried: list | None = None

    def in_step_factor(self, layer: str, alone: bool = False) -> float:
        """The layer's time in steps over its model's, split over several devices (in_step) or,
        `alone`, whole on one (in_step_alone, else in_step's); 1 where it was not timed."""
        if alone and layer in (self.in_step_alone or {}):
            return self.in_step_alone[layer]
        return (self.in_step or {}).get(layer, 1.0)

    def without_links(self, indices) -> "Cluster":
        """The same cluster with the links of these devices free."""
        free = set(indices)
        costs = {layer: [replace(c, link_fixed=0.0, link_per_kernel=0.0,
                                 link_forward=(0.0, 0.0)) if j in free else c
                         for j, c in enumerate(cs)] for layer, cs in self.costs.items()}
        links = [None if j in free else lk for j, lk in enumerate(self.links)]
        return replace(self, links=links, costs=costs)


def _gflops(cost: Cost, flops_per_kernel: float, K: int) -> float:
    """A calibrated device's compute rate on a layer of K kernels: the layer's FLOPs over its
    time for the whole layer, fixed work included (the same figure whether its cost model
    carries the fixed work as an overhead, beside other devices, or folds it into its speed,
    alone). Taken from its costs on its own in its process, so that devices joining its host
    group, which share its fixed work, do not change it. A described device's rate is the
    gflops= it was given."""
    return flops_per_kernel * K / (cost.overhead + K / cost.speed) / 1e9


def _flops_per_kernel(net: NetGeometry, batch: int) -> dict:
    """layer -> FLOPs of one kernel in one training step of the batch."""
    return {g.name: g.flops_per_image(need_dx=i > 0) * batch / g.K
            for i, g in enumerate(net.blocks)}


def placed(cal: Calibration, names: list, moved: set, joining: int = 0) -> Calibration:
    """The calibration of devices timed on this machine, with the devices `moved` placed behind
    links and other devices beside them, by the rule calibration uses (pyhet.calibrate): a
    device alone in its process pays its whole fixed work (its own im2col and col2im); the host
    group's devices that stay share theirs, each carrying an equal part, with `joining` more
    members (described devices on this machine like one of them); and the scales of contention
    stay as measured. A device calibrated on another rank that stays there keeps its compute
    as calibrated (its rank's group unchanged)."""
    speeds, overheads = {}, {}
    for layer, rows in cal.fits.items():
        slower = (cal.contention or {}).get(layer) or [1.0] * len(names)
        parts = (cal.parts or {}).get(layer) or [None] * len(names)
        group = [n for n, (_, _, shared) in zip(names, rows) if shared and n not in moved]
        speeds[layer], overheads[layer] = [], []
        for name, (slope, intercept, shared), c, part in zip(names, rows, slower, parts):
            if part is not None and name not in moved:
                speeds[layer].append(part["compute_kernels_per_s"])
                overheads[layer].append(part["compute_overhead_s"])
                continue
            share = len(group) + joining if shared and name not in moved else 1
            speeds[layer].append(1.0 / (slope * c))
            overheads[layer].append(intercept * c / share)
    return replace(cal, speeds=speeds, overheads=overheads, parts=None, phases=None)


def check_described(described, calibrated_names, sweep: bool = False) -> None:
    """UsageError where described devices name what the calibrated devices (their names, d0,
    d1, ...: known from the SPEC before any calibration) do not have: a link-only entry or
    like= of a device that is not calibrated, one device's link given twice; where a plan's
    device would take a calibrated or another described device's name; or a sweep with no
    entry to count, two entries of one name, or an entry with count= (a sweep takes its
    entries in turn, one device at a time, to the row's count)."""
    known = ", ".join(calibrated_names) or "none"
    moving = [d.name for d in described if d.gflops is None and d.like is None]
    twice = sorted({n for n in moving if moving.count(n) > 1})
    if twice:   # one link per device: a second would silently take the first's place
        raise UsageError(f"--describe: the link of {twice[0]} is given twice; give each "
                         f"calibrated device one bw= (and lat=)")
    for name in moving:
        if name not in calibrated_names:
            raise UsageError(f"--describe {name}: only a link (bw=, lat=) is given, so it "
                             f"must name a calibrated device (the --devices SPEC gives "
                             f"{known}); a device that is not here needs gflops= or like=")
    for d in described:
        if d.like is not None and d.like not in calibrated_names:
            raise UsageError(f"--describe {d.name}: like={d.like}: no calibrated device of that "
                             f"name (the --devices SPEC gives {known})")
    if sweep and len(moving) == len(described):
        raise UsageError("--sweep counts described devices of a speed of their own: give "
                         "--describe NAME:gflops=G (or like=DEVICE)")
    if not sweep:
        check_distinct(list(calibrated_names) + described_names(described))
        return
    named = [d.name for d in described]
    twice = [n for n, c in Counter(named).items() if c > 1]
    if twice:
        raise UsageError(f"--describe: two entries named {shown(twice[0])}; give each its own "
                         f"NAME")
    counted = [d for d in described if d.count != 1]
    if counted:
        raise UsageError(f"--sweep takes the described entries in turn, one device at a time, "
                         f"to each row's count: leave out count={counted[0].count} of "
                         f"{counted[0].name}")


def build_cluster(net: NetGeometry, batch: int, calibrated=None, described=(),
                  default_link: Link | None = None, count: int | None = None,
                  ranked=None, master_link=None) -> Cluster:
    """The cluster of the calibrated devices (names, Calibration; their compute, on the master's
    machine, or on the ranks of `ranked`) and the described ones. default_link: the link of
    described devices that give none (None: they are on the master's machine). count: take this
    many described devices, cycling through the described entries (each of count 1:
    check_described refuses count= here), as a sweep does. ranked: {name: (Link, members)}
    of calibrated devices on other ranks (pyhet.report.calibrate_ranks): each behind its
    rank's measured link, its per-kernel traffic counted `members` times (the devices of its
    rank send in one message), unless a described entry gives that device a link of its own
    (then it is placed as any calibrated device). master_link: the master's own interface,
    bytes/s, or "links" (interface_of; None: the links independent)."""
    per_kernel = _flops_per_kernel(net, batch)
    largest = max(net.blocks, key=lambda g: g.flops_per_image()).name
    largest_k = next(g.K for g in net.blocks if g.name == largest)
    names, links, gflops, cpu_like, shown = [], [], [], [], []
    on_own = []   # per device, {layer: Cost} of its compute on its own in its process, or {}
    costs = {g.name: [] for g in net.blocks}
    known = {}   # calibrated name -> {layer: Cost}
    own = {}     # calibrated name -> {layer: Cost} of a copy on another machine
    described = list(described)
    check_described(described, [] if calibrated is None else list(calibrated[0]),
                    count is not None)
    moved = {d.name for d in described if d.gflops is None and d.like is None}
    entries = [d for d in described if d.gflops is not None or d.like is not None]
    if count is not None:
        entries = [replace(entries[j % len(entries)], count=1) for j in range(count)]
    # (layer, device) whose compute figures were measured as a step runs a share (calibration's
    # parts): its typical time. So were those of the host group's devices calibrated together
    # with no device of another rank, where no described device joins them (their shares are
    # then calibration's): their contention c is their share's time in a trial of the layer as
    # training runs it over their fit's (a share can take Strassen's scheme where the fit's
    # short trials did not: c below 1, as training's prediction takes it). The others' are a
    # model of its best time alone (times its contention c), so a whole-layer factor w above 1
    # (its typical time over that best) is folded into them: a share takes m times the model's
    # best, as the layer on its own takes w (_alone_s): m = w for a single calibrated device
    # (whose c is its typical time over its best at a short trial, a noisier figure of the
    # same thing), else max(c, w) (a GPU's trial, or a share other than the one timed). So a
    # device split with copies of itself is never predicted faster than its share of the
    # whole. (A w below 1 is the whole layer's own: a GEMM that takes Strassen's scheme.)
    measured = set()
    single = calibrated is not None and len(calibrated[0]) == 1
    if calibrated is not None:
        cal_names, cal = calibrated
        for layer, ps in (cal.parts or {}).items():
            measured.update((layer, n) for n, p in zip(cal_names, ps)
                            if p is not None and n not in moved)
        if not single and not described and cal.contention:
            for layer, rows in (cal.fits or {}).items():
                if layer in cal.contention and not any((cal.parts or {}).get(layer) or []):
                    measured.update((layer, n) for n, row in zip(cal_names, rows) if row[2])

    def modelled(layer, name, speed, overhead, cap, c, w) -> Cost:
        """speed, overhead: with contention c; w: the whole-layer factor."""
        if (layer, name) in measured or w < 1:
            return Cost(speed, overhead, cap, contention=c, whole=w)
        m = w if single else max(c, w)
        return Cost(speed * c / m, overhead * m / c, cap, contention=c, whole=w * c / m)

    if calibrated is not None and calibrated[1].fits:
        # each calibrated device on its own in its process (its whole fixed work, its own
        # im2col and col2im): a copy of it on another machine, and the device alone (the best
        # single device's baseline), the factor taken as modelled() takes it
        cal_names, cal = calibrated
        for layer, rows in cal.fits.items():
            slower = (cal.contention or {}).get(layer) or [1.0] * len(cal_names)
            for i, (n, (slope, intercept, _), c) in enumerate(zip(cal_names, rows, slower)):
                own.setdefault(n, {})[layer] = modelled(
                    layer, None, 1.0 / (slope * c), intercept * c, cal.caps[layer][i], c,
                    cal.whole_factor(layer, i))
    if calibrated is not None and calibrated[1].fits and described:
        # other devices beside the calibrated ones: the host group's fixed work is no longer
        # shared by every device; described devices on this machine like a member join it
        cal_names, cal = calibrated
        shared = {n for n, row in zip(cal_names, next(iter(cal.fits.values()))) if row[2]}
        joining = sum(d.count for d in entries if d.like in shared and
                      (d.link if d.link is not None else default_link) is None)
        calibrated = cal_names, placed(cal, cal_names, moved, joining)
    if calibrated is not None:
        cal_names, cal = calibrated
        for i, name in enumerate(cal_names):
            known[name] = {}
            for g in net.blocks:
                part = ((cal.parts or {}).get(g.name) or [None] * len(cal_names))[i]
                speed = part["compute_kernels_per_s"] if part else cal.speeds[g.name][i]
                overhead = part["compute_overhead_s"] if part else cal.overheads[g.name][i]
                slower = ((cal.contention or {}).get(g.name) or [1.0] * len(cal_names))[i]
                known[name][g.name] = modelled(g.name, name, speed, overhead,
                                               cal.caps[g.name][i], slower,
                                               cal.whole_factor(g.name, i))
                costs[g.name].append(known[name][g.name])
            names.append(name)
            links.append(None)
            on_own.append(own.get(name, {}))
            gflops.append(known[name][largest].speed * per_kernel[largest] / 1e9)
            shown.append(_gflops(on_own[-1].get(largest, known[name][largest]),
                                 per_kernel[largest], largest_k))
            cpu_like.append(bool(cal.cpu_like[i]) if cal.cpu_like else False)
    # calibrated devices behind links: those of other ranks behind their ranks' (their rank's
    # members sending in one message), and NAME:bw=... entries behind theirs
    behind = {name: lm for name, lm in (ranked or {}).items()
              if name not in moved and name in names}
    behind.update({d.name: (d.link, 1) for d in described
                   if d.gflops is None and d.like is None})
    for name, (lk, members) in behind.items():
        i = names.index(name)
        links[i] = lk
        for g in net.blocks:
            need_dx = g is not net.blocks[0]
            fixed, per = link_cost(lk, g, batch, need_dx)
            forward = link_phase_cost(lk, g, batch, need_dx)[0]
            costs[g.name][i] = replace(costs[g.name][i], link_fixed=fixed,
                                       link_per_kernel=per * members,
                                       link_forward=(forward[0], forward[1] * members))
    copies = []   # per described device: a copy of a calibrated one (like=)
    for d in entries:
        link = d.link if d.link is not None else default_link
        gpu_copy = (d.like is not None and calibrated is not None
                    and calibrated[1].cpu_like is not None
                    and not cpu_like[names.index(d.like)])
        for j in range(d.count):
            names.append(_entry_name(d, j if count is None else len(names), count is None))
            links.append(link)
            copies.append(d.like is not None)
            # on its own, a copy of a calibrated device does its own im2col, as that one does
            on_own.append({} if d.like not in own else {
                layer: replace(a, speed=a.speed * d.factor, overhead=a.overhead
                               if d.overhead_s is None else d.overhead_s)
                for layer, a in own[d.like].items()})
            for g in net.blocks:
                if d.like is not None:
                    # on another machine, a copy of a calibrated device does its own im2col
                    base = (own[d.like][g.name] if link is not None and d.like in own
                            else known[d.like][g.name])
                    speed, overhead, cap = base.speed * d.factor, base.overhead, base.cap
                    slower, whole = base.contention, base.whole
                else:
                    speed = d.gflops * 1e9 / per_kernel[g.name]
                    overhead, cap, slower, whole = 0.0, g.K, 1.0, 1.0
                if d.overhead_s is not None:
                    overhead = d.overhead_s
                if d.memory is not None:
                    # a copy of a GPU keeps GPU_OUTPUTS arrays of a kernel's output, as
                    # calibration counts a GPU's memory
                    cap = int(max(0, d.memory * MEMORY_SHARE - g.fixed_bytes(batch)) //
                              g.bytes_per_kernel(batch, GPU_OUTPUTS if gpu_copy else 2))
                need_dx = g is not net.blocks[0]
                fixed, per = (0.0, 0.0) if link is None else link_cost(link, g, batch, need_dx)
                forward = ((0.0, 0.0) if link is None else
                           link_phase_cost(link, g, batch, need_dx)[0])
                costs[g.name].append(Cost(speed, overhead, min(g.K, cap), fixed, per,
                                          slower, whole=whole, link_forward=forward))
            gflops.append(costs[largest][-1].speed * per_kernel[largest] / 1e9)
            # a copy of a calibrated device as that one is shown; a rate given, as given
            shown.append(d.gflops if d.like is None else
                         _gflops(on_own[-1].get(largest, costs[largest][-1]),
                                 per_kernel[largest], largest_k))
            cpu_like.append(d.like is not None and cpu_like[names.index(d.like)])
    if not names:
        raise UsageError("the cluster is empty: give --devices SPEC and/or --describe")
    check_distinct(names)
    for j, g in enumerate(net.blocks):
        costs[g.name] = [replace(c, forward_share=g.forward_share(need_dx=j > 0))
                         for c in costs[g.name]]
    master_s = cpu_gflops = None
    if calibrated is not None and calibrated[1].master_s is not None:
        master_s = calibrated[1].master_s
        mine = len(calibrated[0])   # the calibrated devices come first
        cpu_gflops = sum(gf for gf, cpu in zip(gflops[:mine], cpu_like) if cpu) or None
    alone = {g.name: [a.get(g.name) for a in on_own] for g in net.blocks}
    head_s = calibrated[1].head_s if master_s is not None else None
    # the calibrated devices' waits between phases, where no other device joins them
    waits = (calibrated[1].waits if calibrated is not None and not described else None)
    local_waits = (calibrated[1].local_waits if calibrated is not None and not described
                   else None)
    # a split among the devices without a link: each computes as with the others idle, its
    # contention c there lc (calibration's), taken as modelled() takes c
    local_speedup = {}
    if calibrated is not None and not described and not single:
        cal_names, cal = calibrated
        for g in net.blocks:
            lcs = (cal.local_contention or {}).get(g.name)
            if lcs is not None and (cal.contention or {}).get(g.name) is not None:
                local_speedup[g.name] = [
                    _local_factor(c, lc, cal.whole_factor(g.name, i),
                                  (g.name, n) in measured)
                    for i, (n, c, lc) in enumerate(zip(cal_names, cal.contention[g.name],
                                                       lcs))]
    groups = [("rank", id(ranked[n][0])) if n in (ranked or {}) and n not in moved else i
              for i, n in enumerate(names)]
    cluster = Cluster(names, links, costs, gflops, master_s, cpu_like, cpu_gflops,
                      alone if own else None, shown, head_s, waits or None,
                      link_groups=groups, batch=batch,
                      master_bandwidth=interface_of(links, master_link),
                      local_waits=local_waits or None, local_speedup=local_speedup or None)
    # each layer's time in steps (as timed on the calibrated devices, with the calibration's
    # partition, those of other ranks behind their ranks' links) over this model's of it: kept
    # unless a device of another rank is placed behind another link here, or described devices
    # join them (the calibrated devices would carry the factors in their compute's figures,
    # _carrying, where a rank's device's factor holds its messages' time too)
    timed = (calibrated[1].in_step if calibrated is not None and not (
        ranked and (described or moved & set(ranked))) else None)
    if timed:
        zeros = [0] * (len(names) - len(calibrated[0]))   # the others held none as it ran
        timed_waits = calibrated[1].waits or {}
        timed_local = calibrated[1].local_waits or {}
        # as the steps ran them: the calibrated devices placed behind links ran here
        as_ran = cluster.without_links(i for i, n in enumerate(calibrated[0]) if n in moved)

        def factors(entries: dict) -> dict:
            out = {}
            for layer, (counts, seconds) in entries.items():
                if layer in costs and len(counts) + len(zeros) == len(names):
                    model = layer_seconds(as_ran.costs[layer], list(counts) + zeros,
                                          own_costs(as_ran, layer),
                                          timed_waits.get(layer, 1.0),
                                          local_waits=timed_local.get(layer),
                                          local_speedup=local_speedup.get(layer))
                    out[layer] = min(IN_STEP_BOUNDS[1], max(IN_STEP_BOUNDS[0],
                                                            seconds / max(model, 1e-12)))
            return out
        split, whole = factors(timed), factors(calibrated[1].in_step_alone or {})
        if not described:
            cluster = replace(cluster, in_step=split or None, in_step_alone=whole or None)
        elif split:
            # described devices join: the calibrated devices and copies of them carry the
            # factors in their compute's figures (behind a link too: the layer in a step is
            # slower than the model's for the device, wherever it runs), the devices described
            # by their rate keep theirs
            cluster = _carrying(cluster, [True] * len(calibrated[0]) + copies, split, whole,
                                timed_waits)
    return cluster


def _local_factor(c: float, lc: float, w: float, as_measured: bool) -> float:
    """How much faster a device computes in a split among the devices without a link than
    in its cluster cost (Cluster.local_speedup): its contention c over lc there, where its
    figures carry c as measured; else as build_cluster's modelled() folds c with its
    whole-layer factor w (max(c, w) over max(lc, w): a share no faster than its typical time
    alone)."""
    if as_measured or w < 1:
        return c / lc
    return max(c, w) / max(lc, w)


def _carrying(cluster: Cluster, here: list, split: dict, whole: dict, waits: dict) -> Cluster:
    """The cluster with the layers' factors of time in steps carried by the devices `here` (per
    device: a calibrated device or a copy of one) in their compute's figures (a link's apart),
    a factor f making each compute t(k) f times longer: a share's cost by the layer's waits
    times its factor split (Cluster.in_step, `split`), its cost on its own (Cluster.alone) by
    its factor whole (in_step_alone, `whole`; else split's). The layers' own factors are left
    at 1, so that the other devices (described by their rate) keep their figures."""
    def slower(c: Cost, f: float) -> Cost:
        return replace(c, speed=c.speed / f, overhead=c.overhead * f)
    costs, alone, carried = dict(cluster.costs), dict(cluster.alone or {}), {}
    for layer, f in split.items():
        carried[layer] = (f * waits.get(layer, 1.0), whole.get(layer, f))
        own = own_costs(cluster, layer)
        costs[layer] = [slower(c, carried[layer][0]) if h else c
                        for c, h in zip(costs[layer], here)]
        before = alone.get(layer) or [None] * len(own)
        alone[layer] = [slower(o, carried[layer][1]) if h else a
                        for o, a, h in zip(own, before, here)]
    return replace(cluster, costs=costs, alone=alone,
                   carried=[carried if h else None for h in here])


# ================================================================================================
# Predictions


def fc_flops(net: NetGeometry, batch: int) -> float:
    """The FLOPs of the fc layers, forward and backward, in a step of the batch."""
    conv = {g.name for g in net.blocks}
    return batch * sum(f for name, f in net.flops_per_image().items() if name not in conv)


def master_seconds(net: NetGeometry, batch: int, gflops: float) -> float:
    """The master's non-conv work per step (fc layers forward and backward) at `gflops`."""
    return fc_flops(net, batch) / (gflops * 1e9)


def default_master_gflops(cluster: Cluster) -> float:
    """The master's rate: that of the devices on its machine (without a link) together, or
    the first device's where every device is behind a link."""
    local = [g for g, lk in zip(cluster.gflops, cluster.links) if lk is None]
    return sum(local) if local else cluster.gflops[0]


def layer_phases(costs: list) -> list:
    """[(speeds, overheads)] of a layer's phases: the forward and the backward where a device
    has a link (it moves the layer's input in one, the input gradient in the other), else the
    step as one."""
    if not any(c.has_link for c in costs):
        return [([c.total_speed for c in costs], [c.total_overhead for c in costs])]
    per_device = [c.phases() for c in costs]
    return [([ph[p][0] for ph in per_device], [ph[p][1] for ph in per_device]) for p in (0, 1)]


def _alone_compute_s(c: Cost, K: int) -> float:
    """A device's compute for all K kernels of a layer, on its own (no contention; its typical
    time, by its whole-layer factor)."""
    a = c.alone()
    return (a.overhead + K / a.speed) * c.whole


def _alone_s(c: Cost, K: int) -> float:
    """The same with its link's time."""
    return _alone_compute_s(c, K) + c.link_s(K)


def own_costs(cluster: Cluster, layer: str) -> list:
    """Each device's Cost of a layer where it holds every kernel: in its process on its own
    (cluster.alone: its whole fixed work, which its host group shares where they all have
    kernels), its link the cluster's; else its cluster cost."""
    own = (cluster.alone or {}).get(layer) or [None] * len(cluster.names)
    return [c if a is None else replace(c, speed=a.speed, overhead=a.overhead,
                                        contention=a.contention, whole=a.whole)
            for c, a in zip(cluster.costs[layer], own)]


def layer_seconds(costs: list, counts, own: list | None = None, waits: float = 1.0,
                  in_step: float = 1.0, local_waits: float | None = None,
                  local_speedup=None) -> float:
    """The predicted seconds of a layer with these kernels per device: the sum over its
    phases of the slowest device's time, or, where one device has every kernel, its typical
    time on its own (_alone_s: its model alone times its whole-layer factor; own: its cost
    then, own_costs, default its cost among the others). A layer split over several devices
    takes its `waits` between phases beyond their contention (Cluster.waits; where a device
    has a link, a split that gives one of those kernels, and a split among the others its
    `local_waits`, Cluster.local_waits: split_waits, and its devices compute `local_speedup`
    times faster, Cluster.local_speedup); either takes the layer's `in_step` factor
    (Cluster.in_step)."""
    busy = [i for i, k in enumerate(counts) if k]
    if len(busy) == 1:
        return _alone_s((own or costs)[busy[0]], counts[busy[0]]) * in_step
    linked = [c.has_link for c in costs]
    costs = split_costs(costs, counts, local_speedup)
    return phases_time(counts, layer_phases(costs)) * split_waits(
        waits, counts, linked, local_waits) * in_step


def split_costs(costs: list, counts, local_speedup=None) -> list:
    """The costs of a layer's devices in this split: each device's compute `local_speedup`
    times faster (its contention that much lower) where the split is among the devices
    without a link beside devices with one (Cluster.local_speedup; None: as they are)."""
    if local_speedup is None or not among_own(counts, [c.has_link for c in costs]):
        return costs
    return [replace(c, speed=c.speed * f, overhead=c.overhead / f, contention=c.contention / f)
            for c, f in zip(costs, local_speedup)]


def _model_s(cluster: Cluster, g, counts, own: list | None = None) -> float:
    """The layer's time on its devices with these kernels per device (layer_seconds, with its
    waits and its factor of time in steps), its bytes through the master's interface apart;
    own: own_costs(cluster, g.name), where the caller has it."""
    return layer_seconds(cluster.costs[g.name], counts,
                         own if own is not None else own_costs(cluster, g.name),
                         (cluster.waits or {}).get(g.name, 1.0),
                         cluster.in_step_factor(g.name, _whole(counts)),
                         (cluster.local_waits or {}).get(g.name),
                         (cluster.local_speedup or {}).get(g.name))


def partition_of(cluster: Cluster, net: NetGeometry, batch: int | None = None) -> dict:
    """layer -> kernels per device (pyhet.partition.balanced_phases on the cost model), or
    the whole layer on one device where it is predicted faster on its own (as
    pyhet.calibrate.Calibration.partition decides). Where the master's interface is given
    (Cluster.master_bandwidth), also the split over fewer of the linked devices, where their
    bytes through it would lengthen the layer more than their compute shortens it."""
    out = {}
    for j, g in enumerate(net.blocks):
        cs = cluster.costs[g.name]
        held = sum(c.cap for c in cs if c.speed > 0)
        if held < g.K and batch is not None:
            raise DeviceError(
                f"{g.name}: the devices' memory holds {held} of its {g.K} kernels at batch "
                f"{batch} (a kernel takes {g.bytes_per_kernel(batch) / 2**20:.3g} MiB, beyond "
                f"the layer's {g.fixed_bytes(batch) / 2**20:.3g} MiB, of "
                f"{MEMORY_SHARE:.0%} of a device's memory): give the devices more memory "
                f"(a described one's mem=), or plan a smaller --batch-size")
        caps = [c.cap for c in cs]
        try:
            counts = balanced_phases(g.K, layer_phases(cs), caps)
        except ValueError as e:
            raise DeviceError(f"{g.name}: {e}") from None
        own = own_costs(cluster, g.name)

        def seconds(kk):   # as conv_seconds predicts the layer
            return max(_model_s(cluster, g, kk, own), interface_s(cluster, net, j, kk))
        if cluster.master_bandwidth:
            counts = _fewer_links(cluster, g, cs, caps, counts, seconds)
        counts = with_local_split(counts, g.K, layer_phases(cs), caps,
                                  [c.has_link for c in cs], seconds,
                                  speedup=(cluster.local_speedup or {}).get(g.name))
        fits = [i for i, c in enumerate(cs) if c.cap >= g.K]
        if fits:
            # each with the factor of time in steps that conv_seconds gives it (the split's
            # and the whole layer's differ: compared without them, a split predicted slower
            # than the best device alone was chosen); and its bytes through the master's
            # interface, where one is given
            i = min(fits, key=lambda m: max(
                _alone_s(own[m], g.K) * cluster.in_step_factor(g.name, alone=True),
                _whole_interface_s(cluster, g, j, m)))
            whole = [g.K if m == i else 0 for m in range(len(cs))]
            if seconds(whole) <= seconds(counts):
                counts = whole
        out[g.name] = counts
    return out


FEWER_LINKS_ALL = 32   # up to this many linked devices holding kernels, every count is weighed


def _fewer_links(cluster: Cluster, g, cs: list, caps: list, counts: list, seconds) -> list:
    """The split of least `seconds` among `counts` and the splits over fewer of the linked
    devices (each one's input and input gradient cross the master's interface, which the
    devices on its machine do not need): those holding the most in `counts` kept, every other
    linked device left out. Every count from none up is weighed where at most FEWER_LINKS_ALL
    linked devices hold kernels; else half as many each time, then counts spread around the
    best of those (a few dozen re-plans, not one per device)."""
    linked = sorted((i for i, k in enumerate(counts) if k and cluster.links[i] is not None),
                    key=lambda i: -counts[i])
    out = [i for i, lk in enumerate(cluster.links) if lk is not None]
    tried = {len(linked): (seconds(counts), counts)}

    def trial(m: int):
        if m not in tried:
            cut = list(caps)
            for i in out:
                cut[i] = 0
            for i in linked[:m]:
                cut[i] = caps[i]
            split = None
            if sum(c for c, cost in zip(cut, cs) if cost.speed > 0) >= g.K:
                try:
                    split = balanced_phases(g.K, layer_phases(cs), cut)
                except ValueError:
                    split = None
            tried[m] = (math.inf, None) if split is None else (seconds(split), split)
        return tried[m][0]

    n = len(linked)
    if n <= FEWER_LINKS_ALL:
        for m in range(n):
            trial(m)
    else:
        m = n
        while m > 0:
            m //= 2
            trial(m)
        best = min(tried, key=lambda k: tried[k][0])
        lo, hi = max(0, best // 2), min(n, best * 2 + 1)
        for t in range(FEWER_LINKS_ALL):
            trial(lo + (hi - lo) * t // (FEWER_LINKS_ALL - 1))
    best = min(tried, key=lambda k: (tried[k][0], -k))
    return tried[best][1]


def conv_seconds(cluster: Cluster, net: NetGeometry, partition: dict) -> dict:
    """layer -> predicted seconds of the layer (layer_seconds; at least its bytes through the
    master's interface, where one is given: interface_s)."""
    return {g.name: max(_model_s(cluster, g, partition[g.name]),
                        interface_s(cluster, net, j, partition[g.name]))
            for j, g in enumerate(net.blocks)}


def layer_traffic(cluster: Cluster, net: NetGeometry, j: int, batch: int, counts) -> int:
    """Bytes through the master's network interface for layer j with these kernels per device:
    each link that carries kernels moves the layer's input (and its gradient, past the first
    layer) once and its kernels' output slices and their gradients (ConvGeometry.link_bytes);
    the devices of one rank share their rank's link (Cluster.link_groups)."""
    g = net.blocks[j]
    fixed, per = g.link_bytes(batch, need_dx=j > 0)
    groups = cluster.link_groups or list(range(len(cluster.names)))
    used = {}
    for key, lk, k in zip(groups, cluster.links, counts):
        if lk is not None and k:
            used[key] = used.get(key, 0) + k
    return int(len(used) * fixed + sum(used.values()) * per)


def master_traffic(cluster: Cluster, net: NetGeometry, batch: int, partition: dict) -> int:
    """Bytes through the master's network interface in a step of this partition
    (layer_traffic): what its own interface carries, however fast the links are."""
    return sum(layer_traffic(cluster, net, j, batch, partition[g.name])
               for j, g in enumerate(net.blocks))


def _whole_interface_s(cluster: Cluster, g, j: int, i: int) -> float:
    """interface_s of layer g (the j-th) whole on device i, without a list of every device's
    kernels (a plan asks it of each of up to 65,536 devices)."""
    if not cluster.master_bandwidth or cluster.batch is None or cluster.links[i] is None:
        return 0.0
    fixed, per = g.link_bytes(cluster.batch, need_dx=j > 0)
    return (fixed + g.K * per) / cluster.master_bandwidth


def interface_s(cluster: Cluster, net: NetGeometry, j: int, counts) -> float:
    """The least time layer j's bytes take through the master's interface, its transfers one
    after another there (0 where it is not given: the links independent)."""
    if not cluster.master_bandwidth or cluster.batch is None:
        return 0.0
    return layer_traffic(cluster, net, j, cluster.batch, counts) / cluster.master_bandwidth


def _whole(counts) -> bool:
    """Whether these kernels per device put a layer on one device."""
    return sum(1 for k in counts if k) == 1


def _step(cluster: Cluster, net: NetGeometry, master_s: float) -> float:
    return sum(conv_seconds(cluster, net, partition_of(cluster, net)).values()) + master_s


def alone_seconds(cluster: Cluster, net: NetGeometry, i: int, master_s: float,
                  own: dict | None = None):
    """Step time of device i alone with the master (its link included); None when its memory
    cannot hold a whole layer. Alone, it has its machine to itself: no contention; each layer
    takes its factor of time in steps on one device (Cluster.in_step_alone). own: layer ->
    own_costs(cluster, layer), where the caller has them (a list of every device's: made
    once, not once per device)."""
    total = master_s
    for j, g in enumerate(net.blocks):
        # on its own in its process: its whole fixed work
        c = (own[g.name] if own is not None else own_costs(cluster, g.name))[i]
        if c.cap < g.K:
            return None
        total += max(_alone_s(c, g.K) * cluster.in_step_factor(g.name, alone=True),
                     _whole_interface_s(cluster, g, j, i))
    return total


def ddp(cluster: Cluster, net: NetGeometry, batch: int, speed: float = 1.0,
        fc_rate: float = 1.0) -> dict:
    """Data parallelism as PyTorch DDP: r = min(n, batch) devices each a full replica (conv
    layers at its calibrated or described rate, fc layers at its GFLOP/s, times `fc_rate` on a
    device that computes like this machine's CPU cores (cluster.cpu_like), all of it at `speed`
    times that: the DDP framework's speed relative to pyhet's), then a ring all-reduce of every
    weight's gradient: each replica sends and receives 2 (r - 1) / r of the weight bytes over
    the slowest of the replicas' links, in 2 (r - 1) messages.

    A replica takes whole images: each computes ceil(batch / r) of them (DistributedSampler
    pads a batch that does not divide, so the slowest replica computes that many), and beyond
    `batch` devices there is no image left for another replica: the r devices fastest at their
    share and their link's part of the all-reduce are the replicas, the others take no part (in
    the all-reduce neither). A replica's conv layers take their factors of time in steps on
    one device (Cluster.in_step_alone), as each device alone: a single replica's are the best
    single device's.
    Communication does not overlap the backward; devices on the master's machine exchange
    through memory (free); memory is not checked."""
    n = len(cluster.names)
    replicas = min(n, batch)
    images = -(-batch // replicas)
    parts = batch / images     # the batch over one replica's images: n where it divides
    fc = fc_flops(net, batch)
    compute = []
    own = {g.name: own_costs(cluster, g.name) for g in net.blocks}
    for i in range(n):
        t = 0.0
        for g in net.blocks:
            # a replica is a process of its own: each whole layer on its own (its whole fixed
            # work), and where it is the only one, as layer_seconds counts it
            c = own[g.name][i]
            t += (_alone_compute_s(c, g.K) if replicas == 1 else
                  c.overhead + g.K / (c.speed * parts)) * cluster.in_step_factor(g.name, True)
        rate = fc_rate if cluster.cpu_like and cluster.cpu_like[i] else 1.0
        compute.append((t + fc / parts / (cluster.gflops[i] * rate * 1e9)) / speed)
    weight_bytes = 4 * sum(math.prod(s) for s in net.param_shapes().values())

    def cost(i) -> float:   # its compute and its own link's part of the all-reduce
        lk = cluster.links[i]
        return compute[i] + (0.0 if lk is None or replicas == 1 else
                             lk.seconds(2 * (replicas - 1) / replicas * weight_bytes) +
                             2 * (replicas - 1) * lk.latency_s)
    # the devices fastest at their part are the replicas (the first of equals)
    used = sorted(sorted(range(n), key=cost)[:replicas])
    slowest = max(used, key=lambda i: compute[i])
    remote = [cluster.links[i] for i in used if cluster.links[i] is not None]
    allreduce = 0.0
    if replicas > 1 and remote:
        # the slowest link; one too fast to time (bandwidth None) moves its bytes for free
        slow = max(remote, key=lambda lk: lk.seconds(weight_bytes))
        allreduce = (slow.seconds(2 * (replicas - 1) / replicas * weight_bytes) +
                     2 * (replicas - 1) * max(lk.latency_s for lk in remote))
    taking = set(used)
    return {"step_s": compute[slowest] + allreduce, "compute_s": compute[slowest],
            "replica_compute_s": [t if i in taking else None for i, t in enumerate(compute)],
            "replicas": replicas, "replica_images": images,
            "allreduce_s": allreduce, "weight_bytes": weight_bytes,
            "slowest_device": cluster.names[slowest]}


LINK_GAIN = 0.05   # links are the bottleneck when freeing them would save at least this share
MAX_REPLANNED = 4  # classes of devices alike re-planned each with its links free, at most


def link_classes(cluster: Cluster, net: NetGeometry) -> list:
    """The devices behind links in classes of devices alike (the same figures on every layer,
    behind the same link): [[device index, ...]], each in the order of the devices, the classes
    in that of their first devices."""
    classes = {}
    for i, lk in enumerate(cluster.links):
        if lk is not None:
            key = (lk, tuple(cluster.costs[g.name][i] for g in net.blocks))
            classes.setdefault(key, []).append(i)
    return list(classes.values())


def interface_bound(cluster: Cluster, net: NetGeometry, partition: dict) -> list:
    """The layers whose bytes through the master's interface take at least their devices'
    time (interface_s against layer_seconds): there the interface sets the layer's time."""
    out = []
    for j, g in enumerate(net.blocks):
        counts = partition[g.name]
        iface = interface_s(cluster, net, j, counts)
        if iface and iface >= _model_s(cluster, g, counts):
            out.append(g.name)
    return out


def bottleneck(cluster: Cluster, net: NetGeometry, partition: dict, conv_s: float,
               master_s: float) -> str:
    """'master' when the non-conv part is at least the conv part; 'master interface' where the
    master's interface sets a layer's time (interface_bound). Else 'link D' where, of the
    classes of devices alike behind links (link_classes), those whose links dominate (take
    more of their time than their compute, or keep one of them out of a layer) would, with
    every such link free, shorten the step by LINK_GAIN or more: D is the first device of
    the class whose links, freed alone, would shorten it most (of the MAX_REPLANNED classes
    paying the most link time, counting the fixed part of a device left out of a layer: what
    keeps it out). Else 'compute'.

    Links are weighed by class, not one by one: freeing one of many links alike saves next to
    nothing while the others still pay theirs, and re-planning per device took n re-plans of
    n devices (hours for 65,536). Here a plan takes at most MAX_REPLANNED + 1 re-plans."""
    if master_s >= conv_s:
        return "master"
    if interface_bound(cluster, net, partition):
        return "master interface"
    step = conv_s + master_s
    dominant = []   # (link seconds paid, class)
    for members in link_classes(cluster, net):
        link = compute = paid = 0.0
        out = False
        for g in net.blocks:
            for i in members:
                c, k = cluster.costs[g.name][i], partition[g.name][i]
                link += c.link_s(k)
                compute += c.compute_s(k)
                paid += c.link_fixed + k * c.link_per_kernel
                out = out or k == 0
        if link > compute or out:
            dominant.append((paid, members))
    if not dominant:
        return "compute"

    def saved(indices) -> float:
        return step - _step(cluster.without_links(indices), net, master_s)
    # the classes paying most (the first of equals), each freed alone; where none saves
    # enough alone, all of them together (where there are several)
    ranked = sorted(dominant, key=lambda pm: -pm[0])[:MAX_REPLANNED]
    gains = [saved(members) for _, members in ranked]
    best = max(range(len(ranked)), key=lambda j: (gains[j], -j))
    if gains[best] < LINK_GAIN * step and (len(dominant) == 1 or saved(
            [i for _, members in dominant for i in members]) < LINK_GAIN * step):
        return "compute"
    return f"link {cluster.names[ranked[best][1][0]]}"


def plan(cluster: Cluster, net: NetGeometry, batch: int, master_gflops: float | None = None,
         ddp_speed: float = 1.0) -> dict:
    """The prediction of the cluster on the network at this batch size (pyhet plan --json);
    ddp_speed: the DDP framework's compute speed relative to pyhet's (see ddp). The master's
    own work is its time as measured (cluster.master_s) unless master_gflops is given, else
    the fc layers' FLOPs at master_gflops or the master's devices' rate
    (default_master_gflops). A DDP replica that computes like this machine's CPU cores runs
    its fc layers at its rate times the measured master's rate on them over the calibrated
    CPU devices' on the conv layers (1 where the master was not timed; see ddp)."""
    timed = master_gflops is None and cluster.master_s is not None
    fc_rate = 1.0
    if timed:
        master_s = cluster.master_s
        master_gflops = fc_flops(net, batch) / max(master_s, 1e-12) / 1e9
        if cluster.cpu_gflops:   # a replica's fc layers: the master's rate in a loop of its own
            head_s = cluster.head_s if cluster.head_s is not None else master_s
            fc_rate = fc_flops(net, batch) / max(head_s, 1e-12) / 1e9 / cluster.cpu_gflops
    else:
        master_gflops = master_gflops or default_master_gflops(cluster)
        master_s = master_seconds(net, batch, master_gflops)
    partition = partition_of(cluster, net, batch)
    layer_s = conv_seconds(cluster, net, partition)
    conv_s = sum(layer_s.values())
    step = conv_s + master_s
    own = {g.name: own_costs(cluster, g.name) for g in net.blocks}
    alone = [alone_seconds(cluster, net, i, master_s, own) for i in range(len(cluster.names))]
    fits = [i for i, t in enumerate(alone) if t is not None]
    best = min(fits, key=lambda i: alone[i]) if fits else None
    base = alone[best] if best is not None else None
    layers = {}
    for g in net.blocks:
        rows = {}
        # its compute in steps, as conv_s
        factor = cluster.in_step_factor(g.name, _whole(partition[g.name]))
        costs = split_costs(cluster.costs[g.name], partition[g.name],
                            (cluster.local_speedup or {}).get(g.name))
        for i, (name, c) in enumerate(zip(cluster.names, costs)):
            k = partition[g.name][i]
            if k == g.K:     # the whole layer on its own, as layer_seconds counts it
                c = own[g.name][i]
            compute = (_alone_compute_s(c, k) if k == g.K else c.compute_s(k)) * factor
            rows[name] = {"kernels": k, "compute_s": _sig(compute),
                          "link_s": _sig(c.link_s(k)), "kernels_per_s": _sig(c.speed),
                          "overhead_s": _sig(c.overhead), "memory_cap": c.cap,
                          "contention": round(c.contention, 4),
                          "whole_layer": round(c.whole, 4)}
            carried = (cluster.carried[i] or {}).get(g.name) if cluster.carried else None
            if carried:   # the factor its figures carry (a share's, or the layer whole's)
                rows[name]["in_step"] = round(carried[k == g.K], 4)
        layers[g.name] = {"conv_s": _sig(layer_s[g.name]), "devices": rows}
        if g.name in (cluster.in_step or {}) or g.name in (cluster.in_step_alone or {}):
            layers[g.name]["in_step"] = round(factor, 4)
        if g.name in (cluster.in_step_alone or {}):
            layers[g.name]["in_step_alone"] = round(cluster.in_step_alone[g.name], 4)
    d = ddp(cluster, net, batch, ddp_speed, fc_rate)
    traffic = master_traffic(cluster, net, batch, partition)
    return {
        "network": net.arch, "batch_size": batch,
        "devices": [{"name": n, "link": link_name(lk), "gflops": _sig(gf),
                     **({} if lk is None else {"latency_s": _sig(lk.latency_s),
                                               "bandwidth_bytes_per_s": lk.bandwidth_bytes_per_s})}
                    for n, lk, gf in zip(cluster.names, cluster.links,
                                         cluster.shown_gflops or cluster.gflops)],
        "partition": {layer: dict(zip(cluster.names, counts))
                      for layer, counts in partition.items()},
        "layers": layers,
        "predicted_conv_s": _sig(conv_s), "master_s": _sig(master_s),
        "master_gflops": _sig(master_gflops), "master_timed": timed,
        "predicted_step_s": _sig(step),
        "best_single": None if best is None else {"device": cluster.names[best],
                                                  "step_s": _sig(base)},
        "speedup": None if base is None else round(base / step, 4),
        "bottleneck": bottleneck(cluster, net, partition, conv_s, master_s),
        "master_traffic": {"bytes": traffic, "gbit_per_s": _sig(traffic * 8 / step / 1e9),
                           "interface_bytes_per_s": cluster.master_bandwidth,
                           "bound_layers": interface_bound(cluster, net, partition)},
        "ddp": {"step_s": _sig(d["step_s"]), "compute_s": _sig(d["compute_s"]),
                "allreduce_s": _sig(d["allreduce_s"]), "weight_bytes": d["weight_bytes"],
                "slowest_device": d["slowest_device"], "speed": ddp_speed,
                "replicas": d["replicas"], "replica_images": d["replica_images"],
                "speedup": None if base is None else round(base / d["step_s"], 4)},
        "winner": "pyhet" if step <= d["step_s"] else "ddp",
    }


def sweep(net: NetGeometry, batch: int, counts, links, calibrated=None, described=(),
          master_gflops: float | None = None, ddp_speed: float = 1.0,
          ranked=None, master_link=None) -> list[dict]:
    """plan() of the calibrated devices plus n described devices (cycling through the
    described entries) for every n in counts and every link in links (None: the described
    devices' own links); ranked: as build_cluster's. A row whose devices cannot hold the
    network (a DeviceError) has None for its figures and the reason as `error`, unless every
    row fails: then that error, raised. master_link: the master's interface, bytes/s, or
    "links": each column's link's bandwidth (None: the links independent)."""
    rows, failed = [], None
    # "links" in the column of the described devices' own links: the fastest of all of them,
    # the same in every row (a row's own fastest would speed the interface up as devices join)
    own_rate = interface_of([d.link for d in described] +
                            [lk for lk, _ in (ranked or {}).values()], master_link)
    for lk, name in zip(links, link_names(links)):
        for n in counts:
            # the column's link is the described devices'; an entry of a calibrated device's
            # own link (no gflops=, no like=) keeps the link it gives
            cluster = build_cluster(net, batch, calibrated,
                                    [replace(d, link=lk) if lk is not None and (
                                        d.gflops is not None or d.like is not None) else d
                                     for d in described], count=n, ranked=ranked,
                                    master_link=own_rate if lk is None else master_link)
            try:
                p = plan(cluster, net, batch, master_gflops, ddp_speed)
            except DeviceError as e:
                failed = failed or e
                rows.append({"devices": n, "link": name, "predicted_step_s": None,
                             "speedup": None, "bottleneck": None, "ddp_step_s": None,
                             "ddp_speedup": None, "winner": None, "master_gbit_per_s": None,
                             "master_interface_bytes_per_s": cluster.master_bandwidth,
                             "error": str(e)})
                continue
            rows.append({"devices": n, "link": name,
                         "predicted_step_s": p["predicted_step_s"], "speedup": p["speedup"],
                         "bottleneck": p["bottleneck"], "ddp_step_s": p["ddp"]["step_s"],
                         "ddp_speedup": p["ddp"]["speedup"], "winner": p["winner"],
                         "master_gbit_per_s": p["master_traffic"]["gbit_per_s"],
                         "master_interface_bytes_per_s": cluster.master_bandwidth})
    if failed is not None and all("error" in r for r in rows):
        raise failed
    return rows


def interface_of(links, master_link) -> float | None:
    """The master's interface in bytes/s: as given, or for "links" the fastest of these
    links (None where none has a bandwidth, or none is given)."""
    if master_link != "links":
        return master_link
    return max((lk.bandwidth_bytes_per_s for lk in links
                if lk is not None and lk.bandwidth_bytes_per_s), default=None)


def calibration_of(speeds: dict, overheads: dict | None = None, caps: dict | None = None
                   ) -> Calibration:
    """A Calibration from figures (layer -> [per device]), e.g. for tests and what-ifs."""
    overheads = overheads or {k: [0.0] * len(v) for k, v in speeds.items()}
    caps = caps or {k: [10**9] * len(v) for k, v in speeds.items()}
    return Calibration(speeds, overheads, caps)
