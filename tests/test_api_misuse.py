"""The Python API misused: bad argument values refused as UsageError naming the argument (never
a bare Python exception, never a file that load() refuses), a refused fit() that leaves the
network as it was, raw pixels prepared as the training images were after a fit on an npz file
of them, no NumPy warnings from a run that diverges, and later fits after a device failed.

x (N, C, H, W) images, y (N,) labels, M classes.
"""

import os
import re
import warnings

import numpy as np
import pytest

import pyhet
from pyhet.errors import DeviceError, TrainingError, UsageError
from pyhet.images import Normalization

ARCH, SHAPE, M = "4C3-P2-8N", (1, 8, 8), 3


def arrays(n=16, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    if dtype == np.uint8:
        x = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
    else:
        x = rng.standard_normal((n, *SHAPE)).astype(np.float32)
    return x, np.arange(n) % M


def network(**kwargs):
    kwargs.setdefault("devices", "cpu:1")
    return pyhet.Network(ARCH, SHAPE, M, **kwargs)


class FsPath(os.PathLike):
    """An os.PathLike whose __fspath__ gives whatever it was made with."""

    def __init__(self, value):
        self.value = value

    def __fspath__(self):
        return self.value


# ================================================================ normalization=

def test_a_normalization_load_would_refuse_is_refused_at_construction(tmp_path):
    """Network(normalization=) takes what a weight file may record (finite numbers, scales >
    0): anything else was taken, and save() then wrote a file load() refused, or predict()
    and save() raised a bare ValueError (and a scale that is no sequence, a TypeError)."""
    bad = [(Normalization((-1.0,), (0.0,)), ["scale must be > 0", "-1.0"]),
           (Normalization((0.0,), (0.0,)), ["scale must be > 0"]),
           (Normalization((float("nan"),), (0.0,)), ["scale must be finite", "nan"]),
           (Normalization((float("inf"),), (0.0,)), ["scale must be finite"]),
           (Normalization((1e39,), (0.0,)),                                 # past float32
            ["scale must be finite in float32 (at most 3.4e38 in size), got [1e+39]"]),
           (Normalization((1e-300,), (0.0,)),                               # 0 in float32
            ["scale must be > 0 in float32 (which holds less than 7e-46 as 0), got [1e-300]"]),
           (Normalization((0.5,), (float("nan"),)), ["shift must be finite"]),
           (Normalization((2**1024,), (0.0,)), ["scale must be finite numbers"]),
           (Normalization(("a",), (0.0,)), ["scale must be numbers", "'a'"]),
           (Normalization((True,), (0.0,)), ["scale must be numbers"]),
           (Normalization(1, 2), ["scale must be a tuple of numbers", "got 1"]),
           (Normalization(np.ones((1, 1)), (0.0,)), ["scale must be a tuple of numbers"])]
    for norm, words in bad:
        with pytest.raises(UsageError) as e:
            network(normalization=norm)
        for word in ["normalization", *words]:
            assert word in str(e.value), (norm, word, str(e.value))
    # NumPy's numbers are numbers: taken, saved and loaded back
    norm = Normalization(np.array([2 / 255], np.float32), (np.float32(-1.0),))
    with network(normalization=norm) as net:
        net.save(tmp_path / "w.npz")
    with pyhet.load(tmp_path / "w.npz", devices="cpu:1") as back:
        assert back.normalization == Normalization((float(np.float32(2 / 255)),), (-1.0,))


# ================================================================ a refused fit(dataset=)

def test_a_refused_fit_on_a_dataset_leaves_the_network_as_it_was(tmp_path):
    """fit(dataset=) set the dataset's normalization and class names before the checkpoint
    folder was opened: refused there (another run's folder), it left the network preparing
    raw pixels with the dataset's statistics and carrying its class names into save()."""
    xu = np.random.default_rng(0).integers(0, 256, (16, 1, 28, 28), dtype=np.uint8)
    yu = np.arange(16) % 10
    with pyhet.Network("4C5-P2", (1, 28, 28), 10, devices="cpu:1", seed=5) as other:
        other.fit(xu, yu, steps=1, batch_size=8, checkpoint_dir=tmp_path / "ck")
    with pyhet.Network("4C5-P2", (1, 28, 28), 10, devices="cpu:1") as net:
        net.fit(xu, yu, steps=1, batch_size=8)               # trained on uint8 / 255
        before = net.predict(xu[:4])
        with pytest.raises(UsageError, match="holds the checkpoints of another run"):
            net.fit(dataset="bundled", steps=1, checkpoint_dir=tmp_path / "ck")
        assert net.normalization is None and net.classes is None
        np.testing.assert_array_equal(net.predict(xu[:4]), before)
        # a fit that made a step is no refusal: the network is the dataset's from then on
        with pytest.raises(ZeroDivisionError):
            net.fit(dataset="bundled", steps=2, batch_size=8, callback=lambda info: 1 / 0)
        bundled = pyhet.load_dataset("bundled")
        assert net.normalization == bundled.normalization
        assert net.classes == bundled.classes


# ================================================================ x_test, y_test with dataset=

def test_fit_on_a_dataset_refuses_test_labels_without_test_images(tmp_path):
    """With dataset=, a y_test without x_test was dropped without a word (the arrays path
    refuses it); x_test without y_test is refused as well."""
    x, y = arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    with network() as net:
        with pytest.raises(UsageError, match="x_test and y_test go together"):
            net.fit(dataset=f"npz:{tmp_path / 'd.npz'}", y_test=y[:4], steps=1)
        with pytest.raises(UsageError, match="x_test and y_test go together"):
            net.fit(dataset=f"npz:{tmp_path / 'd.npz'}", x_test=x[:4], steps=1)


# ================================================================ an npz file of uint8 pixels

def test_after_a_fit_on_npz_pixels_raw_images_are_prepared_as_in_training(tmp_path):
    """Trained on an npz file of uint8 pixels (prepared / 255), the network kept the
    normalization it had: evaluate, predict and the saved file then prepared the same pixels
    otherwise than training did. It records / 255 (None), as `pyhet train` does."""
    xu, y = arrays(n=32, dtype=np.uint8)
    path = tmp_path / "u8.npz"
    np.savez(path, x=xu, y=y, x_test=xu[:16], y_test=y[:16])
    with network(normalization=Normalization((2 / 255,), (-1.0,))) as net:
        # uint8 x_test given with dataset= is prepared as the dataset's images are
        s = net.fit(dataset=f"npz:{path}", steps=3, batch_size=8, x_test=xu[16:],
                    y_test=y[16:])
        assert net.normalization is None
        assert s["test_loss"] == pytest.approx(net.evaluate(xu[16:], y[16:])["loss"],
                                               rel=1e-6)
        s = net.fit(dataset=f"npz:{path}", steps=1, batch_size=8)
        by_file = net.evaluate(dataset=f"npz:{path}")
        assert by_file["loss"] == pytest.approx(s["test_loss"], rel=1e-6)
        assert net.evaluate(xu[:16], y[:16]) == by_file
        np.testing.assert_array_equal(
            net.predict(xu[:16]), net.predict(xu[:16].astype(np.float32) / np.float32(255)))
        net.save(tmp_path / "w.npz")
    with pyhet.load(tmp_path / "w.npz", devices="cpu:1") as back:
        assert back.normalization is None


# ================================================================ lr, momentum, weight_decay

@pytest.mark.parametrize("name,value", [("lr", 2**1024), ("momentum", 10**400),
                                        ("weight_decay", 2**1024)],
                         ids=["lr", "momentum", "weight_decay"])
def test_hyperparameters_past_floats_range_are_usage_errors(name, value):
    """A Python int float() cannot take raised a bare OverflowError."""
    x, y = arrays()
    with network() as net:
        with pytest.raises(UsageError) as e:
            net.fit(x, y, steps=1, **{name: value})
    assert str(e.value).startswith(f"{name} must be a ") and "got 1" in str(e.value)


def test_an_lr_that_float32_holds_as_0_is_a_usage_error(cli):
    """An lr float32 (the weights' type) rounds to 0 trained nothing and said nothing; the
    smallest one it holds is taken."""
    x, y = arrays()
    with network() as net:
        with pytest.raises(UsageError, match=r"lr must be a number that float32, the weights' "
                                             r"type, holds as > 0 \(at least 1.4e-45\), got "
                                             r"1e-320"):
            net.fit(x, y, steps=1, lr=1e-320)
        net.fit(x, y, steps=1, lr=1.5e-45)     # float32's 1.4e-45
    r = cli("train", "--lr", "1e-320", "--steps", "1")
    assert r.code == 2 and "argument --lr: a number that float32" in r.err, r.err


# ================================================================ paths

@pytest.mark.parametrize("path,words", [
    ("w\0.npz", ["without NUL", "'w\\x00.npz'"]),
    (FsPath(b"w.npz"), ["FsPath", "whose __fspath__ gives b'w.npz'"]),
    (FsPath(5), ["FsPath", "to return str or bytes, not int"]),
], ids=["NUL", "bytes", "int"])
def test_path_arguments_that_name_no_file_are_usage_errors(path, words, tmp_path, monkeypatch):
    """A NUL in a path, or an os.PathLike giving bytes or no path at all, raised a bare
    ValueError or TypeError (load of one giving bytes: 'no such file' of a file that is
    there); a refused checkpoint_dir left its folder made."""
    monkeypatch.chdir(tmp_path)
    x, y = arrays()
    with network() as net:
        net.save("w.npz")
        for call, name in [(lambda: net.save(path), "save"),
                           (lambda: pyhet.load(path, devices="cpu:1"), "load"),
                           (lambda: net.fit(x, y, steps=1, checkpoint_dir=path),
                            "checkpoint_dir")]:
            with pytest.raises(UsageError) as e:
                call()
            for word in [name, *words]:
                assert word in str(e.value), (name, word, str(e.value))
        with pytest.raises(UsageError):
            net.fit(x, y, steps=1, checkpoint_dir=FsPath(b"ck"))
    assert sorted(os.listdir(tmp_path)) == ["w.npz"]        # no folder "ck" made


# ================================================================ NumPy's warnings

@pytest.mark.parametrize("devices,momentum", [("numpy", 0.9), ("cpu:1", 0.0)])
def test_a_diverging_fit_raises_no_numpy_warnings(devices, momentum):
    """README: a run that diverges raises TrainingError without NumPy's warnings. The master's
    NumPy code (with --devices numpy its fc layers and their update, and the update without
    momentum on any devices) ran on the calling thread, where nothing turned them off. The
    callback still runs under the caller's own settings."""
    x, y = arrays()
    seen = []
    with network(devices=devices) as net, warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with pytest.raises(TrainingError, match="diverged"):
            net.fit(x, y, steps=3, batch_size=4, lr=1e308, momentum=momentum,
                    callback=lambda info: seen.append(np.geterr()))
    assert [str(w.message) for w in ws] == []
    assert seen and all(s == np.geterr() for s in seen), (seen, np.geterr())


def test_the_numpy_backend_computes_without_numpy_warnings():
    """As the master's backend it runs on the calling thread, not on a device's worker (whose
    warnings are off): an overflow in its fc layer or update raised NumPy's warning there."""
    from pyhet.backends.numpy_ref import NumpyBackend
    from pyhet.optim import SGDConfig

    big = np.full((2, 3), 3e38, np.float32)
    backend = NumpyBackend()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        y = backend.linear_forward(big, big, np.zeros(2, np.float32))
        p = big.copy()
        backend.sgd_update(p, big, None, SGDConfig(1e308, 0.0, 0.0))   # in place
    assert [str(w.message) for w in ws] == []
    assert not np.isfinite(y).any() and not np.isfinite(p).any()


# ================================================================ after a device failed

def test_fits_after_a_device_failed_train_on_the_others(monkeypatch):
    """After d0 failed in a fit and training went on on d1, every later fit with the dynamic
    balance failed ("a partition ... (none for the failed ones ...) is needed"): its new
    balancer, made from the calibration, gave d0 kernels again."""
    monkeypatch.setenv("PYHET_FAULT", "d0:update:2")
    x, y = arrays()
    with network(devices="cpu:1,cpu:1", balance="dynamic") as net:
        with pytest.warns(RuntimeWarning, match="device d0 .* failed during conv1 update"):
            s = net.fit(x, y, steps=4, batch_size=4)
        assert [f["device"] for f in s["failures"]] == ["d0"]
        for _ in range(2):
            try:
                s = net.fit(x, y, steps=8, batch_size=4)
            except DeviceError as e:
                pytest.fail(f"a later fit failed: {e}")
            assert np.isfinite(s["train_loss"]) and s["failures"] == []
            assert s["partition"] == {"conv1": {"d0": 0, "d1": 4}}


# ================================================================ found by a second round

def test_a_tilde_in_save_load_and_checkpoint_dir_is_the_home_folder(tmp_path, monkeypatch):
    # checkpoint_dir="~/ck" made a folder named ~ where the program ran
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    x, y = arrays()
    with network() as net:
        net.fit(x, y, steps=1, batch_size=8, checkpoint_dir="~/ck")
        net.save("~/w.npz")
    assert (home / "ck").is_dir() and (home / "w.npz").is_file() and not os.listdir(work)
    with pyhet.load("~/w.npz", devices="cpu:1") as back:
        assert back.arch == ARCH


def test_a_fit_that_diverges_puts_back_the_network_it_started_with(tmp_path):
    """Its weights stayed finite (a step whose loss is not finite makes no update) but so large
    that every output overflowed: predict failed, every later fit diverged at its first step,
    and save refused. The fit now puts back the weights, momentum and data order it started
    from: the network goes on as if the call had not been made."""
    x, y = arrays()
    kw = dict(steps=3, batch_size=4, lr=0.05)
    with network() as ref:
        ref.fit(x, y, **kw)
        ref.fit(x, y, **kw)
        want = ref.params()
    with network() as net:
        net.fit(x, y, **kw)
        with pytest.raises(TrainingError, match="diverged.*as it was before this fit"):
            net.fit(x, y, steps=4, batch_size=4, lr=1e30, checkpoint_dir=tmp_path / "ck")
        assert os.listdir(tmp_path / "ck")          # the checkpoints it wrote stay
        net.fit(x, y, **kw)                         # momentum and data order as before
        got = net.params()
        net.save(tmp_path / "w.npz")
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    before = network().params()
    before["fc.weight"] = np.sign(before["fc.weight"]) * np.float32(3e38)
    with network(weights=before) as fresh:
        # diverging before its first update changes nothing: saved as it was
        with pytest.raises(TrainingError, match="before this run updated any weight"):
            fresh.fit(x, y, steps=2, batch_size=4)
        fresh.save(tmp_path / "w.npz")
    with pyhet.load(tmp_path / "w.npz", devices="cpu:1") as back:
        assert all(np.array_equal(back.params()[k], before[k]) for k in before)


def test_a_fit_whose_outputs_all_overflow_at_its_end_diverged():
    """Without a test split, a fit whose last update made the weights so large (and finite)
    that every output overflows ended well; predict failed, and every later fit diverged at its
    first step and was put back to those weights. It is a TrainingError, and put back."""
    x, y = arrays()
    with network() as net:
        want = net.params()
        with pytest.raises(TrainingError, match="training images is nan.*put back"):
            net.fit(x, y, steps=1, batch_size=8, lr=1e20)
        for k in want:
            np.testing.assert_array_equal(net.params()[k], want[k], err_msg=k)
        net.fit(x, y, steps=2, batch_size=8, lr=0.01)
        assert np.isfinite(net.predict(x[:4])).all()


def test_a_diverging_fit_that_could_not_read_the_weights_first_says_nothing_of_them(
        monkeypatch):
    """Where the weights could not be read before the fit (a device that failed since), the
    error does not claim that they were put back."""
    from pyhet import model
    x, y = arrays()
    with network() as net:
        net.fit(x, y, steps=2, batch_size=4, lr=0.05)
        real, calls = model.Net.state, []

        def state(self):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a device that failed")
            return real(self)
        monkeypatch.setattr(model.Net, "state", state)
        with pytest.raises(TrainingError, match="diverged") as e:
            net.fit(x, y, steps=4, batch_size=4, lr=1e30)
        assert "put back" not in str(e.value)


def test_a_put_back_that_fails_on_the_devices_keeps_the_weights_and_stops_them(monkeypatch):
    """Where the devices fail while the weights are put back, the network keeps the weights it
    started from, its devices stopped (the next call starts them afresh)."""
    from pyhet import model
    x, y = arrays()
    with network(devices="cpu:1,cpu:1") as net:
        net.fit(x, y, steps=2, batch_size=4, lr=0.05)
        want = net.params()

        def broken(self, params, moms):
            raise RuntimeError("a device that failed")
        monkeypatch.setattr(model.Net, "set_state", broken)
        with pytest.raises(TrainingError, match="put back"):
            net.fit(x, y, steps=4, batch_size=4, lr=1e30)
        assert net._net is None and net._devices == []
        got = net.params()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        monkeypatch.undo()
        assert np.isfinite(net.predict(x[:4])).all()


def test_a_callback_that_raises_leaves_its_steps_checkpoint(tmp_path):
    # the callback ran before the step's checkpoint was written: the folder stayed a step
    # behind the network, and resuming redid that step
    x, y = arrays()

    def stop_at_3(info):
        if info["step"] == 3:
            raise RuntimeError("stop")
    with network() as net:
        with pytest.raises(RuntimeError, match="stop"):
            net.fit(x, y, steps=6, batch_size=4, checkpoint_dir=tmp_path,
                    checkpoint_every=1, callback=stop_at_3)
    assert (tmp_path / "checkpoint-000000003.npz").is_file()


def test_masked_images_or_labels_are_refused():
    """np.asarray drops a mask: a masked label of 5 (of 3 classes) or a masked pixel would be
    used as it is."""
    from pyhet.errors import DataError
    net = pyhet.Network("4C5-P2", input_shape=(1, 12, 12), num_classes=3, devices="cpu:1")
    x = np.zeros((2, 1, 12, 12), np.float32)
    with pytest.raises(DataError, match=r"x: a masked array.*x.filled\(value\)"):
        net.predict(np.ma.masked_array(x))
    with pytest.raises(DataError, match=r"y: a masked array"):
        net.fit(x, np.ma.masked_array([0, 5], mask=[0, 1]), steps=1, batch_size=2)
    with pytest.raises(DataError, match=r"x: a masked array"):
        net.evaluate(np.ma.masked_array(x), np.array([0, 1]))


def test_images_with_nan_name_the_first_one():
    from pyhet.errors import DataError
    net = pyhet.Network("4C5-P2", input_shape=(1, 12, 12), num_classes=3, devices="cpu:1")
    x = np.zeros((10, 1, 12, 12), np.float32)
    x[7, 0, 3, 3] = np.inf
    x[5, 0, 1, 2] = np.nan
    for call in (lambda: net.predict(x, batch_size=4),
                 lambda: net.evaluate(x, np.zeros(10, int), batch_size=3)):
        with pytest.raises(DataError, match=r"^x: holds NaN or infinite values \(image 5 is "
                                            r"the first\)$"):
            call()


def test_predict_holds_one_batch_of_prepared_images_not_all(tmp_path):
    """uint8 images were converted to float32 all at once (and again for / 255): 200,000 small
    images on disk (29 MB) took 230 MB more, and under a limit a bare NumPy MemoryError."""
    import subprocess
    import sys
    np.save(tmp_path / "x.npy", np.zeros((200_000, 1, 12, 12), np.uint8))
    code = ("import resource, sys\nimport numpy as np, pyhet\n"
            "net = pyhet.Network('4C3-P2-8C3-P2', input_shape=(1, 12, 12), num_classes=3,\n"
            "                    devices='cpu:1')\n"
            "net.predict(np.zeros((16, 1, 12, 12), np.float32), batch_size=16)\n"
            "x = np.load(sys.argv[1], mmap_mode='r')\n"
            "vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize')][0]"
            ".split()[1]) * 1024\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + 100 * 2**20, resource.RLIM_INFINITY))\n"
            "p = net.predict(x, batch_size=16)\n"
            "e = net.evaluate(x, np.zeros(len(x), np.int64), batch_size=16)\n"
            "print(p.shape, e['images'])\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.npy")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == "(200000, 3) 200000\n", (p.stdout,
                                                                     p.stderr[-2000:])


def test_a_removed_working_folder_is_said_not_a_bare_error(tmp_path, monkeypatch, capsys):
    """os.path.abspath of a relative name raised a bare FileNotFoundError naming no path."""
    from pyhet.cli import main
    net = pyhet.Network("4C5-P2", input_shape=(1, 12, 12), num_classes=3, devices="cpu:1")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    for call in (lambda: net.save("w.npz"), lambda: pyhet.load("w.npz")):
        with pytest.raises(UsageError, match=r"'w.npz': a relative path, but the working "
                                             r"folder no longer exists .*give a full path"):
            call()
    net.save(tmp_path / "w.npz")             # a full path still works
    assert pyhet.load(tmp_path / "w.npz").params().keys() == net.params().keys()
    assert main(["train", "--steps", "1", "--save", "w.npz"]) == 1
    assert capsys.readouterr().err == ("pyhet: error: the working folder no longer exists (it "
                                       "was removed after this process started in it): cd to "
                                       "a folder that exists\n")


@pytest.mark.parametrize("how", ["removed", "made again", "the working folder"])
def test_a_folder_removed_while_its_file_is_written_is_said(tmp_path, monkeypatch, how):
    """It was said to be another write of the same file taking the temporary file."""
    import shutil
    from pyhet import model
    from pyhet.errors import WeightsError
    net = pyhet.Network("4C5-P2", input_shape=(1, 12, 12), num_classes=3, devices="cpu:1")
    folder = tmp_path / "d"
    folder.mkdir()
    real = model._savez

    def and_remove(fh, arrays, name):
        real(fh, arrays, name)
        shutil.rmtree(folder)
        if how == "made again":
            folder.mkdir()
    monkeypatch.setattr(model, "_savez", and_remove)
    if how == "the working folder":
        monkeypatch.chdir(folder)
    with pytest.raises(WeightsError, match=r"cannot write .*w.npz: its folder was removed "
                                           r"while it was written$"):
        net.save("w.npz" if how == "the working folder" else folder / "w.npz")


def test_an_os_error_behind_a_file_error_is_its_cause(tmp_path):
    """A program can read the OSError's errno behind a weight file that cannot be written (it
    was cut off: raise ... from None)."""
    import errno

    import resource
    import signal

    x, y = arrays()
    with network() as net:
        net.fit(x, y, steps=1, batch_size=8)
        old = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ,
                                                                        signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (400, old[0][1]))     # the file too large
        try:
            with pytest.raises(pyhet.errors.WeightsError, match="File too large") as e:
                net.save(tmp_path / "w.npz")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old[0])
            signal.signal(signal.SIGXFSZ, old[1])
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EFBIG


