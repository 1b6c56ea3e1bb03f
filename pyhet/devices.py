"""The Device: shards of conv layers, coarse messages, and its own worker thread.

A device receives NumPy arrays and returns NumPy arrays, keeps its own state (its shard of each
conv layer's kernels: weights, biases, momentum, and what the backward needs), and runs its
work on its own worker thread, so that several devices compute at once (the C++ core and CuPy
release the GIL). Its methods are coarse messages (load a shard, forward, backward, step, read
back), so that a device in another process or on another machine fits behind the same
interface. Each shard knows its layer's geometry (pyhet.geometry), so the messages carry only
arrays.

Letters as in pyhet.geometry: x (N, C, H, W), a shard of k kernels w (k, C, R, S), its output
(N, k, PH, PW).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .errors import DeviceError
from .geometry import ConvGeometry
from .optim import SGDConfig
from .specs import DeviceSpec


# ================================================================================================
# Backends (imported when a device of their kind is made: CuPy only for a gpu)


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

    def __init__(self, g: ConvGeometry, w, b, vw, vb):
        self.g, self.w, self.b, self.vw, self.vb = g, w, b, vw, vb
        self.dw = self.db = None
        self.saved = self.col = self.x_shape = None

    @property
    def k(self) -> int:
        return int(self.w.shape[0])


def _quiet_float_errors():
    """NumPy's warnings of overflow and NaN, off on a device's worker: a run that diverges is
    stopped by the checks of the loss and the weights, which say what happened in one line."""
    np.seterr(over="ignore", invalid="ignore", divide="ignore")


class Device:
    """A device that holds shards of conv layers and computes on its own worker thread.

    Work is submitted with a tag (the layer it belongs to); busy time is kept per tag, so the
    balancer can see each layer's cost on each device.
    """

    emulates = True   # applies its own @S slowness (a device on another rank: that rank does)

    def __init__(self, name: str, spec: DeviceSpec, backend=None):
        self.name, self.spec = name, spec
        self.backend = backend if backend is not None else make_backend(spec)
        self.speed = spec.speed            # may be changed while training (emulation)
        self.busy_s = 0.0                  # work time (including emulated slowness) so far
        self.busy_by_tag: dict[str, float] = {}
        self._shards: dict[str, _Shard] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pyhet-{name}",
                                        initializer=_quiet_float_errors)
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

    def free_memory(self):
        """Bytes this device can still allocate, or None if unknown."""
        return self.backend.free_memory()

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
        if self.speed < 1.0 and self.emulates:  # a slower device: idle (1/S - 1) times the work
            time.sleep(took * (1.0 / self.speed - 1.0))
        busy = time.perf_counter() - t0
        with self._lock:
            self.busy_s += busy
            if tag is not None:
                self.busy_by_tag[tag] = self.busy_by_tag.get(tag, 0.0) + busy
        return result

    # --- shard messages (run on the worker) ---------------------------------------------------

    def load_shard(self, layer: str, g: ConvGeometry, w, b, vw=None, vb=None):
        """Install a shard of layer g: w (k, C, R, S), b (k,) and their momentum (None: not
        started)."""
        be = self.backend
        # copies: the shard is updated in place and must not alias the caller's arrays
        conv = (lambda a: None if a is None else be.asarray(np.array(a, np.float32)))
        self._shards[layer] = _Shard(g, conv(w), conv(b), conv(vw), conv(vb))

    def get_shard(self, layer: str, lo=None, hi=None):
        """(w, b, vw, vb) of the shard, or of its kernels [lo, hi), as host arrays (vw, vb None
        before the first step)."""
        s = self._shards[layer]
        lo, hi = (0 if lo is None else lo), (s.k if hi is None else hi)
        host = (lambda a: None if a is None else np.array(self.backend.to_host(a[lo:hi])))
        return host(s.w), host(s.b), host(s.vw), host(s.vb)

    def reshard(self, layer: str, keep_lo: int, keep_hi: int, before=None, after=None):
        """The shard becomes `before` + its own kernels [keep_lo, keep_hi) + `after` (each a
        (w, b, vw, vb) of host arrays, or None): a repartition that moves only the kernels
        that change owner."""
        kept = self.get_shard(layer, keep_lo, keep_hi)
        w, b, vw, vb = join_states([p for p in (before, kept, after) if p is not None])
        self.load_shard(layer, self._shards[layer].g, w, b, vw, vb)

    def drop_shard(self, layer: str):
        self._shards.pop(layer, None)

    def im2col_part(self, x, g: ConvGeometry, col, channels):
        """Fill the rows of input channels [c0, c1) of a host im2col matrix shared by the
        devices of this process."""
        self.backend.im2col_part(x, g, col, channels)

    def conv_forward(self, layer: str, x, col=None):
        """x (N, C, H, W) host -> out (N, k, PH, PW) host. col: x's im2col matrix, if shared."""
        s, be = self._shards[layer], self.backend
        s.x_shape = x.shape
        if s.k == 0:
            s.saved = s.col = None
            return np.zeros(s.g.out_batch_shape(0, x.shape[0]), np.float32)
        if col is None:
            col = be.im2col(be.asarray(x), s.g, key=layer)
        s.col = col
        out, s.saved = be.block_forward(col, x.shape, s.w, s.b, s.g, key=layer)
        return be.to_host(out)

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
                result = be.to_host(be.col2im(dcol, s.x_shape, s.g))
        s.saved = s.col = None
        return result

    def input_grad_part(self, parts, dcol, dx, g: ConvGeometry, channels):
        """Channels [c0, c1) of a layer's input gradient from all host shards (see CpuBackend)."""
        self.backend.input_grad_part(parts, dcol, dx, g, channels)

    def sgd_step(self, layer: str, cfg: SGDConfig):
        s, be = self._shards[layer], self.backend
        s.vw = be.sgd_update(s.w, s.dw, s.vw, cfg)
        s.vb = be.sgd_update(s.b, s.db, s.vb, cfg)
        s.dw = s.db = None


def join_states(parts):
    """(w, b, vw, vb) of consecutive shards joined; momentum None where none of them has
    started, else zeros for those that have not."""
    w, b = (np.concatenate([p[i] for p in parts]) for i in (0, 1))
    if all(p[2] is None for p in parts):
        return w, b, None, None
    vw, vb = (np.concatenate([p[i] if p[i] is not None else np.zeros_like(p[i - 2])
                              for p in parts]) for i in (2, 3))
    return w, b, vw, vb


def make_devices(specs: list[DeviceSpec], names=None) -> list[Device]:
    """Device objects for the specs, all in this process, named d0, d1, ... or `names`. If one
    cannot be made, those made before it are closed (no worker thread is left behind)."""
    names = names if names is not None else [f"d{i}" for i in range(len(specs))]
    devices: list[Device] = []
    try:
        for name, s in zip(names, specs):
            devices.append(Device(name, s))
    except BaseException:
        for d in devices:
            d.close()
        raise
    return devices
