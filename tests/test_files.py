"""What stands at a file's name: FIFOs, device nodes, folders and symbolic links where pyhet
reads or writes a file. Nothing is written through a link or over something that is not a
regular file, no input file is waited on, and every refusal is one line with its status.

x (N, C, H, W) images, y (N,) labels.
"""

import contextlib
import json
import os
import signal
import stat

import numpy as np
import pytest

import pyhet
from conftest import TINY
from pyhet import data
from pyhet.errors import DataError, PyhetError, UsageError, WeightsError
from pyhet.model import write_npz

ARCH = "3C3-P2-4C3-P2"
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


class Hung(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds=20):
    """Raise Hung where the block takes longer (a read that waits on a FIFO)."""
    def expire(signum, frame):
        raise Hung(f"still waiting after {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def make_node(path, kind):
    """A FIFO or a character device (as /dev/full) at path; skips where none can be made."""
    if kind == "fifo":
        os.mkfifo(path)
    else:
        if not IS_ROOT:
            pytest.skip("making a device node needs root")
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    return path


def is_kind(path, kind) -> bool:
    mode = os.lstat(path).st_mode
    return stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISCHR(mode)


WORDS = {"fifo": "a FIFO", "device": "a character device"}
KINDS = ["fifo", "device"]


def one_line(res, code, *words):
    assert res.code == code, (res.code, res.err)
    assert "Traceback" not in res.err
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert len(lines) == 1 and ": error: " in lines[0], res.err
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])
    return lines[0]


@pytest.fixture
def work(tmp_path, npz_dataset):
    """{"train": argv of a one-step run, "weights": a weight file, "images": an .npy}."""
    ds = npz_dataset(n=16)
    weights, images = tmp_path / "w.npz", tmp_path / "x.npy"
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="numpy") as net:
        net.save(weights)
    np.save(images, np.zeros((2, 1, 12, 12), np.float32))
    return {"train": ["train", "--dataset", f"npz:{ds}", *TINY, "--steps", "1", "--quiet"],
            "weights": weights, "images": images,
            "predict": ["predict", "--weights", weights, "--devices", "cpu:1"]}


