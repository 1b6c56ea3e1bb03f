"""The summary's figures count what happened: the images each step trained (a batch larger
than the dataset, a partial last batch), the phase times of the training steps alone (not the
test split's evaluation, which has its own eval_time_s), and a run whose weights became NaN or
infinite ends with an error and writes nothing.

x (N, C, H, W) images, y (N,) labels.
"""

import math

import numpy as np
import pytest

import pyhet
from conftest import TINY, load_npz
from pyhet.errors import PyhetError, TrainingError, UsageError

ARCH = "3C3-P2-4C3-P2"


def arrays(n, seed=0, scale=1.0, shape=(1, 12, 12)):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, *shape)) * scale).astype(np.float32)
    return x, np.arange(n) % 3


def train_argv(data, *extra):
    return ["train", "--dataset", f"npz:{data}", *TINY, "--quiet", *extra]


def assert_one_error_line(res, *words, code=1):
    assert res.code == code, (res.code, res.err)
    assert res.out == "" and "Traceback" not in res.err
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert len(lines) == 1, res.err
    for w in words:
        assert str(w).lower() in lines[0].lower(), (w, lines[0])


# ================================================================ images per second

@pytest.mark.parametrize("n,batch_size,want", [
    (16, 1000, [16, 16, 16]),          # every batch is the whole dataset: 16 images, not 1000
    (20, 8, [8, 8, 4, 8, 8, 4]),       # a partial last batch in each epoch
    (24, 8, [8, 8, 8, 8]),
])
def test_images_per_s_counts_the_images_in_each_batch(n, batch_size, want):
    x, y = arrays(n)
    seen = []
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="cpu:1") as net:
        s = net.fit(x, y, steps=len(want), batch_size=batch_size, callback=seen.append)
    images = [i["images"] for i in seen]
    assert images == want
    # the timed steps (all but the warm-up step): their images over their time
    times = [i["step_time_s"] for i in seen]
    assert s["images_per_s"] == pytest.approx(sum(images[1:]) / sum(times[1:]), rel=1e-9)
    assert s["images_per_s"] <= max(images) / s["step_time_s"]["min"] * (1 + 1e-9)


# ================================================================ phase times, evaluation time

def test_phase_times_are_the_training_steps_alone():
    """phase_time_s counts the timed steps of this fit() only: not the predict() before it, nor
    the warm-up step (left out of the step's median and parts too), nor the evaluation of the
    test split after its last step."""
    x, y = arrays(24)
    xt, yt = arrays(400, seed=1)
    steps = 3
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="cpu:1") as net:
        # starts the devices (planned for fit()'s batch, so fit keeps them), runs their phases
        net.predict(xt, batch_size=8)
        convs = net._net.convs
        first, after = {}, {}

        def last_step(info):                   # runs after the step, before the evaluation
            if info["step"] == 1:
                first.update({c.name: dict(c.phases.parts) for c in convs})
            if info["step"] == steps:
                after.update({c.name: dict(c.phases.parts) for c in convs})

        s = net.fit(x, y, steps=steps, batch_size=8, x_test=xt, y_test=yt, callback=last_step)
        total = {c.name: dict(c.phases.parts) for c in convs}
    for layer, parts in s["phase_time_s"].items():
        for phase, per_step in parts.items():
            want = (after[layer][phase] - first[layer].get(phase, 0.0)) / (steps - 1)
            assert per_step == pytest.approx(round(want, 6), abs=1.5e-6), (layer, phase)
        # the evaluation ran these layers' forward phases again, uncounted
        assert total[layer]["forward"] > after[layer]["forward"]
    assert isinstance(s["eval_time_s"], float) and s["eval_time_s"] >= 0
    assert s["test_accuracy"] is not None
    # a fit of one step: that step is the figure (no other to time), predict() still left out
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="cpu:1") as net:
        net.predict(xt, batch_size=8)
        before = {c.name: dict(c.phases.parts) for c in net._net.convs}
        after = {}
        s = net.fit(x, y, steps=1, batch_size=8, callback=lambda info: after.update(
            {c.name: dict(c.phases.parts) for c in net._net.convs}))
    for layer, parts in s["phase_time_s"].items():
        for phase, per_step in parts.items():
            want = after[layer][phase] - before[layer].get(phase, 0.0)
            assert per_step == pytest.approx(round(want, 6), abs=1.5e-6), (layer, phase)


def test_the_cost_models_figures_keep_their_digits():
    """predicted_conv_time_s was rounded to 4 decimals (a 0.4 ms prediction to one digit, which
    bench plan divides by); now to 6, as conv_time_s's parts, so the predicted step is the
    predicted conv time plus the measured rest of the step to 1e-6."""
    x, y = arrays(24)
    with pyhet.Network("2C3-P2", (1, 12, 12), 3, devices="cpu:1,cpu:1", balance="static") as net:
        s = net.fit(x, y, steps=4, batch_size=4)
    pred, conv = s["predicted_conv_time_s"], s["conv_time_s"]
    assert pred > 0 and pred == round(pred, 6)
    rest = s["step_time_s"]["median"] - conv
    assert s["predicted_step_time_s"] == pytest.approx(pred + rest, abs=1.5e-6)


