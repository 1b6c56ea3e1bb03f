"""Dataset loaders: tiny real-format files written here, read back by pyhet.data.

Each format (IDX raw and gzipped, CIFAR-10 python pickles and binary records,
npz) is checked for shapes, dtypes, labels and normalisation, and each kind of
damage for a DataError that names the damaged file.

x (N, C, H, W) images, y (N,) labels.
"""

import gzip
import io
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhet.data import (DATASETS, FASHION_MNIST_CLASSES, Dataset, describe,
                        iterate_batches, load_dataset, load_test_split, read_images)
import pyhet
from pyhet.errors import DataError

IDX_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]


# ================================================================ writing tiny files

def idx_bytes(array, magic):
    """The IDX encoding of a uint8 array: magic, big-endian sizes, values."""
    return (struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
            + np.ascontiguousarray(array, np.uint8).tobytes())


def write_idx_dir(folder, gz, n_train=30, n_test=12, hw=(28, 28), seed=1):
    """Write the four (Fashion-)MNIST IDX files; return {split: (x (N, H, W), y (N,))}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, size=(n, *hw), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        rng.shuffle(y)
        for (name, magic), a in zip(zip(IDX_NAMES[split], (0x803, 0x801)), (x, y)):
            data = idx_bytes(a, magic)
            if gz:
                (folder / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
        arrays[split] = (x, y)
    return arrays


def cifar_arrays(per_batch=3, n_test=4, seed=2):
    """Five training batches and a test batch of (x (n, 3072) uint8, y list of ints)."""
    rng = np.random.default_rng(seed)
    batches = {}
    for name, n in [(b, per_batch) for b in CIFAR_TRAIN] + [("test_batch", n_test)]:
        x = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, size=n)]
        batches[name] = (x, y)
    return batches


def write_cifar_bin(folder, batches):
    """The binary layout: records of 1 label byte + 3072 pixel bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (x, y) in batches.items():
        records = np.concatenate([np.array(y, np.uint8)[:, None], x], axis=1)  # (n, 3073)
        (folder / f"{name}.bin").write_bytes(records.tobytes())


class Py2Pickler(pickle._Pickler):
    """Pickles as Python 2's cPickle did for the published CIFAR-10 files: every
    str and bytes as a byte string (BINSTRING), protocol 2."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_byte_string(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[str] = save_byte_string
    dispatch[bytes] = save_byte_string


def pickle_bytes(obj, style):
    """obj pickled as "py2" (the published files, naming numpy.core), or with
    Python 3's protocol 2 or 5."""
    if style == "py2":
        buf = io.BytesIO()
        Py2Pickler(buf, protocol=2).dump(obj)
        return buf.getvalue().replace(b"numpy._core.", b"numpy.core.")
    return pickle.dumps(obj, protocol=int(style[-1]))


