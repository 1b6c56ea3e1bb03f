"""Checkpoints that survive crashes and belong to one run: a write killed halfway, a damaged
newest checkpoint, a folder of another run or in use by another process, settings that differ
on --resume, the devices' plan kept, --checkpoint-every and --keep, SIGINT and SIGTERM, the
destinations checked before training, and --deterministic.

Every run trains the tiny network of conftest.TINY on a tiny npz dataset; the runs that must be
killed or signalled are processes (python -m pyhet) in a scratch folder.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import TINY, load_npz

PARAMS = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias")
COMMON = ["--lr", "0.05", "--momentum", "0.9", "--weight-decay", "0.001", "--seed", "3"]


def train_argv(data, *extra, devices="cpu:1"):
    argv = ["train", "--dataset", f"npz:{data}", *TINY, "--quiet", *COMMON, *extra]
    argv[argv.index("--devices") + 1] = devices
    return argv


def assert_bit_identical(a, b):
    for k in PARAMS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def checkpoints(folder):
    return sorted(p.name for p in folder.glob("checkpoint-*.npz"))


def meta_of(path):
    return json.loads(str(load_npz(path)["meta"]))


def one_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def pyhet_process(tmp_path):
    """start(*argv, env=None) -> Popen of `python -m pyhet argv...` in a scratch folder; every
    process started is killed (if still running) and reaped after the test."""
    workdir = tmp_path / "cwd"
    workdir.mkdir(exist_ok=True)
    started = []

    def start(*argv, env=None):
        full = dict(os.environ)
        full.pop("PYTHONPATH", None)
        full.update(env or {})
        p = subprocess.Popen([sys.executable, "-m", "pyhet", *[str(a) for a in argv]],
                             cwd=workdir, env=full, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def wait_for(predicate, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ================================================================ a write killed halfway

@pytest.mark.parametrize("devices,extra", [
    ("cpu:1", []),
    ("cpu:1,cpu:1", ["--deterministic", "--balance", "dynamic"]),
])
def test_kill_9_during_a_checkpoint_write_resumes_bit_identical(
        cli, npz_dataset, tmp_path, pyhet_process, devices, extra):
    """SIGKILL while the checkpoint of step 4 is half written: the half file is not taken for a
    checkpoint, --resume goes on from step 2 and ends with the weights of an uninterrupted
    run, bit for bit."""
    data = npz_dataset(n=40)                    # 5 batches of 8 per epoch
    res = cli(*train_argv(data, "--steps", "7", "--save", tmp_path / "whole.npz", *extra,
                          devices=devices))
    assert res.code == 0, res.err

    ck = tmp_path / "ck"
    p = pyhet_process(*train_argv(data, "--steps", "7", "--checkpoint-dir", ck,
                                  "--checkpoint-every", "2", *extra, devices=devices),
                      env={"PYHET_TEST_STALL_WRITE": "checkpoint-000000004.npz"})
    tmp = ck / ".checkpoint-000000004.npz.tmp"
    wait_for(lambda: tmp.exists() and tmp.stat().st_size > 0, "the half-written checkpoint")
    p.kill()
    p.communicate(timeout=30)
    assert checkpoints(ck) == ["checkpoint-000000002.npz"]
    assert tmp.exists()                         # what the kill left behind

    res = cli(*train_argv(data, "--steps", "7", "--checkpoint-dir", ck, "--resume", "--save",
                          tmp_path / "resumed.npz", *extra, devices=devices))
    assert res.code == 0, res.err
    assert "resuming from" in res.err and "checkpoint-000000002.npz (step 2)" in res.err
    assert not tmp.exists()                     # the leftover was cleared
    assert_bit_identical(load_npz(tmp_path / "resumed.npz"), load_npz(tmp_path / "whole.npz"))


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(cli, npz_dataset, tmp_path):
    data = npz_dataset(n=40)
    res = cli(*train_argv(data, "--steps", "6", "--save", tmp_path / "whole.npz"))
    assert res.code == 0, res.err
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "4", "--checkpoint-dir", ck, "--checkpoint-every",
                          "1"))
    assert res.code == 0, res.err
    newest = ck / "checkpoint-000000004.npz"
    newest.write_bytes(newest.read_bytes()[:300])          # cut short, as a full disk would
    res = cli(*train_argv(data, "--steps", "6", "--checkpoint-dir", ck, "--resume", "--save",
                          tmp_path / "resumed.npz"))
    assert res.code == 0, res.err
    warning = [line for line in res.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and str(newest) in warning[0] and "damaged" in warning[0]
    assert "checkpoint-000000003.npz" in warning[0]
    assert "(step 3)" in res.err
    assert_bit_identical(load_npz(tmp_path / "resumed.npz"), load_npz(tmp_path / "whole.npz"))


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A write that fails (a full disk: OSError; Ctrl-C: KeyboardInterrupt) halfway: the file
    it replaces is intact, and no temporary file is left."""
    from pyhet import model
    from pyhet.errors import WeightsError

    path = tmp_path / "w.npz"
    model.write_npz(path, {"a": np.arange(3, dtype=np.float32)})
    before = path.read_bytes()
    for error in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        def failing_savez(fh, **arrays):
            fh.write(b"PK\x03\x04 half a file")
            raise error
        monkeypatch.setattr(model.np, "savez", failing_savez)
        with pytest.raises(WeightsError if isinstance(error, OSError) else KeyboardInterrupt,
                           match="No space left" if isinstance(error, OSError) else None):
            model.write_npz(path, {"a": np.zeros(5, np.float32)})
        monkeypatch.undo()
        assert path.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["w.npz"]


# ================================================================ one run per folder

