"""The device SPEC grammar and the table of device kinds.

A SPEC is a comma-separated list of entries ``[R/]KIND[:ARG][@S]`` with KIND ``cpu`` (ARG:
threads, default all cores), ``numpy``, ``gpu`` (ARG: CUDA device number, default 0), or
``auto`` (every GPU plus one cpu device with the remaining cores); ``@S`` (0.001 <= S <= 1)
emulates a device S times as fast; ``R/`` places the entry on MPI rank R. Numbers are written
in ASCII digits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from . import ops
from .errors import DeviceError, DeviceSpecError, shown, warn

KINDS = ("cpu", "numpy", "gpu", "auto")
MIN_SPEED = 0.001    # @S: a device emulated a thousand times slower is far beyond any real mix


@dataclass(frozen=True)
class DeviceSpec:
    kind: str                 # "cpu", "numpy" or "gpu"
    arg: int | None = None    # threads for cpu, device number for gpu
    speed: float = 1.0        # emulated relative speed, MIN_SPEED <= speed <= 1
    rank: int | None = None   # MPI rank it lives on; None: every rank

    @property
    def threads(self) -> int:
        return self.arg if self.kind == "cpu" and self.arg else (
            ops.default_threads() if self.kind == "cpu" else 1)

    def __str__(self):
        s = {"cpu": f"cpu:{self.threads}", "numpy": "numpy", "gpu": f"gpu:{self.arg or 0}"}
        text = s[self.kind] + (f"@{self.speed:g}" if self.speed != 1.0 else "")
        return (f"{self.rank}/" if self.rank is not None else "") + text


# ASCII digits only (re's \d and str.isdigit() take any script's digits, and int() reads them)
_ENTRY = re.compile(r"^(?:(?P<rank>[0-9]+)/)?(?P<kind>[a-z]+)(?::(?P<arg>[^@]*))?"
                    r"(?:@(?P<speed>.*))?$", re.ASCII)
_WHOLE = re.compile(r"[0-9]+", re.ASCII)
_NUMBER = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9]+\.", re.ASCII)


# The most devices one SPEC names (each runs a thread): more cores than any machine here has;
# 20,001 of them ran for minutes before a step, and a thousand under a memory limit ran out
# of threads
MAX_DEVICES = 1024


def parse_devices(spec: str, gpu_count=None) -> list[DeviceSpec]:
    """Parse a device SPEC into a list of DeviceSpec; ``auto`` expands to every GPU plus one
    cpu device with the remaining cores. gpu_count: a function giving the number of GPUs
    (called only for ``auto``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise DeviceSpecError("empty device SPEC: expected e.g. 'cpu:1,cpu:1', 'numpy', "
                              "'gpu:0' or 'auto'")
    entries = spec.split(",")
    if len(entries) > MAX_DEVICES:
        raise DeviceSpecError(f"device SPEC of {len(entries):,} entries: at most {MAX_DEVICES} "
                              f"devices (one worker thread each) are run")
    out: list[DeviceSpec] = []
    for raw in entries:
        entry = raw.strip()
        m = _ENTRY.match(entry)
        if not m:
            raise DeviceSpecError(f"device SPEC entry {shown(entry)} is not of the form "
                                  f"[RANK/]KIND[:ARG][@SPEED], e.g. 'cpu:2' or '1/gpu:0@0.5'")
        kind, arg, speed_s, rank_s = m["kind"], m["arg"], m["speed"], m["rank"]
        if kind not in KINDS:
            raise DeviceSpecError(f"unknown device kind {shown(kind)} in {shown(entry)}: "
                                  f"expected one of {', '.join(KINDS)}")
        speed = 1.0
        if speed_s is not None:
            speed = float(speed_s) if _NUMBER.fullmatch(speed_s) else float("nan")
            if not MIN_SPEED <= speed <= 1:
                raise DeviceSpecError(f"speed in {shown(entry)} must be a number with "
                                      f"{MIN_SPEED:g} <= S <= 1, got {shown(speed_s)}")
        for what, digits in (("rank", rank_s), ("argument", arg)):
            # int() of 4,300 digits and more is a ValueError; no rank or count is that long
            if digits is not None and len(digits) > 18:
                raise DeviceSpecError(f"{shown(entry)}: the {what} has {len(digits)} digits; "
                                      f"expected at most 18")
        rank = int(rank_s) if rank_s is not None else None
        if rank is not None and rank > MAX_DEVICES:
            # (a rank that holds no device serves nothing: past MAX_DEVICES, one a rank, none
            # can hold one)
            raise DeviceSpecError(f"{shown(entry)}: rank {rank:,} is past any job of these "
                                  f"devices: at most {MAX_DEVICES} devices are run, so ranks "
                                  f"go up to {MAX_DEVICES}")
        n = None
        if arg is not None:
            if kind in ("numpy", "auto"):
                raise DeviceSpecError(f"{kind!r} takes no argument, got {shown(entry)}")
            if not _WHOLE.fullmatch(arg):
                raise DeviceSpecError(f"{shown(entry)}: the argument of {kind!r} must be a whole "
                                      f"number in ASCII digits (threads for cpu, device number "
                                      f"for gpu), got {shown(arg)}")
            n = int(arg)
            if kind == "cpu" and n < 1:
                raise DeviceSpecError(f"{shown(entry)}: a cpu device needs at least 1 thread")
            if kind == "cpu" and n > ops.MAX_THREADS:
                raise DeviceSpecError(f"{shown(entry)}: a cpu device takes at most "
                                      f"{ops.MAX_THREADS} threads, got {n}")
        if kind == "auto":
            out.extend(replace(d, speed=speed, rank=rank) for d in _auto(gpu_count))
        else:
            out.append(DeviceSpec(kind, n if kind == "cpu" else (n or 0) if kind == "gpu"
                                  else None, speed, rank))
    # the cpu devices' threads of one process (a rank's, or this one's) together: each is an
    # OpenMP team, and libgomp ends the process with its own message where it cannot make one
    for rank in {d.rank for d in out if d.rank is not None} or {None}:
        threads = sum(ops.default_threads() if d.arg is None else d.arg   # `cpu`: every core
                      for d in out if d.kind == "cpu" and d.rank in (rank, None))
        if threads > ops.MAX_THREADS:
            raise DeviceSpecError(f"{shown(spec)}: {threads:,} cpu threads in all"
                                  f"{'' if rank is None else f' on rank {rank}'}; at most "
                                  f"{ops.MAX_THREADS} are run in one process")
    # two devices on one GPU: each would count all of its memory as its own (an entry without
    # a rank is placed on every rank, so it clashes with the same GPU on any rank)
    gpus = [(d.rank, d.arg) for d in out if d.kind == "gpu"]
    for i, (rank, index) in enumerate(gpus):
        for other, same in gpus[i + 1:]:
            if same == index and (rank is None or other is None or rank == other):
                where = "" if rank is None and other is None else \
                    f" on rank {rank if rank is not None else other}"
                raise DeviceSpecError(f"gpu:{index}{where} is named more than once in "
                                      f"{shown(spec)}: a GPU can be one device only")
    return out


def _auto(gpu_count) -> list[DeviceSpec]:
    """Every GPU, plus one cpu device with the cores not needed to drive them."""
    gpus = gpu_count() if gpu_count is not None else 0
    cores = ops.default_threads()
    devs = [DeviceSpec("gpu", i) for i in range(gpus)]
    devs.append(DeviceSpec("cpu", max(1, cores - gpus)))
    return devs


def cuda_device_count() -> int:
    """The number of CUDA GPUs CuPy sees; 0 when CuPy or a driver is missing."""
    from .backends.cuda import gpu_count, import_cupy

    try:
        return gpu_count(import_cupy())
    except DeviceError:
        return 0


def cpu_threads(specs: list[DeviceSpec]) -> int:
    """The threads of the cpu devices: each one's, or one each in a core built without
    OpenMP."""
    one = not ops.have_openmp()
    return sum(1 if one else s.threads for s in specs if s.kind == "cpu")


def compute_threads(specs: list[DeviceSpec]) -> int:
    """The threads the devices compute with on this machine's cores: the cpu devices'
    (cpu_threads), a numpy device's one (its worker, whose NumPy calls may use more), a GPU's
    none (its worker waits on the GPU)."""
    return cpu_threads(specs) + sum(1 for s in specs if s.kind == "numpy")


def check_threads(specs: list[DeviceSpec], master: bool = True) -> None:
    """Warn when the cpu devices ask for more threads than this process has cores; raise a
    DeviceError when this process cannot start the threads its devices need at once (its
    limits: ulimit -u, or -v at a thread's stack), which libgomp would meet by ending the
    process: a cpu device's team of T (its worker and T - 1 OpenMP threads), another device's
    worker, and where this process is the master, the team of the master's own work (the fc
    layers, on every core). The threads are tried at the stack size each will have (an OpenMP
    thread's is OMP_STACKSIZE's where set); a limit used up later (by another process of the
    user, say) is not foreseen. A core built without OpenMP runs every cpu device on one
    thread: a cpu:N of N > 1 is said so."""
    cores = ops.default_threads()
    if not ops.have_openmp():
        # (those whose threads are given: the default cpu device, all cores, says nothing)
        wide = list(dict.fromkeys(str(s) for s in specs
                                  if s.kind == "cpu" and s.arg is not None and s.arg > 1))
        if wide:
            warn(f"this build of pyhet's core has no OpenMP: {', '.join(wide)} "
                 f"run{'s' if len(wide) == 1 else ''} on one thread (every kernel is "
                 f"single-threaded); give cpu:1 devices, or install a build with OpenMP")
    total = cpu_threads(specs)
    if total > cores:
        warn(f"the cpu devices use {total} threads in all but this process may run on "
             f"{cores} cores: they will compete for them")
    others = sum(1 for s in specs if s.kind != "cpu")   # their workers
    # the master's team, past this thread (none without OpenMP)
    own = cores - 1 if master and ops.have_openmp() else 0
    need = total + others + own
    # every device's worker at the default stack; the rest are OpenMP threads
    started = startable_threads(len(specs), openmp=need - len(specs))
    if started < need:
        parts = [f"{total:,} for the cpu devices"] + (
            [f"{others:,} for the other devices' workers"] if others else []) + (
            [f"{own:,} for the master's own work"] if own else [])
        what = (f"the devices need {need:,} threads at once ({', '.join(parts)})"
                if len(parts) > 1 else f"the cpu devices need {total:,} threads at once")
        raise DeviceError(f"{what}, but this process could start only {started:,} (see ulimit "
                          f"-u, and ulimit -v: {stack_reserved()}): give the cpu devices fewer "
                          f"(cpu:N)")


def stack_reserved() -> str:
    """How much address space a thread reserves, in words, for the messages on threads."""
    if ops.OPENMP_STACK_SIZE:
        size, name = ops.OPENMP_STACK_SIZE
        return (f"each OpenMP thread reserves {name}'s {size / 2**20:,.4g} MiB of stack, "
                f"another ulimit -s")
    return "each thread reserves ulimit -s of stack"


def startable_threads(n: int, openmp: int = 0) -> int:
    """How many of `n` threads of the default stack size (a device's worker), and `openmp` more
    of an OpenMP thread's (OMP_STACKSIZE's where set, else the default), this process can start
    and hold at once; all ended again. Made by the core as libgomp makes its threads, so that
    no setting of the process changes meanwhile."""
    stack = ops.OPENMP_STACK_SIZE[0] if ops.OPENMP_STACK_SIZE else 0
    return ops._core.startable_threads([(n, 0), (openmp, min(stack, 2**63 - 1))])


# ================================================================================================
# Placement on MPI ranks


def check_ranks(specs: list[DeviceSpec], world_size: int, command: str = "train") -> None:
    """Every R/ entry must name a rank of the job (0 .. world_size - 1). command: the pyhet
    command that checks (only `train` and `plan` run under mpiexec), or "Network" (the Python
    API, in one process), or "make_devices"."""
    for s in specs:
        if s.rank is None or s.rank < world_size:
            continue
        if command not in ("train", "plan"):
            who = {"Network": "a pyhet.Network", "make_devices": "pyhet.devices.make_devices"
                   }.get(command, f"pyhet {command}")
            raise DeviceSpecError(f"device {s} is placed on MPI rank {s.rank}, but {who} "
                                  f"runs in one process: give it this machine's "
                                  f"devices without R/ (only pyhet train and pyhet plan run under "
                                  f"mpiexec)")
        if world_size == 1:
            raise DeviceSpecError(f"device {s} is placed on MPI rank {s.rank}, but this run is "
                                  f"one process (rank 0): start it with mpiexec -n {s.rank + 1} "
                                  f"pyhet ... (pip install '.[mpi]' in pyhet's source folder "
                                  f"brings mpiexec)")
        raise DeviceSpecError(f"device {s} is placed on MPI rank {s.rank}, but the job has "
                              f"{world_size} ranks (0..{world_size - 1}): start it with mpiexec "
                              f"-n {s.rank + 1}, or place the device on another rank")


def for_rank(specs: list[DeviceSpec], rank: int) -> list[DeviceSpec]:
    """The devices placed on `rank`: its R/ entries and every entry without a prefix, in order,
    with their rank set."""
    return [replace(s, rank=rank) for s in specs if s.rank is None or s.rank == rank]

