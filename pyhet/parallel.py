"""The partitioned conv layer: each device owns a contiguous share of the layer's kernels.

Forward: every device gets the layer input and computes its output channels, then bias, ReLU
and max-pool on the spot (all per channel, so this is exact); it returns only its pooled slice,
and the slices are joined along the channel axis. Backward: each device gets its slice of the
output gradient, computes its weight and bias gradients and its part of the input gradient's
im2col matrix (dcol = w_i^T dy_i); the parts are summed and folded back once by col2im. The
parameter update runs where the parameters live.

Letters: x (N, C, H, W) layer input, out (N, K, PH, PW) pooled output, counts[i] kernels on
device i, sum(counts) = K.
"""

from __future__ import annotations

import numpy as np

from .errors import DeviceError


class PartitionedConv:
    """conv (valid, stride 1) -> ReLU -> max-pool, its K kernels spread over devices."""

    def __init__(self, name: str, w, b, devices, counts, pool: int = 2, need_dx: bool = True,
                 host=None):
        # w (K, C, R, S), b (K,) host float32; counts: kernels per device, in device order
        self.name, self.pool, self.need_dx = name, pool, need_dx
        self.devices = list(devices)
        self.kernel_shape = w.shape[1:]
        self.host = host                     # backend that sums dcol parts and runs col2im
        self.install(w, b, None, None, counts)

    # --- the partition --------------------------------------------------------------------------

    @property
    def K(self) -> int:
        return int(sum(self.counts))

    def install(self, w, b, vw, vb, counts):
        counts = [int(c) for c in counts]
        if len(counts) != len(self.devices) or min(counts) < 0 or sum(counts) != w.shape[0]:
            raise DeviceError(f"{self.name}: a partition of {w.shape[0]} kernels over "
                              f"{len(self.devices)} devices is needed, got {counts}")
        self.counts = counts
        bounds = np.concatenate([[0], np.cumsum(counts)])
        self.bounds = [(int(bounds[i]), int(bounds[i + 1])) for i in range(len(counts))]
        part = (lambda a, k0, k1: None if a is None else a[k0:k1])
        futures = [d.submit("load_shard", d.load_shard, self.name, w[k0:k1], b[k0:k1],
                            part(vw, k0, k1), part(vb, k0, k1), self.pool)
                   for d, (k0, k1) in zip(self.devices, self.bounds)]
        _gather(futures)

    def gather_state(self):
        """(w, b, vw, vb) of the whole layer, joined from the devices (host arrays)."""
        parts = _gather([d.submit("get_shard", d.get_shard, self.name) for d in self.devices])
        w, b = (np.concatenate([p[i] for p in parts]) for i in (0, 1))
        moms = []
        for i in (2, 3):
            started = [p[i] is not None for p in parts if p[0].shape[0]]
            moms.append(np.concatenate([p[i] if p[i] is not None else
                                        np.zeros_like(p[i - 2]) for p in parts])
                        if any(started) else None)
        return w, b, moms[0], moms[1]

    def repartition(self, counts):
        """Move kernels between devices (weights and momentum with them); exact."""
        if list(counts) == self.counts:
            return
        w, b, vw, vb = self.gather_state()
        self.install(w, b, vw, vb, counts)

    # --- forward / backward / step ------------------------------------------------------------

    def forward(self, x):
        """x (N, C, H, W) -> out (N, K, PH, PW), host arrays."""
        self.x_shape = x.shape
        futures = [d.submit(f"{self.name} forward", d.conv_forward, self.name, x)
                   for d in self.devices]
        return np.concatenate(_gather(futures), axis=1)

    def backward(self, dout):
        """dout (N, K, PH, PW) -> dx (N, C, H, W), or None when the layer needs no dx."""
        futures = [d.submit(f"{self.name} backward", d.conv_backward, self.name,
                            dout[:, k0:k1], self.need_dx)
                   for d, (k0, k1) in zip(self.devices, self.bounds)]
        parts = [p for p in _gather(futures) if p is not None]
        if not self.need_dx:
            return None
        dcol = parts[0]
        for p in parts[1:]:
            dcol = dcol + p if dcol is parts[0] else dcol.__iadd__(p)
        R, S = self.kernel_shape[1], self.kernel_shape[2]
        return self.host.col2im(dcol, self.x_shape, R, S)

    def step(self, cfg):
        _gather([d.submit(f"{self.name} update", d.sgd_step, self.name, cfg)
                 for d in self.devices])


def _gather(futures):
    """Wait for every future; re-raise the first error once all have finished."""
    results, error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except Exception as e:  # keep waiting for the others so none is left running
            error = error or e
            results.append(None)
    if error is not None:
        raise error
    return results