def test_a_new_run_in_a_used_folder_is_refused_and_overwrite_starts_afresh(
        cli, npz_dataset, tmp_path):
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    assert cli(*train_argv(data, "--steps", "2", "--checkpoint-dir", ck)).code == 0
    assert checkpoints(ck) == ["checkpoint-000000002.npz"]
    res = cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", ck))
    line = one_line(res.err)
    assert res.code == 2 and res.out == ""
    for w in (str(ck), "another run", "after step 2", "--resume", "another folder",
              "--overwrite"):
        assert w in line, (w, line)
    assert checkpoints(ck) == ["checkpoint-000000002.npz"]            # untouched
    # --overwrite with a run that fails before its first checkpoint (a device that cannot
    # be made, weights that cannot be read): the other run's are kept (they were deleted
    # first, and nothing came in their place)
    before = (ck / "checkpoint-000000002.npz").read_bytes()
    for bad in (["--devices", "gpu:7"], ["--init", tmp_path / "missing.npz"]):
        res = cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", ck, "--overwrite",
                              *bad))
        assert res.code != 0 and res.out == ""
        assert checkpoints(ck) == ["checkpoint-000000002.npz"], bad
        assert (ck / "checkpoint-000000002.npz").read_bytes() == before

    res = cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", ck, "--overwrite"))
    assert res.code == 0, res.err
    assert checkpoints(ck) == ["checkpoint-000000001.npz"]


def test_overwrite_that_cannot_delete_the_other_runs_checkpoints_says_so(
        cli, npz_dataset, tmp_path, monkeypatch):
    """Where the other run's checkpoint cannot be deleted at the first save, the run ends
    with one line naming it (status 1), and writes no checkpoint beside it."""
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    assert cli(*train_argv(data, "--steps", "2", "--checkpoint-dir", ck)).code == 0
    real_remove = os.remove

    def refused(path, *a, **k):
        if os.path.basename(path) == "checkpoint-000000002.npz":
            raise PermissionError(13, "Permission denied")
        return real_remove(path, *a, **k)
    monkeypatch.setattr(os, "remove", refused)
    res = cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", ck, "--overwrite"))
    assert res.code == 1 and res.out == ""
    line = one_line(res.err)
    assert "cannot delete checkpoint-000000002.npz, another run's checkpoint that --overwrite " \
           "deletes (Permission denied)" in line, line
    assert checkpoints(ck) == ["checkpoint-000000002.npz"]


def test_a_folder_in_use_by_another_process_is_refused(cli, npz_dataset, tmp_path,
                                                        pyhet_process):
    """A run still writing into the folder (a slow emulated device) holds its lock: a second
    run there is refused, naming the folder; once the first ends, the lock is free."""
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    p = pyhet_process(*train_argv(data, "--steps", "1000", "--checkpoint-dir", ck,
                                  "--checkpoint-every", "1", devices="cpu:1@0.01"))
    wait_for(lambda: checkpoints(ck), "the first run's first checkpoint")
    res = cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", ck, "--resume"))
    line = one_line(res.err)
    assert res.code == 1 and str(ck) in line and "in use by another pyhet run" in line
    assert f"process {p.pid}" in line
    p.kill()                                    # the kernel drops the lock of a killed process
    p.communicate(timeout=30)
    res = cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", ck, "--overwrite"))
    assert res.code == 0, res.err


def test_the_lock_refuses_a_second_writer_in_one_process(tmp_path):
    from pyhet.checkpoint import CheckpointDir
    from pyhet.errors import PyhetError

    with CheckpointDir(tmp_path / "ck", {}):
        with pytest.raises(PyhetError, match="in use by another pyhet run"):
            CheckpointDir(tmp_path / "ck", {})
    CheckpointDir(tmp_path / "ck", {}).close()        # released


def test_a_resumed_run_whose_lock_is_removed_locks_again(tmp_path, capsys):
    """The checkpoints of the run a fit resumes are not another run's: with its .lock removed
    mid-run, the resumed run stopped ("holds the checkpoints of another run now (1, the newest
    after step 2)") while its first checkpoint was still there (keep=0)."""
    import pyhet

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 1, 12, 12), dtype=np.float32), rng.integers(0, 3, 32)
    ck = tmp_path / "ck"

    def remove_lock(info):
        if info["step"] == 4:
            os.remove(ck / ".lock")

    with pyhet.Network("3C3-P2", (1, 12, 12), 3, devices="cpu:1") as net:
        net.fit(x, y, steps=2, batch_size=8, checkpoint_dir=ck, keep=0)
    with pyhet.Network("3C3-P2", (1, 12, 12), 3, devices="cpu:1") as net:
        with pytest.warns(RuntimeWarning, match="locked it again"):
            s = net.fit(x, y, steps=6, batch_size=8, checkpoint_dir=ck, keep=0,
                        checkpoint_every=2, resume=True, callback=remove_lock)
    assert s["start_step"] == 2
    assert checkpoints(ck) == [f"checkpoint-{n:09d}.npz" for n in (2, 4, 6)]


@pytest.mark.parametrize("how", ["folder moved", "lock removed", "another run's folder",
                                 "another run's checkpoints", "a file in its place"])
