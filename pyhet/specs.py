"""The device SPEC grammar and the table of device kinds.

A SPEC is a comma-separated list of entries ``[R/]KIND[:ARG][@S]`` with KIND ``cpu`` (ARG:
threads, default all cores), ``numpy``, ``gpu`` (ARG: CUDA device number, default 0), or
``auto`` (every GPU plus one cpu device with the remaining cores); ``@S`` (0 < S <= 1) emulates
a device S times as fast; ``R/`` places the entry on MPI rank R.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace

from . import ops
from .errors import DeviceError

KINDS = ("cpu", "numpy", "gpu", "auto")


@dataclass(frozen=True)
class DeviceSpec:
    kind: str                 # "cpu", "numpy" or "gpu"
    arg: int | None = None    # threads for cpu, device number for gpu
    speed: float = 1.0        # emulated relative speed, 0 < speed <= 1
    rank: int | None = None   # MPI rank it lives on; None: every rank

    @property
    def threads(self) -> int:
        return self.arg if self.kind == "cpu" and self.arg else (
            ops.default_threads() if self.kind == "cpu" else 1)

    def __str__(self):
        s = {"cpu": f"cpu:{self.threads}", "numpy": "numpy", "gpu": f"gpu:{self.arg or 0}"}
        text = s[self.kind] + (f"@{self.speed:g}" if self.speed != 1.0 else "")
        return (f"{self.rank}/" if self.rank is not None else "") + text


_ENTRY = re.compile(r"^(?:(?P<rank>\d+)/)?(?P<kind>[a-z]+)(?::(?P<arg>[^@]*))?"
                    r"(?:@(?P<speed>.*))?$")


def parse_devices(spec: str, gpu_count=None) -> list[DeviceSpec]:
    """Parse a device SPEC into a list of DeviceSpec; ``auto`` expands to every GPU plus one
    cpu device with the remaining cores. gpu_count: a function giving the number of GPUs
    (called only for ``auto``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise DeviceError("empty device SPEC: expected e.g. 'cpu:1,cpu:1', 'numpy', 'gpu:0' "
                          "or 'auto'")
    out: list[DeviceSpec] = []
    for raw in spec.split(","):
        entry = raw.strip()
        m = _ENTRY.match(entry)
        if not m:
            raise DeviceError(f"device SPEC entry {entry!r} is not of the form "
                              f"[RANK/]KIND[:ARG][@SPEED], e.g. 'cpu:2' or '1/gpu:0@0.5'")
        kind, arg, speed_s, rank_s = m["kind"], m["arg"], m["speed"], m["rank"]
        if kind not in KINDS:
            raise DeviceError(f"unknown device kind {kind!r} in {entry!r}: expected one of "
                              f"{', '.join(KINDS)}")
        speed = 1.0
        if speed_s is not None:
            try:
                speed = float(speed_s)
            except ValueError:
                speed = float("nan")
            if not 0 < speed <= 1:
                raise DeviceError(f"speed in {entry!r} must be a number with 0 < S <= 1, "
                                  f"got {speed_s!r}")
        rank = int(rank_s) if rank_s is not None else None
        n = None
        if arg is not None:
            if kind in ("numpy", "auto"):
                raise DeviceError(f"{kind!r} takes no argument, got {entry!r}")
            if not arg.isdigit():
                raise DeviceError(f"{entry!r}: the argument of {kind!r} must be a whole number "
                                  f"(threads for cpu, device number for gpu), got {arg!r}")
            n = int(arg)
            if kind == "cpu" and n < 1:
                raise DeviceError(f"{entry!r}: a cpu device needs at least 1 thread")
        if kind == "auto":
            out.extend(replace(d, speed=speed, rank=rank) for d in _auto(gpu_count))
        else:
            out.append(DeviceSpec(kind, n if kind == "cpu" else (n or 0) if kind == "gpu"
                                  else None, speed, rank))
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


def check_threads(specs: list[DeviceSpec]) -> None:
    """Warn when the cpu devices ask for more threads than this process has cores."""
    total = sum(s.threads for s in specs if s.kind == "cpu")
    cores = ops.default_threads()
    if total > cores:
        warnings.warn(f"the cpu devices use {total} threads in all but this process may run on "
                      f"{cores} cores: they will compete for them", RuntimeWarning, stacklevel=2)


# ================================================================================================
# Placement on MPI ranks


def check_ranks(specs: list[DeviceSpec], world_size: int) -> None:
    """Every R/ entry must name a rank of the job (0 .. world_size - 1)."""
    for s in specs:
        if s.rank is None or s.rank < world_size:
            continue
        if world_size == 1:
            raise DeviceError(f"device {s} is placed on MPI rank {s.rank}, but this run is one "
                              f"process (rank 0): start it with mpiexec -n {s.rank + 1} pyhet "
                              f"... (pip install 'pyhet[mpi]' brings mpiexec)")
        raise DeviceError(f"device {s} is placed on MPI rank {s.rank}, but the job has "
                          f"{world_size} ranks (0..{world_size - 1}): start it with mpiexec -n "
                          f"{s.rank + 1}, or place the device on another rank")


def for_rank(specs: list[DeviceSpec], rank: int) -> list[DeviceSpec]:
    """The devices placed on `rank`: its R/ entries and every entry without a prefix, in order,
    with their rank set."""
    return [replace(s, rank=rank) for s in specs if s.rank is None or s.rank == rank]

