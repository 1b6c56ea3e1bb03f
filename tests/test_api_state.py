"""The Network's state through what can go wrong in a fit(): hyperparameters given as NumPy
scalars, flags given as other values, every device failing, Ctrl-C in a step's commit, training
that diverges, a fit that stops early, and copies. Each ends with the network's weights at a
whole step (checked against a run that did not go wrong), or with a clear error that leaves
them as they were."""

import copy
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

import pyhet
from pyhet import interrupt, model
from pyhet.errors import NoDeviceLeftError, TrainingError, UsageError

ARCH = "4C3-P2-8N"
SHAPE = (1, 8, 8)


def data(n=32, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *SHAPE)).astype(np.float32), rng.integers(0, 3, n)


def trained(steps, devices="cpu:1", **fit):
    """The weights after `steps` steps of a fit that nothing disturbed."""
    x, y = data()
    with pyhet.Network(ARCH, SHAPE, 3, devices=devices, seed=3) as net:
        net.fit(x, y, steps=steps, batch_size=8, **fit)
        return net.params()


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == np.float32, (k, got[k].dtype)
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# ------------------------------------------------------------------------------------------------
# Values of other types


@pytest.mark.parametrize("devices", ["cpu:1", "numpy"])
@pytest.mark.parametrize("kind", [np.float64, np.float32])
def test_numpy_scalar_hyperparameters_train_as_python_floats(devices, kind, tmp_path):
    """lr and weight_decay as NumPy scalars (np.logspace gives np.float64) train as the same
    Python floats do: float32 weights (np.float64 * a float32 array is float64 under NumPy 2),
    and checkpoints that can be written (JSON) and resumed."""
    lr, wd, mom = kind(0.05), kind(0.01), kind(0.0)
    want = trained(3, devices, lr=float(lr), weight_decay=float(wd), momentum=0.0)
    x, y = data()
    ck = tmp_path / "ck"
    with pyhet.Network(ARCH, SHAPE, 3, devices=devices, seed=3) as net:
        net.fit(x, y, steps=3, batch_size=8, lr=lr, weight_decay=wd, momentum=mom,
                checkpoint_dir=ck, checkpoint_every=1)
        assert_same(net.params(), want)
    # the checkpoint of step 3 is whole: a resume to step 3 has nothing left to train
    with pyhet.Network(ARCH, SHAPE, 3, devices=devices, seed=3) as net:
        s = net.fit(x, y, steps=3, batch_size=8, lr=lr, weight_decay=wd, momentum=mom,
                    checkpoint_dir=ck, resume=True)
        assert s["steps"] == 3
        assert_same(net.params(), want)


@pytest.mark.parametrize("flag", ["shuffle", "progress", "resume", "overwrite"])
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_flags_are_bools_not_values_read_as_one(flag, value, tmp_path):
    """overwrite="no" used to be read as True, and deleted another run's checkpoints."""
    x, y = data()
    ck = tmp_path / "ck"
    with pyhet.Network(ARCH, SHAPE, 3, devices="numpy", seed=3) as net:
        net.fit(x, y, steps=2, batch_size=8, checkpoint_dir=ck)
        before = sorted(p.name for p in ck.iterdir())
        with pytest.raises(UsageError, match=f"{flag} must be True or False, got {value!r}"):
            net.fit(x, y, steps=1, batch_size=8, checkpoint_dir=ck, **{flag: value})
    assert sorted(p.name for p in ck.iterdir()) == before
    with pyhet.Network(ARCH, SHAPE, 3, devices="numpy", seed=3) as net:
        net.fit(x, y, steps=1, batch_size=8, shuffle=np.bool_(False))    # NumPy's bool is one


# ------------------------------------------------------------------------------------------------
# Every device failing