def test_labels_changed_by_the_program_during_a_fit_are_not_read():
    """fit checks the labels once and trains on a copy: a label the callback (or another
    thread) sets to -1 or M afterwards trained as the last class, or raised a bare
    IndexError."""
    x, y = arrays(12)
    with network(seed=1) as net:
        net.fit(x, y.copy(), steps=4, batch_size=4, lr=0.05, shuffle=False)
        want = net.params()
    for bad in (-1, M):
        labels = y.copy()

        def spoil(info, labels=labels, bad=bad):
            labels[:] = bad

        with network(seed=1) as net:
            net.fit(x, labels, steps=4, batch_size=4, lr=0.05, shuffle=False, callback=spoil)
            got = net.params()
        assert (labels == bad).all()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_later_fit_that_diverges_counts_its_steps_and_the_networks_epochs_apart():
    """A later fit's steps count from its start, its epochs from the network's earlier fits
    (the next epoch's data order): the message said "step 3 (epoch 4, ...)" in a one-epoch
    fit."""
    x, y = arrays(12)
    with network(seed=2) as net:
        net.fit(x, y, epochs=1, batch_size=4)
        with pytest.raises(TrainingError) as e:
            net.fit(x, y, steps=12, batch_size=4, lr=1e20)
    m = re.search(r"at step (\d+) of this fit \(epoch (\d+) of the network's fits, batch "
                  r"(\d+)\)", str(e.value))
    assert m, str(e.value)
    step, epoch, batch = (int(v) for v in m.groups())
    assert epoch == 2 + (step - 1) // 3 and batch == 1 + (step - 1) % 3, str(e.value)


