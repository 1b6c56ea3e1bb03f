"""Images and labels as a network takes them, and how raw pixels become its input.

x (N, C, H, W) float32 images, y (N,) int64 labels in [0, M).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import DataError, shown


@dataclass(frozen=True)
class Normalization:
    """Per channel, x = raw * scale + shift for raw uint8 pixels: ((raw / 255) - mean) / std
    with the training split's mean and std. It travels with trained weights, so that raw
    images given to a trained network are prepared exactly as its training images were."""

    scale: tuple   # (C,) float32 values
    shift: tuple   # (C,)

    def apply(self, x):
        """uint8 x (N, C, H, W) -> float32 (N, C, H, W)."""
        c = len(self.scale)
        out = x.astype(np.float32)                            # (N, C, H, W), C-contiguous
        out *= np.array(self.scale, np.float32).reshape(1, c, 1, 1)
        out += np.array(self.shift, np.float32).reshape(1, c, 1, 1)
        return out

    def as_dict(self) -> dict:
        return {"scale": [float(v) for v in self.scale], "shift": [float(v) for v in self.shift]}

    @classmethod
    def from_dict(cls, d) -> "Normalization":
        """From as_dict()'s form; anything else (lists of other lengths, values that are not
        finite numbers, a scale that is not > 0) raises ValueError."""
        if not isinstance(d, dict) or not all(
                isinstance(d.get(k), list) and d[k] for k in ("scale", "shift")):
            raise ValueError(f"a normalization must be {{'scale': [...], 'shift': [...]}}, "
                             f"one number per channel, got {d!r}")
        if len(d["scale"]) != len(d["shift"]):
            raise ValueError(f"the normalization has {len(d['scale'])} scales but "
                             f"{len(d['shift'])} shifts; expected one of each per channel")
        values = {}
        for k in ("scale", "shift"):
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d[k]):
                raise ValueError(f"the normalization's {k} must be numbers, got {d[k]!r}")
            try:
                with np.errstate(over="ignore"):      # (said below)
                    values[k] = tuple(float(np.float32(v)) for v in d[k])
            except OverflowError:       # an integer past float's range
                raise ValueError(f"the normalization's {k} must be finite numbers, got "
                                 f"{shown(d[k])}") from None
            if not np.isfinite(values[k]).all():
                finite = all(np.isfinite(v) for v in d[k])
                raise ValueError(f"the normalization's {k} must be finite"
                                 + (" in float32 (at most 3.4e38 in size)" if finite else "")
                                 + f", got {d[k]!r}")
        if any(v <= 0 for v in values["scale"]):   # 1 / (255 std): a pixel's scale is > 0
            tiny = all(v > 0 for v in d["scale"])
            raise ValueError("the normalization's scale must be > 0"
                             + (" in float32 (which holds less than 7e-46 as 0)" if tiny else "")
                             + f", got {d['scale']!r}")
        return cls(values["scale"], values["shift"])


def looks_channel_last(shape, input_shape=None) -> bool:
    """Whether images of `shape` (N, ?, ?, ?) look like (N, H, W, C), as PIL, TensorFlow and
    matplotlib keep them, where (N, C, H, W) is expected: given the network's input_shape
    (C, H, W), they are exactly (N, H, W, C); without it, the last dimension is a channel
    count (1, 3 or 4) and the two before it are at least 8, as images are (an (N, C, H, W)
    array of 8 or more channels of images 1 to 4 pixels wide is not one that comes up)."""
    if len(shape) != 4:
        return False
    if input_shape is not None:
        c, h, w = input_shape
        return tuple(shape[1:]) == (h, w, c) and (h, w, c) != (c, h, w)
    return shape[3] in (1, 3, 4) and shape[1] >= 8 and shape[2] >= 8


def channel_last_message(what, shape) -> str:
    """What to say of images that look channel-last."""
    n, h, w, c = shape
    return (f"{what} has shape {tuple(shape)}, which looks channel-last (N, H, W, C): "
            f"pyhet takes images as (N, C, H, W), here ({n}, {c}, {h}, {w}); convert them with "
            f"x.transpose(0, 3, 1, 2)")


def native_float32(a):
    """float32 of the other byte order (a big-endian machine's file) as native float32, the
    same values; else `a` (None included)."""
    if a is not None and a.dtype.kind == "f" and a.dtype.itemsize == 4 and not a.dtype.isnative:
        return a.astype(np.float32)
    return a


def masked_message(what: str) -> str:
    # np.asarray drops a mask: the values under it would be used as they are
    return (f"{what}: a masked array, whose masked values would be used as they are: fill "
            f"them first ({what}.filled(value)) or leave those images out")


def prepare_images(x, input_shape, normalization=None, what="x"):
    """Images for a network taking (C, H, W) inputs, by the rules of npz: datasets: float32 is
    used as it is; uint8 is raw pixels, prepared as the network's training images were (the
    normalization, or / 255 when there is none). Anything else raises DataError."""
    return prepare_batch(check_images(x, input_shape, what), normalization, what)


def check_images(x, input_shape, what="x"):
    """x, checked to be images prepare_batch takes (its type, shape, dtype; not its values),
    and not converted: a caller that goes batch by batch (predict, evaluate) holds one batch
    of prepared images at a time, not all of them."""
    if not isinstance(x, np.ndarray):
        raise DataError(f"{what}: expected a numpy array of images (N, "
                        f"{', '.join(map(str, input_shape))}), got {type(x).__name__}")
    if isinstance(x, np.ma.MaskedArray):
        raise DataError(masked_message(what))
    if looks_channel_last(x.shape, input_shape):
        raise DataError(channel_last_message(what, x.shape))
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(input_shape):
        raise DataError(f"{what}: expected images of shape (N, "
                        f"{', '.join(map(str, input_shape))}), got {tuple(x.shape)}")
    if len(x) == 0:
        raise DataError(f"{what}: holds no images, expected at least one")
    if x.dtype != np.uint8 and not (x.dtype.kind == "f" and x.dtype.itemsize == 4):
        raise DataError(f"{what}: expected float32 images (used as they are) or uint8 pixels "
                        f"(scaled as the training images were), got dtype {x.dtype} "
                        f"(convert others with .astype(np.float32))")
    return x


def prepare_batch(xb, normalization=None, what="x", first: int = 0):
    """Images that check_images took (all of them, or the batch from image `first` on) as the
    network's float32 input."""
    if xb.dtype == np.uint8:
        if normalization is not None:
            return normalization.apply(xb)
        return np.ascontiguousarray(xb, dtype=np.float32) / np.float32(255.0)
    xb = np.ascontiguousarray(native_float32(xb))
    finite = np.isfinite(xb).reshape(len(xb), -1).all(axis=1)
    if not finite.all():
        raise DataError(f"{what}: holds NaN or infinite values (image "
                        f"{first + int(np.argmin(finite))} is the first)")
    return xb


def prepare_labels(y, n, num_classes, what="y"):
    """Labels (n,) of integers in [0, num_classes) as int64, a copy (a fit's labels changed
    by its program meanwhile, from its callback say, are not read: they were checked once);
    anything else raises DataError."""
    if not isinstance(y, np.ndarray):
        try:
            y = np.asarray(y)
        except (ValueError, TypeError) as e:     # a ragged list: [1, [2], 0]
            raise DataError(f"{what}: expected {n} integer labels, got a "
                            f"{type(y).__name__} that is not an array ({e})") from None
    if isinstance(y, np.ma.MaskedArray):
        raise DataError(masked_message(what))
    if y.ndim != 1 or len(y) != n:
        raise DataError(f"{what}: expected {n} labels, shape ({n},), got shape {tuple(y.shape)}")
    if y.dtype.kind not in "iu":
        raise DataError(f"{what}: expected integer class labels, got dtype {y.dtype}")
    if n and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(f"{what}: labels must be in 0..{num_classes - 1}, got "
                        f"{int(y.min())}..{int(y.max())}")
    return np.array(y, dtype=np.int64, order="C")
