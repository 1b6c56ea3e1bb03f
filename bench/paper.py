"""Every analysis of the paper, measured in one run, each against its own baseline.

    pyhet bench paper [--quick] [--json FILE] [--plot DIR] [--bandwidth-json FILE]
                      [--kernels-list A,B/A,B/...] [--batch-sizes LIST] [--network A,B]
                      [--batch-size N] [--steps N]

The paper (Marques, Falcao, Alexandre 2017, "Distributed learning of CNNs on heterogeneous
CPU/GPU architectures") splits the kernels of each conv layer over devices and analyses how the
speedup depends on the devices, the network and the link. Here, on synthetic 3x32x32 data:

  1. conv share: the conv layers' share of the step time (forward and backward, as the
     training summary's conv_time_fraction) against the kernel counts and the batch size;
  2. speedup and efficiency against the number of devices (cpu:1 x 1..all cores), the batch
     size and the network size; the baseline is one cpu:1 device alone;
  3. speedup against the mix of device speeds (cpu:1,cpu:1@0.5, and 1 : 0.5 : 0.25 where the
     cores allow), with --balance even, static and dynamic side by side; the baseline is the
     fastest device of the mix alone;
  4. speedup against the bandwidth: from a `pyhet bench bandwidth --json` file, or by running
     that benchmark at two rates (root and its tools needed; not in --quick).

Every configuration of a measurement point is built once; after two warm-up steps each (and a
dynamic one's untimed steps until its balancer has left the partition alone for QUIET steps,
at most SETTLE_MAX: the row times the balance it settles on, not the moves on its way there),
they are stepped in turn (A B A B ...) so that the drifts of a shared machine hit them alike.
Speedup is the throughput over the baseline's; efficiency is the throughput over the sum of
the devices' solo throughputs. The paper's own figures are printed beside ours, labelled as the
paper's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

import numpy as np

try:
    from . import _util
    from . import scaling
except ImportError:  # run as a script: python bench/paper.py
    import _util
    import scaling

from pyhet import arch, ops
from pyhet.cli import Parser, kernel_counts, positive
from pyhet.errors import PyhetError, shown
from pyhet.model import init_params
from pyhet.timing import PartTimer

INPUT, CLASSES = scaling.INPUT, scaling.CLASSES
# a dynamic configuration is timed once settled (scaling.settle_dynamic)
QUIET, SETTLE_MAX = scaling.QUIET, scaling.SETTLE_MAX

# What the paper reports (CIFAR-10, two conv layers of 500 and 1500 kernels).
PAPER = {
    "source": "Marques, Falcao, Alexandre 2017 (CIFAR-10, conv layers of 500 and 1500 kernels)",
    "conv_time_fraction": [0.60, 0.90],
    "speedup_4_cpus": 3.28,
    "speedup_3_gpus": 2.45,
}


# ------------------------------------------------------------------------------------------------
# Options


def kernels_list(text: str):
    """'50,150/100,300' -> [(50, 150), (100, 300)]; an empty entry is refused."""
    parts = text.split("/")
    if any(not t.strip() for t in parts):
        raise argparse.ArgumentTypeError(f"expected at least one A,B, '/'-separated without "
                                         f"empty entries, got {shown(text)}")
    return [kernel_counts(t) for t in parts]


def int_list(text: str):
    """'8,16' -> [8, 16]; an empty entry is refused (8,,16 was taken as 8,16)."""
    parts = text.split(",")
    if any(not t.strip() for t in parts):
        raise argparse.ArgumentTypeError(f"expected at least one batch size, comma-separated "
                                         f"without empty entries, got {shown(text)}")
    return [positive(int)(t) for t in parts]


def parse_args(argv):
    p = Parser(prog="pyhet bench paper", description=__doc__.split("\n")[0])
    p.add_argument("--kernels-list", type=kernels_list,
                   default=[(50, 150), (100, 300), (250, 750), (500, 1500)], metavar="A,B/A,B",
                   help="the network sizes of analyses 1 and 2, '/'-separated (default "
                        "50,150/100,300/250,750/500,1500)")
    p.add_argument("--batch-sizes", type=int_list, metavar="LIST",
                   help="the batch sizes of analyses 1 and 2 (default 8 to 256; quick 8 to 64)")
    p.add_argument("--network", type=kernel_counts, metavar="A,B",
                   help="the network of the batch, device-count, speed-mix and bandwidth "
                        "analyses (default 250,750; quick 100,300)")
    p.add_argument("--batch-size", type=positive(int), default=16,
                   help="the batch of the network-size, device-count and speed-mix analyses "
                        "(default 16)")
    p.add_argument("--steps", type=_util.warmed_steps,
                   help="N: N - 1 steps of each configuration are timed, after two warm-up "
                        "steps (default 4)")
    p.add_argument("--bandwidth-json", metavar="FILE",
                   help="the JSON of a `pyhet bench bandwidth --json FILE` run for analysis 4")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument("--plot", metavar="DIR",
                   help="one PNG per analysis measured (needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help="batch sizes to 64, a smaller network (100,300), no bandwidth run")
    args = p.parse_args(argv)
    _util.given_once(p, "--kernels-list", args.kernels_list or [], kstr)
    _util.given_once(p, "--batch-sizes", args.batch_sizes or [])
    if not args.kernels_list:
        p.error("argument --kernels-list: expected at least one A,B")
    if args.batch_sizes is None:
        args.batch_sizes = [8, 16, 32, 64] if args.quick else [8, 16, 32, 64, 128, 256]
    if not args.batch_sizes:
        p.error("argument --batch-sizes: expected at least one batch size")
    if args.network is None:
        args.network = (100, 300) if args.quick else (250, 750)
    if args.steps is None:
        args.steps = 4
    _util.check_outputs(p, args, plot_folder_given=True)
    # read now: a file that cannot serve analysis 4 would otherwise end the run after the others
    args.bandwidth_data = (None if args.bandwidth_json is None else
                           read_bandwidth_json(p, args.bandwidth_json))
    return args


def bandwidth_json_problem(data):
    """Why `data` is not the JSON of a bench bandwidth run (as analysis 4 reads it), or None."""
    def number(v, low=None):
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (low is None or v > low))

    if not isinstance(data, dict):
        return f"an object was expected, got {type(data).__name__}"
    if "rates" not in data or "alone_step_s" not in data:
        return "it has no " + " and no ".join(repr(k) for k in ("rates", "alone_step_s")
                                             if k not in data)
    if not number(data["alone_step_s"], 0):
        return f"'alone_step_s' must be a time > 0, got {data['alone_step_s']!r}"
    if not isinstance(data["rates"], list) or not all(isinstance(r, dict)
                                                     for r in data["rates"]):
        return "'rates' must be a list of objects, one a rate"
    for i, r in enumerate(data["rates"]):
        partition = r.get("partition")
        if not isinstance(r.get("rate"), str):
            return f"rates[{i}]: 'rate' must be a string such as 100mbit, got {r.get('rate')!r}"
        for key in ("step_s", "measured_bits_per_s"):
            if r.get(key) is not None and not number(r[key], 0):
                return f"rates[{i}]: {key!r} must be a number > 0 or null, got {r[key]!r}"
        if partition is not None and not (isinstance(partition, dict) and isinstance(
                partition.get("conv2", {}), (dict, type(None)))):
            return f"rates[{i}]: 'partition' must map layers to their partitions"
    return None


def read_bandwidth_json(parser, path):
    """The contents of a --bandwidth-json FILE; a usage error where it cannot be read or is not
    the JSON of `pyhet bench bandwidth --json FILE`."""
    from pyhet import files

    where = f"argument --bandwidth-json {path}"
    there = files.not_regular(path)
    if there is not None:
        parser.error(f"{where}: it is {there}, not a regular file")
    try:
        with files.open_regular(path, OSError) as f:   # open() would wait on a FIFO for ever
            text = f.read()
    except OSError as e:
        parser.error(f"{where}: cannot read it: {e.strerror or e}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        parser.error(f"{where}: not JSON ({e})")
    problem = bandwidth_json_problem(data)
    if problem is not None:
        parser.error(f"{where}: expected the JSON of `pyhet bench bandwidth --json FILE`: "
                     f"{problem}")
    return data


# ------------------------------------------------------------------------------------------------
# Measuring


def measure(kernels, batch, configs, steps):
    """Step every (spec, balance) of `configs` on one network and batch, in turn; one row each:
    the median step time, images/s, the conv share and the conv2 partition."""
    shape = arch.build(arch.shorthand(kernels, 5), INPUT, CLASSES)
    params = init_params(shape, 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + INPUT).astype(np.float32)   # x (N, 3, 32, 32)
    y = rng.integers(0, CLASSES, batch)
    built, conv = [], {}
    try:
        for spec, balance in configs:
            built.append(scaling.Config(spec, balance, shape, params, batch))
        settle = {}
        for c in built:
            for _ in range(scaling.WARMUP):         # warm-up (and dynamic's first measures)
                c.step(x, y, record=False)
            settle[c.label] = scaling.settle_dynamic(c, x, y) if c.dynamic else None
            conv[c.label] = []
        for _ in range(steps - 1):
            for c in built:
                t = PartTimer()
                c.step(x, y, timer=t)
                conv[c.label].append(t.parts.get("conv_forward", 0) +
                                     t.parts.get("conv_backward", 0))
        rows = []
        for c in built:
            med = statistics.median(c.times)
            rows.append({"config": c.spec, "balance": c.balance if len(c.devices) > 1 else None,
                         "devices": [str(d.spec) for d in c.devices], "step_s": med,
                         "images_per_s": batch / med,
                         "conv_time_fraction": sum(conv[c.label]) / sum(c.times),
                         "partition": c.net.partition()["conv2"],
                         "calibration_s": c.calibration_s,
                         **scaling.settled_fields(c, settle[c.label])})
        add_speedups(rows)
        label = f"kernels {kernels[0]},{kernels[1]}, batch {batch}"
        print(f"measured {label}: " + ", ".join(f"{r['config']} {sec(r['step_s'])} s"
                                                 for r in rows), file=sys.stderr, flush=True)
        return rows
    finally:
        for c in built:
            c.close()


def add_speedups(rows):
    """Speedup over the fastest single device of each mix, and efficiency over the sum of its
    devices' solo throughputs (None where a device was not measured alone)."""
    solo = {r["config"]: r["images_per_s"] for r in rows if len(r["devices"]) == 1}
    for r in rows:
        if len(r["devices"]) == 1:  # a device alone: against the fastest device alone
            r["baseline"] = max(solo, key=solo.get)
            r["speedup"], r["efficiency"] = r["images_per_s"] / solo[r["baseline"]], 1.0
            continue
        ips = [solo.get(d) for d in r["devices"]]
        known = all(v is not None for v in ips)
        r["baseline"] = max(r["devices"], key=lambda d: solo[d]) if known else None
        r["speedup"] = r["images_per_s"] / max(ips) if known else None
        r["efficiency"] = r["images_per_s"] / sum(ips) if known else None


