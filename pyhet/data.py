"""Datasets: read them from their published file formats, check them, normalise them.

    ds = load_dataset("fashion-mnist", data_dir=None, seed=0)
    for xb, yb in iterate_batches(ds.x_train, ds.y_train, 64, shuffle=True, rng=rng): ...
    ds = load_test_split("mnist", data_dir="DIR")     # for evaluation: the test files alone

Names (`DATASETS`, plus `npz:FILE`):

    bundled        a class-balanced subset of Fashion-MNIST shipped in pyhet/_bundled/
                   (12,000 train / 2,000 test images, see its NOTICE), gzipped IDX
    fashion-mnist  the four IDX files, gzipped or raw (default /usr/share/datasets/fashion-mnist)
    mnist          the same format and file names (default ~/.cache/pyhet/mnist)
    cifar10        the python (pickled) or binary layout (default ~/.cache/pyhet/cifar10)
    synthetic      1,024 random CIFAR-10-shaped images, 10 classes, no test split
    npz:FILE       arrays x, y [, x_test, y_test, num_classes], as README describes

The named datasets are scaled to [0, 1] and then normalised per channel with the
training split's mean and standard deviation (both splits with the same numbers);
an npz dataset is used as it comes (uint8 only scaled to [0, 1]).

Nothing is ever downloaded: a missing file's error says where the published files come from.
Every file is checked against what its format promises, and a file that is
missing, truncated or malformed raises `DataError` with a message that names the
file, what was expected and what came.

Dimension letters: N images, C channels, H x W pixels. x (N, C, H, W), y (N,).
"""

import functools
import gzip
import io
import math
import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import files, npzfile
from .errors import DataError, UsageError, said, shown
from .images import (Normalization, channel_last_message, looks_channel_last,
                     native_float32)

DATASETS = ("bundled", "fashion-mnist", "mnist", "cifar10", "synthetic")
FOLDER_DATASETS = ("fashion-mnist", "mnist", "cifar10")    # the ones read from a data folder

BUNDLED_DIR = Path(__file__).resolve().parent / "_bundled"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
MNIST_CLASSES = [str(d) for d in range(10)]
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]

# the largest seed (a checkpoint's settings record a run's: a whole number of JSON)
MAX_SEED = 2**64 - 1

# Where the files of mnist and cifar10 come from, for the errors of a missing one
MNIST_SOURCE = ("the four IDX files, train-images-idx3-ubyte.gz etc., as published at "
                "http://yann.lecun.com/exdb/mnist/; pyhet downloads none")
CIFAR10_SOURCE = ("CIFAR-10's python version, cifar-10-python.tar.gz, or its binary version, "
                  "cifar-10-binary.tar.gz, from https://www.cs.toronto.edu/~kriz/cifar.html, "
                  "extracted with tar xzf; pyhet downloads neither")
GIVE_FOLDER = "give its folder: --data-dir DIR, data_dir= in Python"
# What the errors of the training files add where only the test split's images are wanted
TRAIN_STATISTICS_WHY = ("; the training split is read for its per-channel mean and std, which "
                        "normalise the test images for a network whose weight file records no "
                        "normalisation (one of an earlier version)")


def _cache_dir(name):
    """~/.cache/pyhet/NAME (or $XDG_CACHE_HOME/pyhet/NAME): where mnist and cifar10
    are looked for when no --data-dir is given; nothing is ever downloaded there."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):     # the XDG spec: a relative one is ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pyhet" / name


# ================================================================ the Dataset

@dataclass
class Dataset:
    """Arrays ready for training: x float32 C-contiguous (N, C, H, W), y int64 (N,)."""

    name: str
    x_train: np.ndarray            # (N, C, H, W) float32
    y_train: np.ndarray            # (N,) int64
    x_test: "np.ndarray | None"    # (M, C, H, W) float32, or None
    y_test: "np.ndarray | None"    # (M,) int64, or None
    num_classes: int
    classes: "list[str] | None"    # class names, where known
    source: str                    # where it was read from
    # how raw uint8 images became x: per channel x = raw * scale + shift (None: raw / 255)
    normalization: "Normalization | None" = None
    # the test split's raw uint8 pixels (M, C, H, W) where the file held pixels, else None:
    # a trained network's evaluate() prepares them as its own training images were
    x_test_raw: "np.ndarray | None" = None

    @property
    def input_shape(self):
        """(C, H, W) of one image."""
        return tuple(int(d) for d in self.x_train.shape[1:])


def describe(ds):
    """One line: name, image counts, image shape, classes and source."""
    counts = (f"{len(ds.x_train)} train images, no test split" if ds.x_test is None
              else f"{len(ds.x_train)} train + {len(ds.x_test)} test images")
    shape = "x".join(str(d) for d in ds.input_shape)
    names = f" ({', '.join(ds.classes)})" if ds.classes else ""
    return (f"{ds.name}: {counts} of {shape}, {ds.num_classes} classes{names}; "
            f"from {ds.source}")


def iterate_batches(x, y, batch_size, shuffle, rng=None):
    """Yield (xb, yb) batches of one epoch over x (N, ...) and y (N,).

    Without shuffle the batches are consecutive slices in file order (views, no
    copy); with shuffle they follow `rng.permutation(N)` (a numpy Generator), and
    each batch is gathered into a new C-contiguous array. The last batch holds
    the N % batch_size leftover images when there are any.
    """
    n = len(x)
    if len(y) != n:
        raise ValueError(f"x has {n} images but y has {len(y)} labels")
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    batch_size = int(batch_size)
    if shuffle:
        if rng is None:
            raise ValueError("shuffle=True needs an rng (numpy.random.Generator)")
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            yield x[idx], y[idx]                       # (B, C, H, W), (B,)
    else:
        for start in range(0, n, batch_size):
            yield x[start:start + batch_size], y[start:start + batch_size]


# ================================================================ entry point

def name_problem(name: str) -> "str | None":
    """What is wrong with a dataset's name (neither one of DATASETS nor npz:FILE), or None."""
    if name in DATASETS or (name.startswith("npz:") and name[len("npz:"):].strip()):
        return None
    if name.startswith("npz:"):
        return f"{shown(name)}: expected npz:FILE, the path of an .npz file after the colon"
    return f"unknown dataset {shown(name)}: expected one of {', '.join(DATASETS)}, or npz:FILE"


