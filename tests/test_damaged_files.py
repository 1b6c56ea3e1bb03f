"""Files damaged in one field, as a mutation fuzzer of pyhet's readers found them: each is
refused with pyhet's own error (DataError for data, WeightsError for weight files) in one
readable line, or read whole; never a crash, a bare Python exception, or a file read with
parts of it silently missing.

The zip edits are of the central directory that np.savez writes (one entry per array); the
.npy edits are of an array's header text. Test doubles: none, only real files made here.
"""

import io
import json
import lzma
import pickle
import re
import struct
import zipfile

import numpy as np
import pytest

import pyhet
from conftest import make_npz_dataset
from pyhet.data import load_dataset, read_images
from pyhet.errors import DataError, WeightsError

CENTRAL = b"PK\x01\x02"


def central_entries(data: bytes) -> list[int]:
    """The offsets of the zip's central directory entries."""
    out, at = [], data.find(CENTRAL)
    while at >= 0:
        out.append(at)
        at = data.find(CENTRAL, at + 1)
    return out


def edit_central(data: bytes, field: int, value: int, entry: int = 0) -> bytes:
    """data with a 2-byte field of one central directory entry set: 6 the version needed, 8
    the flags, 10 the method, 32 the comment's length."""
    at = central_entries(data)[entry] + field
    return data[:at] + struct.pack("<H", value) + data[at + 2:]


def npy_with_header(a: np.ndarray, header: str) -> bytes:
    """An .npy file of a's bytes under a header text of our own (version 1.0)."""
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + a.tobytes()


