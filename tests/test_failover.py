"""A device that fails during training: its kernels move to the others from the state before
the step, the step is redone, and the weights end as those of one device that never failed.
Faults are injected (pyhet.faults) in every phase of a step, for every balance mode, on a
device that holds kernels of every layer; when no device is left the run ends with one error
and a checkpoint that resumes.

x (N, C, H, W) images, y (N,) labels; weights in PyTorch's layout.
"""

import io
import json

import numpy as np
import pytest

from conftest import assert_same_weights, load_npz, net_shape, train_weights
from pyhet.backends.cpu import CpuBackend
from pyhet.devices import Device, make_devices
from pyhet.errors import DeviceError, NoDeviceLeftError
from pyhet.failover import Failover
from pyhet.faults import PHASES
from pyhet.model import Net, init_params
from pyhet.optim import SGDConfig
from pyhet.specs import parse_devices

STEPS, FAIL_AT = 6, 3
CFG = SGDConfig(0.05, 0.9, 1e-3)


def batches(shape, n=8, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, *shape.input_shape)).astype(np.float32),
             rng.integers(0, shape.num_classes, n)) for _ in range(STEPS)]


def train_with_faults(shape, devices, partition, data, faults, calibration=None):
    """Train on `devices` (closed afterwards) through a Failover, with faults
    {device index: (phase, step)}; returns (weights, failover)."""
    try:
        for i, (phase, step) in faults.items():
            devices[i].inject_fault(phase, step)
        net = Net(shape, init_params(shape, 0), devices, partition, CpuBackend(1))
        failover = Failover(net, calibration, log=io.StringIO())
        for step, (x, y) in enumerate(data, 1):
            failover.train_step(x, y, CFG, step=step)
        return net.params(), failover
    finally:
        for d in devices:
            d.close()


def one_device_weights(shape, data):
    want, _ = train_weights(shape, "numpy", {g.name: [g.K] for g in shape.blocks}, data, CFG)
    return want


# ================================================================ every phase, two device mixes

# conv2's input gradient is the host group's shared phase; the failed device d1 holds kernels
# of both layers
@pytest.mark.parametrize("spec", ["cpu:1,cpu:1", "cpu:1,cpu:1,numpy"])
@pytest.mark.parametrize("phase", ["forward", "backward", "input_gradient", "update"])
def test_a_failed_device_moves_its_kernels_and_the_step_is_redone(spec, phase):
    shape = net_shape((2, 14, 14), (5, 7), 3, 4)
    data = batches(shape)
    n = len(spec.split(","))
    partition = {"conv1": [2, 2, 1][:n] if n == 3 else [3, 2],
                 "conv2": [3, 2, 2][:n] if n == 3 else [4, 3]}
    got, failover = train_with_faults(shape, make_devices(parse_devices(spec)), partition,
                                      data, {1: (phase, FAIL_AT)})
    assert_same_weights(got, one_device_weights(shape, data))
    [event] = failover.failures
    assert (event["step"], event["device"], event["phase"]) == (FAIL_AT, "d1", phase)
    assert "d1" in event["message"] and "injected" in event["message"]
    assert all(counts["d1"] == 0 for counts in event["partition"].values())
    assert all(sum(c.values()) == g.K for c, g in zip(event["partition"].values(),
                                                      shape.blocks))


def test_two_failures_in_one_run_leave_the_last_device():
    shape = net_shape((2, 14, 14), (5, 7), 3, 4)
    data = batches(shape)
    got, failover = train_with_faults(
        shape, make_devices(parse_devices("cpu:1,numpy,cpu:1")),
        {"conv1": [2, 2, 1], "conv2": [3, 2, 2]}, data,
        {0: ("update", 2), 2: ("backward", 4)})
    assert_same_weights(got, one_device_weights(shape, data))
    assert [(f["device"], f["step"]) for f in failover.failures] == [("d0", 2), ("d2", 4)]
    assert failover.failures[-1]["partition"] == {"conv1": {"d0": 0, "d1": 5, "d2": 0},
                                                  "conv2": {"d0": 0, "d1": 7, "d2": 0}}


