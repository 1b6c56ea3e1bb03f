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

import os
import threading
import time
import weakref
from typing import Callable

import numpy as np

from . import ops
from .errors import DeviceError, UsageError, shown
from .faults import ENV as FAULT_ENV
from .faults import Fault, from_environment
from .geometry import ConvGeometry
from .optim import SGDConfig
from .partition import proportional
from .specs import (DeviceSpec, check_ranks, check_threads, cuda_device_count,
                    parse_devices)
from .workers import Work, Worker


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
        # col^T packed whole by the host group, for dw (or col's quadrants' sums packed for the
        # forward, read transposed: SharedCol.dw_operand); or None
        self.packed_col_t = None
        self.dw_reads_fwd = False  # packed_col_t is col packed for the forward, read transposed
        self.dw_elsewhere = False  # the host group makes dw with the input gradient (dw_out)
        self.staged = None     # (w, b, vw, vb) after an update not yet committed
        self.spare = None      # the buffers of the state before the last commit, reused
        self.spare_v = None    # (vw, vb) for the second update to write, made by the first

    @property
    def k(self) -> int:
        return int(self.w.shape[0])


def _waker(device) -> Callable[[], None]:
    """device.wake, without holding the device (its worker ends with it: pyhet.workers)."""
    ref = weakref.ref(device)

    def wake():
        d = ref()
        if d is not None:
            d.wake()
    return wake


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
    link = None       # its link to the master (pyhet.links.Link); None: in this process
    in_this_process = True   # computes here (not on another rank)

    def __init__(self, name: str, spec: DeviceSpec, backend=None):
        self.name, self.spec = name, spec
        self.backend = backend if backend is not None else make_backend(spec)
        self._sync = getattr(self.backend, "sync", None)   # a GPU's: wait for its queued work
        self.speed = spec.speed            # may be changed while training (emulation)
        self.busy_s = 0.0                  # work time (including emulated slowness) so far
        self.compute_s = 0.0               # of which computing (the rest: its link's messages)
        self.last_busy_s = 0.0             # the busy time of the newest finished piece of work
        self.busy_by_tag: dict[str, float] = {}
        self.compute_by_tag: dict[str, float] = {}   # of which computing, per tag
        self._shards: dict[str, _Shard] = {}
        self._pid = os.getpid()
        self._pool = self._new_pool()
        self._lock = threading.Lock()
        self.fault: Fault | None = None    # an injected fault (pyhet.faults), for testing
        self.step: int | None = None       # the training step under way (for the fault)
        self._woken = threading.Event()    # set: emulated slowness is skipped from now on
        try:
            self._start_team()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise

    def __repr__(self):
        return f"Device({self.name}, {self.spec})"

    @property
    def kind(self):
        return self.spec.kind

    # whether the device computes on the master's machine (a device of this process does; one
    # of another rank where that rank said so: pyhet.transport.mpi), so that it competes with
    # the master's devices for its cores and memory
    on_master_machine = True
    # whether the master's machine runs more cpu threads of the job than it has cores (ranks
    # sharing it: pyhet.transport.mpi), so that its devices take turns on the cores
    crowded = False

    @property
    def shares_host_memory(self) -> bool:
        """Whether this device computes on host arrays with the C++ core, so that devices of
        this kind in one process can share one im2col of their input and split the input
        gradient between them instead of each computing a part of all of it."""
        return self.spec.kind == "cpu"

    @property
    def group(self) -> str | None:
        """The devices with the same group share one im2col and split the input gradient
        (pyhet.devices.shared_im2col / shared_input_grad): those that share host memory in one
        process. None: this device does its own."""
        return "host" if self.shares_host_memory else None

    def free_memory(self):
        """Bytes this device can still allocate, or None if unknown. Read by the calling
        thread; a failure (a GPU's driver error) is a DeviceError naming the device."""
        try:
            return self.backend.free_memory()
        except Exception as e:
            err = DeviceError(f"device {self.name} ({self.spec}) failed reading its free "
                              f"memory: {type(e).__name__}: {e}")
            err.device, err.what = self, "free_memory"   # (no layer's: pyhet.failover)
            raise err from e

    def inject_fault(self, phase: str, step: int) -> None:
        """For testing: fail at the first work of `phase` at training step `step` or after,
        and in all step work from then on (pyhet.faults). A phase this device does not have
        as work of its own (fault_refusal), which would never fire, is refused."""
        fault = Fault(phase, step, "inject_fault", UsageError)
        # a device on another rank knows the devices of its rank (siblings), in the run's order
        refusal = fault_refusal(self, phase, list(getattr(self, "siblings", {}).values()))
        if refusal:
            raise UsageError(f"inject_fault: phase {phase!r}: {refusal}")
        self.fault = fault

    def close(self):
        """Stop the worker thread, first dropping the shards and the backend's cached memory
        (a GPU's pool blocks, and the pinned host buffers of its copies) on it; a device that
        failed may fail this too, and is stopped all the same."""
        if self._pid != os.getpid():    # forked: the worker is not here (nor its shards')
            return
        try:
            self._pool.submit(self._release).result()
        except Exception:
            pass
        finally:        # (Ctrl-C while waiting too)
            self._pool.shutdown(wait=True)

    def _release(self):
        for layer in list(self._shards):
            self.drop_shard(layer)
        free_cache = getattr(self.backend, "free_cache", None)
        if free_cache is not None:
            free_cache()

    def wake(self):
        """Cut short the idling of an emulated slow device (@S), now and from now on: a run
        that was asked to stop finishes its step at full speed."""
        self._woken.set()

    # --- running work -------------------------------------------------------------------------

    def submit(self, what: str, fn, *args, tag: str | None = None) -> Work:
        """Run fn(*args) on this device's worker; errors come back naming the device."""
        return self._on_worker(self._run, what, tag, fn, *args)

    def _new_pool(self) -> Worker:
        try:
            return Worker(f"pyhet-{self.name}", initializer=_quiet_float_errors,
                          wake=_waker(self))
        except RuntimeError as e:
            if "start new thread" not in str(e):
                raise
            # the machine's (or ulimit's) threads or memory for their stacks ran out
            raise DeviceError(f"device {self.name} ({self.spec}): its worker thread cannot be "
                              f"started ({e}): fewer devices, or a higher limit on threads "
                              f"and memory (ulimit -u, -v), are needed") from None

    def _after_fork(self) -> None:
        """In a process forked from the one that made this device (a multiprocessing.Pool's
        worker): the worker thread was not copied, and work handed to it waited forever. A cpu
        or numpy device makes its worker anew (a cpu device's team is one thread there,
        pyhet._core says why); a GPU or another rank cannot be reached from a forked process."""
        if self.spec.kind == "gpu" or not self.in_this_process:
            raise DeviceError(
                f"device {self.name} ({self.spec}) was made in process {self._pid} and cannot "
                f"be used in process {os.getpid()}, forked from it ("
                f"{'CUDA' if self.spec.kind == 'gpu' else 'MPI'} does not survive fork()): make "
                f"the network in this process, or start processes with multiprocessing's "
                f"'spawn' or 'forkserver' method")
        self._pid = os.getpid()
        self._pool = self._new_pool()
        self._lock = threading.Lock()
        self._start_team()

    def _start_team(self) -> None:
        start = getattr(self.backend, "start", None)   # a cpu device's OpenMP team, made now
        if start is not None:
            self._pool.submit(start).result()

    def _on_worker(self, fn, *args) -> Work:
        if self._pid != os.getpid():
            self._after_fork()
        return self._pool.submit(fn, *args)

    def call(self, what: str, fn, *args, tag: str | None = None):
        return self.submit(what, fn, *args, tag=tag).result()

    def _run(self, what, tag, fn, *args):
        t0 = time.perf_counter()
        try:
            if self.fault is not None:   # the phase is what follows the layer's name
                phase = what[len(tag) + 1:].replace(" ", "_") if tag is not None else None
                self.fault.check(phase, self.step)
            result = fn(*args)
            if self._sync is not None:   # a GPU's queued work ends within the call's time
                self._sync()
        except Exception as e:
            err = DeviceError(f"device {self.name} ({self.spec}) failed during {what}: "
                              f"{type(e).__name__}: {e}")
            err.device, err.what = self, what   # for pyhet.failover
            raise err from e
        took = time.perf_counter() - t0
        if self.speed < 1.0 and self.emulates:  # a slower device: idle (1/S - 1) times the work
            self._woken.wait(took * (1.0 / self.speed - 1.0))
        busy, compute = self._account(time.perf_counter() - t0)
        with self._lock:
            self.busy_s += busy
            self.last_busy_s = busy
            self.compute_s += compute
            if tag is not None:
                self.busy_by_tag[tag] = self.busy_by_tag.get(tag, 0.0) + busy
                self.compute_by_tag[tag] = self.compute_by_tag.get(tag, 0.0) + compute
        return result

    def _account(self, busy: float) -> tuple:
        """(busy, compute) seconds to count for a piece of work that took `busy` seconds: all
        of it, all computing, here; a device on another rank counts its rank's compute apart,
        and shares out the work it did for a group of its rank's devices."""
        return busy, busy

    def credit(self, tag: str | None, busy: float, compute: float):
        """Count work done for this device by another's message (a group of its rank)."""
        with self._lock:
            self.busy_s += busy
            self.compute_s += compute
            if tag is not None:
                self.busy_by_tag[tag] = self.busy_by_tag.get(tag, 0.0) + busy
                self.compute_by_tag[tag] = self.compute_by_tag.get(tag, 0.0) + compute

    # --- shard messages (run on the worker) ---------------------------------------------------

    def load_shard(self, layer: str, g: ConvGeometry, w, b, vw=None, vb=None):
        """Install a shard of layer g: w (k, C, R, S), b (k,) and their momentum (None: not
        started)."""
        be = self.backend
        # copies: the shard is updated in place and must not alias the caller's arrays
        conv = (lambda a: None if a is None else be.asarray(np.array(a, np.float32)))
        self._shards[layer] = _Shard(g, conv(w), conv(b), conv(vw), conv(vb))

    def get_shard(self, layer: str, lo=None, hi=None, momentum: bool = True):
        """(w, b, vw, vb) of the shard, or of its kernels [lo, hi), as host arrays (vw, vb None
        before the first step, and where momentum is not asked for)."""
        s = self._shards[layer]
        lo, hi = (0 if lo is None else lo), (s.k if hi is None else hi)
        host = (lambda a: None if a is None else np.array(self.backend.to_host(a[lo:hi])))
        if not momentum:
            return host(s.w), host(s.b), None, None
        return host(s.w), host(s.b), host(s.vw), host(s.vb)

    def reshard(self, layer: str, keep_lo: int, keep_hi: int, before=None, after=None):
        """The shard becomes `before` + its own kernels [keep_lo, keep_hi) + `after` (each a
        (w, b, vw, vb) of host arrays, or None): a repartition that moves only the kernels
        that change owner. Each of its new arrays is made once, the kept kernels copied into
        it where they are (momentum that one part lacks: zeros, as join_states). Through the
        host (the kept kernels copied out, joined, copied in) a move of six kernels of the
        paper network's conv2 took 0.4-0.9 s on a VM where new memory is slow to touch: three
        new arrays of each device's 50 MB of weights and as much momentum."""
        s = self._shards[layer]
        be = self.backend
        kept = tuple(None if a is None else a[keep_lo:keep_hi] for a in (s.w, s.b, s.vw, s.vb))
        parts = [p for p in (before, kept, after) if p is not None]

        def joined(i):
            if i >= 2 and all(p[i] is None for p in parts):
                return None          # no momentum yet anywhere
            # on the device (asarray: the kept kernels as they are, the others moved there;
            # a part whose momentum has not started: zeros)
            pieces = [be.asarray(np.zeros(tuple(p[i - 2].shape), np.float32) if p[i] is None
                                 else p[i]) for p in parts]
            # a new array (a copy even of one piece): the shard is updated in place, and its
            # old arrays may be views of a host group's arrays or in a caller's hands
            return be.xp.concatenate(pieces) if len(pieces) > 1 else pieces[0].copy()

        self._shards[layer] = _Shard(s.g, *(joined(i) for i in range(4)))

    def geometry(self, layer: str) -> ConvGeometry:
        return self._shards[layer].g

    def drop_shard(self, layer: str):
        self._shards.pop(layer, None)
        release = getattr(self.backend, "release", None)
        if release is not None:   # its work arrays too (a calibration's trial layers)
            release(layer)

    def im2col_part(self, x, g: ConvGeometry, shared, part):
        """This device's part of the im2col operands shared by the devices of this process (a
        SharedCol): the columns of images [n0, n1) of its packed operands (fwd, and col_t where
        there is one; packed in quadrants: the (image, sum) units [u0, u1)), or, without them
        (a group of one, part None), col whole."""
        if shared.fwd is None:
            self.backend.im2col_into(x, g, shared.col)
        else:
            self.backend.im2col_pack_part(x, g, shared.fwd, shared.col_t, part)

    def conv_forward(self, layer: str, x, shared=None):
        """x (N, C, H, W) host -> out (N, k, PH, PW) host. shared: x's im2col matrix shared by
        the devices of this process (a SharedCol, whole by now), or None."""
        s, be = self._shards[layer], self.backend
        s.x_shape = x.shape
        if s.k == 0:
            s.saved = s.col = s.packed_col_t = None
            return np.zeros(s.g.out_batch_shape(0, x.shape[0]), np.float32)
        s.dw_elsewhere = False
        if shared is None:   # (the last batch's arrays go first: an evaluation, which has no
            s.saved = s.col = s.packed_col_t = None   # backward to drop them, holds one at a time)
            s.col = be.im2col(be.asarray(x), s.g, key=layer)
            out, s.saved = be.block_forward(s.col, x.shape, s.w, s.b, s.g, key=layer)
            return be.to_host(out)
        s.col, s.packed_col_t = shared.col, shared.dw_operand
        s.dw_reads_fwd = s.packed_col_t is not None and s.packed_col_t is shared.fwd
        s.dw_elsewhere = shared.dw_from_fwd   # then col is not made: only fwd is
        out, s.saved = be.block_forward(s.col, x.shape, s.w, s.b, s.g, key=layer,
                                        packed=shared.fwd)
        return be.to_host(out)

    def conv_backward(self, layer: str, dout, dx_mode: str, dy_out=None, dw_out=None):
        """dout (N, k, PH, PW) host -> keeps dw, db; and for the layer's input gradient:
        dx_mode "none": nothing; "own": this shard's part of dx (N, C, H, W), host;
        "shared": (w (k, C*R*S), dy (k, N*OH*OW)) for input_grad_part on the devices that share
        host memory. dy_out: where a member of a host group writes dy (its rows of the group's
        array, so that input_grad_part finds all of dy in one array), or None. dw_out: its rows
        of the group's weight gradient, which input_grad_part fills (from col packed for the
        forward, SharedCol.dw_from_fwd), or None: made here."""
        s, be = self._shards[layer], self.backend
        if s.k == 0:
            s.dw, s.db = be.asarray(np.zeros(s.w.shape, np.float32)), be.asarray(
                np.zeros(0, np.float32))
            return None
        dout = be.asarray(dout)
        if dx_mode == "shared" or s.packed_col_t is not None:   # a member of a host group
            # packed_col_t is whole: the group's im2col filled it before any forward started
            dy = be.block_grad_output(dout, s.saved, out=dy_out)
            if dw_out is not None:   # filled by the group's input_grad_part
                s.dw, s.db = dw_out.reshape(s.w.shape), dy.sum(axis=1, dtype=np.float32)
            elif s.dw_elsewhere:      # col was not made, and no one would make dw
                raise RuntimeError(f"{layer}: the group packed only the forward's operand, so "
                                   f"its weight gradient needs rows of a group array (dw_out), "
                                   f"got none")
            else:
                # packed_col_t None: a group of one, which made col
                s.dw, s.db = be.block_grad_params(dy, s.col, s.w, layer, s.packed_col_t,
                                                  transposed=s.dw_reads_fwd)
            result = (s.w.reshape(s.k, -1), dy) if dx_mode == "shared" else None
        else:
            dcol, s.dw, s.db = be.block_backward(dout, s.saved, s.col, s.w, dx_mode == "own")
            result = None
            if dx_mode == "own":
                result = be.to_host(be.col2im(dcol, s.x_shape, s.g))
        s.saved = s.col = s.packed_col_t = None
        s.dw_elsewhere = False
        return result

    def input_grad_part(self, parts, dcol, dx, g: ConvGeometry, channels, dw=None):
        """Channels [c0, c1) of a layer's input gradient from all host shards, and with dw
        their share of the columns of the group's weight gradient (those channels' columns,
        or in quadrants a share of each half in proportion to them: CpuBackend)."""
        self.backend.input_grad_part(parts, dcol, dx, g, channels, dw)

    # --- the two-phase update -------------------------------------------------------------
    # sgd_stage writes the new state beside the current one, which stays as it was until the
    # master commits every layer of every device at once (commit_stage): a failure anywhere in
    # a step leaves every shard as it was before the step, on the device itself, where
    # get_shard reads it (pyhet.failover). The update reads the old state and writes the new
    # one in one pass (as much memory traffic as updating in place), and the buffers swap at
    # each commit (no allocation): the cost is one more copy of the shard in the device's memory.

    def sgd_stage(self, layer: str, cfg: SGDConfig, w_out=None, b_out=None, vw_out=None,
                  vb_out=None):
        """Stage the shard's update. w_out, b_out, vw_out, vb_out: where the new weights, biases
        and momentum go (a member of a host group: its rows of the group's arrays for the next
        state, so that input_grad_part finds all of the group's weights in one array and a
        repartition within the group moves nothing: adopt), or None (buffers of its own).
        Returns whether the staged state has momentum."""
        s, be = self._shards[layer], self.backend
        w, b, vw, vb = s.spare if s.spare is not None else (None,) * 4
        outs = {"weights": (w_out, s.w, s.w), "biases": (b_out, s.b, s.b),
                "momentum": (vw_out, s.vw, s.w), "bias momentum": (vb_out, s.vb, s.b)}
        for what, (out, now, like) in outs.items():
            if out is None:
                continue
            shape = tuple(like.shape)
            over = now is not None and np.may_share_memory(out, now)
            if tuple(out.shape) != shape or over:
                raise ValueError(f"{layer}: the new {what} need a buffer of shape {shape} apart "
                                 f"from the current ones, got {tuple(out.shape)}"
                                 f"{' over them' if over else ''}")
        w = w_out if w_out is not None else w
        b = b_out if b_out is not None else b
        first = s.vw is None
        if first:                 # the first update: no momentum buffers to reuse yet
            vw = vb = None
        elif vw is None and s.spare_v is not None:   # the second: those the first one made
            vw, vb = s.spare_v
        s.spare_v = None
        vw = vw_out if vw_out is not None else vw
        vb = vb_out if vb_out is not None else vb
        w, vw = be.sgd_update_into(s.w, s.dw, s.vw, cfg, w, vw)
        b, vb = be.sgd_update_into(s.b, s.db, s.vb, cfg, b, vb)
        if first and vw is not None and vw_out is None:
            # The second update writes its momentum beside this one's: make those buffers now,
            # by copies, so that their first-touch page faults fall in the first step (which
            # makes every buffer anyway) and the second step runs as fast as the later ones.
            s.spare_v = (vw.copy(), vb.copy())
        s.staged, s.spare = (w, b, vw, vb), None
        return vw is not None

    def adopt(self, layer: str, w, b, vw, vb):
        """Make (w, b, vw, vb) the shard's state as they are, without a copy: a repartition
        within a host group, whose state is in the group's arrays, each member's shard a view
        of its rows (sgd_stage's outputs), gives each member the views of its new rows. Called
        by the master directly between steps (the worker is idle then), like commit_stage."""
        s = self._shards[layer]
        self._shards[layer] = _Shard(s.g, w, b, vw, vb)

    def commit_stage(self, layer: str):
        """Make the staged update the shard's state. Called by the master directly (the worker
        is idle then): here it only swaps references, so it cannot fail."""
        s = self._shards[layer]
        if s.staged is not None:
            s.spare = (s.w, s.b, s.vw, s.vb)
            s.w, s.b, s.vw, s.vb = s.staged
            s.staged = None
            s.dw = s.db = None