def zipped(members: dict, method=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def members_of(path) -> dict:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def one_line(message: str) -> None:
    assert "\n" not in message and message.isprintable() and len(message) < 600, message


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "d.npz"
    make_npz_dataset(path, n=12, shape=(1, 8, 8), classes=3, n_test=6)
    return path


@pytest.fixture(scope="module")
def weight_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "w.npz"
    with pyhet.Network("2C3-P2", (1, 8, 8), 3, devices="numpy") as net:
        net.save(path)
    return path


ZIP_EDITS = {
    # field, value: what zipfile did with it
    "a compression zipfile does not have": (10, 99),           # NotImplementedError
    "the encrypted flag": (8, 1),                              # RuntimeError
    "the strong-encryption flag": (8, 1 << 6),                 # NotImplementedError
    "a zip version from the future": (6, 255),                 # NotImplementedError
}


@pytest.mark.parametrize("case", list(ZIP_EDITS))
def test_a_zip_field_zipfile_cannot_read_is_a_files_error(tmp_path, dataset, weight_file,
                                                          case):
    field, value = ZIP_EDITS[case]
    for path, read, error in ((dataset, lambda p: load_dataset(f"npz:{p}"), DataError),
                              (weight_file, lambda p: pyhet.load(p, devices="numpy"),
                               WeightsError)):
        bad = tmp_path / f"bad-{path.name}"
        bad.write_bytes(edit_central(path.read_bytes(), field, value))
        with pytest.raises(error) as e:
            read(bad)
        assert str(bad) in str(e.value)
        one_line(str(e.value))


def test_a_damaged_directory_length_does_not_hide_the_arrays_after_it(tmp_path, dataset):
    """The first entry's comment length made to swallow the entries after it: zipfile read
    x and y alone, and the dataset loaded without its test split."""
    data = dataset.read_bytes()
    assert len(central_entries(data)) == 4
    bad = tmp_path / "bad.npz"
    bad.write_bytes(edit_central(data, 32, 0x21C0, entry=1))
    with zipfile.ZipFile(bad) as z:
        assert len(z.namelist()) < 4                 # what zipfile alone makes of it
    with pytest.raises(DataError, match="its zip directory lists 4 entries, but 2 can be read"):
        load_dataset(f"npz:{bad}")
    assert load_dataset(f"npz:{dataset}").x_test is not None


@pytest.mark.parametrize("header", [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (12, 1, 8, 8), ",   # cut short
    "{'descr': '<f4', 'fortran_order': False, 'shape': (True, 1, 8, 8), }",
])
def test_an_npy_header_numpys_parser_chokes_on_is_a_files_error(tmp_path, dataset, header):
    """A header cut short (tokenize's TokenError) or a dimension True (a TypeError in
    reshape): in an npz dataset, and in an .npy file to predict on."""
    x = np.zeros((12, 1, 8, 8), np.float32)
    members = members_of(dataset)
    members["x.npy"] = npy_with_header(x, header)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(zipped(members))
    with pytest.raises(DataError, match="array 'x' cannot be read") as e:
        load_dataset(f"npz:{bad}")
    one_line(str(e.value))
    (tmp_path / "bad.npy").write_bytes(npy_with_header(x, header))
    with pytest.raises(DataError, match="the array cannot be read"):
        read_images(tmp_path / "bad.npy")


def test_a_damaged_lzma_member_is_a_files_error(tmp_path, dataset):
    members = members_of(dataset)
    data = zipped(members, zipfile.ZIP_LZMA)
    packed = lzma.compress(members["x.npy"], format=lzma.FORMAT_RAW,
                           filters=[{"id": lzma.FILTER_LZMA1}])
    at = data.find(packed[20:40])
    assert at > 0
    bad = tmp_path / "bad.npz"
    bad.write_bytes(data[:at] + bytes(40) + data[at + 40:])
    with pytest.raises(DataError, match="array 'x' cannot be read") as e:
        load_dataset(f"npz:{bad}")
    one_line(str(e.value))


def test_a_message_quoting_the_files_bytes_is_one_short_line(tmp_path, dataset):
    """NumPy quotes a header it cannot parse, bytes of the array data included."""
    x = np.full((12, 1, 8, 8), np.nan, np.float32)
    members = members_of(dataset)
    members["x.npy"] = npy_with_header(x, "{'descr': '<f4', 'shape': (12, 1, 8, 8)}" + "\x7f" * 9
                                       + "x" * 900)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(zipped(members))
    with pytest.raises(DataError) as e:
        load_dataset(f"npz:{bad}")
    one_line(str(e.value))


def test_num_classes_past_what_a_network_can_have_is_refused(tmp_path):
    """3 stored big-endian reads as 216,172,782,113,783,808: it was taken as the class
    count."""
    path = tmp_path / "d.npz"
    make_npz_dataset(path, n=12, shape=(1, 8, 8), classes=3,
                     num_classes=np.array(3, ">i8").view("<i8"))
    with pytest.raises(DataError, match="'num_classes' is 216,172,782,113,783,808, more than "
                                        "the 2,147,483,647 classes"):
        load_dataset(f"npz:{path}")


def test_uint8_images_stored_in_fortran_order_load_c_contiguous(tmp_path):
    path = tmp_path / "d.npz"
    arrays = make_npz_dataset(path, n=12, shape=(1, 8, 8), classes=3, dtype=np.uint8)
    np.savez(path, x=np.asfortranarray(arrays["x"]), y=arrays["y"])
    ds = load_dataset(f"npz:{path}")
    assert ds.x_train.flags.c_contiguous and ds.x_train.dtype == np.float32
    np.testing.assert_array_equal(ds.x_train, arrays["x"] / np.float32(255))


def test_a_normalization_of_a_huge_integer_is_a_weight_file_error(tmp_path, weight_file):
    import json

    arrays = dict(np.load(weight_file))
    arch = json.loads(str(arrays["arch"]))
    arch["normalization"] = {"scale": [10**400], "shift": [0.0]}
    np.savez(tmp_path / "bad.npz", **{**arrays, "arch": np.array(json.dumps(arch))})
    with pytest.raises(WeightsError, match="normalization's scale must be finite numbers") as e:
        pyhet.load(tmp_path / "bad.npz", devices="numpy")
    one_line(str(e.value))


# ================================================================ CIFAR-10 python batches

def cifar_batch(tmp_path, edit=lambda b: b, protocol=2):
    """A folder of CIFAR-10 python batches (one image each), data_batch_1 passed through
    edit(its pickled bytes)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                 "data_batch_5", "test_batch"):
        d = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), b"labels": [1, 2]}
        data = pickle.dumps(d, protocol=protocol)
        (folder / name).write_bytes(edit(data) if name == "data_batch_1" else data)
    return tmp_path


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar_batches_of_plain_arrays_load(tmp_path, protocol):
    ds = load_dataset("cifar10", cifar_batch(tmp_path, protocol=protocol))
    assert ds.x_train.shape == (10, 3, 32, 32) and ds.x_train.flags.c_contiguous


@pytest.mark.parametrize("dtype", [b"M8", b"m8", b"O8", b"V8", b"S8"])
def test_a_cifar_batch_of_another_dtype_is_refused_before_numpy_builds_it(tmp_path, dtype):
    """The batch's dtype u1 changed to another kind: a datetime dtype given a uint8's state
    crashed the process (SIGSEGV) inside NumPy's dtype.__setstate__."""
    def swap(data):
        assert data.count(b"X\x02\x00\x00\x00u1") == 1
        return data.replace(b"X\x02\x00\x00\x00u1", b"X\x02\x00\x00\x00" + dtype)

    with pytest.raises(DataError, match="data_batch_1: not a readable CIFAR-10 python batch "
                                        ".*refused the dtype") as e:
        load_dataset("cifar10", cifar_batch(tmp_path, swap))
    one_line(str(e.value))


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.replace(b"(K\x03X\x01\x00\x00\x00|", b"(K\x04X\x01\x00\x00\x00|"),
     "refused a dtype state"),                                       # another state version
    (lambda d: d.replace(b"K\x02M\x00\x0c\x86", b"K\x02M\xff\x0b\x86"),
     r"array data of 6144 bytes for uint8 of shape \(2, 3071\)"),   # a shape of other size
])
def test_a_cifar_batch_whose_array_parts_do_not_fit_is_refused(tmp_path, edit, words):
    with pytest.raises(DataError, match=words):
        load_dataset("cifar10", cifar_batch(tmp_path, edit))


