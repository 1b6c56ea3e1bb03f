"""pyhet's SGEMM, with each micro-kernel this CPU runs, against NumPy's BLAS in the same run.

    python bench/gemm.py [--shapes 1024x1024x1024,1500x1600x12500] [--threads 1,2]
                         [--kernels avx512,avx2-fma,portable] [--plain-max-gflop 4]
                         [--repeat 7] [--pause 0.3] [--json FILE]
    pyhet bench gemm [the same options]

For each shape and thread count: a warm-up of each side, then `repeat` interleaved rounds (numpy,
then each kernel, then the plain loop, again and again), each call after a short pause that lets
the previous side's idle threads stop spinning. The sides: np.matmul; pyhet's packed GEMM with
each micro-kernel (forced by the test hook, whatever the CPU's default); the plain loop, the
i-k-j triple loop the compiler vectorises with the portable kernel's flags (`_core.sgemm_naive`),
which the packed GEMM with the portable kernel must beat. The plain loop streams all of B once
per row of C, so it runs only on shapes without transposes and of at most --plain-max-gflop
GFLOP. The tables give median GFLOP/s and the same-run ratios avx512 / avx2, each kernel / numpy,
portable / plain loop. Where a product is big enough for pyhet's one level of Strassen's scheme
(every dimension >= 768 by default), each kernel runs it as the library does, and one more side,
`blocked`, runs the default kernel with the scheme off (the ratio kernel / blocked is the
scheme's gain); GFLOP/s always count the blocked product's 2 M N K operations, so with the
scheme they are an effective rate (it does 1/8 fewer). NumPy's threads are limited with
threadpoolctl when it is installed. A
shape may end in `:nt`, `:tn` or `:tt` to transpose A and/or B (stored transposed, handled by
each library). For a fair reference run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, e.g.
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/gemm.py`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np

try:
    from . import _util
except ImportError:  # run as a script: python bench/gemm.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _util

from pyhet import _core, ops
from pyhet.backends.numpy_ref import host_available_memory
from pyhet.cli import Parser, positive
from pyhet.errors import shown

DEFAULT_SHAPES = "1024x1024x1024,1500x1600x12500"


def parse_shape(text: str):
    """'MxNxK' or 'MxNxK:tn' -> (M, N, K, trans_a, trans_b)."""
    dims, _, trans = text.strip().partition(":")
    # ASCII digits only: int() would also take 1_0 and other scripts' digits
    match = re.fullmatch(r"([0-9]{1,18})x([0-9]{1,18})x([0-9]{1,18})", dims.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a shape like 1024x1024x1024, got "
                                         f"{shown(text)}")
    m, n, k = (int(v) for v in match.groups())
    trans = trans or "nn"
    if len(trans) != 2 or set(trans) - {"n", "t"}:
        raise argparse.ArgumentTypeError(f"expected :nn, :nt, :tn or :tt after {dims}, "
                                         f"got :{trans}")
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"every dimension must be >= 1, got {text!r}")
    return m, n, k, trans[0] == "t", trans[1] == "t"


def parse_threads(text: str):
    count = positive(int, high=ops.MAX_THREADS)
    try:
        return [count(v) for v in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected thread counts like 1,2, each from 1 to "
                                         f"{ops.MAX_THREADS}, got {text!r}") from None


def shape_name(m, n, k, ta, tb) -> str:
    trans = ("t" if ta else "n") + ("t" if tb else "n")
    return f"{m}x{n}x{k}" + ("" if trans == "nn" else f":{trans}")


KERNELS = ("avx512", "avx2-fma", "portable")  # the fastest first
PLAIN = "plain loop"


def runnable_kernels():
    """The micro-kernels this CPU and build run, in KERNELS' order."""
    out = []
    for name in KERNELS:
        try:
            _core.set_gemm_kernel(name)
        except ValueError:
            continue
        finally:
            _core.set_gemm_kernel("auto")
        out.append(name)
    return out


def parse_kernels(text: str):
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in KERNELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected kernels among {', '.join(KERNELS)}, "
                                         f"got {text!r}")
    return names


BLOCKED = "blocked"
# (numerator, denominator) of each ratio in the table, where both sides ran.
RATIOS = [("avx512", "avx2-fma"), ("avx512", "numpy"), ("avx2-fma", "numpy"),
          ("portable", "numpy"), ("portable", PLAIN)]


