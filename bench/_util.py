"""Helpers shared by the benchmarks: interleaved timing, medians, tables, JSON and plots, option
and output checks, runs of pyhet in processes, system facts.

Every benchmark measures pyhet against its reference in the same run, alternating them
(A B A B ...) after a warm-up, and reports medians and their ratio: absolute times drift on a
shared machine, the ratio of interleaved medians much less. Only the standard library, NumPy and
(optionally) threadpoolctl are imported here at once; pyhet and matplotlib by the helpers that
need them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import stat
import statistics
import sys
import tempfile
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
                   "(pip install threadpoolctl, or pyhet's bench extra)")
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
        info["pyhet_gemm_blocks"] = list(ops.gemm_blocks())
        info["pyhet_openmp"] = ops.have_openmp()
    except ImportError as e:  # a benchmark of something else may still run
        info["pyhet"] = f"not importable: {e}"
    return info


def describe_system(info: dict) -> str:
    """A few lines for the top of a benchmark's output."""
    lines = [f"cpu: {info['cpu']} ({info['cores_available']} cores available)",
             f"python {info['python']}, numpy {info['numpy']}"]
    if "pyhet_gemm_kernel" in info:
        blocks = info.get("pyhet_gemm_blocks")
        lines.append(f"pyhet {info['pyhet']}: gemm kernel {info['pyhet_gemm_kernel']}"
                     + (" (MC {}, KC {}, NC {})".format(*blocks) if blocks else "")
                     + f", OpenMP {'on' if info['pyhet_openmp'] else 'off'}")
    for lib in info["blas"]:
        lines.append(f"numpy BLAS: {lib.get('internal_api')} {lib.get('version')}, "
                     f"kernel {lib.get('architecture')}, {lib.get('num_threads')} threads "
                     f"by default")
    if not info["blas"] and threadpoolctl_available():
        lines.append("numpy BLAS: not reported by threadpoolctl")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Output


def check_memory(pairs, devices: int = 1, input_shape=(3, 32, 32), classes: int = 10) -> None:
    """Refuse, before any work, a network this machine's memory cannot hold at its batch size,
    as pyhet train does (a DeviceError: exit status 1, one line naming the sizes). pairs:
    [(kernel counts A,B, batch size)]; devices: the most devices of this process a run uses."""
    from pyhet import arch
    from pyhet.train import check_memory as check

    for kernels, batch in pairs:
        check(arch.build(arch.shorthand(kernels, 5), input_shape, classes), batch,
              devices=devices)


def secs(v: float) -> str:
    """Seconds for a table: three decimals, or three significant digits below 0.1 s (a 2 ms
    step printed 0.002 beside a ratio of 0.70 that the printed times did not give)."""
    return f"{v:.3f}" if v >= 0.1 or v == 0 else f"{v:.3g}"


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


def _folder_of(path: str) -> str:
    from pyhet import files
    return files.folder_of(path)


NAME_MAX = 255   # the longest file name most file systems take, in bytes