# ================================================================ random damage, seeded

def mutants(data: bytes, n: int, seed: int):
    """n copies of data, each damaged at random: bytes flipped or overwritten, cut short, or
    junk appended (the fuzzer's byte-level mutations, in small)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        b = bytearray(data)
        kind = rng.integers(4)
        if kind == 0:
            for _ in range(rng.integers(1, 4)):
                b[rng.integers(len(b))] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            at = int(rng.integers(len(b) - 8))
            b[at:at + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
        elif kind == 2:
            del b[int(rng.integers(1, len(b))):]
        else:
            b += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        yield bytes(b)


def test_randomly_damaged_files_are_refused_or_read_whole(tmp_path, dataset, weight_file):
    """200 damaged copies of a weight file, an npz dataset and a CIFAR-10 python batch: each
    is refused with pyhet's error in one line, or reads as the file did before the damage
    (the zip's CRC guards the arrays; a pickle's damage may leave it readable)."""
    (tmp_path / "c").mkdir()
    cifar = cifar_batch(tmp_path / "c")
    batch = cifar / "cifar-10-batches-py" / "data_batch_1"
    want = {"weights": pyhet.load(weight_file, devices="numpy").params(),
            "npz": load_dataset(f"npz:{dataset}").x_test}
    cases = [("weights", weight_file, WeightsError,
              lambda p: pyhet.load(p, devices="numpy").params()),
             ("npz", dataset, DataError, lambda p: load_dataset(f"npz:{p}").x_test),
             ("cifar", batch, DataError, lambda p: load_dataset("cifar10", cifar).x_train)]
    refused = 0
    for name, path, error, read in cases:
        original = path.read_bytes()
        target = path if name == "cifar" else tmp_path / f"bad-{path.name}"
        for i, data in enumerate(mutants(original, 200, seed=len(name))):
            target.write_bytes(data)
            try:
                got = read(target)
            except error as e:
                one_line(str(e))
                refused += 1
                continue
            if name == "weights":
                assert got.keys() == want["weights"].keys(), i
                for k in got:
                    np.testing.assert_array_equal(got[k], want["weights"][k], err_msg=k)
            elif name == "npz":
                np.testing.assert_array_equal(got, want["npz"], err_msg=str(i))
            else:
                assert got.shape == (10, 3, 32, 32) and np.isfinite(got).all(), i
        if name == "cifar":
            path.write_bytes(original)
    assert refused > 300   # most damage is seen


def test_a_weight_array_with_bytes_past_its_data_is_refused(tmp_path, weight_file):
    """A member longer than its header's array (np.load reads the array and ignores the rest)
    is damage, not a weight file read whole."""
    members = members_of(weight_file)
    name = next(n for n in members if n.endswith(".npy") and n != "meta.npy")
    members[name] += bytes(8)
    bad = tmp_path / "long.npz"
    bad.write_bytes(zipped(members))
    with pytest.raises(WeightsError, match=rf"long.npz: array '{name[:-4]}' holds 8 bytes past "
                                           r"the [\d,]+ its header gives .*a damaged file") as e:
        pyhet.load(bad, devices="numpy")
    one_line(str(e.value))


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_an_npy_file_of_any_version_with_bytes_past_its_data_is_refused_in_one_line(
        tmp_path, version):
    """np.save's three header versions (3.0's header is UTF-8), one of them of a structured
    dtype whose text runs to kilobytes: the message quotes a short part of it."""
    wide = np.dtype([(f"é{i}", "<f4") for i in range(300)])
    for name, a in (("x", np.zeros((2, 1, 3, 3), np.float32)), ("wide", np.zeros(2, wide))):
        path = tmp_path / f"{name}.npy"
        with open(path, "wb") as f:
            np.lib.format.write_array(f, a, version=version)
            f.write(b"\0" * 3)
        with pytest.raises(DataError, match=r"the array holds 3 bytes past the [\d,]+ its "
                                            r"header gives") as e:
            read_images(path)
        one_line(str(e.value))
        path.write_bytes(path.read_bytes()[:-3])
        if name == "x":
            np.testing.assert_array_equal(read_images(path), a)


# ================================================================ what the messages name

def test_a_network_description_of_sizes_past_the_cores_is_not_one(tmp_path, weight_file):
    """An input of 2**63 pixels a side was taken as a description, and the file then refused
    as a shape mismatch with the network it described."""
    import json

    arrays = dict(np.load(weight_file))
    arch = json.loads(str(arrays["arch"]))
    arch["input_shape"] = [1, 8, 2**63]
    np.savez(tmp_path / "bad.npz", **{**arrays, "arch": np.array(json.dumps(arch))})
    with pytest.raises(WeightsError, match=r"'arch' entry is not a network description "
                                           r"\(input_shape: 9223372036854775808 is not in 1 "):
        pyhet.load(tmp_path / "bad.npz", devices="numpy")


@pytest.mark.parametrize("entry,words", [
    (lambda arch: np.array(json.dumps({k: v for k, v in arch.items() if k != "input_shape"})),
     "(it has no 'input_shape')"),
    (lambda arch: np.arange(3.0), "(an array of float64 of shape (3,), not one JSON string)"),
    (lambda arch: np.array([json.dumps(arch)] * 2),
     "(an array of strings of shape (2,), not one JSON string)"),
    (lambda arch: np.array("{oops"), "(not JSON: Expecting property name"),
])
def test_a_damaged_network_description_says_what_is_wrong(tmp_path, weight_file, entry, words):
    """A missing key was named by KeyError's bare text ("('input_shape')"), an array of numbers
    by a JSON parser's complaint."""
    arrays = dict(np.load(weight_file))
    arch = json.loads(str(arrays["arch"]))
    np.savez(tmp_path / "bad.npz", **{**arrays, "arch": entry(arch)})
    with pytest.raises(WeightsError, match=re.escape(
            f"'arch' entry is not a network description {words}")):
        pyhet.load(tmp_path / "bad.npz", devices="numpy")


