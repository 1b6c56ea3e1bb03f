"""pyhet's SGEMM against NumPy's BLAS (np.matmul on the same float32 arrays), in the same run.

    python bench/gemm.py [--shapes 1024x1024x1024,1500x1600x12500] [--threads 1,2]
                         [--repeat 7] [--pause 0.3] [--json FILE]
    pyhet bench gemm [the same options]

For each shape and thread count: a warm-up of each side, then `repeat` interleaved rounds
(pyhet, numpy, pyhet, numpy, ...), each call after a short pause that lets the other library's
idle threads stop spinning; the table gives median GFLOP/s and the ratio pyhet / numpy.
NumPy's threads are limited with threadpoolctl when it is installed. A shape may end in
`:nt`, `:tn` or `:tt` to transpose A and/or B (stored transposed, handled by each library).
For a fair reference run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, e.g.
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/gemm.py`.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

try:
    from . import _util
except ImportError:  # run as a script: python bench/gemm.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _util

from pyhet import ops
from pyhet.cli import Parser, positive

DEFAULT_SHAPES = "1024x1024x1024,1500x1600x12500"


def parse_shape(text: str):
    """'MxNxK' or 'MxNxK:tn' -> (M, N, K, trans_a, trans_b)."""
    dims, _, trans = text.strip().partition(":")
    try:
        m, n, k = (int(v) for v in dims.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 1024x1024x1024, got {text!r}")
    trans = trans or "nn"
    if len(trans) != 2 or set(trans) - {"n", "t"}:
        raise argparse.ArgumentTypeError(f"expected :nn, :nt, :tn or :tt after {dims}, "
                                         f"got :{trans}")
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"every dimension must be >= 1, got {text!r}")
    return m, n, k, trans[0] == "t", trans[1] == "t"


def parse_threads(text: str):
    try:
        threads = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected thread counts like 1,2, got {text!r}")
    if min(threads) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return threads


def shape_name(m, n, k, ta, tb) -> str:
    trans = ("t" if ta else "n") + ("t" if tb else "n")
    return f"{m}x{n}x{k}" + ("" if trans == "nn" else f":{trans}")


def measure(m, n, k, trans_a, trans_b, threads, repeat, pause, rng) -> dict:
    """Median seconds of pyhet's sgemm and of np.matmul on one problem, interleaved."""
    a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
    c_pyhet = np.empty((m, n), np.float32)
    c_numpy = np.empty((m, n), np.float32)

    def run_pyhet():
        ops.sgemm(a, b, c_pyhet, trans_a=trans_a, trans_b=trans_b, threads=threads)

    def run_numpy():
        np.matmul(op_a, op_b, out=c_numpy)

    with _util.blas_threads(threads):
        times = _util.interleaved_times({"pyhet": run_pyhet, "numpy": run_numpy}, repeat,
                                        pause=pause)
    # A benchmark of a wrong answer is worthless: check the two agree (float32 rounding only).
    scale = float(np.abs(c_numpy).max()) or 1.0
    max_rel_diff = float(np.abs(c_pyhet - c_numpy).max()) / scale
    flops = 2.0 * m * n * k
    t_pyhet, t_numpy = _util.median(times["pyhet"]), _util.median(times["numpy"])
    return {
        "shape": shape_name(m, n, k, trans_a, trans_b), "M": m, "N": n, "K": k,
        "trans_a": trans_a, "trans_b": trans_b, "threads": threads,
        "pyhet_gflops": flops / t_pyhet / 1e9, "numpy_gflops": flops / t_numpy / 1e9,
        "ratio": t_numpy / t_pyhet,
        "pyhet_seconds": times["pyhet"], "numpy_seconds": times["numpy"],
        "max_rel_diff": max_rel_diff,
    }


def main(argv=None) -> int:
    parser = Parser(prog="pyhet bench gemm", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help=f"comma-separated MxNxK[:nt|tn|tt] (default {DEFAULT_SHAPES})")
    parser.add_argument("--threads", type=parse_threads, default=None,
                        help="comma-separated thread counts (default: 1 and all cores)")
    parser.add_argument("--repeat", type=positive(int), default=7,
                        help="timed rounds of each side per problem (default 7)")
    parser.add_argument("--pause", type=float, default=0.3,
                        help="seconds of sleep before each timed call, so that neither side "
                             "runs beside the other's spinning idle threads (default 0.3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = parser.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.pause < 0:
        parser.error(f"--pause must be >= 0, got {args.pause}")
    threads = args.threads or sorted({1, ops.default_threads()})

    info = _util.system_info()
    print(_util.describe_system(info))
    warnings = _util.env_warnings()
    if max(threads) > 1 and not ops.have_openmp():
        warnings.append("pyhet was built without OpenMP: it runs on one thread whatever "
                        "--threads says")
    for warning in warnings:
        print(f"WARNING: {warning}")
    print(f"median of {args.repeat} interleaved runs each, after a warm-up, "
          f"{args.pause:g} s apart\n", flush=True)

    rng = np.random.default_rng(args.seed)
    results, rows = [], []
    for m, n, k, ta, tb in shapes:
        for t in threads:
            r = measure(m, n, k, ta, tb, t, args.repeat, args.pause, rng)
            results.append(r)
            rows.append([r["shape"], t, r["pyhet_gflops"], r["numpy_gflops"], r["ratio"]])
            if r["max_rel_diff"] > 1e-3:
                print(f"WARNING: {r['shape']} at {t} threads: pyhet and numpy differ by "
                      f"{r['max_rel_diff']:.2e} of the largest entry", flush=True)
    print(_util.format_table(["shape (MxNxK)", "threads", "pyhet GFLOP/s", "numpy GFLOP/s",
                              "pyhet/numpy"], rows))
    if args.json:
        _util.write_json(args.json, {"benchmark": "gemm", "system": info,
                                     "warnings": warnings, "repeat": args.repeat,
                                     "pause": args.pause,
                                     "results": results})
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