def measure(m, n, k, trans_a, trans_b, threads, kernels, plain, repeat, pause, rng) -> dict:
    """Median seconds of np.matmul, of pyhet's sgemm with each kernel and (when `plain`) of the
    plain loop on one problem, interleaved."""
    a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
    out = {}

    def run_numpy():
        np.matmul(op_a, op_b, out=out["numpy"])

    def run_kernel(name):
        def run():
            _core.set_gemm_kernel(name)  # an atomic store: nothing next to the product
            ops.sgemm(a, b, out[name], trans_a=trans_a, trans_b=trans_b, threads=threads)
        return run

    def run_plain():
        _core.sgemm_naive(a, b, out[PLAIN], threads=threads)

    auto = ops.gemm_kernel()

    def run_blocked():
        _core.set_gemm_kernel(auto)
        dim = _core.set_gemm_strassen_min_dim(0)
        try:
            ops.sgemm(a, b, out[BLOCKED], trans_a=trans_a, trans_b=trans_b, threads=threads)
        finally:
            _core.set_gemm_strassen_min_dim(dim)

    fns = {"numpy": run_numpy}
    fns.update((name, run_kernel(name)) for name in kernels)
    if ops.uses_strassen(m, n, k, threads):
        fns[BLOCKED] = run_blocked
    if plain:
        fns[PLAIN] = run_plain
    for name in fns:
        out[name] = np.empty((m, n), np.float32)
    try:
        with _util.blas_threads(threads):
            times = _util.interleaved_times(fns, repeat, pause=pause)
    finally:
        _core.set_gemm_kernel("auto")
    # A benchmark of a wrong answer is worthless: check every side agrees with numpy (float32
    # rounding only).
    scale = float(np.abs(out["numpy"]).max()) or 1.0
    max_rel_diff = max((float(np.abs(out[name] - out["numpy"]).max()) / scale
                        for name in fns if name != "numpy"), default=0.0)
    flops = 2.0 * m * n * k
    median = {name: _util.median(t) for name, t in times.items()}
    gflops = {name: flops / median[name] / 1e9 for name in fns}
    ratios = {f"{x}/{y}": median[y] / median[x] for x, y in RATIOS if x in fns and y in fns}
    if BLOCKED in fns and auto in fns:
        ratios[f"{auto}/{BLOCKED}"] = median[BLOCKED] / median[auto]
    result = {
        "shape": shape_name(m, n, k, trans_a, trans_b), "M": m, "N": n, "K": k,
        "trans_a": trans_a, "trans_b": trans_b, "threads": threads,
        "gflops": gflops, "seconds": times, "ratios": ratios,
        "max_rel_diff": max_rel_diff, "default_kernel": auto,
    }
    if auto in fns:  # the figures of the kernel pyhet uses by default
        result.update({
            "pyhet_gflops": gflops[auto], "numpy_gflops": gflops["numpy"],
            "ratio": median["numpy"] / median[auto],
            "pyhet_seconds": times[auto], "numpy_seconds": times["numpy"]})
    return result