def cpu_group(counts):
    """cpu:1 alone and n x cpu:1 with equal shares (the devices are alike: even is what
    calibration would choose, without its cost)."""
    return [(",".join(["cpu:1"] * n), "even" if n > 1 else "static") for n in counts]


class Points:
    """The cpu:1 x n measurements at each (kernels, batch), shared by analyses 1 and 2."""

    def __init__(self, steps, counts):
        self.steps, self.counts, self.done = steps, counts, {}

    def get(self, kernels, batch, counts=None):
        counts = counts or [1, self.counts[-1]]
        key = (tuple(kernels), batch)
        have = self.done.get(key)
        if have is None or not set(counts) <= {len(r["devices"]) for r in have}:
            self.done[key] = measure(kernels, batch, cpu_group(sorted(set(counts))), self.steps)
        return self.done[key]


def by_count(rows, n):
    return next(r for r in rows if len(r["devices"]) == n)


# ------------------------------------------------------------------------------------------------
# The analyses


def conv_share(args, points):
    rows = []
    for k in args.kernels_list:
        rows.append(("kernels", k, args.batch_size, points.get(k, args.batch_size)))
    for b in args.batch_sizes:
        rows.append(("batch", args.network, b, points.get(args.network, b)))
    n = points.counts[-1]
    out = [{"sweep": sweep, "kernels": list(k), "batch_size": b,
            "cpu1": by_count(r, 1)["conv_time_fraction"],
            f"cpu1x{n}": by_count(r, n)["conv_time_fraction"] if n > 1 else None}
           for sweep, k, b, r in rows]
    return {"device": "cpu:1", "devices_split": n, "rows": out,
            "paper": {"conv_time_fraction": PAPER["conv_time_fraction"]}}


