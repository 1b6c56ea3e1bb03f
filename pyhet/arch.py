"""The --arch notation of CNN papers, parsed into a NetGeometry.

Blocks are joined by ``-``, left to right from the input:

    32C5        convolution, 32 kernels of 5x5, stride 1, no padding, then ReLU
    32C3p1s2    the same with zero padding 1 and stride 2 (either suffix may be left out)
    P2, P3s2    max-pool 2x2 stride 2; 3x3 stride 2 (floor mode); it ends the conv before it
    256N        a hidden fully connected layer of 256 units, then ReLU

The classifier (fc to the number of classes) is implicit at the end. Conv blocks (each with an
optional pool) come first, then the hidden fc layers. ``--kernels A,B`` with ``--kernel-size k``
is the shorthand ``AC{k}-P2-BC{k}-P2``; the paper's network is ``500C5-P2-1500C5-P2``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ArchitectureError, shown
from .geometry import ConvGeometry, NetGeometry

DEFAULT_KERNELS = (32, 64)
DEFAULT_KERNEL_SIZE = 5
PAPER_ARCH = "500C5-P2-1500C5-P2"

# ASCII digits only (\d would also take other scripts' digits, and int() reads them)
_CONV = re.compile(r"^([0-9]+)C([0-9]+)((?:[ps][0-9]+)*)$")
_POOL = re.compile(r"^P([0-9]+)(?:s([0-9]+))?$")
_FC = re.compile(r"^([0-9]+)N$")
_FORMS = "32C5, 32C3p1s2, P2, P3s2 or 256N"


@dataclass(frozen=True)
class ConvSpec:
    kernels: int
    size: int
    stride: int = 1
    pad: int = 0
    pool: int = 1
    pool_stride: int = 1


def shorthand(kernels, kernel_size: int = DEFAULT_KERNEL_SIZE) -> str:
    """The --arch form of --kernels A,B and --kernel-size k: two conv blocks, each pooled 2x2."""
    return "-".join(f"{int(k)}C{int(kernel_size)}-P2" for k in kernels)


_INT_MAX = 2**31 - 1


def parse(spec: str, option: str = "--arch") -> tuple[list[ConvSpec], list[int]]:
    """An --arch SPEC -> (conv blocks, hidden fc units). Shapes are not checked here: see
    build(), which knows the input. Errors name `option` (the Python API's "arch")."""
    if not isinstance(spec, str):
        raise ArchitectureError(f"a network description must be a string such as "
                                f"{PAPER_ARCH!r}, got {type(spec).__name__}")
    if not spec.strip():
        raise ArchitectureError(f"empty {option}: expected blocks such as {PAPER_ARCH!r}")
    # (the digits end the block: "32C5s-64C3" is a stride left out, then a block)
    if m := re.search(r"[0-9]+C[0-9]+(?:[ps][0-9]+)*([ps])-([0-9]+)(?=[ps]|-|$)", spec):
        what = "padding must be a whole number >= 0" if m[1] == "p" else \
            "stride must be a whole number >= 1"
        raise ArchitectureError(f"{option} {shown(spec)}: {shown(m[0])}: {what}, got -{m[2]}")
    convs: list[ConvSpec] = []
    hidden: list[int] = []
    previous = None  # the kind of the block before: "conv", "pool" or "fc"
    for n, raw in enumerate(spec.strip().split("-"), start=1):
        tok = raw.strip()
        where = f"{option} {shown(spec)}, block {n} ({shown(tok)})"
        # every size is a C int of the core (int() of 4,300 digits and more is a ValueError,
        # leading zeros counted)
        big = next((d for d in re.findall(r"[0-9]+", tok)
                    if len(d.lstrip("0")) > 10 or int(d.lstrip("0") or "0") > _INT_MAX), None)
        if big is not None:
            raise ArchitectureError(f"{where}: {shown(big, 20)} is past the largest size "
                                    f"this engine takes, 2**31 - 1")
        tok = re.sub(r"[0-9]+", lambda d: d[0].lstrip("0") or "0", tok)
        if m := _CONV.match(tok):
            if hidden:
                raise ArchitectureError(f"{where}: a conv block after a fully connected layer; "
                                        f"conv blocks come first, then the fc layers")
            suffix = dict.fromkeys("ps")
            for key, value in re.findall(r"([ps])([0-9]+)", m[3]):
                if suffix[key] is not None:
                    raise ArchitectureError(f"{where}: {key!r} is given twice")
                suffix[key] = int(value)
            conv = ConvSpec(int(m[1]), int(m[2]), 1 if suffix["s"] is None else suffix["s"],
                            suffix["p"] or 0)
            if conv.kernels < 1 or conv.size < 1 or conv.stride < 1:
                raise ArchitectureError(f"{where}: kernels, kernel size and stride must be "
                                        f">= 1")
            convs.append(conv)
            previous = "conv"
        elif m := _POOL.match(tok):
            if previous != "conv":
                raise ArchitectureError(f"{where}: a pool must follow a conv block (32C5-P2)")
            k = int(m[1])
            s = int(m[2]) if m[2] is not None else k
            if k < 1 or s < 1:
                raise ArchitectureError(f"{where}: pool window and stride must be >= 1")
            if k == 1 and s == 1:
                raise ArchitectureError(f"{where}: a 1x1 pool of stride 1 changes nothing; leave "
                                        f"it out for a block without pooling")
            last = convs[-1]
            convs[-1] = ConvSpec(last.kernels, last.size, last.stride, last.pad, k, s)
            previous = "pool"
        elif m := _FC.match(tok):
            if not convs:
                raise ArchitectureError(f"{where}: fc layers come after the conv blocks; the "
                                        f"network needs at least one conv block first")
            if int(m[1]) < 1:
                raise ArchitectureError(f"{where}: an fc layer needs >= 1 unit")
            hidden.append(int(m[1]))
            previous = "fc"
        else:
            ascii_only = "" if tok.isascii() else " (numbers in ASCII digits)"
            raise ArchitectureError(f"{where}: not a block; expected forms like "
                                    f"{_FORMS}{ascii_only}")
    if not convs:
        raise ArchitectureError(f"{option} {shown(spec)}: the network needs at least one conv "
                                f"block (such as 32C5)")
    return convs, hidden


def build(spec: str, input_shape, num_classes: int, option: str = "--arch") -> NetGeometry:
    """The geometry of the network `spec` on inputs of `input_shape` (C, H, W); a shape that
    cannot work raises ArchitectureError naming the block and the sizes."""
    convs, hidden = parse(spec, option)
    C, H, W = (int(v) for v in input_shape)
    images = f"{C}x{H}x{W}"
    blocks = []
    for i, c in enumerate(convs):
        try:
            g = ConvGeometry(f"conv{i + 1}", C, H, W, c.kernels, c.size, c.size, c.stride,
                             c.pad, c.pool, c.pool_stride)
        except ArchitectureError as e:
            raise ArchitectureError(f"the network {spec} on {images} images: {e}") from None
        blocks.append(g)
        C, H, W = g.out_shape
    try:
        return NetGeometry(tuple(int(v) for v in input_shape), tuple(blocks), tuple(hidden),
                           int(num_classes))
    except ArchitectureError as e:
        raise ArchitectureError(f"the network {spec}: {e}") from None
