"""The partitioned conv layer: each device owns a contiguous share of the layer's kernels.

Forward: every device gets the layer input and computes its output channels, then bias, ReLU
and max-pool on the spot (all per channel, so this is exact); it returns only its pooled slice,
and the slices are joined along the channel axis. Backward: each device gets its slice of the
output gradient and computes its weight and bias gradients; the input gradient
dx = col2im(sum_j w_j^T dy_j) is the sum of every shard's part. The parameter update runs where
the parameters live.

Work that one shared step can do is not repeated per device. The devices that compute on host
memory in this process (kind cpu, the "host group") share one im2col of the input (for two or
more, the products' operands packed straight from the input, each device filling the columns
of its share of the images, in proportion to its kernels: SharedCol); and they split the input
gradient by input channels rather than each computing a part of all of it: device i computes
the rows of dcol of its channels from every host shard (w_j, dy_j), then col2im of those
channels. So the input gradient costs the same whatever the number of devices: the group's
shards keep their weights (from their first update on) and write their dy in their rows of one
array of the whole layer each, so that those rows are one product over all of the group's
kernels (CpuBackend.input_grad_part), not one per shard. Their biases and momentum are kept the
same way, so that a repartition within the group hands each member views of its new rows and
copies nothing (_regroup). With the input gradient they split
the weight gradient the same way, by input channels (the columns of every shard's dw of its
channels, or, where the forward's operand is packed as its quadrants' sums, a share of each
half of dw's columns in proportion to them; from the forward's packed operand read
transposed: SharedCol.dw_from_fwd). The cpu devices
placed on another MPI rank form a group of their own there: one message to the rank carries the
layer input (forward) or their slices of the output gradient (backward), the rank runs the same
shared im2col and channel-split input gradient, and one reply brings back their output slices or
their summed part of dx. Any other device (numpy, gpu, or alone on its rank) does its own im2col
and returns its own part of dx, which is added.

The last consistent state (pyhet.failover): a device may fail in any phase of a step, and its
kernels then move to the others from the layer's state as it was before the step. Forward and
backward change no shard, and the update is two-phase: each device stages its new state beside
the old one (Device.sgd_stage), and the master commits all of them once every device of every
layer has updated. So until the commit every device holds the state before the step, and gives
it back when asked, the failed one too (a GPU that ran out of memory still has its memory; a
device on another rank whose work raised still has its rank). A device that is gone with its
memory (a rank that died) cannot: the run then ends, and the newest checkpoint is where to
resume. The cost: per device one more copy of its shards in its memory (the update writes the
new state beside the old in one pass, no more memory traffic than in place). A device that
failed is left out of every later partition ("dead") and never called again.

Letters as in pyhet.geometry: x (N, C, H, W) layer input, out (N, K, PH, PW) block output,
(R, S) kernel size, counts[i] kernels on device i, sum(counts) = K.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .devices import (SharedCol, channel_shares, gather, group_gradients, join_states, kept,
                      shared_im2col,
                      shared_input_grad)
from .errors import DeviceError
from .geometry import ConvGeometry
from .interrupt import HeldSignals
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
        self._shared = SharedCol()  # the host group's im2col matrix, packed for its products
        self._next_w = 0          # which of the host group's two state arrays the update fills
        # (index, momentum) of the group's arrays that hold the whole layer's current state,
        # every member's shard a view of its rows, or None (repartition then copies)
        self._views = self._staged_views = None
        self.phases = PartTimer()  # wall time of each phase, summed over steps
        self.moves = 0            # repartitions so far
        self.dead: set = set()    # devices that failed: no kernels, no calls
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
        self._views = None        # each device's shard its own copy now
        part = (lambda a, k0, k1: None if a is None else a[k0:k1])
        gather([self.devices[i].submit("load_shard", self.devices[i].load_shard, self.name,
                                       self.g, w[k0:k1], b[k0:k1], part(vw, k0, k1),
                                       part(vb, k0, k1))
                for i, (k0, k1) in enumerate(self.bounds) if i not in self.dead])

    def set_state(self, w, b, vw, vb):
        """The whole layer's weights and momentum (host arrays; momentum None where there is
        none), on the devices as the layer is partitioned now, or kept here where every
        device failed."""
        if self.live:
            self.install(w, b, vw, vb, self.counts)
        else:
            self._orphan = tuple(None if a is None else np.array(a) for a in (w, b, vw, vb))

    def _checked(self, counts, K: int) -> list:
        counts = [int(c) for c in counts]
        if len(counts) != len(self.devices) or min(counts) < 0 or sum(counts) != K or any(
                counts[i] for i in self.dead):
            raise DeviceError(f"{self.name}: a partition of {K} kernels over "
                              f"{len(self.devices)} devices (none for the failed ones, "
                              f"{sorted(self.dead)}) is needed, got {counts}")
        return counts

    def _set_partition(self, counts):
        """Kernel ranges, active devices, and the groups' members and channel shares for
        `counts`."""
        self.counts = counts
        self.active = [i for i, c in enumerate(counts) if c > 0]   # devices with kernels
        self.bounds = _ranges(counts)
        groups: dict = {}
        for i in self.active:
            if self.devices[i].group is not None:
                groups.setdefault(self.devices[i].group, []).append(i)
        # the host group (this process's cpu devices); its shares of the input channels follow
        # their shares of the kernels
        self.group = groups.pop("host", [])
        self.channels = self._shares(self.group)
        # groups on other ranks, of two or more devices (one alone does its own): each runs as
        # one message to its first device's rank; {first: (members, their channel shares)}
        self.remote = {members[0]: (members, self._shares(members))
                       for members in groups.values() if len(members) > 1}
        self.in_remote = {i for members, _ in self.remote.values() for i in members}

    def _shares(self, members) -> dict:
        """{device: (c0, c1)} of the members with a non-empty share of the input channels."""
        shares = channel_shares(self.g.C, [self.counts[i] for i in members])
        return {i: ch for i, ch in zip(members, shares) if ch[1] > ch[0]}

    def gather_state(self, momentum: bool = True):
        """(w, b, vw, vb) of the whole layer, joined from the devices (host arrays); the
        momentum is None before the first update, and where it is not asked for."""
        if not self.live:   # every device failed: the state they had before
            state = tuple(None if a is None else a.copy() for a in self._orphan[:2])
            return state + ((None, None) if not momentum else tuple(
                None if a is None else a.copy() for a in self._orphan[2:]))
        return join_states(gather([self.devices[i].submit("get_shard",
                                                          self.devices[i].get_shard, self.name,
                                                          None, None, momentum)
                                   for i in self.live]))

    # --- failures (pyhet.failover) ---------------------------------------------------------------

    def consistent_state(self):
        """(w, b, vw, vb) of the whole layer as of the last committed step, after a failure in
        any phase of the step under way: every device still holds it (the update is staged
        beside it until the commit), and gives it back, the failed one included, unless it is
        gone (then this raises)."""
        return join_states(gather([self.devices[i].submit("salvage", self.devices[i].get_shard,
                                                          self.name) for i in self.active]))

    def fail_over(self, failed, state, counts):
        """Leave the devices `failed` (indices) out from now on, and give the layer's `state`
        (consistent_state()) to the others as `counts` says, or keep it here when no device
        is left (counts None)."""
        self.dead.update(failed)
        self._views = None
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
        if self._views is not None and all(
                self.devices[i].group == "host" for i, c in enumerate(counts) if c) and all(
                self.devices[i].group == "host" for i in self.active):
            self._regroup(counts)
            return
        self._views = None
        old, new = self.bounds, _ranges(counts)
        # Ctrl-C waits for the move's end: cut short, the devices would hold one partition and
        # the layer's record another (on other ranks, Ctrl-C there ends every rank)
        local = all(getattr(d, "peer", None) is None for d in self.devices)
        with HeldSignals() if local else contextlib.nullcontext(), self.phases("repartition"):
            # 1. each device hands out its kernels outside its new range: global [a, b)
            wanted = []
            for j, ((o0, o1), (n0, n1)) in enumerate(zip(old, new)):
                for a, b in ((o0, min(o1, n0)), (max(o0, n1), o1)):
                    if b > a:
                        wanted.append((a, b, self.devices[j].submit(
                            "get_shard", self.devices[j].get_shard, self.name, a - o0, b - o0)))
            moving = {(a, b): s for (a, b, _), s in zip(wanted, gather([f for *_, f in wanted]))}

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
            gather(futures)
            self._set_partition(counts)
        self.moves += 1

    def _regroup(self, counts):
        """A repartition within the host group, whose state is in its arrays of the whole layer
        (every member's shard a view of its rows, since the group's last update): each device
        takes the views of its new rows, and nothing moves. (Copying the kernels that change
        owner, a move of six of the paper network's conv2 took 137-296 ms: new arrays of each
        device's weights and momentum, on a VM where new memory is slow to touch.)"""
        index, momentum = self._views
        state = [self._buffers[(name, index)] if momentum or name[0] != "v" else None
                 for name, _ in self._state_shapes(True)]
        with HeldSignals(), self.phases("repartition"):
            for i, (n0, n1) in enumerate(_ranges(counts)):
                if i not in self.dead and (counts[i] or self.counts[i]):
                    self.devices[i].adopt(self.name, *(None if a is None else a[n0:n1]
                                                       for a in state))
            self._set_partition(counts)
        self.moves += 1

    def _state_shapes(self, momentum: bool) -> list:
        """[(name, shape)] of the host group's arrays of the layer's state: weights, biases
        and, with momentum, theirs."""
        g = self.g
        return [(n, s) for n, s in (("w", g.weight_shape), ("b", (g.K,)),
                                    ("vw", g.weight_shape), ("vb", (g.K,)))
                if momentum or n[0] != "v"]

    # --- forward / backward / step ------------------------------------------------------------

    def forward(self, x):
        """x (N, C, H, W) -> out (N, K, PH, PW), host arrays."""
        g = self.g
        if x.ndim != 4 or tuple(x.shape[1:]) != g.in_shape:
            raise ValueError(f"{self.name}: expected input of shape (N, "
                             f"{', '.join(map(str, g.in_shape))}), got {tuple(x.shape)}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.x_shape = x.shape
        # the devices that do their own im2col (another rank, a GPU) get the input first, so
        # their im2col and transfers overlap the host group's im2col; a device without kernels
        # of this layer is left out (a remote one costs messages); a group on another rank is
        # one message, to its first device
        futures = {}
        for i in self.active:
            d = self.devices[i]
            if i in self.remote:
                members, shares = self.remote[i]
                futures[i] = d.submit(f"{self.name} forward", d.group_forward, self.name, x,
                                      self._plan(members, shares), self.need_dx, tag=self.name)
            elif i not in self.in_remote and i not in self.group:
                futures[i] = d.submit(f"{self.name} forward", d.conv_forward, self.name, x,
                                      None, tag=self.name)
        shared = None
        if self.group:  # one im2col for the host group, its parts filled by every member
            shared = self._shared.prepare(g.col_shape(x.shape[0]),
                                          {self.devices[i]: self.counts[i] for i in self.group},
                                          x.shape, dw_from_fwd=self.need_dx)
            with self.phases("im2col"):
                try:
                    shared_im2col(self.devices, {i: self.counts[i] for i in self.group}, x, g,
                                  shared, tag=self.name)
                except BaseException:
                    for f in futures.values():   # no device left working on a failed step
                        f.exception()
                    raise
        with self.phases("forward"):
            for i in self.group:
                d = self.devices[i]
                futures[i] = d.submit(f"{self.name} forward", d.conv_forward, self.name, x,
                                      shared, tag=self.name)
            parts = dict(zip(futures, gather(list(futures.values()))))
        with self.phases("join"):
            for first, (members, _) in self.remote.items():   # a group's slices, each in place
                joined = parts.pop(first)
                edges = np.cumsum([0] + [self.counts[i] for i in members])
                for n, i in enumerate(members):
                    parts[i] = joined[:, edges[n]:edges[n + 1]]
            return np.concatenate([parts[i] for i in self.active], axis=1)

    def _plan(self, members, shares):
        """(devices, kernels, c0, c1) of a group's members, as its rank is told."""
        return np.array([(i, self.counts[i], *shares.get(i, (0, 0))) for i in members],
                        np.int64)

    def backward(self, dout):
        """dout (N, K, PH, PW) -> dx (N, C, H, W), or None when the layer needs no dx.

        The host group's channel-split input gradient starts as soon as the group's own
        backward is done, while the devices outside the group (a GPU, another rank) still
        compute their part of dx; those parts are added last."""
        def mode(i):
            return "none" if not self.need_dx else "shared" if i in self.group else "own"

        # a host group's dy in one array, each member writing its rows (input_grad_part then
        # multiplies by all of it at once), and their weight gradient, made with dx's rows
        dy_all = dw_all = None
        if self.need_dx and len(self.group) > 1:
            dy_all, dw_all = group_gradients(self._buffers, None, self.g, dout.shape[0], self.K,
                                             self._shared)
        futures = {}
        for i in self.active:
            d, (k0, k1) = self.devices[i], self.bounds[i]
            if i in self.remote:    # the members' slices, joined in their order
                members, shares = self.remote[i]
                mine = np.concatenate([dout[:, slice(*self.bounds[m])] for m in members], axis=1)
                futures[i] = d.submit(f"{self.name} backward", d.group_backward, self.name,
                                      mine, self._plan(members, shares), self.need_dx,
                                      tag=self.name)
            elif i not in self.in_remote:
                extra = () if dy_all is None or i not in self.group else (
                    (dy_all[k0:k1],) if dw_all is None else (dy_all[k0:k1], dw_all[k0:k1]))
                futures[i] = d.submit(f"{self.name} backward", d.conv_backward, self.name,
                                      dout[:, k0:k1], mode(i), *extra, tag=self.name)
        try:
            with self.phases("backward"):
                group = gather([futures[i] for i in self.group])
            if not self.need_dx:
                return None
            dx = np.zeros(self.x_shape, np.float32) if not self.group else \
                np.empty(self.x_shape, np.float32)
            if self.group:
                with self.phases("input_gradient"):
                    # the group's backward has read the im2col matrix for the last time:
                    # dcol takes its place (no second matrix of that size)
                    dcol = self._shared.col
                    shared_input_grad(self.devices, self.channels, group, dcol, dx, self.g,
                                      tag=self.name, dw=None if dw_all is None else (
                                          [dw_all[slice(*self.bounds[i])] for i in self.group],
                                          self._shared.fwd))
        finally:
            # every device's backward has finished before the layer returns (or fails): the
            # update must not start while a device still reads its shard
            with self.phases("others_backward"):
                results = dict(zip(futures, gather(list(futures.values()))))
        for i, r in results.items():
            if i not in self.group and r is not None:
                dx += r
        return dx

    def step(self, cfg):
        """The first phase of the update: staged on every device beside its state, which stays
        as it was until commit(). The members of a host group write their new state (weights,
        biases, momentum) into their rows of one of two sets of arrays of the whole layer, the
        one that does not hold the current state (they alternate at each commit), so that after
        the commit the group's weights are one array again (input_grad_part: one product over
        all of them), and a repartition within the group moves nothing (_regroup)."""
        outs = None
        self._staged_views = None
        if len(self.group) > 1:
            momentum = cfg.momentum > 0
            outs = [kept(self._buffers, (name, self._next_w), shape)
                    for name, shape in self._state_shapes(momentum)]
            outs += [None] * (4 - len(outs))
            for name, shape in self._state_shapes(momentum):
                if (name, 1 - self._next_w) not in self._buffers:
                    # the arrays the next update writes: made and written now, so that their
                    # page faults fall in the first step, which makes every buffer anyway, and
                    # not in the second (on the paper network's conv2 they made the second
                    # step's update of two devices 108-219 ms, 10-15 ms in later steps)
                    kept(self._buffers, (name, 1 - self._next_w), shape).fill(0.0)
        with self.phases("update"):
            futures = []
            for i in self.active:
                d, (k0, k1) = self.devices[i], self.bounds[i]
                extra = tuple(None if a is None else a[k0:k1] for a in outs) if (
                    outs is not None and i in self.group) else ()
                futures.append(d.submit(f"{self.name} update", d.sgd_stage, self.name, cfg,
                                        *extra, tag=self.name))
            staged = gather(futures)
        if outs is not None and set(self.active) <= set(self.group):
            # the whole layer's new state is in the group's arrays, momentum and all (or none
            # has momentum): commit() makes them the views a repartition hands out
            if outs[2] is not None and all(staged):
                self._staged_views = (self._next_w, True)
            elif not any(staged):
                self._staged_views = (self._next_w, False)

    def commit(self):
        """The update's second phase, once every layer's step() has succeeded."""
        staged, self._views = self._staged_views, None   # (no stale record if this is cut short)
        for i in self.active:
            self.devices[i].commit_stage(self.name)
        # where the group's arrays now hold the layer's state (None: a device's own arrays do)
        self._views, self._staged_views = staged, None
        if len(self.group) > 1:   # the other arrays take the next update (step() used one)
            self._next_w = 1 - self._next_w


def _ranges(counts) -> list:
    """[(k0, k1)] of each device: consecutive kernel ranges of the given sizes."""
    edges = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(len(counts))]
