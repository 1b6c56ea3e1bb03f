"""Devices: SPEC parsing, and Device objects that hold shards of conv layers.

A device receives NumPy arrays and returns NumPy arrays, keeps its own state (its shard of each
conv layer's kernels: weights, biases, momentum, and what the backward needs), and runs its
work on its own worker thread, so that several devices compute at once (the C++ core and CuPy
release the GIL). Its methods are coarse messages (load a shard, forward, backward, step, read
back), so that a device in another process or on another machine fits behind the same
interface.

SPEC grammar (see README): a comma-separated list of entries ``[R/]KIND[:ARG][@S]`` with KIND
``cpu`` (ARG: threads, default all cores), ``numpy``, ``gpu`` (ARG: CUDA device number,
default 0), or ``auto``; ``@S`` (0 < S <= 1) emulates a device S times as fast.
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from . import ops
from .errors import DeviceError
from .optim import SGDConfig, sgd_update

KINDS = ("cpu", "numpy", "gpu", "auto")


# ================================================================================================
# SPEC parsing


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
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def check_threads(specs: list[DeviceSpec]) -> None:
    """Warn when the cpu devices ask for more threads than this process has cores."""
    total = sum(s.threads for s in specs if s.kind == "cpu")
    cores = ops.default_threads()
    if total > cores:
        warnings.warn(f"the cpu devices use {total} threads in all but this process may run on "
                      f"{cores} cores: they will compete for them", RuntimeWarning, stacklevel=2)


# ================================================================================================
# Backends


def make_backend(spec: DeviceSpec):
    if spec.kind == "cpu":
        from .backends.cpu import CpuBackend
        return CpuBackend(spec.threads)
    if spec.kind == "numpy":
        from .backends.numpy_ref import NumpyBackend
        return NumpyBackend()
    if spec.kind == "gpu":
        from .backends.cuda import CudaBackend  # imports CuPy; raises DeviceError if unusable
        return CudaBackend(spec.arg or 0)
    raise DeviceError(f"unknown device kind {spec.kind!r}")


# ================================================================================================
# Device


class _Shard:
    """One device's share of a conv layer: kernels [k0, k1) with their momentum."""

    def __init__(self, w, b, vw, vb, pool):
        self.w, self.b, self.vw, self.vb, self.pool = w, b, vw, vb, pool
        self.dw = self.db = None
        self.saved = self.col = self.x_shape = None


class Device:
    """A device that holds shards of conv layers and computes on its own worker thread."""

    def __init__(self, name: str, spec: DeviceSpec, backend=None):
        self.name, self.spec = name, spec
        self.backend = backend if backend is not None else make_backend(spec)
        self.speed = spec.speed            # may be changed while training (emulation)
        self.busy_s = 0.0                  # work time (including emulated slowness) so far
        self._shards: dict[str, _Shard] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pyhet-{name}")
        self._lock = threading.Lock()

    def __repr__(self):
        return f"Device({self.name}, {self.spec})"

    @property
    def kind(self):
        return self.spec.kind

    @property
    def shares_host_col(self) -> bool:
        """Whether this device can take an im2col matrix computed on the host."""
        return self.spec.kind == "cpu"

    def close(self):
        self._pool.shutdown(wait=True)

    # --- running work -------------------------------------------------------------------------

    def submit(self, what: str, fn, *args) -> Future:
        """Run fn(*args) on this device's worker; errors come back naming the device."""
        return self._pool.submit(self._run, what, fn, *args)

    def call(self, what: str, fn, *args):
        return self.submit(what, fn, *args).result()

    def _run(self, what, fn, *args):
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as e:
            raise DeviceError(f"device {self.name} ({self.spec}) failed during {what}: "
                              f"{type(e).__name__}: {e}") from e
        took = time.perf_counter() - t0
        if self.speed < 1.0:  # emulate a slower device: idle (1/S - 1) times the work time
            time.sleep(took * (1.0 / self.speed - 1.0))
        with self._lock:
            self.busy_s += time.perf_counter() - t0
        return result

    # --- shard messages (run on the worker) ---------------------------------------------------

    def load_shard(self, layer: str, w, b, vw=None, vb=None, pool: int = 2):
        """Install a shard: w (k, C, R, S), b (k,) and their momentum (None: not started)."""
        be = self.backend
        conv = (lambda a: None if a is None else be.asarray(a))
        self._shards[layer] = _Shard(be.asarray(w), be.asarray(b), conv(vw), conv(vb), pool)

    def get_shard(self, layer: str):
        """(w, b, vw, vb) of the shard as host arrays (vw, vb None before the first step)."""
        s = self._shards[layer]
        host = (lambda a: None if a is None else np.array(self.backend.to_host(a)))
        return host(s.w), host(s.b), host(s.vw), host(s.vb)

    def drop_shard(self, layer: str):
        self._shards.pop(layer, None)

    def conv_forward(self, layer: str, x, col=None):
        """x (N, C, H, W) host -> out (N, k, PH, PW) host. col: x's im2col matrix, if shared."""
        s, be = self._shards[layer], self.backend
        R, S = s.w.shape[2], s.w.shape[3]
        s.x_shape = x.shape
        if col is None:
            col = be.im2col(be.asarray(x), R, S, key=layer)
        s.col = col
        if s.w.shape[0] == 0:
            s.saved = None
            return np.zeros((x.shape[0], 0) + self._pooled_hw(x.shape, s), np.float32)
        out, s.saved = be.block_forward(col, x.shape, s.w, s.b, s.pool, key=layer)
        return be.to_host(out)

    @staticmethod
    def _pooled_hw(x_shape, s):
        oh, ow = x_shape[2] - s.w.shape[2] + 1, x_shape[3] - s.w.shape[3] + 1
        return (oh - s.pool) // s.pool + 1, (ow - s.pool) // s.pool + 1

    def conv_backward(self, layer: str, dout, need_dcol: bool):
        """dout (N, k, PH, PW) host -> this shard's part of dcol (host) or None; keeps dw, db."""
        s, be = self._shards[layer], self.backend
        if s.w.shape[0] == 0:
            s.dw, s.db = be.asarray(np.zeros(s.w.shape, np.float32)), be.asarray(
                np.zeros(0, np.float32))
            return None
        dcol, s.dw, s.db = be.block_backward(be.asarray(dout), s.saved, s.col, s.w, need_dcol)
        s.saved = s.col = None
        return None if dcol is None else be.to_host(dcol)

    def sgd_step(self, layer: str, cfg: SGDConfig):
        s = self._shards[layer]
        s.vw = sgd_update(s.w, s.dw, s.vw, cfg)
        s.vb = sgd_update(s.b, s.db, s.vb, cfg)
        s.dw = s.db = None


def make_devices(specs: list[DeviceSpec]) -> list[Device]:
    return [Device(f"d{i}", s) for i, s in enumerate(specs)]