def write_cifar_py(folder, batches, style="py2", str_keys=False, label_names=None):
    """The python layout: one pickled dict per batch, and batches.meta."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (x, y) in batches.items():
        d = {"batch_label": f"batch {name}", "data": x, "labels": list(y),
             "filenames": [f"img{i}.png" for i in range(len(y))]}
        if style != "py2" and not str_keys:
            d = {k.encode(): v for k, v in d.items()}
        (folder / name).write_bytes(pickle_bytes(d, style))
    if label_names is not None:
        meta = {"label_names": label_names, "num_cases_per_batch": 3, "num_vis": 3072}
        (folder / "batches.meta").write_bytes(pickle_bytes(meta, style))


def expected_normalised(x_train, x_test):
    """The reference normalisation in float64: per channel over (N, H, W)."""
    tr, te = x_train / 255.0, x_test / 255.0
    mean = tr.mean(axis=(0, 2, 3), keepdims=True)
    std = tr.std(axis=(0, 2, 3), keepdims=True)
    return (tr - mean) / std, (te - mean) / std


def raises_naming(filename):
    """pytest.raises(DataError) whose message must name `filename`."""
    return pytest.raises(DataError, match=re.escape(str(filename)))


def check_arrays(ds, n_train, n_test, shape):
    assert isinstance(ds, Dataset)
    assert ds.x_train.shape == (n_train, *shape) and ds.input_shape == shape
    assert ds.x_train.dtype == np.float32 and ds.x_train.flags.c_contiguous
    assert ds.y_train.shape == (n_train,) and ds.y_train.dtype == np.int64
    if n_test is None:
        assert ds.x_test is None and ds.y_test is None
    else:
        assert ds.x_test.shape == (n_test, *shape)
        assert ds.x_test.dtype == np.float32 and ds.x_test.flags.c_contiguous
        assert ds.y_test.shape == (n_test,) and ds.y_test.dtype == np.int64


def check_standardised(x):
    """Per channel mean ~0 and std ~1, computed in float64 (a chunk at a time, so
    that the full Fashion-MNIST needs no float64 copy)."""
    s1 = s2 = 0.0
    for start in range(0, len(x), 4096):
        chunk = x[start:start + 4096].astype(np.float64)
        s1 = s1 + chunk.sum(axis=(0, 2, 3))
        s2 = s2 + np.square(chunk).sum(axis=(0, 2, 3))
    count = x.size // x.shape[1]
    mean = s1 / count
    std = np.sqrt(s2 / count - mean ** 2)
    np.testing.assert_allclose(mean, 0.0, atol=1e-5)
    np.testing.assert_allclose(std, 1.0, atol=1e-5)


# ================================================================ IDX: MNIST, Fashion-MNIST

@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("name", ["fashion-mnist", "mnist"])
def test_idx_loads_and_normalises(tmp_path, gz, name):
    arrays = write_idx_dir(tmp_path, gz)
    ds = load_dataset(name, data_dir=str(tmp_path))
    check_arrays(ds, 30, 12, (1, 28, 28))
    (xtr, ytr), (xte, yte) = arrays["train"], arrays["test"]
    np.testing.assert_array_equal(ds.y_train, ytr)
    np.testing.assert_array_equal(ds.y_test, yte)
    want_tr, want_te = expected_normalised(xtr[:, None], xte[:, None])
    np.testing.assert_allclose(ds.x_train, want_tr, atol=1e-5)
    np.testing.assert_allclose(ds.x_test, want_te, atol=1e-5)   # the training split's statistics
    check_standardised(ds.x_train)
    assert ds.num_classes == 10 and len(ds.classes) == 10
    assert ds.name == name and ds.source == str(tmp_path)


def test_idx_raw_and_gz_load_identically(tmp_path):
    write_idx_dir(tmp_path / "raw", gz=False)
    write_idx_dir(tmp_path / "gz", gz=True)
    a = load_dataset("mnist", data_dir=str(tmp_path / "raw"))
    b = load_dataset("mnist", data_dir=str(tmp_path / "gz"))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)


def test_idx_other_image_size(tmp_path):
    write_idx_dir(tmp_path, gz=True, hw=(7, 5))
    assert load_dataset("mnist", data_dir=str(tmp_path)).input_shape == (1, 7, 5)


def _corrupt(folder, name, data):
    """Replace the file called name (raw or .gz, whichever is there) with data."""
    path = folder / name if (folder / name).exists() else folder / (name + ".gz")
    if path.suffix == ".gz" and not data.startswith(b"\x1f\x8b"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


TRAIN_IMAGES, TRAIN_LABELS = IDX_NAMES["train"]
TEST_IMAGES, TEST_LABELS = IDX_NAMES["test"]


def _images(n=30, hw=(28, 28)):
    return np.zeros((n, *hw), np.uint8)


IDX_DAMAGE = {
    # file damaged: its new content, built from sane arrays
    "wrong magic (labels magic on images)": (TRAIN_IMAGES, lambda: idx_bytes(_images(), 0x801)),
    "wrong magic (images magic on labels)": (TRAIN_LABELS, lambda: idx_bytes(_images(), 0x803)),
    "int32 values (type code 0x0c)": (
        TRAIN_IMAGES, lambda: b"\x00\x00\x0c\x03" + idx_bytes(_images(), 0x803)[4:]),
    "truncated payload": (TRAIN_IMAGES, lambda: idx_bytes(_images(), 0x803)[:-100]),
    "trailing bytes": (TEST_LABELS, lambda: idx_bytes(np.zeros(12, np.uint8), 0x801) + b"\x00"),
    "truncated header": (TEST_IMAGES, lambda: idx_bytes(_images(12), 0x803)[:9]),
    "empty file": (TRAIN_LABELS, lambda: b""),
    "count mismatch": (TRAIN_LABELS, lambda: idx_bytes(np.zeros(29, np.uint8), 0x801)),
    "label out of range": (TEST_LABELS, lambda: idx_bytes(np.full(12, 10, np.uint8), 0x801)),
    "zero images": (TRAIN_IMAGES, lambda: idx_bytes(np.zeros((0, 28, 28), np.uint8), 0x803)),
    "test images of another size": (TEST_IMAGES, lambda: idx_bytes(_images(12, (27, 28)), 0x803)),
    "images of zero height": (TRAIN_IMAGES, lambda: idx_bytes(_images(30, (0, 28)), 0x803)),
}


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("damage", list(IDX_DAMAGE))
def test_idx_damage_names_the_file(tmp_path, gz, damage):
    write_idx_dir(tmp_path, gz)
    name, content = IDX_DAMAGE[damage]
    _corrupt(tmp_path, name, content())
    with raises_naming(name):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


GZ_DAMAGE = {
    "not gzip at all": lambda good: b"this is not gzip data at all, honestly",
    "stream cut short": lambda good: good[: len(good) // 2],
    "flipped bytes in the deflate data":
        lambda good: good[:20] + bytes(b ^ 0xFF for b in good[20:60]) + good[60:],
    "wrong CRC": lambda good: good[:-8] + bytes(b ^ 0xFF for b in good[-8:-4]) + good[-4:],
}


def test_idx_header_sizes_are_read_whole(tmp_path):
    """Sizes whose product passes 2**63 (an int64 would wrap) are said as they are; images of
    zero height are refused in words, not taken for another size."""
    write_idx_dir(tmp_path, gz=False)
    huge = 2**32 - 1
    _corrupt(tmp_path, TRAIN_IMAGES, struct.pack(">IIII", 0x803, huge, huge, huge))
    with pytest.raises(DataError, match=f"= {huge ** 3} bytes of data, the file holds 0"):
        load_dataset("mnist", data_dir=str(tmp_path))
    _corrupt(tmp_path, TRAIN_IMAGES, idx_bytes(_images(30, (0, 28)), 0x803))
    with pytest.raises(DataError, match="images of size 0 x 28, expected every size >= 1"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_idx_file_that_is_a_folder(tmp_path):
    write_idx_dir(tmp_path, gz=False)
    (tmp_path / TEST_LABELS).unlink()
    (tmp_path / TEST_LABELS).mkdir()
    with pytest.raises(DataError, match=re.escape(TEST_LABELS) + ": a folder, not a file"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_data_dir_and_name_must_be_usable():
    """A bad argument is a UsageError (a ValueError), as the command line's exit status 2."""
    from pyhet.errors import UsageError
    with pytest.raises(UsageError, match="data_dir must be a folder's path .* got 3"):
        load_dataset("mnist", data_dir=3)
    # an empty one read the default folder; NUL and bytes were bare ValueError, TypeError
    for bad in ("", "a\0b", b"data", Path("a\0b")):
        with pytest.raises(UsageError, match="data_dir must be a folder's path"):
            load_dataset("mnist", data_dir=bad)
    # a folder given to a dataset that reads none was ignored: trained on other data
    for name in ("bundled", "synthetic", "npz:x.npz"):
        with pytest.raises(UsageError, match="reads no data folder, but one was given: 'd'"):
            load_dataset(name, data_dir="d")
    for bad, words in [("foo", "unknown dataset 'foo': expected one of"),
                       ("npz: ", "expected npz:FILE"), (3, "must be a string, got 3")]:
        with pytest.raises(ValueError, match=words) as e:
            load_dataset(bad)
        assert isinstance(e.value, UsageError)
    with pytest.raises(DataError, match="cannot hold a NUL"):
        load_dataset("npz:a\0b.npz")


