"""Scaling of the paper's network over several devices, and dynamic balancing at work.

    pyhet bench scaling [--kernels 500,1500] [--batch-size 16] [--steps 3] [--rounds 2]
                        [--json FILE] [--plot FILE.png] [--quick]

Part 1: one SGD step of the network (3x32x32 input) on each device alone, on 1 to all CPU cores
as separate cpu:1 devices, and on heterogeneous mixes (cpu:1,cpu:1@0.5 with --balance even,
static and dynamic; gpu:0 with the CPU cores where CuPy sees a GPU). For each: the median step
time, images/s, the speedup over the fastest single device of the mix, the efficiency
(throughput over the sum of each device's solo throughput) and the conv2 partition. All
configurations are built once and timed in turn, round after round, so that drifts of this
shared machine hit them alike; a dynamic one after untimed steps until its balancer has
settled (settle_dynamic), so that its rows time the balance, not the moves on the way to it.

Part 2: dynamic balancing. cpu:1,cpu:1 trains with --balance dynamic; after a few steps device
d1 is slowed to half speed (the @S emulation, changed mid-training). The table follows the
partition and the step time step by step, and compares the settled step time with the best
static partition for the new speeds (the one proportional to 1 : 0.5, timed alone).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

try:
    from . import _util
except ImportError:  # run as a script: python bench/scaling.py
    import _util

from pyhet import ops
from pyhet.backends.cpu import CpuBackend
from pyhet import arch
from pyhet.devices import make_devices
from pyhet.model import Net, init_params
from pyhet.optim import SGDConfig
from pyhet.partition import proportional
from pyhet.specs import check_threads, cuda_device_count, parse_devices
from pyhet.cli import Parser, kernel_counts, positive
from pyhet.train import DynamicBalance, plan_partition

INPUT = (3, 32, 32)
CLASSES = 10
SGD = SGDConfig(lr=0.01, momentum=0.9, weight_decay=0.0)


def _moves(c) -> int:
    """The repartitions of a configuration's layers so far."""
    return sum(conv.moves for conv in c.net.convs)


class Config:
    """One device mix with one balance mode, built once and stepped on demand."""

    def __init__(self, spec, balance, shape, params, batch):
        self.spec, self.balance = spec, balance
        self.devices = make_devices(parse_devices(spec))
        try:   # (its devices closed where it cannot be made: calibration interrupted, say)
            t0 = time.perf_counter()
            partition, cal = plan_partition(shape, self.devices, balance, batch)
            self.calibration_s = time.perf_counter() - t0
            self.net = Net(shape, params, self.devices, partition,
                           CpuBackend(ops.default_threads()))
            self.dynamic = DynamicBalance(self.net, cal) if balance == "dynamic" and cal else None
        except BaseException:
            self.close()
            raise
        self.times = []
        self.steps = 0
        # the last step's repartitions (dynamic balancing's moves), seconds; None: no move
        self.move_s = None

    @property
    def label(self):
        return self.spec if len(self.devices) == 1 else f"{self.spec} ({self.balance})"

    def step(self, x, y, record=True, timer=None):
        """One SGD step; timer: a pyhet.timing.PartTimer that receives the time of its parts."""
        t0 = time.perf_counter()
        self.net.train_step(x, y, SGD, timer)
        dt = time.perf_counter() - t0
        self.steps += 1
        self.move_s = None
        if self.dynamic:   # its moves come after the step, outside its time: timed apart
            moves, moved = _moves(self), [c.phases.parts.get("repartition", 0.0)
                                          for c in self.net.convs]
            self.dynamic.after_step(self.steps)
            if _moves(self) != moves:
                self.move_s = sum(c.phases.parts.get("repartition", 0.0) - m
                                  for c, m in zip(self.net.convs, moved))
        if record:
            self.times.append(dt)
        return dt

    def close(self):
        """Every device closed, also where one of them fails to (the first error raised)."""
        error = None
        for d in self.devices:
            try:
                d.close()
            except BaseException as e:     # noqa: BLE001 (the others are closed first)
                error = error or e
        if error is not None:
            raise error