def write_json(path: str, data: dict) -> None:
    """Write the results, whole or not at all: to a new hidden file beside `path`, then renamed
    over it (an earlier file of results stays whole until then, also when the write is
    interrupted or the disk fills). A path that cannot be written ends the benchmark with one
    line, which names the temporary file the results were kept in instead (the run is not
    lost)."""
    import secrets

    from pyhet import files

    tmp = None
    try:
        folder = _folder_of(path)
        os.makedirs(folder, exist_ok=True)   # as mkdir -p: nodir/.. is made
        tag = f".{secrets.token_hex(4)}.tmp"
        # the temporary name no longer than the longest name --json may have (NAME_MAX)
        base = os.fsencode(os.path.basename(path))[:NAME_MAX - 1 - len(tag)]
        name = os.path.join(folder, "." + os.fsdecode(base) + tag)
        fd = files.create_new(name)
        tmp = name
        try:   # a file replaced keeps its permissions
            os.chmod(fd, stat.S_IMODE(os.stat(path).st_mode))
        except OSError:
            pass
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        kept = _keep_elsewhere(data)
        sys.exit(f"pyhet: error: cannot write the JSON file {path}: {e.strerror or e}"
                 + (f"; the results are in {kept}" if kept else ""))
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _keep_elsewhere(data: dict):
    """The results in a new temporary file, its name; None where that fails too."""
    try:
        fd, name = tempfile.mkstemp(prefix="pyhet-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError:
        return None
    return name


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


def save_plot(fig, path: str, dpi: int) -> None:
    """Write the figure to `path` (made with the folders it needs) in the format its suffix
    names, PNG where it has none (never a name matplotlib makes up), close it and say where;
    a path that cannot be written ends the benchmark with one line."""
    import matplotlib.pyplot as plt

    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    try:
        os.makedirs(_folder_of(path), exist_ok=True)   # as mkdir -p: nodir/.. is made
        fig.savefig(path, dpi=dpi, format=fmt)
    except OSError as e:
        sys.exit(f"pyhet: error: cannot write the plot {path}: {e.strerror or e}")
    finally:
        plt.close(fig)
    print(f"plot written to {path}")


def save_outputs(result: dict, args, plot) -> None:
    """The result as JSON to --json FILE and, drawn by plot(result, path), to --plot FILE."""
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)


# ------------------------------------------------------------------------------------------------
# Options, and where the results go: checked before any work, so that a typo costs no run


def non_negative(kind, high=None):
    """An argparse type: a number >= 0 in ASCII (a finite one; at most `high` where given)."""
    from pyhet.cli import ranged

    return ranged(kind, low=0, high=high)


def add_paper_network_options(parser) -> None:
    """--kernels, --batch-size and --steps of the benchmarks whose runs are pyhet train
    processes on the paper's network (bench bandwidth, bench ranks)."""
    from pyhet.cli import positive

    parser.add_argument("--kernels", default="500,1500", metavar="A,B",
                        help="the network's kernel counts (default 500,1500)")
    parser.add_argument("--batch-size", type=positive(int), default=16,
                        help="images per step (default 16)")
    parser.add_argument("--steps", type=warmed_steps, default=4,
                        help="steps per run, the first warming up (default 4)")


def warmed_steps(text: str) -> int:
    """An argparse type: the steps of a training run whose first step warms up (at least 2)."""
    from pyhet.cli import positive

    v = positive(int)(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 (the first warms up), got "
                                         f"{text!r}")
    return v


PLOT_FORMATS = ("png", "pdf", "svg")


def folder_problem(folder: str):
    """Why no file can be made in `folder` (with the folders above it that are missing), or
    None: the nearest one that is there must be a folder that takes a new file (os.access says
    yes to root in /proc, or on a read-only mount)."""
    from pyhet import files

    above = os.path.realpath(folder)     # as os.makedirs goes: links, then ..
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return f"{above} is {files.kind(os.stat(above).st_mode)}, not a folder"
    try:
        tempfile.TemporaryFile(dir=above).close()
    except OSError as e:
        return f"the folder {above} cannot take a new file ({e.strerror or e})"
    return None


def write_problem(path: str, option: str):
    """Why the file `path` cannot be written, or None: as pyhet train checks --save (a name, a
    regular file or none, a folder that takes a new file of a name that long), where its folder
    is there; else the nearest folder above that is there must take the folders it needs."""
    from pyhet import files
    from pyhet.errors import UsageError
    from pyhet.train import check_file_destination

    folder = files.folder_of(path) if path else ""
    if path and not os.path.isdir(folder) and not path.endswith(
            tuple(filter(None, (os.sep, os.altsep)))):
        # a file in the way (f/../x: the system goes into f), else what os.makedirs would do
        problem = files.unreachable(folder, missing_ok=True) or folder_problem(folder)
        return None if problem is None else f"{option} {path}: {problem}"
    try:
        check_file_destination(path, option)
    except UsageError as e:
        return str(e)
    return None