def test_load_dataset_checks_its_seed():
    from pyhet.errors import UsageError
    for bad in (-1, 1.5, "1", None, True):
        with pytest.raises(UsageError, match=re.escape(f"seed must be a whole number in 0 .. "
                                                       f"2**64 - 1, got {bad!r}")):
            load_dataset("synthetic", seed=bad)
    assert load_dataset("synthetic", seed=np.int64(3)).x_train.shape[0] > 0


def test_a_folder_name_too_long_or_of_no_user_is_the_folders_error():
    for name in ("mnist", "cifar10"):
        with pytest.raises(DataError, match="cannot be read .*too long"):
            load_dataset(name, data_dir="d" * 300)
        with pytest.raises(DataError, match="~no-such-user-0/x: no such folder"):
            load_dataset(name, data_dir="~no-such-user-0/x")


@pytest.mark.parametrize("damage", list(GZ_DAMAGE))
def test_bad_gzip_names_the_file(tmp_path, damage):
    write_idx_dir(tmp_path, gz=True)
    path = tmp_path / (TRAIN_IMAGES + ".gz")
    path.write_bytes(GZ_DAMAGE[damage](path.read_bytes()))
    with raises_naming(path.name):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


@pytest.mark.parametrize("missing", [TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS])
def test_idx_missing_file_names_it(tmp_path, missing):
    write_idx_dir(tmp_path, gz=True)
    (tmp_path / (missing + ".gz")).unlink()
    with raises_naming(missing):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_idx_missing_folder(tmp_path):
    with raises_naming(tmp_path / "nowhere"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path / "nowhere"))


def test_mnist_default_place_says_pass_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(DataError, match="--data-dir"):
        load_dataset("mnist")
    write_idx_dir(tmp_path / "pyhet" / "mnist", gz=True)
    assert load_dataset("mnist").source == str(tmp_path / "pyhet" / "mnist")
    # a relative $XDG_CACHE_HOME is ignored, as the XDG spec says: ~/.cache
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    write_idx_dir(tmp_path / "home" / ".cache" / "pyhet" / "mnist", gz=True)
    assert load_dataset("mnist").source == str(tmp_path / "home" / ".cache" / "pyhet" / "mnist")


@pytest.mark.parametrize("data_dir", [True, False], ids=["data-dir", "default-place"])
def test_mnist_missing_files_name_where_they_are_published(tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "pyhet" / "mnist").mkdir(parents=True)
    with pytest.raises(DataError) as e:
        load_dataset("mnist", data_dir=str(tmp_path) if data_dir else None)
    said = str(e.value)
    assert "train-images-idx3-ubyte[.gz]: no such file" in said
    assert "train-images-idx3-ubyte.gz etc., as published at http://yann.lecun.com/exdb/mnist/" \
        in said and "pyhet downloads none" in said and "\n" not in said
    assert ("--data-dir DIR" in said) == (not data_dir)


# ================================================================ the test split alone

def _without_training_files(name, folder):
    """Remove the training split's files of a dataset written by write_idx_dir or
    write_cifar_bin/py into `folder`."""
    stems = IDX_NAMES["train"] if name != "cifar10" else CIFAR_TRAIN
    for p in list(folder.iterdir()):
        if p.name.split(".")[0] in stems:
            p.unlink()


def _write_test_dataset(name, layout, folder):
    """Write `name` (layout: gz or raw IDX; bin or py CIFAR-10) into folder; return the test
    split's raw x (M, C, H, W) uint8 and y (M,)."""
    if name == "cifar10":
        batches = cifar_arrays()
        (write_cifar_bin if layout == "bin" else write_cifar_py)(folder, batches)
        x, y = batches["test_batch"]
        return x.reshape(-1, 3, 32, 32), np.array(y)
    x, y = write_idx_dir(folder, gz=layout == "gz")["test"]
    return x[:, None], y


SPLIT_CASES = [("mnist", "gz"), ("mnist", "raw"), ("fashion-mnist", "gz"), ("cifar10", "bin"),
               ("cifar10", "py")]


@pytest.mark.parametrize("name,layout", SPLIT_CASES)
def test_the_test_split_loads_without_the_training_files(tmp_path, name, layout):
    """Evaluating a network whose weight file records its normalisation reads the test split
    alone: it used to need the training files too (load_dataset reads both)."""
    x, y = _write_test_dataset(name, layout, tmp_path)
    whole = load_dataset(name, data_dir=str(tmp_path))
    _without_training_files(name, tmp_path)
    with pytest.raises(DataError, match="no such file"):
        load_dataset(name, data_dir=str(tmp_path))
    ds = load_test_split(name, data_dir=str(tmp_path))
    np.testing.assert_array_equal(ds.x_test_raw, x)
    np.testing.assert_array_equal(ds.x_test_raw, whole.x_test_raw)
    np.testing.assert_array_equal(ds.y_test, y)
    assert ds.y_test.dtype == np.int64
    assert ds.x_test.dtype == np.float32 and ds.x_test.flags.c_contiguous
    np.testing.assert_array_equal(ds.x_test, x.astype(np.float32) / np.float32(255))
    assert ds.normalization is None          # x_test is only scaled: no training statistics
    assert ds.x_train.shape == (0, *x.shape[1:]) and ds.y_train.shape == (0,)
    assert ds.input_shape == whole.input_shape and ds.num_classes == 10
    assert ds.classes == whole.classes and ds.source == whole.source