# ================================================================================================
# Devices that share host memory (the cpu devices of one process): one im2col of the layer input
# (packed) filled by all of them, and the input gradient split by input channels. The master runs
# this for its own cpu devices, and a serving rank for the cpu devices placed on it.


class SharedCol:
    """The im2col matrix col (C*R*S, N*OH*OW) of a layer's input, shared by the devices of one
    process that compute on host memory (a group). For a group of two or more, the products'
    op(B) instead, packed once for all of them (each device would otherwise pack all of col
    again for its few rows of weights, and the packings would compete for memory bandwidth),
    and made straight from the input, without col (ops.im2col_pack: col would be written, then
    read back twice to pack):
      fwd:   col packed for y_i = w_i @ col
      col_t: col^T packed for dw_i = dy_i @ col^T; None in a layer with an input gradient
             (prepare's dw_from_fwd), whose weight gradient the group splits by input channels
             with it (shared_input_grad), each device its channels' columns, dy @ col[rows]^T,
             from fwd read transposed (ops.sgemm_packed_t): one operand to pack, not two
    each device filling the columns of its share of the images (shared_im2col). Where
    Strassen's scheme pays for a member's share (ops.uses_packed_strassen: big layers; an even
    batch and channel count), fwd is packed as its quadrants' seven sums instead
    (ops.PackedQuadrants, 7/4 of the size), made once for the group, and col_t is not packed:
    every member's forward takes the scheme with only its own weights to pack, as one device's
    whole-layer product does, and the weight gradient reads those seven sums transposed
    (ops.sgemm_packed_t: the scheme for dy @ col^T needs the same seven sums of col), split as
    above by input channels in a layer with an input gradient (each device its columns of each
    half), else each member its own kernels'; so the group writes 7/4 of col, not 7/2
    (`quadrants` is then True and the shares split the (image, sum) units of
    ops.quadrant_units). With one device, fwd and col_t are None: col is
    made, and its GEMM shares the packing among its threads. The buffers are kept from step to
    step (first-touch page faults cost more than a copy); the input gradient's dcol takes col's
    place once the backward is done."""

    def __init__(self):
        self.col = self.fwd = self.col_t = None
        self.quadrants = False
        self.group_dw = False   # prepare's dw_from_fwd, for a group of two or more

    def prepare(self, shape, members: dict, x_shape=None, dw_from_fwd=False):
        """Size the buffers for a col of `shape` and the members {device: kernels}; x_shape:
        the input's (N, C, H, W), for the packing in quadrants (None: never). dw_from_fwd: the
        group can take its weight gradient from fwd (split by input channels with the input
        gradient: shared_input_grad), so that col^T is not packed (in quadrants it never is:
        a member without that reads fwd's sums transposed for its own kernels)."""
        if self.col is None or self.col.shape != tuple(shape):
            self.col = np.empty(shape, np.float32)
        self.group_dw = len(members) >= 2 and bool(dw_from_fwd)
        if len(members) < 2:
            self.fwd = self.col_t = None
            self.quadrants = False
            return self
        rows, cols = shape
        self.quadrants = x_shape is not None and _quadrants_pay(rows, cols, members, x_shape)
        make = ops.packed_quadrants if self.quadrants else ops.packed_b
        if not _packed_fits(self.fwd, rows, cols, self.quadrants):
            self.fwd = None   # freed before the next one is made
            self.fwd = make(rows, cols)
        if dw_from_fwd or self.quadrants:
            self.col_t = None
        elif not _packed_fits(self.col_t, cols, rows, self.quadrants):
            self.col_t = None
            self.col_t = make(cols, rows, trans_b=True)
        return self

    @property
    def dw_from_fwd(self) -> bool:
        """Whether the group makes the weight gradient with the input gradient, split by input
        channels, from fwd (col^T not packed)."""
        return self.fwd is not None and self.group_dw

    @property
    def dw_operand(self):
        """What a member's own weight gradient dy_i @ col^T reads: col_t, or (in quadrants,
        where col_t is not packed) fwd's sums, read transposed (ops.sgemm_packed_t: each
        member transposes all of them, which a layer without an input gradient, the only one
        that gets here, seldom pays: it needs an even channel count); None where it has none
        (one device: col; dw_from_fwd: the group makes it)."""
        if self.fwd is None or self.group_dw:
            return None
        return self.col_t if self.col_t is not None else self.fwd


