"""The reference backend: every operation of the network, written to be read.

It is the oracle of the tests and a device kind of its own (``--devices numpy``). Each function
takes arrays of one array module, NumPy or CuPy (``xp``), and works in their dtype, so the
gradient checks run it in float64 and the GPU backend runs it on CuPy arrays.

Letters: N images, C input channels, (H, W) input plane, K kernels (output channels),
(R, S) kernel size, (OH, OW) output plane, F features, M classes.
  x (N, C, H, W)   w (K, C, R, S)   b (K,)   y (N, K, OH, OW)
  col (C*R*S, N*OH*OW): row (c, i, j), column (n, oh, ow)
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import numpy as np

from ..geometry import conv_out_size as out_size
from ..geometry import pool_out_size
from ..optim import sgd_update, sgd_update_into


def array_module(a):
    """numpy, or cupy for a CuPy array (cupy is imported only if such an array exists)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def host_available_memory():
    """Bytes of host memory available to new allocations (Linux), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# glibc's malloc: blocks of at least this many bytes are mapped afresh (mmap) on every
# allocation, and free memory beyond this at the top of a heap goes back to the system
# (keep_freed_memory)
KEPT_MMAP_THRESHOLD = 32 << 20
KEPT_TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # mallopt's parameters (malloc.h)
_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_kept = None


def keep_freed_memory() -> bool:
    """Has glibc's malloc keep the memory that NumPy's temporaries free for the next ones: a
    `numpy` device makes and frees its arrays afresh every step (im2col's matrix, the GEMMs'
    outputs, their transposed copies: 1-8 MB each on a small network at batch 64), and with
    glibc's defaults, which adapt to what the process freed before, some processes mapped
    them afresh from the system, or gave the top of the heap back, at every free: a short
    network's step faulted in 4,000-6,000 pages (16-24 MB) each time and ran 30-50% longer
    than in another process that did not (40 ms against 27 ms), its speed then a matter of
    what the process had allocated before (the layers' calibration, the batch's array).
    Blocks under KEPT_MMAP_THRESHOLD now come from the heap, and up to KEPT_TRIM_THRESHOLD
    of free memory stays there (the paper network's larger arrays are mapped as before).
    Once per process; not where the process sets these itself (MALLOC_MMAP_THRESHOLD_,
    MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, or glibc.malloc tunables in GLIBC_TUNABLES in its
    environment), nor beside another C library. True where set."""
    global _kept
    if _kept is None:
        _kept = False
        tunables = os.environ.get("GLIBC_TUNABLES", "")
        if (platform.libc_ver()[0] == "glibc" and "glibc.malloc." not in tunables
                and not any(v in os.environ for v in _MALLOC_SETTINGS)):
            try:
                mallopt = ctypes.CDLL(None).mallopt
                mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                _kept = bool(mallopt(_M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD) and
                             mallopt(_M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD))
            except (OSError, AttributeError):
                pass
    return _kept


# ================================================================================================
# im2col and col2im


def im2col(x, R: int, S: int, stride: int = 1, pad: int = 0):
    """x (N, C, H, W) -> col (C*R*S, N*OH*OW)."""
    xp = array_module(x)
    N, C, H, W = x.shape
    OH, OW = out_size(H, R, stride, pad), out_size(W, S, stride, pad)
    xpad = xp.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))) if pad else x
    col = xp.empty((C, R, S, N, OH, OW), x.dtype)
    for i in range(R):
        for j in range(S):
            # the input pixels that kernel tap (i, j) sees, for every output position
            patch = xpad[:, :, i:i + stride * OH:stride, j:j + stride * OW:stride]
            col[:, i, j] = patch.transpose(1, 0, 2, 3)
    return col.reshape(C * R * S, N * OH * OW)


def col2im(col, x_shape, R: int, S: int, stride: int = 1, pad: int = 0):
    """The mirror of im2col: each col entry is added back to the pixel it came from."""
    xp = array_module(col)
    N, C, H, W = x_shape
    OH, OW = out_size(H, R, stride, pad), out_size(W, S, stride, pad)
    col = col.reshape(C, R, S, N, OH, OW)
    dxpad = xp.zeros((N, C, H + 2 * pad, W + 2 * pad), col.dtype)
    for i in range(R):
        for j in range(S):
            dxpad[:, :, i:i + stride * OH:stride, j:j + stride * OW:stride] += (
                col[:, i, j].transpose(1, 0, 2, 3))
    return dxpad[:, :, pad:pad + H, pad:pad + W] if pad else dxpad


# ================================================================================================
# Conv2d: y = w * x + b, as one GEMM over the im2col matrix. The *_col forms start from the im2col
# matrix, so that several devices in one process can share one im2col of their common input.


def conv2d_forward_col(col, x_shape, w, b, stride: int = 1, pad: int = 0):
    """col (C*R*S, N*OH*OW), w (K, C, R, S), b (K,) -> y (N, K, OH, OW)."""
    N, C, H, W = x_shape
    K, _, R, S = w.shape
    OH, OW = out_size(H, R, stride, pad), out_size(W, S, stride, pad)
    y = w.reshape(K, -1) @ col + b[:, None]                # (K, N*OH*OW)
    return y.reshape(K, N, OH, OW).transpose(1, 0, 2, 3).copy()


def conv2d_backward_col(dy, col, w, need_dcol: bool = True):
    """dy (N, K, OH, OW) -> dcol (C*R*S, N*OH*OW) or None, dw (K, C, R, S), db (K,)."""
    K = w.shape[0]
    dy2 = dy.transpose(1, 0, 2, 3).reshape(K, -1)          # (K, N*OH*OW)
    dw = (dy2 @ col.T).reshape(w.shape)
    db = dy2.sum(axis=1)
    dcol = w.reshape(K, -1).T @ dy2 if need_dcol else None
    return dcol, dw, db


def conv2d_forward(x, w, b, stride: int = 1, pad: int = 0):
    """x (N, C, H, W), w (K, C, R, S), b (K,) -> y (N, K, OH, OW), col (kept for backward)."""
    col = im2col(x, w.shape[2], w.shape[3], stride, pad)
    return conv2d_forward_col(col, x.shape, w, b, stride, pad), col


def conv2d_backward(dy, col, x_shape, w, stride: int = 1, pad: int = 0, need_dx: bool = True):
    """dy (N, K, OH, OW) -> dx (N, C, H, W) or None, dw (K, C, R, S), db (K,)."""
    dcol, dw, db = conv2d_backward_col(dy, col, w, need_dx)
    dx = col2im(dcol, x_shape, w.shape[2], w.shape[3], stride, pad) if need_dx else None
    return dx, dw, db


# ================================================================================================
# ReLU


def relu_forward(x):
    xp = array_module(x)
    return xp.maximum(x, 0)


def relu_backward(dy, y):
    """The gradient passes where the output is positive."""
    return dy * (y > 0)


# ================================================================================================
# MaxPool2d, floor mode (PyTorch's default): rows and columns that do not fill a window drop.
# arg (N, C, PH, PW) is the flat index h * W + w of each window's maximum in its plane; the
# first maximum wins and a NaN wins over everything, as in PyTorch.


def maxpool_forward(x, k: int = 2, stride: int | None = None):
    """x (N, C, H, W) -> y (N, C, PH, PW), arg (N, C, PH, PW) int32.

    Each window's later places replace the maximum so far by a select of bits through a mask
    (v's where it is taken, the maximum's where it is kept), not by where(): NumPy's where()
    branches on each element, so that on images whose maxima fall in no pattern (random ones)
    it took 3-4 times as long as on smooth ones (a 64 x 16 x 32 x 32 pool: 8 ms against 4; now
    1.3-1.5 ms on either). Every place is first copied whole (contiguous: the operations after
    it run on vectors). A GPU's where() does not branch: there (CuPy) it takes where(), 7
    kernels a place against 13."""
    xp = array_module(x)
    s = k if stride is None else stride
    N, C, H, W = x.shape
    PH, PW = pool_out_size(H, k, s), pool_out_size(W, k, s)
    rows = (xp.arange(PH) * s)[:, None]                    # top row of each window
    cols = (xp.arange(PW) * s)[None, :]                    # left column of each window
    top_left = (rows * W + cols).astype(np.int32)          # each window's first place
    y = x[:, :, 0:s * PH:s, 0:s * PW:s].copy()               # (C order)
    arg = xp.broadcast_to(top_left, y.shape).copy()
    # an integer as wide as x's numbers (none for a long double: its windows take where())
    same = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}.get(y.dtype.itemsize)
    bits = None if same is None or xp is not np else y.view(same)   # y's bits, in place
    for i in range(k):
        for j in range(k):
            if i == 0 and j == 0:
                continue
            v = xp.ascontiguousarray(x[:, :, i:i + s * PH:s, j:j + s * PW:s])
            # kept where v <= y or y is NaN: v replaces y where v > y or where v is NaN and
            # y not (a NaN wins; of several, and of equal maxima, the first)
            keep = xp.less_equal(v, y)
            keep |= xp.isnan(y)
            at = top_left + np.int32(i * W + j)
            if bits is None:
                y, arg = xp.where(keep, y, v), xp.where(keep, arg, at)
                continue
            taken = keep.view(np.int8) - np.int8(1)          # -1 where v is taken, else 0
            mask = taken.astype(same)
            change = xp.bitwise_xor(v.view(same), bits)    # (v may be x itself: not in place)
            change &= mask
            bits ^= change
            if same is not np.int32:
                mask = taken.astype(np.int32)
            change = xp.bitwise_xor(at, arg)
            change &= mask
            arg ^= change
    return y, arg


def maxpool_backward(dy, arg, x_shape, k: int | None = None, stride: int | None = None):
    """dy, arg (N, C, PH, PW) -> dx (N, C, H, W): each gradient goes to its window's maximum.

    Given the window k (and stride, default k), the windows are taken in ceil(k / stride)^2
    rounds of windows that do not overlap, so that no round adds twice to one place: the sums
    come in a fixed order on every array module (a GPU's scatter-add adds by atomics, in an
    order that changes from run to run where windows overlap). Without k, one scatter-add."""
    xp = array_module(dy)
    N, C, H, W = x_shape
    PH, PW = arg.shape[2], arg.shape[3]
    dx = xp.zeros((N * C, H * W), dy.dtype)
    planes = xp.arange(N * C)[:, None]
    if k is None:
        _scatter_add(dx, (planes, arg.reshape(N * C, PH * PW)), dy.reshape(N * C, PH * PW))
        return dx.reshape(x_shape)
    m = -(-k // (k if stride is None else stride))   # windows m apart do not overlap
    a, d = arg.reshape(N * C, PH, PW), dy.reshape(N * C, PH, PW)
    for i in range(min(m, PH)):
        for j in range(min(m, PW)):
            idx, part = a[:, i::m, j::m], d[:, i::m, j::m]
            n = idx.shape[1] * idx.shape[2]                 # (not -1: N * C may be 0)
            dx[planes, idx.reshape(N * C, n)] += part.reshape(N * C, n)   # no index twice
    return dx.reshape(x_shape)


def _scatter_add(a, index, values):
    xp = array_module(a)
    if xp is np:
        np.add.at(a, index, values)
    elif hasattr(xp.add, "at"):  # CuPy 13 and later (cupyx.scatter_add is deprecated)
        xp.add.at(a, index, values)
    else:
        import cupyx

        cupyx.scatter_add(a, index, values)


# ================================================================================================
# Flatten, Linear


def flatten_forward(x):
    """x (N, C, H, W) -> (N, C*H*W), in (C, H, W) order as torch.flatten does."""
    return x.reshape(x.shape[0], -1)


def linear_forward(x, w, b):
    """x (N, F), w (M, F), b (M,) -> y (N, M) = x @ w.T + b."""
    return x @ w.T + b


def linear_backward(dy, x, w, need_dx: bool = True):
    """dy (N, M) -> dx (N, F) or None, dw (M, F), db (M,)."""
    dx = dy @ w if need_dx else None
    return dx, dy.T @ x, dy.sum(axis=0)


# ================================================================================================
# Softmax cross-entropy, mean over the batch


def softmax(logits):
    """logits (N, M) -> probabilities (N, M), each row summing to 1."""
    xp = array_module(logits)
    with np.errstate(over="ignore", invalid="ignore"):   # diverged logits: see below
        e = xp.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)


def softmax_cross_entropy(logits, labels):
    """logits (N, M), labels (N,) int -> loss (a 0-d array), dlogits (N, M). Logits that are
    infinite or NaN (a run that diverged) give a NaN loss without NumPy's warnings: the
    callers check the loss and the weights and say what went wrong in their own words."""
    xp = array_module(logits)
    N = logits.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        shifted = logits - logits.max(axis=1, keepdims=True)
        logsumexp = xp.log(xp.exp(shifted).sum(axis=1))
        picked = shifted[xp.arange(N), labels]
        loss = (logsumexp - picked).mean()
        dlogits = xp.exp(shifted - logsumexp[:, None])         # softmax
        dlogits[xp.arange(N), labels] -= 1
        return loss, dlogits / N


# ================================================================================================
# The conv block of the network, conv (stride, padding) -> ReLU -> max-pool (window, stride; none
# when the window and stride are 1), from the im2col matrix of its input. The C++ backend fuses
# the same block; tests compare the two.


def conv_block_forward(col, x_shape, w, b, stride: int = 1, pad: int = 0, pool: int = 2,
                       pool_stride: int | None = None):
    """col of x (N, C, H, W) -> out (N, K, PH, PW), saved (what the backward needs)."""
    pool_stride = pool if pool_stride is None else pool_stride
    r = relu_forward(conv2d_forward_col(col, x_shape, w, b, stride, pad))
    if pool == 1 and pool_stride == 1:
        return r, (r, None, 1, 1)
    out, arg = maxpool_forward(r, pool, pool_stride)
    return out, (r, arg, pool, pool_stride)


def conv_block_backward(dout, saved, col, w, need_dcol: bool = True):
    """dout (N, K, PH, PW) -> dcol (C*R*S, N*OH*OW) or None, dw (K, C, R, S), db (K,)."""
    r, arg, pool, pool_stride = saved
    dr = dout if arg is None else maxpool_backward(dout, arg, r.shape, pool, pool_stride)
    return conv2d_backward_col(relu_backward(dr, r), col, w, need_dcol)


# ================================================================================================
# The backend object: what a device of kind `numpy` computes with.


def _quiet(method):
    """The method with NumPy's warnings of overflow and NaN off. A device's worker thread has
    them off already (pyhet.devices), but as the master's backend (`--devices numpy`: the fc
    layers, the loss and their update) this runs on the calling thread, whose settings are the
    caller's (they are per thread): a run that diverges is stopped by the checks of the loss and
    the weights, which say what happened in one line."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return method(*args, **kwargs)
    return run


