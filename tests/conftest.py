"""Shared fixtures: tiny npz datasets, and the command line run in-process or as a process.

x (N, C, H, W) float32 images, y (N,) int64 labels.
"""

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Hypothesis: each property test draws the profile's max_examples (some a multiple of it).
# PYHET_HYPOTHESIS_PROFILE=sanitize, for the sanitizer build of the core (several times slower;
# CI runs it), draws fewer.
settings.register_profile("pyhet", max_examples=40, deadline=None)
settings.register_profile("sanitize", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("PYHET_HYPOTHESIS_PROFILE", "pyhet"))


# ================================================================ training on given devices

# AddressSanitizer (tools/sanitized preloads it) reserves terabytes of shadow memory as a process
# starts: one under `ulimit -v` cannot start at all
beyond_asan = pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                                 reason="AddressSanitizer's shadow memory is beyond any ulimit -v")


def train_weights(shape, spec, partition, batches, cfg, seed=0, host=None):
    """Train the network of `shape` from init_params(seed) on the devices of `spec`, split as
    `partition`, one SGD step per (x, y) batch; return (weights, losses)."""
    from pyhet.backends.cpu import CpuBackend
    from pyhet.backends.numpy_ref import NumpyBackend
    from pyhet.devices import make_devices
    from pyhet.specs import parse_devices
    from pyhet.model import Net, init_params

    devices = make_devices(parse_devices(spec))
    try:
        host = host or (NumpyBackend() if all(d.kind == "numpy" for d in devices)
                        else CpuBackend(1))
        net = Net(shape, init_params(shape, seed), devices, partition, host)
        losses = [net.train_step(x, y, cfg) for x, y in batches]
        return net.params(), losses
    finally:
        for d in devices:
            d.close()


def net_shape(input_shape, kernels, k=5, classes=10):
    """The two-block network AC{k}-P2-BC{k}-P2 (the --kernels shorthand) on this input."""
    from pyhet import arch

    return arch.build(arch.shorthand(kernels, k), input_shape, classes)


def numeric_grad(f, a, eps=1e-6):
    """Central differences of the scalar f() with respect to every entry of a (changed in
    place and restored); a float64 array."""
    g = np.zeros_like(a)
    flat, gflat = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        up = f()
        flat[i] = old - eps
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * eps)
    return g


@pytest.fixture
def make_net():
    """make_net(shape, params, devices spec, partition) -> pyhet Net on copies of params (the
    fc layers on the C++ core, or on NumPy when every device is numpy); its devices are closed
    after the test."""
    from pyhet.backends.cpu import CpuBackend
    from pyhet.backends.numpy_ref import NumpyBackend
    from pyhet.devices import make_devices
    from pyhet.model import Net
    from pyhet.specs import parse_devices

    made = []

    def make(shape, params, spec, partition):
        devices = make_devices(parse_devices(spec))
        made.extend(devices)
        host = NumpyBackend() if all(d.kind == "numpy" for d in devices) else CpuBackend(1)
        params = {k: v.copy() for k, v in params.items()}
        return Net(shape, params, devices, partition, host)

    yield make
    for d in made:
        d.close()


def assert_trains_like_one_device(shape, spec, partition, seed=1, n=6, steps=3):
    """Three SGD steps (momentum, weight decay) on one random batch: the devices of `spec`,
    split as `partition`, end with the weights of one numpy device."""
    from pyhet.optim import SGDConfig

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape.input_shape)).astype(np.float32)
    y = rng.integers(0, shape.num_classes, n)
    cfg = SGDConfig(0.05, 0.9, 1e-3)
    whole = {g.name: [g.K] for g in shape.blocks}
    want, _ = train_weights(shape, "numpy", whole, [(x, y)] * steps, cfg)
    got, _ = train_weights(shape, spec, partition, [(x, y)] * steps, cfg)
    assert_same_weights(got, want)


def assert_repartitions_like_one_device(spec):
    """Two devices (`spec`) whose kernels move both ways between steps, a device left with
    none of a layer and then with all of it: three steps end with one numpy device's weights
    (each move reshards on the device: its kept kernels joined on it with those that come)."""
    from pyhet.backends.cpu import CpuBackend
    from pyhet.devices import make_devices
    from pyhet.model import Net, init_params
    from pyhet.optim import SGDConfig

    shape = net_shape((2, 13, 12), (7, 9), 3, 5)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, *shape.input_shape)).astype(np.float32)
    y = rng.integers(0, shape.num_classes, 6)
    cfg = SGDConfig(0.05, 0.9, 1e-3)
    want, _ = train_weights(shape, "numpy", {"conv1": [7], "conv2": [9]}, [(x, y)] * 3, cfg)
    devices = make_devices(spec)
    try:
        net = Net(shape, init_params(shape, 0), devices, {"conv1": [4, 3], "conv2": [2, 7]},
                  CpuBackend(1))
        net.train_step(x, y, cfg)
        net.convs[0].repartition([1, 6])
        net.convs[1].repartition([9, 0])
        net.train_step(x, y, cfg)
        net.convs[1].repartition([0, 9])
        net.convs[0].repartition([7, 0])
        net.train_step(x, y, cfg)
        assert_same_weights(net.params(), want)
    finally:
        for d in devices:
            d.close()


def assert_same_weights(got, want, rtol=1e-4):
    """Every parameter within rtol of the reference, relative to its largest entry."""
    for k in want:
        err = np.abs(got[k] - want[k]).max() / (np.abs(want[k]).max() + 1e-12)
        assert err < rtol, f"{k}: max relative error {err:.2e}"