def test_after_every_device_failed_the_next_call_starts_them_afresh(monkeypatch):
    """The network keeps the weights of the last whole step, and the next call starts its
    devices again (it used to fail with 'need at least one array to concatenate' until
    close())."""
    x, y = data()
    monkeypatch.setenv("PYHET_FAULT", "d0:forward:2")
    with pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1", seed=3) as net:
        with pytest.raises(NoDeviceLeftError, match="no device is left"):
            net.fit(x, y, steps=3, batch_size=8)
        assert net.partition is None                   # stopped
        monkeypatch.delenv("PYHET_FAULT")
        assert_same(net.params(), trained(1))           # step 1's weights
        probs = net.predict(x)
        assert probs.shape == (32, 3) and np.isfinite(probs).all()
        net.fit(x, y, steps=1, batch_size=8)
        assert net.partition == {"conv1": {"d0": 4}}


# ------------------------------------------------------------------------------------------------
# Ctrl-C in a step's commit


def test_ctrl_c_while_a_step_commits_leaves_every_layer_at_that_step(monkeypatch):
    """SIGINT that comes between the conv layers' commit and the fc layers' update (here from
    inside the update: a real signal to this process) is held until the whole step is made:
    every layer is at step 1, none left at step 0; and then it is a KeyboardInterrupt."""
    x, y = data()
    real = model.Head.update

    def update(self, cfg):
        sgd, calls = self.host.sgd_update, []

        def interrupted(*args):
            calls.append(1)
            if len(calls) == 2:                 # after fc1.weight, before fc1.bias
                os.kill(os.getpid(), signal.SIGINT)
            return sgd(*args)
        self.host.sgd_update = interrupted
        try:
            real(self, cfg)
        finally:
            self.host.sgd_update = sgd

    monkeypatch.setattr(model.Head, "update", update)
    with pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1", seed=3) as net:
        with pytest.raises(KeyboardInterrupt):
            net.fit(x, y, steps=3, batch_size=8)
        got = net.params()
    monkeypatch.setattr(model.Head, "update", real)
    assert_same(got, trained(1))


def pyhet_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("pyhet-")]


def test_ctrl_c_while_kernels_move_waits_for_the_move(monkeypatch):
    """SIGINT (a real one, sent from a device's worker while the balancer's move runs) is held
    until every device holds its new kernels and the layer records them: cut short, the
    devices held one partition and the layer another, and every later call failed."""
    x, y = data()
    with pyhet.Network("6C3-P2-8N", SHAPE, 3, devices="cpu:1,cpu:1", seed=3) as net:
        net.fit(x, y, steps=1, batch_size=8)
        conv = net._net.convs[0]
        c0, c1 = conv.counts
        want = [c0 - 1, c1 + 1] if c0 > 0 else [c0 + 1, c1 - 1]
        dev = conv.devices[1]
        real = dev.reshard

        def reshard(*args):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)                      # the main thread waits on this work
            return real(*args)
        monkeypatch.setattr(dev, "reshard", reshard)
        with pytest.raises(KeyboardInterrupt):
            conv.repartition(want)
        assert conv.counts == want
        assert [d._shards["conv1"].k for d in conv.devices] == want
        assert net.predict(x[:4]).shape == (4, 3)
        net.fit(x, y, steps=1, batch_size=8)


def test_ctrl_c_while_the_devices_stop_stops_them_all(monkeypatch):
    """SIGINT while close() stops the first device: every device is stopped, the network lets
    them go (it kept stopped devices: every call failed), and then it is a KeyboardInterrupt."""
    x, y = data()
    net = pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1,cpu:1", seed=3)
    net.fit(x, y, steps=1, batch_size=8)
    want = net.params()
    dev = net._devices[0]
    real = dev._release

    def release():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        real()
    monkeypatch.setattr(dev, "_release", release)
    with pytest.raises(KeyboardInterrupt):
        net.close()
    assert pyhet_threads() == []
    assert_same(net.params(), want)
    assert net.predict(x[:4]).shape == (4, 3)
    net.close()
    assert pyhet_threads() == []