def _quadrants_pay(rows: int, cols: int, members: dict, x_shape) -> bool:
    """Whether a group packs col in quadrants (SharedCol): its input's batch and channels are
    even and Strassen's scheme pays for some member's share of the layer."""
    n, c = x_shape[:2]
    return n % 2 == 0 and c % 2 == 0 and any(
        ops.uses_packed_strassen(k, rows, cols, getattr(d.backend, "threads", 1))
        for d, k in members.items())


def _packed_fits(packed, k: int, n: int, quadrants: bool = False) -> bool:
    """Whether `packed` holds an op(B) (k, n) for the micro-kernel in use now, whole or (with
    quadrants) as a PackedQuadrants."""
    return packed is not None and isinstance(packed, ops.PackedQuadrants) == quadrants and (
        packed.k, packed.n) == (k, n) and packed.kernel == ops.gemm_kernel()


def shared_im2col(devices, kernels: dict, x, g: ConvGeometry, shared: SharedCol, tag=None):
    """Fill the im2col operands of x (N, C, H, W) in `shared` (SharedCol.prepare'd for these
    devices): for two or more, each device i the columns of its share of the images (in
    proportion to its kernels[i]; when packed in quadrants, its share of the (image, sum) units
    of ops.quadrant_units) of its packed operands (fwd, and col_t where there is one); one
    device makes col whole."""
    if shared.fwd is None:
        shares = [None] * len(kernels)
    else:   # in quadrants, (image, sum) units: finer than half the batch's images
        n = (ops.quadrant_units(x.shape[0], t=shared.col_t is not None) if shared.quadrants
             else x.shape[0])
        shares = channel_shares(n, list(kernels.values()))
    gather([devices[i].submit(f"{g.name} im2col", devices[i].im2col_part, x, g, shared, part,
                              tag=tag) for i, part in zip(kernels, shares)
            if part is None or part[1] > part[0]])