def data_dir_problem(name, data_dir) -> "str | None":
    """Why a data folder may not be given with the dataset `name` (one that reads none: the
    folder would be ignored, and the run train on other data than the user's), or None."""
    if data_dir is None or name in FOLDER_DATASETS:
        return None
    return (f"the dataset {shown(name)} reads no data folder, but one was given: "
            f"{shown(data_dir)} (--data-dir, data_dir= in Python); only "
            f"{', '.join(FOLDER_DATASETS[:-1])} and {FOLDER_DATASETS[-1]} read one: name the "
            f"dataset it holds, or leave the folder out")


def load_dataset(name, data_dir=None, seed=0, *, input_shape=None):
    """The Dataset called `name` (one of DATASETS, or "npz:FILE").

    data_dir is where the fashion-mnist, mnist and cifar10 files are (default: the
    dataset's usual place); the other names read no folder and refuse one (a folder given with
    the wrong name, or none, trained on other data without a word). seed only changes
    synthetic. input_shape: the (C, H, W) of the network the images are for, where known: an
    npz file's images of exactly that shape are not taken for channel-last ones.
    """
    return _load(name, data_dir, seed, test_only=False, input_shape=input_shape)


def load_test_split(name, data_dir=None, seed=0, *, train_statistics=False,
                    input_shape=None):
    """The Dataset called `name` for evaluating a network on its test split: of fashion-mnist,
    mnist and cifar10 only the test files are read. Its x_test_raw holds their pixels, x_test
    the same scaled to [0, 1] (normalization None), and its training split is empty (no images,
    of the test images' shape).

    train_statistics=True is for a network whose weight file records no normalisation (one of
    an earlier version), which takes x_test as load_dataset normalises it, with the training
    split's statistics: the training files are read too, and their errors say why. The other
    names are read as load_dataset reads them (input_shape too)."""
    return _load(name, data_dir, seed, test_only=not train_statistics,
                 why=TRAIN_STATISTICS_WHY if train_statistics else "", input_shape=input_shape)


def _load(name, data_dir, seed, test_only: bool, why: str = "", input_shape=None):
    """load_dataset; with test_only, the folder datasets' test split alone (load_test_split).
    why: what the errors of the training split's files add."""
    if not isinstance(name, str):
        raise UsageError(f"dataset name must be a string, got {shown(name)}")
    if data_dir is not None:
        try:
            data_dir = os.fspath(data_dir)
        except TypeError:   # not a path: said below
            pass
        if not isinstance(data_dir, str) or not data_dir or "\0" in data_dir:
            raise UsageError(f"data_dir must be a folder's path (a non-empty str or "
                            f"os.PathLike, without NUL), got {shown(data_dir)}")
    if (isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer))
            or not 0 <= seed <= MAX_SEED):
        raise UsageError(f"seed must be a whole number in 0 .. 2**64 - 1, got {shown(seed)}")
    if name_problem(name) is not None:   # a bad argument, as the command line's exit 2
        raise UsageError(name_problem(name))
    if data_dir_problem(name, data_dir) is not None:
        raise UsageError(data_dir_problem(name, data_dir))
    if name.startswith("npz:"):
        return load_npz(name[len("npz:"):], input_shape)
    if name == "bundled":
        return _load_idx_dataset("bundled", BUNDLED_DIR, FASHION_MNIST_CLASSES,
                                 hint=" (pyhet's bundled dataset is missing: reinstall pyhet)")
    if name == "fashion-mnist":
        where = Path(files.user_path(data_dir)) if data_dir else FASHION_MNIST_DIR
        hint = "" if data_dir else (f" (Debian/Ubuntu: apt install dataset-fashion-mnist;"
                                    f" or {GIVE_FOLDER})")
        return _load_idx_dataset("fashion-mnist", where, FASHION_MNIST_CLASSES, hint,
                                 test_only, why)
    if name == "mnist":
        where = Path(files.user_path(data_dir)) if data_dir else _cache_dir("mnist")
        hint = f" ({MNIST_SOURCE})" if data_dir else f" ({MNIST_SOURCE}: {GIVE_FOLDER})"
        return _load_idx_dataset("mnist", where, MNIST_CLASSES, hint, test_only, why)
    if name == "cifar10":
        return load_cifar10(data_dir, test_only, why)
    assert name == "synthetic", name       # name_problem let no other name through
    return make_synthetic(seed)


# Image shape (C, H, W) and class count of the named datasets, known without reading them.
SHAPES = {"bundled": ((1, 28, 28), 10), "fashion-mnist": ((1, 28, 28), 10),
          "mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10),
          "synthetic": ((3, 32, 32), 10)}


def input_shape_of(name, data_dir=None):
    """((C, H, W), num_classes) of the dataset `name`; an npz: file is read for them."""
    if isinstance(name, str) and name in SHAPES:
        return SHAPES[name]
    ds = load_dataset(name, data_dir)
    return ds.input_shape, ds.num_classes


# ================================================================ normalisation