def test_a_file_of_an_earlier_version_with_an_array_of_another_rank_names_it(tmp_path):
    with pyhet.Network("2C3-P2-3C3-P2", (1, 16, 16), 3, devices="numpy") as net:
        w = net.params()
    w["conv2.bias"] = w["conv2.bias"][None]
    np.savez(tmp_path / "old.npz", **w)
    with pytest.raises(WeightsError, match="it has conv2.bias of 2 dimensions, not 1$"):
        pyhet.load(tmp_path / "old.npz", devices="numpy", input_shape=(1, 16, 16))


def test_a_damaged_batches_meta_is_called_what_it_is(tmp_path):
    folder = cifar_batch(tmp_path) / "cifar-10-batches-py"
    (folder / "batches.meta").write_bytes(b"\x80\x02}q\x00(X")
    with pytest.raises(DataError, match="batches.meta: not a readable CIFAR-10 batches.meta "
                                        r"\(class names\)"):
        load_dataset("cifar10", tmp_path)


def test_a_small_gzip_idx_file_holding_far_more_than_its_header_promises_is_not_read_whole(
        tmp_path):
    """A gzipped IDX file of a few hundred kilobytes whose header promises 20 labels and that
    holds 256 MiB of zeros after them: refused (trailing bytes) having read what the header
    promises and a byte more, not the 256 MiB (a file of 50 MB so would have taken the
    machine's memory before the error)."""
    import gzip
    import tracemalloc

    from pyhet.data import read_idx

    path = tmp_path / "train-labels-idx1-ubyte.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(struct.pack(">II", 0x801, 20) + bytes(20))
        for _ in range(16):
            f.write(bytes(16 << 20))
    assert path.stat().st_size < (2 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"header promises 20 bytes of data, the file holds "
                                            r"more than 20 \(trailing bytes"):
            read_idx(path, 0x801)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (8 << 20), peak