def need_matplotlib(parser, option: str = "--plot") -> None:
    """A usage error where matplotlib cannot be imported: a plot is asked for, and a run that
    could not draw it should not start."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError as e:
        parser.error(f"argument {option}: drawing the plot needs matplotlib, which cannot be "
                     f"imported ({e}): pip install matplotlib")


def plot_destination(parser, path: str) -> str:
    """The file a --plot FILE is written to: FILE itself where it ends in .png, .pdf or .svg,
    FILE.png where it has no suffix; a usage error for a folder, another suffix, or a place
    that cannot be written."""
    need_matplotlib(parser)
    # a folder's name would be written to as FOLDER/.png, hidden
    folder = os.path.isdir(path) or path.endswith(tuple(filter(None, (os.sep, os.altsep))))
    if not path or folder:
        parser.error(f"argument --plot {path}: {'it names a folder; ' if folder else ''}give a "
                     f"file name (FILE.png)")
    suffix = os.path.splitext(os.path.basename(path))[1]
    if not suffix:
        path += ".png"
    elif suffix[1:].lower() not in PLOT_FORMATS:
        parser.error(f"argument --plot {path}: expected a file name ending in "
                     f"{', '.join('.' + f for f in PLOT_FORMATS)} (or none, for .png), got "
                     f"{suffix!r}")
    problem = write_problem(path, "--plot")
    if problem is not None:
        parser.error(f"argument {problem}")
    return path


def plot_folder(parser, folder: str) -> None:
    """A usage error where the --plot DIR cannot take the plots (or matplotlib is missing)."""
    need_matplotlib(parser)
    if not folder:
        parser.error("argument --plot: give a folder name")
    if os.path.exists(folder) and not os.path.isdir(folder):
        parser.error(f"argument --plot {folder}: it is a file, not a folder")
    suffix = os.path.splitext(os.path.basename(folder.rstrip(os.sep)))[1]
    if suffix[1:].lower() in PLOT_FORMATS and not os.path.isdir(folder):
        parser.error(f"argument --plot {folder}: a folder for the plots, one file each, "
                     f"not a file name (give e.g. --plot {folder[:-len(suffix)] or 'plots'})")
    problem = folder_problem(folder)
    if problem is not None:
        parser.error(f"argument --plot {folder}: {problem}")


def check_outputs(parser, args, plot_folder_given: bool = False) -> None:
    """--json FILE and --plot FILE (--plot DIR where plot_folder_given), where the benchmark
    has them and they are given, checked before any work (usage errors); args.plot becomes the
    file the plot will be written to. A leading ~ in either is the home folder, as in the
    other commands' paths (also after `=`, where the shell leaves it)."""
    from pyhet import files

    for dest in ("json", "plot", "bandwidth_json"):
        if getattr(args, dest, None) is not None:
            setattr(args, dest, files.user_path(getattr(args, dest)))
    if getattr(args, "json", None) is not None:
        problem = write_problem(args.json, "--json")
        if problem is not None:
            parser.error(f"argument {problem}")
    if getattr(args, "plot", None) is not None:
        if plot_folder_given:
            plot_folder(parser, args.plot)
        else:
            args.plot = plot_destination(parser, args.plot)


# ================================================================================================
# Runs of `pyhet train --json` in processes, under mpiexec too (bench bandwidth, bench ranks)


# ================================================================================================
# What bench bandwidth and bench ranks make as root: namespaces, links, cgroups


def sh(*args, check: bool = True):
    """Run a system tool (ip, tc); where it fails and `check`, a PyhetError that quotes it and
    what it said (one line, not a traceback)."""
    import subprocess

    from pyhet.errors import PyhetError

    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        said = " ".join(p.stderr.split()) or "no message"
        raise PyhetError(f"{' '.join(args)} failed (exit status {p.returncode}): {said}")
    return p


def unique_tag() -> str:
    """Six hex digits for the names of what a run makes, beside its pid: a pid comes round
    again, and the names of a run killed before it could remove them are still taken."""
    import secrets
    return secrets.token_hex(3)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def left_behind(names, prefix: str) -> List[str]:
    """The names among `names` that `prefix` followed by a pid and '-' starts, where that pid
    is no longer running: what a run that was killed (SIGKILL) could not remove."""
    import re

    pattern = re.compile(re.escape(prefix) + r"([0-9]+)-")
    return [n for n in names if (m := pattern.match(n)) and not _pid_alive(int(m.group(1)))]