def _normalise(x_train, x_test):
    """uint8 (N, C, H, W) splits -> float32, scaled to [0, 1], then per channel
    (x - mean) / std with the training split's mean and std.

    The statistics are exact: on the raw 0..255 integers, the float64 sums of x
    and x**2 are whole numbers below 2**53, accumulated two thousand images at
    a time so that no float64 copy of the whole set is ever made.
    """
    n, c = x_train.shape[:2]
    count = x_train.size // c                                 # values per channel
    s1 = np.zeros(c, np.float64)
    s2 = np.zeros(c, np.float64)
    for start in range(0, n, 2048):
        chunk = x_train[start:start + 2048].astype(np.float64)  # (B, C, H, W)
        s1 += chunk.sum(axis=(0, 2, 3))
        s2 += np.square(chunk).sum(axis=(0, 2, 3))
    mean = s1 / count                                         # (C,) in 0..255 units
    var = np.maximum(s2 / count - mean * mean, 0.0)
    std = np.sqrt(var)
    std[std == 0] = 255.0                                     # a constant channel: leave its scale
    mean, std = mean / 255.0, std / 255.0                     # in [0, 1] units

    # ((x / 255) - mean) / std  ==  x * scale + shift, per channel
    norm = Normalization(tuple(float(v) for v in (1.0 / (255.0 * std)).astype(np.float32)),
                         tuple(float(v) for v in (-mean / std).astype(np.float32)))
    return norm.apply(x_train), (None if x_test is None else norm.apply(x_test)), norm


def _labels(y):
    return np.ascontiguousarray(y, dtype=np.int64)


# ================================================================ reading files

READ_CHUNK = 1 << 20


def _read_file(path, limit: int | None = None):
    """The bytes of `path`, gunzipped when its name ends in .gz; with `limit`, at most that many
    (read a chunk at a time: the rest is not read, so that a gzip file of a few megabytes that
    holds gigabytes past what its header promises is refused without them)."""
    gz = path.suffix == ".gz"
    chunks, got = [], 0
    try:
        with files.open_regular(path, DataError) as f:    # a FIFO: refused, not waited on
            stream = gzip.GzipFile(fileobj=f, mode="rb") if gz else f
            try:
                while limit is None or got < limit:
                    chunk = stream.read(READ_CHUNK if limit is None
                                        else min(READ_CHUNK, limit - got))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)
            except (OSError, EOFError, zlib.error) as e:
                if not gz:
                    raise
                # BadGzipFile (an OSError) for a wrong header or CRC, EOFError when
                # the stream is cut short, zlib.error for corrupt deflate data
                raise DataError(f"{path}: not a valid gzip file ({e})") from e
    except FileNotFoundError as e:
        raise DataError(f"{path}: no such file") from e
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from e
    return b"".join(chunks)


# ---------------------------------------------------------------- IDX (MNIST, Fashion-MNIST)

IDX_IMAGES = 0x00000803      # unsigned bytes, 3 dimensions (N, H, W)
IDX_LABELS = 0x00000801      # unsigned bytes, 1 dimension (N,)

# (images, labels) file names of each split; each may also come gzipped, as NAME.gz
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path, magic):
    """The uint8 array of an IDX file (gzipped if its name ends in .gz).

    IDX: a big-endian uint32 magic number (0x0000 08 D: unsigned bytes, D
    dimensions), D big-endian uint32 sizes, then the values in C order.
    """
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    data = _read_file(path, limit=header)
    kind = {IDX_IMAGES: "image", IDX_LABELS: "label"}.get(magic, "IDX")
    if len(data) < 4:
        raise DataError(f"{path}: {len(data)} bytes, too short for an IDX header "
                        f"(expected magic 0x{magic:08x})")
    (got,) = struct.unpack(">I", data[:4])
    if got != magic:
        raise DataError(f"{path}: not an IDX {kind} file: magic number 0x{got:08x}, "
                        f"expected 0x{magic:08x} (unsigned bytes, {ndim} dimension"
                        f"{'s' if ndim > 1 else ''})" + _gzipped(data))
    if len(data) < header:
        raise DataError(f"{path}: {len(data)} bytes, too short for an IDX header of "
                        f"{ndim} dimensions ({header} bytes); truncated file?")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = math.prod(dims)          # Python ints: 3 sizes of up to 2**32 - 1 overflow int64
    # the data, and a byte more where the file has it: no more is read
    data = _read_file(path, limit=header + expected + 1)
    payload = len(data) - header
    if payload != expected:
        what = ("truncated file, or a damaged header?" if payload < expected
                else "trailing bytes, or a damaged header?")
        sizes = " x ".join(map(str, dims)) + f" = {expected}" if ndim > 1 else f"{expected}"
        holds = f"{payload}" if payload < expected else f"more than {expected}"
        raise DataError(f"{path}: header promises {sizes} bytes of data, the file "
                        f"holds {holds} ({what})")
    if dims[0] == 0:
        raise DataError(f"{path}: holds no {kind}s (the header says 0)")
    if 0 in dims[1:]:
        raise DataError(f"{path}: {kind}s of size {' x '.join(map(str, dims[1:]))}, expected "
                        f"every size >= 1")
    return np.frombuffer(data, np.uint8, offset=header).reshape(dims)


def _is(test, path) -> bool:
    """path.is_file() or path.is_dir() (`test`), where an error other than "not there" (a name
    too long, no permission to look) is the path's DataError, not a traceback: pathlib
    passes only a few errors over."""
    try:
        return test(path)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from e