class Gone(Device):
    """A device that is gone with its memory once it failed (as a rank that died): its shards
    cannot be read back."""

    def get_shard(self, layer, lo=None, hi=None, momentum=True):
        if self.fault is not None and self.fault.fired:
            raise RuntimeError("the device is gone")
        return super().get_shard(layer, lo, hi, momentum)


@pytest.mark.parametrize("phase", ["forward", "update"])
def test_a_device_gone_with_its_state_ends_the_run_clearly(phase):
    shape = net_shape((2, 14, 14), (5, 7), 3, 4)
    data = batches(shape)
    specs = parse_devices("numpy,cpu:1")
    devices = [Gone("d0", specs[0]), Device("d1", specs[1])]
    with pytest.raises(DeviceError, match="d0.*could not be read back.*newest checkpoint"):
        train_with_faults(shape, devices, {"conv1": [3, 2], "conv2": [4, 3]}, data,
                          {0: (phase, FAIL_AT)})


@pytest.mark.parametrize("phase", ["forward", "update"])
def test_an_update_failure_leaves_every_shard_as_before_the_step(phase):
    """The survivors' staged updates of a step that failed are never committed: the state
    moved to them is that before the step, on a host and a numpy device alike."""
    shape = net_shape((2, 14, 14), (5, 7), 3, 4)
    data = batches(shape)
    got, failover = train_with_faults(shape, make_devices(parse_devices("numpy,cpu:1")),
                                      {"conv1": [3, 2], "conv2": [4, 3]}, data,
                                      {0: (phase, FAIL_AT)})
    assert_same_weights(got, one_device_weights(shape, data))
    assert [f["device"] for f in failover.failures] == ["d0"]


def test_when_no_device_is_left_the_state_before_the_step_stays():
    shape = net_shape((2, 14, 14), (5, 7), 3, 4)
    data = batches(shape)
    devices = make_devices(parse_devices("cpu:1"))
    devices[0].inject_fault("update", FAIL_AT)
    try:
        net = Net(shape, init_params(shape, 0), devices, {"conv1": [5], "conv2": [7]},
                  CpuBackend(1))
        failover = Failover(net, log=io.StringIO())
        with pytest.raises(NoDeviceLeftError, match="d0.*no device is left"):
            for step, (x, y) in enumerate(data, 1):
                failover.train_step(x, y, CFG, step=step)
        got = net.params()
    finally:
        devices[0].close()
    assert_same_weights(got, one_device_weights(shape, data[:FAIL_AT - 1]))


class BreaksOnLoad(Device):
    """A device that fails when it takes more kernels than it was first given."""

    def load_shard(self, layer, *args):
        if layer in self._shards:
            raise RuntimeError("cannot take more kernels")
        return super().load_shard(layer, *args)


def test_a_device_that_fails_taking_the_kernels_of_a_failed_one_is_named_too():
    """d0 fails in the forward; d1 fails as it takes d0's kernels: no device is left, and the
    error names both failures."""
    shape = net_shape((2, 14, 14), (5, 7), 3, 4)
    data = batches(shape)
    specs = parse_devices("cpu:1,cpu:1")
    devices = [Device("d0", specs[0]), BreaksOnLoad("d1", specs[1])]
    devices[0].inject_fault("forward", FAIL_AT)
    try:
        net = Net(shape, init_params(shape, 0), devices, {"conv1": [3, 2], "conv2": [4, 3]},
                  CpuBackend(1))
        failover = Failover(net, log=io.StringIO())
        with pytest.raises(NoDeviceLeftError) as e:
            for step, (x, y) in enumerate(data, 1):
                failover.train_step(x, y, CFG, step=step)
    finally:
        for d in devices:
            d.close()
    said = str(e.value)
    assert "device d0 (cpu:1) failed during conv1 forward" in said, said
    assert "device d1 (cpu:1) failed during load_shard" in said and "cannot take more" in said
    assert said.endswith("no device is left to train on")


