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
from .optim import SGDConfig

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
        try:
            from .backends.cuda import CudaBackend  # imports CuPy; raises DeviceError if unusable
        except ImportError as e:
            raise DeviceError(f"{spec}: no usable GPU ({e})") from None
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

    @property
    def k(self) -> int:
        return int(self.w.shape[0])


class Device:
    """A device that holds shards of conv layers and computes on its own worker thread.

    Work is submitted with a tag (the layer it belongs to); busy time is kept per tag, so the
    balancer can see each layer's cost on each device.
    """

    def __init__(self, name: str, spec: DeviceSpec, backend=None):
        self.name, self.spec = name, spec
        self.backend = backend if backend is not None else make_backend(spec)
        self.speed = spec.speed            # may be changed while training (emulation)
        self.busy_s = 0.0                  # work time (including emulated slowness) so far
        self.busy_by_tag: dict[str, float] = {}
        self._shards: dict[str, _Shard] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pyhet-{name}")
        self._lock = threading.Lock()

    def __repr__(self):
        return f"Device({self.name}, {self.spec})"

    @property
    def kind(self):
        return self.spec.kind

    @property
    def shares_host_memory(self) -> bool:
        """Whether this device computes on host arrays with the C++ core, so that devices of
        this kind in one process can share one im2col of their input and split the input
        gradient between them instead of each computing a part of all of it."""
        return self.spec.kind == "cpu"

    def close(self):
        self._pool.shutdown(wait=True)

    # --- running work -------------------------------------------------------------------------

    def submit(self, what: str, fn, *args, tag: str | None = None) -> Future:
        """Run fn(*args) on this device's worker; errors come back naming the device."""
        return self._pool.submit(self._run, what, tag, fn, *args)

    def call(self, what: str, fn, *args, tag: str | None = None):
        return self.submit(what, fn, *args, tag=tag).result()

    def _run(self, what, tag, fn, *args):
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as e:
            raise DeviceError(f"device {self.name} ({self.spec}) failed during {what}: "
                              f"{type(e).__name__}: {e}") from e
        took = time.perf_counter() - t0
        if self.speed < 1.0:  # emulate a slower device: idle (1/S - 1) times the work time
            time.sleep(took * (1.0 / self.speed - 1.0))
        busy = time.perf_counter() - t0
        with self._lock:
            self.busy_s += busy
            if tag is not None:
                self.busy_by_tag[tag] = self.busy_by_tag.get(tag, 0.0) + busy
        return result

    # --- shard messages (run on the worker) ---------------------------------------------------

    def load_shard(self, layer: str, w, b, vw=None, vb=None, pool: int = 2):
        """Install a shard: w (k, C, R, S), b (k,) and their momentum (None: not started)."""
        be = self.backend
        # copies: the shard is updated in place and must not alias the caller's arrays
        conv = (lambda a: None if a is None else be.asarray(np.array(a, np.float32)))
        self._shards[layer] = _Shard(conv(w), conv(b), conv(vw), conv(vb), pool)

    def get_shard(self, layer: str):
        """(w, b, vw, vb) of the shard as host arrays (vw, vb None before the first step)."""
        s = self._shards[layer]
        host = (lambda a: None if a is None else np.array(self.backend.to_host(a)))
        return host(s.w), host(s.b), host(s.vw), host(s.vb)

    def drop_shard(self, layer: str):
        self._shards.pop(layer, None)

    def im2col_part(self, x, R, S, col, channels):
        """Fill the rows of input channels [c0, c1) of a host im2col matrix shared by the
        devices of this process."""
        self.backend.im2col_part(x, R, S, col, channels)

    def conv_forward(self, layer: str, x, col=None):
        """x (N, C, H, W) host -> out (N, k, PH, PW) host. col: x's im2col matrix, if shared."""
        s, be = self._shards[layer], self.backend
        s.x_shape = x.shape
        if s.k == 0:
            s.saved = s.col = None
            return np.zeros((x.shape[0], 0) + self._pooled_hw(x.shape, s), np.float32)
        if col is None:
            col = be.im2col(be.asarray(x), s.w.shape[2], s.w.shape[3], key=layer)
        s.col = col
        out, s.saved = be.block_forward(col, x.shape, s.w, s.b, s.pool, key=layer)
        return be.to_host(out)

    @staticmethod
    def _pooled_hw(x_shape, s):
        oh, ow = x_shape[2] - s.w.shape[2] + 1, x_shape[3] - s.w.shape[3] + 1
        return (oh - s.pool) // s.pool + 1, (ow - s.pool) // s.pool + 1

    def conv_backward(self, layer: str, dout, dx_mode: str):
        """dout (N, k, PH, PW) host -> keeps dw, db; and for the layer's input gradient:
        dx_mode "none": nothing; "own": this shard's part of dx (N, C, H, W), host;
        "shared": (w (k, C*R*S), dy (k, N*OH*OW)) for input_grad_part on the devices that share
        host memory."""
        s, be = self._shards[layer], self.backend
        if s.k == 0:
            s.dw, s.db = be.asarray(np.zeros(s.w.shape, np.float32)), be.asarray(
                np.zeros(0, np.float32))
            return None
        dout = be.asarray(dout)
        if dx_mode == "shared":
            dy = be.block_grad_output(dout, s.saved)
            s.dw, s.db = be.block_grad_params(dy, s.col, s.w)
            result = (s.w.reshape(s.k, -1), dy)
        else:
            dcol, s.dw, s.db = be.block_backward(dout, s.saved, s.col, s.w, dx_mode == "own")
            result = None
            if dx_mode == "own":
                result = be.to_host(be.col2im(dcol, s.x_shape, s.w.shape[2], s.w.shape[3]))
        s.saved = s.col = None
        return result

    def input_grad_part(self, parts, dcol, dx, R, S, channels):
        """Channels [c0, c1) of a layer's input gradient from all host shards (see CpuBackend)."""
        self.backend.input_grad_part(parts, dcol, dx, R, S, channels)

    def sgd_step(self, layer: str, cfg: SGDConfig):
        s, be = self._shards[layer], self.backend
        s.vw = be.sgd_update(s.w, s.dw, s.vw, cfg)
        s.vb = be.sgd_update(s.b, s.db, s.vb, cfg)
        s.dw = s.db = None


