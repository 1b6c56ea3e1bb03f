"""Every command's errors: one line on stderr, exit status 2 for usage errors (bad option values,
device SPECs, combinations, argparse's own) and 1 for the rest, no traceback, nothing on
stdout. A table of bad command lines over every subcommand (bad values, missing files, folders
in place of files, empty, truncated and foreign files), then standard output that cannot be
written, and resuming a run that has nothing left to do.

x (N, C, H, W) images, y (N,) labels.
"""

import io
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import pyhet
from conftest import TINY, beyond_asan, make_npz_dataset

ARCH = "3C3-P2-4C3-P2"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files the table's command lines name, by the placeholder that stands for each."""
    d = tmp_path_factory.mktemp("files")
    rng = np.random.default_rng(0)
    f = {"DIR": d / "folder", "DATA": d / "data.npz", "WEIGHTS": d / "w.npz"}
    f["DIR"].mkdir()
    make_npz_dataset(f["DATA"], n=16, n_test=8)
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="numpy") as net:
        net.save(f["WEIGHTS"])

    def npz(name, **arrays):
        f[name] = d / f"{name.lower()}.npz"
        np.savez(f[name], **arrays)

    y = np.arange(16) % 3
    npz("OBJECTS", x=np.zeros((16, 1, 12, 12), np.float32), y=np.array(list(y) + [None])[:16])
    npz("CHANNEL_LAST", x=rng.standard_normal((16, 12, 12, 1)).astype(np.float32), y=y)
    npz("HUGE_LABELS", x=np.zeros((16, 1, 12, 12), np.float32), y=y * 10**12)
    npz("HUGE_CLASSES", x=np.zeros((16, 1, 12, 12), np.float32), y=y,
        num_classes=np.int64(2 * 10**9))
    npz("TOO_MANY_CLASSES", x=np.zeros((16, 1, 12, 12), np.float32), y=y,
        num_classes=np.int64(10**12))
    f["TEXT"] = d / "text.npz"
    f["TEXT"].write_text("these are not arrays\n")
    f["UNDER_A_FILE"] = f["TEXT"] / "w.npz"
    f["DIR_LOCK"], f["DIR_CHECKPOINT"] = f["DIR"] / ".lock", f["DIR"] / "checkpoint-000000001.npz"
    f["EMPTY"] = d / "empty.npz"
    f["EMPTY"].write_bytes(b"")
    f["TRUNCATED"] = d / "truncated.npz"
    f["TRUNCATED"].write_bytes(f["DATA"].read_bytes()[:300])
    f["NPY_CHANNEL_LAST"] = d / "cl.npy"
    np.save(f["NPY_CHANNEL_LAST"], np.zeros((2, 12, 12, 1), np.float32))
    f["NPY_OBJECTS"] = d / "objects.npy"
    np.save(f["NPY_OBJECTS"], np.array([1, None], dtype=object), allow_pickle=True)
    # a numeric array whose header is padded past the 10,000 bytes NumPy reads untrusted
    f["NPY_LONG_HEADER"] = d / "long_header.npy"
    head = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 1, 12, 12), }"
    head += b" " * (12000 - len(head) - 13) + b"\n"
    head = head[:-1] + b" " * ((64 - (12 + len(head)) % 64) % 64) + b"\n"
    f["NPY_LONG_HEADER"].write_bytes(np.lib.format.magic(2, 0) + len(head).to_bytes(4, "little")
                                     + head + np.zeros((2, 1, 12, 12), np.float32).tobytes())
    f["IMAGES"] = d / "x.npy"
    np.save(f["IMAGES"], np.zeros((2, 1, 12, 12), np.float32))
    f["NOWHERE"] = d / "no-such-folder" / "out.npz"
    f["SLASHED"] = f"{d / 'out.npz'}/"                 # a folder's name, which does not exist
    # finite images so large that the network's outputs overflow float32 (NaN probabilities)
    f["NPY_HUGE_HEADER"] = d / "huge-header.npy"     # 10**12 images promised, 64 bytes held
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 1, 12, 12), }"
    f["NPY_HUGE_HEADER"].write_bytes(b"\x93NUMPY\x01\x00" + (118).to_bytes(2, "little")
                                     + (header.ljust(117) + "\n").encode() + bytes(64))
    f["NPY_OVERFLOW"] = d / "overflow.npy"
    np.save(f["NPY_OVERFLOW"], np.clip(rng.standard_normal((2, 1, 12, 12)) * 1e39, -3e38,
                                       3e38).astype(np.float32))
    # a member of the archive that is not an .npy array (np.load gives its raw bytes)
    weights = dict(np.load(f["WEIGHTS"]))
    f["WEIGHTS_JUNK_MEMBER"] = d / "w-junk-member.npz"
    f["X_JUNK_MEMBER"] = d / "x-junk-member.npz"
    for path, arrays, junk in ((f["WEIGHTS_JUNK_MEMBER"], weights, "conv1.weight"),
                               (f["X_JUNK_MEMBER"], {"x": None, "y": y}, "x")):
        with zipfile.ZipFile(path, "w") as z:
            for k, v in arrays.items():
                buf = io.BytesIO()
                if k != junk:
                    np.save(buf, v)
                z.writestr(k + ".npy", buf.getvalue() if k != junk else b"not an array")
    # weights whose description gives raw images two channels' normalization, the network one
    meta = json.loads(str(weights["arch"]))
    f["WEIGHTS_TWO_CHANNELS"] = d / "w-two-channels.npz"
    np.savez(f["WEIGHTS_TWO_CHANNELS"], **{**weights, "arch": np.array(json.dumps(
        {**meta, "normalization": {"scale": [1.0, 1.0], "shift": [0.0, 0.0]}}))})
    f["WEIGHTS_HALF_CLASS"] = d / "w-half-class.npz"        # int() would read 3.5 as 3
    np.savez(f["WEIGHTS_HALF_CLASS"], **{**weights, "arch": np.array(json.dumps(
        {**meta, "num_classes": meta["num_classes"] + 0.5}))})
    return f


TRAIN = ["train", "--dataset", "npz:DATA", *TINY, "--steps", "1", "--quiet"]
PREDICT = ["predict", "--weights", "WEIGHTS", "--devices", "cpu:1"]

