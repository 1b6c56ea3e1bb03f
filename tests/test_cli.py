"""The command line as README describes it: `pyhet train` options, the JSON summary, weight
files, checkpoints, exit statuses and messages; and the checks of `pyhet.ops`.

Every run trains a tiny network (`TINY`: kernels 3,4, k = 3, one cpu:1 device, batch 8) on a
tiny npz dataset written by the test, so the file runs in seconds.

x (N, C, H, W) images, y (N,) labels; weights in PyTorch's layout (see pyhet.model).
"""

import json
import math
import os
import sys

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import pyhet
from conftest import TINY, load_npz, make_npz_dataset, pmi_launcher, run_python

SUMMARY_FIELDS = {"steps", "epochs", "batch_size", "devices", "partition", "step_time_s",
                    "images_per_s", "train_loss", "test_accuracy", "conv_time_fraction"}


def test_version(cli):
    res = cli("--version")
    assert res.code == 0 and res.out.strip() == f"pyhet {pyhet.__version__}", res


def train_argv(data, *extra):
    return ["train", "--dataset", f"npz:{data}", *TINY, "--quiet", *extra]


def last_json(stdout):
    lines = stdout.strip().splitlines()
    assert lines, "nothing on stdout"
    return json.loads(lines[-1])


def assert_one_error_line(res, *words, code=1):
    """The run failed with `code`, wrote nothing to stdout and one line without a traceback to
    stderr that holds every word (case-insensitive)."""
    assert res.code == code, (res.code, res.err)
    assert res.out == ""
    assert "Traceback" not in res.err
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert len(lines) == 1, res.err
    for w in words:
        assert str(w).lower() in lines[0].lower(), (w, lines[0])


PARAM_NAMES = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias")


def assert_params_equal(a, b, rtol=1e-6):
    assert set(a) - {"arch"} == set(b) - {"arch"} == set(PARAM_NAMES)
    for k in PARAM_NAMES:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=1e-7, err_msg=k)


def params_differ(a, b):
    return any(not np.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in PARAM_NAMES)


# ---------------------------------------------------------------- an independent forward pass