WARMUP = 2   # untimed steps per configuration: the two-phase update allocates in its first two
# a dynamic configuration's untimed steps before it is timed: until its balancer has not moved
# kernels in QUIET steps in a row (it moves after two steps out of balance), at most SETTLE_MAX
QUIET, SETTLE_MAX = 3, 8


def settle_dynamic(c, x, y):
    """[untimed steps, moves] of a dynamic configuration (Config) before it is timed: steps
    until its balancer has left the partition alone for QUIET steps in a row, at most
    SETTLE_MAX. A move costs a step or more of a small network's time where it copies
    kernels, and its first steps on a new partition make new arrays: three timed steps that
    hold one show the move, not the balance."""
    quiet = steps = 0
    while quiet < QUIET and steps < SETTLE_MAX:
        before = len(c.dynamic.moves)
        c.step(x, y, record=False)
        steps += 1
        quiet = quiet + 1 if len(c.dynamic.moves) == before else 0
    return [steps, len(c.dynamic.moves)]


def settled_fields(c, settle) -> dict:
    """A row's settling figures (settle: settle_dynamic's result, or None: not dynamic)."""
    if settle is None:
        return {}
    return {"settle_steps": settle[0], "moves_before_timing": settle[1],
            "moves_timed": len(c.dynamic.moves) - settle[1]}


def settled_line(r) -> str | None:
    """A dynamic row's settling in words (None for another row)."""
    if "settle_steps" not in r:
        return None

    def moves(n):
        return f"{n} move{'' if n == 1 else 's'}"

    return (f"{r['config']} dynamic: timed after {r['settle_steps']} untimed steps to settle "
            f"({moves(r['moves_before_timing'])} from the calibrated partition), "
            f"{moves(r['moves_timed'])} in its timed steps")


