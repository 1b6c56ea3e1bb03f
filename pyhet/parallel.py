"""The partitioned conv layer: each device owns a contiguous share of the layer's kernels.

Forward: every device gets the layer input and computes its output channels, then bias, ReLU
and max-pool on the spot (all per channel, so this is exact); it returns only its pooled slice,
and the slices are joined along the channel axis. Backward: each device gets its slice of the
output gradient and computes its weight and bias gradients; the input gradient
dx = col2im(sum_j w_j^T dy_j) is the sum of every shard's part. The parameter update runs where
the parameters live.

Work that one shared step can do is not repeated per device. The devices that compute on host
memory in this process (kind cpu, the "host group") share one im2col matrix of the input, each
filling the rows of its share of the input channels; and they split the input gradient by input
channels rather than each computing a part of all of it: device i computes the rows of dcol of
its channels from every host shard (w_j, dy_j), then col2im of those channels. So the input
gradient costs the same whatever the number of devices. A device outside the group (numpy, gpu,
another process) does its own im2col and returns its own part of dx, which is added.

The last consistent state (pyhet.failover): a device may fail in any phase of a step, and its
kernels then move to the others from the layer's state as it was before the step, which is
read as follows. Forward and backward change no shard, so before the update every shard is
still that state. The update is two-phase: a device that computes on host memory in this
process stages its new state beside the old one (Device.sgd_stage) and the master commits all
of them once every device of every layer has updated; such a device's shards are host arrays,
readable by the master even after it failed, so they need no copy. A GPU or a device on another
rank may take its shards with it when it fails, so the master keeps a host copy of each of its
shards, refreshed by reading them back after each step's update (before the commit, so a
failed read leaves the step undone). The costs: per host device one more copy of its shards in
memory and a copy of them per step (about a percent of a conv step); per GPU or remote device a
host copy of its shards and a read-back of them (weights and momentum) over its link per step.
A device that failed is left out of every later partition ("dead") and never called again.

Letters as in pyhet.geometry: x (N, C, H, W) layer input, out (N, K, PH, PW) block output,
(R, S) kernel size, counts[i] kernels on device i, sum(counts) = K.
"""

from __future__ import annotations

import numpy as np

from .devices import join_states
from .errors import DeviceError
from .geometry import ConvGeometry
from .partition import proportional
from .timing import PartTimer


