"""How far two cores' speeds drift apart: one thread pinned to each of two cores, each running
the same GEMM of pyhet's core (about 55 ms a call on one Zen 4 core) in a loop at once, for
SECONDS; per window of WINDOW seconds each core's median call time (over its median for the
whole run) and their ratio (core 1's over core 0's: above 1, core 1 slower). A split fixed for
a run (pyhet's static balance) is balanced for the cores' speeds when it was calibrated; where
they drift apart, every phase waits for the core that is slow at that moment: the last line
gives what that costs two equal devices split half and half, the mean over the windows of the
slower core's time over the two cores' mean.

    python tools/core_drift.py [SECONDS [WINDOW [CPU0 CPU1]]]    (default 60 1, the first two
                                                                 cores this process may use)

A window of about a phase of a step (the paper network's conv2 at batch 16: 0.5-1 s) shows what
each phase waits for; longer windows, the drift a calibration sees.
"""

import argparse
import math
import os
import sys
import threading
import time

import numpy as np

from pyhet import _core


FLOPS = 2 * 500 * 4500 * 1024   # of one call of the GEMM timed (timed_calls)


def timed_calls(cpus, seconds: float, prog: str = "core_drift.py", warm: bool = False) -> dict:
    """{cpu: [(start, seconds) of each call]} of one thread pinned to each core of `cpus`, all
    at once, each running the same GEMM of pyhet's core (500 x 1024 x 4500) in a loop for
    `seconds` from now (after one call that is not timed, where `warm`: its packing buffers
    and pages); the program (`prog`) exits saying why where a core's thread failed or hung."""
    calls = {c: [] for c in cpus}
    start = time.perf_counter()
    failed = []

    def work(cpu):
        try:
            os.sched_setaffinity(0, {cpu})
            rng = np.random.default_rng(cpu)
            a = rng.random((500, 4500), np.float32)
            b = rng.random((4500, 1024), np.float32)
            c = np.empty((500, 1024), np.float32)
            if warm:
                _core.sgemm(a, b, c)
            while time.perf_counter() - start < seconds:
                t0 = time.perf_counter()
                _core.sgemm(a, b, c)
                calls[cpu].append((t0 - start, time.perf_counter() - t0))
        except BaseException as e:   # said after the join, not lost in a thread
            failed.append(f"core {cpu}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in cpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    if failed or any(t.is_alive() for t in threads):
        sys.exit(f"{prog}: " + ("; ".join(failed) or "a core's GEMM did not return"))
    return calls


def main(argv):
    ap = argparse.ArgumentParser(prog="core_drift.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("seconds", nargs="?", type=float, default=60.0)
    ap.add_argument("window", nargs="?", type=float, default=1.0)
    ap.add_argument("cpus", nargs="*", type=int, metavar="CPU")
    args = ap.parse_args(argv)
    seconds, window = args.seconds, args.window
    if not (0 < window <= seconds and math.isfinite(seconds)):
        ap.error(f"needs 0 < WINDOW <= SECONDS; got SECONDS {seconds:g}, WINDOW {window:g}")
    allowed = sorted(os.sched_getaffinity(0))
    cpus = args.cpus or allowed[:2]
    if len(cpus) != 2 or cpus[0] == cpus[1] or not set(cpus) <= set(allowed):
        ap.error(f"needs two different cores of those this process may use, {allowed}; "
                 f"got {cpus}")
    calls = timed_calls(cpus, seconds)
    if any(not calls[c] for c in cpus):
        sys.exit(f"core_drift.py: no GEMM call ended in {seconds:g} s on a core; give more "
                 f"SECONDS")
    overall = {c: float(np.median([d for _, d in calls[c]])) for c in cpus}
    print(f"cores {cpus[0]} and {cpus[1]}: median call {overall[cpus[0]] * 1e3:.1f} and "
          f"{overall[cpus[1]] * 1e3:.1f} ms over {seconds:g} s")
    print(" window  core %d  core %d  ratio" % tuple(cpus))
    ratios, losses, empty = [], [], 0
    for w0 in np.arange(0.0, seconds, window):
        rel = []
        for c in cpus:
            inside = [d for t, d in calls[c] if w0 <= t < w0 + window]
            rel.append(float(np.median(inside)) / overall[c] if inside else None)
        if None in rel:      # a window in which a core began no call
            empty += 1
            continue
        ratios.append(rel[1] / rel[0])
        losses.append(max(rel) / (sum(rel) / 2))
        print(f"{w0:6g}s  {rel[0]:6.3f}  {rel[1]:6.3f}  {ratios[-1]:.3f}")
    if not ratios:
        sys.exit(f"core_drift.py: no window of {window:g} s in which both cores began a call "
                 f"(a call takes {max(overall.values()):.3f} s here); give a longer WINDOW")
    ratios = np.array(ratios)
    skipped = f" ({empty} windows without a call on a core left out)" if empty else ""
    print(f"ratio of the cores' times per {window:g} s: {ratios.min():.3f} to "
          f"{ratios.max():.3f}, mean |ratio - 1| {np.mean(np.abs(ratios - 1)):.3f}; a half and "
          f"half split waits for the slower core: {100 * (np.mean(losses) - 1):.1f}% longer"
          f"{skipped}")


if __name__ == "__main__":
    main(sys.argv[1:])