def shared_input_grad(devices, channels: dict, parts, dcol, dx, g: ConvGeometry, tag=None,
                      dw=None):
    """dx (N, C, H, W) of the layer from every shard's (w_j, dy_j) in parts, device i computing
    the rows of dcol and the channels of dx of channels[i]. dw: ([dw_j, ...], fwd), the
    shards' weight gradients (k_j, C*R*S), made here too, each device the columns of its
    channels (in quadrants, a share of each half of them in proportion to its channels), from
    col packed for the forward (SharedCol.dw_from_fwd); or None."""
    gather([devices[i].submit(f"{g.name} input gradient", devices[i].input_grad_part, parts,
                              dcol, dx, g, ch, dw, tag=tag) for i, ch in channels.items()])


def kept(store: dict, key, shape):
    """A float32 work array kept in `store` under `key` while its shape stays the same
    (contents undefined)."""
    a = store.get(key)
    if a is None or a.shape != tuple(shape):
        a = store[key] = np.empty(shape, np.float32)
    return a


def group_gradients(store: dict, key, g: ConvGeometry, batch: int, kernels: int,
                    shared: SharedCol):
    """(dy, dw) of a host group of two or more in a layer with an input gradient, kept in
    `store` under `key`: dy (kernels, N*OH*OW), each member writing its rows (so that
    input_grad_part finds the group's dy in one array), and, where the group packed only the
    forward's operand (shared.dw_from_fwd), dw (kernels, C*R*S), which input_grad_part fills
    (else None)."""
    rows, cols = g.col_shape(batch)
    dy = kept(store, (key, "dy"), (kernels, cols))
    return dy, kept(store, (key, "dw"), (kernels, rows)) if shared.dw_from_fwd else None


