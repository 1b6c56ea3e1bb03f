"""Every binding of the C++ core (pyhet._core) called with odd and with bad arguments: it does
its work or raises a short ValueError or TypeError, and never crashes. On the sanitizer build
(README, "The sanitizer build") this also checks that no argument makes the core read or write
out of bounds or run into undefined behaviour. The values are checked in test_ops.py and
test_gemm.py; here it is the arguments.

Each case draws a valid call (zero sizes included) on 1, 2, 3 or 7 threads, then spoils some of
its arguments. A spoil that no call can accept (a wrong dtype or ndim, not an array, a
non-contiguous or read-only output, a bad index, thread count, size or channel range) must
raise; one that might still make a valid call (a dimension changed) may raise or run.
"""

import contextlib
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhet import _core, ops

THREADS = st.sampled_from([1, 2, 3, 7])
INT32_MAX = 2**31 - 1

# Values that no int argument (sizes, strides, padding, pool windows) and no thread count
# accepts: negative, not an int, or beyond 64 bits; and thread counts out of range.
BAD_INTS = [-1, 1.5, None, True, "3", 2**70, -2**70]
BAD_THREADS = [0, -1, 1025, 10**6, 2**31, 2**70, 2.0, None, True, "2"]
# Channel ranges that are wrong whatever the number of channels.
BAD_CHANNELS = [(-1, 0), (2, 1), (0, 2**40), "ab", (0,), 3, (0.0, 1.0)]
# Pool indices outside every plane (all of them smaller than 2**31 elements).
BAD_INDICES = [-2, -2**31, INT32_MAX]


@dataclass
class Call:
    """A call of one binding: its keyword arguments, which of them are written, which are ints
    (sizes, strides), which are index arrays (arg), whether it takes channels and threads, and
    how it was spoiled."""
    fn: object
    args: dict
    outputs: tuple = ()
    ints: tuple = ()
    indices: tuple = ()
    channels: bool = False
    ranges: tuple = ()     # (begin, end) arguments other than channels (pack_b's rows, slivers)
    packed: bool = False   # takes a PackedB
    packed_rows: str = ""  # the argument that picks the PackedB's rows (more rows then fit)
    packs: tuple = ()      # PackedB arguments other than packed (None where not given)
    quadrants: tuple = ()  # arguments that take a sequence of 7 PackedB (None where not given)
    threads: bool = True
    spoiled: list = field(default_factory=list)  # (argument, how, must raise)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Valid calls, one strategy per binding


def sgemm_call(draw, fn=_core.sgemm, threads=True):
    m, n, k = (draw(st.integers(0, 20)) for _ in range(3))
    ta, tb = draw(st.booleans()), draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args = dict(a=rand(rng, *((k, m) if ta else (m, k))), b=rand(rng, *((n, k) if tb else (k, n))),
                c=rand(rng, m, n), trans_a=ta, trans_b=tb, alpha=draw(st.sampled_from([1.0, -2.0])),
                beta=draw(st.sampled_from([0.0, 0.5])))
    if threads:
        args["threads"] = draw(THREADS)
    return Call(fn, args, outputs=("c",), threads=threads)


def sgemm_ref_call(draw):
    return sgemm_call(draw, _core.sgemm_ref, threads=False)