def forward_float64(params, x):
    """Logits (N, M) of the network in float64 with sliding windows: the oracle of
    test_accuracy."""
    h = x.astype(np.float64)
    for layer in ("conv1", "conv2"):
        w, b = params[f"{layer}.weight"].astype(np.float64), params[f"{layer}.bias"]
        k = w.shape[2]
        win = sliding_window_view(h, (k, k), axis=(2, 3))         # (N, C, OH, OW, k, k)
        h = np.einsum("nchwij,kcij->nkhw", win, w) + b[None, :, None, None]
        h = np.maximum(h, 0)
        n, c, oh, ow = h.shape
        h = h[:, :, :oh // 2 * 2, :ow // 2 * 2].reshape(n, c, oh // 2, 2, ow // 2, 2)
        h = h.max(axis=(3, 5))
    h = h.reshape(h.shape[0], -1)
    return h @ params["fc.weight"].astype(np.float64).T + params["fc.bias"]


# ================================================================ the JSON summary

@pytest.mark.parametrize("n,extra,steps,epochs", [
    (24, ["--steps", "5"], 5, 5 / 3),
    (20, ["--steps", "4"], 4, 4 / 3),           # a partial last batch (20 = 8 + 8 + 4)
    (24, ["--epochs", "2"], 6, 2.0),            # no --steps: epochs x batches per epoch
])
def test_json_summary_fields_and_values(cli, npz_dataset, tmp_path, n, extra, steps, epochs):
    data = npz_dataset(n=n, n_test=10)
    out = tmp_path / "w.npz"
    res = cli(*train_argv(data, "--json", "--lr", "0.05", "--save", out, *extra))
    assert res.code == 0, res.err
    assert len(res.out.strip().splitlines()) == 1          # --json prints only the object
    s = last_json(res.out)
    assert SUMMARY_FIELDS <= set(s)
    assert s["steps"] == steps and isinstance(s["steps"], int)
    assert s["epochs"] == pytest.approx(epochs, abs=1e-4)
    assert s["batch_size"] == 8
    assert [(d["name"], d["spec"], d["rank"]) for d in s["devices"]] == [("d0", "cpu:1", 0)]
    assert s["partition"] == {"conv1": {"d0": 3}, "conv2": {"d0": 4}}
    st = s["step_time_s"]
    assert set(st) == {"median", "min", "max"}
    assert 0 < st["min"] <= st["median"] <= st["max"]
    assert isinstance(s["images_per_s"], float)
    assert 4 / st["max"] * 0.99 <= s["images_per_s"] <= 8 / st["min"] * 1.01
    assert isinstance(s["train_loss"], float) and math.isfinite(s["train_loss"])
    assert isinstance(s["conv_time_fraction"], float) and 0 <= s["conv_time_fraction"] <= 1

    # test_accuracy: the saved weights' accuracy on the whole test split
    ds, w = load_npz(data), load_npz(out)
    expected = float((forward_float64(w, ds["x_test"]).argmax(axis=1) == ds["y_test"]).mean())
    assert isinstance(s["test_accuracy"], float) and 0 <= s["test_accuracy"] <= 1
    assert s["test_accuracy"] == pytest.approx(expected, abs=1e-12)


def test_json_two_devices_partition_sums_to_kernel_counts(cli, npz_dataset):
    data = npz_dataset(n=24)
    for balance in ("dynamic", "static", "even"):
        res = cli("train", "--dataset", f"npz:{data}", "--kernels", "5,7", "--kernel-size", "3",
                  "--devices", "cpu:1,numpy", "--batch-size", "8", "--steps", "4", "--quiet",
                  "--json", "--balance", balance)
        assert res.code == 0, res.err
        s = last_json(res.out)
        assert [(d["name"], d["spec"], d["rank"]) for d in s["devices"]] == [
            ("d0", "cpu:1", 0), ("d1", "numpy", 0)]
        assert set(s["partition"]) == {"conv1", "conv2"}
        for layer, total in (("conv1", 5), ("conv2", 7)):
            part = s["partition"][layer]
            assert set(part) == {"d0", "d1"}, balance
            assert all(isinstance(v, int) and v >= 0 for v in part.values()), balance
            assert sum(part.values()) == total, (balance, part)
        assert s["test_accuracy"] is None                  # an npz without a test split


def test_json_synthetic_has_no_test_accuracy(cli):
    res = cli("train", "--dataset", "synthetic", "--kernels", "2,2", "--kernel-size", "5",
              "--devices", "cpu:1", "--batch-size", "16", "--steps", "2", "--quiet", "--json")
    assert res.code == 0, res.err
    s = last_json(res.out)
    assert s["test_accuracy"] is None
    assert s["steps"] == 2
    assert s["epochs"] == pytest.approx(2 / 64, abs=1e-4)  # 1,024 images, 64 batches of 16


def test_json_bundled_has_test_accuracy(cli):
    res = cli("train", "--dataset", "bundled", "--kernels", "2,2", "--devices", "cpu:1",
              "--steps", "2", "--quiet", "--json")
    assert res.code == 0, res.err
    s = last_json(res.out)
    assert isinstance(s["test_accuracy"], float) and 0 <= s["test_accuracy"] <= 1
    assert s["epochs"] == pytest.approx(2 / math.ceil(12000 / 64), abs=1e-4)


@pytest.mark.parametrize("as_json", [True, False])
def test_progress_goes_to_stderr_only(cli, npz_dataset, as_json):
    data = npz_dataset(n=24)
    argv = ["train", "--dataset", f"npz:{data}", *TINY, "--steps", "4"]  # not --quiet
    res = cli(*argv, *(["--json"] if as_json else []))
    assert res.code == 0, res.err
    assert "epoch 1" in res.err and "epoch 2" in res.err   # 4 steps of 3 per epoch
    for progress in ("epoch 1", "img/s", "###"):
        assert progress not in res.out, progress
    if as_json:
        assert len(res.out.strip().splitlines()) == 1
        last_json(res.out)
    else:
        assert "trained 4 steps" in res.out



def test_quiet_leaves_out_the_bars_and_the_set_ups_lines(cli, npz_dataset):
    """pyhet train says when it calibrates, the partition and why a device gets no kernels;
    --quiet leaves those out with the bars (the summary keeps the partition)."""
    data = npz_dataset(n=24)
    argv = ["train", "--dataset", f"npz:{data}", "--kernels", "5,7", "--kernel-size", "3",
            "--devices", "cpu:1,numpy", "--batch-size", "8", "--steps", "2", "--json"]
    loud = cli(*argv)
    assert loud.code == 0, loud.err
    assert "calibrating 2 devices (d0, d1)" in loud.err and "partition: conv1" in loud.err
    quiet = cli(*argv, "--quiet")
    assert quiet.code == 0, quiet.err
    assert quiet.err == ""
    assert set(last_json(quiet.out)["partition"]) == {"conv1", "conv2"}


def test_a_run_whose_loss_ends_far_above_a_guess_is_said_to_have_diverged(cli_process,
                                                                         tmp_path):
    """An lr of 1000 ends at a finite loss of about 1,400 (ln 10 = 2.3 is a guess's) with
    weights of order 1e10: a warning says it diverged, and what to change; an ordinary run says
    nothing."""
    argv = ["train", "--arch", "4C5-P2-8C5-P2", "--devices", "cpu:1", "--batch-size", "8",
            "--steps", "6", "--quiet", "--json", "--save", tmp_path / "w.npz"]
    res = cli_process(*argv, "--lr", "1000")
    assert res.code == 0, res.err
    loss = last_json(res.out)["train_loss"]
    assert loss > 100 * math.log(10)
    (line,) = res.err.strip().splitlines()
    assert line.startswith(f"pyhet: warning: the training loss ended at {loss:.4g}, "), line
    assert ("training diverged, though its values stayed finite; the weights are saved as they "
            "are; try a smaller --lr (now 1000)") in line, line
    res = cli_process(*argv)
    assert res.code == 0 and res.err == "", res.err


# ================================================================ steps, epochs, order, seed

def test_steps_cross_epoch_boundaries(cli, npz_dataset):
    data = npz_dataset(n=24)
    res = cli(*train_argv(data, "--steps", "10", "--json"))
    assert res.code == 0, res.err
    s = last_json(res.out)
    assert s["steps"] == 10
    assert s["epochs"] == pytest.approx(10 / 3, abs=1e-4)


def test_no_shuffle_is_file_order(cli, tmp_path):
    """With --no-shuffle the first S batches are the first S * 8 images of the file: training
    on a file cut after them gives the same weights."""
    classes = np.int64(3)
    full = make_npz_dataset(tmp_path / "full.npz", n=24, num_classes=classes)
    for steps in (1, 2):
        np.savez(tmp_path / "cut.npz", x=full["x"][:8 * steps], y=full["y"][:8 * steps],
                 num_classes=classes)
        runs = {}
        for name in ("full", "cut"):
            out = tmp_path / f"{name}-{steps}.npz"
            res = cli(*train_argv(tmp_path / f"{name}.npz", "--no-shuffle", "--steps", steps,
                                  "--save", out))
            assert res.code == 0, res.err
            runs[name] = load_npz(out)
        assert_params_equal(runs["full"], runs["cut"])


def test_no_shuffle_repeats_and_differs_from_shuffled(cli, npz_dataset, tmp_path):
    data = npz_dataset(n=24)
    runs = {}
    for name, extra in (("a", ["--no-shuffle"]), ("b", ["--no-shuffle"]), ("shuffled", [])):
        out = tmp_path / f"{name}.npz"
        res = cli(*train_argv(data, "--steps", "3", "--save", out, *extra))
        assert res.code == 0, res.err
        runs[name] = load_npz(out)
    assert_params_equal(runs["a"], runs["b"])
    assert params_differ(runs["a"], runs["shuffled"])


def test_seed_is_reproducible(cli, npz_dataset, tmp_path):
    data = npz_dataset(n=24)
    runs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        out = tmp_path / f"{name}.npz"
        res = cli(*train_argv(data, "--steps", "4", "--seed", seed, "--save", out))
        assert res.code == 0, res.err
        runs[name] = load_npz(out)
    assert_params_equal(runs["a"], runs["b"])
    assert params_differ(runs["a"], runs["c"])


# ================================================================ weight files

def test_save_writes_float32_in_pytorch_layout(cli, npz_dataset, tmp_path):
    # 14 x 13 images, k = 3: conv1 12 x 11 -> pool 6 x 5 -> conv2 4 x 3 -> pool 2 x 1
    data = npz_dataset(n=16, shape=(2, 14, 13), classes=5)
    out = tmp_path / "w.npz"
    res = cli(*train_argv(data, "--steps", "1", "--save", out))
    assert res.code == 0, res.err
    w = load_npz(out)
    assert list(w) == list(PARAM_NAMES) + ["arch"]      # float32 parameters, then the network
    assert json.loads(str(w["arch"]))["arch"] == "3C3-P2-4C3-P2"
    want = {"conv1.weight": (3, 2, 3, 3), "conv1.bias": (3,), "conv2.weight": (4, 3, 3, 3),
            "conv2.bias": (4,), "fc.weight": (5, 4 * 2 * 1), "fc.bias": (5,)}
    for k in PARAM_NAMES:
        assert w[k].dtype == np.float32, k
        assert w[k].shape == want[k], k
        assert np.isfinite(w[k]).all(), k
    assert list(tmp_path.glob("*.tmp*")) == []             # the atomic write cleaned up


def test_init_is_used_exactly(cli, npz_dataset, tmp_path):
    """A step with a negligible lr leaves --init's weights as they are: the file was loaded
    unchanged and saved back unchanged."""
    data = npz_dataset(n=16)
    rng = np.random.default_rng(5)
    shapes = {"conv1.weight": (3, 1, 3, 3), "conv1.bias": (3,), "conv2.weight": (4, 3, 3, 3),
              "conv2.bias": (4,), "fc.weight": (3, 4), "fc.bias": (3,)}
    w0 = {k: (rng.uniform(0.1, 1, s) * rng.choice([-1, 1], s)).astype(np.float32)
          for k, s in shapes.items()}
    np.savez(tmp_path / "w0.npz", **w0)
    res = cli(*train_argv(data, "--init", tmp_path / "w0.npz", "--steps", "1", "--lr", "1e-30",
                          "--momentum", "0", "--save", tmp_path / "w1.npz"))
    assert res.code == 0, res.err
    w1 = load_npz(tmp_path / "w1.npz")
    for k in PARAM_NAMES:
        np.testing.assert_array_equal(w1[k], w0[k], err_msg=k)


def test_init_from_saved_continues_deterministically(cli, npz_dataset, tmp_path):
    data = npz_dataset(n=24)
    res = cli(*train_argv(data, "--steps", "1", "--save", tmp_path / "w1.npz"))
    assert res.code == 0, res.err
    runs = []
    for i in range(2):
        out = tmp_path / f"w2-{i}.npz"
        res = cli(*train_argv(data, "--init", tmp_path / "w1.npz", "--steps", "1",
                              "--save", out, "--seed", "1"))
        assert res.code == 0, res.err
        runs.append(load_npz(out))
    assert_params_equal(runs[0], runs[1])
    assert params_differ(runs[0], load_npz(tmp_path / "w1.npz"))


def _good_weights():
    rng = np.random.default_rng(0)
    return {"conv1.weight": rng.standard_normal((3, 1, 3, 3)), "conv1.bias": np.zeros(3),
            "conv2.weight": rng.standard_normal((4, 3, 3, 3)), "conv2.bias": np.zeros(4),
            "fc.weight": rng.standard_normal((3, 4)), "fc.bias": np.zeros(3)}


def _write_weights(path, **changes):
    w = {k: v.astype(np.float32) for k, v in _good_weights().items()}
    for k, v in changes.items():
        if v is None:
            del w[k]
        else:
            w[k] = v
    np.savez(path, **w)


BAD_WEIGHTS = {
    "wrong shape": (lambda p: _write_weights(p, **{"conv1.weight": np.zeros((3, 1, 5, 5),
                                                                            np.float32)}),
                    ["conv1.weight", "shape", "(3, 1, 5, 5)", "(3, 1, 3, 3)"]),
    "wrong dtype": (lambda p: _write_weights(p, **{"fc.weight": np.zeros((3, 4))}),
                    ["fc.weight", "float32", "float64"]),
    "missing key": (lambda p: _write_weights(p, **{"fc.bias": None}), ["missing", "fc.bias"]),
    "NaN": (lambda p: _write_weights(p, **{"conv2.bias": np.array([0, np.nan, 0, 0],
                                                                  np.float32)}),
            ["conv2.bias", "nan"]),
    "infinite": (lambda p: _write_weights(p, **{"fc.bias": np.array([0, -np.inf, 0],
                                                                    np.float32)}),
                 ["fc.bias", "infinite"]),
    "not an npz": (lambda p: p.write_text("these are not weights\n"), ["npz"]),
    "a truncated npz": (lambda p: (_write_weights(p), p.write_bytes(p.read_bytes()[:200])),
                        ["npz"]),
    "a single .npy array": (lambda p: p.write_bytes(_npy_bytes(np.zeros(3, np.float32))),
                            ["npz"]),
    "no such file": (lambda p: None, ["no such file"]),
}


def _npy_bytes(a):
    import io
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_bad_init_file_exits_1_naming_file_and_problem(cli, npz_dataset, tmp_path, case):
    data = npz_dataset(n=16)
    path = tmp_path / "bad.npz"
    write, words = BAD_WEIGHTS[case]
    write(path)
    res = cli(*train_argv(data, "--init", path, "--steps", "1", "--json"))
    assert_one_error_line(res, str(path), *words)


def test_bad_init_file_in_a_process_has_no_traceback(cli_process, npz_dataset, tmp_path):
    data = npz_dataset(n=16)
    path = tmp_path / "bad.npz"
    _write_weights(path, **{"conv2.weight": np.zeros((4, 3, 3, 3))})   # float64
    res = cli_process(*train_argv(data, "--init", path, "--steps", "1", "--json"))
    assert_one_error_line(res, str(path), "conv2.weight", "float32")


# ================================================================ checkpoints

@pytest.mark.parametrize("first", [1, 2, 3, 5])
def test_resume_equals_an_uninterrupted_run(cli, npz_dataset, tmp_path, first):
    """20 images in batches of 8: 3 batches per epoch (the last one partial). Stopping after
    `first` steps and resuming to 7 gives the weights of 7 steps in one go; first = 2 and 5
    stop with exactly one batch of the epoch left."""
    data = npz_dataset(n=20)
    common = ["--momentum", "0.9", "--weight-decay", "0.001", "--lr", "0.05", "--seed", "2"]
    res = cli(*train_argv(data, *common, "--steps", "7", "--save", tmp_path / "whole.npz"))
    assert res.code == 0, res.err

    ckpt = tmp_path / "ckpt"
    res = cli(*train_argv(data, *common, "--steps", first, "--checkpoint-dir", ckpt))
    assert res.code == 0, res.err
    assert list(ckpt.glob("checkpoint-*.npz")), "no checkpoint written"
    res = cli(*train_argv(data, *common, "--steps", "7", "--checkpoint-dir", ckpt, "--resume",
                          "--save", tmp_path / "resumed.npz", "--json"))
    assert res.code == 0, res.err
    assert "resuming from" in res.err
    assert_params_equal(load_npz(tmp_path / "resumed.npz"), load_npz(tmp_path / "whole.npz"))


def test_resumed_summary_is_consistent(cli, npz_dataset, tmp_path):
    """After resuming, `steps` and `epochs` of the summary count the same steps."""
    data = npz_dataset(n=24)
    ckpt = tmp_path / "ckpt"
    assert cli(*train_argv(data, "--steps", "3", "--checkpoint-dir", ckpt)).code == 0
    res = cli(*train_argv(data, "--steps", "5", "--checkpoint-dir", ckpt, "--resume", "--json"))
    assert res.code == 0, res.err
    s = last_json(res.out)
    assert s["epochs"] == pytest.approx(s["steps"] / 3, abs=1e-4), s


def test_resume_with_no_checkpoint_yet_starts_fresh(cli, npz_dataset, tmp_path):
    data = npz_dataset(n=24)
    runs = []
    for i, extra in enumerate((["--checkpoint-dir", tmp_path / "empty", "--resume"], [])):
        out = tmp_path / f"w{i}.npz"
        res = cli(*train_argv(data, "--steps", "2", "--save", out, *extra))
        assert res.code == 0, res.err
        runs.append(load_npz(out))
    assert_params_equal(runs[0], runs[1])


# ================================================================ errors

@pytest.mark.parametrize("bad", [
    ["--kernels", "5"], ["--kernels", "a,b"], ["--kernels", "0,4"], ["--kernels", "1,2,3"],
    ["--batch-size", "0"], ["--batch-size", "x"], ["--lr", "-1"], ["--lr", "0"],
    ["--lr", "nan"], ["--lr", "inf"], ["--lr", "1e400"], ["--steps", "0"], ["--epochs", "0"],
    ["--kernel-size", "0"], ["--momentum", "-0.5"], ["--momentum", "1"], ["--momentum", "inf"],
    ["--momentum", "nan"], ["--weight-decay", "-1"], ["--weight-decay", "inf"],
    ["--weight-decay", "nan"], ["--seed", "-1"], ["--seed", "\u0661"], ["--steps", "\u0661"],
    ["--timeout", "nan"], ["--balance", "foo"], ["--devices", "tpu:0"],
    ["--devices", "cpu:\u0661"], ["--resume"], ["--frobnicate"],
])
def test_usage_errors_exit_2(cli, npz_dataset, bad):
    """A bad option value or combination: one line naming the option and where the options
    are listed, exit status 2, before anything is read or trained."""
    data = npz_dataset(n=16)
    res = cli("train", "--dataset", f"npz:{data}", "--devices", "cpu:1", "--steps", "1",
              "--quiet", *bad)
    assert_one_error_line(res, bad[0] if bad[0] != "--frobnicate" else "unrecognized",
                          "pyhet train --help", code=2)
    assert res.err.startswith("pyhet train: error: ")


@pytest.mark.parametrize("value", ["1e400", "nan", "x"])
def test_a_timeout_that_is_not_seconds_says_inf_is_the_no_limit(cli, value):
    """1e400 (inf to float) was "expected a finite number", beside an inf that is taken."""
    res = cli("train", "--timeout", value, "--steps", "1")
    assert_one_error_line(res, "--timeout", "finite number of seconds > 0, or inf for no limit",
                          code=2)


def test_no_command_is_a_usage_error(cli):
    res = cli()
    assert_one_error_line(res, "COMMAND", "pyhet --help", code=2)


def test_usage_error_in_a_process(cli_process):
    res = cli_process("train", "--kernels", "5")
    assert_one_error_line(res, "--kernels", "A,B", code=2)


@pytest.mark.parametrize("case", [
    "unknown dataset", "missing npz file", "tpu:0", "cpu:0", "cpu:1@2", "cpu:x",
    "too small", "momentum 1", "one class",
])
def test_other_errors_exit_1_with_one_line(cli, npz_dataset, tmp_path, case):
    data = npz_dataset(n=16)
    argv = {"dataset": f"npz:{data}", "devices": "cpu:1", "kernel-size": "3"}
    extra, words = [], []
    if case == "unknown dataset":
        argv["dataset"], words = "no-such-set", ["no-such-set", "npz:FILE"]
    elif case == "missing npz file":
        argv["dataset"] = f"npz:{tmp_path / 'absent.npz'}"
        words = [str(tmp_path / "absent.npz"), "no such file"]
    elif case in ("tpu:0", "cpu:0", "cpu:1@2", "cpu:x"):
        argv["devices"], words = case, [case]
    elif case == "too small":
        # 12x12, k = 4: conv1 9x9 -> pool 4x4 -> conv2 1x1 -> pool 0x0
        argv["kernel-size"], words = "4", ["12x12", "too small"]
    elif case == "momentum 1":
        extra, words = ["--momentum", "1"], ["momentum"]
    elif case == "one class":
        argv["dataset"] = f"npz:{npz_dataset('one.npz', n=16, classes=1)}"
        words = ["classes"]
    res = cli("train", *[a for k, v in argv.items() for a in (f"--{k}", v)],
              "--kernels", "3,4", "--steps", "1", "--quiet", "--json", *extra)
    # bad option values, device SPECs and combinations are usage errors
    usage = case in ("unknown dataset", "tpu:0", "cpu:0", "cpu:1@2", "cpu:x",
                     "resume without checkpoint dir", "momentum 1")
    assert_one_error_line(res, *words, code=2 if usage else 1)


def test_an_error_line_reaches_stderr_in_one_write(monkeypatch, tmp_path):
    """The ranks of an MPI job share the launcher's stderr: a line written as two writes (the
    text, then its newline, as print does) can run into another rank's line."""
    from pyhet.cli import main

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return len(text)

        def flush(self):
            pass

    err = Recorder()
    monkeypatch.setattr(sys, "stderr", err)
    code = main(["train", "--dataset", f"npz:{tmp_path / 'absent.npz'}", *TINY, "--quiet"])
    assert code == 1
    assert len(err.writes) == 1 and err.writes[0].startswith("pyhet: error: "), err.writes
    assert err.writes[0].endswith("\n") and err.writes[0].count("\n") == 1, err.writes
    # and the run's own lines (calibration, partition), where they are written
    err.writes.clear()
    make_npz_dataset(tmp_path / "d.npz", n=16)
    argv = ["train", "--dataset", f"npz:{tmp_path / 'd.npz'}", *TINY, "--steps", "1"]
    argv[argv.index("--devices") + 1] = "cpu:1,cpu:1"
    assert main(argv) == 0
    lines = [w for w in err.writes if w.startswith(("calibrating", "partition:"))]
    assert len(lines) == 2, err.writes
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in lines), lines
    assert lines[0] == "calibrating 2 devices (d0, d1) on the network's layer shapes...\n"