def parse_args(argv):
    p = Parser(prog="pyhet bench scaling", description=__doc__.split("\n")[0])
    p.add_argument("--kernels", type=kernel_counts, default=None, metavar="A,B",
                   help="the network's kernel counts (default 500,1500; 64,128 with --quick)")
    p.add_argument("--batch-size", type=positive(int), default=16,
                   help="images per step (default 16)")
    p.add_argument("--steps", type=positive(int), default=3,
                   help="timed steps per configuration per round (default 3)")
    p.add_argument("--rounds", type=positive(int), default=2,
                   help="times the configurations run, in turn (default 2)")
    p.add_argument("--dynamic-steps", type=positive(int), default=16,
                   help="steps of part 2 after the speed change (default 16)")
    p.add_argument("--cpu-devices", metavar="LIST",
                   type=lambda t: [positive(int, ops.MAX_THREADS)(v) for v in t.split(",")],
                   help="numbers of cpu:1 devices to run, each at most 1024 (default: 1 to "
                        "all cores; powers of two beyond 4 cores)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the results to FILE (.png, .pdf or .svg; needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help="a small network (64,128 kernels unless --kernels says) for a fast check")
    args = p.parse_args(argv)
    _util.given_once(p, "--cpu-devices", args.cpu_devices or [])
    if args.kernels is None:
        args.kernels = (64, 128) if args.quick else (500, 1500)
    _util.check_outputs(p, args)
    return args


def cpu_counts(cores: int):
    """1 to all cores: every count on a small machine, powers of two (and all) on a big one."""
    if cores <= 4:
        return list(range(1, cores + 1))
    return sorted({2 ** i for i in range(cores.bit_length()) if 2 ** i <= cores} | {cores})


def configurations(cores: int, gpus: int, counts):
    solo = ["cpu:1", "cpu:1@0.5"] + [f"gpu:{i}" for i in range(min(gpus, 1))]
    mixes = [(",".join(["cpu:1"] * n), "static") for n in counts if n >= 2]
    mixes += [("cpu:1,cpu:1@0.5", mode) for mode in ("even", "static", "dynamic")]
    if gpus:
        rest = max(1, cores - 1)
        mixes += [(f"gpu:0,cpu:{rest}", mode) for mode in ("static", "dynamic")]
        solo.append(f"cpu:{rest}")
    return solo, mixes


def part1(args, shape, params, x, y):
    cores, gpus = ops.default_threads(), cuda_device_count()
    counts = args.cpu_devices or cpu_counts(cores)
    solo, mixes = configurations(cores, gpus, counts)
    # the largest mix, as pyhet train checks its devices: a warning where its threads are more
    # than the cores (its row then measures them competing); the mixes are timed one at a time
    check_threads(max((parse_devices(s) for s, _ in mixes),
                      key=lambda specs: sum(d.threads for d in specs if d.kind == "cpu")))
    configs = []
    try:   # (the configurations made so far closed, also where a later one is interrupted)
        for s, m in [(s, "static") for s in solo] + mixes:
            configs.append(Config(s, m, shape, params, args.batch_size))
        settle = {}
        for c in configs:  # warm-up (the first two updates allocate the staged state; and
            for _ in range(WARMUP):   # the first dynamic measurements)
                c.step(x, y, record=False)
            settle[c.label] = settle_dynamic(c, x, y) if c.dynamic else None
        for r in range(args.rounds):
            for c in configs:
                for _ in range(args.steps):
                    c.step(x, y)
                print(f"round {r + 1}/{args.rounds} {c.label}: median "
                      f"{_util.secs(statistics.median(c.times[-args.steps:]))} s", file=sys.stderr)
        solo_ips = {c.spec: args.batch_size / statistics.median(c.times) for c in configs
                    if len(c.devices) == 1}
        rows = []
        for c in configs:
            med = statistics.median(c.times)
            ips = args.batch_size / med
            members = [str(d.spec) for d in c.devices]
            member_ips = [solo_ips.get(m) for m in members]
            known = all(v is not None for v in member_ips)
            rows.append({
                "config": c.spec, "balance": c.balance if len(c.devices) > 1 else None,
                "devices": members, "step_s": med, "min_s": min(c.times),
                "images_per_s": ips,
                "speedup": ips / max(member_ips) if known else None,
                "efficiency": ips / sum(member_ips) if known else None,
                "partition": c.net.partition(), "calibration_s": c.calibration_s,
                "moves": c.dynamic.moves if c.dynamic else [],
                **settled_fields(c, settle[c.label])})
        return rows
    finally:
        for c in configs:
            c.close()


def best_static(args, shape, params, x, y, speeds):
    """The step time of the partition proportional to the devices' true (emulated) speeds,
    fixed: the best static partition for them."""
    c = Config("cpu:1,cpu:1@0.5", "even", shape, params, args.batch_size)
    try:
        for conv in c.net.convs:
            conv.repartition(proportional(conv.K, speeds))
        c.step(x, y, record=False)
        for _ in range(max(3, args.steps)):
            c.step(x, y)
        return statistics.median(c.times), c.net.partition()
    finally:
        c.close()


def _settled(start, after, key):
    """The step after the change (1, 2, ...) at which key(step) last changed, from `start`
    (its value before the change; after[i] holds the partition after step i + 1): 0 where it
    never moved; None where it moved at the last step, which no step then ran on (not seen to
    settle)."""
    last, value = 0, start
    for i, t in enumerate(after, 1):
        if key(t) != value:
            last, value = i, key(t)
    return None if last and last == len(after) else last


def part2(args, shape, params, x, y, static_ref):
    c = Config("cpu:1,cpu:1", "dynamic", shape, params, args.batch_size)
    trace = []
    try:
        before = 4
        for i in range(before + args.dynamic_steps):
            if i == before:
                c.devices[1].speed = 0.5  # the speed change, mid-training
            dt = c.step(x, y)
            trace.append({"step": i + 1, "d1_speed": c.devices[1].speed, "step_s": dt,
                          "move_s": c.move_s,
                          "conv2": list(c.net.convs[1].counts),
                          "conv1": list(c.net.convs[0].counts)})
    finally:
        c.close()
    best_s, best_partition = best_static(args, shape, params, x, y, [1.0, 0.5])
    after = trace[before:]
    # settled: the step after which the partition no longer changes (conv2 is 99% of the work)
    conv2_key, all_key = (lambda t: t["conv2"]), (lambda t: (t["conv1"], t["conv2"]))
    conv2_at = _settled(conv2_key(trace[before - 1]), after, conv2_key)
    all_at = _settled(all_key(trace[before - 1]), after, all_key)
    # the first step from which the step time stays, in median, within 5% of the best static
    close_at = next((k for k in range(len(after))
                     if after[k]["step_s"] <= 1.05 * best_s and
                     statistics.median(t["step_s"] for t in after[k:]) <= 1.05 * best_s), None)
    # the steps that ran on conv2's final partition: none where it moved at the last step
    settled_s = None if conv2_at is None else statistics.median(
        t["step_s"] for t in after[conv2_at:])
    return {"trace": trace, "change_at_step": before + 1,
            "conv2_settled_after_steps": conv2_at,
            "partition_settled_after_steps": all_at,
            "within_5pct_of_best_static_after_steps": None if close_at is None else close_at + 1,
            "settled_step_s": settled_s,
            "best_static_step_s": best_s, "best_static_partition": best_partition,
            "calibrated_static_step_s": static_ref,
            "settled_over_best_static": None if settled_s is None else settled_s / best_s,
            "final_partition": {"conv1": after[-1]["conv1"], "conv2": after[-1]["conv2"]},
            "moves_s": [t["move_s"] for t in trace if t["move_s"] is not None]}


def moves_summary(moves_s) -> str:
    """The repartitions of part 2 in words: how many, and the time each took (after its step,
    outside the step times)."""
    if not moves_s:
        return "no repartition in these steps"
    n = len(moves_s)
    span = (f"{1e3 * moves_s[0]:.2f} ms" if n == 1 else
            f"{1e3 * min(moves_s):.2f}-{1e3 * max(moves_s):.2f} ms each")
    return (f"{n} repartition{'s' if n > 1 else ''} (a layer's kernels moved between the "
            f"devices after a step, outside its step time): {span}")


def settling_summary(dyn: dict, steps: int) -> str:
    """Part 2's findings in words, in the table's step numbers (dyn: part2's result, whose
    figures count the steps after the change; steps: those after the change)."""
    first = dyn.get("change_at_step", 1)     # the table's step of the first after the change
    last = first + steps - 1

    def at(k):   # the table's step of the k-th step after the change
        return first + k - 1

    best = (f"the best static partition for the new speeds "
            f"({'/'.join(str(v) for v in dyn['best_static_partition']['conv2'].values())} for "
            f"conv2, proportional to 1 : 0.5) {_util.secs(dyn['best_static_step_s'])} s")
    conv2, both = dyn["conv2_settled_after_steps"], dyn["partition_settled_after_steps"]
    if conv2 is None:
        return (f"after the change: conv2's partition still moved after the last step "
                f"({last}), so it has not been seen to settle (give more --dynamic-steps); "
                f"{best}")
    on_final = steps - conv2     # the steps that ran on conv2's final partition
    moved = (f"conv2's partition last moved after step {at(conv2)} ({conv2} steps after the "
             f"change), steps {at(conv2) + 1}-{last} ran on it" if conv2 else
             f"conv2's partition did not move in the {steps} steps after it")
    if both is None:
        moved += " (conv1's still moved after the last step)"
    elif both > conv2:
        moved += f" (conv1's last moved after step {at(both)})"
    close = dyn["within_5pct_of_best_static_after_steps"]
    if close is None:
        near = f"not within 5% of the best static partition's in the {steps} steps after it"
    else:
        held = steps - close + 1
        near = (f"within 5% of the best static partition's from step {at(close)} on" +
                (f" (the last {held} step{'s' if held > 1 else ''} only: more --dynamic-steps "
                 f"would show whether it holds)" if held < 3 else ""))
    return (f"after the change (before step {first}): {moved}; the step time is {near}.\n"
            f"settled step time {_util.secs(dyn['settled_step_s'])} s (the median of the "
            f"{on_final} step{'s' if on_final > 1 else ''} on conv2's final partition); {best}: "
            f"ratio {dyn['settled_over_best_static']:.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    _util.check_memory([(args.kernels, args.batch_size)],
                       max(args.cpu_devices or cpu_counts(ops.default_threads())), INPUT, CLASSES)
    info = _util.system_info()
    print(_util.describe_system(info))
    shape = arch.build(arch.shorthand(args.kernels, 5), INPUT, CLASSES)
    params = init_params(shape, 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size,) + INPUT).astype(np.float32)
    y = rng.integers(0, CLASSES, args.batch_size)

    rows = part1(args, shape, params, x, y)
    print(f"\nPart 1: one SGD step, kernels {args.kernels[0]},{args.kernels[1]}, 3x32x32, batch "
          f"{args.batch_size}; median of {args.steps * args.rounds} steps")
    table = [[r["config"], r["balance"] or "-", _util.secs(r["step_s"]), r["images_per_s"],
              "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
              "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%",
              "/".join(str(v) for v in r["partition"]["conv2"].values())] for r in rows]
    print(_util.format_table(["devices", "balance", "step s", "img/s", "speedup", "efficiency",
                              "conv2 partition"], table))

    for r in rows:
        line = settled_line(r)
        if line is not None:
            print(line)
    static = next((r for r in rows if r["config"] == "cpu:1,cpu:1@0.5" and
                   r["balance"] == "static"), None)
    even = next((r for r in rows if r["config"] == "cpu:1,cpu:1@0.5" and
                 r["balance"] == "even"), None)
    if static and even:
        print(f"cpu:1,cpu:1@0.5: calibrated (static) over even: "
              f"{static['images_per_s'] / even['images_per_s']:.2f}x the throughput")

    dyn = part2(args, shape, params, x, y, static["step_s"] if static else None)
    print(f"\nPart 2: --balance dynamic on cpu:1,cpu:1; d1 slowed to 0.5 before step "
          f"{dyn['change_at_step']}")
    print(_util.format_table(["step", "d1 speed", "step s", "move ms", "conv1 partition",
                              "conv2 partition"],
                             [[t["step"], t["d1_speed"], _util.secs(t["step_s"]),
                               "-" if t["move_s"] is None else f"{1e3 * t['move_s']:.2f}",
                               "/".join(map(str, t["conv1"])), "/".join(map(str, t["conv2"]))]
                              for t in dyn["trace"]]))
    print(settling_summary(dyn, args.dynamic_steps))
    print(moves_summary(dyn["moves_s"]))

    result = {"benchmark": "scaling", "system": info, "kernels": list(args.kernels),
              "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds,
              "dynamic_steps": args.dynamic_steps,
              "cpu_devices": args.cpu_devices or cpu_counts(ops.default_threads()),
              "configs": rows, "dynamic": dyn}
    _util.save_outputs(result, args, plot)
    return 0