def test_an_injected_fault_raises_in_the_worker_like_a_real_failure():
    d = make_devices(parse_devices("cpu:1"))[0]
    try:
        d.inject_fault("forward", 2)
        d.step = 2
        with pytest.raises(DeviceError, match=r"device d0 \(cpu:1\) failed during conv1 "
                                              r"forward: InjectedFault") as e:
            d.call("conv1 forward", lambda: None, tag="conv1")
        assert e.value.device is d
        with pytest.raises(DeviceError, match="failed earlier"):   # its step work stays failed
            d.call("conv2 backward", lambda: None, tag="conv2")
        assert d.call("salvage", lambda: "read") == "read"         # its memory stays readable
    finally:
        d.close()
    assert set(PHASES) == {"im2col", "forward", "backward", "input_gradient", "update"}


# ================================================================ the command line

DATA_ARGS = ["--kernels", "4,6", "--kernel-size", "3", "--batch-size", "8", "--steps",
             str(STEPS), "--quiet", "--lr", "0.05"]


@pytest.fixture
def data(npz_dataset):
    return npz_dataset(n=48, shape=(1, 12, 12), classes=3)


@pytest.fixture
def reference(cli, data, tmp_path):
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", "cpu:1", "--save",
              tmp_path / "ref.npz")
    assert res.code == 0, res.err
    return load_npz(tmp_path / "ref.npz")


@pytest.mark.parametrize("balance", ["static", "even", "dynamic"])
def test_cli_training_goes_on_after_a_failure(cli, data, reference, tmp_path, monkeypatch,
                                              balance):
    monkeypatch.setenv("PYHET_FAULT", f"d0:backward:{FAIL_AT}")
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", "cpu:1,cpu:1",
              "--balance", balance, "--save", tmp_path / "w.npz", "--json")
    assert res.code == 0, res.err
    summary = json.loads(res.out.strip().splitlines()[-1])
    [event] = summary["failures"]
    assert event["step"] == FAIL_AT and event["device"] == "d0" and event["phase"] == "backward"
    assert event["partition"] == summary["partition"] == {"conv1": {"d0": 0, "d1": 4},
                                                          "conv2": {"d0": 0, "d1": 6}}
    warnings = [line for line in res.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "d0" in warnings[0] and f"step {FAIL_AT}" in warnings[0]
    got = load_npz(tmp_path / "w.npz")
    assert_same_weights({k: got[k] for k in reference if k != "arch"},
                        {k: reference[k] for k in reference if k != "arch"})


@pytest.mark.parametrize("phase", ["forward", "update"])
def test_two_devices_failing_in_one_phase_are_each_recorded(cli, data, reference, tmp_path,
                                                            monkeypatch, phase):
    """Only the first error of a phase was handled: the second device was recorded at the
    redone step's first phase, failing "earlier", a failure that appeared nowhere."""
    monkeypatch.setenv("PYHET_FAULT", f"d0:{phase}:{FAIL_AT},d1:{phase}:{FAIL_AT}")
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices",
              "cpu:1,cpu:1,numpy", "--deterministic", "--save", tmp_path / "w.npz", "--json")
    assert res.code == 0, res.err
    summary = json.loads(res.out.strip().splitlines()[-1])
    assert [(f["device"], f["phase"], f["step"]) for f in summary["failures"]] == [
        ("d0", phase, FAIL_AT), ("d1", phase, FAIL_AT)]
    assert all("earlier" not in f["message"] for f in summary["failures"])
    assert summary["partition"] == {"conv1": {"d0": 0, "d1": 0, "d2": 4},
                                    "conv2": {"d0": 0, "d1": 0, "d2": 6}}
    got = load_npz(tmp_path / "w.npz")
    assert_same_weights({k: got[k] for k in reference if k != "arch"},
                        {k: reference[k] for k in reference if k != "arch"})


def test_cli_summary_has_no_failures_when_none_happen(cli, data):
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", "cpu:1", "--json")
    assert res.code == 0 and json.loads(res.out.strip().splitlines()[-1])["failures"] == []