def namespaces() -> List[str]:
    """The names of the network namespaces `ip netns` knows."""
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines()
            if line.split()]


def note_left_behind(bench: str, what: str, names, remove: str) -> None:
    """One line on stderr naming what an earlier run left (nothing is deleted: it is named, with
    the command that removes it)."""
    if names:
        from pyhet.errors import say
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        say(f"pyhet bench {bench}: note: {what} of earlier runs that were killed are left: "
            f"{shown} (remove them with: {remove})")


_PRIVATE_MOUNTS = []   # [whether unshare --mount works here], found once


def private_tmp(cmd) -> list:
    """cmd in a mount namespace of its own, with a new, empty /dev/shm and a /tmp that shows
    this machine's /tmp but keeps what is written there in that /dev/shm: what an MPI job
    leaves there when it is ended (MPICH's shared-memory files, mpiexec's topology file, which
    it leaves whatever signal ends it) goes when its last process does. Where a mount cannot
    be made (no overlay file system, say), cmd runs with what could be made; where no mount
    namespace can be made, as it is."""
    import subprocess

    if not _PRIVATE_MOUNTS:
        try:
            ok = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                                capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        _PRIVATE_MOUNTS.append(ok)
    if not _PRIVATE_MOUNTS[0]:
        return list(cmd)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            "mount -t tmpfs pyhet-shm /dev/shm 2>/dev/null && "
            "mkdir /dev/shm/.pyhet-upper /dev/shm/.pyhet-work && "
            "mount -t overlay pyhet-tmp -o lowerdir=/tmp,upperdir=/dev/shm/.pyhet-upper,"
            "workdir=/dev/shm/.pyhet-work /tmp 2>/dev/null; "
            'exec "$@"', "sh", *cmd]


def mpiexec():
    """The mpiexec beside this Python (the mpich wheel's), else the one on the PATH, or None."""
    import shutil
    from pathlib import Path

    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec")


def missing_mpi():
    """Why pyhet cannot run under mpiexec here, or None."""
    if mpiexec() is None:
        return "there is no mpiexec (pip install '.[mpi]' in pyhet's source folder)"
    try:
        import mpi4py  # noqa: F401  (only whether it is there)
    except ImportError:
        return "mpi4py is not installed (pip install '.[mpi]' in pyhet's source folder)"
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
        parser.error(f"argument --configs: {e}")
    if not configs:
        parser.error("argument --configs: no configuration given")
    given_once(parser, "--configs", configs)
    return configs


def given_once(parser, option: str, values, shown=str) -> None:
    """parser.error where a list option names one value twice: a benchmark files its runs by
    the value, so a repeat was measured twice and shown as one (the ratios of a configuration
    against itself), or measured again for a row that said nothing new."""
    seen = set()
    for v in values:
        if v in seen:
            parser.error(f"argument {option}: {shown(v)} is given twice (each is measured in "
                         f"every round: give it once)")
        seen.add(v)


def command_name(cmd) -> str:
    """A run's command in short, for messages: `pyhet train --devices SPEC ...` for a
    `python -m pyhet train`, behind `mpiexec ...` where that starts it."""
    words = [str(w) for w in cmd]
    starts = [i + 1 for i in range(len(words) - 1) if words[i:i + 2] == ["-m", "pyhet"]]
    if not starts:
        return " ".join(words[:3]) + (" ..." if len(words) > 3 else "")
    rest = words[starts[0]:]
    name = " ".join(rest[:2])
    if "--devices" in rest[:-1]:
        name += f" --devices {rest[rest.index('--devices') + 1]}"
    name += " ..."
    return f"mpiexec ... {name}" if os.path.basename(words[0]).startswith("mpiexec") else name