def test_unusable_gpu_exits_1(cli, npz_dataset):
    from pyhet.specs import cuda_device_count
    if cuda_device_count() > 0:
        pytest.skip("a GPU is present")
    data = npz_dataset(n=16)
    res = cli(*train_argv(data, "--steps", "1", "--json", "--devices", "gpu:0"))  # the last wins
    assert_one_error_line(res, "gpu")


def test_debug_shows_a_traceback(cli_process, tmp_path):
    absent = f"npz:{tmp_path / 'no-such-set.npz'}"
    res = cli_process("--debug", "train", "--dataset", absent, "--quiet")
    assert res.code == 1
    assert "Traceback" in res.err and "DataError" in res.err and "no-such-set" in res.err
    assert res.err.strip().splitlines()[-1].startswith("pyhet: error: ")
    plain = cli_process("train", "--dataset", absent, "--quiet")
    assert plain.code == 1 and "Traceback" not in plain.err
    # a usage error keeps its status 2 (the exception's way out of Python gave 1)
    res = cli_process("--debug", "train", "--save", tmp_path / "no" / "w.npz", "--quiet")
    assert res.code == 2 and "Traceback" in res.err and "does not exist" in res.err, res.err


@pytest.mark.parametrize("command", ["train", "evaluate", "devices", "plan"])
@pytest.mark.parametrize("name,words", [
    ("no-such-set", ["no-such-set", "bundled", "npz:FILE"]),
    ("npz:", ["npz:", "after the colon"]),
])
def test_a_dataset_name_that_is_none_is_a_usage_error(cli, command, name, words):
    """--dataset is checked before any work: a name that is not a dataset is a bad option value
    (exit 2), in every command that takes one."""
    extra = {"evaluate": ["--weights", "w.npz"], "devices": ["--no-calibrate"],
             "plan": ["--describe", "cpu:gflops=10,count=2"]}.get(command, [])
    res = cli(command, "--dataset", name, *extra)
    assert_one_error_line(res, "--dataset", *words, code=2)


