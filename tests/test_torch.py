"""pyhet against PyTorch: the same network, the same weights, the same SGD steps.

The network is built in torch.nn from the layers README names (conv1, conv2, fc), pyhet's
weights load into it with no reshaping, and both train for a few steps of SGD with momentum and
weight decay; the weights must agree after every step. Skipped where torch is not installed.

Tolerance: for each parameter, max |w_pyhet - w_torch| <= 1e-4 * max |w_torch| (float32 on
both sides, summed in different orders; the observed gap is about 3e-7, while 5 steps move the
weights by about half their size). Logits and loss of the first step: 1e-5 of the largest
logit, and of the loss.

x (N, C, H, W) images, y (N,) labels, A and B the kernel counts, k the kernel size,
F = B * P2h * P2w the fc inputs, M classes.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import load_npz, make_npz_dataset, net_shape  # noqa: E402
from pyhet.model import init_params  # noqa: E402
from pyhet.optim import SGDConfig  # noqa: E402
from torch_ref import (TorchNet, assert_close_weights, torch_model, torch_params,  # noqa: E402
                       torch_settings, torch_step)

PARAM_NAMES = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias")
FORWARD_RTOL = 1e-5
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-3


@pytest.fixture(autouse=True, scope="module")
def settings():
    with torch_settings():
        yield


def torch_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                           weight_decay=WEIGHT_DECAY)


# ================================================================ pyhet's Net vs torch

CASES = {
    # name: (input (C, H, W), kernels (A, B), k, classes, batch, devices, partition or None)
    "default 28x28 k5 cpu:1": ((1, 28, 28), (8, 12), 5, 10, 8, "cpu:1", None),
    "default 28x28 k5 numpy": ((1, 28, 28), (8, 12), 5, 10, 8, "numpy", None),
    # 29x29, k = 3: conv1 27 -> pool 13 (a row and column dropped) -> conv2 11 -> pool 5
    "29x29 k3 numpy": ((1, 29, 29), (7, 11), 3, 5, 5, "numpy", None),
    "29x29 k3 cpu:1": ((1, 29, 29), (7, 11), 3, 5, 5, "cpu:1", None),
    "29x29 k3 two cpus, one idle in conv1": ((1, 29, 29), (7, 11), 3, 5, 5, "cpu:1,cpu:2",
                                             {"conv1": [7, 0], "conv2": [1, 10]}),
    # 31x30, k = 4: conv1 28x27 -> pool 14x13 (a column dropped) -> conv2 11x10 -> pool 5x5
    "31x30 k4 numpy": ((3, 31, 30), (7, 11), 4, 4, 6, "numpy", None),
    "31x30 k4 two cpus uneven": ((3, 31, 30), (7, 11), 4, 4, 6, "cpu:1,cpu:2",
                                 {"conv1": [2, 5], "conv2": [8, 3]}),
    "31x30 k4 cpu and numpy uneven": ((3, 31, 30), (7, 11), 4, 4, 6, "cpu:1,numpy",
                                      {"conv1": [5, 2], "conv2": [4, 7]}),
    "31x30 k4 three devices": ((3, 31, 30), (7, 11), 4, 4, 6, "numpy,cpu:1,cpu:1",
                               {"conv1": [1, 3, 3], "conv2": [6, 0, 5]}),
}


def even_partition(total, n):
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


@pytest.mark.parametrize("case", list(CASES))
def test_sgd_steps_match_torch(make_net, case):
    input_shape, kernels, k, classes, batch, spec, partition = CASES[case]
    shape = net_shape(input_shape, kernels, k, classes)
    seed = sorted(CASES).index(case)
    params = init_params(shape, seed)
    n = len(spec.split(","))
    partition = partition or {"conv1": even_partition(kernels[0], n),
                              "conv2": even_partition(kernels[1], n)}
    net = make_net(shape, params, spec, partition)
    model = torch_model(shape, params)
    opt = torch_sgd(model)
    cfg = SGDConfig(LR, MOMENTUM, WEIGHT_DECAY)

    rng = np.random.default_rng(100 + seed)
    for step in range(5):
        x = rng.standard_normal((batch, *input_shape)).astype(np.float32)
        y = rng.integers(0, classes, size=batch).astype(np.int64)
        if step == 0:
            logits = np.asarray(net.forward(x))
        loss = net.train_step(x, y, cfg)
        want_logits, want_loss = torch_step(model, opt, x, y)
        if step == 0:
            assert logits.shape == (batch, classes) and logits.dtype == np.float32
            err = np.abs(logits - want_logits).max()
            assert err <= FORWARD_RTOL * np.abs(want_logits).max(), f"logits off by {err:.3g}"
            assert loss == pytest.approx(want_loss, rel=FORWARD_RTOL)
        assert np.isfinite(loss)
        assert_close_weights(net.params(), torch_params(model), f"{case}, step {step + 1}:")
    assert net.partition() == {layer: {f"d{i}": c for i, c in enumerate(counts)}
                               for layer, counts in partition.items()}


def test_params_load_into_torch_unchanged():
    """init_params' arrays are the torch state_dict: same names, shapes and dtype."""
    shape = net_shape((3, 31, 30), (7, 11), 4, 4)
    params = init_params(shape, 0)
    model = TorchNet(shape)
    sd = model.state_dict()
    assert list(params) == list(sd) == list(PARAM_NAMES)
    for k in PARAM_NAMES:
        assert params[k].dtype == np.float32 and tuple(sd[k].shape) == params[k].shape, k
    model = torch_model(shape, params)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), params[k])