def leftovers(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp") or ".npz.p" in n)


# ================================================================ writing: what is at the name

@pytest.mark.parametrize("kind", KINDS)
def test_save_refuses_a_fifo_or_device_before_training(cli, work, tmp_path, kind):
    node = make_node(tmp_path / "node", kind)
    res = cli(*work["train"], "--save", node)
    one_line(res, 2, "--save", WORDS[kind], "not a regular file")
    assert res.out == ""
    assert is_kind(node, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_predict_output_refuses_a_fifo_or_device(cli, work, tmp_path, kind):
    node = make_node(tmp_path / "node", kind)
    res = cli(*work["predict"], "--input", work["images"], "--output", node)
    one_line(res, 2, "--output", WORDS[kind])
    assert is_kind(node, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_network_save_and_write_npz_never_replace_a_fifo_or_device(tmp_path, kind):
    node = make_node(tmp_path / "node", kind)
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="numpy") as net:
        with pytest.raises(UsageError, match=WORDS[kind]):
            net.save(node)
    with pytest.raises(WeightsError, match=f"{WORDS[kind]}, not a regular file"):
        write_npz(node, {"a": np.zeros(2)})
    assert is_kind(node, kind)
    assert leftovers(tmp_path) == []


def test_a_link_at_the_temporary_name_is_removed_not_written_through(cli, work, tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("keep me\n")
    (tmp_path / ".y.npz.tmp").symlink_to(target)
    res = cli(*work["train"], "--save", tmp_path / "y.npz")
    assert res.code == 0, res.err
    assert target.read_text() == "keep me\n"
    assert stat.S_ISREG(os.lstat(tmp_path / "y.npz").st_mode)
    assert "conv1.weight" in np.load(tmp_path / "y.npz").files
    assert leftovers(tmp_path) == []


def test_a_save_that_is_a_link_is_replaced_and_its_target_kept(cli, work, tmp_path):
    target = tmp_path / "target.npz"
    target.write_bytes(b"earlier")
    (tmp_path / "y.npz").symlink_to(target)
    assert cli(*work["train"], "--save", tmp_path / "y.npz").code == 0
    assert target.read_bytes() == b"earlier"
    assert stat.S_ISREG(os.lstat(tmp_path / "y.npz").st_mode)


def test_a_lock_that_is_a_link_is_refused_and_its_target_kept(cli, work, tmp_path):
    folder, target = tmp_path / "ckpt", tmp_path / "user.txt"
    folder.mkdir()
    target.write_text("mine\n")
    (folder / ".lock").symlink_to(target)
    res = cli(*work["train"], "--checkpoint-dir", folder)
    one_line(res, 2, "--checkpoint-dir", ".lock", "a symbolic link", "not a regular file")
    assert target.read_text() == "mine\n"
    assert os.path.islink(folder / ".lock")


def test_a_lock_that_is_a_fifo_is_refused(cli, work, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.mkfifo(folder / ".lock")
    with deadline():
        res = cli(*work["train"], "--checkpoint-dir", folder)
    one_line(res, 2, "--checkpoint-dir", ".lock", "a FIFO")


def test_the_lock_of_a_running_checkpoint_folder_is_never_replaced(cli, work, tmp_path):
    """--save (or any write) onto the .lock of another run's checkpoint folder replaced it, and
    with it the flock that keeps the folder that run's: a second run could then open it."""
    from pyhet.checkpoint import CheckpointDir
    folder = tmp_path / "ckpt"
    with CheckpointDir(folder, {}) as held:
        lock = folder / ".lock"
        before = os.stat(lock)
        res = cli(*work["train"], "--save", lock)
        one_line(res, 2, "--save", "lock file of a checkpoint folder that a running pyhet holds")
        with pytest.raises(WeightsError, match="lock file of a checkpoint folder"):
            write_npz(lock, {"a": np.zeros(2, np.float32)})
        after = os.stat(lock)
        assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
        with pytest.raises(PyhetError, match="in use by another pyhet run"):
            CheckpointDir(folder, {})
        assert held._fd is not None
    # released: a file of that name is an ordinary destination again
    write_npz(folder / ".lock", {"a": np.zeros(2, np.float32)})
    (tmp_path / "other").mkdir()
    other = tmp_path / "other" / ".lock"
    other.write_text("not held\n")
    write_npz(other, {"a": np.zeros(2, np.float32)})


# ================================================================ --output onto an input

@pytest.mark.parametrize("which", ["weights", "images", "a link to the weights"])
def test_predict_output_is_never_its_weights_or_input(cli, work, tmp_path, which):
    out = work["images" if which == "images" else "weights"]
    if which.startswith("a link"):
        out = tmp_path / "link.npz"
        out.symlink_to(work["weights"])
    before = {k: work[k].read_bytes() for k in ("weights", "images")}
    res = cli(*work["predict"], "--input", work["images"], "--output", out)
    one_line(res, 2, "--output", "the same file as",
             "--input" if which == "images" else "--weights")
    assert {k: work[k].read_bytes() for k in ("weights", "images")} == before


# ================================================================ destinations that cannot be

def test_save_in_proc_is_refused_before_training(cli, work):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    res = cli(*work["train"], "--save", "/proc/pyhet-test.npz")
    one_line(res, 2, "--save", "/proc")
    assert res.out == ""


def test_save_whose_temporary_name_is_a_folder_is_refused_before_training(cli, work, tmp_path):
    (tmp_path / ".x.npz.tmp").mkdir()
    res = cli(*work["train"], "--save", tmp_path / "x.npz")
    one_line(res, 2, "--save", ".x.npz.tmp", "a folder", "move it away")
    assert res.out == ""
    assert (tmp_path / ".x.npz.tmp").is_dir()


def test_save_whose_temporary_name_is_too_long_is_refused_before_training(cli, work, tmp_path):
    name = "w" * 250 + ".npz"          # fits; .NAME.tmp does not (255 bytes at most)
    res = cli(*work["train"], "--save", tmp_path / name)
    one_line(res, 2, "--save", "cannot take a new file")
    assert res.out == ""
    assert leftovers(tmp_path) == []


def test_the_check_of_a_destination_leaves_nothing_behind(cli, work, tmp_path):
    (tmp_path / ".o.npz.tmp").write_bytes(b"a write cut short")
    res = cli(*work["predict"], "--input", work["images"], "--output", tmp_path / "o.npz")
    assert res.code == 0, res.err
    assert set(np.load(tmp_path / "o.npz").files) == {"classes", "probabilities"}
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("unnamed", [True, False], ids=["O_TMPFILE", "named"])
def test_the_folder_probe_leaves_nothing_even_when_interrupted(monkeypatch, tmp_path, unnamed):
    """The probe of a destination's folder is a file without a name where the file system
    makes one; else a named one, removed also when an interrupt comes between its making and
    its removal. Both refuse a folder that takes no file, and a name too long."""
    from pyhet import train as train_mod
    real_open, real_close = os.open, os.close
    made = []

    def no_unnamed(path, flags, *a):
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
            made.append("unnamed")
            if not unnamed:
                raise OSError(95, "Operation not supported")
        else:
            made.append(os.path.basename(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_unnamed)
    target = tmp_path / "w.npz"
    train_mod.check_file_destination(target, "--save")
    assert made[-1] == ("unnamed" if unnamed and hasattr(os, "O_TMPFILE") else
                        f".w.npz.p{os.getpid() % 100:02d}")
    assert leftovers(tmp_path) == []

    def interrupted(fd):
        real_close(fd)
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_mod.check_file_destination(target, "--save")
    monkeypatch.setattr(os, "close", real_close)
    assert leftovers(tmp_path) == []
    with pytest.raises(UsageError, match="cannot take a new file .File name too long"):
        train_mod.check_file_destination(tmp_path / ("w" * 250 + ".npz"), "--save")
    if unnamed and hasattr(os, "O_TMPFILE"):   # a read-only file system: said, not the fallback
        def read_only(path, flags, *a):
            raise OSError(30, "Read-only file system")
        monkeypatch.setattr(os, "open", read_only)
        with pytest.raises(UsageError, match=f"the folder {tmp_path} is not writable .Read-only"):
            train_mod.check_file_destination(target, "--save")
        monkeypatch.setattr(os, "open", no_unnamed)
    if not IS_ROOT:
        tmp_path.chmod(0o500)
        try:
            with pytest.raises(UsageError, match="is not writable"):
                train_mod.check_file_destination(target, "--save")
        finally:
            tmp_path.chmod(0o700)
    assert leftovers(tmp_path) == []


def test_a_destination_whose_whole_path_is_too_long_is_refused(tmp_path):
    """A folder whose path fits, and a temporary file's path that does not (the system's
    PATH_MAX): refused before the work, as a name too long is (a probe without a name, which
    has no path of its own, let it through to fail at the write)."""
    from pyhet import files, train as train_mod
    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    folder, want = str(tmp_path), limit - 38        # ASCII: a byte a character
    while len(folder) < want:
        folder = os.path.join(folder, "d" * min(200, want - len(folder) - 1))
    os.makedirs(folder)
    target = os.path.join(folder, "w" * 30 + ".npz")    # fits; .NAME.tmp beside it does not
    assert len(target) < limit <= len(files.temp_name(target))
    with pytest.raises(UsageError, match="cannot take a new file .File name too long"):
        train_mod.check_file_destination(target, "--save")
    assert leftovers(folder) == []


def test_a_destination_through_dot_dot_is_checked_where_the_system_goes(cli, work, tmp_path):
    """`a/..` is resolved by the system: through a link, to the folder above its target; past
    a folder that is not there, nowhere. os.path.abspath, working on the text, named another
    folder: the run trained and failed at its --save, or replaced a checkpoint."""
    (tmp_path / "deep" / "sub").mkdir(parents=True)
    (tmp_path / "lnk").symlink_to(tmp_path / "deep" / "sub")
    res = cli(*work["train"], "--save", f"{tmp_path}/nodir/../w.npz")
    one_line(res, 2, "--save", "nodir/..", "cannot be reached", "nodir does not exist")
    assert res.out == ""
    (tmp_path / "file").write_text("")
    res = cli(*work["train"], "--save", f"{tmp_path}/file/../w.npz")
    one_line(res, 2, "--save", "is a regular file, not a folder")
    # the checkpoint folder's own names, through the link: refused before training
    ck = tmp_path / "deep"
    res = cli(*work["train"], "--checkpoint-dir", ck, "--save",
              f"{tmp_path}/lnk/../checkpoint-000000001.npz")
    one_line(res, 2, "--save", "a name the files of --checkpoint-dir")
    res = cli(*work["train"], "--save", f"{tmp_path}/lnk/../out.npz")
    assert res.code == 0, res.err
    assert (ck / "out.npz").is_file() and not (tmp_path / "out.npz").exists()
    assert leftovers(ck) == [] and leftovers(tmp_path) == []


def test_a_bench_destination_through_dot_dot(tmp_path):
    """bench --json makes the folders it needs, as mkdir -p does (nodir/.. is made), but not
    through a file."""
    import importlib
    try:
        util = importlib.import_module("pyhet.bench._util")
    except ImportError:
        util = importlib.import_module("bench._util")
    (tmp_path / "file").write_text("")
    assert "file is a regular file, not a folder" in util.write_problem(
        f"{tmp_path}/file/../x.json", "--json")
    path = f"{tmp_path}/nodir/../x.json"
    assert util.write_problem(path, "--json") is None
    util.write_json(path, {"a": 1})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}


# ================================================================ reading: never waiting

def _input_argv(work, where, node):
    return {"--weights": ["predict", "--weights", node, "--devices", "cpu:1",
                          "--input", work["images"]],
            "--input": [*work["predict"], "--input", node],
            "--init": [*work["train"], "--init", node],
            "--dataset": [*work["train"], "--dataset", f"npz:{node}"],
            "evaluate": ["evaluate", "--weights", node, "--devices", "cpu:1"]}[where]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["--weights", "--input", "--init", "--dataset", "evaluate"])
def test_an_input_that_is_a_fifo_or_device_is_refused(cli, work, tmp_path, kind, where):
    node = make_node(tmp_path / "node", kind)
    with deadline():
        res = cli(*_input_argv(work, where, node))
    one_line(res, 1, str(node), f"not a regular file ({WORDS[kind]})")
    assert is_kind(node, kind)


def test_load_of_a_fifo_is_a_weights_error(tmp_path):
    os.mkfifo(tmp_path / "w.npz")
    with deadline(), pytest.raises(WeightsError, match=r"not a regular file \(a FIFO\)"):
        pyhet.load(tmp_path / "w.npz", devices="numpy")


@pytest.mark.parametrize("read", [lambda p: data.read_idx(p, data.IDX_IMAGES),
                                  data.read_cifar_bin, data.read_cifar_py],
                         ids=["idx", "cifar-bin", "cifar-py"])
def test_dataset_readers_refuse_a_fifo(tmp_path, read):
    from pathlib import Path
    os.mkfifo(tmp_path / "batch")
    with deadline(), pytest.raises(DataError, match=r"not a regular file \(a FIFO\)"):
        read(Path(tmp_path / "batch"))


def test_an_idx_file_that_is_a_fifo_is_named(tmp_path):
    os.mkfifo(tmp_path / "train-images-idx3-ubyte")
    with deadline(), pytest.raises(DataError, match="train-images-idx3-ubyte: a FIFO"):
        data.load_dataset("mnist", data_dir=tmp_path)


# ================================================================ JSON nested too deeply

@pytest.fixture
def deep_weights(work, tmp_path):
    arrays = dict(np.load(work["weights"]))
    arrays["arch"] = np.array("[" * 5000 + "]" * 5000)
    path = tmp_path / "deep.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_a_deeply_nested_arch_entry_is_one_line(cli, work, deep_weights, command):
    argv = [command, "--weights", deep_weights, "--devices", "cpu:1"]
    if command == "predict":
        argv += ["--input", work["images"]]
    one_line(cli(*argv), 1, "deep.npz", "'arch' entry", "not a network description")


def test_load_of_a_deeply_nested_arch_entry_is_a_weights_error(deep_weights):
    with pytest.raises(WeightsError, match="nested too deeply"):
        pyhet.load(deep_weights, devices="numpy")


# ================================================================ checkpoint folders

@pytest.mark.parametrize("name", ["checkpoint-000000005.npz", ".checkpoint-000000005.npz.tmp"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_named_like_a_checkpoint_is_refused(cli, work, tmp_path, name, overwrite):
    folder = tmp_path / "ckpt"
    (folder / name).mkdir(parents=True)
    res = cli(*work["train"], "--checkpoint-dir", folder, *(["--overwrite"] if overwrite else []))
    one_line(res, 2, "--checkpoint-dir", name, "a folder", "move it away")
    assert res.out == ""
    assert (folder / name).is_dir()


def test_a_fifo_named_like_a_checkpoint_is_refused(cli, work, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.mkfifo(folder / "checkpoint-000000005.npz")
    with deadline():
        res = cli(*work["train"], "--checkpoint-dir", folder, "--resume")
    one_line(res, 2, "checkpoint-000000005.npz", "a FIFO")


def test_a_checkpoint_folder_still_trains_and_resumes(cli, work, tmp_path):
    folder = tmp_path / "ckpt"
    assert cli(*work["train"], "--checkpoint-dir", folder).code == 0
    res = cli(*work["train"][:-3], "--steps", "2", "--quiet", "--checkpoint-dir", folder,
              "--resume", "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out)
    assert stat.S_ISREG(os.lstat(folder / ".lock").st_mode)