def test_debug_after_the_command_is_accepted(cli_process, tmp_path):
    """`pyhet train ... --debug` (where a user would add it) works as well."""
    res = cli_process("train", "--dataset", f"npz:{tmp_path / 'no-such-set.npz'}", "--quiet",
                      "--debug")
    assert res.code == 1, res.err
    assert "Traceback" in res.err and "no-such-set" in res.err


def test_infinite_images_are_refused(cli, npz_dataset):
    x = np.zeros((16, 1, 12, 12), np.float32)
    x[3, 0, 4, 4] = np.inf
    data = npz_dataset(n=16, x=x)
    res = cli(*train_argv(data, "--steps", "1", "--json"))
    assert_one_error_line(res, str(data), "infinite")


def test_diverging_loss_stops_with_exit_1(cli_process, npz_dataset, tmp_path):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 1, 12, 12)) * 1e30).astype(np.float32)
    data = npz_dataset(n=16, x=x)
    out = tmp_path / "w.npz"
    res = cli_process(*train_argv(data, "--steps", "8", "--lr", "10", "--json", "--save", out))
    assert res.code == 1, (res.code, res.err)
    assert res.out == "" and "Traceback" not in res.err
    line = res.err.strip().splitlines()[-1]
    assert line.startswith("pyhet: error:") and "loss became" in line
    assert "nan" in line.lower() or "inf" in line.lower()
    assert not out.exists()


