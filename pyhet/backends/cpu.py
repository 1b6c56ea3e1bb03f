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

from .. import _core, ops
from ..optim import sgd_update_into
from . import numpy_ref as ref


# The input gradient's parts are joined into one product up to this many kernels in all: the
# core's GEMM takes K in blocks of 512 (PYHET_GEMM_KC), so that such a product passes over its
# output once.
JOIN_KERNELS = 512
# Up to this many kernels in all, the input gradient goes straight from the product to col2im a
# block at a time (ops.col2im_product): its dcol would be most of the product's memory traffic
# (on the default network's conv2, 64 kernels, 1.1-1.2x faster with one or two threads; about
# even at 512 kernels, 0.83-0.93x at the paper network's 1500).
COL2IM_PRODUCT_KERNELS = 256


class CpuBackend:
    name = "cpu"
    xp = np

    def __init__(self, threads: int = 1):
        self.threads = int(threads)
        self._buffers: dict = {}

    def start(self):
        """On the device's worker thread, before any work: its OpenMP team made now, right
        after pyhet.specs.check_threads found that many threads can be had (libgomp ends the
        process where it cannot make one)."""
        ops.start_team(self.threads)

    # --- arrays -----------------------------------------------------------------------------

    def asarray(self, a):
        return np.ascontiguousarray(a, dtype=np.float32)

    def to_host(self, a):
        return a

    def free_memory(self):
        return ref.host_available_memory()

    def release(self, key):
        """Drop the work arrays kept under `key` (a layer whose shard is dropped)."""
        for k in [k for k in self._buffers if k[1] == key]:
            del self._buffers[k]

    def buffer(self, key, shape, dtype=np.float32):
        """A work array kept between calls with the same key and shape (contents undefined)."""
        a = self._buffers.get(key)
        if a is None or a.shape != tuple(shape) or a.dtype != dtype:
            a = np.empty(shape, dtype)
            self._buffers[key] = a
        return a

    # --- im2col -----------------------------------------------------------------------------
    # Conv methods take the layer's geometry g (pyhet.geometry.ConvGeometry).

    def im2col(self, x, g, key=None):
        """x (N, C, H, W) -> col (C*R*S, N*OH*OW); with a key, into a kept buffer."""
        out = self.buffer(("col", key), g.col_shape(x.shape[0])) if key is not None else None
        return ops.im2col(x, g.R, g.S, g.stride, g.pad, out=out, threads=self.threads)

    def col2im(self, dcol, x_shape, g):
        return ops.col2im(dcol, x_shape, g.R, g.S, g.stride, g.pad, threads=self.threads)

    # --- conv block: GEMM, then bias + ReLU + max-pool in one pass --------------------------

    def block_forward(self, col, x_shape, w, b, g, key=None, packed=None):
        """col (C*R*S, N*OH*OW), w (K, C, R, S), b (K,) -> out (N, K, PH, PW), saved.
        The epilogue also puts the output in NCHW order; without a pool it is bias + ReLU.
        packed: col already packed whole (ops.packed_b), or None."""
        K = w.shape[0]
        y_shape = g.y_shape(K, x_shape[0])                                # (K, N, OH, OW)
        y = self.buffer(("y", key), y_shape[:1] + (col.shape[1],)) if key is not None else None
        if packed is not None:
            y = ops.sgemm_packed(w.reshape(K, -1), packed, y, threads=self.threads)
        else:
            y = ops.sgemm(w.reshape(K, -1), col, y, threads=self.threads)  # (K, N*OH*OW)
        out, arg = ops.bias_relu_maxpool(y.reshape(y_shape), b, g.pool, g.pool_stride,
                                         threads=self.threads)
        return out, (arg, y_shape, g, key)

    def block_backward(self, dout, saved, col, w, need_dcol):
        """dout (N, K, PH, PW) -> dcol (C*R*S, N*OH*OW) or None, dw (K, C, R, S), db (K,)."""
        key = saved[3]
        dy = self.block_grad_output(dout, saved)
        dw, db = self.block_grad_params(dy, col, w, key)
        dcol = None
        if need_dcol:
            # col is read for the last time above; where it is this backend's own kept matrix
            # (with a key), dcol takes its place: no second matrix of that size
            dcol = col if key is not None else None
            dcol = ops.sgemm(w.reshape(w.shape[0], -1), dy, dcol, trans_a=True,
                             threads=self.threads)
        return dcol, dw, db

    def block_grad_output(self, dout, saved, out=None):
        """dout (N, K, PH, PW) -> dy (K, N*OH*OW): the gradient of the conv output (into out,
        a C-contiguous (K, N*OH*OW), when given)."""
        arg, y_shape, g, key = saved
        if out is not None:
            dy = out.reshape(y_shape)   # a view: out is C-contiguous
        else:
            dy = self.buffer(("dy", key), y_shape) if key is not None else None
        dy = ops.bias_relu_maxpool_backward(dout, arg, y_shape, g.pool, g.pool_stride, out=dy,
                                            threads=self.threads)
        return dy.reshape(y_shape[0], -1)

    def block_grad_params(self, dy, col, w, key=None, packed=None, transposed=False):
        """dy (K, N*OH*OW) -> dw (K, C, R, S) = dy @ col^T, db (K,); packed: col^T already
        packed whole (a PackedB, or a PackedQuadrants of its sums), or, with transposed, col
        packed for the forward (a PackedB or PackedQuadrants), read transposed; or None. With
        a key, dw is a kept array (a fresh one of this size every step would cost its page
        faults every step)."""
        K = w.shape[0]
        dw = self.buffer(("dw", key), (K, col.shape[0])) if key is not None else None
        if transposed:
            dw = ops.sgemm_packed_t(dy, packed, dw, threads=self.threads)
        elif packed is not None:
            dw = ops.sgemm_packed(dy, packed, dw, threads=self.threads)
        else:
            dw = ops.sgemm(dy, col, dw, trans_b=True, threads=self.threads)
        return dw.reshape(w.shape), dy.sum(axis=1, dtype=np.float32)

    # --- work on a share of a matrix that several devices of one process fill together -----

    def im2col_into(self, x, g, col):
        """Fill col, an im2col matrix kept by others (the host group's of one device)."""
        ops.im2col(x, g.R, g.S, g.stride, g.pad, out=col, threads=self.threads)

    def im2col_pack_part(self, x, g, fwd, col_t, part):
        """Fill a part of col packed for the forward product (fwd) and of col^T packed for the
        weight gradient (col_t; None: not packed), straight from x: the columns of images
        [n0, n1), or, packed as their quadrants' sums (ops.PackedQuadrants), the (image, sum)
        units [u0, u1) (ops.quadrant_units)."""
        if isinstance(fwd, ops.PackedQuadrants):
            ops.im2col_pack_quadrants(x, g.R, g.S, g.stride, g.pad, fwd=fwd, t=col_t,
                                      units=part, threads=self.threads)
        else:
            ops.im2col_pack(x, g.R, g.S, g.stride, g.pad, fwd=fwd, t=col_t, images=part,
                            threads=self.threads)

    def input_grad_part(self, parts, dcol, dx, g, channels, dw=None):
        """Channels [c0, c1) of the layer's input gradient, from every shard of the layer:
        dcol[rows] = sum_j w_j[:, rows]^T @ dy_j (rows of those channels), then col2im of those
        channels into dx (for up to COL2IM_PRODUCT_KERNELS kernels in all, a block of dcol at a
        time, dcol left as it was). parts: [(w_j (k_j, C*R*S), dy_j (k_j, N*OH*OW)), ...]. dw:
        ([dw_j (k_j, C*R*S), ...], fwd), the shards' weight gradients, of which this fills the
        columns of those rows: dy_j @ col[rows]^T, from col packed for the forward (fwd, read
        transposed); or None. Where fwd holds col's quadrants' sums (ops.PackedQuadrants),
        the columns are instead a share of each half of dw's, in proportion to the channels
        (Strassen's scheme makes the four quadrants of dw's columns together)."""
        r0, r1 = channels[0] * g.R * g.S, channels[1] * g.R * g.S
        block = dcol[r0:r1]
        kernels = sum(w2.shape[0] for w2, _ in parts)
        # where the shards' dy, weights and weight gradients are consecutive rows of the
        # group's arrays (as the group's backward and update write them), one product over all
        # the kernels, not one per shard: it passes over the block once and takes Strassen's
        # scheme where the whole layer does
        dy_all = _joined_rows([dy for _, dy in parts]) if len(parts) > 1 else None
        if dw is not None:
            grads, fwd = dw
            dw_all = _joined_rows(grads) if dy_all is not None else None
            pairs = [(dw_all, dy_all)] if dw_all is not None else zip(
                grads, (dy for _, dy in parts))
            if isinstance(fwd, ops.PackedQuadrants):
                half = fwd.k // 2
                q = (channels[0] * half // g.C, channels[1] * half // g.C)
                for dw_j, dy in pairs:
                    ops.sgemm_packed_t(dy, fwd, dw_j, rows=q, threads=self.threads)
            else:
                for dw_j, dy in pairs:
                    ops.sgemm_packed_t(dy, fwd, dw_j[:, r0:r1], rows=(r0, r1),
                                       threads=self.threads)
        if dy_all is not None:
            w_all = _joined_rows([w2 for w2, _ in parts])
            if w_all is not None:
                parts = [(w_all, dy_all)]
        if kernels <= COL2IM_PRODUCT_KERNELS:
            # few kernels: the rows of dcol a block at a time, each added into dx while in cache
            # (dcol itself is then neither written nor read back)
            ops.col2im_product([w2 for w2, _ in parts], [dy for _, dy in parts], dx.shape, g.R,
                               g.S, g.stride, g.pad, out=dx, channels=channels,
                               threads=self.threads)
            return
        if len(parts) > 1 and kernels <= JOIN_KERNELS and kernels < r1 - r0:
            # few kernels in all: one product over all of them passes over the block once
            # (the GEMM's K block holds them), not once per part; the joined copies are smaller
            # than the block
            parts = [(np.concatenate([w2[:, r0:r1] for w2, _ in parts]),
                      np.concatenate([dy for _, dy in parts]))]
            r0, r1 = 0, r1 - r0
        for j, (w2, dy) in enumerate(parts):
            ops.sgemm(w2[:, r0:r1], dy, block, trans_a=True, beta=0.0 if j == 0 else 1.0,
                      threads=self.threads)
        if not parts:
            block[...] = 0
        ops.col2im(dcol, dx.shape, g.R, g.S, g.stride, g.pad, out=dx, channels=channels,
                   threads=self.threads)

    # --- the update, in one pass over memory --------------------------------------------------

    def sgd_update(self, p, g, v, cfg):
        """As pyhet.optim.sgd_update (torch.optim.SGD's rule), on the C++ core; without
        momentum, NumPy's, a part at a time (its temporaries a part's size, not p's)."""
        _same_shape(g, p, "g")
        if not cfg.momentum or not p.flags.c_contiguous or (
                v is not None and not v.flags.c_contiguous):
            # (the core updates flat arrays: one not C-ordered would be a copy, its update lost)
            return ref.sgd_update_parts(p, g, v, cfg)
        first = v is None
        if first:
            v = np.empty_like(p)
        _core.sgd_update(p.reshape(-1), np.ascontiguousarray(g).reshape(-1), v.reshape(-1),
                         cfg.lr, cfg.momentum, cfg.weight_decay, first, self.threads)
        return v

    def sgd_update_into(self, p, g, v, cfg, p_out=None, v_out=None):
        """As pyhet.optim.sgd_update_into, in one pass on the C++ core: the new state goes to
        p_out and v_out (None: new arrays), p and v stay as they were."""
        if not cfg.momentum:
            return sgd_update_into(p, g, v, cfg, p_out, v_out)
        first = v is None
        p_out = np.empty_like(p) if p_out is None else _update_out(p_out, p, "p_out")
        v_out = np.empty_like(p) if v_out is None else _update_out(v_out, p, "v_out")
        _same_shape(g, p, "g")
        v = np.empty_like(p) if first else v     # not read on the first step
        _core.sgd_update(p.reshape(-1), np.ascontiguousarray(g).reshape(-1),
                         v.reshape(-1), cfg.lr, cfg.momentum,
                         cfg.weight_decay, first, self.threads, p_out.reshape(-1),
                         v_out.reshape(-1))
        return p_out, v_out

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


def _joined_rows(arrays):
    """The 2-D float32 arrays as one (their rows, columns) view where they are, in this order,
    consecutive rows of one C-contiguous array (views of it); else None."""
    base = arrays[0].base
    if (base is None or not isinstance(base, np.ndarray) or base.dtype != np.float32
            or not base.flags.c_contiguous):
        return None
    if arrays[0].ndim != 2:
        return None
    cols = arrays[0].shape[1]
    start = addr = arrays[0].ctypes.data
    for a in arrays:
        if (a.base is not base or a.ndim != 2 or a.dtype != np.float32 or a.shape[1] != cols
                or not a.flags.c_contiguous or a.ctypes.data != addr):
            return None
        addr += a.nbytes
    if (start - base.ctypes.data) % 4:   # not on a float of base
        return None
    first = (start - base.ctypes.data) // 4
    return base.reshape(-1)[first:first + (addr - start) // 4].reshape(-1, cols)


def _same_shape(a, p, name: str) -> None:
    if a.shape != p.shape:
        raise ValueError(f"{name}: expected the parameter's shape {p.shape}, got {a.shape}")


def _update_out(out, p, name: str):
    """An output of the update: the core writes it flat, so it must be C-ordered (a reshape of
    another order is a copy, the update written to it lost)."""
    _same_shape(out, p, name)
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name}: expected a writeable C-contiguous array")
    return out