# ================================================================ tiny npz datasets

def make_npz_dataset(path, n=24, shape=(1, 12, 12), classes=3, n_test=0, seed=0,
                     dtype=np.float32, **extra):
    """Write an npz dataset (as README describes) of n random images and labels 0..classes-1 that
    uses every class; return the arrays written. extra: more arrays, or overrides."""
    rng = np.random.default_rng(seed)
    arrays = {}

    def images(count):
        if dtype == np.uint8:
            return rng.integers(0, 256, size=(count, *shape), dtype=np.uint8)
        return rng.standard_normal((count, *shape)).astype(dtype)

    def labels(count):
        y = np.arange(count) % classes
        rng.shuffle(y)
        return y.astype(np.int64)

    arrays["x"], arrays["y"] = images(n), labels(n)
    if n_test:
        arrays["x_test"], arrays["y_test"] = images(n_test), labels(n_test)
    arrays.update(extra)
    np.savez(path, **arrays)
    return arrays


@pytest.fixture
def npz_dataset(tmp_path):
    """A factory: npz_dataset(name="data.npz", **make_npz_dataset options) -> its path."""
    def make(name="data.npz", **kw):
        path = tmp_path / name
        make_npz_dataset(path, **kw)
        return path
    return make


# ================================================================ running the command line

@dataclass
class Result:
    code: int
    out: str
    err: str


# Options that keep a training run tiny and quiet enough to read; tests add their own.
TINY = ["--kernels", "3,4", "--kernel-size", "3", "--devices", "cpu:1", "--batch-size", "8"]


@pytest.fixture
def cli(capsys):
    """cli(*argv) runs `pyhet argv...` in this process (pyhet.cli.main) and returns
    Result(exit code, stdout, stderr). A SystemExit from argparse becomes the exit code."""
    from pyhet.cli import main

    def run(*argv):
        capsys.readouterr()  # drop anything printed before
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return Result(code, out, err)
    return run


@pytest.fixture
def cli_process(tmp_path):
    """cli_process(*argv) runs `python -m pyhet argv...` as a separate process in a scratch
    folder (so that the installed pyhet is the one imported) and returns Result."""
    workdir = tmp_path / "cwd"
    workdir.mkdir(exist_ok=True)

    def run(*argv, timeout=120):
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        p = subprocess.run([sys.executable, "-m", "pyhet", *[str(a) for a in argv]],
                           cwd=workdir, env=env, capture_output=True, text=True,
                           timeout=timeout)
        return Result(p.returncode, p.stdout, p.stderr)
    return run


def run_python(code, timeout=120):
    """Run `python -c code` in a clean folder; returns the CompletedProcess."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code], cwd=Path(sys.executable).parent,
                          env=env, capture_output=True, text=True, timeout=timeout)


def load_npz(path):
    """{name: array} of an .npz file, read completely."""
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


@contextlib.contextmanager
def pmi_launcher(monkeypatch, rank: int):
    """MPICH's launcher's end of a rank's PMI socket, played by a thread, for the block: the
    environment says this process is rank `rank` of 2 with that socket (and a rank asking the
    launcher to end the job does not wait for it). Yields what the launcher heard (the rank's
    init, then one more message), complete after the block."""
    import socket
    import threading

    from pyhet import transport

    ours, launcher = socket.socketpair()
    heard = []

    def answer():
        with launcher:
            heard.append(launcher.recv(256))
            launcher.sendall(b"cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n")
            heard.append(launcher.recv(256))

    t = threading.Thread(target=answer)
    t.start()
    monkeypatch.setattr(transport, "ABORT_WAIT_S", 0.0)
    with ours:
        for k, v in (("PMI_SIZE", "2"), ("PMI_RANK", str(rank)),
                     ("PMI_FD", str(ours.fileno()))):
            monkeypatch.setenv(k, v)
        yield heard
    t.join(10)


# ================================================================ MPI jobs

def private_mpi_job(cmd, cwd):
    """cmd, an mpiexec job run in the folder cwd, in a mount namespace of its own with a
    private /dev/shm and /tmp, as the benchmarks run theirs (private_tmp in pyhet.bench._util):
    what MPICH and mpiexec leave there when the job is ended by a signal goes with its last
    process. The folder directly under /tmp that holds cwd (pytest's) is bound back over the
    overlay, so that what the job writes there is written here (where the bind fails, the
    overlay is taken off). Where no mount namespace can be made, cmd as it is."""
    cmd = [str(c) for c in cmd]
    try:
        from pyhet.bench._util import private_tmp
    except ImportError:
        try:
            from bench._util import private_tmp
        except ImportError:
            return cmd
    if private_tmp(cmd) == cmd:
        return cmd
    tmp, here = os.path.realpath("/tmp"), os.path.realpath(cwd)
    if here == tmp:             # its writes would go to the overlay
        return cmd
    if os.path.commonpath([tmp, here]) != tmp:
        return private_tmp(cmd)
    top = os.path.join(tmp, os.path.relpath(here, tmp).split(os.sep)[0])
    # the source relative to cwd, which is outside the overlay (an absolute path is inside)
    keep = ('mount -c --bind "$1" "$2" 2>/dev/null || '
            '[ "$(findmnt -no FSTYPE /tmp)" != overlay ] || umount /tmp; shift 2; exec "$@"')
    return private_tmp(["sh", "-c", keep, "sh", os.path.relpath(top, here), top, *cmd])