def test_step_parts_are_medians_of_the_timed_steps():
    """step_parts_s: each part of Net.train_step (conv forward, fc, conv backward, update) as its
    median over the steps after the warm-up one, and the rest of the step's median as other."""
    import statistics

    x, y = arrays(40)
    seen = []
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="cpu:1,cpu:1") as net:
        net.predict(x[:8])                     # starts the devices, for fit()'s batch
        inner = net._net.train_step

        def spy(*args, **kwargs):
            loss = inner(*args, **kwargs)
            seen.append(dict(args[3].parts))   # the step's PartTimer
            return loss
        net._net.train_step = spy
        s = net.fit(x, y, steps=6, batch_size=8)
    assert len(seen) == 6
    parts = s["step_parts_s"]
    assert list(parts) == ["conv_forward", "fc", "conv_backward", "update", "other"]
    for k in ("conv_forward", "fc", "conv_backward", "update"):
        want = statistics.median(p[k] for p in seen[1:])
        assert parts[k] == pytest.approx(round(want, 6), abs=1.5e-6), k
        assert parts[k] > 0
    rest = s["step_time_s"]["median"] - sum(statistics.median(p[k] for p in seen[1:])
                                            for k in parts if k != "other")
    assert parts["other"] == pytest.approx(round(max(0.0, rest), 6), abs=1.5e-6)


def test_a_batch_size_beyond_the_data_sizes_memory_for_the_data(cli, npz_dataset):
    """A --batch-size far above the training split trains batches of the whole split: memory,
    calibration and the test split's evaluation are sized for that, not refused for the
    batch size given."""
    import json

    res = cli(*train_argv(npz_dataset(n=16, n_test=40), "--steps", "2", "--json",
                          "--batch-size", str(10 ** 9)))
    assert res.code == 0, res.err
    s = json.loads(res.out.strip().splitlines()[-1])
    assert s["batch_size"] == 16 and s["steps"] == 2 and s["epochs"] == 2   # the batch trained
    assert s["images_per_s"] <= 16 / s["step_time_s"]["min"] * (1 + 1e-9)
    assert s["test_accuracy"] is not None


def test_eval_time_is_null_without_a_test_split(cli, npz_dataset):
    import json

    res = cli(*train_argv(npz_dataset(n=16), "--steps", "2", "--json"))
    assert res.code == 0, res.err
    s = json.loads(res.out.strip().splitlines()[-1])
    assert s["eval_time_s"] is None and s["test_accuracy"] is None
    res = cli(*train_argv(npz_dataset("t.npz", n=16, n_test=8), "--steps", "2", "--json"))
    s = json.loads(res.out.strip().splitlines()[-1])
    assert isinstance(s["eval_time_s"], float) and s["eval_time_s"] >= 0


# ================================================================ non-finite weights

def test_an_update_to_infinite_weights_fails_and_saves_nothing(cli_process, npz_dataset,
                                                               tmp_path):
    """Images of size 1e4 and lr 1e36: the first step's loss is finite (computed before the
    update), the update makes conv1's weights infinite. Exit 1, one line, no --save file and
    no checkpoint."""
    x, y = arrays(16, scale=1e4)
    data = npz_dataset(n=16, x=x, y=y)
    out, ckpt = tmp_path / "w.npz", tmp_path / "ckpt"
    res = cli_process(*train_argv(data, "--steps", "1", "--lr", "1e36", "--save", out,
                                  "--checkpoint-dir", ckpt, "--json"))
    assert_one_error_line(res, "conv1.weight", "NaN or infinite", "after step 1",
                          "neither this checkpoint nor a weight file was written", "--lr",
                          "1e+36")
    assert not out.exists()
    assert not ckpt.exists() or list(ckpt.glob("*.npz")) == []
    # the same run with a sane lr saves finite weights
    res = cli_process(*train_argv(data, "--steps", "1", "--lr", "1e-6", "--save", out))
    assert res.code == 0, res.err
    assert all(np.isfinite(v).all() for k, v in load_npz(out).items() if k != "arch")


def test_weights_so_large_that_the_test_outputs_overflow_fail(cli_process, npz_dataset,
                                                              tmp_path):
    """lr 3e38 gives finite weights of about 1e37, whose outputs overflow: the test loss is
    NaN. Exit 1, one line (no NumPy warnings), nothing saved, no NaN in any JSON."""
    data = npz_dataset(n=16, n_test=8)
    out = tmp_path / "w.npz"
    res = cli_process(*train_argv(data, "--steps", "1", "--lr", "3e38", "--momentum", "0",
                                  "--save", out, "--json"))
    assert_one_error_line(res, "test loss", "overflow", "not saved")
    assert not out.exists()


@pytest.mark.parametrize("kwargs,words", [
    ({"lr": math.inf}, ["lr", "finite"]),
    ({"lr": math.nan}, ["lr"]),
    ({"lr": -math.inf}, ["lr"]),
    ({"momentum": math.inf}, ["momentum", "[0, 1)"]),
    ({"momentum": math.nan}, ["momentum"]),
    ({"momentum": 1.0}, ["momentum", "[0, 1)"]),
    ({"weight_decay": math.inf}, ["weight decay", "finite"]),
    ({"weight_decay": math.nan}, ["weight decay"]),
    ({"lr": np.float32("inf")}, ["lr", "finite"]),
])
def test_fit_refuses_non_finite_hyperparameters(kwargs, words):
    x, y = arrays(16)
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="numpy") as net:
        before = net.params()
        with pytest.raises(ValueError) as e:
            net.fit(x, y, steps=1, batch_size=8, **kwargs)
        assert isinstance(e.value, UsageError) and isinstance(e.value, PyhetError)
        for k, v in net.params().items():
            np.testing.assert_array_equal(v, before[k])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_fit_to_infinite_weights_raises_training_error():
    x, y = arrays(16, scale=1e4)
    with pyhet.Network(ARCH, (1, 12, 12), 3, devices="cpu:1") as net:
        with pytest.raises(TrainingError, match="conv1.weight holds NaN or infinite"):
            net.fit(x, y, steps=1, batch_size=8, lr=1e36)