def speedup(args, points):
    n = points.counts[-1]
    dev = points.get(args.network, args.batch_size, points.counts)

    def row(sweep, k, b, r):
        return {"sweep": sweep, "kernels": list(k), "batch_size": b, "devices": len(r["devices"]),
                "step_s": r["step_s"], "images_per_s": r["images_per_s"],
                "baseline": "cpu:1", "baseline_step_s": by_count(points.get(k, b), 1)["step_s"],
                "speedup": r["speedup"], "efficiency": r["efficiency"],
                "partition": r["partition"]}

    devices = [row("devices", args.network, args.batch_size, by_count(dev, c))
               for c in points.counts]
    batch = [row("batch", args.network, b, by_count(points.get(args.network, b), n))
             for b in args.batch_sizes]
    network = [row("network", k, args.batch_size, by_count(points.get(k, args.batch_size), n))
               for k in args.kernels_list]
    return {"baseline": "cpu:1 alone, measured beside each point", "balance": "even",
            "devices": devices, "batch": batch, "network": network,
            "paper": {"speedup_4_cpus": PAPER["speedup_4_cpus"],
                      "speedup_3_gpus": PAPER["speedup_3_gpus"]}}


def speed_mix(args, cores):
    mixes = [[1.0, 0.5]]
    note = None
    if cores >= 3:
        mixes.append([1.0, 0.5, 0.25])
    else:
        note = (f"1 : 0.5 : 0.25 left out: three devices on {cores} cores would oversubscribe "
                f"them, and the slowdown would not be the emulated one")
    rows = []
    for speeds in mixes:
        specs = [("cpu:1" if s == 1.0 else f"cpu:1@{s:g}") for s in speeds]
        configs = [(s, "static") for s in specs]
        configs += [(",".join(specs), mode) for mode in ("even", "static", "dynamic")]
        for r in measure(args.network, args.batch_size, configs, args.steps):
            if len(r["devices"]) > 1:
                r["speeds"] = speeds
                r["ideal_speedup"] = sum(speeds) / max(speeds)
            rows.append(r)
    return {"kernels": list(args.network), "batch_size": args.batch_size,
            "baseline": "the fastest device of the mix alone (cpu:1)", "rows": rows,
            "note": note}