def test_a_folder_replaced_mid_run_is_locked_again_or_refused(tmp_path, capsys, how):
    """The folder moved away and made anew (or its .lock removed) while a run writes in it:
    the run went on writing at the folder's path with no lock there, so a second run could
    take the folder. The lock is taken again (a warning), or, where another run holds the new
    folder, or its checkpoints are there, the run stops with an error (status 1) and touches
    none of them."""
    import pyhet
    from pyhet.checkpoint import CheckpointDir
    from pyhet.errors import PyhetError

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 1, 12, 12), dtype=np.float32), rng.integers(0, 3, 32)
    ck, moved = tmp_path / "ck", tmp_path / "moved"
    other = []

    def replace(info):
        if info["step"] != 2:
            return
        if how == "lock removed":
            os.remove(ck / ".lock")
            return
        os.rename(ck, moved)
        if how == "a file in its place":
            ck.write_text("not a folder\n")
            return
        ck.mkdir()
        if how == "another run's folder":
            other.append(CheckpointDir(ck, {}))
        if how == "another run's checkpoints":    # written, and the folder released
            for step in (1, 50):
                (ck / f"checkpoint-{step:09d}.npz").write_bytes(b"run B")

    with pyhet.Network("3C3-P2-4C3-P2", (1, 12, 12), 3, devices="cpu:1") as net:
        fit = lambda: net.fit(x, y, steps=4, batch_size=8, checkpoint_dir=ck,  # noqa: E731
                              checkpoint_every=1, keep=1, callback=replace)
        fails = {"another run's folder": r"in use by another pyhet run",
                 "a file in its place": r"cannot be made again",
                 "another run's checkpoints": r"holds the checkpoints of another run now "
                                              r"\(2, the newest after step 50\)"}
        if how in fails:
            try:
                with pytest.raises(PyhetError, match=fails[how]) as e:
                    fit()
            finally:
                for o in other:
                    o.close()
            assert e.value.exit_status == 1
            if how == "another run's folder":
                assert checkpoints(ck) == []
            elif how == "a file in its place":
                assert ck.read_text() == "not a folder\n"
                assert checkpoints(moved) == ["checkpoint-000000002.npz"]
            else:
                assert checkpoints(ck) == ["checkpoint-000000001.npz",
                                           "checkpoint-000000050.npz"]
                assert {(ck / n).read_bytes() for n in checkpoints(ck)} == {b"run B"}
            return
        with pytest.warns(RuntimeWarning, match="locked it again") as said:
            fit()
        assert [w.filename for w in said] == [__file__]     # the program's line
    assert checkpoints(ck) == ["checkpoint-000000004.npz"]      # keep=1
    if how == "folder moved":     # the newest before the move stays where the folder went
        assert checkpoints(moved) == ["checkpoint-000000002.npz"]
    with CheckpointDir(ck, {}, resume=True):     # released at the end of fit(), as usual
        pass


# ================================================================ what resuming must match

@pytest.mark.parametrize("change,words", [
    (["--lr", "0.1"], ["--lr", "0.05", "0.1"]),
    (["--momentum", "0.5"], ["--momentum", "0.9", "0.5"]),
    (["--weight-decay", "0"], ["--weight-decay", "0.001", "0.0"]),
    (["--seed", "4"], ["--seed", "3", "4"]),
    (["--batch-size", "4"], ["--batch-size", "8", "4"]),
    # a position past the end of an epoch of this run's batches is still the other batch size
    (["--batch-size", "16"], ["--batch-size", "8", "16"]),
    (["--no-shuffle"], ["shuffle", "True", "False"]),
    (["--kernels", "3,5"], ["the network", "3C3-P2-4C3-P2", "3C3-P2-5C3-P2"]),
    (["DATA"], ["training images", "24", "32"]),
])
def test_resume_refuses_other_settings_naming_them(cli, npz_dataset, tmp_path, change, words):
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    # five steps of 8 of 24 images: epoch 1, batch 2 (an epoch of 16s has 2 batches)
    assert cli(*train_argv(data, "--steps", "5", "--checkpoint-dir", ck)).code == 0
    if change == ["DATA"]:
        data, change = npz_dataset(n=32), []        # the same file, now of 32 images
    res = cli(*train_argv(data, "--steps", "6", "--checkpoint-dir", ck, "--resume", *change))
    line = one_line(res.err)
    assert res.code == 2, res.err
    for w in ("checkpoint-000000005.npz", *words):
        assert w in line, (w, line)


@pytest.mark.parametrize("first,then", [("100", "24"), ("24", "50"), ("100", "999")])
def test_a_batch_size_above_the_split_resumes_at_the_batch_trained(cli, npz_dataset, tmp_path,
                                                                   first, then):
    """--batch-size above the training split's size trains batches of the whole split, and the
    summary says the batch is that size: a resume giving the size reported, or another size
    above the split, is the same run (and gives the same weights); a smaller one is not."""
    data = npz_dataset(n=24)
    res = cli(*train_argv(data, "--steps", "5", "--batch-size", first,
                          "--save", tmp_path / "whole.npz"))
    assert res.code == 0, res.err
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "3", "--batch-size", first, "--checkpoint-dir", ck,
                          "--json"))
    assert res.code == 0, res.err
    assert json.loads(res.out.splitlines()[-1])["batch_size"] == 24
    res = cli(*train_argv(data, "--steps", "5", "--batch-size", then, "--checkpoint-dir", ck,
                          "--resume", "--save", tmp_path / "resumed.npz"))
    assert res.code == 0, res.err
    assert "(step 3)" in res.err
    assert_bit_identical(load_npz(tmp_path / "resumed.npz"), load_npz(tmp_path / "whole.npz"))
    res = cli(*train_argv(data, "--steps", "6", "--batch-size", "23", "--checkpoint-dir", ck,
                          "--resume"))
    assert res.code == 2 and "--batch-size" in res.err and "23" in res.err, res.err


def test_resume_on_the_same_devices_keeps_the_partition(cli, npz_dataset, tmp_path):
    """The checkpoint keeps the partition, the calibration and the balancer's estimates; a
    resumed run on the same devices starts from them (static: no moves, so its final partition
    is the one it started with); on other devices it plans afresh and says so."""
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "3", "--checkpoint-dir", ck, "--json",
                          devices="cpu:1,cpu:1@0.5"))
    assert res.code == 0, res.err
    plan = meta_of(ck / "checkpoint-000000003.npz")["plan"]
    assert plan["devices"] == ["cpu:1", "cpu:1@0.5"]
    assert plan["partition"] == {k: list(v.values()) for k, v in
                                 json.loads(res.out.splitlines()[-1])["partition"].items()}
    assert set(plan["calibration"]) == {"speeds", "overheads", "caps", "parts", "contention",
                                        "fits", "phases", "whole", "waits", "master_s", "head_s",
                                        "cpu_like", "local_waits", "local_contention"}
    assert set(plan["balancer"]) == {"conv1", "conv2"}

    res = cli(*train_argv(data, "--steps", "5", "--checkpoint-dir", ck, "--resume", "--json",
                          "--balance", "static", devices="cpu:1,cpu:1@0.5"))
    assert res.code == 0, res.err
    assert "resuming with the checkpoint's partition" in res.err
    assert "calibrating" not in res.err
    s = json.loads(res.out.splitlines()[-1])
    assert {k: list(v.values()) for k, v in s["partition"].items()} == plan["partition"]

    res = cli(*train_argv(data, "--steps", "6", "--checkpoint-dir", ck, "--resume",
                          devices="cpu:1,numpy"))
    assert res.code == 0, res.err
    assert "this run has cpu:1,numpy: planning the partition afresh" in res.err


