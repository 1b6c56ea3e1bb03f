"""The shapes of a network, in one place: every module asks these, none re-derives them.

A conv block is a convolution (K kernels of R x S, a stride, zero padding), then ReLU, then an
optional max-pool (window and stride; floor mode, as torch.nn.MaxPool2d). A network is a stack
of conv blocks, then hidden fully connected layers with ReLU, then the classifier.

Letters: N images, C input channels, (H, W) input plane, K kernels (output channels), (R, S)
kernel size, (OH, OW) conv output plane, (PH, PW) block output plane (after the pool), F fc
inputs, M classes.
    x (N, C, H, W) -> y (N, K, OH, OW) -> out (N, K, PH, PW)
    col (C*R*S, N*OH*OW): im2col of x, row (c, i, j), column (n, oh, ow)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ArchitectureError, shown


def int_arg(v, name: str, what: str, minimum: int = 0) -> int:
    """An int argument (a size, kernel, stride, padding or window) >= minimum, as an int: a
    TypeError for another type (a bool too; NumPy's integers are ints), a ValueError below
    minimum."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{what}: {name} must be >= {minimum}, got {shown(v)}")
    return int(v)


def _conv_out(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


def _pool_out(size: int, k: int, stride: int) -> int:
    return (size - k) // stride + 1


def conv_out_size(size: int, k: int, stride: int = 1, pad: int = 0) -> int:
    """Output length of a convolution along one axis (Caffe's and PyTorch's formula): >= 1,
    since the kernel must fit the padded input (a ValueError where it does not)."""
    what = "conv_out_size"
    size, k = int_arg(size, "size", what), int_arg(k, "k", what, 1)
    stride, pad = int_arg(stride, "stride", what, 1), int_arg(pad, "pad", what)
    if size + 2 * pad < k:
        raise ValueError(f"{what}: a kernel of {k} does not fit a size {size} input with "
                         f"padding {pad}")
    return _conv_out(size, k, stride, pad)


def pool_out_size(size: int, k: int, stride: int) -> int:
    """Output length of a max-pool along one axis, floor mode (windows that do not fit drop):
    >= 1, since the window must fit the input (a ValueError where it does not)."""
    what = "pool_out_size"
    size, k, stride = int_arg(size, "size", what), int_arg(k, "k", what, 1), int_arg(
        stride, "stride", what, 1)
    if size < k:
        raise ValueError(f"{what}: window {k} is larger than the size {size} input")
    return _pool_out(size, k, stride)


# Arrays of a conv output's size per kernel that a GPU holds at the peak of a step
GPU_OUTPUTS = 5


@dataclass(frozen=True)
class ConvGeometry:
    """One conv block: input (C, H, W), K kernels of R x S with stride and zero padding, ReLU,
    then a max-pool of window `pool` and stride `pool_stride` (pool 1: no pooling)."""

    name: str
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    stride: int = 1
    pad: int = 0
    pool: int = 1
    pool_stride: int = 1

    def __post_init__(self):
        for field in ("C", "H", "W", "K", "R", "S", "stride", "pool", "pool_stride"):
            if getattr(self, field) < 1:
                raise ArchitectureError(f"{self.name}: {field} must be >= 1, got "
                                        f"{getattr(self, field)}")
        if self.pad < 0:
            raise ArchitectureError(f"{self.name}: padding must be >= 0, got {self.pad}")
        Hp, Wp = self.H + 2 * self.pad, self.W + 2 * self.pad
        if self.R > Hp or self.S > Wp:
            padded = f" padded by {self.pad} ({Hp}x{Wp})" if self.pad else ""
            raise ArchitectureError(f"{self.name}: a {self.R}x{self.S} kernel is larger than its "
                                    f"{self.H}x{self.W} input{padded}: the map is too small")
        if self.pool > self.OH or self.pool > self.OW:
            raise ArchitectureError(f"{self.name}: a {self.pool}x{self.pool} pool is larger than "
                                    f"the {self.OH}x{self.OW} conv output (input "
                                    f"{self.H}x{self.W}, kernel {self.R}x{self.S}, stride "
                                    f"{self.stride}, padding {self.pad}): the map is too small "
                                    f"and would shrink below 1x1")

    # --- shapes -------------------------------------------------------------------------------

    @property
    def OH(self) -> int:   # (the fields are checked: see __post_init__)
        return _conv_out(self.H, self.R, self.stride, self.pad)

    @property
    def OW(self) -> int:
        return _conv_out(self.W, self.S, self.stride, self.pad)

    @property
    def PH(self) -> int:
        return _pool_out(self.OH, self.pool, self.pool_stride)

    @property
    def PW(self) -> int:
        return _pool_out(self.OW, self.pool, self.pool_stride)

    @property
    def has_pool(self) -> bool:
        return self.pool > 1 or self.pool_stride > 1

    @property
    def in_shape(self) -> tuple:
        return (self.C, self.H, self.W)

    @property
    def out_shape(self) -> tuple:
        """(K, PH, PW): one image's output of the block."""
        return (self.K, self.PH, self.PW)

    @property
    def weight_shape(self) -> tuple:
        return (self.K, self.C, self.R, self.S)

    @property
    def col_rows(self) -> int:
        return self.C * self.R * self.S

    def x_shape(self, N: int) -> tuple:
        return (N, self.C, self.H, self.W)

    def y_shape(self, k: int, N: int) -> tuple:
        """(k, N, OH, OW): the conv output of k kernels as the GEMM leaves it."""
        return (k, N, self.OH, self.OW)

    def out_batch_shape(self, k: int, N: int) -> tuple:
        """(N, k, PH, PW): the block output of k kernels."""
        return (N, k, self.PH, self.PW)

    def positions(self, N: int) -> int:
        """N * OH * OW: the columns of the im2col matrix."""
        return N * self.OH * self.OW

    def col_shape(self, N: int) -> tuple:
        return (self.col_rows, self.positions(N))

    # --- cost ---------------------------------------------------------------------------------

    def bytes_per_kernel(self, N: int, outputs: int = 2) -> int:
        """Memory a kernel costs a device: its weights, gradient and momentum, the update's
        staged weights and momentum (pyhet.failover's two-phase update), and `outputs` arrays
        of its conv output's size: 2 on the host (the output and its gradient: the C++ core
        fuses the block), GPU_OUTPUTS on a GPU (the reference's array expressions keep the
        conv output, ReLU's, and in the backward max-pool's and ReLU's gradients beside the
        output's gradient). A GPU's update also takes one temporary of its weights' size
        (pyhet.optim.sgd_update_into), at most a fifth of this: calibration's cap of 0.8 of the
        free memory leaves room for it."""
        return 4 * (5 * self.col_rows + outputs * self.positions(N))

    def fixed_bytes(self, N: int) -> int:
        """Memory a device needs whatever its share: the input and its gradient, and two
        matrices of the im2col matrix's size (the im2col matrix, whose place its gradient
        takes). A host group shares the matrix and its packed operands: 2 or 3 of its size in
        all, or 2.75 where the forward's is packed as its quadrants' sums (the weight gradient
        reads them too), which two per device cover."""
        return 4 * (2 * self.col_rows * self.positions(N) + 2 * N * self.C * self.H * self.W)

    def link_bytes(self, N: int, need_dx: bool) -> tuple:
        """(fixed bytes, bytes per kernel) a device on another rank moves for this layer in one
        step: x (N, C, H, W) in, and dx of the same shape out where the layer needs it; per
        kernel, its output slice (N, 1, PH, PW) out and that slice's gradient in."""
        x_bytes = 4 * N * self.C * self.H * self.W
        return x_bytes * (2 if need_dx else 1), 2 * 4 * N * self.PH * self.PW

    def link_bytes_phases(self, N: int, need_dx: bool) -> tuple:
        """link_bytes by phase: ((fixed, per kernel) bytes of the forward: x in, the output
        slice out; (fixed, per kernel) of the backward: the output gradient slice in, dx out
        where the layer needs it)."""
        x_bytes, slice_bytes = 4 * N * self.C * self.H * self.W, 4 * N * self.PH * self.PW
        return (x_bytes, slice_bytes), (x_bytes if need_dx else 0, slice_bytes)

    def forward_share(self, need_dx: bool = True) -> float:
        """The forward's share of the layer's training FLOPs: one GEMM of the two or three."""
        return 1 / (3 if need_dx else 2)

    def flops_per_image(self, need_dx: bool = True) -> int:
        """Multiply-adds x 2 of one training step per image: forward, weight gradient and (when
        the block's input needs a gradient) input gradient, each one GEMM of this size."""
        gemm = 2 * self.K * self.col_rows * self.OH * self.OW
        return (3 if need_dx else 2) * gemm

    # --- notation -----------------------------------------------------------------------------

    def spec(self) -> str:
        """The block in --arch notation: 32C5, 32C3p1s2, then -P2 or -P3s2 for its pool."""
        text = f"{self.K}C{self.R}" + (f"p{self.pad}" if self.pad else "") + (
            f"s{self.stride}" if self.stride != 1 else "")
        if self.has_pool:
            text += f"-P{self.pool}" + (f"s{self.pool_stride}" if self.pool_stride != self.pool
                                        else "")
        return text


@dataclass(frozen=True)
class NetGeometry:
    """A whole network: conv blocks conv1..convN, hidden fc layers fc1..fcM, classifier fc."""

    input_shape: tuple          # (C, H, W)
    blocks: tuple               # ConvGeometry, conv1 first
    hidden: tuple = ()          # units of each hidden fc layer
    num_classes: int = 10

    def __post_init__(self):
        if not self.blocks:
            raise ArchitectureError("a network needs at least one conv block")
        if self.num_classes < 2:
            raise ArchitectureError(f"a network needs at least 2 classes, got {self.num_classes}")
        prev = tuple(self.input_shape)
        for g in self.blocks:
            if g.in_shape != prev:
                raise ArchitectureError(f"{g.name}: expects input {g.in_shape}, but gets "
                                        f"{prev}")
            prev = g.out_shape
        if any(u < 1 for u in self.hidden):
            raise ArchitectureError(f"hidden fc layers need >= 1 unit, got "
                                    f"{list(self.hidden)}")

    @property
    def arch(self) -> str:
        """The network in --arch notation (the classifier is implicit)."""
        return "-".join([g.spec() for g in self.blocks] + [f"{u}N" for u in self.hidden])

    @property
    def kernel_size(self):
        """The blocks' kernel size (R), or a list of each block's where they differ (the
        summaries' kernel_size)."""
        sizes = [g.R for g in self.blocks]
        return sizes[0] if len(set(sizes)) == 1 else sizes

    @property
    def kernels(self) -> tuple:
        return tuple(g.K for g in self.blocks)

    @property
    def features(self) -> int:
        """F: the flattened output of the last conv block, the first fc layer's input."""
        K, PH, PW = self.blocks[-1].out_shape
        return K * PH * PW

    def fc_layers(self) -> list:
        """[(name, inputs, outputs)] of the fc layers in order: fc1..fcM, then fc."""
        sizes = [self.features, *self.hidden, self.num_classes]
        names = [f"fc{i + 1}" for i in range(len(self.hidden))] + ["fc"]
        return [(n, sizes[i], sizes[i + 1]) for i, n in enumerate(names)]

    def param_shapes(self) -> dict:
        """{name: shape} of every parameter, in PyTorch's layout and names, in layer order."""
        shapes = {}
        for g in self.blocks:
            shapes[f"{g.name}.weight"], shapes[f"{g.name}.bias"] = g.weight_shape, (g.K,)
        for name, f_in, f_out in self.fc_layers():
            shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (f_out, f_in), (f_out,)
        return shapes

    @property
    def param_names(self) -> tuple:
        return tuple(self.param_shapes())

    def flops_per_image(self) -> dict:
        """Multiply-adds x 2 of one training step per image, by layer (forward and backward;
        the first conv block computes no input gradient)."""
        out = {g.name: g.flops_per_image(need_dx=i > 0) for i, g in enumerate(self.blocks)}
        for i, (name, f_in, f_out) in enumerate(self.fc_layers()):
            out[name] = 3 * 2 * f_in * f_out
        return out
