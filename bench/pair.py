"""Device mixes against a reference device on one network, round after round, in fresh processes.

    pyhet bench pair [--configs "cpu:2;cpu:1,cpu:1"] [--dataset bundled] [--arch SPEC]
                     [--batch-size 64] [--steps 100] [--rounds 9] [--json FILE]

Each round runs `pyhet train --devices SPEC --balance static --json` for every configuration in
turn, each in its own process, and takes its median step time (the first step warms up). The
first configuration is the reference: per round, each other configuration's throughput over the
reference's in the same round, and over all rounds the median of those ratios. On a machine
shared with other work single rounds scatter; the median of the paired ratios is the figure.
The default is the default network's question: two one-thread devices against one two-thread
device (the splitting's own cost, where the products are small).
"""

from __future__ import annotations

import statistics
import sys
import tempfile

try:
    from . import _util
except ImportError:  # run as a script: python bench/pair.py
    import _util

from pyhet.cli import Parser, arch_spec, dataset, positive
from pyhet.data import load_dataset
from pyhet.errors import PyhetError


def parse_args(argv):
    p = Parser(prog="pyhet bench pair", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="cpu:2;cpu:1,cpu:1",
                   help="--devices SPECs separated by ';', the reference first (default "
                        "'cpu:2;cpu:1,cpu:1')")
    p.add_argument("--dataset", type=dataset, default="bundled",
                   help="as pyhet train's (default bundled)")
    p.add_argument("--arch", type=arch_spec, default=None, metavar="SPEC",
                   help="the network (default: pyhet train's)")
    p.add_argument("--batch-size", type=positive(int), default=64,
                   help="images per step (default 64)")
    p.add_argument("--steps", type=_util.warmed_steps, default=100,
                   help="training steps per run, the first warming up (default 100)")
    p.add_argument("--rounds", type=positive(int), default=9,
                   help="times the configurations run, in turn (default 9)")
    p.add_argument("--timeout", type=positive(float, high=_util.TIMEOUT_MAX), default=900,
                   help="seconds one run may take (default 900)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = p.parse_args(argv)
    try:   # the file it reads, before any work (an npz: file, a named dataset's files)
        load_dataset(args.dataset)
    except PyhetError as e:
        p.error(f"argument --dataset: {e}")
    args.configs = _util.device_configs(p, args.configs)
    if len(args.configs) < 2:
        p.error(f"argument --configs: expected a reference and at least one more, got "
                f"{args.configs}")
    _util.check_outputs(p, args)
    return args


def train_argv(args, spec: str) -> list:
    argv = [sys.executable, "-m", "pyhet", "train", "--devices", spec, "--dataset", args.dataset,
            "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--balance", "static", "--quiet", "--json"]
    return argv + (["--arch", args.arch] if args.arch else [])


def main(argv=None) -> int:
    args = parse_args(argv)
    info = _util.system_info()
    print(_util.describe_system(info))
    ref = args.configs[0]
    times = {spec: [] for spec in args.configs}
    network = None
    try:
        with tempfile.TemporaryDirectory(prefix="pyhet-pair-") as cwd:
            for r in range(args.rounds):
                for spec in args.configs:
                    s = _util.run_json(train_argv(args, spec), args.timeout, cwd)
                    network = s["arch"]
                    times[spec].append(s["step_time_s"]["median"])
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{spec} {times[spec][-1] * 1e3:.2f} ms" for spec in args.configs),
                    flush=True)
    except (PyhetError, KeyboardInterrupt) as e:   # a run failed, or a stop: rounds before it kept
        whole = min(len(t) for t in times.values())
        _util.stop_with_partial(args, {"benchmark": "pair", "system": info, "network": network,
                                       "dataset": args.dataset, "batch_size": args.batch_size,
                                       "steps": args.steps, "rounds": whole,
                                       "reference": ref,
                                       "step_s": {k: v[:whole] for k, v in times.items()}}
                                if whole else None, e)
    rows = []
    for spec in args.configs[1:]:
        ratios = [a / b for a, b in zip(times[ref], times[spec])]
        rows.append({"devices": spec, "step_s": times[spec], "ratios": ratios,
                     "median_ratio": statistics.median(ratios)})
    print(f"\nnetwork {network}, {args.dataset} data, batch {args.batch_size}, --balance static, "
          f"{args.steps} steps a run, {args.rounds} rounds; throughput over {ref}'s, per round")
    table = [[ref, f"{statistics.median(times[ref]) * 1e3:.2f}", "-", "1.00"]]
    table += [[row["devices"], f"{statistics.median(row['step_s']) * 1e3:.2f}",
               " ".join(f"{v:.2f}" for v in sorted(row["ratios"])), f"{row['median_ratio']:.3f}"]
              for row in rows]
    print(_util.format_table(["devices", "median step ms", "ratios (sorted)", "median ratio"],
                             table))
    result = {"benchmark": "pair", "system": info, "network": network, "dataset": args.dataset,
              "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds,
              "reference": ref,
              "reference_step_s": times[ref], "rows": rows}
    if args.json:
        _util.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