# ================================================================ --checkpoint-every, --keep

@pytest.mark.parametrize("keep,kept", [
    ([], [4, 6, 7]),                   # the default: the 3 newest
    (["--keep", "2"], [6, 7]),
    (["--keep", "0"], [2, 3, 4, 6, 7]),
])
def test_checkpoint_every_and_keep(cli, npz_dataset, tmp_path, keep, kept):
    """20 images in batches of 8: 3 steps per epoch. --checkpoint-every 2 over 7 steps writes
    after steps 2, 3 (epoch end), 4, 6 (epoch end and every 2) and 7 (the end); the older ones
    are deleted once a newer one is complete."""
    data = npz_dataset(n=20)
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "7", "--checkpoint-dir", ck, "--checkpoint-every",
                          "2", *keep))
    assert res.code == 0, res.err
    assert checkpoints(ck) == [f"checkpoint-{s:09d}.npz" for s in kept]
    assert [meta_of(ck / f"checkpoint-{s:09d}.npz")["step"] for s in kept] == kept


# ================================================================ SIGINT and SIGTERM

@pytest.mark.parametrize("signame,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_writes_a_checkpoint_and_exits(cli, npz_dataset, tmp_path, pyhet_process,
                                                signame, code):
    """A signal while a slow emulated device trains: the run writes the checkpoint of its last
    step, says where in one line, and exits 128 + the signal; the checkpoint resumes."""
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    p = pyhet_process(*train_argv(data, "--steps", "1000", "--checkpoint-dir", ck,
                                  "--checkpoint-every", "1", devices="cpu:1@0.005"))
    wait_for(lambda: checkpoints(ck), "the first checkpoint")
    p.send_signal(getattr(signal, signame))
    out, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    line = one_line(err)
    assert out == ""
    assert line.startswith(f"pyhet: interrupted by {signame} after step ")
    step = int(line.split("after step ")[1].split(":")[0])
    path = ck / f"checkpoint-{step:09d}.npz"
    assert f"wrote the checkpoint {path}" in line and "--resume" in line
    assert checkpoints(ck)[-1] == path.name
    assert meta_of(path)["step"] == step
    res = cli(*train_argv(data, "--steps", step + 1, "--checkpoint-dir", ck, "--resume"))
    assert res.code == 0 and f"(step {step})" in res.err, res.err


@pytest.mark.parametrize("signame,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_without_a_checkpoint_dir_exits_with_one_line(npz_dataset, pyhet_process,
                                                               signame, code):
    data = npz_dataset(n=24)
    for wait in (2, 5, 10):
        p = pyhet_process(*train_argv(data, "--steps", "1000", "--json", devices="cpu:1@0.005"))
        time.sleep(wait)
        p.send_signal(getattr(signal, signame))
        out, err = p.communicate(timeout=60)
        # a signal before training began (a loaded machine still loading the modules): the
        # command's line of that moment, or SIGTERM's default action before the command's
        # handler: tried again, waiting longer (training's line never comes where it is wrong)
        if err.strip() != "pyhet: interrupted" and p.returncode != -signal.SIGTERM:
            break
    assert p.returncode == code, err
    assert one_line(err).startswith(f"pyhet: interrupted by {signame}") and out == ""


def test_waking_a_device_cuts_its_emulated_idling_short():
    """A device at @0.001 idles 999 times its work; wake() ends the idling at once, so a
    stopped run finishes its step at full speed."""
    from pyhet.devices import make_devices
    from pyhet.specs import parse_devices

    (d,) = make_devices(parse_devices("numpy@0.001"))
    try:
        threading.Timer(0.2, d.wake).start()
        t0 = time.monotonic()
        d.call("work", time.sleep, 0.05)        # 50 ms of work: 50 s of idling unless woken
        assert time.monotonic() - t0 < 20
    finally:
        d.close()


# ================================================================ destinations, checked first

@pytest.mark.parametrize("case,words", [
    ("save in a missing folder", ["--save", "does not exist"]),
    ("save is a folder", ["--save", "a folder, not a file"]),
    ("save is empty", ["--save ''"]),
    ("save under a file", ["--save", "is a regular file, not a folder"]),
    ("checkpoint dir is a file", ["--checkpoint-dir", "a file, not a folder"]),
    ("checkpoint dir under a file", ["--checkpoint-dir", "cannot be made", "is a file"]),
    ("checkpoint dir is empty", ["--checkpoint-dir ''"]),
    ("checkpoint dir in /proc", ["--checkpoint-dir", "cannot be made"]),
    ("resume without a dir", ["--resume needs --checkpoint-dir"]),
    ("overwrite without a dir", ["--overwrite needs --checkpoint-dir"]),
    ("every without a dir", ["--checkpoint-every needs --checkpoint-dir"]),
    ("keep without a dir", ["--keep needs --checkpoint-dir"]),
    # with --overwrite, the other run's checkpoints were deleted before this was refused
    ("data dir of a dataset that reads none", ["reads no data folder"]),
    ("resume and overwrite", ["--overwrite", "--resume"]),
])
def test_destinations_are_checked_before_training(cli, npz_dataset, tmp_path, case, words):
    data = npz_dataset(n=16)
    (tmp_path / "FILE").write_text("a file")
    extra = {
        "save in a missing folder": ["--save", tmp_path / "no" / "w.npz"],
        "save is a folder": ["--save", tmp_path],
        "save is empty": ["--save", ""],
        "save under a file": ["--save", tmp_path / "FILE" / "w.npz"],
        "checkpoint dir is a file": ["--checkpoint-dir", tmp_path / "FILE"],
        "checkpoint dir under a file": ["--checkpoint-dir", tmp_path / "FILE" / "ck"],
        "checkpoint dir is empty": ["--checkpoint-dir", ""],
        "checkpoint dir in /proc": ["--checkpoint-dir", "/proc/no/such"],
        "resume without a dir": ["--resume"],
        "overwrite without a dir": ["--overwrite"],
        "every without a dir": ["--checkpoint-every", "2"],
        "keep without a dir": ["--keep", "5"],
        "data dir of a dataset that reads none": ["--data-dir", tmp_path, "--checkpoint-dir",
                                                  tmp_path / "ck", "--overwrite"],
        "resume and overwrite": ["--checkpoint-dir", tmp_path / "ck", "--resume",
                                 "--overwrite"],
    }[case]
    res = cli(*train_argv(data, "--steps", "1", *extra))
    assert res.code == 2, res.err
    line = one_line(res.err)
    for w in words:
        assert w in line, (w, line)
    assert "epoch" not in res.err and res.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE", "data.npz"]   # nothing made


