"""`pyhet plan`'s predictions against measured steps, on the configurations this machine runs.

    pyhet bench plan [--configs "cpu:1;cpu:1,cpu:1;cpu:1,cpu:1@0.5"] [--batch-sizes 16,32]
                     [--kernels 500,1500 | --arch SPEC] [--steps 6] [--rounds 1] [--json FILE]

For each configuration (a --devices SPEC of this machine) and batch size, one after the other:
`pyhet plan --devices SPEC --json` (in its own process, calibrating as a user's run of it would),
then `pyhet train --devices SPEC --balance static --json` on synthetic data. A SPEC that places
devices on ranks (`0/cpu:1,1/cpu:1`) runs both under `mpiexec -n R` (R: its highest rank + 1),
ranks of this machine talking through shared memory; the plan then calibrates each rank's
devices where they are, behind the link it measures. The table gives the
plan's step time, the measured median step time and their ratio, both partitions of the last
conv layer (conv2 of the paper network), and the prediction the training run's own cost model
made (its summary's `predicted_step_time_s`; a single device is not calibrated in training).
Links are validated by `pyhet bench bandwidth`, whose table has the plan's columns for each
measured link.

With --rounds R, the whole set runs R times in turn (every configuration once a round), and each
row gives the medians over the rounds: of the plan, of the measured step, and of the plan /
measured ratio of each round (each a plan and the training run right after it). A machine whose
speed drifts then moves a row's plan and its measurement together, and one slow run is outvoted.

Where a configuration's plan names as its best single device one that is itself a configuration
of the run (`cpu:1` beside `cpu:1,cpu:1`), a second table sets the plan's time for that device
alone beside its measured step, and the plan's speedup beside the measured one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace

try:
    from . import _util
except ImportError:  # run as a script: python bench/plan.py
    import _util

from pyhet.cli import Parser, arch_spec, kernel_counts, positive
from pyhet.errors import PyhetError
from pyhet.specs import parse_devices


def parse_args(argv):
    p = Parser(prog="pyhet bench plan", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="cpu:1;cpu:1,cpu:1;cpu:1,cpu:1@0.5",
                   help="--devices SPECs, separated by ';' (default "
                        "'cpu:1;cpu:1,cpu:1;cpu:1,cpu:1@0.5')")
    p.add_argument("--batch-sizes", default="16,32", help="comma-separated (default 16,32)")
    p.add_argument("--kernels", default=None, metavar="A,B",
                   help="the network's kernel counts (default 500,1500)")
    p.add_argument("--arch", type=arch_spec, default=None, metavar="SPEC",
                   help="the network in --arch notation (instead of --kernels)")
    p.add_argument("--steps", type=_util.warmed_steps, default=6,
                   help="training steps per run, the first warming up (default 6)")
    p.add_argument("--rounds", type=positive(int), default=1,
                   help="times the whole set runs, in turn; rows give medians over them "
                        "(default 1)")
    p.add_argument("--timeout", type=positive(float, high=_util.TIMEOUT_MAX), default=900,
                   help="seconds one run may take (default 900)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = p.parse_args(argv)
    args.configs = _util.device_configs(p, args.configs)
    if any(ranks_of(c) > 1 for c in args.configs):
        why = _util.missing_mpi()
        if why:
            p.error(f"--configs places devices on MPI ranks, but {why}")
    if args.arch is not None and args.kernels is not None:   # as pyhet train refuses them
        p.error("--arch describes the whole network: give it without --kernels")
    if args.arch is None and args.kernels is None:
        args.kernels = "500,1500"
    try:
        if args.kernels is not None:
            kernel_counts(args.kernels)
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(f"argument --kernels: {e}")
    try:
        args.batch_sizes = [positive(int)(b) for b in args.batch_sizes.split(",")]
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(f"argument --batch-sizes: {e}")
    _util.check_outputs(p, args)
    return args


def plan_argv(spec: str, args, batch: int) -> list:
    return [sys.executable, "-m", "pyhet", "plan", "--devices", spec, "--dataset", "synthetic",
            *_util.network_argv(args.kernels, args.arch), "--batch-size", str(batch), "--json"]


def ranks_of(spec: str) -> int:
    """The MPI ranks a SPEC places devices on: its highest R/ + 1 (1: none, one process)."""
    from pyhet.specs import parse_devices

    return 1 + max((s.rank or 0) for s in parse_devices(spec))


def launched(spec: str, argv: list) -> list:
    """argv, under mpiexec where the SPEC places devices on several ranks."""
    ranks = ranks_of(spec)
    return argv if ranks == 1 else [_util.mpiexec(), "-n", str(ranks), *argv]


def ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


median = _util.median_or_none


def measure(spec: str, batch: int, args, cwd) -> dict:
    """One round of one configuration: its plan, then its training run."""
    p = _util.run_json(launched(spec, plan_argv(spec, args, batch)), args.timeout, cwd)
    s = _util.run_json(launched(spec, _util.train_argv(args.kernels, batch, args.steps, spec,
                                                       arch=args.arch)), args.timeout, cwd)
    layer = list(p["partition"])[-1]   # the last conv layer (conv2 of the paper network)
    return {"plan_step_s": p["predicted_step_s"], "layer": layer,
            # the plan's conv layers and master, and the training run's conv layers (forward
            # and backward; the rest of its step is the update and the master's work)
            "plan_conv_s": p["predicted_conv_s"], "plan_master_s": p["master_s"],
            "plan_master_timed": p["master_timed"],
            "plan_gflops": {d["name"]: d["gflops"] for d in p["devices"]},
            "conv_s": s["conv_time_s"],
            "step_parts_s": s.get("step_parts_s"),   # the run's step, part by part
            "plan_partition": p["partition"][layer],
            "step_s": s["step_time_s"]["median"],
            "partition": s["partition"][layer],
            "train_model_step_s": s.get("predicted_step_time_s"),
            # the plan's best single device (its --devices entry, where known) and its step
            "plan_single": single_entry(spec, p),
            "plan_single_s": (p.get("best_single") or {}).get("step_s"),
            "contention": {d: v["contention"] for d, v in
                           p["layers"][layer]["devices"].items()},
            # both whole (a few kB): where a plan misses, its layers, devices and calibration
            # beside the run's phases, devices and partition, for study after the run
            "plan": p, "run": s}


def single_entry(spec: str, plan: dict):
    """The --devices entry (without its rank) of the plan's best single device, or None where
    the plan names none or its devices do not match the SPEC's entries one for one."""
    best = (plan.get("best_single") or {}).get("device")
    entries = sorted(parse_devices(spec), key=lambda e: e.rank or 0)
    names = [d["name"] for d in plan["devices"]]
    if best is None or len(entries) != len(names) or best not in names:
        return None
    return str(replace(entries[names.index(best)], rank=None))