def make_parser() -> Parser:
    parser = Parser(prog="pyhet bench gemm", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help=f"comma-separated MxNxK[:nt|tn|tt] (default {DEFAULT_SHAPES})")
    parser.add_argument("--threads", type=parse_threads, default=None,
                        help="comma-separated thread counts (default: 1 and all cores)")
    parser.add_argument("--kernels", type=parse_kernels, default=None,
                        help=f"comma-separated micro-kernels among {', '.join(KERNELS)} "
                             f"(default: every one this CPU runs)")
    parser.add_argument("--plain-max-gflop", type=_util.non_negative(float), default=4.0,
                        help="run the plain loop on products of at most this many GFLOP, "
                             "0 for never (default 4: 1024^3 and smaller)")
    parser.add_argument("--repeat", type=positive(int), default=7,
                        help="timed rounds of each side per problem (default 7)")
    # at most an hour: time.sleep() overflows on a huge one
    parser.add_argument("--pause", type=_util.non_negative(float, high=3600), default=0.3,
                        help="seconds of sleep before each timed call, so that no side runs "
                             "beside another's spinning idle threads (default 0.3)")
    parser.add_argument("--seed", type=_util.non_negative(int), default=0,
                        help="of the random matrices (default 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    return parser


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    _util.given_once(parser, "--threads", args.threads or [])
    _util.given_once(parser, "--kernels", args.kernels or [])
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument --shapes: {e}")
    if not shapes:
        parser.error(f"argument --shapes: expected at least one shape like 1024x1024x1024, got "
                     f"{args.shapes!r}")
    _util.given_once(parser, "--shapes", shapes, lambda s: shape_name(*s))
    available = host_available_memory()
    for m, n, k, ta, tb in shapes:
        # A, B, the kernel's C and NumPy's, as float32: refused here rather than allocated
        # until the machine runs out (a MemoryError said "the network")
        need = 4 * (m * k + k * n + 2 * m * n)
        if available is not None and need > available:
            parser.error(f"argument --shapes: {shape_name(m, n, k, ta, tb)} needs "
                         f"{need / 2**30:,.1f} GiB for its matrices, but this machine has "
                         f"{available / 2**30:,.1f} GiB available")
    _util.check_outputs(parser, args)
    runnable = runnable_kernels()
    kernels = args.kernels or runnable
    missing = [name for name in kernels if name not in runnable]
    if missing:
        parser.error(f"this CPU or build cannot run the {', '.join(missing)} kernel; "
                     f"it runs {', '.join(runnable)}")
    threads = args.threads or sorted({1, ops.default_threads()})

    info = _util.system_info()
    print(_util.describe_system(info))
    print(f"micro-kernels this CPU runs: {', '.join(runnable)}; measured: {', '.join(kernels)}")
    warnings = _util.env_warnings()
    if max(threads) > 1 and not ops.have_openmp():
        warnings.append("pyhet was built without OpenMP: it runs on one thread whatever "
                        "--threads says")
    for warning in warnings:
        print(f"WARNING: {warning}")
    print(f"median of {args.repeat} interleaved runs each, after a warm-up, "
          f"{args.pause:g} s apart; the plain loop on untransposed products of at most "
          f"{args.plain_max_gflop:g} GFLOP\n", flush=True)

    rng = np.random.default_rng(args.seed)
    results = []
    for m, n, k, ta, tb in shapes:
        plain = not (ta or tb) and 2.0 * m * n * k <= args.plain_max_gflop * 1e9
        for t in threads:
            r = measure(m, n, k, ta, tb, t, kernels, plain, args.repeat, args.pause, rng)
            results.append(r)
            if r["max_rel_diff"] > 1e-3:
                print(f"WARNING: {r['shape']} at {t} threads: a side differs from numpy by "
                      f"{r['max_rel_diff']:.2e} of the largest entry", flush=True)
    print(format_tables(results, kernels))
    if args.json:
        _util.write_json(args.json, {"benchmark": "gemm", "system": info,
                                     "warnings": warnings, "repeat": args.repeat,
                                     "pause": args.pause, "seed": args.seed,
                                     "plain_max_gflop": args.plain_max_gflop,
                                     "threads": threads, "kernels": kernels,
                                     "results": results})
        print(f"\nwrote {args.json}")
    return 0


def format_tables(results, kernels) -> str:
    """GFLOP/s per side, then the ratios; "-" where a side did not run on a problem."""
    sides = [s for s in ("numpy", *kernels, BLOCKED, PLAIN)
             if any(s in r["gflops"] for r in results)]
    ratios = [f"{x}/{y}" for x, y in RATIOS
              if any(f"{x}/{y}" in r["ratios"] for r in results)]
    ratios += sorted({q for r in results for q in r["ratios"] if q.endswith(f"/{BLOCKED}")})

    def value(d, key):
        return d[key] if key in d else "-"

    speed = [[r["shape"], r["threads"], *(value(r["gflops"], s) for s in sides)]
             for r in results]
    ratio = [[r["shape"], r["threads"], *(value(r["ratios"], q) for q in ratios)]
             for r in results]
    head = ["shape (MxNxK)", "threads"]
    return (_util.format_table(head + sides, speed) + "\n\nGFLOP/s above; same-run ratios "
            "(speed of the first over the second):\n\n" + _util.format_table(head + ratios, ratio))


if __name__ == "__main__":
    sys.exit(main())