UPDATE_PART = 1 << 18   # numbers sgd_update_parts updates at once (1 MB temporaries)


def sgd_update_parts(p, g, v, cfg, part: int = UPDATE_PART):
    """pyhet.optim.sgd_update on NumPy arrays a part at a time: the same numbers, with
    temporaries of a part's size, not p's (a large fc layer's update needs no more memory than
    its weights, gradient and momentum). Returns the momentum buffer to keep. (Arrays that are
    not C-ordered, whose flat form would be a copy, are updated whole, in place.)"""
    if not p.flags.c_contiguous or (v is not None and not v.flags.c_contiguous):
        return sgd_update(p, g, v, cfg)
    if cfg.momentum and v is None:
        v = np.zeros_like(p)     # momentum * 0 + d is d, the first step's buffer
    flat_p, flat_g = p.reshape(-1), np.ascontiguousarray(g).reshape(-1)
    flat_v = None if v is None else v.reshape(-1)
    for i in range(0, flat_p.size, part):
        sgd_update(flat_p[i:i + part], flat_g[i:i + part],
                   None if flat_v is None else flat_v[i:i + part], cfg)
    return v


def sgd_update_into_parts(p, g, v, cfg, p_out=None, v_out=None, part: int = UPDATE_PART):
    """pyhet.optim.sgd_update_into on NumPy arrays a part at a time: the same numbers (its rule
    written out, each term into the outputs or one scratch part), into the same arrays (new ones
    where p_out or v_out is None). Its whole-array temporaries (the paper network's conv2: 75 MB
    each, four of them) were mapped afresh and faulted in by every update, 0.1-0.25 s of a numpy
    device's step; temporaries made part by part were still given back to the system and
    faulted in again in some states of the worker's heap. (Arrays that are not C-ordered, or of
    another dtype than p, are updated whole.)"""
    if any(a is not None and not a.flags.c_contiguous for a in (p, g, v, p_out, v_out)):
        return sgd_update_into(p, g, v, cfg, p_out, v_out)
    if p_out is None:
        p_out = np.empty_like(p)
    keeps_v = bool(cfg.momentum) or v is not None
    if v_out is None and keeps_v:
        v_out = np.empty_like(p)
    if any(a is not None and a.dtype != p.dtype for a in (g, v, p_out, v_out)):
        return sgd_update_into(p, g, v, cfg, p_out, v_out)
    flat = [None if a is None else a.reshape(-1) for a in (p, g, v, p_out, v_out)]
    scratch = np.empty(min(part, flat[0].size), p.dtype)
    for i in range(0, flat[0].size, part):
        fp, fg, fv, fpo, fvo = (None if a is None else a[i:i + part] for a in flat)
        tmp = scratch[:fp.size]
        d = fg
        if cfg.weight_decay:                      # d = g + weight_decay * p
            np.multiply(fp, cfg.weight_decay, out=tmp)
            np.add(fg, tmp, out=tmp)
            d = tmp
        if cfg.momentum:
            if fv is None:                        # v = d
                fvo[...] = d
            else:                                 # v = momentum * v + d
                np.multiply(fv, cfg.momentum, out=fvo)
                np.add(fvo, d, out=fvo)
            d = fvo
        elif keeps_v:
            fvo[...] = fv
        np.multiply(d, cfg.lr, out=tmp)           # p = p - lr * d
        np.subtract(fp, tmp, out=fpo)
    return p_out, (v_out if keeps_v else None)