def test_an_idx_header_that_promises_other_sizes_may_be_the_damage(tmp_path):
    from pyhet.data import read_idx

    path = tmp_path / "images-idx3-ubyte"
    path.write_bytes(struct.pack(">IIII", 0x803, 4, 65536, 2**32 - 1) + bytes(100))
    with pytest.raises(DataError, match=r"header promises 4 x 65536 x 4294967295 = "
                                        r"1125899906580480 bytes of data, the file holds 100 "
                                        r"\(truncated file, or a damaged header\?\)"):
        read_idx(path, 0x803)


@pytest.mark.parametrize("batch, words", [
    ({b"data": np.dtype("u1"), b"labels": [1]}, "a dtype outside an array"),
    ({b"data": np.zeros((1, 3072), ">u2"), b"labels": [1]}, "'data' should be a uint8 array"),
    ({b"data": np.zeros((1, 3072), "u1"), b"labels": [1], b"x": [[[[1]]]] * 2},
     None),                                                          # read: nothing to refuse
])
def test_what_a_cifar_pickle_holds_besides_plain_arrays(tmp_path, batch, words):
    data = pickle.dumps(batch, protocol=2)
    folder = cifar_batch(tmp_path, lambda _: data)
    if words is None:
        assert load_dataset("cifar10", folder).x_train.shape == (9, 3, 32, 32)
        return
    with pytest.raises(DataError, match=words):
        load_dataset("cifar10", folder)


def test_a_changed_byte_in_a_whole_file_is_called_damaged_not_truncated(tmp_path, weight_file):
    """An array whose bytes changed in a file of its full length fails the zip's CRC: the file
    is said to be damaged; one cut short fails its size check first and is said to be
    truncated."""
    data = bytearray(weight_file.read_bytes())
    with zipfile.ZipFile(weight_file) as z:
        info = z.getinfo("conv1.weight.npy")
        at = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size - 2
    data[at] ^= 0xFF                              # the array's last float, its header left
    bad = tmp_path / "flipped.npz"
    bad.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"flipped\.npz: .*conv1\.weight.*CRC.*; damaged "
                                           r"file\?$") as e:
        pyhet.load(bad, devices="numpy")
    one_line(str(e.value))
    cut = tmp_path / "cut.npz"
    cut.write_bytes(weight_file.read_bytes()[:len(data) // 2])
    with pytest.raises(WeightsError, match=r"cut\.npz: .*truncated"):
        pyhet.load(cut, devices="numpy")


def test_a_changed_byte_in_a_compressed_array_is_called_damaged(tmp_path):
    """A compressed npz whose deflate stream no longer decodes (zlib's error, not the CRC's) is
    a damaged file too."""
    x = np.tile(np.arange(64, dtype=np.float32), (64, 1)).reshape(64, 1, 8, 8)
    path = tmp_path / "ok.npz"
    np.savez_compressed(path, x=x, y=np.arange(64) % 3)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("x.npy")
    data[info.header_offset + 30 + len(info.filename) + len(info.extra)
         + info.compress_size // 2] ^= 0xFF
    bad = tmp_path / "bad.npz"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"bad\.npz: array 'x' cannot be read \(Error -3 while "
                                        r"decompressing data.*\); damaged file\?$") as e:
        load_dataset(f"npz:{bad}")
    one_line(str(e.value))