# ================================================================ initialisation

def _ks_uniform(values, bound):
    """Kolmogorov-Smirnov distance of values from U(-bound, bound)."""
    v = np.sort(values.astype(np.float64).ravel())
    n = v.size
    cdf = (v + bound) / (2 * bound)
    return max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))


def test_init_matches_torch_default_distribution():
    """pyhet's init and torch's default are both U(-1/sqrt(fan_in), 1/sqrt(fan_in)), for the
    weights and for the biases."""
    shape = net_shape((3, 28, 28), (32, 64), 5, 10)
    fan_in = {"conv1": 3 * 5 * 5, "conv2": 32 * 5 * 5, "fc": shape.features}
    params = init_params(shape, 7)
    torch.manual_seed(7)
    theirs = torch_params(TorchNet(shape))
    for k in PARAM_NAMES:
        bound = 1 / np.sqrt(fan_in[k.split(".")[0]])
        for who, a in (("pyhet", params[k]), ("torch", theirs[k])):
            assert a.shape == shape.param_shapes()[k]
            assert np.abs(a).max() <= bound * (1 + 1e-6), (who, k)
            if a.size >= 1000:
                # KS distance: the 0.1% critical value is about 1.95 / sqrt(n)
                d = _ks_uniform(a, bound)
                assert d < 1.95 / np.sqrt(a.size), (who, k, d)
            if a.size >= 32:
                assert np.abs(a).max() > 0.8 * bound, (who, k)   # the whole range is used
                assert abs(a.mean()) < 4 * bound / np.sqrt(3 * a.size), (who, k)


def test_init_is_seeded():
    shape = net_shape((1, 28, 28), (4, 6), 5, 10)
    a, b, c = init_params(shape, 1), init_params(shape, 1), init_params(shape, 2)
    for k in PARAM_NAMES:
        np.testing.assert_array_equal(a[k], b[k])
        assert not np.array_equal(a[k], c[k]), k


# ================================================================ the command line vs torch

@pytest.mark.parametrize("devices", ["cpu:1", "cpu:1,numpy"])
def test_cli_run_matches_torch(cli, tmp_path, devices):
    """`pyhet train` from torch's own init, 4 steps in file order over 20 images in batches
    of 8 (8, 8, 4, then the first 8 again): the saved file loads into torch unchanged and
    holds torch's weights after the same steps."""
    # 16 x 15, k = 3: conv1 14x13 -> pool 7x6 -> conv2 5x4 -> pool 2x2; F = 5 * 2 * 2
    shape = net_shape((1, 16, 15), (3, 5), 3, 4)
    data = make_npz_dataset(tmp_path / "data.npz", n=20, shape=(1, 16, 15), classes=4, seed=3)

    torch.manual_seed(0)
    model = TorchNet(shape)
    np.savez(tmp_path / "init.npz", **torch_params(model))

    res = cli("train", "--dataset", f"npz:{tmp_path / 'data.npz'}", "--init",
              tmp_path / "init.npz", "--save", tmp_path / "out.npz", "--steps", "4",
              "--no-shuffle", "--batch-size", "8", "--momentum", "0.9", "--weight-decay",
              "0.001", "--lr", "0.05", "--devices", devices, "--kernels", "3,5",
              "--kernel-size", "3", "--quiet", "--json")
    assert res.code == 0, res.err
    summary = json.loads(res.out.strip().splitlines()[-1])

    opt = torch_sgd(model)
    for start, stop in ((0, 8), (8, 16), (16, 20), (0, 8)):
        _, loss = torch_step(model, opt, data["x"][start:stop], data["y"][start:stop])
    assert summary["train_loss"] == pytest.approx(loss, rel=FORWARD_RTOL)

    saved = load_npz(tmp_path / "out.npz")
    reloaded = TorchNet(shape)
    assert saved.pop("arch").dtype.kind == "U"              # the one non-float entry
    reloaded.load_state_dict({k: torch.from_numpy(v) for k, v in saved.items()}, strict=True)
    assert_close_weights(torch_params(reloaded), torch_params(model), f"{devices}:")