def bandwidth(args):
    """Analysis 4 from a bench bandwidth JSON file, or from a run of it, or why there is none."""
    if args.bandwidth_data is not None:
        data = args.bandwidth_data
        rates, alone = data["rates"], data["alone_step_s"]
        source = f"read from {args.bandwidth_json}"
    elif args.quick:
        return {"skipped": "--quick: no bandwidth run (pass --bandwidth-json FILE from "
                           "`pyhet bench bandwidth --json FILE`)"}
    else:
        try:
            from . import bandwidth as bw
        except ImportError:
            import bandwidth as bw
        why = bw.missing_tools()
        if why:
            return {"skipped": f"no bandwidth run: {why}"}
        with tempfile.TemporaryDirectory(prefix="pyhet-paper-") as tmp:
            path = os.path.join(tmp, "bandwidth.json")
            try:
                bw.main(["--rates", "100mbit,none", "--kernels",
                         ",".join(map(str, args.network)), "--batch-size", str(args.batch_size),
                         "--steps", str(args.steps), "--no-ddp", "--json", path])
            except PyhetError as e:      # a run of it that failed (_util.child_error)
                return {"skipped": f"the bandwidth run failed: {e}"}
            with open(path) as f:
                data = json.load(f)
        rates, alone = data["rates"], data["alone_step_s"]
        source = "pyhet bench bandwidth --rates 100mbit,none --no-ddp, run here"
    rows = [{"rate": r.get("rate"), "measured_bits_per_s": r.get("measured_bits_per_s"),
             "step_s": r.get("step_s"), "speedup": alone / r["step_s"] if r.get("step_s")
             else None, "partition": (r.get("partition") or {}).get("conv2")} for r in rates]
    return {"source": source, "kernels": data.get("kernels"), "batch_size":
            data.get("batch_size"), "baseline": "the master's device alone (cpu:1, one process)",
            "baseline_step_s": alone, "rows": rows}