def child_error(what: str, returncode: int, stderr: str):
    """The PyhetError of a run that failed: what ran, how it ended, and why in one line (its
    own `pyhet: error:` line where it gave one, else its last line); the tail of its stderr is
    attached as a note, which --debug shows."""
    from pyhet.errors import PyhetError

    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("pyhet: error:")]
    why = (said[-1][len("pyhet: error:"):].strip() if said else
           lines[-1] if lines else "it said nothing on stderr")
    try:
        status = (f"exit status {returncode}" if returncode >= 0 else
                  f"killed by {signal.Signals(-returncode).name}")
    except ValueError:
        status = f"exit status {returncode}"
    err = PyhetError(f"{what} failed ({status}): {why}")
    if hasattr(err, "add_note") and lines:
        err.add_note("its stderr ended with:\n" + (stderr or "").strip()[-2000:])
    return err


def stop_with_partial(args, partial: "dict | None", error) -> None:
    """A run of pyhet failed, or the benchmark was interrupted (Ctrl-C, SIGTERM: a time limit's),
    after others were measured: those go to --json (with the error) where there are any and a
    --json was given, and the error says so; then it is raised."""
    import signal

    from pyhet.errors import Interrupted, PyhetError

    if partial is None or not getattr(args, "json", None):
        raise error
    stopped = isinstance(error, KeyboardInterrupt)
    signum = getattr(error, "signum", signal.SIGINT)
    write_json(args.json, {**partial, "error": (f"interrupted by {signal.Signals(signum).name}"
                                                if stopped else str(error))})
    where = f"what was measured before it is in {args.json}"
    if stopped:
        raise Interrupted(signum, f"({where})") from None
    raise PyhetError(f"{error}; {where}") from None


TIMEOUT_MAX = 7 * 86400   # --timeout at most a week (Python's clocks refuse ~2.1e6 s more)
STOP_GRACE_S = 5.0    # how long a child asked to stop may take before it is killed (less
#                       than the 10 s a time limit such as tools/gpu_check.sh's gives us)


def stop_child(p, grace: float = STOP_GRACE_S, own_group: bool = False) -> None:
    """Stop a child process and reap it: SIGTERM first, so that it ends as it would be asked
    to (mpiexec ends its ranks and removes its own files in /tmp and /dev/shm, which killing it
    left behind; pyhet removes its temporary files), then SIGKILL after `grace` seconds, or at
    once on a second interruption; own_group: it leads a process group of its own, which is
    killed with it."""
    import signal
    import subprocess

    try:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=grace)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    finally:
        if p.poll() is None:
            p.kill()
        if own_group:          # what it started (mpiexec's proxies and ranks) with it
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            p.communicate(timeout=5)
        except (subprocess.TimeoutExpired, KeyboardInterrupt, ValueError, OSError):
            pass


def run_json(cmd, timeout: "float | None", cwd, env=None, what: "str | None" = None,
             own_group: bool = False) -> dict:
    """The JSON summary a run of cmd prints last (env: this one's, without PYTHONPATH, when
    None); a PyhetError that says why (child_error) when it fails, runs past `timeout` seconds
    or prints no JSON. what: the run as messages name it (default: its command). own_group:
    cmd (an MPI job) runs in a process group of its own (else in ours, so that a time limit's
    signals to our group reach it too)."""
    import subprocess

    from pyhet.errors import PyhetError

    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    name = what or command_name(cmd)
    # an MPI job in a process group of its own: mpiexec ends its job's group with SIGTERM when
    # a rank fails, which reached the benchmark too (it said "interrupted", not the rank's
    # error); a Ctrl-C here reaches it through stop_child
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=cwd, start_new_session=own_group)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_child(p, own_group=own_group)
        raise PyhetError(f"{name} ran past --timeout ({timeout:g} s) and was stopped") from None
    except BaseException:      # Ctrl-C, SIGTERM: the child is stopped before we go
        stop_child(p, own_group=own_group)
        raise
    if p.returncode != 0:
        raise child_error(name, p.returncode, err)
    lines = out.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        raise PyhetError(f"{name} printed no JSON summary last: got "
                         f"{(lines or [''])[-1][:200]!r}") from None