def channel_shares(C: int, counts) -> list:
    """[(c0, c1)] of each device of a group: the input channels (or images, for C their number)
    in proportion to its kernels (devices without kernels, and shares that round to nothing,
    get an empty range)."""
    split = proportional(C, counts) if any(counts) else [0] * len(counts)
    edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
    return [(int(edges[n]), int(edges[n + 1])) for n in range(len(counts))]


def gather(futures):
    """Wait for every future; re-raise the first error once all have finished, so no device is
    left working on a step that has failed. The others' errors go with it, as its `also`
    (devices that failed in the same phase: pyhet.failover takes them all out at once)."""
    results, errors = [], []
    for f in futures:
        try:
            results.append(f.result())
        except Exception as e:
            errors.append(e)
            results.append(None)
    if errors:
        errors[0].also = errors[1:]
        raise errors[0]
    return results


def join_states(parts):
    """(w, b, vw, vb) of consecutive shards joined; momentum None where none of them has
    started, else zeros for those that have not. One part is itself (not copied again: a
    large layer's gathered weights are not held twice)."""
    if len(parts) == 1:
        return tuple(parts[0])
    w, b = (np.concatenate([p[i] for p in parts]) for i in (0, 1))
    if all(p[2] is None for p in parts):
        return w, b, None, None
    vw, vb = (np.concatenate([p[i] if p[i] is not None else np.zeros_like(p[i - 2])
                              for p in parts]) for i in (2, 3))
    return w, b, vw, vb