def test_ctrl_c_outside_the_commit_is_not_held():
    """The hold is for the commit alone: SIGINT in a callback is a KeyboardInterrupt at once,
    and the handler is Python's again after fit()."""
    x, y = data()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seen = []

    def callback(info):
        seen.append(info["step"])
        os.kill(os.getpid(), signal.SIGINT)
        seen.append("after")                    # never reached

    with pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1", seed=3) as net:
        with pytest.raises(KeyboardInterrupt):
            net.fit(x, y, steps=3, batch_size=8, callback=callback)
        assert_same(net.params(), trained(1))
    assert seen == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ------------------------------------------------------------------------------------------------
# Divergence, an early stop, copies


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:1,cpu:1@0.5", "numpy"])
def test_a_fit_whose_weights_become_infinite_puts_back_the_weights(tmp_path, devices):
    """An update too large for float32 made weights infinite; the fit that did it puts back
    those it started with (on the devices as they are, also a fresh network's), which save."""
    x, y = data()
    with pyhet.Network(ARCH, SHAPE, 3, devices=devices, seed=3) as net:
        want = net.params()
        with pytest.raises(TrainingError, match="training diverged"):
            net.fit(x, y, steps=1, batch_size=8, lr=1e300)
        got = net.params()
        net.save(tmp_path / "w.npz")
        assert net.predict(x).shape == (len(x), 3)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("wd,momentum,blamed", [
    (1e10, 0.9, "--weight-decay"), (50.0, 0.0, "--weight-decay"), (1.0, 0.9, "--lr")])
def test_divergence_names_the_weight_decay_where_it_alone_grows_the_weights(
        wd, momentum, blamed):
    """w <- w - lr (m v + wd w) grows the weights by itself once lr x wd > 2 (1 + m)."""
    advice = model.divergence_advice(0.1, momentum, wd)
    assert advice.startswith("try a smaller " + blamed) or (
        blamed == "--weight-decay" and "try a smaller --weight-decay" in advice), advice
    if blamed == "--weight-decay":
        assert f"--lr x --weight-decay is {0.1 * wd:g}" in advice


def test_a_diverging_weight_decay_is_named_on_the_command_line(cli_process, tmp_path):
    x, y = data(37)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    res = cli_process("train", "--arch", ARCH, "--dataset", f"npz:{tmp_path / 'd.npz'}",
                      "--devices", "cpu:1", "--steps", "3", "--weight-decay", "1e10", "--quiet")
    assert res.code == 1 and "try a smaller --weight-decay (now 1e+10)" in res.err, res.err


@pytest.mark.parametrize("stop_at, then", [
    (2, [(2, 1), (2, 2)]),
    (1, [(2, 1), (2, 2)]),           # the first step of the run
    (5, [(3, 1), (3, 2)]),           # the first step of epoch 2
])
def test_a_fit_that_stopped_early_is_followed_by_the_next_epochs_order(stop_at, then):
    """A fit stopped by its callback has begun the epoch of its last step: the next fit trains
    the next epoch's order, not that epoch's batches again."""
    x, y = data()                    # 4 steps an epoch
    seen = []

    def stop(info):
        seen.append((info["epoch"], info["step"]))
        if info["step"] == stop_at:
            raise KeyboardInterrupt
    with pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1", seed=3) as net:
        with pytest.raises(KeyboardInterrupt):
            net.fit(x, y, epochs=2, batch_size=8, callback=stop)
        assert seen[-1] == ((stop_at - 1) // 4 + 1, stop_at)
        seen.clear()
        net.fit(x, y, steps=2, batch_size=8,
                callback=lambda i: seen.append((i["epoch"], i["step"])))
    assert seen == then


def test_ctrl_c_held_through_a_commit_counts_its_step(monkeypatch):
    """The step that Ctrl-C waited for is made: a later fit goes on after it (here the first of
    epoch 1: epoch 1 has begun, and the next fit trains epoch 2's order)."""
    x, y = data()
    real = model.Head.update
    calls = []

    def update(self, cfg):
        calls.append(1)
        if len(calls) == 1:                   # in step 1's commit
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, cfg)

    monkeypatch.setattr(model.Head, "update", update)
    seen = []
    with pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1", seed=3) as net:
        with pytest.raises(KeyboardInterrupt):
            net.fit(x, y, epochs=3, batch_size=8)
        net.fit(x, y, steps=1, batch_size=8, callback=lambda i: seen.append(i["epoch"]))
    assert seen == [2]