class NumpyBackend:
    """The reference backend as a device kind: host arrays, plain NumPy. Conv methods take the
    layer's geometry g (pyhet.geometry.ConvGeometry). Its computations raise no NumPy warnings
    of overflow or NaN (_quiet)."""

    name = "numpy"
    xp = np

    def __init__(self, threads: int = 1):
        self.threads = threads  # NumPy's BLAS has its own threads; kept for a uniform interface
        keep_freed_memory()

    def asarray(self, a):
        return np.ascontiguousarray(a)

    def free_memory(self):
        return host_available_memory()

    def to_host(self, a):
        return a

    @_quiet
    def im2col(self, x, g, key=None):
        return im2col(x, g.R, g.S, g.stride, g.pad)

    @_quiet
    def col2im(self, dcol, x_shape, g):
        return col2im(dcol, x_shape, g.R, g.S, g.stride, g.pad)

    @_quiet
    def block_forward(self, col, x_shape, w, b, g, key=None):
        return conv_block_forward(col, x_shape, w, b, g.stride, g.pad, g.pool, g.pool_stride)

    @_quiet
    def block_backward(self, dout, saved, col, w, need_dcol):
        return conv_block_backward(dout, saved, col, w, need_dcol)

    @_quiet
    def linear_forward(self, x, w, b):
        return linear_forward(x, w, b)

    @_quiet
    def linear_backward(self, dy, x, w, need_dx=True):
        return linear_backward(dy, x, w, need_dx)

    @_quiet
    def softmax_cross_entropy(self, logits, labels):
        return softmax_cross_entropy(logits, labels)

    @_quiet
    def sgd_update(self, p, g, v, cfg):
        return sgd_update_parts(p, g, v, cfg)

    @_quiet
    def sgd_update_into(self, p, g, v, cfg, p_out=None, v_out=None):
        return sgd_update_into_parts(p, g, v, cfg, p_out, v_out)
