"""One SGD step of the paper's network on one device: pyhet against PyTorch's CPU path.

    pyhet bench step [--kernels 500,1500] [--batch-size 16] [--threads 1] [--steps 3]
                     [--rounds 2] [--blocked] [--json FILE]

Each side runs in its own fresh process pinned to the same cores (so peak memory is each one's
own), in rounds A B A B; a round warms up with one step, then times --steps steps. The table
gives the median step time of each side, the ratio pyhet / PyTorch (below 1 is faster), the
GFLOP/s each reaches and each process's peak resident memory. PyTorch is skipped, with a note,
where it is not installed. GFLOP/s count the step's operations as blocked products do them;
pyhet's GEMM runs its biggest products by one level of Strassen's scheme (1/8 fewer
operations there), so its figure is an effective rate. --blocked adds a side, pyhet with the
scheme off (PYHET_GEMM_STRASSEN=0), and the ratio pyhet / blocked.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np

try:
    from . import _util
except ImportError:  # run as a script (each worker is): python bench/step.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _util

from pyhet import ops
from pyhet.cli import Parser, kernel_counts, positive

INPUT = (3, 32, 32)
CLASSES = 10


def _batch(n):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n,) + INPUT).astype(np.float32),
            rng.integers(0, CLASSES, n))


def _pin(threads):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= threads:
        os.sched_setaffinity(0, cores[:threads])


# ------------------------------------------------------------------------------------------------
# Workers (each runs in its own process)


def worker_pyhet(kernels, batch, threads, steps):
    from pyhet.backends.cpu import CpuBackend
    from pyhet import arch
    from pyhet.devices import make_devices
    from pyhet.model import Net, init_params
    from pyhet.specs import parse_devices
    from pyhet.optim import SGDConfig
    from pyhet.timing import PartTimer

    shape = arch.build(arch.shorthand(kernels, 5), INPUT, CLASSES)
    devices = make_devices(parse_devices(f"cpu:{threads}"))
    try:
        net = Net(shape, init_params(shape, 0), devices,
                  {"conv1": [kernels[0]], "conv2": [kernels[1]]}, CpuBackend(threads))
        x, y = _batch(batch)
        cfg = SGDConfig(0.01, 0.9, 0.0)
        times, parts = [], {}
        for i in range(steps + 1):
            timer = PartTimer()
            t0 = time.perf_counter()
            net.train_step(x, y, cfg, timer)
            if i:
                times.append(time.perf_counter() - t0)
                for k, v in timer.parts.items():
                    parts[k] = parts.get(k, 0.0) + v / steps
    finally:
        for d in devices:
            d.close()
    return {"times": times, "parts": parts}


def worker_torch(kernels, batch, threads, steps):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    A, B = kernels
    model = torch.nn.Sequential(
        torch.nn.Conv2d(INPUT[0], A, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(A, B, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(B * 5 * 5, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    x, y = (torch.from_numpy(a) for a in _batch(batch))
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return {"times": times, "torch": torch.__version__}


def _run_worker(side, args, timeout=None):
    """The worker's result, its steps run in a process of their own (stopped, and a
    PyhetError, past `timeout` seconds where given)."""
    env = dict(os.environ)
    worker = side
    if side == BLOCKED:  # pyhet with Strassen's scheme off
        worker, env = "pyhet", dict(env, PYHET_GEMM_STRASSEN="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker,
           "--kernels", f"{args.kernels[0]},{args.kernels[1]}", "--batch-size",
           str(args.batch_size), "--threads", str(args.threads), "--steps", str(args.steps)]
    return _util.run_json(cmd, timeout, None, env,
                          f"the {side} worker (its steps in a process of their own)")


BLOCKED = "blocked"


def _torch_available():
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# ------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = Parser(prog="pyhet bench step", description=__doc__.split("\n")[0])
    p.add_argument("--kernels", type=kernel_counts, default=(500, 1500), metavar="A,B",
                   help="the network's kernel counts (default 500,1500, the paper's)")
    p.add_argument("--batch-size", type=positive(int), default=16,
                   help="images per step (default 16)")
    p.add_argument("--threads", type=positive(int, high=ops.MAX_THREADS), default=1,
                   help="of each side (default 1)")
    p.add_argument("--steps", type=positive(int), default=3,
                   help="timed steps per round (default 3)")
    p.add_argument("--rounds", type=positive(int), default=2,
                   help="rounds of each side, in turn (default 2)")
    p.add_argument("--blocked", action="store_true",
                   help="also run pyhet with Strassen's scheme off (PYHET_GEMM_STRASSEN=0)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument("--worker", choices=("pyhet", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _util.check_outputs(p, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        _pin(args.threads)
        fn = worker_pyhet if args.worker == "pyhet" else worker_torch
        out = fn(args.kernels, args.batch_size, args.threads, args.steps)
        out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(out))
        return 0

    from pyhet import arch

    _util.check_memory([(args.kernels, args.batch_size)], 1, INPUT, CLASSES)
    info = _util.system_info()
    print(_util.describe_system(info))
    shape = arch.build(arch.shorthand(args.kernels, 5), INPUT, CLASSES)
    flops = sum(shape.flops_per_image().values()) * args.batch_size
    sides = (["pyhet"] + ([BLOCKED] if args.blocked else []) +
             (["torch"] if _torch_available() else []))
    runs = {s: [] for s in sides}
    for r in range(args.rounds):
        for s in sides:
            runs[s].append(_run_worker(s, args))
            print(f"round {r + 1}/{args.rounds} {s}: median "
                  f"{_util.secs(statistics.median(runs[s][-1]['times']))} s", file=sys.stderr)

    result = {"benchmark": "step", "system": info, "kernels": list(args.kernels),
              "batch_size": args.batch_size, "threads": args.threads, "steps": args.steps,
              "rounds": args.rounds, "blocked": args.blocked, "gflop_per_step": flops / 1e9,
              "sides": {}}
    for s in sides:
        times = [t for run in runs[s] for t in run["times"]]
        med = statistics.median(times)
        result["sides"][s] = {"median_s": med, "min_s": min(times), "max_s": max(times),
                              "gflops": flops / med / 1e9,
                              "peak_rss_mb": max(run["max_rss_mb"] for run in runs[s])}
    if args.blocked:
        result["ratio_pyhet_over_blocked"] = (result["sides"]["pyhet"]["median_s"] /
                                              result["sides"][BLOCKED]["median_s"])
    parts = {}
    for run in runs["pyhet"]:
        for k, v in run["parts"].items():
            parts[k] = parts.get(k, 0.0) + v / len(runs["pyhet"])
    result["pyhet_parts_s"] = parts
    if "torch" in sides:
        result["torch_version"] = runs["torch"][0]["torch"]
        result["ratio_pyhet_over_torch"] = (result["sides"]["pyhet"]["median_s"] /
                                            result["sides"]["torch"]["median_s"])

    print(f"one SGD step, kernels {args.kernels[0]},{args.kernels[1]}, 3x32x32, batch "
          f"{args.batch_size}, {args.threads} thread(s), {flops / 1e9:.4g} GFLOP per step")
    print(f"{'side':<8}{'median s':>10}{'min s':>9}{'GFLOP/s':>10}{'peak RSS MB':>13}")
    for s, v in result["sides"].items():
        print(f"{s:<8}{_util.secs(v['median_s']):>10}{_util.secs(v['min_s']):>9}"
              f"{v['gflops']:>10.4g}"
              f"{v['peak_rss_mb']:>13.0f}")
    if "ratio_pyhet_over_torch" in result:
        print(f"ratio pyhet / torch {result['torch_version']}: "
              f"{result['ratio_pyhet_over_torch']:.3f}")
    else:
        print("PyTorch is not installed: no reference measured (pip install torch)")
    if args.blocked:
        print(f"ratio pyhet / blocked (Strassen's scheme off): "
              f"{result['ratio_pyhet_over_blocked']:.3f}")
    print("pyhet step parts (s): " + ", ".join(f"{k} {_util.secs(v)}" for k, v in parts.items()))
    if args.json:
        _util.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
