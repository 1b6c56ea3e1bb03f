"""The paper's network, and its weight files in PyTorch's layout.

    x (N, C, H, W) -> conv k x k, A kernels -> ReLU -> maxpool 2
                   -> conv k x k, B kernels -> ReLU -> maxpool 2 -> flatten (N, F) -> fc (N, M)

Valid convolutions, stride 1. The two conv blocks are PartitionedConv layers whose kernels are
spread over the devices; flatten, fc and the loss run on the master. A weight file is an .npz of
float32 arrays named and shaped as the equivalent torch.nn model's state_dict:
conv1.weight (A, C, k, k), conv1.bias (A,), conv2.weight (B, A, k, k), conv2.bias (B,),
fc.weight (M, F), fc.bias (M,), with F = B * P2 * P2 flattened in (C, H, W) order.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass

import numpy as np

from .errors import WeightsError
from .layers import Flatten, Linear, SoftmaxCrossEntropy, init_uniform
from .optim import SGDConfig
from .parallel import PartitionedConv
from .timing import PartTimer

POOL = 2
PARAM_NAMES = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias")


@dataclass(frozen=True)
class NetShape:
    input_shape: tuple      # (C, H, W)
    kernels: tuple          # (A, B)
    kernel_size: int = 5
    num_classes: int = 10

    def __post_init__(self):
        C, H, W = self.input_shape
        k = self.kernel_size
        if k < 1 or min(self.kernels) < 1 or self.num_classes < 2:
            raise ValueError(f"a network needs kernel size >= 1, kernel counts >= 1 and >= 2 "
                             f"classes, got k={k}, kernels={self.kernels}, "
                             f"classes={self.num_classes}")
        if self.pooled2[0] < 1 or self.pooled2[1] < 1:
            raise ValueError(f"a {H}x{W} input is too small for two {k}x{k} convolutions each "
                             f"followed by 2x2 pooling (it would leave a "
                             f"{self.pooled2[0]}x{self.pooled2[1]} map)")

    @property
    def pooled1(self):
        _, H, W = self.input_shape
        k = self.kernel_size
        return (H - k + 1) // POOL, (W - k + 1) // POOL

    @property
    def pooled2(self):
        h, w = self.pooled1
        k = self.kernel_size
        return (h - k + 1) // POOL, (w - k + 1) // POOL

    @property
    def features(self) -> int:
        return self.kernels[1] * self.pooled2[0] * self.pooled2[1]

    def param_shapes(self) -> dict:
        C = self.input_shape[0]
        A, B = self.kernels
        k = self.kernel_size
        return {"conv1.weight": (A, C, k, k), "conv1.bias": (A,),
                "conv2.weight": (B, A, k, k), "conv2.bias": (B,),
                "fc.weight": (self.num_classes, self.features), "fc.bias": (self.num_classes,)}

    def geometries(self, batch: int):
        """The two conv blocks' shapes at this batch size (what devices are calibrated on)."""
        from .devices import LayerGeometry

        C, H, W = self.input_shape
        A, B = self.kernels
        k = self.kernel_size
        h1, w1 = self.pooled1
        return [LayerGeometry("conv1", batch, C, H, W, A, k, k, POOL),
                LayerGeometry("conv2", batch, A, h1, w1, B, k, k, POOL)]

    def flops_per_image(self) -> dict:
        """Multiply-adds x 2 of one training step per image, by part (forward and backward)."""
        C, H, W = self.input_shape
        A, B = self.kernels
        k = self.kernel_size
        p1 = (H - k + 1) * (W - k + 1)
        h1, w1 = self.pooled1
        p2 = (h1 - k + 1) * (w1 - k + 1)
        conv1 = 2 * A * p1 * C * k * k
        conv2 = 2 * B * p2 * A * k * k
        fc = 2 * self.num_classes * self.features
        return {"conv1": 2 * conv1, "conv2": 3 * conv2, "fc": 3 * fc}


def init_params(shape: NetShape, seed: int = 0) -> dict:
    """PyTorch's default initialisation, seeded: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    rng = np.random.default_rng(seed)
    shapes = shape.param_shapes()
    params = {}
    for layer in ("conv1", "conv2", "fc"):
        wshape = shapes[f"{layer}.weight"]
        fan_in = int(np.prod(wshape[1:]))
        params[f"{layer}.weight"] = init_uniform(rng, wshape, fan_in)
        params[f"{layer}.bias"] = init_uniform(rng, shapes[f"{layer}.bias"], fan_in)
    return params


# ================================================================================================
# Weight files


def save_weights(path, params: dict) -> None:
    """Write the parameters as an .npz of float32 arrays in PyTorch's layout (atomically)."""
    path = os.fspath(path)
    tmp = path + ".tmp.npz"
    try:
        np.savez(tmp, **{k: np.asarray(params[k], np.float32) for k in PARAM_NAMES})
        os.replace(tmp, path)
    except OSError as e:
        raise WeightsError(f"cannot write the weight file {path}: {e.strerror or e}") from None