def test_a_checkpoint_folder_that_is_a_dangling_link_is_named(cli, npz_dataset, tmp_path):
    """It said "cannot be made: File exists" after the start."""
    data = npz_dataset(n=16)
    (tmp_path / "ck").symlink_to(tmp_path / "gone")
    for given in (tmp_path / "ck", f"{tmp_path / 'ck'}/", tmp_path / "ck" / "sub"):
        res = cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", given))
        assert res.code == 2, res.err
        line = one_line(res.err)
        assert f"{tmp_path / 'ck'} is a symbolic link to {tmp_path / 'gone'}, which is not " \
               f"there" in line
        assert res.out == "" and not (tmp_path / "gone").exists()


# ================================================================ --deterministic

@pytest.mark.parametrize("balance", ["dynamic", "static"])
def test_deterministic_runs_are_bit_identical(cli, npz_dataset, tmp_path, balance):
    """Two devices, static or dynamic balance asked for: with --deterministic no timing decides
    the partition and nothing moves, so two runs end with the same weights, bit for bit."""
    data = npz_dataset(n=40)
    runs = []
    for i in range(2):
        out = tmp_path / f"w{i}.npz"
        res = cli(*train_argv(data, "--steps", "6", "--save", out, "--json", "--deterministic",
                              "--balance", balance, devices="cpu:1,cpu:1"))
        assert res.code == 0, res.err
        s = json.loads(res.out.splitlines()[-1])
        assert s["deterministic"] is True and s["partition_moves"] == []
        assert s["calibration"] is None and "calibrating" not in res.err
        assert s["partition"] == {"conv1": {"d0": 2, "d1": 1}, "conv2": {"d0": 2, "d1": 2}}
        runs.append(load_npz(out))
    assert_bit_identical(runs[0], runs[1])


def test_deterministic_splits_in_proportion_to_the_declared_speeds(cli, npz_dataset):
    data = npz_dataset(n=16)
    res = cli("train", "--dataset", f"npz:{data}", "--kernels", "6,9", "--kernel-size", "3",
              "--devices", "cpu:1,cpu:1@0.5", "--batch-size", "8", "--steps", "1", "--quiet",
              "--json", "--deterministic")
    assert res.code == 0, res.err
    s = json.loads(res.out.splitlines()[-1])
    assert s["partition"] == {"conv1": {"d0": 4, "d1": 2}, "conv2": {"d0": 6, "d1": 3}}


# ================================================================ Network.fit

def test_fit_checkpoints_have_the_same_protections(tmp_path):
    """fit(checkpoint_dir=...) writes the command line's checkpoints, refuses another run's
    folder, overwrites on request, and resume=True goes on to the weights of one fit."""
    import pyhet
    from pyhet.errors import UsageError

    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 1, 12, 12)).astype(np.float32)
    y = np.arange(24) % 3
    ck = tmp_path / "ck"
    kw = dict(batch_size=8, lr=0.05, checkpoint_dir=ck)

    def network():
        return pyhet.Network("3C3-P2-4C3-P2", (1, 12, 12), 3, devices="cpu:1", seed=2)

    with network() as net:
        net.fit(x, y, steps=5, batch_size=8, lr=0.05)
        whole = net.params()
    with network() as net:
        net.fit(x, y, steps=2, checkpoint_every=1, **kw)
    assert checkpoints(ck) == ["checkpoint-000000001.npz", "checkpoint-000000002.npz"]
    with network() as net:
        with pytest.raises(UsageError, match="holds the checkpoints of another run"):
            net.fit(x, y, steps=5, **kw)
        with pytest.raises(UsageError, match="made with lr 0.05, but this run asks for 0.1"):
            net.fit(x, y, steps=5, resume=True, **{**kw, "lr": 0.1})
        net.fit(x, y, steps=5, resume=True, checkpoint_every=1, **kw)
        assert_bit_identical(net.params(), whole)
    assert checkpoints(ck) == [f"checkpoint-00000000{i}.npz" for i in (3, 4, 5)]  # keeps 3
    with network() as net:
        net.fit(x, y, steps=1, overwrite=True, **kw)
        for bad, words in (({"keep": -1}, "keep must be a whole number >= 0"),
                           ({"checkpoint_every": "2"}, "checkpoint_every must be a whole")):
            with pytest.raises(pyhet.errors.PyhetError, match=words):
                net.fit(x, y, steps=1, overwrite=True, **kw, **bad)
    assert checkpoints(ck) == ["checkpoint-000000001.npz"]


# ================================================================ what a resume finds in the folder