def test_cli_every_device_failing_ends_with_one_line_and_a_checkpoint_that_resumes(
        cli_process, cli, data, reference, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("PYHET_FAULT", "d0:forward:2,d1:update:4")
    res = cli_process("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices",
                      "cpu:1,cpu:1", "--checkpoint-dir", ckpt, timeout=120)
    assert res.code == 1 and res.out == "" and "Traceback" not in res.err
    lines = res.err.strip().splitlines()
    assert len(lines) == 2 and "warning" in lines[0], res.err   # d0's failure, then the error
    assert lines[1].startswith("pyhet: error: device d1") and "no device is left" in lines[1]
    assert "checkpoint-000000003.npz" in lines[1]
    assert sorted(p.name for p in ckpt.glob("checkpoint-*")) == ["checkpoint-000000003.npz"]
    monkeypatch.delenv("PYHET_FAULT")
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", "cpu:1",
              "--checkpoint-dir", ckpt, "--resume", "--save", tmp_path / "resumed.npz")
    assert res.code == 0, res.err
    got = load_npz(tmp_path / "resumed.npz")
    assert_same_weights({k: got[k] for k in reference if k != "arch"},
                        {k: reference[k] for k in reference if k != "arch"})


def test_cli_one_device_failing_without_a_checkpoint_dir(cli, data, monkeypatch):
    monkeypatch.setenv("PYHET_FAULT", "d0:forward:2")
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", "cpu:1")
    assert res.code == 1 and res.out == ""
    assert res.err.strip().splitlines() == [
        "pyhet: error: device d0 (cpu:1) failed during conv1 forward: InjectedFault: injected "
        "fault (PYHET_FAULT) at step 2, forward, and no device is left to train on"]


@pytest.mark.parametrize("value,words", [
    ("d3:forward:2", "no device d3"), ("d0:fwd:2", "phase must be one of"),
    ("d0:forward", "DEVICE:PHASE:STEP"), ("d0:forward:0", "step must be")])
def test_cli_a_bad_fault_is_one_line(cli, data, monkeypatch, value, words):
    monkeypatch.setenv("PYHET_FAULT", value)
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", "cpu:1")
    assert res.code == 1 and res.out == ""
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyhet: error: PYHET_FAULT") and \
        words in lines[0], res.err


def test_api_fit_goes_on_after_a_failure(monkeypatch, capsys):
    """And says so as a RuntimeWarning at the program's line, progress or not (it said nothing
    without progress=True: a line to stderr, dropped)."""
    import warnings

    import pyhet

    monkeypatch.setenv("PYHET_FAULT", "d1:update:2")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 12, 12)).astype(np.float32)
    y = np.arange(16) % 3
    with pyhet.Network("4C3-P2-6C3-P2", (1, 12, 12), 3, devices="cpu:1,cpu:1",
                       balance="even") as net:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            summary = net.fit(x, y, steps=3, batch_size=8)
        assert [f["device"] for f in summary["failures"]] == ["d1"]
        [w] = said
        assert w.category is RuntimeWarning and w.filename == __file__, (w.filename, w.lineno)
        assert str(w.message).startswith("device d1 (cpu:1) failed during conv1 update: ")
        assert "its kernels moved to the other devices" in str(w.message)
        assert capsys.readouterr().err == ""
        assert net.partition == {"conv1": {"d0": 4, "d1": 0}, "conv2": {"d0": 6, "d1": 0}}


# ================================================================ after a failure: summary, resume

def test_a_failed_device_is_left_out_for_its_failure_and_a_resume_uses_it_again(
        cli, data, tmp_path, monkeypatch):
    """left_out named a cost-model reason for a device that had failed, and a resume on the
    same devices took up the partition without it (static: for good)."""
    ck = tmp_path / "ck"
    # --deterministic: both devices hold kernels whatever the timings (equal declared speeds)
    argv = ["train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", "cpu:1,cpu:1",
            "--balance", "static", "--deterministic", "--checkpoint-dir", ck, "--json"]
    monkeypatch.setenv("PYHET_FAULT", "d1:forward:2")
    res = cli(*argv, "--steps", "3")
    assert res.code == 0, res.err
    s = json.loads(res.out.splitlines()[-1])
    assert [f["device"] for f in s["failures"]] == ["d1"]
    assert all(c["d1"] == 0 for c in s["partition"].values())
    notes = [n for n in s["left_out"] if n["device"] == "d1"]
    assert notes and all(n["why"] == "it failed in training (see failures)" for n in notes)
    monkeypatch.delenv("PYHET_FAULT")
    res = cli(*argv, "--steps", "5", "--resume")
    assert res.code == 0, res.err
    assert "leaves out d1, which failed in that run: planning the partition afresh" in res.err
    s = json.loads(res.out.splitlines()[-1])
    assert any(c["d1"] > 0 for c in s["partition"].values()), s["partition"]