class PartitionedConv:
    """conv -> ReLU -> optional max-pool (the block g), its K kernels spread over devices."""

    def __init__(self, g: ConvGeometry, w, b, devices, counts, need_dx: bool = True):
        # w (K, C, R, S), b (K,) host float32; counts: kernels per device, in device order
        if tuple(w.shape) != g.weight_shape or tuple(b.shape) != (g.K,):
            raise ValueError(f"{g.name}: weights {g.weight_shape} and bias ({g.K},) are "
                             f"needed, got {tuple(w.shape)} and {tuple(b.shape)}")
        self.g, self.name, self.need_dx = g, g.name, need_dx
        self.devices = list(devices)
        self._buffers: dict = {}
        self.phases = PartTimer()  # wall time of each phase, summed over steps
        self.moves = 0            # repartitions so far
        self.dead: set = set()    # devices that failed: no kernels, no calls
        self._mirror: dict = {}   # device -> (w, b, vw, vb) of its shard as of the last commit
        self._read: dict = {}     # device -> the same, read back after an update not committed
        self._orphan = None       # the layer's state once no device is left
        self.install(w, b, None, None, counts)

    # --- the partition --------------------------------------------------------------------------

    @property
    def K(self) -> int:
        return int(sum(self.counts))

    @property
    def live(self) -> list:
        """Indices of the devices that have not failed."""
        return [i for i in range(len(self.devices)) if i not in self.dead]

    def install(self, w, b, vw, vb, counts):
        """Give device i kernels [sum(counts[:i]), sum(counts[:i+1])) with their momentum."""
        counts = self._checked(counts, w.shape[0])
        self._set_partition(counts)
        part = (lambda a, k0, k1: None if a is None else a[k0:k1])
        _gather([self.devices[i].submit("load_shard", self.devices[i].load_shard, self.name,
                                        self.g, w[k0:k1], b[k0:k1], part(vw, k0, k1),
                                        part(vb, k0, k1))
                 for i, (k0, k1) in enumerate(self.bounds) if i not in self.dead])
        self._refresh_mirror()

    def _checked(self, counts, K: int) -> list:
        counts = [int(c) for c in counts]
        if len(counts) != len(self.devices) or min(counts) < 0 or sum(counts) != K or any(
                counts[i] for i in self.dead):
            raise DeviceError(f"{self.name}: a partition of {K} kernels over "
                              f"{len(self.devices)} devices (none for the failed ones, "
                              f"{sorted(self.dead)}) is needed, got {counts}")
        return counts

    def _mirrored(self) -> list:
        """The devices with kernels whose shards the master keeps a host copy of."""
        return [i for i in self.active if not self.devices[i].keeps_state_on_failure]

    def _refresh_mirror(self):
        mirrored = self._mirrored()
        states = _gather([self.devices[i].submit("get_shard", self.devices[i].get_shard,
                                                 self.name) for i in mirrored])
        self._mirror = dict(zip(mirrored, states))

    def _set_partition(self, counts):
        """Kernel ranges, active devices and the host group's channel shares for `counts`."""
        self.counts = counts
        self.active = [i for i, c in enumerate(counts) if c > 0]   # devices with kernels
        self.bounds = _ranges(counts)
        # the host group's shares of the input channels follow their shares of the kernels
        self.group = [i for i, d in enumerate(self.devices)
                      if d.shares_host_memory and counts[i] > 0]
        C = self.g.C
        split = proportional(C, [counts[i] for i in self.group]) if self.group else []
        edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
        self.channels = {i: (int(edges[n]), int(edges[n + 1])) for n, i in enumerate(self.group)
                         if edges[n + 1] > edges[n]}

    def gather_state(self):
        """(w, b, vw, vb) of the whole layer, joined from the devices (host arrays); the
        momentum is None before the first update."""
        if not self.live:   # every device failed: the state they had before
            return tuple(None if a is None else a.copy() for a in self._orphan)
        return join_states(_gather([self.devices[i].submit("get_shard",
                                                           self.devices[i].get_shard, self.name)
                                    for i in self.live]))

    # --- failures (pyhet.failover) ---------------------------------------------------------------

    def consistent_state(self):
        """(w, b, vw, vb) of the whole layer as of the last committed step, after a failure in
        any phase of the step under way. No device is called: shards on host memory are read
        directly (their workers are idle: every phase waits for all its devices), the others
        come from the master's copies."""
        parts = [self._mirror[i] if i in self._mirror else self.devices[i].salvage_shard(
            self.name) for i in self.active]
        return join_states(parts)

    def fail_over(self, failed, state, counts):
        """Leave the devices `failed` (indices) out from now on, and give the layer's `state`
        (consistent_state()) to the others as `counts` says, or keep it here when no device
        is left (counts None)."""
        self.dead.update(failed)
        self._mirror, self._read = {}, {}
        if counts is None:
            self._orphan = state
            self._set_partition([0] * len(self.devices))
            return
        self.install(*state, counts)

    def repartition(self, counts):
        """Move kernels between devices, weights and momentum with them; exact. Only the
        kernels that change owner travel: each device hands out the kernels that leave its
        range and keeps the rest (kernel ranges stay contiguous in device order)."""
        counts = self._checked(counts, self.K)
        if counts == self.counts:
            return
        old, new = self.bounds, _ranges(counts)
        with self.phases("repartition"):
            # 1. each device hands out its kernels outside its new range: global [a, b)
            wanted = []
            for j, ((o0, o1), (n0, n1)) in enumerate(zip(old, new)):
                for a, b in ((o0, min(o1, n0)), (max(o0, n1), o1)):
                    if b > a:
                        wanted.append((a, b, self.devices[j].submit(
                            "get_shard", self.devices[j].get_shard, self.name, a - o0, b - o0)))
            moving = {(a, b): s for (a, b, _), s in zip(wanted, _gather([f for *_, f in wanted]))}

            def rows(x, y):   # global kernels [x, y) from the pieces that move
                if y <= x:
                    return None
                parts = [tuple(None if v is None else v[max(a, x) - a:min(b, y) - a] for v in s)
                         for (a, b), s in sorted(moving.items()) if a < y and b > x]
                assert sum(p[0].shape[0] for p in parts) == y - x, "kernels lost in a move"
                return join_states(parts)

            # 2. each device keeps the overlap of its old and new ranges, and takes the rest
            futures = []
            for i, ((o0, o1), (n0, n1)) in enumerate(zip(old, new)):
                if i in self.dead:    # no kernels before or after: nothing to send it
                    continue
                lo, hi = max(o0, n0), min(o1, n1)
                if hi <= lo:          # nothing kept: all comes from the others
                    before, after, keep = rows(n0, n1), None, (0, 0)
                else:
                    before, after, keep = rows(n0, lo), rows(hi, n1), (lo - o0, hi - o0)
                futures.append(self.devices[i].submit("reshard", self.devices[i].reshard,
                                                      self.name, keep[0], keep[1], before,
                                                      after))
            _gather(futures)
            self._set_partition(counts)
            self._refresh_mirror()
        self.moves += 1

    def _buffer(self, key, shape):
        a = self._buffers.get(key)
        if a is None or a.shape != shape:
            a = self._buffers[key] = np.empty(shape, np.float32)
        return a

    # --- forward / backward / step ------------------------------------------------------------

    def forward(self, x):
        """x (N, C, H, W) -> out (N, K, PH, PW), host arrays."""
        g = self.g
        if x.ndim != 4 or tuple(x.shape[1:]) != g.in_shape:
            raise ValueError(f"{self.name}: expected input of shape (N, "
                             f"{', '.join(map(str, g.in_shape))}), got {tuple(x.shape)}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.x_shape = x.shape
        col = None
        if self.group:  # one im2col for the host group, filled by channel shares
            col = self._buffer("col", g.col_shape(x.shape[0]))
            with self.phases("im2col"):
                _gather([self.devices[i].submit(f"{self.name} im2col",
                                                self.devices[i].im2col_part, x, g, col, ch,
                                                tag=self.name)
                         for i, ch in self.channels.items()])
        with self.phases("forward"):
            # a device without kernels of this layer is left out (a remote one costs messages)
            futures = [self.devices[i].submit(f"{self.name} forward",
                                              self.devices[i].conv_forward, self.name, x,
                                              col if i in self.group else None, tag=self.name)
                       for i in self.active]
            parts = _gather(futures)
        with self.phases("join"):
            return np.concatenate(parts, axis=1)

    def backward(self, dout):
        """dout (N, K, PH, PW) -> dx (N, C, H, W), or None when the layer needs no dx.

        The host group's channel-split input gradient starts as soon as the group's own
        backward is done, while the devices outside the group (a GPU, another rank) still
        compute their part of dx; those parts are added last."""
        def mode(i):
            return "none" if not self.need_dx else "shared" if i in self.group else "own"

        futures = {i: self.devices[i].submit(f"{self.name} backward",
                                             self.devices[i].conv_backward, self.name,
                                             dout[:, k0:k1], mode(i), tag=self.name)
                   for i, (k0, k1) in ((i, self.bounds[i]) for i in self.active)}
        try:
            with self.phases("backward"):
                group = _gather([futures[i] for i in self.group])
            if not self.need_dx:
                return None
            dx = np.zeros(self.x_shape, np.float32) if not self.group else \
                np.empty(self.x_shape, np.float32)
            if self.group:
                with self.phases("input_gradient"):
                    dcol = self._buffer("dcol", self._buffers["col"].shape)
                    _gather([self.devices[i].submit(f"{self.name} input gradient",
                                                    self.devices[i].input_grad_part, group,
                                                    dcol, dx, self.g, ch, tag=self.name)
                             for i, ch in self.channels.items()])
        finally:
            # every device's backward has finished before the layer returns (or fails): the
            # update must not start while a device still reads its shard
            with self.phases("others_backward"):
                results = dict(zip(futures, _gather(list(futures.values()))))
        for i, r in results.items():
            if i not in self.group and r is not None:
                dx += r
        return dx

    def step(self, cfg):
        """The first phase of the update: staged on the devices that keep their state on
        failure, in place on the others (the master has a copy of theirs); then those are read
        back. Nothing is final before commit()."""
        with self.phases("update"):
            _gather([self.devices[i].submit(f"{self.name} update",
                                            self.devices[i].sgd_stage
                                            if self.devices[i].keeps_state_on_failure
                                            else self.devices[i].sgd_step,
                                            self.name, cfg, tag=self.name)
                     for i in self.active])
            mirrored = self._mirrored()
            self._read = dict(zip(mirrored, _gather([
                self.devices[i].submit(f"{self.name} read back", self.devices[i].get_shard,
                                       self.name, tag=self.name) for i in mirrored])))

    def commit(self):
        """The update's second phase, once every layer's step() has succeeded: it cannot fail
        (references swap on the master)."""
        for i in self.active:
            if self.devices[i].keeps_state_on_failure:
                self.devices[i].commit_stage(self.name)
        self._mirror, self._read = self._read, {}


def _ranges(counts) -> list:
    """[(k0, k1)] of each device: consecutive kernel ranges of the given sizes."""
    edges = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(len(counts))]


def _gather(futures):
    """Wait for every future; re-raise the first error once all have finished, so no device is
    left working on a step that has failed."""
    results, error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except Exception as e:
            error = error or e
            results.append(None)
    if error is not None:
        raise error
    return results