def test_a_loss_that_overflows_before_any_update_blames_the_inputs_not_the_lr(cli_process,
                                                                             npz_dataset):
    """The first step's loss comes before any update: where it is not finite, the inputs (or
    the weights the run started from) are the cause, which a smaller --lr cannot mend."""
    data = npz_dataset(n=16, x=np.full((16, 1, 12, 12), 3.4e38, np.float32))
    res = cli_process("train", "--dataset", f"npz:{data}", "--arch", "4C3-P2-8N", "--devices",
                      "cpu:1", "--steps", "3", "--quiet")
    assert_one_error_line(res, "the loss is inf at step 1", "before this run updated any weight",
                          "largest magnitude is 3.4e+38", code=1)
    assert "--lr" not in res.err


def test_ctrl_c_while_the_command_loads_is_its_status_and_one_line(monkeypatch, capsys):
    """pyhet._loading_interrupted: for the `pyhet` command (or python -m pyhet) a Ctrl-C while
    its modules load ends it with 130 and one line; a program that imports pyhet gets its
    KeyboardInterrupt back (the function returns, the import re-raises)."""
    import pyhet

    def exit_(code):
        raise SystemExit(code)
    monkeypatch.setattr(os, "_exit", exit_)
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    for argv, orig in ((["/usr/bin/pyhet", "train"], ["python", "/usr/bin/pyhet", "train"]),
                       (["-m", "train"], ["python", "-m", "pyhet", "train"])):
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sys, "orig_argv", orig)
        with pytest.raises(SystemExit) as e:
            pyhet._loading_interrupted()
        assert e.value.code == 130 and capsys.readouterr().err == "pyhet: interrupted\n"
    monkeypatch.setattr(sys, "argv", ["myprog.py"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "myprog.py"])
    assert pyhet._loading_interrupted() is None and capsys.readouterr().err == ""


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_while_the_command_loads_under_mpiexec_asks_the_launcher(monkeypatch, capsys,
                                                                       rank):
    """Under MPICH's mpiexec the rank asks the launcher, over its PMI socket, to end the job
    with 130 (it ended by the signal, whose status MPICH gives as 2, or as 11 where it met
    the rank that signal killed). In this process, the launcher played by a thread."""
    import pyhet

    def exit_(code):
        raise SystemExit(code)
    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(os, "kill", lambda *a: pytest.fail("ended by the signal"))
    monkeypatch.setattr(sys, "argv", ["/usr/bin/pyhet", "train"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "/usr/bin/pyhet", "train"])
    with pmi_launcher(monkeypatch, rank) as heard:
        with pytest.raises(SystemExit) as e:
            pyhet._loading_interrupted()
    assert e.value.code == 130
    assert heard == [b"cmd=init pmi_version=1 pmi_subversion=1\n", b"cmd=abort exitcode=130\n"]
    assert capsys.readouterr().err == ("pyhet: interrupted\n" if rank == 0 else "")