# (command line, exit status, words its one line of stderr holds)
BAD = [
    # --- train: option values and combinations (2)
    (TRAIN + ["--lr", "inf"], 2, ["--lr", "finite"]),
    (TRAIN + ["--lr", "1e999"], 2, ["--lr", "finite"]),
    (TRAIN + ["--momentum", "inf"], 2, ["--momentum"]),
    (TRAIN + ["--momentum", "1"], 2, ["--momentum", "[0, 1)"]),
    (TRAIN + ["--weight-decay", "inf"], 2, ["--weight-decay", "finite"]),
    (TRAIN + ["--weight-decay", "nan"], 2, ["--weight-decay"]),
    (TRAIN + ["--seed", "-1"], 2, ["--seed", ">= 0"]),
    (TRAIN + ["--steps", "\u0661"], 2, ["--steps", "whole number"]),
    (TRAIN + ["--devices", "cpu:\u0661"], 2, ["--devices", "ASCII"]),
    (TRAIN + ["--devices", "cpu:1@1e-300"], 2, ["--devices", "0.001 <= S <= 1"]),
    (TRAIN + ["--devices", "cpu:100000000000"], 2, ["--devices", "at most 1024"]),
    (TRAIN + ["--devices", "3/cpu:1"], 2, ["rank 3", "mpiexec"]),
    (TRAIN + ["--resume"], 2, ["--resume", "--checkpoint-dir"]),
    (TRAIN + ["--kernels", "3,4", "--arch", "3C3"], 2, ["--arch", "--kernels"]),
    (TRAIN + ["--kernels", "\u0663,4"], 2, ["--kernels", "A,B"]),
    (["train", "--arch", "\uff13C3"], 2, ["--arch", "ASCII digits"]),
    (["train", "--arch", "3C3p\u0661"], 2, ["--arch", "block 1", "ASCII digits"]),
    (TRAIN + ["--frobnicate"], 2, ["pyhet train", "unrecognized", "--frobnicate"]),
    # --- train: files and sizes (1)
    (TRAIN + ["--init", "DIR"], 1, ["folder", "not a file"]),
    (TRAIN + ["--init", "EMPTY"], 1, ["empty file"]),
    (TRAIN + ["--init", "TEXT"], 1, ["not an .npz file"]),
    (TRAIN + ["--init", "TRUNCATED"], 1, ["truncated"]),
    (TRAIN + ["--init", "WEIGHTS_JUNK_MEMBER"], 1, ["'conv1.weight'", "not an .npy array"]),
    (TRAIN + ["--dataset", "npz:X_JUNK_MEMBER"], 1, ["'x'", "not an .npy array"]),
    (TRAIN + ["--save", "DIR"], 2, ["--save", "a folder, not a file"]),
    (TRAIN + ["--save", "SLASHED"], 2, ["--save", "out.npz/", "ends in /", "not a file"]),
    (TRAIN + ["--save", "w.npy"], 2, ["--save w.npy", "an .npz archive", "ending in .npz"]),
    (TRAIN + ["--dataset", "npz:DIR"], 1, ["folder"]),
    (TRAIN + ["--dataset", "npz:OBJECTS"], 1, ["'y'", "Python objects"]),
    (TRAIN + ["--dataset", "npz:TEXT"], 1, ["not an .npz file", "x (N, C, H, W)"]),
    (TRAIN + ["--dataset", "npz:EMPTY"], 1, ["empty file"]),
    (TRAIN + ["--dataset", "npz:TRUNCATED"], 1, ["truncated"]),
    (TRAIN + ["--dataset", "npz:IMAGES"], 1, ["single .npy array"]),
    (TRAIN + ["--dataset", "npz:CHANNEL_LAST"], 1, ["channel-last", "(16, 1, 12, 12)"]),
    (TRAIN + ["--dataset", "npz:HUGE_LABELS"], 1, ["= 2000000000000 would make",
                                                   "2,000,000,000,001 classes"]),
    (TRAIN + ["--dataset", "npz:HUGE_CLASSES"], 1, ["2,000,000,000 classes", "GiB"]),
    (TRAIN + ["--dataset", "npz:TOO_MANY_CLASSES"], 1, ["'num_classes' is 1,000,000,000,000",
                                                        "more than the 2,147,483,647"]),
    (["train", "--kernels", "1000000,8", "--devices", "cpu:1,cpu:1", "--quiet"], 1,
     ["1000000C5", "GiB", "available"]),
    (TRAIN + ["--dataset", "mnist", "--data-dir", "DATA"], 1,
     ["data.npz: a regular file, not a folder, expected the IDX files"]),
    (TRAIN + ["--dataset", "cifar10", "--data-dir", "/nonexistent/pyhet-data"], 1,
     ["no such folder, expected CIFAR-10 in it"]),
    (TRAIN + ["--dataset", "cifar10", "--data-dir", "DIR"], 1,
     ["no CIFAR-10 batches", "cifar-10-python.tar.gz",
      "https://www.cs.toronto.edu/~kriz/cifar.html", "pyhet downloads neither"]),
    (TRAIN + ["--dataset", "mnist", "--data-dir", "DIR"], 1,
     ["train-images-idx3-ubyte[.gz]: no such file", "http://yann.lecun.com/exdb/mnist/",
      "pyhet downloads none"]),
    # --- devices
    (["devices", "--devices", "tpu"], 2, ["--devices", "tpu"]),
    (["devices", "--devices", "0/cpu:1,1/cpu:1", "--no-calibrate"], 2,
     ["rank 1", "pyhet devices runs in one process", "without R/"]),
    (["devices", "--batch-size", "0"], 2, ["--batch-size"]),
    (["devices", "--dataset", "npz:DIR", "--devices", "cpu:1"], 1, ["folder"]),
    (["devices", "--kernels", "1000000,8", "--devices", "cpu:1,cpu:1"], 1, ["GiB"]),
    # --- plan: the devices it calibrates here need what training them would (it ran out
    # of memory in calibration, after gigabytes)
    (["plan", "--arch", "4C5-P2-8C5-P2", "--batch-size", "500000", "--devices", "cpu:1"], 1,
     ["at batch 500000", "GiB available"]),
    # --- evaluate
    (["evaluate"], 2, ["--weights", "required"]),
    (["evaluate", "--weights", "DIR", "--devices", "cpu:1"], 1, ["folder"]),
    (["evaluate", "--weights", "EMPTY", "--devices", "cpu:1"], 1, ["empty file"]),
    (["evaluate", "--weights", "TEXT", "--devices", "cpu:1"], 1, ["not an .npz file"]),
    (["evaluate", "--weights", "WEIGHTS", "--devices", "cpu:1", "--dataset", "synthetic"], 1,
     ["no test split"]),
    (["evaluate", "--weights", "WEIGHTS", "--devices", "cpu:1", "--dataset", "npz:TEXT"], 1,
     ["not an .npz file"]),
    # --- predict
    (PREDICT + ["--input", "NPY_CHANNEL_LAST"], 1, ["channel-last", "(2, 1, 12, 12)"]),
    (PREDICT + ["--input", "NPY_OBJECTS"], 1, ["Python objects"]),
    (PREDICT + ["--input", "NPY_LONG_HEADER"], 1, ["header of 12,020 bytes", "damaged"]),
    (PREDICT + ["--input", "DIR"], 1, ["folder"]),
    (PREDICT + ["--input", "NPY_CHANNEL_LAST", "--output", "p.npy"], 2,
     ["--output p.npy", "an .npz archive"]),
    (PREDICT + ["--input", "EMPTY"], 1, ["empty file"]),
    (PREDICT + ["--input", "TEXT"], 1, ["not an .npy or .npz file"]),
    (PREDICT + ["--input", "X_JUNK_MEMBER"], 1, ["'x'", "not an .npy array"]),
    (PREDICT + ["--input", "NPY_OVERFLOW"], 1, ["--input", "overflow.npy", "not finite"]),
    (PREDICT + ["--input", "NPY_HUGE_HEADER"], 1,
     ["huge-header.npy", "header", "576,000,000,000,000 bytes", "holds 64", "truncated"]),
    (PREDICT + ["--input", "IMAGES", "--output", "DIR"], 2, ["--output", "a folder, not a file"]),
    (PREDICT + ["--input", "IMAGES", "--output", ""], 2, ["--output ''", "give a file name"]),
    (PREDICT + ["--input", "IMAGES", "--output", "NOWHERE"], 2, ["--output", "does not exist"]),
    (PREDICT + ["--input", "MISSING", "--output", "DIR"], 2, ["--output"]),   # before reading
    (["evaluate", "--weights", "WEIGHTS_JUNK_MEMBER", "--devices", "cpu:1"], 1,
     ["'conv1.weight'", "not an .npy array"]),
    (["evaluate", "--weights", "WEIGHTS_HALF_CLASS", "--devices", "cpu:1"], 1,
     ["w-half-class.npz", "num_classes", ".5 is not a whole number"]),
    (["predict", "--weights", "WEIGHTS_TWO_CHANNELS", "--devices", "cpu:1", "--input",
      "IMAGES"], 1, ["w-two-channels.npz", "normalization", "2 scales", "1 channel"]),
    # --- plan: figures that cannot be read, counts that would never end
    (["plan", "--describe", "g:gflops=1", "--sweep", "devices=\u0663"], 2, ["--sweep"]),
    (["plan", "--describe", "g:gflops=1", "--sweep", "devices=1,+-2"], 2, ["--sweep", "+-2"]),
    (["plan", "--describe", "g:gflops=1", "--sweep", "devices=" + "9" * 5000], 2,
     ["--sweep", "expected devices=N"]),
    (["plan", "--describe", "g:gflops=1,count=" + "9" * 5000], 2, ["count=", "a whole number"]),
    (TRAIN + ["--batch-size=-+3"], 2, ["--batch-size", "a whole number", "'-+3'"]),
    (["plan", "--describe", "g:gflops=1", "--sweep", "devices=2,99999999999"], 2,
     ["--sweep", "at most 65,536", "99,999,999,999"]),
    (["plan", "--describe", "g:gflops=1,count=99999999999"], 2,
     ["--describe", "at most 65,536", "count="]),
    (["plan", "--describe", "g:gflops=1", "--link", "1e999gbit"], 2,
     ["--link '1e999gbit'", "a finite number"]),
    (["plan", "--describe", "g:gflops=1", "--link", "1gbit@1e999s"], 2,
     ["--link", "a finite number"]),
    (["plan", "--describe", "g:gflops=1,mem=1e999G"], 2, ["--describe", "a finite number"]),
    (["plan", "--describe", "g:gflops=1", "--link", "fast"], 2, ["--link 'fast'", "bandwidth"]),
    (["plan", "--describe", "g:gflops=1,count=1.5"], 2, ["count=1.5", "a whole number"]),
    (["plan", "--describe", "g:gflops=\u0661\u0660"], 2, ["gflops=", "a number such as"]),
    (["plan", "--describe", "g:gflops=1e999"], 2, ["gflops=1e999", "a finite number"]),
    (["plan", "--describe", "g:gflops=1;g:gflops=2"], 2, ["two devices named 'g'"]),
    (["plan", "--describe", "g:gflops=1,count=2;g.1:gflops=3"], 2,
     ["two devices named 'g.1'", "g.0, g.1, g.1"]),
    (["plan", "--devices", "cpu:1", "--describe", "d0:gflops=2"], 2, ["two devices named 'd0'"]),
    (PREDICT + ["--input", "IMAGES", "--batch-size", "0"], 2, ["--batch-size"]),
    (PREDICT + ["--input", "IMAGES", "--devices", "numpy:2"], 2, ["--devices"]),
    # --- bench: argparse errors and option values, before anything is measured
    (["bench", "nosuch"], 2, ["invalid choice", "nosuch", "pyhet bench --help"]),
    (["bench", "gemm", "--pause", "nan"], 2, ["pyhet bench gemm", "--pause", "nan"]),
    (["bench", "pair", "--arch", "x"], 2, ["pyhet bench pair", "--arch 'x'", "not a block"]),
    (["bench", "bandwidth", "--rates", "0mbit"], 2,
     ["pyhet bench bandwidth", "from 1kbit to 1000gbit", "0mbit"]),
    (["bench", "gemm", "--repeat", "0"], 2, ["pyhet bench gemm", "--repeat"]),
    (["bench", "gemm", "--frob"], 2, ["pyhet bench gemm", "--frob"]),
    (["bench", "step", "--kernels", "a"], 2, ["pyhet bench step", "--kernels"]),
    (["bench"], 2, ["pyhet bench", "give the benchmark to run: one of gemm, step"]),
    (["bench", "--json", "x.json"], 2,
     ["give the benchmark's name before its options (pyhet bench NAME --json ...)", "gemm"]),
    (["--debug", "bench", "--json", "x.json", "plan"], 2,
     ["give the benchmark's name before its options (pyhet bench NAME --json ...)", "gemm"]),
    (["bench", "scaling", "--steps", "0"], 2, ["pyhet bench scaling", "--steps"]),
    (["bench", "bandwidth", "--rates", "foo"], 2, ["pyhet bench bandwidth", "rate"]),
    (["bench", "ranks", "--quotas", "2"], 2, ["pyhet bench ranks", "--quotas"]),
    (["bench", "ranks", "--kernels", "a"], 2, ["pyhet bench ranks", "kernel counts"]),
    # --- paths: empty, ~ of no user, too long a name, a file where a folder should be
    (TRAIN + ["--init="], 2, ["--init ''", "give a file name"]),
    (["train", "--dataset", "mnist", "--data-dir=", "--steps", "1"], 2,
     ["--data-dir ''", "give a folder"]),
    (["train", "--dataset", "mnist", "--data-dir", "~no-such-user-0/x", "--steps", "1"], 1,
     ["~no-such-user-0/x", "no such folder"]),
    (["train", "--dataset", "mnist", "--data-dir", "d" * 300, "--steps", "1"], 1,
     ["cannot be read", "too long"]),
    (["train", "--dataset", "npz:~no-such-user-0/d.npz", "--steps", "1"], 1, ["no such file"]),
    # a name with a newline or a terminal's escape: one line all the same, the name escaped
    (["train", "--dataset", "npz:no\nsuch\x1b[2J.npz", "--steps", "1"], 1,
     ["no\\nsuch\\x1b[2J.npz: no such file"]),
    (TRAIN + ["--save", "a\nb/w.npz"], 2, ["--save a\\nb/w.npz: the folder a\\nb does not"]),
    # --- a data folder given to a dataset that reads none (it trained on other data)
    (TRAIN + ["--data-dir", "DIR"], 2, ["'npz:", "reads no data folder", "--data-dir"]),
    (["train", "--data-dir", "DIR", "--steps", "1"], 2,
     ["the dataset 'bundled' reads no data folder", "mnist", "name the dataset it holds"]),
    (["evaluate", "--weights", "WEIGHTS", "--data-dir", "DIR"], 2, ["reads no data folder"]),
    (TRAIN + ["--save", "UNDER_A_FILE"], 2, ["--save", "is a regular file, not a folder"]),
    # --- --save onto a file the run reads or keeps (the file was replaced without a word)
    (TRAIN + ["--save", "DATA"], 2, ["--save", "the same file as --dataset npz:"]),
    (TRAIN + ["--init", "WEIGHTS", "--save", "WEIGHTS"], 2, ["the same file as --init"]),
    (TRAIN + ["--checkpoint-dir", "DIR", "--save", "DIR_LOCK"], 2,
     ["--save", "a name the files of --checkpoint-dir"]),
    (TRAIN + ["--checkpoint-dir", "DIR", "--save", "DIR_CHECKPOINT"], 2,
     ["--save", "a name the files of --checkpoint-dir"]),
    # --- values too many or too long to quote whole
    (TRAIN + ["--devices", ",".join(["cpu:1"] * 1025)], 2, ["1,025 entries", "at most 1024"]),
    (TRAIN + ["--devices", "x" * 100_000], 2, ["--devices", "(100000 chars)"]),
    (TRAIN + ["--devices", ",".join(["cpu:2"] * 513)], 2, ["1,026 cpu threads", "at most 1024"]),
    (TRAIN + ["--devices", "cpu:1024,1/cpu:1"], 2, ["1,025 cpu threads", "on rank 1"]),
    (TRAIN + ["--devices", "cpu:1@" + "9" * 100_000], 2, ["speed", "(100000 chars)"]),
    # a path of 100 KB (no system takes one) is quoted by its start and end
    (TRAIN + ["--save", "/tmp/" + "a" * 100_000 + ".npz"], 2, ["--save", "...[100,0", "chars]..."]),
    (TRAIN + ["--init", "/tmp/" + "a" * 100_000 + ".npz"], 1, ["weight file", "[100,0"]),
    (TRAIN + ["--checkpoint-dir", "/tmp/" + "a" * 100_000], 2, ["--checkpoint-dir", "[100,0"]),
    (["train", "--dataset", "npz:/tmp/" + "a" * 100_000, "--steps", "1"], 1,
     ["[100,0", "cannot be read"]),
    (["plan", "--describe", "g:gflops=" + "1" * 10_000], 2, ["gflops=", "(10000 chars)"]),
    (["plan", "--describe", "g:gflops=1", "--link", "x" * 10_000], 2, ["--link", "chars)"]),
    (["bench", "gemm", "--shapes", "1000000x1000000x1000000"], 2,
     ["pyhet bench gemm", "--shapes", "GiB", "available"]),
    # --- no command, an unknown one
    ([], 2, ["COMMAND", "required"]),
    (["frob"], 2, ["invalid choice", "frob"]),
]