# ------------------------------------------------------------------------------------------------
# Printing


def pct(v):
    return "-" if v is None else f"{100 * v:.0f}%"


def times(v):
    return "-" if v is None else f"{v:.2f}x"


def sec(v):
    return "-" if v is None else _util.secs(v)


def kstr(k):
    return f"{k[0]},{k[1]}"


def print_all(res):
    cs = res["conv_share"]
    n = cs["devices_split"]
    lo, hi = cs["paper"]["conv_time_fraction"]
    print(f"\n1. Conv layers' share of the step time (forward + backward) on cpu:1"
          f"{f' and split over {n} x cpu:1' if n > 1 else ''}; paper: {lo:.0%}-{hi:.0%}")
    print(_util.format_table(
        ["sweep", "kernels", "batch", "cpu:1", f"{n} x cpu:1", "paper"],
        [[r["sweep"], kstr(r["kernels"]), r["batch_size"], pct(r["cpu1"]),
          pct(r.get(f"cpu1x{n}")), f"{lo:.0%}-{hi:.0%}"] for r in cs["rows"]]))

    sp = res["speedup"]
    print("\n2. Speedup and efficiency of n x cpu:1 (equal shares) over one cpu:1 alone, "
          "measured beside it at each point")
    paper = sp["paper"]
    for sweep, what in (("devices", "number of devices"), ("batch", "batch size"),
                        ("network", "network size")):
        print(f"\n2{'abc'[('devices', 'batch', 'network').index(sweep)]}. against the {what}")
        print(_util.format_table(
            ["devices", "kernels", "batch", "baseline s", "step s", "img/s", "speedup",
             "efficiency", "conv2 partition"],
            [[r["devices"], kstr(r["kernels"]), r["batch_size"], sec(r["baseline_step_s"]),
              sec(r["step_s"]), r["images_per_s"], times(r["speedup"]), pct(r["efficiency"]),
              "/".join(map(str, r["partition"].values()))] for r in sp[sweep]]))
    print(f"paper (500,1500 kernels, CIFAR-10): {paper['speedup_4_cpus']:.2f}x on 4 CPUs, "
          f"{paper['speedup_3_gpus']:.2f}x on 3 GPUs")

    mix = res["speed_mix"]
    print(f"\n3. Speedup against the mix of device speeds (@S emulation), kernels "
          f"{kstr(mix['kernels'])}, batch {mix['batch_size']}; baseline: {mix['baseline']}")
    print(_util.format_table(
        ["devices", "balance", "step s", "img/s", "speedup", "ideal", "efficiency",
         "conv2 partition"],
        [[r["config"], r["balance"] or "-", sec(r["step_s"]), r["images_per_s"],
          times(r["speedup"]), times(r.get("ideal_speedup")), pct(r["efficiency"]),
          "/".join(map(str, r["partition"].values()))] for r in mix["rows"]]))
    for r in mix["rows"]:
        line = scaling.settled_line(r)
        if line is not None:
            print(line)
    if mix["note"]:
        print(mix["note"])

    bw = res["bandwidth"]
    print("\n4. Speedup against the bandwidth (2 ranks, one cpu:1 device each)")
    if "skipped" in bw:
        print(bw["skipped"])
    else:
        print(f"{bw['source']}; baseline: {bw['baseline']}, {sec(bw['baseline_step_s'])} s")
        print(_util.format_table(
            ["rate", "Mbit/s measured", "step s", "speedup", "conv2 partition"],
            [[r["rate"], "-" if not r["measured_bits_per_s"] else
              f"{r['measured_bits_per_s'] / 1e6:.0f}", sec(r["step_s"]), times(r["speedup"]),
              "/".join(map(str, (r["partition"] or {}).values())) or "-"] for r in bw["rows"]]))


# ------------------------------------------------------------------------------------------------
# Plots: one small PNG per analysis