def with_singles(rows: list) -> None:
    """Each row of several devices whose plan's best single device is itself a row of this
    run (the same entry, the same batch): that row's measured step beside the plan's single
    device (`single_measured_s`, `single_ratio`), and the measured speedup beside the plan's
    (`plan_speedup`, `measured_speedup`)."""
    steps = {(r["devices"], r["batch_size"]): r["step_s"] for r in rows}
    for r in rows:
        alone = steps.get((r["plan_single"], r["batch_size"]))
        if r["plan_single"] is None or r["plan_single"] == r["devices"] or alone is None:
            continue
        r["single_measured_s"] = alone
        r["single_ratio"] = r["plan_single_s"] / alone
        r["plan_speedup"] = r["plan_single_s"] / r["plan_step_s"]
        r["measured_speedup"] = alone / r["step_s"]


def summarise(spec: str, batch: int, runs: list) -> dict:
    """A row: the last round's partitions and contention, medians of the times and ratios."""
    row = {"devices": spec, "batch_size": batch,
           **{k: v for k, v in runs[-1].items() if k not in ("plan", "run")}}
    for key in ("plan_step_s", "step_s", "train_model_step_s", "plan_conv_s", "plan_master_s",
                "conv_s", "plan_single_s"):
        row[key] = median(r[key] for r in runs)
    row["plan_ratio"] = median(r["plan_step_s"] / r["step_s"] for r in runs)
    row["train_model_ratio"] = median(
        None if r["train_model_step_s"] is None else r["train_model_step_s"] / r["step_s"]
        for r in runs)
    row["rounds"] = runs
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    info = _util.system_info()
    print(_util.describe_system(info))
    keys = [(batch, spec) for batch in args.batch_sizes for spec in args.configs]
    runs = {key: [] for key in keys}
    try:
        with tempfile.TemporaryDirectory(prefix="pyhet-plan-") as cwd:
            for rnd in range(args.rounds):
                for batch, spec in keys:
                    r = measure(spec, batch, args, cwd)
                    runs[(batch, spec)].append(r)
                    print(f"round {rnd + 1}/{args.rounds}: {spec}, batch {batch}: plan "
                          f"{_util.secs(r['plan_step_s'])} s, measured "
                          f"{_util.secs(r['step_s'])} s", flush=True)
    except (PyhetError, KeyboardInterrupt) as e:   # a run failed, or a stop: the others are kept
        done = [summarise(spec, batch, runs[(batch, spec)]) for batch, spec in keys
                if runs[(batch, spec)]]
        _util.stop_with_partial(args, {"benchmark": "plan", "system": info,
                                       "kernels": args.kernels, "arch": args.arch,
                                       "steps": args.steps, "rounds": args.rounds,
                                       "rows": done} if done else None, e)
    rows = [summarise(spec, batch, runs[(batch, spec)]) for batch, spec in keys]
    print(f"\n{args.arch or 'kernels ' + args.kernels}, synthetic 3x32x32 data, "
          f"--balance static, "
          f"{args.steps} steps a run"
          + (f"; medians of {args.rounds} rounds (ratios: of each round's)"
             if args.rounds > 1 else ""))
    table = [[r["devices"], r["batch_size"], _util.secs(r["plan_step_s"]),
              _util.secs(r["step_s"]), f"{r['plan_ratio']:.2f}",
              "-" if r["train_model_step_s"] is None else _util.secs(r["train_model_step_s"]),
              "-" if r["train_model_ratio"] is None else f"{r['train_model_ratio']:.2f}",
              "/".join(map(str, r["plan_partition"].values())),
              "/".join(map(str, r["partition"].values()))] for r in rows]
    print(_util.format_table(["devices", "batch", "plan s", "measured s", "plan/measured",
                              "train model s", "model/measured", f"plan {rows[0]['layer']}",
                              f"trained {rows[0]['layer']}"],
                             table))
    worst = max(abs(r["plan_ratio"] - 1) for r in rows)
    print(f"largest difference of the plan from the measured step: {100 * worst:.1f}%")
    with_singles(rows)
    singles = [r for r in rows if "single_ratio" in r]
    if singles:
        print("\nthe plan's best single device against its own row's measured step, and the "
              "speedups:")
        print(_util.format_table(
            ["devices", "batch", "single", "plan single s", "measured s", "plan/measured",
             "plan speedup", "measured speedup"],
            [[r["devices"], r["batch_size"], r["plan_single"], _util.secs(r["plan_single_s"]),
              _util.secs(r["single_measured_s"]), f"{r['single_ratio']:.2f}",
              f"{r['plan_speedup']:.2f}x", f"{r['measured_speedup']:.2f}x"] for r in singles]))
    result = {"benchmark": "plan", "system": info, "kernels": args.kernels, "arch": args.arch,
              "steps": args.steps, "rounds": args.rounds, "rows": rows}
    if args.json:
        _util.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