def _argv(argv, files):
    out = []
    for a in map(str, argv):
        for name, path in sorted(files.items(), key=lambda kv: -len(kv[0])):
            if a == name or a.endswith(":" + name):
                a = a[:len(a) - len(name)] + str(path)
                break
        out.append(a)
    return out


@pytest.mark.parametrize("argv,code,words", BAD, ids=[" ".join(a[:1] + a[-2:])[:80] for a, _, _
                                                      in BAD])
def test_a_bad_command_line_is_one_line_with_its_status(cli, files, argv, code, words):
    res = cli(*_argv(argv, files))
    assert res.code == code, (res.code, res.err)
    assert res.out == ""
    assert "Traceback" not in res.err
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert len(lines) == 1, res.err
    assert ": error: " in lines[0], lines[0]
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])
    assert len(lines[0]) < 1000, lines[0][:300]    # a value is quoted short


# ================================================================ stdout that cannot be written

def _pyhet(argv, cwd, stdout, shell_redirect=""):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "pyhet", *map(str, argv)]
    if shell_redirect:
        cmd = ["sh", "-c", 'exec "$@" ' + shell_redirect, "sh", *cmd]
    return subprocess.run(cmd, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=120)


@pytest.mark.parametrize("as_json", [False, True])
def test_a_full_disk_on_stdout_is_one_line(files, tmp_path, as_json):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    argv = _argv(TRAIN, files) + (["--json"] if as_json else [])
    with open("/dev/full", "w") as full:
        p = _pyhet(argv, tmp_path, full)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().splitlines() == [
        "pyhet: error: cannot write to stdout: No space left on device"], p.stderr