def test_ctrl_c_while_the_parser_is_built_or_the_cli_loads_is_one_line():
    """Two windows after the package has loaded: pyhet.cli being found and read (before its
    own guard), and its parser being built; each was a traceback."""
    parser_built = (
        "import os, shutil, signal, sys\n"
        "from pyhet import cli\n"
        "def size(*a, **k):   # argparse asks for the terminal's size while it builds the help\n"
        "    shutil.get_terminal_size = size.orig\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return size.orig(*a, **k)\n"
        "size.orig, shutil.get_terminal_size = shutil.get_terminal_size, size\n"
        "sys.argv = ['pyhet', 'train', '--steps', '1']\n"
        "cli.entry()\n")
    cli_loading = (
        "import sys, pyhet\n"
        "class Stop:   # Ctrl-C as pyhet.cli is looked for\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pyhet.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Stop())\n"
        "sys.argv = ['pyhet', 'train']\n"
        "from pyhet._command import entry\n"
        "entry()\n")
    for code in (parser_built, cli_loading):
        p = run_python(code)
        assert (p.returncode, p.stderr) == (130, "pyhet: interrupted\n"), (p.returncode, p.stderr)


@pytest.mark.parametrize("module", ["pyhet.ops", "pyhet.cli"])
def test_ctrl_c_that_a_library_reports_as_a_failed_import_is_one_line(module):
    """NumPy turns Ctrl-C while its C extensions load into an ImportError (a page of advice on
    broken installs, status 1); the KeyboardInterrupt is in its chain."""
    code = ("import sys\n"
            "class Stop:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name == {module!r}:\n"
            "            try:\n"
            "                raise KeyboardInterrupt\n"
            "            except KeyboardInterrupt as e:\n"
            "                raise ImportError('the C extensions failed to load') from e\n"
            "sys.meta_path.insert(0, Stop())\n"
            "sys.argv = ['pyhet', 'train']\n"
            "from pyhet._command import entry\n"
            "entry()\n")
    p = run_python(code)
    assert (p.returncode, p.stderr) == (130, "pyhet: interrupted\n"), (p.returncode, p.stderr)
    # an import that fails on its own is still its traceback
    p = run_python(code.replace("raise KeyboardInterrupt", "raise OSError('no such file')")
                   .replace("except KeyboardInterrupt", "except OSError"))
    assert p.returncode == 1 and "ImportError: the C extensions failed to load" in p.stderr