def _find_idx_file(folder, stem, hint):
    """folder/stem or folder/stem.gz (the raw one when both are there)."""
    for name in (stem, stem + ".gz"):
        if _is(Path.is_file, folder / name):
            return folder / name
    for name in (stem, stem + ".gz"):
        there = files.not_regular(folder / name)      # a folder, a FIFO, ...
        if there is not None:
            raise DataError(f"{folder / name}: {there}, not a file; expected the IDX file "
                            f"{stem}[.gz]")
    if not _is(Path.is_dir, folder):
        raise DataError(f"{folder}: {_not_a_folder(folder)}, expected the IDX files "
                        f"{stem}[.gz] etc. in it{hint}")
    raise DataError(f"{folder / stem}[.gz]: no such file{hint}")


def read_idx_split(folder, split, hint="", num_classes=10):
    """x (N, H, W) uint8, y (N,) uint8 and the two paths of one split."""
    image_stem, label_stem = IDX_FILES[split]
    image_path = _find_idx_file(folder, image_stem, hint)
    label_path = _find_idx_file(folder, label_stem, hint)
    x = read_idx(image_path, IDX_IMAGES)                 # (N, H, W)
    y = read_idx(label_path, IDX_LABELS)                 # (N,)
    if len(x) != len(y):
        raise DataError(f"{label_path}: {len(y)} labels, but {image_path.name} "
                        f"has {len(x)} images")
    _check_label_range(y, num_classes, label_path)
    return x, y, image_path, label_path


def _load_idx_dataset(name, folder, classes, hint, test_only=False, why=""):
    """The Dataset of the four IDX files in `folder` (the test split's alone where test_only).
    hint ends the errors of a missing file or folder; why, those of the training files."""
    if test_only:
        x_test, y_test, _, _ = read_idx_split(folder, "test", hint)
        return _test_only(name, x_test[:, None], y_test, classes, folder)   # (M, 1, H, W)
    if why:      # the test files first: a training file's error is then the one to say why
        x_test, y_test, test_path, _ = read_idx_split(folder, "test", hint)
    try:
        x_train, y_train, path, _ = read_idx_split(folder, "train", hint)
    except DataError as e:
        if not why:
            raise
        raise DataError(f"{e}{why}") from e
    if not why:
        x_test, y_test, test_path, _ = read_idx_split(folder, "test", hint)
    if x_test.shape[1:] != x_train.shape[1:]:
        raise DataError(f"{test_path}: images of {x_test.shape[1]}x{x_test.shape[2]}, "
                        f"but the training images are {x_train.shape[1]}x{x_train.shape[2]}")
    xtr, xte, norm = _normalise(x_train[:, None], x_test[:, None])  # (N, 1, H, W)
    return Dataset(name, xtr, _labels(y_train), xte, _labels(y_test),
                   num_classes=len(classes), classes=list(classes), source=str(folder),
                   normalization=norm, x_test_raw=x_test[:, None])


def _test_only(name, x_test, y_test, classes, folder) -> Dataset:
    """The Dataset of a test split alone: raw uint8 x_test (M, C, H, W) kept as x_test_raw and
    scaled to [0, 1] (no training split's statistics to normalise it with); no training
    images."""
    empty = np.empty((0, *x_test.shape[1:]), np.float32)              # (0, C, H, W)
    scaled = x_test.astype(np.float32)                                # one copy, scaled
    scaled /= np.float32(255.0)
    return Dataset(name, empty, np.empty(0, np.int64), scaled, _labels(y_test),
                   num_classes=len(classes), classes=list(classes), source=str(folder),
                   normalization=None, x_test_raw=x_test)


def _not_a_folder(path) -> str:
    """Why a data folder is none, in words: "no such folder", or what is there instead."""
    try:
        return f"{files.kind(os.stat(path).st_mode)}, not a folder"
    except FileNotFoundError:
        return "no such folder"
    except OSError as e:    # a loop of symbolic links, a folder above it not readable
        return f"cannot be read ({e.strerror})"


def _check_label_range(y, num_classes, path):
    bad = np.flatnonzero((y < 0) | (y >= num_classes))
    if len(bad):
        i = int(bad[0])
        raise DataError(f"{path}: label {int(y[i])} at index {i} is out of range, "
                        f"expected 0..{num_classes - 1} ({len(bad)} such "
                        f"label{'s' if len(bad) > 1 else ''})")


# ---------------------------------------------------------------- CIFAR-10

CIFAR_PIXELS = 3 * 32 * 32                  # R plane, G plane, B plane of 32 x 32
CIFAR_RECORD = 1 + CIFAR_PIXELS             # binary layout: label byte + pixels
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = "test_batch"


def _find_cifar_folder(data_dir):
    """(folder, layout) where layout is "bin" or "py". data_dir may be either
    cifar-10-batches-* folder itself, or the folder that holds one."""
    root = Path(files.user_path(data_dir)) if data_dir else _cache_dir("cifar10")
    hint = _cifar_hint(data_dir)
    candidates = [root, root / "cifar-10-batches-bin", root / "cifar-10-batches-py"]
    for folder in candidates:
        if (_is(Path.is_file, folder / "data_batch_1.bin")
                or _is(Path.is_file, folder / "test_batch.bin")):
            return folder, "bin"
        if _is(Path.is_file, folder / "data_batch_1") or _is(Path.is_file, folder / "test_batch"):
            return folder, "py"
    if not root.is_dir():
        raise DataError(f"{root}: {_not_a_folder(root)}, expected CIFAR-10 in it "
                        f"(cifar-10-batches-py/ or cifar-10-batches-bin/){hint}")
    archives = [p.name for p in root.glob("cifar-10-*.tar.gz")]
    extract = f"; found {archives[0]}: extract it with tar xzf" if archives else ""
    raise DataError(f"{root}: no CIFAR-10 batches found: expected data_batch_1..5 and "
                    f"test_batch (python layout) or the same with .bin (binary layout), "
                    f"in it or in cifar-10-batches-py/ or cifar-10-batches-bin/ "
                    f"under it{extract}{hint}")


