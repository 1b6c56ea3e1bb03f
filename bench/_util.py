"""Helpers shared by the benchmarks: interleaved timing, medians, tables, JSON, system facts.

Every benchmark measures pyhet against its reference in the same run, alternating them
(A B A B ...) after a warm-up, and reports medians and their ratio: absolute times drift on a
shared machine, the ratio of interleaved medians much less. Only the standard library, NumPy and
(optionally) threadpoolctl are imported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Mapping, Sequence

# ------------------------------------------------------------------------------------------------
# Timing


def interleaved_times(fns: Mapping[str, Callable[[], object]], repeat: int, warmup: int = 1,
                      pause: float = 0.0) -> Dict[str, List[float]]:
    """Run every function `warmup` times, then `repeat` rounds of each in turn (A B A B ...).

    `pause` seconds of sleep before each timed call let the thread pools of the previous call go
    to sleep: OpenBLAS's idle threads spin for about 0.1 s after a call and OpenMP's for a few
    ms, and on a machine with as many cores as threads a spinning pool slows whatever runs next
    (2x at 2 threads on 2 cores). Returns the wall-clock seconds of each timed call, per name,
    in the order they ran.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            if pause > 0:
                time.sleep(pause)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def median_or_none(values):
    """The median of the values that are not None, or None when none is."""
    values = [v for v in values if v is not None]
    return median(values) if values else None


# ------------------------------------------------------------------------------------------------
# Threads of the reference library


def threadpoolctl_available() -> bool:
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        return False
    return True


def blas_threads(n: int):
    """A context in which NumPy's BLAS uses n threads (a no-op without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


def blas_info() -> List[dict]:
    """The BLAS libraries loaded in this process (name, version, kernel, threads), if known."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keep = ("internal_api", "version", "architecture", "num_threads", "threading_layer",
            "filepath")
    return [{k: lib.get(k) for k in keep if k in lib} for lib in threadpool_info()
            if lib.get("user_api") == "blas"]


def env_warnings() -> List[str]:
    """Settings in the environment that make a comparison against NumPy's BLAS unfair."""
    out = []
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if os.environ.get(var):
            out.append(f"{var}={os.environ[var]} is set: it can slow OpenBLAS down; "
                       f"run with `env -u {var}` for a fair reference")
    if not threadpoolctl_available():
        out.append("threadpoolctl is not installed: NumPy's BLAS threads are not limited, "
                   "so its numbers at a given thread count may use more threads "
                   "(pip install threadpoolctl)")
    return out


# ------------------------------------------------------------------------------------------------
# Facts about the machine and the build


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def system_info() -> dict:
    import numpy as np

    info = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores_available": available_cores(),
        "numpy": np.__version__,
        "blas": blas_info(),
        "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                           "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
                if k in os.environ},
    }
    try:
        import pyhet
        from pyhet import ops
        info["pyhet"] = getattr(pyhet, "__version__", "?")
        info["pyhet_gemm_kernel"] = ops.gemm_kernel()
        info["pyhet_openmp"] = ops.have_openmp()
    except ImportError as e:  # a benchmark of something else may still run
        info["pyhet"] = f"not importable: {e}"
    return info


def describe_system(info: dict) -> str:
    """A few lines for the top of a benchmark's output."""
    lines = [f"cpu: {info['cpu']} ({info['cores_available']} cores available)",
             f"python {info['python']}, numpy {info['numpy']}"]
    if "pyhet_gemm_kernel" in info:
        lines.append(f"pyhet {info['pyhet']}: gemm kernel {info['pyhet_gemm_kernel']}, "
                     f"OpenMP {'on' if info['pyhet_openmp'] else 'off'}")
    for lib in info["blas"]:
        lines.append(f"numpy BLAS: {lib.get('internal_api')} {lib.get('version')}, "
                     f"kernel {lib.get('architecture')}, {lib.get('num_threads')} threads "
                     f"by default")
    if not info["blas"] and threadpoolctl_available():
        lines.append("numpy BLAS: not reported by threadpoolctl")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Output


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: right-aligned columns, floats with 2 decimals."""
    def cell(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def write_json(path: str, data: dict) -> None:
    """Write the results; a path that cannot be written ends the benchmark with one line."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as e:
        sys.exit(f"pyhet: error: cannot write the JSON file {path}: {e.strerror or e}")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (saying so on stderr) where it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def save_outputs(result: dict, args, plot) -> None:
    """The result as JSON to --json FILE and, drawn by plot(result, path), to --plot FILE."""
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)


# ================================================================================================
# Runs of `pyhet train --json` in processes, under mpiexec too (bench bandwidth, bench ranks)


def mpiexec():
    """The mpiexec beside this Python (the mpich wheel's), else the one on the PATH, or None."""
    import shutil
    from pathlib import Path

    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec")


def missing_mpi():
    """Why pyhet cannot run under mpiexec here, or None."""
    if mpiexec() is None:
        return "there is no mpiexec (pip install 'pyhet[mpi]')"
    try:
        import mpi4py  # noqa: F401  (only whether it is there)
    except ImportError:
        return "mpi4py is not installed (pip install 'pyhet[mpi]')"
    return None


def network_argv(kernels: str, arch: str | None = None) -> list:
    """The network options of a pyhet command: --arch SPEC where given, else --kernels A,B."""
    return ["--arch", arch] if arch else ["--kernels", kernels]


def train_argv(kernels: str, batch_size: int, steps: int, devices: str,
               balance: str = "static", arch: str | None = None) -> list:
    """`python -m pyhet train` on synthetic data, the JSON summary on stdout (the network by
    --arch where `arch` is given, else by --kernels)."""
    return [sys.executable, "-m", "pyhet", "train", "--dataset", "synthetic",
            *network_argv(kernels, arch), "--batch-size", str(batch_size), "--steps",
            str(steps), "--devices", devices, "--balance", balance, "--quiet", "--json"]


def device_configs(parser, text: str) -> List[str]:
    """The --devices SPECs of a --configs option, separated by ';' (parser.error on a bad one
    or on none)."""
    from pyhet.specs import parse_devices

    configs = [c.strip() for c in text.split(";") if c.strip()]
    try:
        for c in configs:
            parse_devices(c)
    except ValueError as e:
        parser.error(str(e))
    if not configs:
        parser.error("argument --configs: no configuration given")
    return configs


def run_json(cmd, timeout: float, cwd, env=None) -> dict:
    """The JSON summary a run of cmd prints last (env: this one's, without PYTHONPATH, when
    None); RuntimeError with its stderr's tail when it fails."""
    import subprocess

    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:8]))} ... failed ({p.returncode}): "
                           f"{p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])