def test_a_sigint_as_the_hold_ends_is_not_lost(monkeypatch):
    """A SIGINT that comes while the hold puts Python's handler back is still a
    KeyboardInterrupt (the flag was read before the handler was back, and it was lost)."""
    def restoring(real, signum, handler):
        if handler is signal.default_int_handler:        # the hold ends
            os.kill(os.getpid(), signal.SIGINT)
        return real(signum, handler)

    _hold_once_with(monkeypatch, restoring, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _hold_once_with(monkeypatch, setting, error):
    """An empty hold, where signal.signal(s, h) is setting(the real one, s, h), ending in
    `error`; then the real signal.signal back."""
    real = signal.signal
    monkeypatch.setattr(signal, "signal", lambda s, h: setting(real, s, h))
    with pytest.raises(error):
        with interrupt.HeldSignals():
            pass
    monkeypatch.undo()


def test_the_hold_keeps_an_ignored_sigint_ignored_and_does_nothing_off_the_main_thread():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt.HeldSignals():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
    seen = []

    def off_main():
        with interrupt.HeldSignals():
            seen.append(signal.getsignal(signal.SIGINT))
    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_a_network_is_not_copied_but_says_how_to(how):
    """A copy shared the devices (closing it closed the original's); pickle failed on a lock."""
    x, _ = data()
    with pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1", seed=3) as net:
        net.predict(x)
        with pytest.raises(TypeError, match=r"cannot be copied or pickled: save\(\)"):
            how(net)
        assert net.predict(x).shape == (32, 3)


def test_a_datasets_test_labels_past_the_networks_classes_name_both(tmp_path):
    x, y = data(8)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=x[:4], y_test=np.array([0, 1, 2, 5]),
             num_classes=6)
    with pyhet.Network(ARCH, SHAPE, 3, devices="numpy") as net:
        with pytest.raises(pyhet.errors.PyhetError,
                           match=r"d.npz's test labels \(for a network of 3 classes\): "
                                 r"labels must be in 0..2"):
            net.evaluate(dataset=f"npz:{tmp_path / 'd.npz'}")


# ------------------------------------------------------------------------------------------------
# Messages in Python's words


