"""Layers as forward/backward pairs, with hand-written gradients.

Each layer's forward keeps only what its backward needs; backward takes the gradient of the
output (d<name>) and returns the gradient of the input, storing parameter gradients in
``grads``. They run on the reference backend's functions, which accept NumPy or CuPy arrays of
any float dtype (the gradient checks use float64).

The network itself runs its conv layers through the fused, partitioned conv block
(pyhet.parallel), which computes the same function as Conv2d -> ReLU -> MaxPool2d here; the fc
layer and the loss are these classes, on the master.

Letters: x (N, C, H, W), w (K, C, R, S), fc input (N, F), logits (N, M).
"""

from __future__ import annotations

import math

import numpy as np

from .backends import numpy_ref as ref


# ================================================================================================
# Initialisation as PyTorch's defaults for Conv2d and Linear: kaiming_uniform_(a=sqrt(5)) for the
# weight, which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the same bound for the bias.


INIT_CHUNK = 1 << 16   # numbers drawn at once: the float64 draw is 512 KB, not the layer's


def init_uniform(rng: np.random.Generator, shape, fan_in: int) -> np.ndarray:
    """U(-bound, bound) as float32: the numbers of one float64 draw of the whole shape, drawn a
    chunk at a time, so that a large fc layer costs its float32 array, not three times that."""
    bound = 1.0 / math.sqrt(fan_in)
    out = np.empty(shape, np.float32)
    flat = out.reshape(-1)
    for i in range(0, flat.size, INIT_CHUNK):
        part = flat[i:i + INIT_CHUNK]
        part[...] = rng.uniform(-bound, bound, size=part.size)
    return out


class Layer:
    params: dict
    grads: dict

    def __init__(self):
        self.params, self.grads = {}, {}


class Conv2d(Layer):
    """Valid or padded 2-D convolution, stride s."""

    def __init__(self, w, b, stride: int = 1, pad: int = 0, need_dx: bool = True):
        super().__init__()
        self.params = {"weight": w, "bias": b}
        self.stride, self.pad, self.need_dx = stride, pad, need_dx

    def forward(self, x):
        y, col = ref.conv2d_forward(x, self.params["weight"], self.params["bias"], self.stride,
                                    self.pad)
        self.saved = (col, x.shape)
        return y

    def backward(self, dy):
        col, x_shape = self.saved
        dx, dw, db = ref.conv2d_backward(dy, col, x_shape, self.params["weight"], self.stride,
                                         self.pad, self.need_dx)
        self.grads = {"weight": dw, "bias": db}
        return dx


class ReLU(Layer):
    def forward(self, x):
        self.y = ref.relu_forward(x)
        return self.y

    def backward(self, dy):
        return ref.relu_backward(dy, self.y)


class MaxPool2d(Layer):
    """Max-pooling in floor mode (as torch.nn.MaxPool2d): kernel k, stride k unless given."""

    def __init__(self, k: int = 2, stride: int | None = None):
        super().__init__()
        self.k, self.stride = k, (k if stride is None else stride)

    def forward(self, x):
        y, self.arg = ref.maxpool_forward(x, self.k, self.stride)
        self.x_shape = x.shape
        return y

    def backward(self, dy):
        return ref.maxpool_backward(dy, self.arg, self.x_shape, self.k, self.stride)


class Flatten(Layer):
    """(N, C, H, W) -> (N, C*H*W) in (C, H, W) order, as torch.flatten."""

    def forward(self, x):
        self.x_shape = x.shape
        return ref.flatten_forward(x)

    def backward(self, dy):
        return dy.reshape(self.x_shape)


class Linear(Layer):
    """y = x @ w.T + b on a backend (the C++ core on the master, or the reference)."""

    def __init__(self, w, b, backend=None, need_dx: bool = True):
        super().__init__()
        self.params = {"weight": w, "bias": b}
        self.backend = backend if backend is not None else ref.NumpyBackend()
        self.need_dx = need_dx

    def forward(self, x):
        self.x = x
        return self.backend.linear_forward(x, self.params["weight"], self.params["bias"])

    def backward(self, dy):
        self.grads = {}   # the last step's go first: a large layer holds one gradient, not two
        dx, dw, db = self.backend.linear_backward(dy, self.x, self.params["weight"], self.need_dx)
        self.grads = {"weight": dw, "bias": db}
        return dx


class SoftmaxCrossEntropy(Layer):
    """Mean cross-entropy over the batch; forward returns the loss, backward dlogits."""

    def forward(self, logits, labels):
        loss, self.dlogits = ref.softmax_cross_entropy(logits, labels)
        return loss

    def backward(self):
        return self.dlogits