def fault_refusal(device, phase: str, devices) -> "str | None":
    """Why a fault in `phase` would never fire on `device`, as a sentence that names it and
    says which phases to give; None where it would. devices: the run's devices in order (those
    of its rank will do for a device on another rank)."""
    remote = getattr(device, "peer", None) is not None    # (mpi.RemoteDevice)
    if phase in ("im2col", "input_gradient") and not device.shares_host_memory:
        # only the cpu devices of a process share one im2col and split the input
        # gradient, as phases of their own; the others (a device on another rank
        # included) do both inside their forward and backward: it would never fire
        where = (f"is on rank {device.spec.rank}, where {phase} is part of the forward or "
                 f"backward request" if remote else
                 f"({device.spec}) does its {phase} inside its forward and backward")
        return f"{device.name} {where}: give forward, backward or update"
    if remote and device.group is not None and phase in ("forward", "backward"):
        # a rank's cpu devices go as one request, through its first device's worker,
        # where alone a fault is checked
        first = next((d for d in devices if d.group == device.group), device)
        if first is not device:
            return (f"{device.name} is on rank {device.spec.rank} with {first.name}, whose "
                    f"request carries the {phase} of the rank's cpu devices: give update, or "
                    f"the fault to {first.name}")
    return None


def arm_faults(devices) -> None:
    """Give the devices of a run the faults that PYHET_FAULT asks for (pyhet.faults; testing
    only). Called once the run's devices are all made, those on other ranks included."""
    for name, fault in from_environment([d.name for d in devices]).items():
        device = next(d for d in devices if d.name == name)
        refusal = fault_refusal(device, fault.phase, devices)
        if refusal:
            raise DeviceError(f"{FAULT_ENV}: {refusal}")
        device.fault = fault