def test_fits_messages_name_its_arguments_not_the_options(tmp_path):
    """What to change is said as fit's arguments (lr, resume=True, checkpoint_dir), where the
    command line says --lr, --resume, --checkpoint-dir; a run that diverges says so without
    NumPy's warnings, as the command line does."""
    import warnings

    x, y = data()
    ck = tmp_path / "ck"
    with pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1", seed=3) as net:
        net.fit(x, y, steps=2, batch_size=8, checkpoint_dir=ck, checkpoint_every=1)
        said = []
        for fit, kind in (
                (dict(resume=True), UsageError),                        # no checkpoint_dir
                (dict(keep=5), UsageError),                             # no checkpoint_dir
                (dict(checkpoint_dir=ck), UsageError),                  # another run's
                (dict(checkpoint_dir=ck, resume=True, lr=0.5), UsageError),  # another lr
                (dict(resume=True, overwrite=True, checkpoint_dir=ck), UsageError),
                (dict(lr=100.0, momentum=0.99, weight_decay=50.0), TrainingError)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with pytest.raises(kind) as e:
                    net.fit(x * 1e4, y, steps=5, batch_size=8, **fit)
            assert not [w for w in caught if "encountered" in str(w.message)], caught
            said.append(str(e.value))
    assert all("--" not in s for s in said), said
    assert said[0] == "resume=True needs checkpoint_dir"
    assert said[1] == "keep needs checkpoint_dir"
    assert "continue that run with resume=True" in said[2] and "overwrite=True" in said[2]
    assert "made with lr 0.01, but this run asks for 0.5" in said[3]
    assert said[4].startswith("overwrite=True deletes the checkpoints that resume=True")
    assert "try a smaller weight_decay (now 50) or lr (now 100)" in said[5], said[5]


def test_loading_a_file_of_an_earlier_version_asks_for_its_input_shape(tmp_path):
    """Such a file (conv1, conv2, fc, and no description) does not hold its input shape: the
    message says how to give it in Python (it said "must come from a dataset")."""
    with pyhet.Network("2C3-P2-3C3-P2", (1, 16, 16), 3, devices="numpy") as net:
        w = net.params()
    assert sorted(w) == ["conv1.bias", "conv1.weight", "conv2.bias", "conv2.weight", "fc.bias",
                         "fc.weight"]
    np.savez(tmp_path / "old.npz", **w)
    with pytest.raises(pyhet.errors.WeightsError, match=r"load\(path, input_shape=\(C, H, W\)"):
        pyhet.load(tmp_path / "old.npz", devices="numpy")
    assert pyhet.load(tmp_path / "old.npz", devices="numpy", input_shape=(1, 16, 16)).arch == \
        "2C3-P2-3C3-P2"


def test_a_non_finite_first_loss_leaves_the_weights_as_they_were(tmp_path):
    # finite weights whose outputs overflow: the step's NaN gradients were applied before the
    # loss was checked, so the network lost its weights (and could not be saved)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    y = np.arange(16) % 3
    w = pyhet.Network("4C3-P2-8N", (1, 8, 8), 3, devices="cpu:1").params()
    w["fc1.weight"] = np.sign(w["fc1.weight"]) * np.float32(3e38)
    with pyhet.Network("4C3-P2-8N", (1, 8, 8), 3, devices="cpu:1,cpu:1", weights=w) as net:
        with pytest.raises(TrainingError, match="before this run updated any weight"):
            net.fit(x, y, steps=2, batch_size=4)
        after = net.params()
        assert all(np.array_equal(after[k], w[k]) for k in w)
        net.save(tmp_path / "w.npz")


def test_a_fit_without_momentum_keeps_the_buffers_and_its_checkpoint_resumes(tmp_path, capsys):
    # the conv layers dropped their momentum buffers at momentum 0 and the fc layers kept
    # theirs, so the checkpoint held the fc layers' alone: resuming called it damaged and
    # started again from step 0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 16)
    with pyhet.Network("4C3-P2-8N", (1, 8, 8), 3, devices="cpu:1", seed=0) as net:
        net.fit(x, y, steps=2, batch_size=8, momentum=0.9)
        net.fit(x, y, steps=2, batch_size=8, momentum=0.0, checkpoint_dir=tmp_path)
        assert all(v[0] is not None for v in net._net.momentum().values())
        want = net.params()
    with pyhet.Network("4C3-P2-8N", (1, 8, 8), 3, devices="cpu:1", seed=0) as again:
        s = again.fit(x, y, steps=3, batch_size=8, momentum=0.0, checkpoint_dir=tmp_path,
                      resume=True)
        assert s["start_step"] == 2 and "damaged" not in capsys.readouterr().err
        # its first step after resuming started from the checkpoint's weights
        assert not all(np.array_equal(again.params()[k], want[k]) for k in want)


def test_the_hold_runs_other_handlers_when_its_block_raises():
    """Only a SIGINT is dropped with the block's error; a SIGUSR1 bookkeeping handler was
    dropped too."""
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with pytest.raises(ValueError):
            with interrupt.HeldSignals():
                os.kill(os.getpid(), signal.SIGUSR1)
                assert seen == []
                raise ValueError
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_handler_raising_as_the_hold_begins_leaves_none_held(monkeypatch):
    """A handler not yet held that raised while the others were taken over left those taken
    over for good: Ctrl-C noted and never raised."""
    class Timeout(Exception):
        pass
    mine = {s: (lambda *a: None) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    olds = {s: signal.signal(s, h) for s, h in mine.items()}
    raised = []

    def raising_at_usr2(real, signum, handler):
        if signum == signal.SIGUSR2 and not raised:
            raised.append(signum)
            raise Timeout      # as a SIGALRM handler raising at that moment would
        return real(signum, handler)
    try:
        _hold_once_with(monkeypatch, raising_at_usr2, Timeout)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGUSR1) is mine[signal.SIGUSR1]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        for s, h in olds.items():
            signal.signal(s, h)


def test_a_default_sigint_after_a_hold_cut_short_still_ends_the_process(tmp_path):
    """A handler that raised as the hold put the others back left SIGINT with the hold's: a
    later Ctrl-C, where the program had left SIGINT at its default action, must still end the
    process as that action does (by the signal), not be noted and dropped."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, signal, time
        from pyhet import interrupt

        class Timeout(Exception):
            pass

        def alarm(signum, frame):
            raise Timeout
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, alarm)
        real = signal.signal

        def putting_back(signum, handler):
            out = real(signum, handler)
            if handler is alarm:                 # SIGUSR1's handler back, SIGINT's not yet
                os.kill(os.getpid(), signal.SIGUSR1)
            return out
        signal.signal = putting_back
        try:
            with interrupt.HeldSignals():
                pass
        except Timeout:
            print("cut short", flush=True)
        signal.signal = real
        assert signal.getsignal(signal.SIGINT) not in (signal.SIG_DFL, None)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("still running", flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.stdout == "cut short\n", (p.stdout, p.stderr)
    assert p.returncode == -signal.SIGINT, (p.returncode, p.stderr)


def test_pyhets_warnings_point_at_the_programs_line(monkeypatch, tmp_path, capsys):
    """A warning said deep in pyhet named pyhet's own lines (train.py:364, train.py:375), so a
    program's filters by module and the once-per-line rule did not see its call; checkpoint
    notices went to stderr whatever progress said."""
    import warnings

    from pyhet import ops
    monkeypatch.setenv("PYHET_GEMM_STRASSEN", "false")
    monkeypatch.setattr(ops, "_strassen_env_told", False)
    x, y = data()
    cores = ops.default_threads()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pyhet.Network(ARCH, SHAPE, 3, devices=f"cpu:{cores},cpu:1", seed=3) as net:
            net.fit(x, y, steps=2, batch_size=8, checkpoint_dir=tmp_path, checkpoint_every=1,
                    keep=0)
    assert sorted(str(w.message)[:20] for w in said) == [
        "PYHET_GEMM_STRASSEN=", "the cpu devices use "], [str(w.message) for w in said]
    assert all(w.filename == __file__ and w.category is RuntimeWarning for w in said), [
        (w.filename, w.lineno) for w in said]
    # a damaged newest checkpoint, skipped: said as a warning, nothing on stderr
    newest = sorted(tmp_path.glob("checkpoint-*.npz"))[-1]
    newest.write_bytes(newest.read_bytes()[:200])
    monkeypatch.setenv("PYHET_GEMM_STRASSEN", "1")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pyhet.Network(ARCH, SHAPE, 3, devices="cpu:1", seed=3) as net:
            s = net.fit(x, y, steps=3, batch_size=8, checkpoint_dir=tmp_path, resume=True,
                        keep=0)
    assert s["start_step"] == 1
    [w] = said
    assert "is damaged" in str(w.message) and w.filename == __file__
    assert capsys.readouterr().err == ""


def test_a_warning_said_in_pyhet_imported_by_an_unnormalised_path_is_the_programs():
    """Frames of pyhet's files named by a path such as ..././pyhet/x.py were taken for the
    program's: the warning named them."""
    import warnings

    from pyhet import errors
    here = os.path.dirname(os.path.abspath(errors.__file__))
    code = compile("def deep():\n    warn('said deep in pyhet')\n",
                   os.path.join(os.path.dirname(here), os.curdir, os.path.basename(here),
                                "deep.py"), "exec")
    space = {"warn": errors.warn}
    exec(code, space)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        space["deep"]()
    [w] = said
    assert w.filename == __file__, w.filename