def plot(res, folder):
    plt = _util.pyplot()
    if plt is None:
        return

    def save(fig, name):
        fig.tight_layout()
        _util.save_plot(fig, os.path.join(folder, name), dpi=80)

    cs = res["conv_share"]
    lo, hi = cs["paper"]["conv_time_fraction"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, sweep, xlabel in ((axes[0], "kernels", "kernels (conv1,conv2)"),
                              (axes[1], "batch", "batch size")):
        rows = [r for r in cs["rows"] if r["sweep"] == sweep]
        xs = [kstr(r["kernels"]) if sweep == "kernels" else str(r["batch_size"]) for r in rows]
        ax.plot(xs, [100 * r["cpu1"] for r in rows], "o-", label="cpu:1")
        key = f"cpu1x{cs['devices_split']}"
        if cs["devices_split"] > 1:
            ax.plot(xs, [100 * r[key] for r in rows], "s--",
                    label=f"{cs['devices_split']} x cpu:1")
        ax.axhspan(100 * lo, 100 * hi, color="gray", alpha=0.2, label="paper")
        ax.set_ylim(0, 100)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("conv share of step (%)")
        ax.legend(fontsize=7)
    save(fig, "paper_conv_share.png")

    sp = res["speedup"]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, sweep, xlabel in ((axes[0], "devices", "cpu:1 devices"),
                              (axes[1], "batch", "batch size"),
                              (axes[2], "network", "kernels (conv1,conv2)")):
        rows = sp[sweep]
        xs = [str(r["devices"]) if sweep == "devices" else str(r["batch_size"])
              if sweep == "batch" else kstr(r["kernels"]) for r in rows]
        ax.plot(xs, [r["speedup"] for r in rows], "o-", label="speedup")
        ax.plot(xs, [r["efficiency"] for r in rows], "s--", label="efficiency")
        if sweep == "devices":
            ax.axhline(sp["paper"]["speedup_4_cpus"], color="gray", ls=":",
                       label="paper, 4 CPUs")
        ax.set_xlabel(xlabel)
        ax.set_ylim(bottom=0)
        fixed = (f"kernels {kstr(rows[0]['kernels'])}" if sweep == "batch" else
                 f"batch {rows[0]['batch_size']}")
        ax.set_title(f"over one cpu:1, {fixed}", fontsize=8)
        ax.legend(fontsize=7)
    save(fig, "paper_speedup.png")

    mix = [r for r in res["speed_mix"]["rows"] if r["balance"]]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(range(len(mix)), [r["speedup"] for r in mix], color="tab:blue")
    for i, r in enumerate(mix):
        ax.plot([i - 0.4, i + 0.4], [r["ideal_speedup"]] * 2, "k--", lw=1)
    ax.set_xticks(range(len(mix)), [f"{':'.join(f'{s:g}' for s in r['speeds'])}\n{r['balance']}"
                                    for r in mix], fontsize=7)
    ax.set_ylabel("speedup (dashed: ideal)")
    save(fig, "paper_speed_mix.png")

    bw = res["bandwidth"]
    if "rows" in bw:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar([r["rate"] for r in bw["rows"]], [r["speedup"] or 0 for r in bw["rows"]])
        ax.axhline(1, color="gray", ls=":")
        ax.set_xlabel("link rate")
        ax.set_ylabel("speedup over one device")
        save(fig, "paper_bandwidth.png")


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    cores = ops.default_threads()
    counts = scaling.cpu_counts(cores)
    # every network at every batch size it runs, before any work (a later one that does not
    # fit lost the analyses already measured)
    _util.check_memory([(k, args.batch_size) for k in args.kernels_list]
                       + [(args.network, b) for b in args.batch_sizes + [args.batch_size]],
                       max(counts), INPUT, CLASSES)
    info = _util.system_info()
    print(_util.describe_system(info))
    points = Points(args.steps, counts)
    res = {"benchmark": "paper", "system": info, "quick": args.quick,
           "settings": {"kernels_list": [list(k) for k in args.kernels_list],
                        "batch_sizes": args.batch_sizes, "network": list(args.network),
                        "batch_size": args.batch_size, "steps": args.steps,
                        "warmup_steps": scaling.WARMUP, "dataset": "synthetic 3x32x32, 10 classes"},
           "paper": PAPER}
    res["speedup"] = speedup(args, points)          # measures the points analysis 1 reads too
    res["conv_share"] = conv_share(args, points)
    res["speed_mix"] = speed_mix(args, cores)
    res["bandwidth"] = bandwidth(args)
    print_all(res)
    if args.json:
        _util.write_json(args.json, res)
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