def test_a_damaged_checkpoint_past_the_run_never_costs_a_new_one(cli, npz_dataset, tmp_path):
    """A damaged checkpoint of a later step, which --resume skips, used to outrank every
    checkpoint the run wrote: --keep 1 deleted each new one as soon as it was written."""
    data = npz_dataset(n=40)
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", ck))
    assert res.code == 0, res.err
    (ck / "checkpoint-000000050.npz").write_text("junk")
    res = cli(*train_argv(data, "--steps", "4", "--checkpoint-dir", ck, "--resume",
                          "--keep", "1", "--checkpoint-every", "1"))
    assert res.code == 0 and "(step 1)" in res.err, res.err
    assert checkpoints(ck) == ["checkpoint-000000004.npz", "checkpoint-000000050.npz"]
    res = cli(*train_argv(data, "--steps", "5", "--checkpoint-dir", ck, "--resume",
                          "--keep", "1"))
    assert res.code == 0 and "resuming from" in res.err and "(step 4)" in res.err, res.err


def test_a_checkpoint_renamed_to_a_later_step_is_damaged(cli, npz_dataset, tmp_path):
    """A checkpoint of step 4 renamed as step 9 used to be resumed from by every --resume, each
    starting again at step 4: a name whose step is not the one the file holds is damage."""
    data = npz_dataset(n=40)
    res = cli(*train_argv(data, "--steps", "6", "--save", tmp_path / "whole.npz"))
    assert res.code == 0, res.err
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "4", "--checkpoint-dir", ck, "--checkpoint-every",
                          "1", "--keep", "0"))
    assert res.code == 0, res.err
    renamed = ck / "checkpoint-000000009.npz"
    (ck / "checkpoint-000000004.npz").rename(renamed)
    res = cli(*train_argv(data, "--steps", "6", "--checkpoint-dir", ck, "--resume", "--save",
                          tmp_path / "resumed.npz", "--checkpoint-every", "1", "--keep", "2"))
    assert res.code == 0, res.err
    warning = [line for line in res.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and str(renamed) in warning[0], res.err
    assert "damaged (it is named step 9 but holds step 4)" in warning[0]
    assert "resuming from" in warning[0] and "checkpoint-000000003.npz" in warning[0]
    assert "(step 3)" in res.err
    assert_bit_identical(load_npz(tmp_path / "resumed.npz"), load_npz(tmp_path / "whole.npz"))
    # --keep 2 keeps the run's two newest; the renamed file past the run is left as it is
    assert checkpoints(ck) == ["checkpoint-000000005.npz", "checkpoint-000000006.npz",
                               renamed.name]
    assert meta_of(renamed)["step"] == 4
    res = cli(*train_argv(data, "--steps", "7", "--checkpoint-dir", ck, "--resume"))
    assert res.code == 0 and "(step 6)" in res.err and "named step 9" in res.err, res.err


def test_a_checkpoint_renamed_to_the_newest_step_is_damaged(cli, npz_dataset, tmp_path):
    """Step 2's checkpoint named as step 4, beside the checkpoint of step 3: resumed from step
    3, with a warning, not silently from step 2."""
    data = npz_dataset(n=40)
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "4", "--checkpoint-dir", ck, "--checkpoint-every",
                          "1", "--keep", "0"))
    assert res.code == 0, res.err
    named = ck / "checkpoint-000000004.npz"
    named.write_bytes((ck / "checkpoint-000000002.npz").read_bytes())
    res = cli(*train_argv(data, "--steps", "5", "--checkpoint-dir", ck, "--resume",
                          "--checkpoint-every", "1"))
    assert res.code == 0, res.err
    warning = [line for line in res.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and str(named) in warning[0], res.err
    assert "damaged (it is named step 4 but holds step 2)" in warning[0]
    assert "checkpoint-000000003.npz" in warning[0] and "(step 3)" in res.err
    assert meta_of(named)["step"] == 4           # written again by the resumed run


def test_keep_counts_only_the_checkpoints_that_hold_their_own_step(cli, npz_dataset, tmp_path):
    """A file named step 3 that holds step 1 used to count as one of the --keep newest: it was
    kept, and the checkpoint of step 2 deleted. It is no checkpoint to resume from: the valid
    ones are kept, and the renamed one goes once it is older than all of them."""
    data = npz_dataset(n=40)
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "4", "--checkpoint-dir", ck, "--checkpoint-every",
                          "1", "--keep", "0"))
    assert res.code == 0, res.err
    (ck / "checkpoint-000000003.npz").write_bytes((ck / "checkpoint-000000001.npz").read_bytes())
    res = cli(*train_argv(data, "--steps", "5", "--checkpoint-dir", ck, "--resume", "--keep",
                          "3"))
    assert res.code == 0 and "(step 4)" in res.err, res.err
    assert checkpoints(ck) == [f"checkpoint-{s:09d}.npz" for s in (2, 3, 4, 5)]
    assert [meta_of(ck / f"checkpoint-{s:09d}.npz")["step"] for s in (2, 4, 5)] == [2, 4, 5]
    res = cli(*train_argv(data, "--steps", "7", "--checkpoint-dir", ck, "--resume", "--keep",
                          "3", "--checkpoint-every", "1"))
    assert res.code == 0 and "(step 5)" in res.err, res.err
    assert checkpoints(ck) == [f"checkpoint-{s:09d}.npz" for s in (5, 6, 7)]


def test_a_weight_file_in_the_folder_is_named_as_one(cli, npz_dataset, tmp_path):
    data = npz_dataset(n=40)
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "2", "--checkpoint-dir", ck, "--save",
                          tmp_path / "w.npz"))
    assert res.code == 0, res.err
    (ck / "checkpoint-000000007.npz").write_bytes((tmp_path / "w.npz").read_bytes())
    res = cli(*train_argv(data, "--steps", "3", "--checkpoint-dir", ck, "--resume"))
    assert res.code == 0, res.err
    assert "no 'meta' entry: a weight file, not a checkpoint" in res.err, res.err


def test_a_calibrated_resume_of_an_even_checkpoint_plans_afresh_and_says_so(cli, npz_dataset,
                                                                         tmp_path):
    """A checkpoint of --balance even has no calibration for --balance static to go on with: it
    was planned afresh without a word."""
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "3", "--checkpoint-dir", ck, "--balance", "even",
                          devices="cpu:1,cpu:1"))
    assert res.code == 0, res.err
    res = cli(*train_argv(data, "--steps", "5", "--checkpoint-dir", ck, "--resume",
                          "--balance", "static", "--json", devices="cpu:1,cpu:1"))
    assert res.code == 0, res.err
    assert ("the checkpoint's partition has no calibration to go on with: planning the "
            "partition afresh") in res.err, res.err
    assert json.loads(res.out.splitlines()[-1])["calibration"] is not None


