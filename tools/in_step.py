#!/usr/bin/env python3
"""Each conv layer as calibration predicts it, as pyhet plan times it in steps, and in the
training steps that follow, in one process.

    python tools/in_step.py [--devices cpu:1,cpu:1] [--kernels 32,64 | --arch SPEC]
                            [--batch-size 4] [--steps 400] [--rounds 6]

Each round: calibrate the devices on random 3x32x32 data of the batch size (as pyhet plan and
pyhet train do), take the calibration's partition, time the layers inside training steps with
it as pyhet plan does (pyhet.model.time_in_step: steps for up to a second), then run --steps
training steps with that partition on fresh random batches, each conv layer's calls (its
forward, backward and update) timed. One line per round and layer: the partition, the
calibration's prediction (Calibration.predicted), the plan's in-step figure, and the median of
the steps that follow, in milliseconds; then the whole step (the plan's in-step master plus its
layers, against the steps' median). Shows how far a layer's trials alone are from the layer in
a step, and how far the plan's short run of steps is from a longer one a moment after.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pyhet import arch
from pyhet.calibrate import calibrate
from pyhet.devices import make_devices
from pyhet.model import Net, _Timed, time_in_step
from pyhet.optim import SGDConfig
from pyhet.specs import check_threads, parse_devices
from pyhet.timing import PartTimer
from pyhet.train import host_backend


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--devices", default="cpu:1,cpu:1")
    p.add_argument("--kernels", default=None, metavar="A,B", help="default 32,64")
    p.add_argument("--arch", default=None, help="the network in --arch notation")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=400, help="training steps after each plan")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    if args.arch is not None and args.kernels is not None:
        p.error("give --arch or --kernels, not both")
    if min(args.batch_size, args.steps, args.rounds) < 1:
        p.error("--batch-size, --steps and --rounds take numbers >= 1")
    spec = args.arch or arch.shorthand(tuple(int(k) for k in (args.kernels or "32,64").split(",")),
                                       arch.DEFAULT_KERNEL_SIZE)
    net = arch.build(spec, (3, 32, 32), 10)
    specs = parse_devices(args.devices)
    check_threads(specs)
    devices = make_devices(specs)
    rng = np.random.default_rng(0)
    params = {k: (rng.standard_normal(s) * 0.05).astype(np.float32)
              for k, s in net.param_shapes().items()}
    batches = 16
    xs = rng.standard_normal((batches, args.batch_size, 3, 32, 32)).astype(np.float32)
    ys = rng.integers(0, 10, (batches, args.batch_size))
    print(f"{net.arch} on {args.devices}, batch {args.batch_size}; ms: calibration's "
          f"prediction, pyhet plan's time in steps, median of the {args.steps} steps after")
    try:
        host = host_backend(devices)
        for r in range(args.rounds):
            cal = calibrate(devices, net.blocks, args.batch_size, seed=r)
            part = {g.name: cal.partition(g.name, g.K) for g in net.blocks}
            master, planned = time_in_step(net, args.batch_size, devices, part, host, 0.0)
            model = Net(net, params, devices, part, host)
            timers = [PartTimer() for _ in net.blocks]
            model.convs = [_Timed(c, ("forward", "backward", "step", "commit"), t, "conv")
                           for c, t in zip(model.convs, timers)]
            rows = []
            for s in range(args.steps + 2):
                for t in timers:
                    t.parts.clear()
                t0 = time.perf_counter()
                model.train_step(xs[s % batches], ys[s % batches], SGDConfig())
                wall = time.perf_counter() - t0
                if s >= 2:
                    rows.append([wall] + [t.parts.get("conv", 0.0) for t in timers])
            for g in net.blocks:
                for d in devices:
                    d.call("in_step", d.drop_shard, g.name)
            after = np.median(np.array(rows), axis=0) * 1e3
            for j, g in enumerate(net.blocks):
                print(f"round {r + 1} {g.name} {'/'.join(map(str, part[g.name]))}: "
                      f"predicted {cal.predicted(g.name, part[g.name]) * 1e3:.3f}, "
                      f"in steps {planned[g.name] * 1e3:.3f}, after {after[j + 1]:.3f}")
            print(f"round {r + 1} step: in steps {(master + sum(planned.values())) * 1e3:.3f}, "
                  f"after {after[0]:.3f}", flush=True)
    finally:
        for d in devices:
            d.close()


if __name__ == "__main__":
    main()