def sgemm_naive_call(draw):
    """The plain loop (for the benchmark): c = a @ b, no transposes."""
    m, n, k = (draw(st.integers(0, 20)) for _ in range(3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args = dict(a=rand(rng, m, k), b=rand(rng, k, n), c=rand(rng, m, n), threads=draw(THREADS))
    return Call(_core.sgemm_naive, args, outputs=("c",))


def packed_b_call(draw):
    """The room for a packed op(b): PackedB(k, n, trans_b)."""
    args = dict(k=draw(st.integers(0, 40)), n=draw(st.integers(0, 40)),
                trans_b=draw(st.booleans()))
    return Call(_core.PackedB, args, ints=("k", "n"), threads=False)


def pack_b_call(draw):
    """Pack a part of op(b) (k, n): rows (r0, r1) x slivers (s0, s1), or all of it."""
    k, n, tb = draw(st.integers(0, 40)), draw(st.integers(0, 70)), draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    packed = _core.PackedB(k, n, tb)
    args = dict(b=rand(rng, *((n, k) if tb else (k, n))), packed=packed, threads=draw(THREADS))
    for name, end in (("rows", k), ("slivers", packed.slivers)):
        if draw(st.booleans()):
            r0 = draw(st.integers(0, end))
            args[name] = (r0, draw(st.integers(r0, end)))
    return Call(_core.pack_b, args, ranges=("rows", "slivers"), packed=True)


def packed_product(draw):
    """(m, n, k, rng, args) of a product with op(b) (k, n) packed whole: args holds the
    PackedB, trans_a, alpha, beta and threads."""
    m, n, k = (draw(st.integers(0, 20)) for _ in range(3))
    tb = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    packed = _core.PackedB(k, n, tb)
    _core.pack_b(rand(rng, *((n, k) if tb else (k, n))), packed)
    return m, n, k, rng, dict(packed=packed, trans_a=draw(st.booleans()),
                              alpha=draw(st.sampled_from([1.0, -2.0])),
                              beta=draw(st.sampled_from([0.0, 0.5])), threads=draw(THREADS))


def sgemm_packed_call(draw):
    """c = alpha * op(a) @ op(b) + beta * c, op(b) (k, n) packed whole."""
    m, n, k, rng, args = packed_product(draw)
    args.update(a=rand(rng, *((k, m) if args["trans_a"] else (m, k))), c=rand(rng, m, n))
    return Call(_core.sgemm_packed, args, outputs=("c",), packed=True)


def sgemm_packed_t_call(draw):
    """c = alpha * op(a) @ s^T + beta * c, s rows (r0, r1) of a packed op(b) (k, n), or all."""
    m, n, k, rng, args = packed_product(draw)
    r0, r1 = 0, k
    if draw(st.booleans()):
        r0 = draw(st.integers(0, k))
        r1 = draw(st.integers(r0, k))
        args["rows"] = (r0, r1)
    args.update(a=rand(rng, *((n, m) if args["trans_a"] else (m, n))), c=rand(rng, m, r1 - r0))
    return Call(_core.sgemm_packed_t, args, outputs=("c",), ranges=("rows",), packed=True,
                packed_rows="rows")


def sgemm_packed_quadrants_call(draw):
    """c = alpha * op(a) @ op(b) + beta * c, op(b) (2 k2, 2 n2) as 7 packed quadrant sums, by
    Strassen's scheme or not (strassen -1, 0 or 1)."""
    m, n2, k2 = draw(st.integers(0, 12)), draw(st.integers(0, 10)), draw(st.integers(0, 10))
    ta, tb = draw(st.booleans()), draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    packs = []
    for _ in range(7):
        packs.append(_core.PackedB(k2, n2, tb))
        _core.pack_b(rand(rng, *((n2, k2) if tb else (k2, n2))), packs[-1])
    args = dict(a=rand(rng, *((2 * k2, m) if ta else (m, 2 * k2))), packs=packs,
                c=rand(rng, m, 2 * n2), trans_a=ta, alpha=draw(st.sampled_from([1.0, -2.0])),
                beta=draw(st.sampled_from([0.0, 0.5])), strassen=draw(st.sampled_from([-1, 0, 1])),
                threads=draw(THREADS))
    return Call(_core.sgemm_packed_quadrants, args, outputs=("c",), quadrants=("packs",))


def sgemm_packed_quadrants_t_call(draw):
    """c = alpha * op(a) @ s^T + beta * c, s (2 n2, 2 k2) as 7 packed quadrant sums (each
    (n2, k2)), read transposed, by Strassen's scheme or not (strassen -1, 0 or 1)."""
    call = sgemm_packed_quadrants_call(draw)
    args = call.args
    n2, k2 = args["packs"][0].k, args["packs"][0].n   # s's quadrants
    m = args["c"].shape[0]
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args.update(a=rand(rng, *((2 * k2, m) if args["trans_a"] else (m, 2 * k2))),
                c=rand(rng, m, 2 * n2))
    if draw(st.booleans()):   # columns of each half of c
        r0 = draw(st.integers(0, n2))
        args["rows"] = (r0, draw(st.integers(r0, n2)))
    return Call(_core.sgemm_packed_quadrants_t, args, outputs=("c",), ranges=("rows",),
                quadrants=("packs",))


def conv_sizes(draw):
    N, C = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    stride, pad = draw(st.integers(1, 3)), draw(st.integers(0, 2))
    H = draw(st.integers(max(0, kh - 2 * pad), 9))
    W = draw(st.integers(max(0, kw - 2 * pad), 9))
    OH, OW = (H + 2 * pad - kh) // stride + 1, (W + 2 * pad - kw) // stride + 1
    channels = None
    if draw(st.booleans()):
        c0 = draw(st.integers(0, C))
        channels = (c0, draw(st.integers(c0, C)))
    return N, C, H, W, kh, kw, stride, pad, OH, OW, channels


def im2col_call(draw):
    N, C, H, W, kh, kw, stride, pad, OH, OW, channels = conv_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args = dict(x=rand(rng, N, C, H, W), kh=kh, kw=kw, stride=stride, pad=pad,
                col=np.zeros((C * kh * kw, N * OH * OW), np.float32), threads=draw(THREADS),
                channels=channels)
    return Call(_core.im2col, args, outputs=("col",), ints=("kh", "kw", "stride", "pad"),
                channels=True)


def im2col_pack_call(draw):
    """im2col of some images straight into col packed (fwd), col^T packed (t), both or none."""
    N, C, H, W, kh, kw, stride, pad, OH, OW, _ = conv_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    K, NP = C * kh * kw, N * OH * OW
    args = dict(x=rand(rng, N, C, H, W), kh=kh, kw=kw, stride=stride, pad=pad,
                fwd=_core.PackedB(K, NP, False) if draw(st.booleans()) else None,
                t=_core.PackedB(NP, K, True) if draw(st.booleans()) else None,
                threads=draw(THREADS))
    if draw(st.booleans()):
        n0 = draw(st.integers(0, N))
        args["images"] = (n0, draw(st.integers(n0, N)))
    return Call(_core.im2col_pack, args, ints=("kh", "kw", "stride", "pad"), ranges=("images",),
                packs=("fwd", "t"))


def im2col_pack_quadrants_call(draw):
    """im2col of some images of each half of the batch straight into the quadrants' sums of
    col (fwd), of col^T (t), both or none: an even batch and channel count."""
    N, C, H, W, kh, kw, stride, pad, OH, OW, _ = conv_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    K2, NP2 = C * kh * kw, N * OH * OW   # the quadrants, of x (2 N, 2 C, H, W)

    def packs(k, n, trans):
        return [_core.PackedB(k, n, trans) for _ in range(7)]

    args = dict(x=rand(rng, 2 * N, 2 * C, H, W), kh=kh, kw=kw, stride=stride, pad=pad,
                fwd=packs(K2, NP2, False) if draw(st.booleans()) else None,
                t=packs(NP2, K2, True) if draw(st.booleans()) else None,
                threads=draw(THREADS))
    # a range of the images of each half, or of the (image, sum) units (11 or 7 an image)
    how = draw(st.sampled_from(["all", "images", "units"]))
    sums = 11 if args["fwd"] and args["t"] else 7 if args["fwd"] or args["t"] else 0
    end = N if how == "images" else N * sums
    if how != "all":
        n0 = draw(st.integers(0, end))
        args[how] = (n0, draw(st.integers(n0, end)))
    return Call(_core.im2col_pack_quadrants, args, ints=("kh", "kw", "stride", "pad"),
                ranges=("images",) if how == "images" else ("units",) if how == "units" else (),
                quadrants=("fwd", "t"))


def col2im_call(draw):
    N, C, H, W, kh, kw, stride, pad, OH, OW, channels = conv_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args = dict(col=rand(rng, C * kh * kw, N * OH * OW), kh=kh, kw=kw, stride=stride, pad=pad,
                x=np.zeros((N, C, H, W), np.float32), threads=draw(THREADS), channels=channels)
    return Call(_core.col2im, args, outputs=("x",), ints=("kh", "kw", "stride", "pad"),
                channels=True)


def col2im_product_call(draw):
    N, C, H, W, kh, kw, stride, pad, OH, OW, channels = conv_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    kernels = draw(st.lists(st.integers(0, 4), max_size=3))
    args = dict(ws=[rand(rng, k, C * kh * kw) for k in kernels],
                dys=[rand(rng, k, N * OH * OW) for k in kernels], kh=kh, kw=kw, stride=stride,
                pad=pad, x=np.zeros((N, C, H, W), np.float32), threads=draw(THREADS),
                channels=channels)
    return Call(_core.col2im_product, args, outputs=("x",), ints=("kh", "kw", "stride", "pad"),
                channels=True)


def pool_sizes(draw):
    """N, C (or K), H, W, window k, stride s, PH, PW."""
    k, s = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    N, C = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    H, W = draw(st.integers(k, 9)), draw(st.integers(k, 9))
    return N, C, H, W, k, s, (H - k) // s + 1, (W - k) // s + 1


def maxpool_call(draw):
    N, C, H, W, k, s, PH, PW = pool_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args = dict(x=rand(rng, N, C, H, W), k=k, stride=s, out=np.zeros((N, C, PH, PW), np.float32),
                arg=np.zeros((N, C, PH, PW), np.int32), threads=draw(THREADS))
    return Call(_core.maxpool, args, outputs=("out", "arg"), ints=("k", "stride"))


def maxpool_backward_call(draw):
    N, C, H, W, k, s, PH, PW = pool_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args = dict(dout=rand(rng, N, C, PH, PW),
                arg=rng.integers(0, H * W, (N, C, PH, PW)).astype(np.int32),
                dx=np.zeros((N, C, H, W), np.float32), threads=draw(THREADS))
    return Call(_core.maxpool_backward, args, outputs=("dx",), indices=("arg",))


def bias_relu_maxpool_call(draw):
    N, K, H, W, k, s, PH, PW = pool_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args = dict(y=rand(rng, K, N, H, W), bias=rand(rng, K), pool=k, stride=s,
                out=np.zeros((N, K, PH, PW), np.float32), arg=np.zeros((N, K, PH, PW), np.int32),
                threads=draw(THREADS))
    return Call(_core.bias_relu_maxpool, args, outputs=("out", "arg"), ints=("pool", "stride"))


def bias_relu_maxpool_backward_call(draw):
    N, K, H, W, k, s, PH, PW = pool_sizes(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    if k == s == 1:  # without pooling each entry is -1 or its element's own index
        own = np.broadcast_to(np.arange(H * W, dtype=np.int32).reshape(H, W), (N, K, H, W))
        arg = np.where(rng.random((N, K, H, W)) < 0.5, own, -1).astype(np.int32)
    else:   # each entry -1 or inside its own window, as the forward chooses
        ph, pw = np.meshgrid(np.arange(PH), np.arange(PW), indexing="ij")
        dr, dc = rng.integers(0, k, (2, N, K, PH, PW))
        inside = (ph * s + dr) * W + pw * s + dc
        arg = np.where(rng.random((N, K, PH, PW)) < 0.8, inside, -1).astype(np.int32)
    args = dict(dout=rand(rng, N, K, PH, PW), arg=arg, pool=k, stride=s,
                dy=np.zeros((K, N, H, W), np.float32), threads=draw(THREADS))
    return Call(_core.bias_relu_maxpool_backward, args, outputs=("dy",), ints=("pool", "stride"),
                indices=("arg",))


def sgd_update_call(draw):
    n = draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    args = dict(p=rand(rng, n), g=rand(rng, n), v=rand(rng, n), lr=0.1,
                momentum=draw(st.sampled_from([0.0, 0.9])), weight_decay=1e-3,
                first=draw(st.booleans()), threads=draw(THREADS))
    return Call(_core.sgd_update, args, outputs=("p", "v"))


CASES = {
    "sgemm": sgemm_call, "sgemm_ref": sgemm_ref_call, "sgemm_naive": sgemm_naive_call,
    "PackedB": packed_b_call, "pack_b": pack_b_call, "sgemm_packed": sgemm_packed_call,
    "sgemm_packed_t": sgemm_packed_t_call, "sgemm_packed_quadrants": sgemm_packed_quadrants_call,
    "sgemm_packed_quadrants_t": sgemm_packed_quadrants_t_call,
    "im2col": im2col_call, "im2col_pack": im2col_pack_call,
    "im2col_pack_quadrants": im2col_pack_quadrants_call,
    "col2im": col2im_call, "col2im_product": col2im_product_call, "maxpool": maxpool_call, "maxpool_backward": maxpool_backward_call,
    "bias_relu_maxpool": bias_relu_maxpool_call,
    "bias_relu_maxpool_backward": bias_relu_maxpool_backward_call,
    "sgd_update": sgd_update_call,
}


# ------------------------------------------------------------------------------------------------
# Spoils


def spoil_array(draw, a, output):
    """(the spoiled array or object, how, whether no call can accept it)."""
    how = draw(st.sampled_from(["dtype", "more dims", "fewer dims", "list", "strided",
                                "read-only", "size"]))
    if how == "dtype":
        other = {np.dtype(np.float32): np.float64, np.dtype(np.int32): np.int64}[a.dtype]
        return a.astype(other), how, True
    if how == "more dims":
        return a[..., None], how, True
    if how == "fewer dims":
        return (a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1)), how, True
    if how == "list":
        return a.tolist(), how, True
    if how == "strided":  # the same shape, every other element of a wider array
        wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)[..., ::2]
        wide[...] = a
        return wide, how, not wide.flags.c_contiguous
    if how == "read-only":
        b = a.copy()
        b.flags.writeable = False
        return b, how, output
    axis = draw(st.integers(0, a.ndim - 1))
    shape = list(a.shape)
    shape[axis] = draw(st.sampled_from([0, shape[axis] + 1, max(0, shape[axis] - 1)]))
    return np.zeros(shape, a.dtype), f"size {tuple(shape)}", False


@st.composite
def spoiled_calls(draw, make):
    call = make(draw)
    names = [k for k, v in call.args.items() if isinstance(v, np.ndarray)] + list(call.ints)
    if call.threads:
        names.append("threads")
    if call.channels:
        names.append("channels")
    names += list(call.ranges)
    if call.packed:
        names.append("packed")
    names += list(call.packs)
    names += [f"quadrants:{k}" for k in call.quadrants]
    names += [f"{k} values" for k in call.indices if call.args[k].size]
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=2))
    for name in chosen:
        if name == "threads":
            value = draw(st.sampled_from(BAD_THREADS))
            call.args[name] = value
            call.spoiled.append((name, repr(value), True))
        elif name == "packed" or name in call.packs:
            # another size (a k or n two more: op(b), a or c cannot match it, even spoiled
            # themselves, by one), or no PackedB (where one must be given)
            p = call.args[name]
            how = draw(st.sampled_from(["array", "list"] if p is None else ["k", "n", "array"]
                                       + (["None"] if name == "packed" else [])))
            if how == "list":
                call.args[name] = [1.0]
                call.spoiled.append((name, f"{name}: a list", True))
                continue
            value = (_core.PackedB(p.k + 2, p.n, p.trans_b) if how == "k" else
                     _core.PackedB(p.k, p.n + 2, p.trans_b) if how == "n" else
                     np.zeros(4, np.float32) if how == "array" else None)
            call.args[name] = value
            picked = call.packed_rows and call.args.get(call.packed_rows) is not None
            call.spoiled.append((name, f"packed: {how}", not (how == "k" and picked)))
        elif name.startswith("quadrants:"):
            # six of them, one of another size or storage, something else among them, or a
            # string (where None is allowed) or None (where it is not)
            key = name.split(":")[1]
            packs = call.args[key]
            if packs is None:
                call.args[key] = draw(st.sampled_from(["packs", [1.0] * 7]))
                call.spoiled.append((key, "not PackedBs", True))
                continue
            packs, p = list(packs), packs[0]
            how = draw(st.sampled_from(["six", "k", "trans", "array", "str"]
                                       + (["None"] if key == "packs" else [])))
            if how == "six":
                packs = packs[:6]
            elif how in ("k", "trans", "array"):
                packs[draw(st.integers(1, 6))] = (
                    _core.PackedB(p.k + 2, p.n, p.trans_b) if how == "k" else
                    _core.PackedB(p.k, p.n, not p.trans_b) if how == "trans" else
                    np.zeros(4, np.float32))
            call.args[key] = None if how == "None" else "packs" if how == "str" else packs
            call.spoiled.append((key, how, True))
        elif name == "channels" or name in call.ranges:
            value = draw(st.sampled_from(BAD_CHANNELS))
            call.args[name] = value
            call.spoiled.append((name, repr(value), True))
        elif name in call.ints:
            value = draw(st.sampled_from(BAD_INTS))
            call.args[name] = value
            call.spoiled.append((name, repr(value), True))
        elif name.endswith(" values"):
            key = name.split()[0]
            if not isinstance(call.args[key], np.ndarray) or not call.args[key].size:
                continue  # spoiled otherwise already
            a = call.args[key].copy()
            value = draw(st.sampled_from(BAD_INDICES))
            a.reshape(-1)[draw(st.integers(0, a.size - 1))] = value
            call.args[key] = a
            call.spoiled.append((key, f"an index {value}", True))
        else:
            value, how, must = spoil_array(draw, call.args[name], name in call.outputs)
            call.args[name] = value
            call.spoiled.append((name, how, must))
    # a PackedB two rows or columns bigger can be matched again by an array whose size was
    # spoiled too (x one channel more, with a 1 x 2 kernel: two more rows of col)
    if any(how.startswith("size") for _, how, _ in call.spoiled):
        call.spoiled = [(n, how, must and how not in ("packed: k", "packed: n"))
                        for n, how, must in call.spoiled]
    return call


