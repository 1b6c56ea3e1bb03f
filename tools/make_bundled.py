#!/usr/bin/env python3
"""Make pyhet's bundled dataset: a class-balanced, seeded subset of Fashion-MNIST.

    python tools/make_bundled.py                  # reads /usr/share/datasets/fashion-mnist
    python tools/make_bundled.py --src DIR --out pyhet/_bundled

The originals are the four gzipped IDX files Zalando publishes (Debian ships them
in the package dataset-fashion-mnist). From the training file the script draws
`--train-per-class` images of each of the 10 classes, from the test file
`--test-per-class` of each, with `numpy.random.default_rng(--seed)`. The chosen
images keep their original relative order (the originals are already in a mixed
class order, so `--no-shuffle` batches stay mixed). They are written back as
gzipped IDX files under the original names, so pyhet reads them with the same
reader as the full set, and gzip's header carries no name and no time, so the
output is byte for byte the same on every run (for one zlib version).

The script also writes NOTICE, with the licence of Fashion-MNIST (MIT, Zalando SE)
and how the subset was made. It needs only NumPy and the standard library (it
does not import pyhet, so it runs before the package is built).
"""

import argparse
import gzip
import hashlib
import io
import struct
from pathlib import Path

import numpy as np

# x (N, H, W) uint8 images, y (N,) uint8 labels

FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
NUM_CLASSES = 10
LICENCE_FILE = Path("/usr/share/doc/dataset-fashion-mnist/copyright")


# ---------------------------------------------------------------- IDX in and out

def read_idx(path, magic, ndim):
    """The array in a gzipped IDX file of unsigned bytes, checked against its header."""
    raw = gzip.decompress(path.read_bytes())
    (got,) = struct.unpack(">I", raw[:4])
    if got != magic:
        raise SystemExit(f"{path}: magic 0x{got:08x}, expected 0x{magic:08x}")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    payload = raw[4 + 4 * ndim:]
    if len(payload) != int(np.prod(dims)):
        raise SystemExit(f"{path}: {len(payload)} payload bytes, header says {dims}")
    return np.frombuffer(payload, np.uint8).reshape(dims)


def write_idx(path, array, magic):
    """Write a uint8 array as a gzipped IDX file: no file name and mtime 0 in the
    gzip header, so the bytes depend only on the array."""
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(header + np.ascontiguousarray(array, np.uint8).tobytes())
    path.write_bytes(buf.getvalue())


# ---------------------------------------------------------------- the subset

def balanced_indices(y, per_class, rng):
    """`per_class` indices of each class, drawn without replacement, in file order."""
    chosen = []
    for c in range(NUM_CLASSES):
        members = np.flatnonzero(y == c)
        if len(members) < per_class:
            raise SystemExit(f"class {c} has {len(members)} images, {per_class} asked for")
        chosen.append(rng.choice(members, size=per_class, replace=False))
    return np.sort(np.concatenate(chosen))


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent.parent / "pyhet" / "_bundled")
    p.add_argument("--train-per-class", type=int, default=1200)
    p.add_argument("--test-per-class", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--licence", type=Path, default=LICENCE_FILE)
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    provenance = []
    for split, per_class in (("train", args.train_per_class), ("test", args.test_per_class)):
        image_name, label_name = FILES[split]
        x = read_idx(args.src / image_name, 0x00000803, 3)  # (N, 28, 28)
        y = read_idx(args.src / label_name, 0x00000801, 1)  # (N,)
        keep = balanced_indices(y, per_class, rng)
        write_idx(args.out / image_name, x[keep], 0x00000803)
        write_idx(args.out / label_name, y[keep], 0x00000801)
        provenance.append(f"  {split}: {len(keep)} images ({per_class} of each class) of "
                          f"{len(y)} in {image_name}")
        for name in (image_name, label_name):
            provenance.append(f"    {name}: source sha256 {sha256(args.src / name)}")
            provenance.append(f"    {name}: subset sha256 {sha256(args.out / name)}")
        print(f"{split}: kept {len(keep)} of {len(y)}")

    licence = args.licence.read_text(encoding="utf-8").rstrip() + "\n"
    notice = (
        "pyhet's bundled dataset is a subset of Fashion-MNIST\n"
        "(https://github.com/zalandoresearch/fashion-mnist), Copyright 2017 Zalando SE,\n"
        "distributed under the MIT (Expat) licence reproduced below.\n"
        "\n"
        "How the subset was made (tools/make_bundled.py in the pyhet repository):\n"
        f"  python tools/make_bundled.py --train-per-class {args.train_per_class} "
        f"--test-per-class {args.test_per_class} --seed {args.seed}\n"
        "  from the Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist);\n"
        "  the images of each class drawn without replacement with\n"
        f"  numpy.random.default_rng({args.seed}), kept in their original order, and\n"
        "  written unchanged as gzipped IDX files under the original names.\n"
        + "\n".join(provenance) + "\n"
        "\n"
        "Licence of Fashion-MNIST, as in /usr/share/doc/dataset-fashion-mnist/copyright:\n"
        "\n" + licence
    )
    (args.out / "NOTICE").write_text(notice, encoding="utf-8")


if __name__ == "__main__":
    main()
