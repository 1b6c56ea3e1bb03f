"""The C++ core as a backend: packed GEMM, im2col/col2im and the fused bias + ReLU + max-pool,
each call on this device's own team of `threads` OpenMP threads (the GIL is released inside).

Same operations and letters as numpy_ref; arrays are float32 NumPy arrays.
The conv block keeps the GEMM's natural (K, N, OH, OW) layout for its output and lets the fused
pooling kernel write the pooled result in NCHW order, so no transposes are spent on the big
arrays. Large work buffers are kept between steps (first-touch page faults on an 80 MB im2col
matrix cost more than the copy itself).
"""

from __future__ import annotations

import numpy as np

from .. import ops
from . import numpy_ref as ref


class CpuBackend:
    name = "cpu"
    xp = np

    def __init__(self, threads: int = 1):
        self.threads = int(threads)
        self._buffers: dict = {}

    # --- arrays -----------------------------------------------------------------------------

    def asarray(self, a):
        return np.ascontiguousarray(a, dtype=np.float32)

    def to_host(self, a):
        return a

    def buffer(self, key, shape, dtype=np.float32):
        """A work array kept between calls with the same key and shape (contents undefined)."""
        a = self._buffers.get(key)
        if a is None or a.shape != tuple(shape) or a.dtype != dtype:
            a = np.empty(shape, dtype)
            self._buffers[key] = a
        return a

    # --- im2col -----------------------------------------------------------------------------

    def im2col(self, x, R, S, key=None):
        """x (N, C, H, W) -> col (C*R*S, N*OH*OW); with a key, into a kept buffer."""
        N, C, H, W = x.shape
        shape = (C * R * S, N * (H - R + 1) * (W - S + 1))
        out = self.buffer(("col", key), shape) if key is not None else None
        return ops.im2col(x, R, S, out=out, threads=self.threads)

    def col2im(self, dcol, x_shape, R, S):
        return ops.col2im(dcol, x_shape, R, S, threads=self.threads)

    # --- conv block: GEMM, then bias + ReLU + max-pool in one pass --------------------------

    def block_forward(self, col, x_shape, w, b, pool, key=None):
        """col (C*R*S, N*OH*OW), w (K, C, R, S), b (K,) -> out (N, K, PH, PW), saved."""
        N, C, H, W = x_shape
        K, _, R, S = w.shape
        OH, OW = H - R + 1, W - S + 1
        y = self.buffer(("y", key), (K, N * OH * OW)) if key is not None else None
        y = ops.sgemm(w.reshape(K, -1), col, y, threads=self.threads)     # (K, N*OH*OW)
        out, arg = ops.bias_relu_maxpool(y.reshape(K, N, OH, OW), b, pool, threads=self.threads)
        return out, (arg, (K, N, OH, OW), pool, key)

    def block_backward(self, dout, saved, col, w, need_dcol):
        """dout (N, K, PH, PW) -> dcol (C*R*S, N*OH*OW) or None, dw (K, C, R, S), db (K,)."""
        arg, y_shape, pool, key = saved
        K = w.shape[0]
        dy = self.buffer(("dy", key), y_shape) if key is not None else None
        dy = ops.bias_relu_maxpool_backward(dout, arg, y_shape, pool, out=dy,
                                            threads=self.threads).reshape(K, -1)
        dw = ops.sgemm(dy, col, trans_b=True, threads=self.threads).reshape(w.shape)
        db = dy.sum(axis=1, dtype=np.float32)
        dcol = None
        if need_dcol:
            dcol = self.buffer(("dcol", key), col.shape) if key is not None else None
            dcol = ops.sgemm(w.reshape(K, -1), dy, dcol, trans_a=True, threads=self.threads)
        return dcol, dw, db

    # --- fc and loss (on the master) --------------------------------------------------------

    def linear_forward(self, x, w, b):
        """x (N, F), w (M, F), b (M,) -> y (N, M)."""
        y = ops.sgemm(x, w, trans_b=True, threads=self.threads)
        y += b
        return y

    def linear_backward(self, dy, x, w, need_dx=True):
        """dy (N, M) -> dx (N, F) or None, dw (M, F), db (M,)."""
        dx = ops.sgemm(dy, w, threads=self.threads) if need_dx else None
        dw = ops.sgemm(dy, x, trans_a=True, threads=self.threads)
        return dx, dw, dy.sum(axis=0)

    def softmax_cross_entropy(self, logits, labels):
        return ref.softmax_cross_entropy(logits, labels)