# ------------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=settings.default.max_examples * 3)
@given(data=st.data())
def test_binding_runs_or_raises_a_short_error(name, data):
    call = data.draw(spoiled_calls(CASES[name]), "call")
    must_raise = any(must for _, _, must in call.spoiled)
    try:
        call.fn(**call.args)
    except (ValueError, TypeError) as e:
        assert call.spoiled, f"a valid call raised {e!r}"
        message = str(e)
        assert "\n" not in message and len(message) < 200, f"not a short message: {message!r}"
        return
    assert not must_raise, f"{name} ran with {call.spoiled}"


@settings(max_examples=settings.default.max_examples * 3)
@given(data=st.data())
def test_col2im_product_runs_or_raises_with_spoiled_parts(data):
    """col2im_product's lists of weights and output gradients, spoiled: an array of one of
    them (as the arrays of every binding are), a list one longer than the other, or not a
    list of arrays at all."""
    call = col2im_product_call(data.draw)
    ws, dys = call.args["ws"], call.args["dys"]
    how = data.draw(st.sampled_from(["array", "longer", "not a list"]))
    must = True
    if how == "array" and ws:
        which = data.draw(st.sampled_from(["ws", "dys"]))
        j = data.draw(st.integers(0, len(ws) - 1))
        value, how, must = spoil_array(data.draw, call.args[which][j], False)
        call.args[which][j] = value
    elif how == "longer" or how == "array":
        call.args[data.draw(st.sampled_from(["ws", "dys"]))].append(np.zeros((1, 1), np.float32))
    else:
        call.args[data.draw(st.sampled_from(["ws", "dys"]))] = data.draw(
            st.sampled_from(["ab", 3, None, np.zeros((2, 2), np.float32), [[1.0]]]))
    try:
        call.fn(**call.args)
    except (ValueError, TypeError) as e:
        message = str(e)
        assert "\n" not in message and len(message) < 200, f"not a short message: {message!r}"
        return
    assert not must, f"col2im_product ran with {how}"