def plot(result, path):
    plt = _util.pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = [r for r in result["configs"] if r["speedup"] is not None]
    labels = [r["config"] + (f"\n{r['balance']}" if r["balance"] else "") for r in rows]
    a.bar(range(len(rows)), [r["images_per_s"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        a.text(i, r["images_per_s"], f"{100 * r['efficiency']:.0f}%", ha="center",
               va="bottom", fontsize=8)
    a.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    a.set_ylabel("images/s (label: efficiency)")
    a.set_title(f"kernels {result['kernels'][0]},{result['kernels'][1]}, "
                f"batch {result['batch_size']}")
    trace = result["dynamic"]["trace"]
    b.plot([t["step"] for t in trace], [t["step_s"] for t in trace], "o-", label="dynamic")
    b.axhline(result["dynamic"]["best_static_step_s"], color="gray", ls="--",
              label="best static partition for the new speeds")
    b.axvline(result["dynamic"]["change_at_step"] - 0.5, color="red", ls=":",
              label="d1 slowed to 0.5")
    b.xaxis.get_major_locator().set_params(integer=True)
    b.set_xlabel("step")
    b.set_ylabel("step time (s)")
    b.set_title("dynamic balancing, cpu:1,cpu:1")
    b.legend(fontsize=8)
    fig.tight_layout()
    _util.save_plot(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