@pytest.mark.parametrize("name,layout", SPLIT_CASES)
def test_the_training_statistics_need_the_training_files_and_say_why(tmp_path, name, layout):
    """A weight file of an earlier version records no normalisation: its test images are
    normalised with the training split's statistics, as load_dataset does, and a missing
    training file says why it is read."""
    _write_test_dataset(name, layout, tmp_path)
    whole = load_dataset(name, data_dir=str(tmp_path))
    ds = load_test_split(name, data_dir=str(tmp_path), train_statistics=True)
    np.testing.assert_array_equal(ds.x_test, whole.x_test)
    np.testing.assert_array_equal(ds.x_train, whole.x_train)
    assert ds.normalization == whole.normalization
    _without_training_files(name, tmp_path)
    with pytest.raises(DataError) as e:
        load_test_split(name, data_dir=str(tmp_path), train_statistics=True)
    said = str(e.value)
    first = "data_batch_1" if name == "cifar10" else IDX_NAMES["train"][0]
    assert first in said and "no such file" in said and "\n" not in said
    assert ("the training split is read for its per-channel mean and std, which normalise the "
            "test images for a network whose weight file records no normalisation") in said


def test_the_test_split_alone_still_needs_the_test_files(tmp_path):
    write_idx_dir(tmp_path, gz=True)
    (tmp_path / (IDX_NAMES["test"][1] + ".gz")).unlink()
    with raises_naming(IDX_NAMES["test"][1]):
        load_test_split("mnist", data_dir=str(tmp_path))
    with pytest.raises(pyhet.errors.UsageError, match="reads no data folder"):
        load_test_split("synthetic", data_dir=str(tmp_path))


def test_other_datasets_load_for_evaluation_as_they_do_for_training(tmp_path):
    a, b = load_test_split("synthetic", seed=3), load_dataset("synthetic", seed=3)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.x_test is None


# ================================================================ CIFAR-10

def _cifar_expected(batches):
    """x (N, 3, 32, 32) uint8 and y (N,) of the training and test splits."""
    xtr = np.concatenate([batches[b][0] for b in CIFAR_TRAIN]).reshape(-1, 3, 32, 32)
    ytr = np.concatenate([batches[b][1] for b in CIFAR_TRAIN])
    xte = batches["test_batch"][0].reshape(-1, 3, 32, 32)
    return xtr, ytr, xte, np.array(batches["test_batch"][1])


@pytest.mark.parametrize("layout", ["bin", "py2", "protocol2", "protocol5", "str-keys"])
@pytest.mark.parametrize("point_at", ["folder", "parent"])
def test_cifar_layouts(tmp_path, layout, point_at):
    batches = cifar_arrays()
    if layout == "bin":
        folder = tmp_path / "cifar-10-batches-bin"
        write_cifar_bin(folder, batches)
    else:
        folder = tmp_path / "cifar-10-batches-py"
        style = "protocol5" if layout == "str-keys" else layout
        write_cifar_py(folder, batches, style, str_keys=layout == "str-keys")
    ds = load_dataset("cifar10", data_dir=str(folder if point_at == "folder" else tmp_path))
    check_arrays(ds, 15, 4, (3, 32, 32))
    xtr, ytr, xte, yte = _cifar_expected(batches)
    np.testing.assert_array_equal(ds.y_train, ytr)
    np.testing.assert_array_equal(ds.y_test, yte)
    want_tr, want_te = expected_normalised(xtr, xte)
    np.testing.assert_allclose(ds.x_train, want_tr, atol=1e-5)
    np.testing.assert_allclose(ds.x_test, want_te, atol=1e-5)
    check_standardised(ds.x_train)
    assert ds.num_classes == 10 and ds.classes[0] == "airplane"
    assert ds.source == str(folder)


def test_cifar_binary_and_python_layouts_agree(tmp_path):
    batches = cifar_arrays()
    write_cifar_bin(tmp_path / "b" / "cifar-10-batches-bin", batches)
    write_cifar_py(tmp_path / "p" / "cifar-10-batches-py", batches)
    a = load_dataset("cifar10", data_dir=str(tmp_path / "b"))
    b = load_dataset("cifar10", data_dir=str(tmp_path / "p"))
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_cifar_planes_are_rgb(tmp_path):
    """Pixel bytes 0..1023 are the red plane, in rows: x[n, 0, i, j] = byte 32 i + j."""
    batches = cifar_arrays()
    x0 = batches["data_batch_1"][0]
    x0[0] = 0
    x0[0, 1024 + 32 * 5 + 7] = 255                           # green, row 5, column 7
    write_cifar_bin(tmp_path / "cifar-10-batches-bin", batches)
    ds = load_dataset("cifar10", data_dir=str(tmp_path))
    first = ds.x_train[0]                                    # (3, 32, 32)
    assert np.argmax(first[1]) == 32 * 5 + 7
    assert len(np.unique(first[0])) == 1 and len(np.unique(first[2])) == 1


def test_cifar_label_names_from_meta(tmp_path):
    names = [f"thing{i}" for i in range(10)]
    write_cifar_py(tmp_path / "cifar-10-batches-py", cifar_arrays(), label_names=names)
    assert load_dataset("cifar10", data_dir=str(tmp_path)).classes == names


@pytest.mark.parametrize("names", [5, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], ids=["int", "ints"])
def test_cifar_label_names_that_are_not_names(tmp_path, names):
    write_cifar_py(tmp_path / "cifar-10-batches-py", cifar_arrays(), label_names=names)
    with pytest.raises(DataError, match="batches.meta: 'label_names' should be a list of 10 "
                                        "names"):
        load_dataset("cifar10", data_dir=str(tmp_path))