def test_every_binding_is_covered():
    """A new binding needs a case here (or a test of its own below)."""
    own_tests = {"gemm_kernel", "gemm_blocks", "have_openmp", "set_gemm_kernel",
                 "set_gemm_min_flops_per_thread",
                 "set_gemm_strassen_min_dim", "gemm_strassen_min_dim", "gemm_uses_strassen",
                 "gemm_splits_k", "start_team", "startable_threads",
                 "gemm_packed_uses_strassen"}
    bindings = {k for k in dir(_core) if not k.startswith("_") and callable(getattr(_core, k))}
    assert bindings == set(CASES) | own_tests


@given(st.one_of(st.sampled_from(["auto", "portable", "avx2-fma", "AVX2", ""]), st.text(),
                 st.integers(), st.none()))
def test_set_gemm_kernel_takes_only_its_names(name):
    _core.set_gemm_kernel("auto")
    chosen = _core.gemm_kernel()  # this CPU's: avx512 (but on Zen 4), avx2-fma or portable
    try:
        _core.set_gemm_kernel(name)
    except (ValueError, TypeError):
        assert name not in ("auto", "portable")
    else:
        assert name in ("auto", "portable", "avx2-fma")
        assert _core.gemm_kernel() == (chosen if name == "auto" else name)
    finally:
        _core.set_gemm_kernel("auto")
    assert isinstance(_core.have_openmp(), bool)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_set_gemm_min_flops_per_thread(flops):
    """Any threshold but NaN is taken (negative: the default again) and handed back by the next
    call; the GEMM stays right whatever it is."""
    default = _core.set_gemm_min_flops_per_thread(-1)
    try:
        with (pytest.raises(ValueError, match="nan") if np.isnan(flops)
              else contextlib.nullcontext()):
            _core.set_gemm_min_flops_per_thread(flops)
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        c = np.empty((3, 3), np.float32)
        _core.sgemm(a, a, c, trans_b=True, threads=3)
        np.testing.assert_array_equal(c, a @ a.T)
        want = default if np.isnan(flops) or flops < 0 else flops
        assert _core.set_gemm_min_flops_per_thread(-1) == want
    finally:
        _core.set_gemm_min_flops_per_thread(default)