def test_sigterm_outside_training_is_one_line_and_143():
    # before training installs its handlers (and in evaluate, predict, plan, bench) SIGTERM
    # killed the process without a word
    code = ("import os, signal, sys\n"
            "from pyhet import cli\n"
            "made = cli.TrainConfig\n"
            "def config(*a, **k):   # as the run is set up, before training's own handlers\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return made(*a, **k)\n"
            "cli.TrainConfig = config\n"
            "sys.argv = ['pyhet', 'train', '--dataset', 'synthetic', '--steps', '1']\n"
            "cli.entry()\n")
    p = run_python(code)
    assert (p.returncode, p.stderr) == (143, "pyhet: interrupted by SIGTERM\n"), p.stderr


def test_a_signal_once_the_command_is_over_changes_nothing():
    # after the output was written, Python's shutdown killed the process by the signal (no
    # line, status -15) or broke the exit with a traceback (status 1)
    code = ("import os, signal, sys, time\n"
            "from pyhet import cli\n"
            "end = sys.exit\n"
            "def exit(code):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(0.1)\n"
            "    end(code)\n"
            "sys.exit = exit\n"
            "sys.argv = ['pyhet', 'plan', '--describe', 'g:gflops=5', '--json']\n"
            "cli.entry()\n")
    p = run_python(code)
    assert (p.returncode, p.stderr) == (0, ""), (p.returncode, p.stderr)
    assert json.loads(p.stdout)["devices"]


@pytest.mark.parametrize("argv", [["train", "--steps=--"], ["train", "--init=--"],
                                  ["evaluate", "--weights=--"], ["plan", "--sweep=--"],
                                  ["bench", "gemm", "--shapes=--"],
                                  ["plan", "--describe", "g:gflops=1", "--describe=--"]])
def test_an_option_given_dashes_as_its_value_is_a_usage_error(cli, argv):
    # argparse stored [] without calling the option's check: tracebacks, or the default used
    res = cli(*argv)
    assert res.code == 2, (res.code, res.err)
    assert f"argument {argv[-1].split('=')[0]}: expected one argument, got '--'" in res.err


def test_a_long_bad_choice_is_quoted_short(cli):
    res = cli("train", "--balance", "x" * 100_000)
    assert res.code == 2 and "invalid choice" in res.err and len(res.err) < 400
    res = cli("train", "--steps", "1", "y" * 100_000)
    assert res.code == 2 and "unrecognized arguments: 'yyy" in res.err and len(res.err) < 400
    res = cli("train", "--steps", "1", "--frob")
    assert res.code == 2 and "unrecognized arguments: --frob (see" in res.err


# ================================================================ help, imports

def test_help_in_a_process(cli_process):
    res = cli_process("train", "--help")
    assert res.code == 0 and res.err == ""
    for opt in ("--kernels", "--kernel-size", "--dataset", "--devices", "--balance", "--steps",
                "--no-shuffle", "--init", "--save", "--checkpoint-dir", "--resume", "--json"):
        assert opt in res.out, opt
    top = cli_process("--help")
    assert top.code == 0 and "train" in top.out