def _cifar_hint(data_dir) -> str:
    """What ends the error of a missing CIFAR-10 folder or file: where it comes from."""
    return f" ({CIFAR10_SOURCE})" if data_dir else f" ({CIFAR10_SOURCE}: {GIVE_FOLDER})"


def _gzipped(data: bytes) -> str:
    """What to say of a file that is gzip-compressed under a name without .gz (browsers drop
    the suffix), or nothing."""
    if data[:2] == b"\x1f\x8b":
        return "; it is gzip-compressed: decompress it (gunzip), or add .gz to its name"
    return ""


def read_cifar_bin(path):
    """x (N, 3, 32, 32) uint8, y (N,) uint8 of one binary-layout batch file:
    records of 1 label byte and 3072 pixel bytes."""
    data = _read_file(path)
    if len(data) == 0:
        raise DataError(f"{path}: an empty file, expected CIFAR-10 records of {CIFAR_RECORD} "
                        f"bytes (1 label + 3072 pixels); truncated file?")
    if len(data) % CIFAR_RECORD:
        raise DataError(f"{path}: {len(data)} bytes, not a whole number of CIFAR-10 "
                        f"records of {CIFAR_RECORD} bytes (1 label + 3072 pixels); "
                        + (_gzipped(data).lstrip("; ") or "truncated file?"))
    records = np.frombuffer(data, np.uint8).reshape(-1, CIFAR_RECORD)
    y = records[:, 0].copy()                                   # (N,)
    x = records[:, 1:].reshape(-1, 3, 32, 32)                  # (N, 3, 32, 32)
    _check_label_range(y, 10, path)
    return x, y


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """An unpickler that builds only what CIFAR-10's python batches hold: dicts,
    lists, strings, numbers and NumPy arrays. Any other global (os.system, eval,
    any class) is refused, so loading a hostile file cannot run its code.

    NumPy's helpers are looked up by the names the files use, old (numpy.core,
    as in the published files) and new (numpy._core), and mapped to this NumPy's
    own functions without importing the deprecated numpy.core module.
    """

    def find_class(self, module, name):
        allowed = _pickle_globals()
        if (module, name) in allowed:
            return allowed[(module, name)]
        raise pickle.UnpicklingError(f"refused to load global {module}.{name}: "
                                     f"only NumPy arrays are allowed")


@functools.lru_cache(maxsize=None)
def _pickle_globals():
    """{(module, name): object} of the globals a pickled ndarray refers to. NumPy's own are
    not handed out: its dtype's __setstate__ crashes the process on a state that does not fit
    the dtype (a datetime dtype given a uint8's state), so a damaged file could; these
    stand-ins build the same plain numeric arrays from checked parts."""
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): _PickledDtype,
               # Python 3 protocol-2 pickles spell bytes as _codecs.encode(str, "latin1")
               ("_codecs", "encode"): _latin1_encode,
               # ... and empty bytes as bytes()
               ("__builtin__", "bytes"): _empty_bytes, ("builtins", "bytes"): _empty_bytes}
    for core in ("numpy.core", "numpy._core"):
        allowed[(core + ".multiarray", "_reconstruct")] = _PickledArray    # protocols 0-4
        allowed[(core + ".numeric", "_frombuffer")] = _array_from_buffer  # protocol 5
    return allowed


class _PickledDtype:
    """numpy.dtype(name, align, copy) as a pickle builds it, then its state: only a plain
    number type (bool, integers, floats), in the plain state NumPy writes for one."""

    def __init__(self, name=None, align=False, copy=True):
        if isinstance(name, bytes):        # Python 2's str, read as bytes
            name = name.decode("latin1")
        try:
            dtype = np.dtype(name) if isinstance(name, str) and len(name) <= 8 else None
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in "biuf" or dtype.fields or dtype.subdtype:
            raise pickle.UnpicklingError(f"refused the dtype {shown(name)}: only "
                                         f"numbers are allowed")
        self.dtype = dtype

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) > 1 and isinstance(state[1], bytes):
            state = (state[0], state[1].decode("latin1"), *state[2:])
        if not (isinstance(state, tuple) and len(state) == 8 and state[0] == 3
                and state[1] in ("|", "<", ">", "=") and state[2:5] == (None, None, None)):
            raise pickle.UnpicklingError(f"refused a dtype state {shown(state)}")
        if state[1] in "<>":
            self.dtype = self.dtype.newbyteorder(state[1])


def _checked_array(raw, dtype, shape, fortran: bool) -> np.ndarray:
    """A copy of the array that the bytes `raw` hold, of a _PickledDtype and shape."""
    if not isinstance(dtype, _PickledDtype):
        raise pickle.UnpicklingError(f"refused an array of {type(dtype).__name__}")
    if not (isinstance(shape, tuple) and all(isinstance(d, int) and 0 <= d < 2**40
                                             for d in shape)):
        raise pickle.UnpicklingError(f"refused an array shape {shown(shape)}")
    if isinstance(raw, str):           # Python 2's str, read as text
        raw = raw.encode("latin1")
    if not isinstance(raw, (bytes, bytearray, memoryview, pickle.PickleBuffer)):
        raise pickle.UnpicklingError(f"refused array data of {type(raw).__name__}")
    raw = memoryview(raw).cast("B")
    need = math.prod(shape) * dtype.dtype.itemsize
    if len(raw) != need:
        raise pickle.UnpicklingError(f"array data of {len(raw)} bytes for {dtype.dtype} of "
                                     f"shape {shape} ({need} bytes)")
    flat = np.frombuffer(raw, dtype.dtype)
    return flat.reshape(shape, order="F" if fortran else "C").copy(order="C")