def test_cifar_missing_everything(tmp_path, monkeypatch):
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"")
    with pytest.raises(DataError, match="tar xzf"):
        load_dataset("cifar10", data_dir=str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(DataError, match="--data-dir"):
        load_dataset("cifar10")


CIFAR_SOURCE = ("CIFAR-10's python version, cifar-10-python.tar.gz, or its binary version, "
                "cifar-10-binary.tar.gz, from https://www.cs.toronto.edu/~kriz/cifar.html, "
                "extracted with tar xzf; pyhet downloads neither")


@pytest.mark.parametrize("what", ["folder", "batches", "one batch"])
def test_cifar_missing_files_name_where_they_are_published(tmp_path, monkeypatch, what):
    folder = tmp_path / "cifar-10-batches-py"
    if what == "folder":
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    elif what == "batches":
        folder.mkdir()
    else:
        write_cifar_py(folder, cifar_arrays())
        (folder / "data_batch_3").unlink()
    with pytest.raises(DataError) as e:
        load_dataset("cifar10", data_dir=None if what == "folder" else str(tmp_path))
    said = str(e.value)
    assert CIFAR_SOURCE in said and "\n" not in said
    assert ("--data-dir DIR" in said) == (what == "folder")
    if what == "one batch":
        assert f"{folder / 'data_batch_3'}: no such file; a CIFAR-10 folder holds test_batch " \
               f"and data_batch_1..5" in said


@pytest.mark.parametrize("layout", ["bin", "py"])
@pytest.mark.parametrize("missing", ["data_batch_3", "test_batch"])
def test_cifar_missing_batch_names_it(tmp_path, layout, missing):
    batches = cifar_arrays()
    folder = tmp_path / f"cifar-10-batches-{layout}"
    (write_cifar_bin if layout == "bin" else write_cifar_py)(folder, batches)
    suffix = ".bin" if layout == "bin" else ""
    (folder / (missing + suffix)).unlink()
    with raises_naming(missing + suffix):
        load_dataset("cifar10", data_dir=str(tmp_path))


@pytest.mark.parametrize("cut", [1, 3072, 3074])
def test_cifar_bin_size_not_a_multiple_of_3073(tmp_path, cut):
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar_bin(folder, cifar_arrays())
    path = folder / "data_batch_2.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-cut] if cut < len(data) else data + b"\x00" * cut)
    with raises_naming("data_batch_2.bin"):
        load_dataset("cifar10", data_dir=str(folder))


def test_an_empty_cifar_bin_batch_is_said_to_be_empty(tmp_path):
    """It was "0 bytes, not a whole number of records" (0 is one)."""
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar_bin(folder, cifar_arrays())
    (folder / "data_batch_3.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"data_batch_3.bin: an empty file, expected CIFAR-10 "
                                        r"records of 3073 bytes"):
        load_dataset("cifar10", data_dir=str(folder))


def test_cifar_bin_label_out_of_range(tmp_path):
    batches = cifar_arrays()
    batches["test_batch"][1][2] = 10
    write_cifar_bin(tmp_path / "cifar-10-batches-bin", batches)
    with raises_naming("test_batch.bin"):
        load_dataset("cifar10", data_dir=str(tmp_path))


def _bad_python_batch(kind):
    x = np.zeros((3, 3072), np.uint8)
    return {
        "no labels key": {b"data": x, b"filenames": []},
        "no data key": {b"pixels": x, b"labels": [0, 1, 2]},
        "data of the wrong shape": {b"data": np.zeros((3, 1024), np.uint8), b"labels": [0, 1, 2]},
        "data not uint8": {b"data": x.astype(np.float32), b"labels": [0, 1, 2]},
        "too few labels": {b"data": x, b"labels": [0, 1]},
        "label out of range": {b"data": x, b"labels": [0, 11, 2]},
        "negative label": {b"data": x, b"labels": [0, -1, 2]},
        "labels not integers": {b"data": x, b"labels": [b"cat", b"dog", b"cow"]},
        "not a dict": [x, [0, 1, 2]],
    }[kind]


@pytest.mark.parametrize("kind", ["no labels key", "no data key", "data of the wrong shape",
                                  "data not uint8", "too few labels", "label out of range",
                                  "negative label", "labels not integers", "not a dict"])
def test_cifar_py_bad_batch_names_the_file(tmp_path, kind):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar_py(folder, cifar_arrays(), style="protocol5")
    (folder / "data_batch_4").write_bytes(pickle.dumps(_bad_python_batch(kind)))
    with raises_naming("data_batch_4"):
        load_dataset("cifar10", data_dir=str(folder))


@pytest.mark.parametrize("content", [b"", b"garbage, not a pickle", b"\x80\x02}q\x00(U\x04da"],
                         ids=["empty", "garbage", "cut short"])
def test_cifar_py_unreadable_pickle(tmp_path, content):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar_py(folder, cifar_arrays())
    (folder / "test_batch").write_bytes(content)
    with raises_naming("test_batch"):
        load_dataset("cifar10", data_dir=str(folder))


class _Hostile:
    """Unpickling this runs code: a shell command, or eval of one."""

    def __init__(self, how, marker):
        self.how, self.marker = how, marker

    def __reduce__(self):
        command = f"touch {self.marker}"
        if self.how == "os.system":
            return (os.system, (command,))
        return (eval, (f"__import__('os').system({command!r})",))


@pytest.mark.parametrize("how", ["os.system", "eval"])
@pytest.mark.parametrize("target", ["data_batch_1", "batches.meta"])
def test_cifar_hostile_pickle_is_refused(tmp_path, how, target):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar_py(folder, cifar_arrays(), label_names=[str(i) for i in range(10)])
    marker = tmp_path / "code-ran"
    (folder / target).write_bytes(pickle.dumps({b"data": _Hostile(how, marker), b"labels": []}))
    with pytest.raises(DataError, match=re.escape(target) + ".*refused"):
        load_dataset("cifar10", data_dir=str(folder))
    assert not marker.exists()


def test_cifar_protocol2_pickle_with_empty_bytes(tmp_path):
    """Python 3's protocol 2 writes b"" as bytes(): a valid batch re-pickled so was refused as
    if hostile ("refused to load global __builtin__.bytes"); bytes() with an argument is still
    refused."""
    folder = tmp_path / "cifar-10-batches-py"
    batches = cifar_arrays()
    write_cifar_py(folder, batches, "protocol2")
    for name, (x, y) in batches.items():
        d = {b"batch_label": b"", b"data": x, b"labels": list(y), b"filenames": [b""] * len(y)}
        (folder / name).write_bytes(pickle.dumps(d, protocol=2))
    ds = load_dataset("cifar10", data_dir=str(folder))
    np.testing.assert_array_equal(ds.y_test, _cifar_expected(batches)[3])
    # bytes(10**9), a memory bomb, in place of the empty label
    bomb = pickle.dumps({b"batch_label": b""}, protocol=2).replace(
        b"bytes\nq\x06)R", b"bytes\nq\x06J\x00\xca\x9a;\x85R")
    assert bomb != pickle.dumps({b"batch_label": b""}, protocol=2)
    (folder / "data_batch_1").write_bytes(bomb)
    with pytest.raises(DataError, match="refused bytes"):
        load_dataset("cifar10", data_dir=str(folder))


def test_gzip_without_its_suffix_is_named(tmp_path):
    """Browsers drop .gz from a download's name: the IDX magic (0x1f8b...) and a CIFAR batch's
    size then said nothing of gzip."""
    write_idx_dir(tmp_path / "idx", gz=False)
    for f in (tmp_path / "idx").iterdir():
        f.write_bytes(gzip.compress(f.read_bytes()))
    with pytest.raises(DataError, match="gzip-compressed: decompress it"):
        load_dataset("mnist", data_dir=str(tmp_path / "idx"))
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar_bin(folder, cifar_arrays())
    for f in folder.iterdir():
        f.write_bytes(gzip.compress(f.read_bytes()))
    with pytest.raises(DataError, match="gzip-compressed: decompress it"):
        load_dataset("cifar10", data_dir=str(folder))
    folder = tmp_path / "cifar-10-batches-py"          # a pickle: said the unpickler's error
    write_cifar_py(folder, cifar_arrays())
    for f in folder.iterdir():
        f.write_bytes(gzip.compress(f.read_bytes()))
    with pytest.raises(DataError, match="python batch; it is gzip-compressed: decompress it"):
        load_dataset("cifar10", data_dir=str(folder))


def test_cifar_ragged_labels_and_bad_names_are_named(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    batches = cifar_arrays()
    write_cifar_py(folder, batches, label_names=["cat\ndog", ""] + [f"c{i}" for i in range(8)])
    with pytest.raises(DataError, match=r"batches.meta: class names must be printable"):
        load_dataset("cifar10", data_dir=str(folder))
    write_cifar_py(folder, batches, label_names=[f"c{i}" for i in range(10)])
    x, y = batches["data_batch_1"]
    d = {"batch_label": "b", "data": x, "labels": [0, [1]] + list(y[2:])}
    (folder / "data_batch_1").write_bytes(pickle_bytes(d, "py2"))
    with pytest.raises(DataError, match=r"got list of 3 items, not all integers"):
        load_dataset("cifar10", data_dir=str(folder))


def test_npz_labels_all_zero_are_named(tmp_path):
    np.savez(tmp_path / "z.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.zeros(4, np.int64))
    with pytest.raises(DataError, match=r"z.npz: every label is 0.*num_classes"):
        load_dataset(f"npz:{tmp_path / 'z.npz'}")


# ================================================================ synthetic, bundled, names

def test_synthetic():
    ds = load_dataset("synthetic", seed=3)
    check_arrays(ds, 1024, None, (3, 32, 32))
    check_standardised(ds.x_train)
    assert ds.num_classes == 10 and set(np.unique(ds.y_train)) <= set(range(10))
    again = load_dataset("synthetic", seed=3)
    np.testing.assert_array_equal(ds.x_train, again.x_train)
    np.testing.assert_array_equal(ds.y_train, again.y_train)
    assert not np.array_equal(ds.x_train, load_dataset("synthetic", seed=4).x_train)
    assert "no test split" in describe(ds)


def test_bundled():
    ds = load_dataset("bundled")
    check_arrays(ds, 12000, 2000, (1, 28, 28))
    assert ds.num_classes == 10 and ds.classes == FASHION_MNIST_CLASSES
    np.testing.assert_array_equal(np.bincount(ds.y_train, minlength=10), [1200] * 10)
    np.testing.assert_array_equal(np.bincount(ds.y_test, minlength=10), [200] * 10)
    check_standardised(ds.x_train)
    notice = (Path(ds.source) / "NOTICE").read_text(encoding="utf-8")
    assert "Zalando" in notice and "Permission is hereby granted" in notice
    line = describe(ds)
    assert line.startswith("bundled: 12000 train + 2000 test images of 1x28x28, 10 classes")


DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not (DEBIAN_FASHION / "train-images-idx3-ubyte.gz").is_file(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_debian_fashion_mnist():
    ds = load_dataset("fashion-mnist")
    check_arrays(ds, 60000, 10000, (1, 28, 28))
    np.testing.assert_array_equal(np.bincount(ds.y_train), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(ds.y_test), [1000] * 10)
    check_standardised(ds.x_train)


def test_unknown_name_lists_the_valid_ones():
    from pyhet.errors import UsageError
    with pytest.raises(UsageError) as info:
        load_dataset("imagenet")
    for name in DATASETS + ("npz:FILE",):
        assert name in str(info.value)
    assert DATASETS == ("bundled", "fashion-mnist", "mnist", "cifar10", "synthetic")


# ================================================================ npz:FILE

def _npz(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def test_npz_float32_used_as_is(tmp_path):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 2, 5, 4)) * 7 + 3).astype(np.float32)
    y = np.array([0, 1, 2, 2, 1, 0], np.int32)
    xt = rng.standard_normal((3, 2, 5, 4)).astype(np.float32)
    path = _npz(tmp_path, x=x, y=y, x_test=xt, y_test=np.array([4, 0, 1]))
    ds = load_dataset(f"npz:{path}")
    check_arrays(ds, 6, 3, (2, 5, 4))
    np.testing.assert_array_equal(ds.x_train, x)             # exactly, never normalised
    np.testing.assert_array_equal(ds.x_test, xt)
    np.testing.assert_array_equal(ds.y_train, y)
    assert ds.num_classes == 5                               # largest label + 1, over both splits
    assert ds.source == str(path) and ds.classes is None


def test_npz_uint8_scaled_only(tmp_path):
    x = np.arange(2 * 1 * 3 * 3, dtype=np.uint8).reshape(2, 1, 3, 3) * 15   # 0, 15, .. 255
    path = _npz(tmp_path, x=x, y=np.array([0, 1]), num_classes=np.array(7))
    ds = load_dataset(f"npz:{path}")
    check_arrays(ds, 2, None, (1, 3, 3))
    np.testing.assert_array_equal(ds.x_train, x.astype(np.float32) / np.float32(255))
    assert ds.x_train.max() == 1.0 and ds.x_train.min() == 0.0
    assert ds.num_classes == 7


def test_npz_missing_file(tmp_path):
    with raises_naming("nothere.npz"):
        load_dataset(f"npz:{tmp_path / 'nothere.npz'}")


GOOD_X = np.zeros((4, 1, 3, 3), np.float32)
GOOD_Y = np.array([0, 1, 2, 3])

NPZ_DAMAGE = {
    "missing x": dict(y=GOOD_Y),
    "missing y": dict(x=GOOD_X),
    "x float64": dict(x=GOOD_X.astype(np.float64), y=GOOD_Y),
    "x int32": dict(x=GOOD_X.astype(np.int32), y=GOOD_Y),
    "x 3-d": dict(x=GOOD_X[:, 0], y=GOOD_Y),
    "x no images": dict(x=GOOD_X[:0], y=GOOD_Y[:0]),
    "x NaN": dict(x=np.full_like(GOOD_X, np.nan), y=GOOD_Y),
    "y float": dict(x=GOOD_X, y=GOOD_Y.astype(np.float32)),
    "y 2-d": dict(x=GOOD_X, y=GOOD_Y[:, None]),
    "y count mismatch": dict(x=GOOD_X, y=GOOD_Y[:3]),
    "y negative": dict(x=GOOD_X, y=GOOD_Y - 1),
    "y >= num_classes": dict(x=GOOD_X, y=GOOD_Y, num_classes=np.array(3)),
    "y_test >= num_classes": dict(x=GOOD_X, y=GOOD_Y, x_test=GOOD_X, y_test=GOOD_Y + 1,
                                  num_classes=np.array(4)),
    "num_classes not an integer": dict(x=GOOD_X, y=GOOD_Y, num_classes=np.array(4.0)),
    "num_classes an array": dict(x=GOOD_X, y=GOOD_Y, num_classes=np.array([4, 4])),
    "num_classes 1": dict(x=GOOD_X, y=GOOD_Y * 0, num_classes=np.array(1)),
    "x_test without y_test": dict(x=GOOD_X, y=GOOD_Y, x_test=GOOD_X),
    "y_test without x_test": dict(x=GOOD_X, y=GOOD_Y, y_test=GOOD_Y),
    "x_test of another shape": dict(x=GOOD_X, y=GOOD_Y, x_test=np.zeros((4, 1, 3, 4), np.float32),
                                    y_test=GOOD_Y),
    "x_test of another dtype": dict(x=GOOD_X, y=GOOD_Y, x_test=GOOD_X.astype(np.uint8),
                                    y_test=GOOD_Y),
    "x_test empty": dict(x=GOOD_X, y=GOOD_Y, x_test=GOOD_X[:0], y_test=GOOD_Y[:0]),
    "y_test count mismatch": dict(x=GOOD_X, y=GOOD_Y, x_test=GOOD_X, y_test=GOOD_Y[:2]),
}


@pytest.mark.parametrize("damage", list(NPZ_DAMAGE))
def test_npz_damage_names_the_file(tmp_path, damage):
    path = _npz(tmp_path, name="broken-set.npz", **NPZ_DAMAGE[damage])
    with raises_naming("broken-set.npz"):
        load_dataset(f"npz:{path}")


def test_npz_images_not_finite_name_the_first(tmp_path):
    """As Network.predict and evaluate name the first image with NaN or infinite values, so
    does a dataset file (and so pyhet train, evaluate and predict on the command line)."""
    x = GOOD_X.copy()
    x[2, 0, 1, 1] = np.inf
    x[3, 0, 0, 0] = np.nan
    path = _npz(tmp_path, x=x, y=GOOD_Y)
    with pytest.raises(DataError, match=r"'x' holds NaN or infinite values \(image 2 is the "
                                        r"first\)"):
        load_dataset(f"npz:{path}")
    test = GOOD_X.copy()
    test[1, 0, 2, 2] = np.nan
    path = _npz(tmp_path, name="t.npz", x=GOOD_X, y=GOOD_Y, x_test=test, y_test=GOOD_Y)
    with pytest.raises(DataError, match=r"'x_test' .*\(image 1 is the first\)"):
        load_dataset(f"npz:{path}")
    np.save(tmp_path / "in.npy", x)
    with pytest.raises(DataError, match=r"image 2 is the first"):
        read_images(tmp_path / "in.npy")


def test_images_of_two_arrays_saved_into_one_npy_file_are_refused(tmp_path):
    """np.save twice into one open file: np.load would read the first array alone."""
    path = tmp_path / "two.npy"
    with open(path, "wb") as f:
        np.save(f, GOOD_X)
        np.save(f, GOOD_X[:1])
    with pytest.raises(DataError, match=r"two.npy: the array holds \d[\d,]* bytes past the "
                                        r"[\d,]+ its header gives .*more than one array saved "
                                        r"into it\?"):
        read_images(path)
    np.save(path, GOOD_X)
    np.testing.assert_array_equal(read_images(path), GOOD_X)


def test_a_stray_label_is_named_not_taken_for_a_huge_number_of_classes(tmp_path):
    """Without 'num_classes' the classes are 0 to the largest label: a label of 2**62 made a
    network of 4.6e18 classes, refused as too large for memory; now the label is named. Below
    the core's limit (2**31 - 1), the largest label says how many there are."""
    path = _npz(tmp_path, x=GOOD_X, y=np.array([0, 1, 2**62, 3]))
    with pytest.raises(DataError, match=rf"y\[2\] = {2**62} would make .* classes.*below "
                                        rf"2,147,483,647"):
        load_dataset(f"npz:{path}")
    path = _npz(tmp_path, name="many.npz", x=GOOD_X, y=np.array([0, 1, 2**16, 3]))
    assert load_dataset(f"npz:{path}").num_classes == 2**16 + 1


def test_npz_missing_key_is_named(tmp_path):
    path = _npz(tmp_path, x=GOOD_X, labels=GOOD_Y)
    with pytest.raises(DataError, match="no array 'y'.*labels"):
        load_dataset(f"npz:{path}")


@pytest.mark.parametrize("kind", ["garbage", "npy", "object array", "member not an array"])
def test_npz_unreadable_file(tmp_path, kind):
    path = tmp_path / "weird.npz"
    if kind == "garbage":
        path.write_bytes(b"PK\x03\x04 but not really a zip file")
    elif kind == "npy":
        with open(path, "wb") as f:
            np.save(f, GOOD_X)
    elif kind == "object array":
        np.savez(path, x=np.array([GOOD_X, "a"], dtype=object), y=GOOD_Y)
    else:    # np.load gives such a member as its raw bytes
        np.savez(path, y=GOOD_Y)
        with zipfile.ZipFile(path, "a") as z:
            z.writestr("x.npy", b"no array here")
    with raises_naming("weird.npz"):
        load_dataset(f"npz:{path}")
    if kind == "member not an array":
        with pytest.raises(DataError, match="array 'x' is not an .npy array .* 13 bytes"):
            load_dataset(f"npz:{path}")


def _npy_header_only(shape, data=b""):
    """An .npy file of float32 whose header gives `shape`, followed by `data` only."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape!r}, }}"
    header = header.ljust(117) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + data


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_npz_header_promising_more_than_the_file_holds(tmp_path, compression):
    """A header of 10**12 images over 64 bytes: said to be truncated, before NumPy allocates
    576 TB (which ended in "out of memory")."""
    path = tmp_path / "lies.npz"
    np.savez(path, y=GOOD_Y)
    with zipfile.ZipFile(path, "a", compression=compression) as z:
        z.writestr("x.npy", _npy_header_only((10**12, 1, 12, 12), bytes(64)))
    with pytest.raises(DataError, match=r"lies.npz: the header of array 'x' promises float32 "
                                        r"of shape \(1000000000000, 1, 12, 12\) "
                                        r"\(576,000,000,000,000 bytes\), the file holds 64"):
        load_dataset(f"npz:{path}")


def test_an_npz_array_with_bytes_past_its_data_is_refused(tmp_path):
    """np.load reads what the header gives and ignores the rest: an array whose member holds
    more (np.save writes nothing after the data) is damaged, not read as if whole."""
    path = tmp_path / "long.npz"
    np.savez(path, y=GOOD_Y)
    x = np.zeros((2, 1, 12, 12), np.float32)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("x.npy", _npy_header_only(x.shape, x.tobytes() + bytes(20)))
    with pytest.raises(DataError, match=r"long.npz: array 'x' holds 20 bytes past the 1,152 "
                                        r"its header gives \(float32 of shape \(2, 1, 12, 12\)\); "
                                        r"a damaged file"):
        load_dataset(f"npz:{path}")


# ================================================================ batches

def test_iterate_batches_in_file_order():
    x = np.arange(10 * 2, dtype=np.float32).reshape(10, 2, 1, 1)
    y = np.arange(10)
    batches = list(iterate_batches(x, y, 4, shuffle=False, rng=None))
    assert [len(yb) for _, yb in batches] == [4, 4, 2]           # the last one partial
    np.testing.assert_array_equal(np.concatenate([yb for _, yb in batches]), y)
    np.testing.assert_array_equal(np.concatenate([xb for xb, _ in batches]), x)


def test_iterate_batches_shuffled():
    x = np.arange(23, dtype=np.float32).reshape(23, 1, 1, 1)
    y = np.arange(23)
    runs = []
    for _ in range(2):
        batches = list(iterate_batches(x, y, 5, shuffle=True, rng=np.random.default_rng(9)))
        assert [len(yb) for _, yb in batches] == [5, 5, 5, 5, 3]
        for xb, yb in batches:
            np.testing.assert_array_equal(xb[:, 0, 0, 0], yb)     # pairs stay together
            assert xb.flags.c_contiguous
        runs.append(np.concatenate([yb for _, yb in batches]))
    np.testing.assert_array_equal(np.sort(runs[0]), y)           # every image once
    assert not np.array_equal(runs[0], y)
    np.testing.assert_array_equal(runs[0], runs[1])              # the same rng seed, the same order


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), batch_size=st.integers(1, 80), shuffle=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_iterate_batches_cover_every_image_once(n, batch_size, shuffle, seed):
    x = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1)
    y = np.arange(n)
    batches = list(iterate_batches(x, y, batch_size, shuffle, np.random.default_rng(seed)))
    sizes = [len(yb) for _, yb in batches]
    assert sizes == [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    seen = np.concatenate([yb for _, yb in batches])
    np.testing.assert_array_equal(np.sort(seen), y)
    np.testing.assert_array_equal(np.concatenate([xb[:, 0, 0, 0] for xb, _ in batches]), seen)


def test_iterate_batches_bad_arguments():
    x, y = np.zeros((3, 1, 1, 1), np.float32), np.zeros(3, np.int64)
    with pytest.raises(ValueError):
        list(iterate_batches(x, y, 0, shuffle=False))
    with pytest.raises(ValueError):
        list(iterate_batches(x, y[:2], 2, shuffle=False))
    with pytest.raises(ValueError):
        list(iterate_batches(x, y, 2, shuffle=True, rng=None))


def test_a_missing_file_keeps_its_os_error_as_the_cause(tmp_path):
    with pytest.raises(DataError, match="no such file") as e:
        pyhet.load_dataset(f"npz:{tmp_path / 'missing.npz'}")
    assert isinstance(e.value.__cause__, FileNotFoundError)


@pytest.mark.parametrize("name", ["mnist", "cifar10", "fashion-mnist"])
def test_a_data_folder_that_is_a_loop_of_links_says_so(tmp_path, name):
    """It was "no such folder", where the name is there."""
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'a'}: cannot be read (")):
        load_dataset(name, data_dir=tmp_path / "a")