def test_a_deterministic_resume_of_a_calibrated_checkpoint_plans_afresh(cli, npz_dataset,
                                                                        tmp_path):
    """--deterministic promises the split of the declared speeds, no calibration: a resume
    of a calibrated run's checkpoint used to keep its partition (and its calibration)."""
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    res = cli(*train_argv(data, "--steps", "3", "--checkpoint-dir", ck,
                          devices="cpu:1,cpu:1"))
    assert res.code == 0, res.err
    res = cli(*train_argv(data, "--steps", "5", "--checkpoint-dir", ck, "--resume",
                          "--deterministic", "--json", devices="cpu:1,cpu:1"))
    assert res.code == 0, res.err
    assert "this run's is: planning the partition afresh" in res.err, res.err
    s = json.loads(res.out.splitlines()[-1])
    assert s["calibration"] is None
    assert s["partition"] == json.loads(cli(*train_argv(
        data, "--steps", "1", "--deterministic", "--json", devices="cpu:1,cpu:1"
    )).out.splitlines()[-1])["partition"]


def test_a_write_whose_temporary_file_another_write_took_fails_and_renames_nothing(
        tmp_path, monkeypatch):
    """Two writes of one file at once: the second removes the first's temporary file (as it
    would a leftover) and makes its own. The first, once written, finds its temporary file
    not its own: it fails, naming the other write, and neither renames the other's unfinished
    file into place nor removes it; the file it would have replaced is as it was."""
    from pyhet import model
    from pyhet.errors import WeightsError
    from pyhet.files import temp_name

    path = tmp_path / "w.npz"
    model.write_npz(path, {"a": np.arange(3, dtype=np.float32)})
    before = path.read_bytes()
    tmp = temp_name(path)
    real = model.np.savez

    def taken_meanwhile(fh, **arrays):
        real(fh, **arrays)
        os.unlink(tmp)                        # the other write, starting
        with open(tmp, "wb") as other:
            other.write(b"PK\x03\x04 the other write, half done")

    monkeypatch.setattr(model.np, "savez", taken_meanwhile)
    with pytest.raises(WeightsError, match="another write of it at the same time"):
        model.write_npz(path, {"a": np.zeros(5, np.float32)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    with open(tmp, "rb") as other:
        assert other.read() == b"PK\x03\x04 the other write, half done"


def test_a_write_under_way_is_never_taken_for_a_leftover(tmp_path):
    """A write holds its temporary file flock()ed until its rename. A second write of the same
    file that finds it so fails at once, renaming nothing and leaving the first's file; it
    used to remove it as a leftover and write its own (the first then failed, or, in the
    instant between its check and its rename, renamed the second's file unseen). Once the
    holder is gone, the file left is a leftover, and removed."""
    import fcntl

    from pyhet import model
    from pyhet.errors import WeightsError
    from pyhet.files import temp_name

    path = tmp_path / "w.npz"
    model.write_npz(path, {"a": np.arange(3, dtype=np.float32)})
    before = path.read_bytes()
    tmp = temp_name(path)
    with open(tmp, "wb") as first:      # a write under way, as write_npz holds its file
        first.write(b"PK\x03\x04 the first write, half done")
        first.flush()
        fcntl.flock(first.fileno(), fcntl.LOCK_EX)
        with pytest.raises(WeightsError, match=r"another write of it is under way \(its "
                                               r"temporary file .*\.w\.npz\.tmp is held\)"):
            model.write_npz(path, {"a": np.zeros(5, np.float32)})
        assert path.read_bytes() == before
        with open(tmp, "rb") as still:
            assert still.read() == b"PK\x03\x04 the first write, half done"
    model.write_npz(path, {"a": np.zeros(5, np.float32)})     # a leftover now: removed
    assert not os.path.exists(tmp)
    np.testing.assert_array_equal(load_npz(path)["a"], np.zeros(5, np.float32))


def test_a_write_found_before_it_locks_is_never_renamed_as_another(tmp_path, monkeypatch):
    """The one instant a write's file is not yet locked (between its making and its flock):
    another write that finds it then took it for a leftover by a check, and removed it later,
    after the first had locked, written and checked it; the second then made its own file
    there, and the first renamed that (empty) file into place and said it had written. Now a
    leftover is removed under a lock of its own: the first cannot lock and fails, the second
    writes, and the file is always that of the write that says it landed."""
    from pyhet import files, model
    from pyhet.errors import WeightsError

    path = tmp_path / "w.npz"
    model.write_npz(path, {"a": np.zeros(3, np.float32)})
    tmp = files.temp_name(path)
    step = {k: threading.Event() for k in ("first_made", "second_at_unlink", "first_on",
                                           "second_made")}
    real_create, real_unlink, real_mine = files.create_new, os.unlink, model._still_mine

    def who():
        return threading.current_thread().name

    def create_new(p, *args):
        fd = real_create(p, *args)
        if who() == "first":
            step["first_made"].set()        # made, not yet locked
            step["second_at_unlink"].wait(10)
        elif who() == "second":
            step["second_made"].set()
        return fd

    def unlink(p, *args, **kwargs):
        if who() == "second" and os.fspath(p) == tmp:
            step["second_at_unlink"].set()  # the first's file found: removed after a pause
            step["first_on"].wait(10)
        return real_unlink(p, *args, **kwargs)

    def still_mine(t, mine):
        there = real_mine(t, mine)
        if who() == "first":                # checked: the second goes on before the rename
            step["first_on"].set()
            step["second_made"].wait(3)
        return there

    monkeypatch.setattr(files, "create_new", create_new)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(model, "_still_mine", still_mine)
    said = {}

    def write(name, value):
        if name == "second":
            step["first_made"].wait(10)
        try:
            model.write_npz(path, {"a": np.full(3, value, np.float32)})
            said[name] = value
        except WeightsError as e:
            said[name] = str(e)
        finally:
            if name == "first":
                step["first_on"].set()

    threads = [threading.Thread(target=write, args=a, name=a[0])
               for a in (("first", 1), ("second", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    monkeypatch.undo()
    landed = [v for v in said.values() if not isinstance(v, str)]
    assert len(landed) == 1, said
    np.testing.assert_array_equal(load_npz(path)["a"], np.full(3, landed[0], np.float32))
    assert said == {"first": said["first"], "second": 2}, said
    assert "another write of it is under way" in said["first"]


def test_writes_of_one_file_at_once_leave_it_whole(tmp_path):
    """Two threads write one file again and again while a third reads it: every read is a
    whole file of one of the two writes, and every write either lands or says why not."""
    import zipfile

    from pyhet import model
    from pyhet.errors import WeightsError

    path = tmp_path / "w.npz"
    model.write_npz(path, {"a": np.zeros(1000, np.float32)})
    stop, bad, refused, landed = threading.Event(), [], [], []

    def write(value):
        for _ in range(60):
            try:
                model.write_npz(path, {"a": np.full(1000, value, np.float32)})
                landed.append(value)
            except WeightsError as e:
                refused.append(str(e))

    def read():
        while not stop.is_set():
            try:
                a = load_npz(path)["a"]
            except (OSError, ValueError, zipfile.BadZipFile) as e:
                bad.append(repr(e))
                continue
            if not (a.shape == (1000,) and (a == a[0]).all() and a[0] in (0, 1, 2)):
                bad.append(f"mixed {a[:3]}")

    threads = [threading.Thread(target=write, args=(v,)) for v in (1, 2)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    reader.join(timeout=60)
    assert not bad, bad[:3]
    assert len(landed) + len(refused) == 120 and landed
    assert all("another write of it" in m for m in refused), refused[:3]


@pytest.mark.parametrize("odd", ["checkpoint-5.npz", "checkpoint-0000000006.npz",
                                 "checkpoint-\u0669\u0669\u0669\u0669\u0669\u0669\u0669\u0669"
                                 "\u0669.npz", "checkpoint-000000007.npz.old"])
def test_only_the_names_a_run_writes_are_checkpoints(cli, npz_dataset, tmp_path, odd):
    """A file named almost as a checkpoint (the step in fewer or more digits than nine
    zero-padded, or in other digits than ASCII's) is a user's: never resumed from, and never
    removed by --keep."""
    data = npz_dataset(n=24)
    first = tmp_path / "first"
    assert cli(*train_argv(data, "--steps", "2", "--checkpoint-dir", first)).code == 0
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / odd).write_bytes((first / "checkpoint-000000002.npz").read_bytes())
    res = cli(*train_argv(data, "--steps", "3", "--checkpoint-dir", ck, "--resume",
                          "--checkpoint-every", "1", "--keep", "1"))
    assert res.code == 0, res.err
    assert "resuming from" not in res.err
    assert sorted(p.name for p in ck.iterdir() if p.name != ".lock") == sorted(
        [odd, "checkpoint-000000003.npz"])


def test_resume_from_a_checkpoint_says_that_init_is_not_read(cli, npz_dataset, tmp_path):
    """The same command line starts a run from --init, and, once the folder holds a checkpoint,
    resumes it: the checkpoint's weights go on, and stderr says --init was not read (a file
    that no longer loads is not read either)."""
    data = npz_dataset(n=24)
    init = tmp_path / "init.npz"
    assert cli(*train_argv(data, "--steps", "1", "--save", init)).code == 0
    ck = tmp_path / "ck"
    argv = train_argv(data, "--checkpoint-dir", ck, "--resume", "--init", init)
    res = cli(*argv, "--steps", "2")
    assert res.code == 0 and "resuming" not in res.err, res.err
    init.write_bytes(b"not weights")
    res = cli(*argv, "--steps", "3")
    assert res.code == 0, res.err
    assert f"--init {init} is not read" in res.err and "checkpoint-000000002.npz" in res.err


def test_only_the_leftovers_of_a_runs_writes_are_cleared(cli, npz_dataset, tmp_path):
    """Opening the folder removes what a killed write of a checkpoint left (.NAME.tmp of a
    name the run writes), and nothing named almost so."""
    data = npz_dataset(n=24)
    ck = tmp_path / "ck"
    ck.mkdir()
    theirs = [".checkpoint-0000000006.npz.tmp", ".checkpoint-5.npz.tmp",
              ".checkpoint-000000001.npz.tmp\n", ".checkpoint-000000001.npz.tmp.old"]
    for name in theirs + [".checkpoint-000000001.npz.tmp"]:
        (ck / name).write_bytes(b"half")
    assert cli(*train_argv(data, "--steps", "1", "--checkpoint-dir", ck)).code == 0
    assert sorted(p.name for p in ck.iterdir() if p.name != ".lock") == sorted(
        theirs + ["checkpoint-000000001.npz"])


def test_a_file_system_without_locks_still_takes_writes_and_checkpoints(tmp_path, monkeypatch):
    """flock fails with ENOLCK (or EOPNOTSUPP) on file systems that take no locks: a write
    goes on unlocked, and a checkpoint folder is used with a warning, not refused with a raw
    OSError."""
    import errno
    import fcntl
    import io

    from pyhet import model
    from pyhet.checkpoint import CheckpointDir

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = tmp_path / "w.npz"
    model.write_npz(path, {"a": np.arange(3, dtype=np.float32)})
    model.write_npz(path, {"a": np.zeros(2, np.float32)})
    np.testing.assert_array_equal(load_npz(path)["a"], np.zeros(2, np.float32))
    log = io.StringIO()
    with CheckpointDir(tmp_path / "ck", {}, log=log):
        pass
    assert "takes no locks (No locks available)" in log.getvalue()