@given(st.integers(-2**62, 2**62))
def test_set_gemm_strassen_min_dim(dim):
    """Any threshold is taken (negative: the default again) and handed back by the next call;
    the GEMM stays right whatever it is."""
    default = _core.set_gemm_strassen_min_dim(-1)
    try:
        _core.set_gemm_strassen_min_dim(dim)
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        c = np.empty((3, 3), np.float32)
        _core.sgemm(a, a, c, trans_b=True)
        np.testing.assert_array_equal(c, a @ a.T)
        assert _core.gemm_strassen_min_dim() == (default if dim < 0 else dim)
        want = (dim if dim >= 0 else default) > 0 and 2000 >= max(dim, 2)
        assert _core.gemm_uses_strassen(2000, 2000, 2000) == want
        assert not _core.gemm_uses_strassen(-5, 2000, 2000, threads=0)
        assert _core.set_gemm_strassen_min_dim(-1) == (default if dim < 0 else dim)
    finally:
        _core.set_gemm_strassen_min_dim(default)


def test_gemm_uses_strassen_takes_only_ints():
    for args in [("a", 2000, 2000), (2000.5, 2000, 2000), (2000, 2000, 2000, None)]:
        with pytest.raises(TypeError):
            _core.gemm_uses_strassen(*args)