class _PickledArray:
    """numpy's _reconstruct(ndarray, (0,), b"b") as a pickle calls it, then the array's state
    (version, shape, dtype, fortran order, bytes); the array itself is put in its place once
    the file is read (_arrays_in)."""

    def __init__(self, cls=None, shape=None, code=None):
        if cls is not np.ndarray:
            raise pickle.UnpicklingError("refused an array subclass")
        self.array = None

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 5:
            state = state[1:]                      # the version, 1
        if not (isinstance(state, tuple) and len(state) == 4):
            raise pickle.UnpicklingError(f"refused an array state {shown(state)}")
        shape, dtype, fortran, raw = state
        self.array = _checked_array(raw, dtype, shape, bool(fortran))


def _array_from_buffer(buf, dtype, shape, order):
    """numpy's _frombuffer as a protocol-5 pickle calls it."""
    if order not in ("C", "F"):
        raise pickle.UnpicklingError(f"refused an array order {shown(order)}")
    return _checked_array(buf, dtype, shape, order == "F")


def _arrays_in(obj, depth: int = 0):
    """obj as unpickled, with each _PickledArray replaced by its array."""
    if depth > 50:
        raise pickle.UnpicklingError("refused nesting more than 50 deep")
    if isinstance(obj, _PickledArray):
        if obj.array is None:
            raise pickle.UnpicklingError("an array without its data")
        return obj.array
    if isinstance(obj, _PickledDtype):
        raise pickle.UnpicklingError("a dtype outside an array")
    if isinstance(obj, dict):
        return {k: _arrays_in(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_arrays_in(v, depth + 1) for v in obj)
    return obj


def _empty_bytes(*args):
    """bytes() as a protocol-2 pickle writes b"" (only that: no call with arguments)."""
    if args:
        raise pickle.UnpicklingError("refused bytes() with arguments")
    return b""


def _latin1_encode(text, encoding="latin1", errors="strict"):
    """_codecs.encode for the only codec a bytes pickle uses."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"refused _codecs.encode with {encoding!r}")
    return text.encode("latin1", errors)


def _unpickle(path, what="python batch"):
    data = _read_file(path)
    if data[:2] == b"\x1f\x8b":
        raise DataError(f"{path}: not a readable CIFAR-10 {what}; it is gzip-compressed: "
                        f"decompress it (gunzip)")
    try:
        return _arrays_in(_ArraysOnlyUnpickler(io.BytesIO(data), encoding="bytes").load())
    except Exception as e:        # any failure to decode is a malformed (or hostile) file
        raise DataError(f"{path}: not a readable CIFAR-10 {what} "
                        f"({type(e).__name__}: {said(e)})") from None


def _get(d, key, path):
    """d[key] for a dict unpickled with encoding="bytes" (bytes keys) or a str-keyed one."""
    for k in (key.encode(), key):
        if k in d:
            return d[k]
    raise DataError(f"{path}: no key {key!r} in the batch dict "
                    f"(keys: {', '.join(repr(k) for k in d)})")


def read_cifar_py(path):
    """x (N, 3, 32, 32) uint8, y (N,) uint8 of one python-layout (pickled) batch:
    a dict with data (N, 3072) uint8 and labels, a list of N ints."""
    d = _unpickle(path)
    if not isinstance(d, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(d).__name__}")
    data = _get(d, "data", path)
    labels = _get(d, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != CIFAR_PIXELS:
        got = (f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray)
               else type(data).__name__)
        raise DataError(f"{path}: 'data' should be a uint8 array of shape (N, {CIFAR_PIXELS}), "
                        f"got {got}")
    try:
        y = np.asarray(labels)
    except Exception:        # ragged: not one array
        y = None
    if y is None or y.ndim != 1 or y.dtype.kind not in "iu":
        got = (f"{type(labels).__name__} of {len(labels)} items, not all integers"
               if y is None else f"{type(labels).__name__} ({y.dtype}, shape {y.shape})")
        raise DataError(f"{path}: 'labels' should be a list of integers, got {got}")
    if len(y) != len(data):
        raise DataError(f"{path}: {len(y)} labels, but 'data' has {len(data)} images")
    if len(y) == 0:
        raise DataError(f"{path}: holds no images")
    _check_label_range(y, 10, path)
    return data.reshape(-1, 3, 32, 32), y.astype(np.uint8)


def _cifar_class_names(folder):
    """Names from batches.meta (python) or batches.meta.txt (binary) when present."""
    meta_py, meta_txt = folder / "batches.meta", folder / "batches.meta.txt"
    names = None
    if meta_py.is_file():
        d = _unpickle(meta_py, "batches.meta (class names)")
        raw = d.get(b"label_names", d.get("label_names")) if isinstance(d, dict) else None
        if raw is not None:
            if not isinstance(raw, (list, tuple)) or not all(
                    isinstance(n, (bytes, str)) for n in raw):
                raise DataError(f"{meta_py}: 'label_names' should be a list of 10 names, got "
                                f"{type(raw).__name__} {str(raw)[:80]}")
            names = [n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in raw]
    elif meta_txt.is_file():
        text = _read_file(meta_txt).decode("utf-8", "replace")
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if names is None:
        return list(CIFAR10_CLASSES)
    if len(names) != 10:
        meta = meta_py if meta_py.is_file() else meta_txt
        raise DataError(f"{meta}: {len(names)} label names, expected 10")
    bad = next((n for n in names if not n.strip() or not n.isprintable()), None)
    if bad is not None:    # the evaluation's table has a line per class
        meta = meta_py if meta_py.is_file() else meta_txt
        raise DataError(f"{meta}: class names must be printable and not blank, got {bad!r}")
    return names


def load_cifar10(data_dir=None, test_only=False, why=""):
    """CIFAR-10 from the python or binary layout, x (N, 3, 32, 32) normalised; with test_only,
    test_batch alone (see load_test_split). why ends the errors of the training batches."""
    folder, layout = _find_cifar_folder(data_dir)
    suffix = ".bin" if layout == "bin" else ""

    def read(name, why=""):
        path = folder / (name + suffix)
        if not os.path.lexists(path):
            raise DataError(f"{path}: no such file; a CIFAR-10 folder holds {CIFAR_TEST}{suffix} "
                            f"and data_batch_1..5{suffix}{_cifar_hint(data_dir)}{why}")
        try:
            return (read_cifar_bin if layout == "bin" else read_cifar_py)(path)
        except DataError as e:
            if not why:
                raise
            raise DataError(f"{e}{why}") from e

    x_test, y_test = read(CIFAR_TEST)                          # (10000, 3, 32, 32)
    classes = _cifar_class_names(folder)
    if test_only:
        return _test_only("cifar10", x_test, y_test, classes, folder)
    parts = [read(name, why) for name in CIFAR_TRAIN]
    x_train = np.concatenate([x for x, _ in parts])            # (50000, 3, 32, 32)
    y_train = np.concatenate([y for _, y in parts])
    xtr, xte, norm = _normalise(x_train, x_test)
    return Dataset("cifar10", xtr, _labels(y_train), xte, _labels(y_test),
                   num_classes=10, classes=classes, source=str(folder), normalization=norm,
                   x_test_raw=x_test)


# ================================================================ synthetic

SYNTHETIC_SIZE = 1024


def make_synthetic(seed=0):
    """1,024 random 3x32x32 uint8 images of 10 classes, no test split.

    Each class has its own random template and an image is half template, half
    noise, so the set is random yet learnable: a training run's loss can fall.
    """
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(10, 3, 32, 32))              # (10, 3, 32, 32)
    y = rng.integers(0, 10, size=SYNTHETIC_SIZE)                         # (N,)
    noise = rng.integers(0, 256, size=(SYNTHETIC_SIZE, 3, 32, 32))       # (N, 3, 32, 32)
    x = ((templates[y] + noise) // 2).astype(np.uint8)
    xtr, _, norm = _normalise(x, None)
    return Dataset("synthetic", xtr, _labels(y), None, None, num_classes=10, classes=None,
                   source=f"generated (seed {seed})", normalization=norm)


# ================================================================ npz:FILE

# The most classes an npz dataset may have, its 'num_classes' given or its labels' largest + 1:
# the core's sizes are C ints, so more is a stray label or a damaged count (a label of 2**62
# read as 4.6e18 classes was refused for the memory it would take)
MAX_INFERRED_CLASSES = 2**31 - 1


def load_npz(filename, input_shape=None):
    """The npz dataset README describes: x (N, C, H, W) float32 (used as is) or
    uint8 (scaled to [0, 1]), y (N,) integers, optional x_test, y_test and num_classes.
    input_shape: the (C, H, W) of the network the images are for, where known (images of that
    shape are not taken for channel-last)."""
    if not filename:
        raise DataError("npz: needs a file name, as in npz:data.npz")
    if "\0" in filename:
        raise DataError(f"npz:{shown(filename)}: a file name cannot hold a NUL character")
    path = Path(files.user_path(filename))
    arrays = npzfile.read(path, DataError, "an .npz archive with arrays x (N, C, H, W) and "
                          "y (N,) (np.savez)", keys=NPZ_KEYS)
    x, y, x_test, y_test, num_classes = _npz_arrays(arrays, path)
    x, x_test = native_float32(x), native_float32(x_test)

    guess = input_shape is None or tuple(x.shape[1:]) != tuple(input_shape)
    _check_npz_images(x, "x", None, path, guess_layout=guess)
    _check_npz_labels(y, "y", len(x), path)
    if x_test is not None:
        _check_npz_images(x_test, "x_test", x, path, guess_layout=guess)
        _check_npz_labels(y_test, "y_test", len(x_test), path)

    largest = int(y.max()) if y_test is None else max(int(y.max()), int(y_test.max()))
    if num_classes is None:
        num_classes = largest + 1
        if num_classes < 2:
            raise DataError(f"{path}: every label is 0, which makes one class; a network "
                            f"needs at least 2 (an array 'num_classes' gives classes the "
                            f"labels do not show)")
        if num_classes > MAX_INFERRED_CLASSES:   # a stray label
            which = "y" if int(y.max()) == largest else "y_test"
            i = int(np.argmax(y if which == "y" else y_test))
            raise DataError(f"{path}: {which}[{i}] = {largest} would make {num_classes:,} "
                            f"classes (the classes are 0 to the largest label where the file "
                            f"gives no 'num_classes'); expected labels below "
                            f"{MAX_INFERRED_CLASSES:,}")
    else:
        if num_classes.size != 1 or num_classes.dtype.kind not in "iu":
            raise DataError(f"{path}: 'num_classes' should be one integer, got "
                            f"{num_classes.dtype} of shape {num_classes.shape}")
        num_classes = int(num_classes.reshape(()))
        if num_classes < 2:     # a classifier of one class learns nothing
            raise DataError(f"{path}: 'num_classes' is {num_classes}, expected >= 2 (a "
                            f"network needs at least 2 classes)")
        if num_classes > MAX_INFERRED_CLASSES:
            raise DataError(f"{path}: 'num_classes' is {num_classes:,}, more than the "
                            f"{MAX_INFERRED_CLASSES:,} classes a network can have")
        if largest >= num_classes:
            which = "y" if int(y.max()) == largest else "y_test"
            arr = y if which == "y" else y_test
            i = int(np.argmax(arr))
            raise DataError(f"{path}: {which}[{i}] = {largest} is out of range, "
                            f"num_classes is {num_classes} (expected 0..{num_classes - 1})")

    def images(a):
        if a is None:
            return None
        if a.dtype == np.uint8:
            # scaled only (C-contiguous, as from a file stored in Fortran order too)
            return np.ascontiguousarray(a, np.float32) / np.float32(255.0)
        return np.ascontiguousarray(a)                               # float32 as is

    return Dataset(f"npz:{filename}", images(x), _labels(y), images(x_test),
                   None if y_test is None else _labels(y_test),
                   num_classes=num_classes, classes=None, source=str(path),
                   x_test_raw=x_test if x_test is not None and x_test.dtype == np.uint8
                   else None)


def read_images(filename):
    """Images to predict on, from an .npy file (the array) or an .npz file (its array x):
    (N, C, H, W), float32 or uint8, as npz datasets have them; other arrays are ignored."""
    if "\0" in os.fspath(filename):
        raise DataError(f"{shown(filename)}: a file name cannot hold a NUL character")
    path = Path(files.user_path(filename))
    loaded = npzfile.read(path, DataError, "an .npy array of images (N, C, H, W) or an .npz "
                          "with one in x", keys=("x",), npy=True)
    label = "x"
    if isinstance(loaded, dict):
        if "x" not in loaded:
            names = npzfile.read_names(path, DataError)
            raise DataError(f"{path}: no array 'x' (N, C, H, W) of images; found "
                            f"{', '.join(sorted(names)) or 'no arrays'}")
        loaded = loaded["x"]
    else:
        label = None   # an .npy file: the array, unnamed
    # no guess at a channel-last layout from the shape alone: the network the images are
    # for says exactly (pyhet predict checks against its input shape)
    loaded = native_float32(loaded)
    _check_npz_images(loaded, label, None, path, guess_layout=False)
    return loaded


NPZ_KEYS = ("x", "y", "x_test", "y_test", "num_classes")


def _npz_arrays(arrays, path):
    """x, y, x_test, y_test, num_classes of an npz dataset's arrays (None where absent)."""
    for key in ("x", "y"):
        if key not in arrays:
            names = npzfile.read_names(path, DataError)
            raise DataError(f"{path}: no array {key!r}; expected x (N, C, H, W) and "
                            f"y (N,), found {', '.join(sorted(names)) or 'no arrays'}")
    if ("x_test" in arrays) != ("y_test" in arrays):
        have, missing = ("x_test", "y_test") if "x_test" in arrays else ("y_test", "x_test")
        raise DataError(f"{path}: has {have!r} but no {missing!r}; give both or neither")
    return tuple(arrays.get(k) for k in NPZ_KEYS)


def _check_npz_images(a, key, like, path, guess_layout: bool = True):
    """a must be (N, C, H, W), float32 or uint8, N > 0; shaped and typed like `like`.
    guess_layout: refuse a shape that looks channel-last (images.looks_channel_last). key None:
    the array of an .npy file, which has no name."""
    named = "the array" if key is None else repr(key)
    if a.dtype not in (np.float32, np.uint8):
        raise DataError(f"{path}: {named} is {a.dtype}, expected float32 (used as is) "
                        f"or uint8 (scaled to [0, 1]); save other images as "
                        f".astype(np.float32)")
    if a.ndim != 4:
        raise DataError(f"{path}: {named} has shape {a.shape}, expected 4 dimensions "
                        f"(N, C, H, W)")
    if guess_layout and looks_channel_last(a.shape):
        raise DataError(f"{path}: " + channel_last_message(named, a.shape))
    if like is None:
        if len(a) == 0 or 0 in a.shape[1:]:
            raise DataError(f"{path}: {named} has shape {a.shape}, expected at least "
                            f"one image of non-zero size")
    else:
        if len(a) == 0:
            raise DataError(f"{path}: {named} holds no images; leave x_test and y_test "
                            f"out for a dataset without a test split")
        if a.shape[1:] != like.shape[1:]:
            raise DataError(f"{path}: {named} has images of {a.shape[1:]}, but 'x' has "
                            f"{like.shape[1:]} (C, H, W)")
        if a.dtype != like.dtype:
            raise DataError(f"{path}: {named} is {a.dtype}, but 'x' is {like.dtype}; "
                            f"both splits must have the same dtype")
    if a.dtype == np.float32:
        finite = np.isfinite(a).reshape(len(a), -1).all(axis=1)
        if not finite.all():
            raise DataError(f"{path}: {named} holds NaN or infinite values (image "
                            f"{int(np.argmin(finite))} is the first)")


def _check_npz_labels(y, key, n, path):
    """y must be (n,) integers >= 0."""
    if y.dtype.kind not in "iu":
        raise DataError(f"{path}: {key!r} is {y.dtype}, expected integer labels")
    if y.ndim != 1:
        raise DataError(f"{path}: {key!r} has shape {y.shape}, expected 1 dimension (N,)")
    if len(y) != n:
        images = "x" if key == "y" else "x_test"
        raise DataError(f"{path}: {key!r} has {len(y)} labels, but {images!r} "
                        f"has {n} images")
    if n and int(y.min()) < 0:
        i = int(np.argmin(y))
        raise DataError(f"{path}: {key}[{i}] = {int(y[i])} is negative, expected labels >= 0")