def test_help_into_a_full_disk_is_one_line(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        p = _pyhet(["train", "--help"], tmp_path, full)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [
        "pyhet: error: cannot write to stdout: No space left on device"], p.stderr


def test_a_closed_pipe_on_stdout_is_quiet(files, tmp_path):
    """`pyhet train ... | head -0`: the reader is gone before anything is written."""
    r, w = os.pipe()
    os.close(r)
    with os.fdopen(w, "w") as pipe:
        p = _pyhet(_argv(TRAIN, files), tmp_path, pipe)
    assert p.returncode == 1
    assert p.stderr == "", p.stderr


def test_a_closed_stdout_is_one_line_and_the_run_still_saves(files, tmp_path):
    """`pyhet train --save w.npz >&-`: the weights are written (no file takes the place of
    stdout), and that the summary could not be printed is said in one line."""
    out = tmp_path / "w.npz"
    p = _pyhet(_argv(TRAIN, files) + ["--save", out], tmp_path, None, shell_redirect=">&-")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [
        "pyhet: error: cannot write to stdout: it is closed"], p.stderr
    with np.load(out) as w:
        assert "conv1.weight" in w.files


@pytest.mark.parametrize("redirect", ["2>&-", "2>/dev/full"])
def test_a_stderr_that_cannot_be_written_loses_no_run(files, tmp_path, redirect):
    """Progress, warnings and errors go to stderr or nowhere: with stderr closed or full the
    run still prints its summary and writes --save (it used to end with status 1 and nothing
    at the progress bar's first line), and no warning or error line reaches stdout."""
    if "full" in redirect and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    out = tmp_path / "w.npz"
    argv = [a for a in _argv(TRAIN, files) if a != "--quiet"] + [   # with a progress bar
        "--save", out, "--json", "--devices", "cpu:1,cpu:1,cpu:1"]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    p = subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", sys.executable, "-m",
                        "pyhet", *map(str, argv)], cwd=tmp_path, env=env,
                       stdout=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 0
    assert json.loads(p.stdout.strip())["steps"] >= 1, p.stdout   # one line: the summary
    with np.load(out) as w:
        assert "conv1.weight" in w.files
    # an error: status 2 and nothing on stdout
    p = subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", sys.executable, "-m",
                        "pyhet", "train", "--lr", "-1"], cwd=tmp_path, env=env,
                       stdout=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", p.stdout


# ================================================================ warnings, and NumPy's

def test_a_run_that_diverges_says_so_in_one_line_without_numpy_warnings(files, tmp_path):
    """lr 1e30 makes the loss NaN at step 2: NumPy warns of invalid values on the way, which the
    command keeps to itself (its own error says it all)."""
    p = _pyhet(_argv(TRAIN, files)[:-3] + ["--steps", "2", "--quiet", "--lr", "1e30"], tmp_path,
               subprocess.PIPE)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "the loss became nan at step 2" in lines[0], p.stderr


def test_a_warning_is_one_line(files, tmp_path):
    """More cpu threads than cores: a warning, in one line (no source file, no line of code)."""
    cores = len(os.sched_getaffinity(0))
    if cores >= 1024:
        pytest.skip("a cpu device takes at most 1024 threads")
    argv = _argv(TRAIN, files)
    argv[argv.index("--devices") + 1] = f"cpu:{cores + 1}"
    p = _pyhet(argv, tmp_path, subprocess.PIPE)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"pyhet: warning: the cpu devices use {cores + 1} threads in all but this process may "
        f"run on {cores} cores: they will compete for them"], p.stderr


def _limited_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))    # 4 GiB of address space
    resource.setrlimit(resource.RLIMIT_STACK, (8 << 20, resource.getrlimit(
        resource.RLIMIT_STACK)[1]))                                  # 8 MiB a thread's stack


def _stack_hard_limit() -> float:
    import resource
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    return math.inf if hard == resource.RLIM_INFINITY else hard