def make_devices(specs: list[DeviceSpec]) -> list[Device]:
    return [Device(f"d{i}", s) for i, s in enumerate(specs)]


# ================================================================================================
# Calibration: each device's speed on the real layer shapes.


@dataclass(frozen=True)
class LayerGeometry:
    """One conv block of the network at a batch size: input x (N, C, H, W), K kernels of R x S."""
    name: str
    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    pool: int = 2

    @property
    def positions(self) -> int:  # N * OH * OW
        return self.N * (self.H - self.R + 1) * (self.W - self.S + 1)

    def bytes_per_kernel(self) -> int:
        """Weights, gradient and momentum of a kernel, and its conv output and gradient."""
        return 4 * (3 * self.C * self.R * self.S + 2 * self.positions)

    def fixed_bytes(self) -> int:
        """The input, its im2col matrix and that matrix's gradient."""
        return 4 * (2 * self.C * self.R * self.S * self.positions + 2 * self.N * self.C *
                    self.H * self.W)


@dataclass
class Calibration:
    """Per layer and device: kernels per second, fixed overhead per step (s), memory cap."""
    speeds: dict      # layer -> [kernels/s per device]
    overheads: dict   # layer -> [s per device]
    caps: dict        # layer -> [max kernels per device]

    def as_dict(self, devices) -> dict:
        return {layer: {d.name: {"kernels_per_s": round(self.speeds[layer][i], 3),
                                 "overhead_s": round(self.overheads[layer][i], 6),
                                 "memory_cap": self.caps[layer][i]}
                        for i, d in enumerate(devices)} for layer in self.speeds}


def _trial_kernels(device: Device, K: int) -> int:
    # enough kernels for the GEMMs to run at speed; more on a GPU, whose fixed costs are higher
    return max(1, min(K, 256 if device.kind == "gpu" else 32))


def _time_block(device: Device, g: LayerGeometry, k: int, x, rng) -> float:
    """Seconds for one forward and backward of k kernels of layer g on the device (as the
    device's own work, emulated slowness included)."""
    layer = f"calibrate/{g.name}"
    w = (rng.standard_normal((k, g.C, g.R, g.S)) * 0.1).astype(np.float32)
    device.call("calibration", device.load_shard, layer, w, np.zeros(k, np.float32), None, None,
                g.pool)
    oh, ow = g.H - g.R + 1, g.W - g.S + 1
    dout = np.ones((g.N, k, (oh - g.pool) // g.pool + 1, (ow - g.pool) // g.pool + 1),
                   np.float32)
    t0 = device.busy_s
    device.call("calibration", device.conv_forward, layer, x)
    device.call("calibration", device.conv_backward, layer, dout, "own")
    took = device.busy_s - t0
    device.call("calibration", device.drop_shard, layer)
    return took


def calibrate_device(device: Device, g: LayerGeometry, seed: int = 0):
    """(kernels/s, overhead s, memory cap) of one device on layer g, from a warm, short run:
    t(k) = overhead + k / speed fitted through two kernel counts, the best of two runs each."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((g.N, g.C, g.H, g.W)).astype(np.float32)
    kb = _trial_kernels(device, g.K)
    ka = max(1, kb // 2)
    _time_block(device, g, kb, x, rng)  # warm-up: page faults, thread pools, GPU kernels
    tb = min(_time_block(device, g, kb, x, rng) for _ in range(2))
    if ka == kb:
        speed, overhead = kb / tb, 0.0
    else:
        ta = min(_time_block(device, g, ka, x, rng) for _ in range(2))
        slope = (tb - ta) / (kb - ka)
        overhead = tb - kb * slope
        if slope <= 0 or not 0 <= overhead < 0.9 * tb:  # timing noise: no usable fit
            speed, overhead = kb / tb, 0.0
        else:
            speed = 1.0 / slope
    free = device.backend.free_memory() if hasattr(device.backend, "free_memory") else None
    cap = g.K if free is None else int(max(0, free * 0.8 - g.fixed_bytes()) //
                                       g.bytes_per_kernel())
    return speed, overhead, min(g.K, cap)


def calibrate(devices, geometries, seed: int = 0) -> Calibration:
    """Calibrate every device on every layer, the devices at once (as they will run)."""
    speeds, overheads, caps = {}, {}, {}
    for g in geometries:
        with ThreadPoolExecutor(max_workers=len(devices)) as pool:
            results = list(pool.map(lambda d: calibrate_device(d, g, seed), devices))
        speeds[g.name] = [r[0] for r in results]
        overheads[g.name] = [r[1] for r in results]
        caps[g.name] = [r[2] for r in results]
    return Calibration(speeds, overheads, caps)