def load_weights(path, shape: NetShape) -> dict:
    """Read and check a weight file against the network it must fit."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise WeightsError(f"weight file {path}: no such file")
    try:
        # np.load is handed an open file: np.load(name) leaks its handle on a broken zip
        with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, TypeError, zipfile.BadZipFile, EOFError) as e:
        # TypeError: a single .npy array (an ndarray is no context manager)
        raise WeightsError(f"weight file {path}: not a readable .npz ({e})") from None
    want = shape.param_shapes()
    missing = [k for k in PARAM_NAMES if k not in arrays]
    if missing:
        raise WeightsError(f"weight file {path}: missing {', '.join(missing)} "
                           f"(it has {', '.join(sorted(arrays)) or 'nothing'})")
    params = {}
    for k in PARAM_NAMES:
        a = arrays[k]
        if a.dtype != np.float32:
            raise WeightsError(f"weight file {path}: {k} must be float32, got {a.dtype}")
        if a.shape != want[k]:
            raise WeightsError(f"weight file {path}: {k} has shape {a.shape}, but the network "
                               f"(input {shape.input_shape}, kernels {shape.kernels}, kernel "
                               f"size {shape.kernel_size}, {shape.num_classes} classes) needs "
                               f"{want[k]}")
        if not np.isfinite(a).all():
            raise WeightsError(f"weight file {path}: {k} holds NaN or infinite values")
        params[k] = np.ascontiguousarray(a)
    return params


# ================================================================================================
# The network


class Net:
    """The two-conv network over a set of devices; the fc layer and the loss on the master."""

    def __init__(self, shape: NetShape, params: dict, devices, partition: dict, host):
        # partition: {"conv1": counts per device, "conv2": counts per device}
        # host: the master's backend (fc and loss)
        self.shape, self.devices, self.host = shape, list(devices), host
        self.conv1 = PartitionedConv("conv1", params["conv1.weight"], params["conv1.bias"],
                                     self.devices, partition["conv1"], POOL, need_dx=False)
        self.conv2 = PartitionedConv("conv2", params["conv2.weight"], params["conv2.bias"],
                                     self.devices, partition["conv2"], POOL, need_dx=True)
        self.flatten = Flatten()
        self.fc = Linear(params["fc.weight"].copy(), params["fc.bias"].copy(), backend=host)
        self.loss = SoftmaxCrossEntropy()
        self._fc_momentum = {"weight": None, "bias": None}

    @property
    def convs(self):
        return (self.conv1, self.conv2)

    def forward(self, x):
        """x (N, C, H, W) -> logits (N, M)."""
        h = self.conv1.forward(x)
        h = self.conv2.forward(h)
        return self.fc.forward(self.flatten.forward(h))

    def train_step(self, x, labels, cfg: SGDConfig, timer=None) -> float:
        """One SGD step on a batch; returns the loss. timer: a PartTimer that receives the time
        of the step's parts, or None."""
        t = timer if timer is not None else PartTimer()
        with t("conv_forward"):
            h1 = self.conv1.forward(x)
            h2 = self.conv2.forward(h1)
        with t("fc"):
            logits = self.fc.forward(self.flatten.forward(h2))
            loss = self.loss.forward(logits, labels)
            dh2 = self.flatten.backward(self.fc.backward(self.loss.backward()))
        with t("conv_backward"):
            dh1 = self.conv2.backward(dh2)
            self.conv1.backward(dh1)
        with t("update"):
            for conv in self.convs:
                conv.step(cfg)
            for k in ("weight", "bias"):
                self._fc_momentum[k] = self.host.sgd_update(self.fc.params[k], self.fc.grads[k],
                                                            self._fc_momentum[k], cfg)
        return float(loss)

    def params(self) -> dict:
        """The current weights as host float32 arrays in PyTorch's layout."""
        out = {}
        for conv in self.convs:
            w, b, _, _ = conv.gather_state()
            out[f"{conv.name}.weight"], out[f"{conv.name}.bias"] = w, b
        out["fc.weight"] = np.array(self.fc.params["weight"])
        out["fc.bias"] = np.array(self.fc.params["bias"])
        return out

    def momentum(self) -> dict:
        """{layer: (vw, vb)} host arrays, (None, None) before the first step."""
        out = {}
        for conv in self.convs:
            _, _, vw, vb = conv.gather_state()
            out[conv.name] = (vw, vb)
        out["fc"] = (self._fc_momentum["weight"], self._fc_momentum["bias"])
        return out

    def set_momentum(self, moms: dict) -> None:
        """Install momentum buffers {"conv1.weight": array, ...} (from a checkpoint)."""
        for conv in self.convs:
            if f"{conv.name}.weight" in moms:
                w, b, _, _ = conv.gather_state()
                conv.install(w, b, moms[f"{conv.name}.weight"], moms[f"{conv.name}.bias"],
                             conv.counts)
        if "fc.weight" in moms:
            self._fc_momentum = {"weight": moms["fc.weight"].copy(),
                                 "bias": moms["fc.bias"].copy()}

    def partition(self) -> dict:
        return {conv.name: {d.name: c for d, c in zip(self.devices, conv.counts)}
                for conv in self.convs}