def test_gemm_splits_k_takes_only_ints():
    # without OpenMP every product runs on one thread, and nothing is split
    assert _core.gemm_splits_k(32, 25, 36864, threads=2) is _core.have_openmp()
    for args in [(0, 25, 36864, 2), (32, -1, 36864, 2), (32, 25, 0, 2), (32, 25, 36864, 0),
                 (32, 25, 36864, -3)]:
        assert _core.gemm_splits_k(*args) is False
    for args in [("a", 25, 36864), (32.5, 25, 36864), (32, 25, 36864, None)]:
        with pytest.raises(TypeError):
            _core.gemm_splits_k(*args)


def test_start_team_takes_a_thread_count():
    """Its team's size (1 without OpenMP); a count out of [1, 1024] or not an int is refused
    before any thread starts."""
    assert _core.start_team(3) == (3 if _core.have_openmp() else 1)
    assert _core.start_team(1) == 1
    assert ops.start_team(2) == (2 if ops.have_openmp() else 1)
    for bad, error, words in [(0, ValueError, ">= 1"), (1025, ValueError, "at most 1024"),
                              (2**70, ValueError, "64 bits"), (1.5, TypeError, "int"),
                              ("2", TypeError, "int"), (None, TypeError, "int")]:
        with pytest.raises(error, match=words):
            _core.start_team(bad)


