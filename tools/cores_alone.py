"""A core alone against the cores at once: the GEMM rate of one thread of pyhet's core pinned to
the first core while the others idle, then of one thread on each core at once, in turns, for
ROUNDS rounds of SECONDS each way; per round the rates and the ratio alone / at once (the
first core's), and the median ratio last. A CPU whose clock rises where few of its cores are
busy (boost) shows a ratio above 1 though the cores share no work: a device timed alone then
runs at a clock the devices of a pair do not get, and an efficiency measured on one machine
against devices alone (`tools/hetero.sh`, which prints this each round) reads that much lower.
On a 2-core Zen 1 VM the conv2 product ran 41.3 GFLOP/s alone and 36.8 beside the other in one
stretch, 35.3 and 35.9 in another (BENCHMARKS.md).

    python tools/cores_alone.py [SECONDS [ROUNDS [CPU ...]]]    (default 2 3, the first two
                                                                cores this process may use)
"""

import argparse
import os
import statistics
import sys

from core_drift import FLOPS, timed_calls   # (this folder is the script's: on sys.path)


def rates(cpus, seconds: float) -> list:
    """GFLOP/s of one thread pinned to each core of `cpus`, all at once, for `seconds`: the
    median over its calls; None for a core on which no call ended."""
    calls = timed_calls(cpus, seconds, "cores_alone.py", warm=True)
    return [FLOPS / statistics.median(d for _, d in calls[c]) / 1e9 if calls[c] else None
            for c in cpus]


def main(argv):
    ap = argparse.ArgumentParser(prog="cores_alone.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("seconds", nargs="?", type=float, default=2.0)
    ap.add_argument("rounds", nargs="?", type=int, default=3)
    ap.add_argument("cpus", nargs="*", type=int, metavar="CPU")
    args = ap.parse_args(argv)
    if not 0 < args.seconds <= 600 or not 1 <= args.rounds <= 100:   # (NaN fails too)
        ap.error(f"needs 0 < SECONDS <= 600 and 1 <= ROUNDS <= 100; got SECONDS "
                 f"{args.seconds:g}, ROUNDS {args.rounds}")
    allowed = sorted(os.sched_getaffinity(0))
    cpus = args.cpus or allowed[:2]
    if len(cpus) < 2 or len(set(cpus)) != len(cpus) or not set(cpus) <= set(allowed):
        ap.error(f"needs two or more different cores of those this process may use, {allowed}; "
                 f"got {cpus}")
    ratios = []
    for r in range(1, args.rounds + 1):
        alone, = rates(cpus[:1], args.seconds)
        together = rates(cpus, args.seconds)
        if alone is None or None in together:
            sys.exit(f"cores_alone.py: no GEMM call ended in {args.seconds:g} s on a core; give "
                     f"more SECONDS")
        ratios.append(alone / together[0])
        print(f"round {r}: core {cpus[0]} alone {alone:.1f} GFLOP/s; cores "
              f"{', '.join(map(str, cpus))} at once " + " ".join(f"{g:.1f}" for g in together)
              + f"; alone / at once {ratios[-1]:.3f}", flush=True)
    print(f"median alone / at once over {len(ratios)} round{'s' if len(ratios) > 1 else ''}: "
          f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