def test_a_deterministic_failover_splits_by_the_declared_speeds(cli, data, monkeypatch):
    monkeypatch.setenv("PYHET_FAULT", "d0:forward:2")
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices",
              "cpu:1,cpu:1@0.5,numpy@0.1", "--deterministic", "--json")
    assert res.code == 0, res.err
    s = json.loads(res.out.splitlines()[-1])
    assert [f["device"] for f in s["failures"]] == ["d0"]
    for layer, counts in s["partition"].items():   # an even split was 2/2 and 3/3
        assert counts["d0"] == 0 and counts["d1"] > counts["d2"], (layer, counts)


@pytest.mark.parametrize("value,devices,words", [
    ("d1:forward:\u00b2", "cpu:1,cpu:1", "is not DEVICE:PHASE:STEP"),     # a superscript 2
    ("d1:forward:2,d1:backward:3", "cpu:1,cpu:1", "d1 is given twice"),
    ("d0:im2col:2", "numpy,numpy", "does its im2col inside its forward and backward"),
    ("d1:input_gradient:2", "cpu:1,numpy", "does its input_gradient inside"),
])
def test_faults_that_would_never_fire_or_cannot_be_read_are_one_line(cli, data, monkeypatch,
                                                                      value, devices, words):
    monkeypatch.setenv("PYHET_FAULT", value)
    res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", devices)
    assert res.code == 1 and res.out == "" and "Traceback" not in res.err
    assert len(res.err.strip().splitlines()) == 1 and words in res.err, res.err


def test_devices_refuses_devices_on_other_ranks(cli):
    res = cli("devices", "--devices", "1/cpu:1,cpu:1", "--kernels", "4,6", "--dataset",
              "synthetic", "--no-calibrate")
    assert res.code == 2 and "placed on MPI rank 1" in res.err, res.err


def test_every_device_failing_at_once_names_them_all_and_its_checkpoint_resumes_plainly(
        cli_process, cli, data, tmp_path, monkeypatch):
    """Both devices fail in one phase: the error names both; the checkpoint then holds a
    partition of no kernels on any device (the layers were on the master), which a resume
    on the same devices takes as devices that failed, not as a damaged plan; on one device,
    without a word about the plan."""
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("PYHET_FAULT", "d0:forward:2,d1:forward:2")
    res = cli_process("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices",
                      "cpu:1,cpu:1", "--balance", "even", "--checkpoint-dir", ckpt, timeout=120)
    assert res.code == 1 and "Traceback" not in res.err
    assert len(res.err.strip().splitlines()) == 1, res.err     # (no warning: at once)
    line = res.err.strip().splitlines()[-1]
    assert "device d0 (cpu:1) failed" in line and "device d1 (cpu:1) failed" in line, line
    assert "no device is left" in line and "checkpoint-000000001.npz" in line
    monkeypatch.delenv("PYHET_FAULT")
    for devices, words in (("cpu:1,cpu:1", "leaves out d0, d1, which failed"), ("cpu:1", None)):
        res = cli("train", "--dataset", f"npz:{data}", *DATA_ARGS, "--devices", devices,
                  "--balance", "static", "--checkpoint-dir", ckpt, "--resume", "--steps", "3")
        assert res.code == 0, res.err
        assert "warning" not in res.err and "cannot be reused" not in res.err, res.err
        assert words is None or words in res.err, res.err