def test_gemm_packed_uses_strassen_takes_only_ints():
    assert _core.gemm_packed_uses_strassen(2000, 1000, 1000) is True
    assert not _core.gemm_packed_uses_strassen(-5, 1000, 1000, threads=0)
    for args in [("a", 1000, 1000), (2000.5, 1000, 1000), (2000, 1000, 1000, None)]:
        with pytest.raises(TypeError):
            _core.gemm_packed_uses_strassen(*args)


def test_an_array_through_pickle_is_taken():
    """An array that went through pickle (multiprocessing, joblib) has a float32 dtype of its
    own, not NumPy's: it was refused as 'expected dtype float32, got float32'. A big-endian
    float32 is still refused."""
    x = pickle.loads(pickle.dumps(np.arange(2 * 3 * 5 * 5, dtype=np.float32).reshape(2, 3, 5, 5)))
    assert x.dtype is not np.dtype(np.float32)
    np.testing.assert_array_equal(ops.im2col(x, 3, 3), ops.im2col(np.array(x), 3, 3))
    y, arg = ops.maxpool(x, 2)
    arg = pickle.loads(pickle.dumps(arg))
    assert arg.dtype is not np.dtype(np.int32)
    dy = np.ones_like(y)
    np.testing.assert_array_equal(ops.maxpool_backward(dy, arg, x.shape),
                                  ops.maxpool_backward(dy, np.array(arg), x.shape))
    with pytest.raises(TypeError, match="expected dtype float32, got >f4"):
        _core.im2col(x.astype(">f4"), 3, 3, 1, 0, np.empty((27, 18), np.float32))


