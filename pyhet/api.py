"""The Python API: build a network, train it on arrays or a named dataset over a set of devices,
evaluate it, predict with it, save and load it.

    import pyhet
    with pyhet.Network("32C5-P2-64C5-P2", input_shape=(1, 28, 28), num_classes=10,
                       devices="cpu:1,cpu:1", seed=0) as net:
        net.fit(x, y, steps=300, batch_size=64, lr=0.01)
        probs = net.predict(x_test)               # (N, 10) float32, rows sum to 1
        net.evaluate(x_test, y_test)              # {"loss": ..., "accuracy": ..., ...}
        net.save("w.npz")
    net = pyhet.load("w.npz", devices="cpu:1")

Letters: x (N, C, H, W) images, y (N,) integer labels, M classes. Images are float32 (used as
they are) or uint8 (raw pixels, prepared as the network's training images were: scaled to
[0, 1] and, for a network trained on a named dataset, normalised with that dataset's per-channel
statistics). Errors are pyhet.errors exceptions, with the command line's messages; a bad
argument value is a UsageError, which is also a ValueError.
"""

from __future__ import annotations

import functools
import io
import os
import sys
import threading
import weakref
from typing import Callable, Optional, Sequence

import numpy as np

from . import arch as arch_notation
from . import evaluation, files
from .data import MAX_SEED, Dataset, load_dataset, load_test_split
from .images import (Normalization, check_images, prepare_batch, prepare_images,
                     prepare_labels)
from .checkpoint import CheckpointDir
from .errors import (DataError, NoDeviceLeftError, TrainingError, UsageError, WeightsError,
                     say, shown, warn)
from .geometry import NetGeometry
from .interrupt import HeldSignals
from .model import (check_class_names, checked_params, init_params, load_weights,
                    network_of_file, read_weight_file, save_weights)
from .specs import check_ranks, cuda_device_count, parse_devices
from .train import (BALANCE_MODES, DynamicBalance, TrainConfig, build_net,
                    check_file_destination, check_memory, host_devices, largest_batch,
                    open_devices, plan_record, run_settings, run_steps, with_plan)

__all__ = ["Network", "load"]

# copies of every parameter that fit() holds beside the running network: the weights and the
# momentum it started with, which it puts back after a fit that diverges
FIT_KEEPS = 2


_FORK_LOCK = threading.Lock()    # Network._forked's, made anew in a forked child
os.register_at_fork(after_in_child=lambda: globals().__setitem__("_FORK_LOCK", threading.Lock()))