@pytest.mark.parametrize("steps", [1, 6])
def test_a_fit_that_diverges_on_huge_images_says_to_scale_them_first(steps):
    """Finite images of 1e30 overflow the outputs whatever the lr: the message said only "try
    a smaller lr". Images of order 1 that diverge at a huge lr keep that advice alone."""
    x, y = arrays(12)
    x = np.clip(x, -3, 3)
    x[0, 0, 0, 0] = 3.0
    with network(seed=2) as net:
        with pytest.raises(TrainingError) as e:
            net.fit(x * np.float32(1e30), y, steps=steps, batch_size=4)
    assert ("the images are far from order 1, as networks expect them (their largest "
            "magnitude is 3e+30): scale them; then, if it still diverges, try a smaller lr "
            "(now 0.01)") in str(e.value), str(e.value)
    with network(seed=2) as net:
        with pytest.raises(TrainingError) as e:
            net.fit(x, y, steps=12, batch_size=4, lr=1e20)
    assert "try a smaller lr (now 1e+20)" in str(e.value) and "scale" not in str(e.value)


@pytest.mark.parametrize("seed,words", [
    (2**64, "2**64 - 1, got 18446744073709551616"),
    (10**5000, "got a whole number of about 5,000 digits"),     # Python writes no such int
], ids=["2**64", "10**5000"])
def test_a_seed_past_what_a_checkpoint_records_is_a_usage_error(seed, words):
    """A seed is recorded in a checkpoint's settings: one beyond 2**64 - 1 is refused (one of
    5,000 digits was a bare ValueError with Python's advice on its own limits)."""
    with pytest.raises(UsageError, match=re.escape(words)):
        pyhet.load_dataset("synthetic", seed=seed)
    with pytest.raises(UsageError, match=re.escape(words)):
        network(seed=seed)
    pyhet.load_dataset("synthetic", seed=2**64 - 1)