def test_quadrant_packs_are_held_while_the_product_runs():
    """The seven packs of a quadrant product are read with the GIL released: another thread
    that dropped the list's last references to them made the product read freed memory
    (SIGSEGV); the call now holds them."""
    code = ("import threading, time, numpy as np\n"
            "from pyhet import _core\n"
            "m = 1024\n"
            "packs = [_core.PackedB(m, m) for _ in range(7)]\n"
            "a = np.ones((m, 2 * m), np.float32); c = np.empty((m, 2 * m), np.float32)\n"
            "threading.Thread(target=lambda: (time.sleep(0.02), packs.clear())).start()\n"
            "_core.sgemm_packed_quadrants(a, packs, c, strassen=1)\n"
            "print('returned')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=tempfile.gettempdir())   # not the source tree
    assert p.returncode == 0 and p.stdout == "returned\n", (p.returncode, p.stderr[-2000:])


def test_quadrant_packs_made_as_they_are_asked_for():
    """A sequence whose items are made as they are asked for (each dropped at once): the sizes
    were read from freed memory (k of 140111444385040); now each is held while it is read."""
    class Fresh:
        def __len__(self):
            return 7

        def __getitem__(self, i):
            if i >= 7:
                raise IndexError(i)
            return _core.PackedB(64, 32)
    c = np.full((3, 64), np.nan, np.float32)
    _core.sgemm_packed_quadrants(np.ones((3, 128), np.float32), Fresh(), c)
    assert not c.any()          # B's packs all zeros


def test_quadrant_packs_written_must_differ():
    """The same PackedB given twice among the seven written (fwd's or t's): the sums
    overwrote each other and the product was silently wrong (off by about 15)."""
    x = np.random.default_rng(0).random((2, 2, 5, 5), dtype=np.float32)
    col = ops.im2col(x, 3, 3)
    k, n = col.shape
    p = ops.packed_b(k // 2, n // 2)
    with pytest.raises(ValueError, match="7 different PackedB"):
        ops.im2col_pack_quadrants(x, 3, 3, fwd=ops.PackedQuadrants([p] * 7, k, n, False))
    t = [ops.packed_b(n // 2, k // 2, trans_b=True) for _ in range(6)]
    with pytest.raises(ValueError, match="the same one at 2 and 6"):
        _core.im2col_pack_quadrants(x, 3, 3, 1, 0, None, t + [t[2]])


@pytest.mark.parametrize("ask", [
    lambda: _core.gemm_splits_k(16, 16, 2**63 - 1, 2),
    lambda: _core.gemm_splits_k(2**62, 16, 2**62, 2),
    lambda: _core.gemm_splits_k(2**63 - 1, 1, 1, 2),
    lambda: _core.gemm_uses_strassen(2**40, 2**40, 2**40, 2),
    lambda: _core.gemm_packed_uses_strassen(2**40, 2**40, 2**40, 2),
    lambda: _core.gemm_packed_uses_strassen(8, 2**63 - 1, 8, 2),
    lambda: _core.gemm_packed_uses_strassen(8, 2**62, 8, 2),      # 2 * 2**62 wrapped negative
    lambda: _core.gemm_packed_uses_strassen(8, 8, 2**62, 2)])
def test_questions_about_products_no_memory_holds_are_refused(ask):
    """The plans multiply the dimensions: splits_k(16, 16, 2**63 - 1, 2) overflowed (UBSan)
    and said False where every k from 2**20 to 2**62 says True."""
    with pytest.raises(ValueError, match="more floats than a process can address|more than a "
                                         "process can address"):
        ask()


def test_questions_about_the_largest_products_a_process_holds_are_answered():
    assert _core.gemm_splits_k(16, 16, 2**40, 2) is _core.have_openmp()
    assert _core.gemm_splits_k(0, 16, 2**63 - 1, 2) is False       # empty: no
    assert _core.gemm_uses_strassen(2**15, 2**15, 2**15, 1) is (_core.gemm_strassen_min_dim() > 0)


def test_an_empty_batch_with_maps_too_large_to_count_is_refused():
    """OH * OW was counted only as N * OH * OW, which is 0 for an empty batch; the kernels then
    computed OH * OW = (2**32 - 1)**2 (a signed overflow, UBSan) before returning."""
    x = np.zeros((0, 2, 1, 1), np.float32)
    for call in (lambda: _core.im2col_pack(x, 1, 1, 1, 2**31 - 1, ops.packed_b(2, 0)),
                 lambda: ops.im2col_pack(x, 1, 1, 1, 2**31 - 1, fwd=ops.packed_b(2, 0)),
                 lambda: ops.im2col(x, 1, 1, 1, 2**31 - 1)):
        with pytest.raises((ValueError, MemoryError), match="sizes too large|does not fit"):
            call()


def test_startable_threads_counts_the_threads_it_can_hold():
    """The probe of the threads a team needs, made as libgomp makes them: every group's threads
    held at once, at its stack size (one too small for pthread leaves the default, as in libgomp;
    one no memory holds cannot be made, and ends the count);
    threading.stack_size is not touched (it was set for the probe, for every thread the process
    started meanwhile)."""
    import threading
    before = threading.stack_size()
    assert _core.startable_threads([]) == 0
    assert _core.startable_threads([(3, 0), (2, 1 << 20), (0, 0)]) == 5
    assert _core.startable_threads([(2, 100)]) == 2            # under PTHREAD_STACK_MIN: default
    assert _core.startable_threads([(2, 0), (1, 2**62), (5, 0)]) == 2   # no room: the count so far
    assert threading.stack_size() == before
    for bad in ([(-1, 0)], [(1, -5)], [(2**21, 0)], [(2**20, 0), (1, 0)]):
        with pytest.raises(ValueError, match="startable_threads: "):
            _core.startable_threads(bad)
    with pytest.raises(TypeError):
        _core.startable_threads([(1, 2**64)])
