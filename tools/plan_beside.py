#!/usr/bin/env python3
"""pyhet plan's prediction of calibrated devices alone and beside described ones, on one
calibration each round, so that only the described devices differ between the plans.

    python tools/plan_beside.py [--devices cpu:1,cpu:1] [--kernels 32,64] [--batch-size 16]
                                [--rounds 3] [--describe "c:gflops=0.001" ...]

Each round calibrates the devices once (as pyhet plan does, the layers timed in steps where
they are short), then plans them alone and beside each --describe in turn: the predicted step
and the best single device's, in milliseconds. A described device that takes no kernel leaves
the plan as it was.
"""

from __future__ import annotations

import argparse

from pyhet import arch, plan
from pyhet.data import input_shape_of
from pyhet.report import calibrate_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu:1,cpu:1")
    ap.add_argument("--kernels", default="32,64")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--describe", action="append", default=None,
                    help="described devices beside them (default: c:gflops=0.001)")
    args = ap.parse_args()
    a, b = (int(k) for k in args.kernels.split(","))
    shape, classes = input_shape_of("bundled")
    net = arch.build(f"{a}C5-P2-{b}C5-P2", shape, classes)
    described = args.describe or ["c:gflops=0.001"]
    print(f"{net.arch}, batch {args.batch_size}, {args.devices}: predicted step "
          f"(best single device), ms")
    for r in range(args.rounds):
        calibrated = calibrate_spec(args.devices, net, args.batch_size)
        cells = []
        for text in [None] + described:
            cluster = plan.build_cluster(net, args.batch_size, calibrated,
                                         plan.parse_describe(text) if text else ())
            p = plan.plan(cluster, net, args.batch_size)
            best = p["best_single"]
            cells.append(f"{'alone' if text is None else 'beside ' + text} "
                         f"{p['predicted_step_s'] * 1e3:.3f}" +
                         (f" ({best['step_s'] * 1e3:.3f})" if best else ""))
        print(f"round {r + 1}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