def test_import_pyhet_loads_no_heavy_optional_modules():
    code = ("import sys, pyhet, pyhet.cli, pyhet.train, pyhet.devices, pyhet.model\n"
            "print(sorted(m for m in ('cupy', 'mpi4py', 'torch') if m in sys.modules))")
    p = run_python(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_a_cpu_training_run_loads_no_heavy_optional_modules(tmp_path):
    data = tmp_path / "d.npz"
    make_npz_dataset(data, n=16)
    code = ("import sys\nfrom pyhet.cli import main\n"
            f"assert main({train_argv(data, '--steps', '1')!r}) == 0\n"
            "print(sorted(m for m in ('cupy', 'mpi4py', 'torch') if m in sys.modules))")
    p = run_python(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"


# ================================================================ pyhet.ops checks

def test_gemm_matches_numpy_on_odd_sizes():
    from pyhet import ops
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 1, 1), (7, 17, 3), (17, 1, 255), (3, 255, 7)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        c = ops.gemm(a, b, threads=1)
        assert c.dtype == np.float32 and c.shape == (m, n)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        # float32 sums of k terms: error within a few ulps of the sum of |terms|
        bound = 1e-6 * k * (np.abs(a).astype(np.float64) @ np.abs(b)) + 1e-7
        assert (np.abs(c - ref) <= bound).all(), (m, k, n)


def test_gemm_non_contiguous_inputs_give_the_right_answer():
    from pyhet import ops
    rng = np.random.default_rng(1)
    big = rng.standard_normal((20, 34)).astype(np.float32)
    a = big[:7, ::2]                                   # (7, 17), strided columns
    b = rng.standard_normal((3, 17)).astype(np.float32).T      # (17, 3), Fortran order
    fa = np.asfortranarray(rng.standard_normal((5, 17)).astype(np.float32))
    for x, y in ((a, b), (fa, b), (a[::-1], b[::-1][::-1])):
        assert not (x.flags.c_contiguous and y.flags.c_contiguous)
        c = ops.gemm(x, y, threads=1)
        np.testing.assert_allclose(c, x.astype(np.float64) @ y.astype(np.float64),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args,kwargs,error", [
    ((np.ones((2, 3)), np.ones((3, 2), np.float32)), {}, TypeError),          # float64
    ((np.ones((2, 3), np.float32), np.ones((3, 2), np.float64)), {}, TypeError),
    (([[1.0, 2.0]], np.ones((2, 2), np.float32)), {}, TypeError),             # a list
    ((np.ones((2, 3), np.float32), np.ones((4, 2), np.float32)), {}, ValueError),
    ((np.ones(3, np.float32), np.ones((3, 2), np.float32)), {}, ValueError),  # 1-d
    ((np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)), {"threads": 0}, ValueError),
    ((np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)), {"threads": -2}, ValueError),
])
def test_gemm_argument_checks(args, kwargs, error):
    from pyhet import ops
    with pytest.raises(error):
        ops.gemm(*args, **kwargs)


@pytest.mark.slow
def test_bare_train_learns_the_bundled_data(tmp_path):
    """`pyhet train` with every default (the bundled Fashion-MNIST subset, 32,64 kernels, two
    epochs) reaches the accuracy the README promises, as its own process would."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pyhet", "train", "--json", "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 * 188 and summary["dataset"] == "bundled"
    assert summary["test_accuracy"] >= 0.75, summary


def test_bench_help_lists_the_benchmarks(cli):
    """`pyhet bench --help` (before a benchmark's name) lists them and exits 0; after a name,
    --help is the benchmark's own."""
    from pyhet.cli import BENCHMARKS

    res = cli("bench", "--help")
    assert res.code == 0, res.err
    assert res.out.startswith("usage: pyhet bench") and all(b in res.out for b in BENCHMARKS)
    res = cli("bench", "pair", "--help")
    assert res.code == 0 and res.out.startswith("usage: pyhet bench pair"), res.err


# ================================================================ paths, the summary's batch

def test_a_tilde_after_an_equals_sign_is_the_home_folder(cli, tmp_path, monkeypatch):
    # the shell expands ~ only as a word's start: --checkpoint-dir=~/ck made a folder named ~
    data = tmp_path / "d.npz"
    make_npz_dataset(data, n=16)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    res = cli(*train_argv(data, "--steps", "2", "--checkpoint-dir=~/ck", "--save=~/w.npz"))
    assert res.code == 0, res.err
    assert (home / "w.npz").is_file() and (home / "ck").is_dir()
    assert not (tmp_path / "~").exists()
    res = cli("predict", "--weights=~/w.npz", f"--input={data}", "--output=~/p.npz",
              "--devices", "cpu:1")
    assert res.code == 0 and (home / "p.npz").is_file(), res.err


def test_the_summary_gives_the_batch_trained(cli, tmp_path):
    # a --batch-size above the split's size trains batches of the whole split
    data = tmp_path / "d.npz"
    make_npz_dataset(data, n=16)
    argv = train_argv(data, "--steps", "2", "--json")
    argv[argv.index("--batch-size") + 1] = "100000"
    res = cli(*argv)
    assert res.code == 0, res.err
    assert json.loads(res.out.splitlines()[-1])["batch_size"] == 16


def test_save_without_a_test_split_checks_the_outputs_overflow(cli, tmp_path):
    # finite weights whose outputs overflow on every input were saved with exit status 0
    data = tmp_path / "d.npz"
    make_npz_dataset(data, n=16)
    res = cli(*train_argv(data, "--steps", "1", "--lr", "1e37", "--save", tmp_path / "w.npz"))
    assert res.code == 1, res.err
    assert "the loss on the first 8 training images is nan" in res.err
    assert "the weights were not saved" in res.err and not (tmp_path / "w.npz").exists()
    # without --save too: a run whose outputs all overflow has diverged (it ended with 0)
    res = cli(*train_argv(data, "--steps", "1", "--lr", "1e37"))
    assert res.code == 1, res.err
    assert "the loss on the first 8 training images is nan" in res.err
    assert "not saved" not in res.err