def _one_at_a_time(in_callback: bool):
    """A Network method that runs alone: a call from another thread waits for the running one
    to end; a call from fit()'s callback (the thread that runs fit) is refused unless
    `in_callback` (reading the weights, predicting, evaluating between steps is fine;
    training or closing inside a step's callback is not)."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            if self._pid != os.getpid():
                self._forked()
            me = threading.get_ident()
            if self._owner == me:          # from inside the running call: fit's callback
                if not in_callback:
                    raise UsageError(f"{method.__name__}() cannot be called from fit()'s "
                                     f"callback: fit() is still running")
                return method(self, *args, **kwargs)
            with self._turn:
                self._owner = me
                try:
                    return method(self, *args, **kwargs)
                except NoDeviceLeftError:
                    # every device failed: they are stopped, and the next call starts them
                    # afresh from the weights of the last whole step
                    self._close()
                    raise
                finally:
                    self._owner = None
        return run
    return wrap


class _Notices(io.TextIOBase):
    """fit's log: its `pyhet: warning:` lines (a device that failed and whose kernels moved, a
    damaged checkpoint skipped, a checkpoint folder locked again) become RuntimeWarnings at the
    line of the program's call, whatever `progress` says, which a program can filter or make
    errors of; its other lines (calibration, resuming, the bars) go to stderr where
    progress=True, else nowhere."""

    PREFIX = "pyhet: warning: "

    def __init__(self, progress: bool):
        super().__init__()
        self.progress = progress

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.progress and sys.stderr is not None and sys.stderr.isatty()

    def write(self, text: str) -> int:
        if text.startswith(self.PREFIX):
            warn(text[len(self.PREFIX):].rstrip("\n"))
        elif self.progress and sys.stderr is not None:
            sys.stderr.write(text)
        return len(text)

    def flush(self) -> None:
        if self.progress and sys.stderr is not None:
            sys.stderr.flush()


class Network:
    """A CNN whose conv layers' kernels are split over devices.

    arch: the network in the notation of CNN papers, e.g. ``"32C5-P2-64C3p1s2-P2-256N"``
    (blocks joined by ``-``; ``KCk`` a conv of K kernels k x k, with ``pP`` padding and ``sS``
    stride; ``Pk`` / ``PksS`` a max-pool; ``UN`` a hidden fc layer of U units; the classifier
    is implicit). input_shape: (C, H, W) of one image. devices: a device SPEC such as
    ``"cpu:1,cpu:1"``, ``"numpy"``, ``"gpu:0,cpu"`` or ``"auto"``. balance: ``"dynamic"``,
    ``"static"`` or ``"even"``. seed: the initial weights (PyTorch's default initialisation)
    and the data order of fit().

    The devices (each with its own worker thread) are started when first needed and stopped
    by close() or the end of a ``with`` block; the network can be used again after close().
    """

    def __init__(self, arch: str = arch_notation.shorthand(arch_notation.DEFAULT_KERNELS),
                 input_shape: Sequence[int] = (1, 28, 28), num_classes: int = 10, *,
                 devices: str = "auto", balance: str = "dynamic", seed: int = 0,
                 classes: Optional[Sequence[str]] = None,
                 normalization: Optional[Normalization] = None,
                 weights: Optional[dict] = None):
        # weights: {name: float32 array} in PyTorch's layout (as params() gives) instead of the
        # seeded initialisation; classes: the class names; normalization: how raw uint8 images
        # become inputs (pyhet.images.Normalization; None: / 255)
        if balance not in BALANCE_MODES:
            raise UsageError(f"balance must be one of {', '.join(BALANCE_MODES)}, "
                             f"got {balance!r}")
        seed = _seed(seed)
        shape = _input_shape(input_shape)
        self.geometry: NetGeometry = arch_notation.build(arch, shape,
                                                         _whole(num_classes, "num_classes", 2),
                                                         "arch")
        check_memory(self.geometry, 1)
        if not isinstance(devices, str):
            raise UsageError(f"devices must be a SPEC string such as 'cpu:1,cpu:1', got "
                             f"{devices!r}")
        self.devices_spec, self.balance, self.seed = devices, balance, seed
        # a bad SPEC fails here, not later (and so does one that places a device on a rank)
        check_ranks(parse_devices(devices, gpu_count=cuda_device_count), 1, "Network")
        if isinstance(classes, (str, bytes)):       # list("abc") would make three names
            raise UsageError(f"classes must be a list of {self.num_classes} class names, got "
                             f"{classes!r}")
        try:
            self.classes = check_class_names(None if classes is None else list(classes),
                                             self.num_classes)
        except (TypeError, ValueError) as e:
            raise UsageError(f"classes: {e}") from None
        self.normalization = _checked_normalization(normalization, self.input_shape[0],
                                                    UsageError, "normalization")
        self._params = (init_params(self.geometry, seed) if weights is None
                        else checked_params(weights, self.geometry))
        self._epochs = 0          # epochs begun by fit() so far: the next fit's data order
        # False for a file of an earlier version (load()), which does not say how its
        # training images were prepared
        self._records_normalization = True
        self._devices: list = []
        self._net = None
        self._calibration = None
        self._finalizer = None
        self._planned_for = None  # (batch, trained): the batch the devices were planned for
        self._turn = threading.Lock()    # one call at a time (_one_at_a_time)
        self._owner = None               # the thread of the call under way
        self._pid = os.getpid()          # the process the lock and the owner belong to
        self._forked_mid_call = False
        self._batch_high = 0      # the largest batch the running devices have been given
        self._kept = 0            # copies of the parameters beside them, memory checked for

    def _forked(self) -> None:
        """In a process forked from the one that made this network: its lock may be held by a
        thread that fork() did not copy (a call under way in another thread: the next call
        waited forever). A network forked in the middle of another thread's call holds that
        call's half-done state, and is refused; one forked by the thread of its call (from
        fit's callback, between two steps) goes on with it; else it is used as in the
        parent."""
        with _FORK_LOCK:            # (two threads of the child at once: one lock made)
            if self._pid != os.getpid():
                owner = self._owner
                if owner is not None and owner != threading.get_ident():
                    self._forked_mid_call = True
                if owner != threading.get_ident():
                    self._turn, self._owner = threading.Lock(), None
                self._pid = os.getpid()
        if self._forked_mid_call:
            raise UsageError("this network was in a call of another thread (a fit, say) when "
                             "this process was forked from its own: its state here is that "
                             "call's, half done; load or make the network in this process")

    # --- description --------------------------------------------------------------------------

    @property
    def arch(self) -> str:
        """The network in --arch notation (canonical form)."""
        return self.geometry.arch

    @property
    def input_shape(self) -> tuple:
        return self.geometry.input_shape

    @property
    def num_classes(self) -> int:
        return self.geometry.num_classes

    @property
    def partition(self) -> Optional[dict]:
        """{layer: {device: kernels}} while the devices run, else None."""
        return self._net.partition() if self._net is not None else None

    @_one_at_a_time(in_callback=True)
    def params(self) -> dict:
        """The weights, {name: float32 array} in PyTorch's layout and names (copies)."""
        if self._net is not None:
            return self._net.params()
        return {k: v.copy() for k, v in self._params.items()}

    def __repr__(self):
        state = "running on " + self.devices_spec if self._net is not None else "idle"
        return (f"Network({self.arch!r}, input_shape={self.input_shape}, "
                f"num_classes={self.num_classes}, devices={self.devices_spec!r}; {state})")

    # --- devices ------------------------------------------------------------------------------

    def _start(self, batch_size: int, log=None, training: bool = False):
        """The Net on running devices, partitioned for this batch size on the first call, and
        again for training's batch size when only predict() or evaluate() used it before (a
        partition timed on one image would serve a fit() of 64 badly); a net that has trained
        keeps its partition (and its momentum)."""
        if (training and self._net is not None and not self._planned_for[1]
                and self._planned_for[0] != batch_size):
            self._close()         # no momentum yet: the weights are all there is to keep
        if self._net is None:
            self._check_memory(batch_size, training)
            self._devices = open_devices(self.devices_spec)
            # a Network dropped without close() still stops its devices' threads
            self._finalizer = weakref.finalize(self, _close_all, list(self._devices))
            try:
                self._net, self._calibration = build_net(
                    self.geometry, self._params, self._devices, self.balance, batch_size,
                    self.seed, log)
            except BaseException:
                self._close()
                raise
            self._planned_for, self._batch_high = (batch_size, False), batch_size
            self._kept = FIT_KEEPS if training else 0
        else:   # a larger batch than the devices have run, or a fit after predict()
            self._check_memory(batch_size, training)
        if training:
            self._planned_for = (self._planned_for[0], True)
        return self._net

    def _check_memory(self, batch_size: int, training: bool) -> None:
        """Refuse (DeviceError), before anything is allocated for it, a batch size or a fit that
        this machine's memory cannot hold; what the running devices hold counts as held."""
        kept = FIT_KEEPS if training else 0
        if self._net is None:
            check_memory(self.geometry, batch_size, kept=kept,
                         devices=host_devices(self.devices_spec))
        elif batch_size > self._batch_high or kept > self._kept:   # (else: nothing to check)
            check_memory(self.geometry, max(batch_size, self._batch_high), self._batch_high,
                         max(kept, self._kept), self._kept, host_devices(self.devices_spec))
            self._batch_high = max(batch_size, self._batch_high)
            self._kept = max(kept, self._kept)

    @_one_at_a_time(in_callback=False)
    def close(self) -> None:
        """Stop the devices and their threads; the weights are kept (momentum is dropped)."""
        self._close()

    def _close(self) -> None:
        # Ctrl-C waits until every device is stopped and the network holds its weights (cut
        # short, it kept stopped devices, or older weights, and left threads running)
        with HeldSignals():
            try:
                if self._net is not None:
                    try:
                        self._params = self._net.params()
                    except Exception:  # a failed device: keep the last weights we had
                        pass
            finally:
                try:
                    if self._finalizer is not None:
                        self._finalizer()          # closes the devices, once
                finally:
                    self._devices, self._net, self._calibration = [], None, None
                    self._finalizer, self._planned_for, self._batch_high = None, None, 0
                    self._kept = 0

    def _not_copied(self, *args):
        raise TypeError("a pyhet.Network runs devices and cannot be copied or pickled: save() "
                        "it and load() the file, or build a Network from its params() "
                        "(weights=)")

    __copy__ = __deepcopy__ = __reduce_ex__ = __reduce__ = _not_copied

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- training -----------------------------------------------------------------------------

    @_one_at_a_time(in_callback=False)
    def fit(self, x: Optional[np.ndarray] = None, y: Optional[np.ndarray] = None, *,
            dataset: Optional[str] = None, data_dir: Optional[str] = None,
            epochs: int = 1, steps: Optional[int] = None, batch_size: int = 64,
            lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0,
            shuffle: bool = True, x_test: Optional[np.ndarray] = None,
            y_test: Optional[np.ndarray] = None,
            callback: Optional[Callable[[dict], None]] = None, progress: bool = False,
            checkpoint_dir: "str | os.PathLike | None" = None, resume: bool = False,
            overwrite: bool = False, checkpoint_every: Optional[int] = None,
            keep: Optional[int] = None) -> dict:
        """Train with SGD (torch.optim.SGD's rule) on images x (N, C, H, W) with labels y (N,),
        or on a named dataset (``dataset="bundled"``, ``"cifar10"``, ``"npz:FILE"``, ...).

        Training runs `epochs` passes, or `steps` optimizer steps when given. Each epoch's
        order comes from (seed, epoch), and a later fit() goes on with the next epoch's order.
        The devices are partitioned for the batch size of their first use (the first fit(),
        predict() or evaluate()), and once more for the first fit()'s when only predict() or
        evaluate() used them before with another batch size. callback(info) is called after
        every step with {"step", "steps", "epoch", "loss", "step_time_s", "images"};
        progress=True also draws a bar on stderr. Momentum carries over to the next fit()
        while the devices run. Returns the summary that ``pyhet train --json`` prints (test
        accuracy from x_test and y_test, or the dataset's test split). Trained on a named
        dataset, the network prepares raw uint8 pixels (x_test's, and predict()'s, evaluate()'s
        and its weight file's from then on) as the dataset prepared its images: with its
        normalisation, or / 255 where it has none (an npz file of uint8 pixels), as ``pyhet
        train`` records it. A call that is refused before it changes a weight leaves the
        network as it was, and so does one that diverges (TrainingError: its weights,
        momentum and data order are put back; the checkpoints it wrote stay).

        checkpoint_dir, resume, overwrite, checkpoint_every, keep: checkpoints as ``pyhet
        train`` writes them (the folder is locked while fit() runs and belongs to one fit();
        resume=True goes on from its newest checkpoint, weights and momentum, to `steps` or
        `epochs` counted from its start)."""
        batch_size, epochs = _positive(batch_size, "batch_size"), _positive(epochs, "epochs")
        steps = None if steps is None else _positive(steps, "steps")
        checkpoint_every = (None if checkpoint_every is None
                            else _positive(checkpoint_every, "checkpoint_every"))
        keep = None if keep is None else _whole(keep, "keep", 0)
        if callback is not None and not callable(callback):
            raise UsageError(f"callback must be a function of one argument (the step's info), "
                             f"got {callback!r}")
        if checkpoint_dir is not None:     # checked here, before any folder is made
            checkpoint_dir = _path(checkpoint_dir, "checkpoint_dir", "a folder's path")
        rules = {"lr": "a finite number > 0", "momentum": "a number in [0, 1)",
                 "weight_decay": "a finite number >= 0"}
        numbers = {}
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                                 np.floating)):
                raise UsageError(f"{name} must be a number, got {value!r}")
            # as Python floats: a NumPy scalar (np.float64 from np.logspace) would make float64
            # of the float32 weights it multiplies, and cannot be written to a checkpoint's JSON
            try:
                numbers[name] = float(value)
            except OverflowError:          # an int past float's range (2**1024)
                raise UsageError(f"{name} must be {rules[name]}, got {shown(value)}") from None
        lr, momentum, weight_decay = numbers["lr"], numbers["momentum"], numbers["weight_decay"]
        shuffle, progress, resume, overwrite = (
            _flag(v, name) for name, v in (("shuffle", shuffle), ("progress", progress),
                                           ("resume", resume), ("overwrite", overwrite)))
        ds = self._training_data(x, y, dataset, data_dir, x_test, y_test)
        cfg = TrainConfig(arch=self.arch, dataset=ds.name, devices=self.devices_spec,
                          balance=self.balance, batch_size=batch_size, epochs=epochs,
                          steps=steps, lr=lr, momentum=momentum, weight_decay=weight_decay,
                          seed=self.seed, shuffle=shuffle, progress=progress,
                          checkpoint_dir=checkpoint_dir, resume=resume, overwrite=overwrite,
                          checkpoint_every=checkpoint_every, keep=keep, python=True)
        try:
            cfg.check()
        except ValueError as e:      # lr, momentum or weight_decay out of range
            raise UsageError(str(e)) from None
        # what training on ds makes of the network, set now (the callback's predict() and the
        # checkpoints need it) and taken back below if the call is refused before it changes
        # a weight: a refused call leaves the network as it was
        before = (self.normalization, self._records_normalization, self.classes,
                  self._planned_for)
        if dataset is not None:
            # raw pixels are prepared as the dataset prepared its training images: its
            # normalisation, or / 255 where it has none (an npz file's uint8 pixels), which is
            # what `pyhet train` records of such a run; not a normalisation the network had
            self.normalization = ds.normalization
        # trained here, the network's preparation of raw pixels is known (what it records, or
        # / 255), even when it came from a file of an earlier version
        self._records_normalization = True
        if ds.classes and not self.classes:
            self.classes = list(ds.classes)
        log = _Notices(progress)
        changed = {"weights": False}     # set by _fit once a step or a checkpoint changed them
        try:
            if cfg.checkpoint_dir is None:
                return self._fit(cfg, ds, log, None, callback, changed)
            with CheckpointDir(cfg.checkpoint_dir, run_settings(cfg, ds, self.geometry),
                               resume=cfg.resume, overwrite=cfg.overwrite, keep=cfg.kept(),
                               log=log, python=True) as folder:
                return self._fit(cfg, ds, log, folder, callback, changed)
        except BaseException:
            if not changed["weights"]:
                self.normalization, self._records_normalization, self.classes = before[:3]
                if self._planned_for is not None:   # not trained, as far as the plan goes
                    self._planned_for = (self._planned_for[0],
                                         before[3] is not None and before[3][1])
            raise

    def _fit(self, cfg: TrainConfig, ds: Dataset, log, folder, callback, changed) -> dict:
        # changed["weights"]: set to True once the weights are no longer the network's own
        start = {"step": 0, "epoch": self._epochs, "batch": 0}
        self._check_memory(largest_batch(cfg, ds), training=True)   # before the copies below
        # the network as it is now, which a fit that diverges puts back: its weights may have
        # grown so large that every output overflows, and every later fit with them too
        try:
            before = (self._net.state() if self._net is not None else (self._params, None),
                      self._epochs)
        except Exception:   # a device that failed since: training fails over, if it can
            before = None
        if before is not None:
            # the weights kept while the devices run (their own are on the devices) are these:
            # the copy made when they started goes (a large fc layer is held once, not twice)
            self._params = before[0][0]
        found = folder.newest(self.geometry) if folder is not None and cfg.resume else None
        if found:      # the checkpoint's weights and momentum, on freshly planned devices
            path, params, moms, meta = found
            self._close()
            self._params = params
            changed["weights"] = True
            start = {k: int(meta[k]) for k in ("step", "epoch", "batch")}
            say(f"resuming from {path} (step {start['step']})", log)
        net = self._start(largest_batch(cfg, ds), log if cfg.progress else None,
                          training=True)
        if found:
            net.set_momentum(moms)
            # the net holds the checkpoint's weights and momentum now; beside it, only the
            # state it puts back (FIT_KEEPS copies, as the memory check counts)
            params = moms = found = None
            if before is not None:
                self._params = before[0][0]
        balance = (DynamicBalance(net, self._calibration)
                   if self.balance == "dynamic" and self._calibration else None)
        if balance is not None:
            # devices that failed in an earlier fit() (Failover told only that fit's balancer)
            # get no kernels: a new balancer starts from the calibration, which counts them
            for conv in net.convs:
                if conv.dead:
                    balance.balancers[conv.name].leave_out(sorted(conv.dead))
        made = getattr(net, "steps_made", 0)

        def save(position):
            return folder.save(net, position, plan_record(net, self._calibration, balance,
                                                          False),
                               self.classes, self.normalization)

        at = dict(start)       # where the next step starts, after each step
        try:
            result = run_steps(cfg, ds, net, start, log, balance, callback,
                               save_checkpoint=save if folder is not None else None, at=at)
        except TrainingError as e:
            if before is None:       # nothing to put back (rare: see above)
                self._epochs = at["epoch"] + (1 if at["batch"] else 0)
                changed["weights"] = getattr(net, "steps_made", 0) > made or changed["weights"]
                raise
            self._put_back(net, *before)
            changed["weights"] = False
            raise TrainingError(f"{e}; the network is as it was before this fit(): its "
                                f"weights, momentum and data order are put back") from None
        except BaseException:
            if getattr(net, "steps_made", 0) > made:
                changed["weights"] = True
            # the epochs begun, also when training stopped early (Ctrl-C, a callback's error):
            # the next fit() goes on with the next epoch's order
            self._epochs = at["epoch"] + (1 if at["batch"] else 0)
            raise
        if getattr(net, "steps_made", 0) > made:
            changed["weights"] = True
        self._epochs = at["epoch"] + (1 if at["batch"] else 0)
        return with_plan(result, net, self._devices, self._calibration, balance)

    def _put_back(self, net, state, epochs) -> None:
        """Make the network as it was before a fit that diverged: state (weights, momentum or
        None where the devices were not running) on the devices as they are now, and the data
        order; where a device fails meanwhile, the weights alone, the devices stopped."""
        params, moms = state
        self._epochs = epochs
        try:
            none = {name: (None, None) for name in [c.name for c in net.convs] + net.head.names}
            with HeldSignals():       # every layer put back, or Ctrl-C waits
                net.set_state(params, moms if moms is not None else none)
        except Exception:
            self._close()
            self._params = params

    def _training_data(self, x, y, dataset, data_dir, x_test, y_test) -> Dataset:
        if dataset is not None:
            if x is not None or y is not None:
                raise UsageError("fit: give either arrays (x, y) or dataset=, not both")
            ds = load_dataset(dataset, data_dir, seed=self.seed, input_shape=self.input_shape)
            if ds.input_shape != self.input_shape or ds.num_classes != self.num_classes:
                raise DataError(f"dataset {dataset}: {ds.num_classes} classes of "
                                f"{'x'.join(map(str, ds.input_shape))} images, but the network "
                                f"takes {'x'.join(map(str, self.input_shape))} images and has "
                                f"{self.num_classes} classes")
            if x_test is not None or y_test is not None:   # one without the other: refused
                # raw pixels as the dataset's own, which the network will take them as
                ds.x_test, ds.y_test = self._xy(x_test, y_test, "x_test", "y_test",
                                                ds.normalization)
            return ds
        if data_dir is not None:   # (the command line refuses a --data-dir it would not read)
            raise UsageError("fit: data_dir= is the folder of dataset='s files; with arrays "
                             "(x, y) it would be read by nothing")
        if x is None or y is None:
            raise UsageError("fit: needs images x and labels y, or dataset=")
        xs, ys = self._xy(x, y, "x", "y")
        xt = yt = None
        if x_test is not None or y_test is not None:
            xt, yt = self._xy(x_test, y_test, "x_test", "y_test")
        return Dataset("arrays", xs, ys, xt, yt, self.num_classes, self.classes, "arrays",
                       self.normalization)

    def _xy(self, x, y, xname, yname, normalization=False):
        # normalization: how uint8 x becomes the input (False: the network's own)
        xs, ys = self._checked_xy(x, y, xname, yname)
        return prepare_batch(xs, self.normalization if normalization is False
                             else normalization, xname), ys

    def _checked_xy(self, x, y, xname, yname):
        """Images (checked, not prepared: check_images) and their labels."""
        if x is None or y is None:
            raise UsageError(f"{xname} and {yname} go together: give both or neither")
        xs = check_images(x, self.input_shape, xname)
        return xs, prepare_labels(y, len(xs), self.num_classes, yname)

    def _images(self, x, what="x"):
        return prepare_images(x, self.input_shape, self.normalization, what)

    def _batch_preparer(self, what: str):
        """prepare(xb, first) for evaluation.logits: images that check_images took, a batch at
        a time, as _images prepares them all."""
        return lambda xb, first: prepare_batch(xb, self.normalization, what, first)

    # --- using it -----------------------------------------------------------------------------

    @_one_at_a_time(in_callback=True)
    def predict(self, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """x (N, C, H, W) -> class probabilities (N, M) float32, each row summing to 1,
        computed batch by batch on the devices."""
        return self._predict(x, batch_size, "x")

    def _predict(self, x, batch_size, what: str) -> np.ndarray:
        """predict(), its errors naming the images as `what`."""
        batch_size = _positive(batch_size, "batch_size")
        xs = check_images(x, self.input_shape, what)
        batch_size = min(batch_size, len(xs))    # no batch larger than the images, or memory
        net = self._start(batch_size)
        probs = evaluation.probabilities(net, xs, batch_size, self._batch_preparer(what))
        bad = np.flatnonzero(~np.isfinite(probs).all(axis=1))
        if len(bad):
            raise DataError(_overflow_message(what, bad, len(xs)))
        return probs

    @_one_at_a_time(in_callback=True)
    def evaluate(self, x: Optional[np.ndarray] = None, y: Optional[np.ndarray] = None, *,
                 dataset: Optional[str] = None, data_dir: Optional[str] = None,
                 batch_size: int = 64) -> dict:
        """The loss, accuracy and per-class accuracy on images x (N, C, H, W) with labels y,
        or on a named dataset's test split: {"loss", "accuracy", "per_class_accuracy",
        "images"}."""
        batch_size = _positive(batch_size, "batch_size")
        if dataset is not None:
            if x is not None or y is not None:
                raise UsageError("evaluate: give either arrays (x, y) or dataset=, not both")
            # the test files alone, but where an earlier version's file takes the
            # dataset's images normalised by the training split's statistics
            ds = load_test_split(dataset, data_dir, seed=self.seed,
                                 train_statistics=not self._records_normalization,
                                 input_shape=self.input_shape)
            if ds.x_test is None:
                raise DataError(f"dataset {dataset} has no test split to evaluate on")
            if ds.input_shape != self.input_shape:
                raise DataError(f"dataset {dataset} has {'x'.join(map(str, ds.input_shape))} "
                                f"images, but the network takes "
                                f"{'x'.join(map(str, self.input_shape))}")
            # raw pixels as this network's training images were prepared, as predict() does:
            # by its normalisation, which may be another dataset's, or / 255 where it has none
            # (trained on uint8 arrays or an npz file of them); not as the dataset's own. Only
            # a file of an earlier version, which records nothing of how its images were
            # prepared, takes the dataset's images as they are.
            raw = ds.x_test_raw is not None and self._records_normalization
            what = f"dataset {dataset}'s test images"
            xs = check_images(ds.x_test_raw, self.input_shape, what) if raw else ds.x_test
            prepare = self._batch_preparer(what) if raw else None
            ys = prepare_labels(ds.y_test, len(xs), self.num_classes,
                                f"dataset {dataset}'s test labels (for a network of "
                                f"{self.num_classes} classes)")
        else:
            if x is None and y is None:
                raise UsageError("evaluate: give the images and labels (x, y), or dataset= "
                                 "(a named dataset's test split)")
            if data_dir is not None:
                raise UsageError("evaluate: data_dir= is the folder of dataset='s files; with "
                                 "arrays (x, y) it would be read by nothing")
            xs, ys = self._checked_xy(x, y, "x", "y")
            prepare = self._batch_preparer("x")
        batch_size = min(batch_size, len(xs))    # no batch larger than the images, or memory
        net = self._start(batch_size)
        z = evaluation.logits(net, xs, batch_size, prepare)
        bad = np.flatnonzero(~np.isfinite(z).all(axis=1))   # finite logits: a finite loss
        if len(bad):
            raise DataError(_overflow_message("x" if dataset is None else f"dataset {dataset}",
                                              bad, len(xs)))
        return evaluation.score(z, ys, self.num_classes)

    @_one_at_a_time(in_callback=True)
    def save(self, path: "str | os.PathLike") -> None:
        """Write the weights (float32, PyTorch's names and layout) and the network's
        description to an .npz; pyhet.load() needs nothing else."""
        path = _path(path, "save")
        check_file_destination(path, "save")     # a folder, a missing one: before writing
        params = self.params()
        bad = [k for k, v in params.items() if not np.isfinite(v).all()]
        if bad:      # a fit() that diverged: a file that load() would refuse
            raise TrainingError(f"save {path}: {', '.join(bad)} hold NaN or infinite "
                                f"values (training diverged): nothing written")
        save_weights(path, params, self.geometry, self.classes, self.normalization)


def load(path: "str | os.PathLike", devices: str = "auto", *, balance: str = "dynamic",
         input_shape: Optional[Sequence[int]] = None, seed: int = 0) -> Network:
    """The Network saved in a weight file. input_shape (C, H, W) is needed only for files of
    earlier versions, which do not record it; seed: as Network's, for later fits' data order
    (a weight file does not record the seed it was trained with)."""
    path = _path(path, "load")
    input_shape = None if input_shape is None else _input_shape(input_shape)
    read = read_weight_file(path)
    geometry, meta = network_of_file(path, input_shape, read)
    if meta is not None and input_shape is not None and input_shape != geometry.input_shape:
        raise UsageError(f"load: input_shape {input_shape} was given, but weight file "
                         f"{path} records {geometry.input_shape}; leave it out (only "
                         f"files of earlier versions need it)")
    params = load_weights(path, geometry, read)
    meta = meta or {}
    normalization = _checked_normalization(meta.get("normalization"), geometry.input_shape[0],
                                           WeightsError,
                                           f"weight file {path}: its normalization")
    net = Network(geometry.arch, geometry.input_shape, geometry.num_classes, devices=devices,
                  balance=balance, seed=seed, classes=meta.get("classes"),
                  normalization=normalization, weights=params)
    net._records_normalization = bool(meta.get("records_normalization", False))
    return net


def _input_shape(input_shape) -> tuple:
    """(C, H, W) as ints, from three whole numbers >= 1; else UsageError."""
    if not (isinstance(input_shape, (tuple, list)) and len(input_shape) == 3 and all(
            _is_whole(v) and v >= 1 for v in input_shape)):
        raise UsageError(f"input_shape must be (C, H, W), three whole numbers >= 1, got "
                         f"{input_shape!r}")
    return tuple(int(v) for v in input_shape)


def _path(path, what: str, kind: str = "a file's path") -> str:
    """The str of a path argument (save's and load's path, checkpoint_dir): a non-empty str, or
    an os.PathLike that gives one, without NUL (which no file name can hold: open() would raise
    a bare ValueError); else UsageError, before anything is read or made. `what`: the argument
    as messages name it; `kind`: what it should be."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"{what}: expected {kind} (str or os.PathLike), got {shown(path)}")
    accepted = f"{kind} (str, or os.PathLike whose __fspath__ gives a str)"
    try:
        text = os.fspath(path)
    except TypeError as e:     # its __fspath__ gives neither str nor bytes
        raise UsageError(f"{what}: expected {accepted}, got {shown(path)} ({e})") from None
    if not isinstance(text, str):   # bytes, refused as a bytes path is
        raise UsageError(f"{what}: expected {accepted}, got {shown(path)}, whose __fspath__ "
                         f"gives {shown(text)}")
    if not text:
        raise UsageError(f"{what}: an empty path; expected {kind}")
    if "\0" in text:
        raise UsageError(f"{what}: expected {kind} without NUL characters (no file name can "
                         f"hold one), got {shown(text)}")
    text = files.user_path(text)     # a leading ~, as the dataset's paths and the CLI's
    if not os.path.isabs(text) and files.working_folder_gone():
        raise UsageError(f"{what} {shown(text)}: a relative path, but "
                         f"{files.WORKING_FOLDER_GONE}: give a full path")
    return text


def _checked_normalization(norm, channels: int, error, what: str):
    """None, or a Normalization with one scale and one shift per channel of the images, each a
    finite number and each scale > 0: what a weight file may record (Normalization.from_dict's
    rules), so that save() never writes a file that load() refuses, and raw pixels never
    become NaN inputs or a bare NumPy error in predict() or fit()."""
    if norm is None:
        return None
    if not isinstance(norm, Normalization):
        raise error(f"{what} must be a pyhet.images.Normalization or None, got {norm!r}")
    values = {}
    for k in ("scale", "shift"):
        v = getattr(norm, k)
        if (not isinstance(v, (tuple, list, np.ndarray))
                or isinstance(v, np.ndarray) and v.ndim != 1):
            raise error(f"{what}'s {k} must be a tuple of numbers, one per channel, got "
                        f"{shown(v)}")
        # NumPy's numbers as Python's, which the file's rules take
        values[k] = [float(x) if isinstance(x, np.floating) else
                     int(x) if isinstance(x, np.integer) else x for x in v]
    if len(values["scale"]) != channels or len(values["shift"]) != channels:
        raise error(f"{what} has {len(values['scale'])} scales and "
                    f"{len(values['shift'])} shifts, but the images have {channels} channel"
                    f"{'s' if channels != 1 else ''}: one of each per channel")
    try:
        with np.errstate(over="ignore"):   # past float32's range (1e39): refused as not finite
            Normalization.from_dict(values)
    except ValueError as e:
        raise error(f"{what}: {e}") from None
    return norm


def _overflow_message(what: str, bad, n: int) -> str:
    """What to say of outputs that are not finite (float32 overflowed) on images `bad` of n."""
    first = f", the first at index {int(bad[0])}" if len(bad) else ""
    return (f"{what}: the network's outputs are not finite (they overflow float32) on "
            f"{len(bad)} of {n} images{first}: the images or the weights are far too large; "
            f"no result")


def _close_all(devices) -> None:
    """Close every device, also where one fails to (then its error is raised at the end)."""
    failed = None
    for d in devices:
        try:
            d.close()
        except BaseException as e:
            failed = failed or e
    if failed is not None:
        raise failed


def _is_whole(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _whole(v, name, minimum: int) -> int:
    if not _is_whole(v) or v < minimum:
        raise UsageError(f"{name} must be a whole number >= {minimum}, got {shown(v)}")
    return int(v)


def _seed(v) -> int:
    """A seed: a whole number in 0 .. MAX_SEED (a checkpoint records it)."""
    v = _whole(v, "seed", 0)
    if v > MAX_SEED:
        raise UsageError(f"seed must be at most 2**64 - 1, got {shown(v)}")
    return v


def _flag(v, name) -> bool:
    """A bool argument: True or False (NumPy's too), never a value read as one ("no")."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise UsageError(f"{name} must be True or False, got {v!r}")


def _positive(v, name) -> int:
    return _whole(v, name, 1)