@beyond_asan
@pytest.mark.skipif(not pyhet.ops.have_openmp(), reason="built without OpenMP")
def test_more_threads_than_the_limits_allow_is_a_device_error(files, tmp_path):
    """1024 threads of 8 MiB of stack in 4 GiB: libgomp would end the process with its own
    line; pyhet tries them first (pyhet.specs.check_threads) and says what it could start.
    16 threads, which the limits allow, train."""
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("not Linux")
    if _stack_hard_limit() < 8 << 20:
        pytest.skip("a hard limit on the stack below 8 MiB")
    argv = _argv(TRAIN, files)
    argv[argv.index("--devices") + 1] = "cpu:1024"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    p = subprocess.run([sys.executable, "-m", "pyhet", *argv], cwd=tmp_path, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=_limited_memory)
    assert p.returncode == 1, p.stderr
    lines = [line for line in p.stderr.strip().splitlines() if "warning" not in line]
    assert len(lines) == 1, p.stderr
    own = len(os.sched_getaffinity(0)) - 1    # the master's team, past its own thread
    assert lines[0].startswith(
        f"pyhet: error: the devices need {1024 + own:,} threads at once (1,024 for the cpu "
        f"devices, {own:,} for the master's own work), but this process could start only "
        if own else "pyhet: error: the cpu devices need 1,024 threads at once, but this process "
        "could start only "), lines[0]
    assert "ulimit" in lines[0] and "libgomp" not in p.stderr, p.stderr
    argv[argv.index("--devices") + 1] = "cpu:16"
    p = subprocess.run([sys.executable, "-m", "pyhet", *argv], cwd=tmp_path, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=_limited_memory)
    assert p.returncode == 0, p.stderr