def _not_a_list_of(value, kind) -> "str | None":
    """What `value` is where it is not a list (or tuple) of `kind` items, for a message; None
    where it is one."""
    if not isinstance(value, (list, tuple)):
        return type(value).__name__
    wrong = next((v for v in value if not isinstance(v, kind)), None)
    return None if wrong is None else f"a {type(value).__name__} holding {type(wrong).__name__}"


def make_devices(specs, names=None) -> list[Device]:
    """Device objects for the specs (a device SPEC string such as 'cpu:1,numpy', or a list of
    DeviceSpec: pyhet.specs.parse_devices), all in this process, named d0, d1, ... or `names`
    (one distinct str a spec). If one cannot be made, those made before it are closed (no
    worker thread is left behind)."""
    if isinstance(specs, str):
        # as the command line reads a SPEC: `auto` counts the GPUs, every device in this
        # process (no rank but 0), its threads checked (a warning past the cores)
        specs = parse_devices(specs, gpu_count=cuda_device_count)
        check_ranks(specs, 1, "make_devices")
        check_threads(specs, master=False)
    elif _not_a_list_of(specs, DeviceSpec):
        raise TypeError(f"make_devices: specs must be a device SPEC string such as "
                        f"'cpu:1,numpy' or a list of DeviceSpec (pyhet.specs.parse_devices), "
                        f"got {_not_a_list_of(specs, DeviceSpec)}")
    if names is None:
        names = [f"d{i}" for i in range(len(specs))]
    elif _not_a_list_of(names, str):
        raise TypeError(f"make_devices: names must be None or a list of str, one a device, got "
                        f"{_not_a_list_of(names, str)}")
    if len(names) != len(specs):
        raise UsageError(f"make_devices: expected one name a device ({len(specs)}), got "
                         f"{len(names)} name{'' if len(names) == 1 else 's'}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"make_devices: names must differ, got {', '.join(map(shown, twice))} "
                         f"more than once")
    ops.warn_about_environment()
    devices: list[Device] = []
    try:
        for name, s in zip(names, specs):
            devices.append(Device(name, s))
    except BaseException:
        for d in devices:
            d.close()
        raise
    return devices
