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
# Backends


def make_backend(spec: DeviceSpec):
    if spec.kind == "cpu":
        from .backends.cpu import CpuBackend
        return CpuBackend(spec.threads)
    if spec.kind == "numpy":
        from .backends.numpy_ref import NumpyBackend
        return NumpyBackend()
    if spec.kind == "gpu":
        from .backends.cuda import CudaBackend  # CuPy is imported only here

        return CudaBackend(spec.arg or 0)  # a DeviceError says what is missing
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
    """Device objects d0, d1, ... for the specs, all in this process."""
    for s in specs:
        if s.rank not in (None, 0):
            raise DeviceError(f"device {s} is placed on MPI rank {s.rank}, but this run has "
                              f"only rank 0 (devices on other ranks need mpiexec and the MPI "
                              f"transport, which this version does not have yet)")
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
    # enough kernels for the GEMMs to run at speed and to outweigh the fixed costs; more on a
    # GPU, whose fixed costs are higher
    return max(1, min(K, 256 if device.kind == "gpu" else 64))


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


def calibrate(devices, geometries, seed: int = 0, rounds: int = 3) -> Calibration:
    """Each device's speed on each layer, from a warm, short run on the real shapes.

    The devices are timed one at a time (so that devices sharing cores or memory bandwidth do
    not disturb each other), in rounds (d0 d1 ... d0 d1 ...) after two warm-up runs each, and
    the best time of each is kept, so that a drift of the machine hits all of them alike.

    A device of the host group does all its work (its kernels, and its shares of the im2col and
    of the input gradient) at its own pace, so its time is taken as proportional to its share:
    speed = k / t(k), no overhead. Another device (a GPU) also pays fixed costs whatever its
    share (moving the layer's input and output, its own im2col): t(k) = overhead + k / speed is
    fitted through two kernel counts.
    """
    rng = np.random.default_rng(seed)
    speeds, overheads, caps = {}, {}, {}
    for g in geometries:
        x = rng.standard_normal((g.N, g.C, g.H, g.W)).astype(np.float32)
        trials = []  # (device index, kernels)
        for i, d in enumerate(devices):
            kb = _trial_kernels(d, g.K)
            trials.append((i, kb))
            if not d.shares_host_memory and kb // 4 >= 1 and kb // 4 < kb:
                trials.append((i, kb // 4))
        for i, k in trials:  # warm-up: page faults, thread pools, GPU kernels, clocks
            for _ in range(2):
                _time_block(devices[i], g, k, x, rng)
        best = {t: float("inf") for t in trials}
        for _ in range(rounds):
            for i, k in trials:
                best[(i, k)] = min(best[(i, k)], _time_block(devices[i], g, k, x, rng))
        speeds[g.name], overheads[g.name], caps[g.name] = [], [], []
        for i, d in enumerate(devices):
            kb = _trial_kernels(d, g.K)
            tb = best[(i, kb)]
            speed, overhead = kb / tb, 0.0
            if (i, kb // 4) in best and kb // 4 < kb:
                ka, ta = kb // 4, best[(i, kb // 4)]
                slope = (tb - ta) / (kb - ka)
                if slope > 0 and 0 <= tb - kb * slope < 0.9 * tb:  # else noise: keep k / t
                    speed, overhead = 1.0 / slope, tb - kb * slope
            free = d.backend.free_memory() if hasattr(d.backend, "free_memory") else None
            cap = g.K if free is None else int(max(0, free * 0.8 - g.fixed_bytes()) //
                                               g.bytes_per_kernel())
            speeds[g.name].append(speed)
            overheads[g.name].append(overhead)
            caps[g.name].append(min(g.K, cap))
    return Calibration(speeds, overheads, caps)


# ================================================================================================
# `pyhet devices`

INPUT_SHAPES = {"bundled": (1, 28, 28), "fashion-mnist": (1, 28, 28), "mnist": (1, 28, 28),
                "cifar10": (3, 32, 32), "synthetic": (3, 32, 32)}


def _input_shape(dataset: str):
    if dataset in INPUT_SHAPES:
        return INPUT_SHAPES[dataset]
    from .data import load_dataset  # npz: the shape is in the file

    return load_dataset(dataset).input_shape


def describe_devices(spec: str, kernels, kernel_size: int, dataset: str, batch: int,
                     calibrate_them: bool = True) -> dict:
    """The host, the GPUs, and the devices of `spec` with their calibrated speed on the network
    (and the partition calibration gives)."""
    from .backends.numpy_ref import host_available_memory
    from .model import NetShape
    from .partition import balanced

    gpus = []
    try:
        from .backends.cuda import describe_gpus

        gpus = describe_gpus()
    except DeviceError as e:
        gpus = [{"error": str(e)}]
    avail = host_available_memory()
    report = {"host": {"cores": ops.default_threads(), "openmp": ops.have_openmp(),
                       "gemm_kernel": ops.gemm_kernel(),
                       "memory_available_gib": (avail or 0) / 2**30},
              "gpus": gpus}
    try:
        shape = NetShape(_input_shape(dataset), tuple(kernels), kernel_size, 10)
    except ValueError as e:
        raise DeviceError(str(e)) from None
    report["network"] = {"kernels": list(kernels), "kernel_size": kernel_size,
                         "input_shape": list(shape.input_shape), "batch_size": batch}
    specs = parse_devices(spec, gpu_count=cuda_device_count)
    check_threads(specs)
    devices = make_devices(specs)
    try:
        report["devices"] = [{"name": d.name, "spec": str(d.spec), "kind": d.kind,
                              "emulated_speed": d.spec.speed if d.spec.speed != 1 else None}
                             for d in devices]
        report["calibration"] = report["partition"] = None
        if calibrate_them:
            geoms = shape.geometries(batch)
            cal = calibrate(devices, geoms)
            report["calibration"] = cal.as_dict(devices)
            report["partition"] = {
                g.name: dict(zip([d.name for d in devices],
                                 balanced(g.K, cal.speeds[g.name], cal.overheads[g.name],
                                          cal.caps[g.name]))) for g in geoms}
    finally:
        for d in devices:
            d.close()
    return report