@beyond_asan
@pytest.mark.skipif(not pyhet.ops.have_openmp(), reason="built without OpenMP")
def test_threads_are_tried_at_the_stack_size_openmp_gives_them(files, tmp_path):
    """With OMP_STACKSIZE set, libgomp makes its threads with that stack: 15 of 512 MiB do not
    fit in 4 GiB, though 16 of 8 MiB do. They were tried at the default size, passed, and
    libgomp ended the process with its own line."""
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("not Linux")
    argv = _argv(TRAIN, files)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_STACKSIZE"] = "512M"

    def run(devices):
        argv[argv.index("--devices") + 1] = devices
        return subprocess.run([sys.executable, "-m", "pyhet", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120,
                              preexec_fn=_limited_memory)
    p = run("cpu:16")
    assert p.returncode == 1, p.stderr
    lines = [line for line in p.stderr.strip().splitlines() if "warning" not in line]
    assert len(lines) == 1 and "libgomp" not in p.stderr, p.stderr
    assert "each OpenMP thread reserves OMP_STACKSIZE's 512 MiB of stack" in lines[0], lines[0]
    p = run("cpu:1")
    assert p.returncode == 0, p.stderr


def test_openmp_stack_size_is_read_as_libgomp_reads_it():
    read = pyhet.ops._openmp_stack_size
    assert read({}) is None
    assert read({"OMP_STACKSIZE": "64"}) == (64 << 10, "OMP_STACKSIZE")   # KiB by default
    assert read({"OMP_STACKSIZE": " 2 g "}) == (2 << 30, "OMP_STACKSIZE")
    assert read({"OMP_STACKSIZE": "+4M"}) == (4 << 20, "OMP_STACKSIZE")    # strtoul's sign
    assert read({"OMP_STACKSIZE": "100b"}) == (100, "OMP_STACKSIZE")
    assert read({"OMP_STACKSIZE": "16M", "GOMP_STACKSIZE": "8"}) == (16 << 20, "OMP_STACKSIZE")
    assert read({"OMP_STACKSIZE": "bad", "GOMP_STACKSIZE": "8"}) == (8 << 10, "GOMP_STACKSIZE")
    assert read({"OMP_STACKSIZE": "1T"}) is None and read({"OMP_STACKSIZE": "-4"}) is None
    assert read({"OMP_STACKSIZE": f"{2**60}G"}) is None              # past 64 bits: invalid


@beyond_asan
def test_a_result_that_cannot_be_allocated_names_the_call(tmp_path):
    """An im2col result within the address space but past the process's memory limit: the
    MemoryError names the call, the shape and the size (NumPy's names neither)."""
    code = ("import numpy as np, pyhet.ops as o\n"
            "try:\n"
            "    o.im2col(np.zeros((1, 1, 4, 4), np.float32), 3, 3, pad=30000)\n"
            "except MemoryError as e:\n"
            "    print(type(e).__name__, e)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120, preexec_fn=_limited_memory)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == ("MemoryError im2col: cannot allocate the result, shape "
                                "(9, 3600240004) (121 GiB)"), p.stdout


def test_importing_from_the_source_folder_says_so(tmp_path):
    """Python started in the source folder imports its pyhet/, which has no built core: the
    error says so and what to do, not Python's words about a partly initialised module."""
    import shutil
    src = Path(__file__).resolve().parent.parent    # the source folder (tests/..)
    shutil.copy(src / "CMakeLists.txt", tmp_path / "CMakeLists.txt")
    shutil.copytree(src / "pyhet", tmp_path / "pyhet",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    python = [sys.executable]
    p = subprocess.run([*python, "-c", "import pyhet; print(pyhet.__file__)"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if p.returncode == 0 and not p.stdout.strip().startswith(str(tmp_path)):
        # an editable install's import hook (a .pth file's) comes before the current folder:
        # without the site module's .pth files, NumPy found where it is installed
        python = [sys.executable, "-S"]
        env["PYTHONPATH"] = str(Path(np.__file__).resolve().parent.parent)
    for argv in (["-c", "import pyhet"], ["-m", "pyhet", "train", "--steps", "1"]):
        p = subprocess.run([*python, *argv], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode != 0, p.stderr
        assert f"pyhet was imported from its source folder ({tmp_path})" in p.stderr, p.stderr
        assert "run Python from another folder" in p.stderr, p.stderr
        assert "circular import" not in p.stderr and "partially initialized" not in p.stderr
    # the command says it in one line, as its other errors (a program's import: a traceback)
    assert p.returncode == 1 and p.stderr.startswith("pyhet: error: pyhet was imported from")
    assert len(p.stderr.splitlines()) == 1, p.stderr


def test_a_weight_file_that_cannot_be_read_is_a_public_weights_error(tmp_path):
    """pyhet.load of a missing or damaged file raises pyhet.errors.WeightsError itself (its
    class, in a traceback, is the documented one)."""
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    for name in ("missing.npz", "bad.npz"):
        with pytest.raises(pyhet.errors.WeightsError) as e:
            pyhet.load(tmp_path / name)
        assert type(e.value) is pyhet.errors.WeightsError
        assert str(e.value).startswith(f"weight file {tmp_path / name}: "), e.value


# ================================================================ nothing left to resume

def test_resuming_a_finished_run_of_two_devices_says_that_alone(cli, files, tmp_path):
    """With two devices and progress shown, it also said how the partition was planned
    ("resuming with the checkpoint's partition") and what it was."""
    argv = _argv(["train", "--dataset", "npz:DATA", "--arch", "3C3-P2-4C3-P2", "--devices",
                  "cpu:1,cpu:1", "--steps", "2", "--checkpoint-dir", tmp_path / "ck"], files)
    assert cli(*argv, "--quiet").code == 0
    res = cli(*argv, "--resume")
    assert res.code == 0, res.err
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "nothing left to train" in lines[0], res.err


def test_resuming_a_finished_run_says_so_and_exits_0(cli, files, tmp_path):
    """A run whose checkpoint is at its last step: no step, exit 0, one line on stderr that
    says so; the summary has no step figures, and --save writes the checkpoint's weights."""
    ckpt = tmp_path / "ckpt"
    argv = _argv(["train", "--dataset", "npz:DATA", *TINY, "--quiet", "--epochs", "2",
                  "--checkpoint-dir", ckpt], files)
    assert cli(*argv).code == 0
    done = sorted(ckpt.glob("checkpoint-*.npz"))[-1]
    for extra in (["--json"], []):
        res = cli(*argv, "--resume", "--save", tmp_path / "w.npz", *extra)
        assert res.code == 0, res.err
        lines = [line for line in res.err.splitlines() if line.strip()]
        assert len(lines) == 1 and "nothing left to train" in lines[0], res.err
        assert str(done) in lines[0] and "--epochs" in lines[0]
        if extra:
            s = json.loads(res.out.strip().splitlines()[-1])
            assert s["steps"] == 4 and s["step_time_s"] is None and s["train_loss"] is None
            assert s["start_step"] == 4
        else:   # it said "trained 4 steps"
            assert res.out.startswith("trained no step after resuming at step 4, 4 steps "
                                      "(2.00 epochs) in all, of batch 8"), res.out
            assert "final train loss: n/a" in res.out
    # a resume that trains: the steps of this run, and of the whole run
    res = cli(*argv[:argv.index("2")], "3", *argv[argv.index("2") + 1:], "--resume")
    assert res.code == 0 and res.out.startswith(
        "trained 2 steps after resuming at step 4, 6 steps (3.00 epochs) in all,"), res.out
    with np.load(done) as c, np.load(tmp_path / "w.npz") as w:
        np.testing.assert_array_equal(c["conv1.weight"], w["conv1.weight"])


# ================================================================ checkpoints that were edited

def _meta(meta, **change):
    return {"meta": np.array(json.dumps({**meta, **change}))}


DAMAGED_CHECKPOINT = {
    # what is changed in the newest checkpoint: (its arrays, given the meta and momentum) and
    # the words of the warning
    "meta a list": (lambda m, v: {"meta": np.array("[1]")}, ["meta entry is list"]),
    "no step": (lambda m, v: {"meta": np.array(json.dumps(
        {k: x for k, x in m.items() if k != "step"}))}, ["'step' is None"]),
    "step a string": (lambda m, v: _meta(m, step="x"), ["'step' is 'x'"]),
    "step negative": (lambda m, v: _meta(m, step=-5), ["'step' is -5"]),
    "settings a list": (lambda m, v: _meta(m, settings=[1]), ["settings are [1]"]),
    # (without them a different --lr went unnoticed)
    "settings missing": (lambda m, v: {"meta": np.array(json.dumps(
        {k: x for k, x in m.items() if k != "settings"}))}, ["format 2 has no settings"]),
    "meta nested too deeply": (lambda m, v: {"meta": np.array("[" * 5000 + "]" * 5000)},
                               ["nested too deeply"]),
    "a format to come": (lambda m, v: _meta(m, format=99), ["format is 99, not one of 1..2"]),
    "a step training cannot have reached": (lambda m, v: _meta(m, step=10**30),
                                            [f"step {10**30}, more than the 2 batches"]),
    "a batch past the epoch's end": (lambda m, v: _meta(m, batch=10**9),
                                     ["batch 1000000000 of an epoch, which has"]),
    "lr a string": (lambda m, v: _meta(m, settings={**m["settings"],
                                                    "lr": str(m["settings"]["lr"])}),
                    ["setting 'lr' is '0.01', not a number"]),
    "momentum of another shape": (lambda m, v: {"momentum/conv1.weight": v[:1]},
                                  ["momentum for", "conv1.weight", "shape (3, 1, 3, 3)",
                                   "(1, 1, 3, 3)"]),
    "momentum NaN": (lambda m, v: {"momentum/conv1.weight": np.full_like(v, np.nan)},
                     ["momentum for", "conv1.weight", "NaN"]),
    "momentum float64": (lambda m, v: {"momentum/conv1.weight": v.astype(np.float64)},
                         ["momentum for", "conv1.weight", "float64"]),
    "momentum of an unknown layer": (lambda m, v: {"momentum/conv9.weight": v},
                                     ["momentum for", "unknown conv9.weight"]),
    # the settings name this network, so weights of another shape are damage, as momentum's
    "weights of another shape": (lambda m, v: {"conv1.weight": v[:1]},
                                 ["conv1.weight", "(3, 1, 3, 3)", "(1, 1, 3, 3)"]),
    "weights float64": (lambda m, v: {"conv1.weight": v.astype(np.float64)},
                        ["conv1.weight", "float64"]),
    "weights missing": (lambda m, v: {"conv1.weight": None}, ["conv1.weight"]),
    "weights NaN": (lambda m, v: {"conv1.weight": np.full_like(v, np.nan)},
                    ["conv1.weight", "NaN or infinite"]),
}


def _one_checkpoint(cli, files, tmp_path):
    """(argv of a run with a checkpoint folder, the path of its one checkpoint, its arrays)."""
    ckpt = tmp_path / "ckpt"
    argv = _argv(["train", "--dataset", "npz:DATA", *TINY, "--quiet", "--checkpoint-dir", ckpt],
                 files)
    assert cli(*argv, "--steps", "1").code == 0
    path = ckpt / "checkpoint-000000001.npz"
    return argv, path, dict(np.load(path))


@pytest.mark.parametrize("damage", list(DAMAGED_CHECKPOINT))
def test_resume_passes_over_an_edited_checkpoint(cli, files, tmp_path, damage):
    """A checkpoint whose meta entry, weights or momentum are not what pyhet writes is damaged:
    --resume says so in one warning and goes on from the one before it, where it ended in a
    traceback, resumed from a negative step, or trained with NaN momentum; where there is none
    before it, --resume is refused, and the file left as it is (a run started afresh would
    have deleted it in time, or written over it)."""
    argv, first, _ = _one_checkpoint(cli, files, tmp_path)
    assert cli(*argv, "--steps", "2", "--resume").code == 0
    path = first.with_name("checkpoint-000000002.npz")
    arrays = dict(np.load(path))
    change, words = DAMAGED_CHECKPOINT[damage]
    changed = {**arrays, **change(json.loads(str(arrays["meta"])),
                                  arrays["momentum/conv1.weight"])}
    np.savez(path, **{k: v for k, v in changed.items() if v is not None})
    res = cli(*argv, "--steps", "3", "--resume", "--json")
    assert res.code == 0, res.err
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert len(lines) == 2 and "Traceback" not in res.err, res.err
    assert lines[1] == f"resuming from {first} (step 1)", res.err
    for w in [str(path), "is damaged", f"resuming from {first} instead", *words]:
        assert w in lines[0], (w, lines[0])
    summary = json.loads(res.out.splitlines()[-1])
    assert summary["steps"] == 3 and summary["start_step"] == 1
    # the only checkpoint, damaged: nothing to resume from
    for old in first.parent.glob("checkpoint-*.npz"):
        old.unlink()
    np.savez(path, **{k: v for k, v in changed.items() if v is not None})
    before = path.read_bytes()
    res = cli(*argv, "--steps", "3", "--resume")
    assert res.code == 1, res.err
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.err, res.err
    for w in [str(path), "is damaged", "no older one", "--overwrite in place of --resume",
              *words]:
        assert w in lines[0], (w, lines[0])
    assert path.read_bytes() == before
    res = cli(*argv, "--steps", "1", "--overwrite")
    assert res.code == 0, res.err


def test_resume_refuses_an_earlier_versions_checkpoint_of_another_network(cli, files, tmp_path):
    """A checkpoint whose settings do not name its network (an earlier version's) and whose
    weights are not of this run's network may be of another network: refused, not passed
    over, and left as it was."""
    argv, path, arrays = _one_checkpoint(cli, files, tmp_path)
    meta = {k: v for k, v in json.loads(str(arrays["meta"])).items()
            if k not in ("settings", "format")}     # format 1's meta
    np.savez(path, **{**arrays, **_meta(meta), "conv1.weight": arrays["conv1.weight"][:1]})
    before = path.read_bytes()
    res = cli(*argv, "--steps", "2", "--resume")
    assert res.code == 1 and "Traceback" not in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1, res.err
    assert "conv1.weight" in res.err and "damaged" not in res.err, res.err
    assert path.read_bytes() == before


PLAN_NOT_REUSED = {
    # a checkpoint whose plan is not of this version's form: (its new plan, given the old
    # one) and the words of the warning
    "a string": (lambda plan: "junk", ["it is 'junk'"]),
    "partition not counts": (lambda plan: {**plan, "partition": 5}, ["partition is 5"]),
    "a calibration field of another version": (
        lambda plan: {**plan, "calibration": {**plan["calibration"], "alone": {}}},
        ["calibration is not one of this version", "'alone'"]),
    "balancer state a list": (lambda plan: {**plan, "balancer": [1]}, ["balancer state is [1]"]),
    # counts that do not split the layer's kernels over the devices (they were planned afresh
    # without a word)
    "partition of too many kernels": (
        lambda plan: {**plan, "partition": {**plan["partition"], "conv1": [1000, 1000]}},
        ["its partition of conv1 is [1000, 1000], not the layer's", "over its 2 devices"]),
    "partition of one device": (
        lambda plan: {**plan, "partition": {**plan["partition"],
                                            "conv1": [sum(plan["partition"]["conv1"])]}},
        ["its partition of conv1 is [", "over its 2 devices"]),
    "partition without a layer": (
        lambda plan: {**plan, "partition": {k: v for k, v in plan["partition"].items()
                                            if k != "conv2"}},
        ["its partition of conv2 is None"]),
}


def _calibration(plan, name, layer, value):
    """The plan with one entry of its calibration changed (value None: the layer taken out)."""
    table = {k: v for k, v in (plan["calibration"][name] or {}).items() if k != layer}
    if value is not None:
        table[layer] = value
    return {**plan, "calibration": {**plan["calibration"], name: table}}


PLAN_NOT_REUSED.update({
    # calibrations that once ended the resumed run in a traceback
    "speeds zero": (lambda plan: _calibration(plan, "speeds", "conv1", [0.0, 0.0]),
                    ["calibration has speeds [0.0, 0.0] for conv1"]),
    "speeds strings": (lambda plan: _calibration(plan, "speeds", "conv1", ["a", "b"]),
                       ["has speeds ['a', 'b'] for conv1"]),
    "speeds of one device": (lambda plan: _calibration(plan, "speeds", "conv1", [5.0]),
                             ["has speeds [5.0] for conv1"]),
    "speeds of a layer missing": (lambda plan: _calibration(plan, "speeds", "conv2", None),
                                  ["has speeds", "not one entry for each of ['conv1', 'conv2']"]),
    "phases junk": (lambda plan: _calibration(plan, "phases", "conv1", "x"),
                    ["has phases 'x' for conv1"]),
    "fits junk": (lambda plan: _calibration(plan, "fits", "conv1", [["a"], ["b"]]),
                  ["has fits [['a'], ['b']] for conv1"]),
    "whole not numbers": (lambda plan: _calibration(plan, "whole", "conv1", [None, None]),
                          ["has whole [None, None] for conv1"]),
    "waits below one": (lambda plan: _calibration(plan, "waits", "conv1", 0.5),
                        ["has waits 0.5 for conv1"]),
    "local waits below one": (lambda plan: _calibration(plan, "local_waits", "conv1", 0.5),
                              ["has local_waits 0.5 for conv1"]),
    "local contention not positive": (
        lambda plan: _calibration(plan, "local_contention", "conv1", [0.0, 1.0]),
        ["has local_contention [0.0, 1.0] for conv1"]),
    "head_s a string": (lambda plan: {**plan, "calibration": {**plan["calibration"],
                                                              "head_s": "x"}},
                        ["calibration has head_s 'x'"]),
    "fits of an integer past float's range": (
        lambda plan: _calibration(plan, "fits", "conv1", [[0, 0, 10**400], [0, 0, 0]]),
        ["has fits [[0, 0, 1000"]),
})


def _balancer(conv1):
    return lambda plan: {**plan, "balancer": {**(plan.get("balancer") or {}), "conv1": conv1}}


PLAN_NOT_REUSED.update({
    # damaged plans that ended the resumed run in a traceback
    "balancer layer a number": (_balancer(5), ["balancer state for conv1 is 5"]),
    "balancer speed zero": (_balancer({"speeds": [1.0, 0.0], "noise": [0.0, 0.0]}),
                            ["balancer state for conv1"]),
    "balancer noise short": (_balancer({"speeds": [1.0, 2.0], "noise": []}),
                             ["balancer state for conv1"]),
    "balancer alone seen junk": (_balancer({"speeds": [1.0, 2.0], "noise": [0.1, 0.1],
                                            "alone_seen": [{}, 1.0]}),
                                 ["balancer state for conv1"]),
    "failed not names": (lambda plan: {**plan, "failed": [1]}, ["failed devices are [1]"]),
    "deterministic a string": (lambda plan: {**plan, "deterministic": "no"},
                               ["deterministic is 'no'"]),
    "calibration speeds a number": (
        lambda plan: {**plan, "calibration": {**plan["calibration"], "speeds": 5}},
        ["calibration has speeds 5"]),
    # memory caps that do not hold the layer (a traceback from the balancer at the first step)
    "caps below the layer": (lambda plan: _calibration(plan, "caps", "conv2", [1, 1]),
                             ["memory caps of conv2, [1, 1], do not hold its partition"]),
})


@pytest.mark.parametrize("case", list(PLAN_NOT_REUSED))
def test_resume_plans_afresh_where_a_checkpoint_plan_cannot_be_reused(cli, files, tmp_path,
                                                                     case):
    """The plan is advice: a checkpoint whose plan cannot be reused is resumed from (its
    weights, momentum and position), with the partition planned afresh and a warning that
    says why."""
    ckpt = tmp_path / "ckpt"
    argv = _argv(["train", "--dataset", "npz:DATA", *TINY, "--devices", "cpu:1,cpu:1",
                  "--quiet", "--checkpoint-dir", ckpt], files)
    assert cli(*argv, "--steps", "1").code == 0
    path = ckpt / "checkpoint-000000001.npz"
    arrays = dict(np.load(path))
    meta = json.loads(str(arrays["meta"]))
    assert isinstance(meta["plan"], dict) and meta["plan"]["calibration"]
    change, words = PLAN_NOT_REUSED[case]
    np.savez(path, **{**arrays, **_meta(meta, plan=change(meta["plan"]))})
    res = cli(*argv, "--steps", "2", "--resume", "--json")
    assert res.code == 0, res.err
    assert "Traceback" not in res.err and "is damaged" not in res.err, res.err
    warning = [line for line in res.err.splitlines() if "warning" in line]
    assert len(warning) == 1, res.err
    for w in [str(path), "plan cannot be reused", "planning the partition afresh", *words]:
        assert w in warning[0], (w, warning[0])
    assert f"resuming from {path} (step 1)" in res.err
    assert json.loads(res.out.splitlines()[-1])["steps"] == 2


# ================================================================ channel-last images in the API

def test_channel_last_images_are_named_in_the_api():
    from pyhet.errors import DataError
    from pyhet.images import looks_channel_last

    with pyhet.Network(ARCH, (3, 12, 12), 3, devices="numpy") as net:
        with pytest.raises(DataError, match=r"channel-last .* here \(2, 3, 12, 12\).*transpose"):
            net.predict(np.zeros((2, 12, 12, 3), np.float32))
    assert looks_channel_last((5, 32, 32, 3)) and looks_channel_last((5, 28, 28, 1))
    # (N, C, H, W) arrays that only end in a 1, 3 or 4 are left alone
    assert not looks_channel_last((6, 2, 5, 4)) and not looks_channel_last((5, 3, 32, 3))


def test_predict_takes_images_of_the_networks_own_shape_that_look_channel_last(cli, tmp_path):
    """A network of (12, 16, 1) inputs (12 channels of 16-long signals): pyhet predict used to
    refuse its own input shape as channel-last, from the shape alone."""
    x = np.random.default_rng(0).random((6, 12, 16, 1), dtype=np.float32)
    with pyhet.Network("4C3p1", (12, 16, 1), 2, devices="numpy") as net:
        net.fit(x, np.arange(6) % 2, steps=1, batch_size=3)
        net.save(tmp_path / "w.npz")
    np.save(tmp_path / "x.npy", x)
    res = cli("predict", "--weights", tmp_path / "w.npz", "--input", tmp_path / "x.npy",
              "--devices", "numpy")
    assert res.code == 0 and len(res.out.splitlines()) == 6, res.err
    # and images truly channel-last for it are still named so
    np.save(tmp_path / "t.npy", x.transpose(0, 2, 3, 1))
    res = cli("predict", "--weights", tmp_path / "w.npz", "--input", tmp_path / "t.npy",
              "--devices", "numpy")
    assert res.code == 1 and "channel-last" in res.err, res.err


def test_an_npz_dataset_of_the_networks_own_shape_that_looks_channel_last_evaluates(
        cli, tmp_path):
    """A network of (8, 8, 3) inputs: pyhet evaluate, and fit and evaluate with dataset=,
    refused an npz dataset of exactly its images as channel-last (from the shape alone), and
    told to transpose them into a shape the network does not take; as predict, they take it."""
    rng = np.random.default_rng(0)
    x, y = rng.random((6, 8, 8, 3), dtype=np.float32), np.arange(6) % 2
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=x, y_test=y)
    with pyhet.Network("4C3p1", (8, 8, 3), 2, devices="numpy") as net:
        net.fit(dataset=f"npz:{tmp_path / 'd.npz'}", steps=1, batch_size=3)
        assert net.evaluate(dataset=f"npz:{tmp_path / 'd.npz'}")["images"] == 6
        net.save(tmp_path / "w.npz")
    res = cli("evaluate", "--weights", tmp_path / "w.npz", "--dataset",
              f"npz:{tmp_path / 'd.npz'}", "--devices", "numpy", "--json")
    assert res.code == 0 and json.loads(res.out.splitlines()[-1])["images"] == 6, res.err
    # pyhet train, whose network is made for the data, still names the layout
    res = cli("train", "--dataset", f"npz:{tmp_path / 'd.npz'}", "--arch", "2C3", "--steps",
              "1", "--devices", "numpy")
    assert res.code == 1 and "channel-last" in res.err, res.err


def test_big_endian_images_are_the_same_images(cli, tmp_path):
    """float32 of the other byte order, in a dataset or predict's input, is taken as native
    float32 (the same values), as the Python API takes it: it was refused."""
    x = np.random.default_rng(0).random((6, 1, 8, 8), dtype=np.float32)
    outs = []
    for name, images in (("le", x), ("be", x.astype(">f4"))):
        np.savez(tmp_path / f"{name}.npz", x=images, y=np.arange(6) % 2, x_test=images,
                 y_test=np.arange(6) % 2)
        res = cli("train", "--dataset", f"npz:{tmp_path / f'{name}.npz'}", "--arch", "2C3",
                  "--steps", "2", "--quiet", "--devices", "cpu:1", "--save",
                  tmp_path / f"w-{name}.npz", "--json")
        assert res.code == 0, res.err
        outs.append(json.loads(res.out.splitlines()[-1])["test_loss"])
        np.save(tmp_path / f"{name}.npy", images)
        res = cli("predict", "--weights", tmp_path / "w-le.npz", "--input",
                  tmp_path / f"{name}.npy", "--devices", "cpu:1")
        assert res.code == 0, res.err
        outs.append(res.out)
    assert outs[0] == outs[2] and outs[1] == outs[3]



def _big_endian(arrays: dict) -> dict:
    """The float32 arrays as a big-endian machine writes them (the rest as they are)."""
    return {k: v.astype(v.dtype.newbyteorder(">")) if v.dtype == np.float32 else v
            for k, v in arrays.items()}


def test_big_endian_weights_are_the_same_weights(files, tmp_path):
    """float32 weights of the other byte order, given to a Network or in a weight file, are
    taken as native float32, as images are: they were refused as 'must be a float32 array
    ..., got >f4' and 'must be float32, got >f4'."""
    x = np.random.default_rng(1).standard_normal((4, 1, 12, 12)).astype(np.float32)
    with pyhet.load(files["WEIGHTS"], devices="cpu:1") as net:
        w, p = net.params(), net.predict(x)
    be = _big_endian(w)
    assert all(v.dtype.str == ">f4" for v in be.values())
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="cpu:1", weights=be) as net:
        np.testing.assert_array_equal(net.predict(x), p)
        assert all(v.dtype == np.float32 and v.dtype.isnative for v in net.params().values())
    np.savez(tmp_path / "wbe.npz", **_big_endian(dict(np.load(files["WEIGHTS"]))))
    with pyhet.load(tmp_path / "wbe.npz", devices="cpu:1") as net:
        np.testing.assert_array_equal(net.predict(x), p)
    from pyhet.model import checked_params
    with pyhet.load(files["WEIGHTS"], devices="numpy") as net:
        checked = checked_params(be, net.geometry, copy=False)
    assert all(v.dtype.isnative and v.dtype == np.float32 for v in checked.values())


def test_a_big_endian_checkpoint_resumes_as_the_native_one(cli, files, tmp_path):
    """Its weights and momentum are converted: the run goes on exactly as from the native one
    (the momentum passed the check and reached the devices in the other byte order)."""
    argv, path, arrays = _one_checkpoint(cli, files, tmp_path)
    assert arrays["momentum/conv1.weight"].any()
    saved = []
    for name, stored in (("le", arrays), ("be", _big_endian(arrays))):
        ckpt = tmp_path / name
        ckpt.mkdir()
        np.savez(ckpt / path.name, **stored)
        at = argv.index("--checkpoint-dir") + 1
        res = cli(*argv[:at], ckpt, *argv[at + 1:], "--steps", "3", "--resume", "--save",
                  tmp_path / f"w-{name}.npz")
        assert res.code == 0 and res.err.strip().splitlines() == [
            f"resuming from {ckpt / path.name} (step 1)"], res.err      # not passed over
        saved.append(dict(np.load(tmp_path / f"w-{name}.npz")))
    for k, v in saved[0].items():
        if v.dtype == np.float32:
            np.testing.assert_array_equal(saved[1][k], v, err_msg=k)


def test_an_error_line_escapes_only_what_breaks_it():
    """Controls, line separators and bidirectional overrides are written as Python writes
    them (and a backslash doubled then, so that \\n reads one way); letters, spaces and
    joiners of any script are left as they are."""
    from pyhet.errors import brief
    for kept in ("é", "日本\u3000語", "a\xa0b", "x\u200dy", "soft\xadhy", "C:\\data"):
        assert brief(kept) == kept
    assert brief("no\nsuch\x1b[2J") == "no\\nsuch\\x1b[2J"
    assert brief("a\\nb\nc") == "a\\\\nb\\nc"
    assert brief("ab\u202ecd\u2028") == "ab\\u202ecd\\u2028"
