"""A network as a list of blocks, and its weight files in PyTorch's layout.

    x (N, C, H, W) -> conv1 block -> ... -> convN block -> flatten (N, F)
                   -> fc1 -> ReLU -> ... -> fcM -> ReLU -> fc (N, M classes)

Each conv block (pyhet.geometry.ConvGeometry: conv with stride and padding, ReLU, optional
max-pool) is a PartitionedConv whose kernels are spread over the devices; flatten, the fc layers
and the loss run on the master.

A weight file is an .npz of float32 arrays named and shaped as the equivalent torch.nn model's
state_dict, conv1.weight (K1, C, R, S), conv1.bias (K1,), ..., fc1.weight (U1, F), ...,
fc.weight (M, F or UM), fc.bias (M,), the fc input flattened in (C, H, W) order, plus one string
entry ``arch`` (JSON: the --arch notation, input shape, classes, class names, and the
normalization of uint8 images) so that evaluation and prediction need only the file. Files
without it (the two-block networks of earlier versions) still load: their shape is read off the
arrays.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import math
import os
import re
import time

import numpy as np

from . import arch as arch_notation
from . import files, npzfile
from .images import Normalization, native_float32
from .interrupt import HeldSignals
from .errors import TrainingError, WeightsError, option, shown
from .geometry import NetGeometry
from .layers import Flatten, Linear, ReLU, SoftmaxCrossEntropy, init_uniform
from .optim import SGDConfig
from .parallel import PartitionedConv
from .timing import PartTimer

ARCH_KEY = "arch"        # the weight file's one non-float entry
FORMAT = 1               # of that entry


def init_params(net: NetGeometry, seed: int = 0) -> dict:
    """PyTorch's default initialisation, seeded: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), layer by
    layer in order (weight, then bias)."""
    rng = np.random.default_rng(seed)
    params = {}
    shapes = net.param_shapes()
    for name in shapes:
        if name.endswith(".weight"):
            layer = name[:-len(".weight")]
            fan_in = int(np.prod(shapes[name][1:]))
            params[name] = init_uniform(rng, shapes[name], fan_in)
            params[f"{layer}.bias"] = init_uniform(rng, shapes[f"{layer}.bias"], fan_in)
    return params


# ================================================================================================
# Weight files


def arch_entry(net: NetGeometry, classes=None, normalization=None) -> np.ndarray:
    """The file's description of the network: a 0-d string array holding JSON with the
    --arch notation, the input shape, the classes (and their names, where known) and how raw
    uint8 images were prepared for training (pyhet.images.Normalization, or None)."""
    meta = {"format": FORMAT, "arch": net.arch, "input_shape": list(net.input_shape),
            "num_classes": net.num_classes, "classes": list(classes) if classes else None,
            "normalization": normalization.as_dict() if normalization is not None else None}
    return np.array(json.dumps(meta))


def write_npz(path, arrays: dict, what: str = "the file") -> None:
    """np.savez, atomically and durably: written to a hidden temporary file beside `path`
    (``.NAME.tmp``, which no ``*.npz`` pattern matches), flushed to disk (os.fsync), renamed
    over `path`, and the folder synced, so that a crash, a full disk or Ctrl-C at any moment
    leaves either the earlier file or the new one, complete, and no temporary file (but for
    SIGKILL or a power cut, whose leftover the next write of that name, or the checkpoint
    folder when next opened, removes). The temporary file is always made anew (a leftover
    one, or a link at its name, is removed, never followed); a FIFO, a device or a folder at
    `path` is refused, never replaced.

    Two writes of one file at once: each holds its temporary file flock()ed from its making
    to its rename, and a leftover is removed only where no write holds it. So a second write
    that finds the first's under way fails at once (WeightsError), renaming nothing; and
    where it took the first's file for a leftover in the instant before that one locked it,
    the first finds its file gone before its rename and fails instead."""
    path = os.fspath(path)
    folder, name = files.folder_of(path), os.path.basename(path)
    tmp = files.temp_name(path)
    try:
        held = os.stat(folder)      # the folder as it is now: removed meanwhile, said so
    except OSError:
        held = None
    problem = files.destination_problem(path)   # never replaces a FIFO, a device, a folder
    if problem is not None:
        raise WeightsError(f"cannot write {what} {path}: {problem}")
    under_way = (f"cannot write {what} {path}: another write of it is under way (its "
                 f"temporary file {tmp} is held); {path} is as that write leaves it")
    try:
        if os.path.lexists(tmp):   # a write cut short, or a link: removed, never followed
            _remove_leftover(tmp, under_way)
        try:
            fd = files.create_new(tmp)
        except FileExistsError:          # another write made it meanwhile
            raise WeightsError(under_way) from None
        with os.fdopen(fd, "wb") as fh:
            mine = os.fstat(fh.fileno())
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in files.HELD:
                    # another write's check holds it this instant: that write removes it, as
                    # a leftover, or fails
                    raise WeightsError(under_way) from e
                if e.errno not in files.NO_LOCKS:
                    raise
                # a file system without flock: written unlocked, the check before the rename
                # still sees a take of the file (but for one in that instant)
            try:
                _savez(fh, arrays, name)
                fh.flush()
                os.fsync(fh.fileno())
                if not _still_mine(tmp, mine):
                    if _removed(folder, held):
                        raise WeightsError(f"cannot write {what} {path}: its folder was "
                                           f"removed while it was written")
                    # another write of the same file at once removed this temporary file (as
                    # a leftover, before this one locked it) and made its own there: that one
                    # is not this one's to rename, nor to remove
                    raise WeightsError(f"cannot write {what} {path}: another write of it at "
                                       f"the same time took its temporary file {tmp}; {path} "
                                       f"is as that write leaves it")
                os.replace(tmp, path)     # still locked: no other write takes it meanwhile
            except BaseException:    # OSError, and KeyboardInterrupt or SIGTERM mid-write:
                if _still_mine(tmp, mine):   # this write's file, still locked: removed
                    try:
                        os.remove(tmp)
                    except OSError:
                        pass
                raise
        _sync_folder(folder)
    except OSError as e:
        raise WeightsError(f"cannot write {what} {path}: {e.strerror or e}") from e


def _remove_leftover(tmp: str, under_way: str) -> None:
    """Remove the file at write_npz's temporary name where no write holds it: under an
    exclusive lock of its own, and only if it is still the file locked (a check, then an
    unlink, would let another write make its file there in between). A write that holds it
    makes this one fail (WeightsError(under_way)). A link, or a file this process cannot
    open, is removed unlocked (never followed)."""
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:        # renamed by its write meanwhile
        return
    except OSError:                  # a link (ELOOP), or unreadable
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in files.HELD:
                raise WeightsError(under_way) from e
            if e.errno not in files.NO_LOCKS:
                raise
        if _still_mine(tmp, os.fstat(fd)):
            os.unlink(tmp)           # while locked: no write's own
    finally:
        os.close(fd)


def _removed(folder: str, held: "os.stat_result | None") -> bool:
    """Whether the folder `held` (stat of it before) is gone: not there, another one made at
    its path, or removed while it is this process's working folder (still there to stat, by
    no name)."""
    try:
        now = os.stat(folder)
    except OSError:
        return True
    return held is not None and ((now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)
                                 or now.st_nlink == 0)


def _still_mine(tmp: str, mine: os.stat_result) -> bool:
    """Whether the temporary file at `tmp` is still the one this write made (by device and
    inode)."""
    try:
        there = os.lstat(tmp)
    except OSError:
        return False
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def _savez(fh, arrays: dict, name: str) -> None:
    """np.savez into the open file. The tests make a write stop halfway, so that a process can
    be killed with half a file on disk: PYHET_TEST_STALL_WRITE=NAME writes half of the file
    NAME, then sleeps (a test-only switch; nothing else reads it)."""
    if os.environ.get("PYHET_TEST_STALL_WRITE") == name:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        data = buf.getvalue()
        fh.write(data[:len(data) // 2])
        fh.flush()
        time.sleep(600)
    np.savez(fh, **arrays)


def _sync_folder(folder: str) -> None:
    """Make a rename in `folder` durable (where the system allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_weights(path, params: dict, net: NetGeometry, classes=None, normalization=None) -> None:
    """Write the parameters (float32, PyTorch's layout) and the network's description to an
    .npz, atomically."""
    arrays = {k: np.asarray(params[k], np.float32) for k in net.param_names}
    arrays[ARCH_KEY] = arch_entry(net, classes, normalization)
    write_npz(path, arrays, "the weight file")


def read_weight_file(path) -> tuple[dict, dict | None]:
    """(arrays, description) of a weight file or checkpoint; the description (the ``arch``
    entry, parsed) is None for files that do not carry one."""
    arrays = npzfile.read(path, _weight_file_error, "an .npz of named float32 arrays "
                          "(pyhet train --save, Network.save or np.savez)")
    meta = None
    if ARCH_KEY in arrays:
        entry = arrays.pop(ARCH_KEY)
        try:
            if entry.dtype.kind not in "US" or entry.shape != ():
                what = "strings" if entry.dtype.kind in "US" else entry.dtype
                raise ValueError(f"an array of {what} of shape {entry.shape}, not one JSON "
                                 f"string")
            try:
                meta = json.loads(str(entry), parse_int=json_int)
            except json.JSONDecodeError as e:
                raise ValueError(f"not JSON: {e}") from None
            if not isinstance(meta, dict) or not isinstance(meta.get("arch"), str):
                raise ValueError("no 'arch' string")
            if meta.get("format", 1) != FORMAT:
                got = meta.get("format")
                kind = "" if isinstance(got, int) else f" (a {type(got).__name__})"
                raise ValueError(f"its format is {shown(got)}{kind}, this version reads the "
                                 f"number {FORMAT}")
            meta["input_shape"] = tuple(_whole_entry(v, "input_shape")
                                        for v in meta["input_shape"])
            if len(meta["input_shape"]) != 3:
                raise ValueError(f"input_shape {list(meta['input_shape'])} is not (C, H, W)")
            meta["num_classes"] = _whole_entry(meta["num_classes"], "num_classes")
            # files of earlier versions record no normalisation, not even none
            meta["records_normalization"] = "normalization" in meta
            norm = meta.get("normalization")
            meta["normalization"] = None if norm is None else Normalization.from_dict(norm)
            meta["classes"] = check_class_names(meta.get("classes"), meta["num_classes"])
        except RecursionError:    # JSON nested deeper than Python's parser goes
            raise WeightsError(f"weight file {path}: its {ARCH_KEY!r} entry is not a network "
                               f"description (JSON nested too deeply)") from None
        except (ValueError, TypeError, KeyError) as e:
            why = f"it has no {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
            raise WeightsError(f"weight file {path}: its {ARCH_KEY!r} entry is not a network "
                               f"description ({why})") from None
    return arrays, meta


# the longest whole number a JSON entry is read with: Python's own limit, past which it refuses
# with advice on that limit (sys.set_int_max_str_digits), no word on the file. Shorter ones are
# read, and each entry's checks say what is wrong with them (a calibration's figure past
# float's range makes a checkpoint's plan one to make afresh, not a damaged checkpoint)
JSON_INT_DIGITS = 4300


def json_int(text: str) -> int:
    """json.loads' parse_int: a whole number of at most JSON_INT_DIGITS digits; else
    ValueError saying how long it is."""
    digits = len(text.lstrip("-"))
    if digits > JSON_INT_DIGITS:
        raise ValueError(f"a number of {digits:,} digits, where a whole number of at most "
                         f"{JSON_INT_DIGITS:,} digits is read")
    return int(text)


def _whole_entry(v, what: str) -> int:
    """A whole number of a network description (int() would read 1.5 as 1); else ValueError."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what}: {shown(v)} is not a whole number")
    if not 1 <= v <= 2**31 - 1:      # the core's sizes are C ints
        raise ValueError(f"{what}: {shown(v)} is not in 1 .. 2**31 - 1")
    return v


def _weight_file_error(message) -> WeightsError:
    """A WeightsError whose message begins "weight file PATH: ..." (raised by npzfile.read)."""
    return WeightsError(f"weight file {message}")


def check_class_names(names, num_classes: int):
    """None, or a list of num_classes strings; else ValueError."""
    if names is None:
        return None
    if not isinstance(names, (list, tuple)) or len(names) != num_classes or not all(
            isinstance(n, str) for n in names):
        raise ValueError(f"class names must be {num_classes} strings, got {shown(names)}")
    return list(names)


_LEGACY = re.compile(r"^conv[12]\.(weight|bias)$|^fc\.(weight|bias)$")


def network_of_file(path, input_shape=None, read=None) -> tuple[NetGeometry, dict | None]:
    """The network a weight file was saved from, and its description. A file without one (the
    two-block networks of earlier versions) is read as ``AC{k}-P2-BC{k}-P2`` from its arrays;
    then input_shape (C, H, W) must be given, since the file does not hold it. read: the file's
    read_weight_file(), where the caller has it (a file is read once)."""
    arrays, meta = read if read is not None else read_weight_file(path)
    if meta is not None:
        try:
            net = arch_notation.build(meta["arch"], meta["input_shape"], meta["num_classes"])
        except Exception as e:  # an edited or foreign file: say which
            raise WeightsError(f"weight file {path}: its network {meta['arch']!r} cannot be "
                               f"built ({e})") from None
        return net, meta
    names = {k for k in arrays if _LEGACY.match(k)}

    def rank(k):     # of each array of a two-block network
        return 4 if ".weight" in k and "conv" in k else 2 if ".weight" in k else 1

    odd = sorted(k for k in names if arrays[k].ndim != rank(k))
    if len(names) != 6 or odd:
        has = (", ".join(f"{k} of {arrays[k].ndim} dimensions, not {rank(k)}" for k in odd)
               if len(names) == 6 else ", ".join(shown(k) for k in sorted(arrays))
               or "nothing")
        raise WeightsError(f"weight file {path}: it carries no network description and is not "
                           f"a two-block network (conv1, conv2, fc) either; it has {has}")
    if input_shape is None:
        raise WeightsError(f"weight file {path}: it carries no network description (a file "
                           f"of an earlier version), so its input shape must be given: "
                           f"load(path, input_shape=(C, H, W))")
    w1, w2, fc = arrays["conv1.weight"], arrays["conv2.weight"], arrays["fc.weight"]
    spec = arch_notation.shorthand((w1.shape[0], w2.shape[0]), w1.shape[2])
    try:
        net = arch_notation.build(spec, input_shape, fc.shape[0])
    except Exception as e:
        raise WeightsError(f"weight file {path}: read as {spec!r}, it does not fit "
                           f"{'x'.join(map(str, input_shape))} input ({e})") from None
    return net, None


def _float32(dtype) -> bool:
    """float32 of either byte order (a big-endian machine's arrays are read as native)."""
    return dtype.kind == "f" and dtype.itemsize == 4


def checked_params(weights: dict, net: NetGeometry, what: str = "weights",
                   copy: bool = True) -> dict:
    """C-ordered copies (or, copy=False, the arrays themselves where they are C-ordered) of the
    network's parameters from {name: array}: every name present, float32 (of either byte
    order: the other is converted, a copy), the network's shapes, finite; else WeightsError,
    which calls them `what` (weights, a checkpoint's momentum)."""
    if not isinstance(weights, dict):
        raise WeightsError(f"{what} must be a dict of arrays, got {type(weights).__name__}")
    want = net.param_shapes()
    missing = [k for k in want if k not in weights]
    extra = [k for k in weights if k not in want]
    if missing or extra:
        raise WeightsError(f"{what} for {net.arch}: missing {', '.join(missing) or 'nothing'}, "
                           f"unknown {', '.join(map(str, extra)) or 'nothing'}")
    out = {}
    for k, shape in want.items():
        a = weights[k]
        if not isinstance(a, np.ndarray) or not _float32(a.dtype) or a.shape != shape:
            raise WeightsError(f"{what} for {net.arch}: {k} must be a float32 array of shape "
                               f"{shape}, got {getattr(a, 'dtype', type(a).__name__)} "
                               f"{getattr(a, 'shape', '')}")
        if not np.isfinite(a).all():
            raise WeightsError(f"{what} for {net.arch}: {k} holds NaN or infinite values")
        # (C order: the updates work on flat views of the arrays; native float32 of either
        # byte order, a big-endian machine's arrays: a copy converts them)
        out[k] = (np.array(a, np.float32, order="C")
                  if copy or not a.flags.c_contiguous or not a.dtype.isnative else a)
    return out


def load_weights(path, net: NetGeometry, read=None) -> dict:
    """Read a weight file (or checkpoint) and check it against the network it must fit; float32
    of the other byte order (a big-endian machine's file) comes back as native float32. read:
    the file's read_weight_file(), where the caller has it (a file is read once)."""
    path = os.fspath(path)
    arrays, meta = read if read is not None else read_weight_file(path)
    if meta is not None and (meta["arch"] != net.arch or
                             tuple(meta["input_shape"]) != tuple(net.input_shape) or
                             meta["num_classes"] != net.num_classes):
        raise WeightsError(f"weight file {path} holds the network {meta['arch']} on "
                           f"{'x'.join(map(str, meta['input_shape']))} input with "
                           f"{meta['num_classes']} classes, but this run's is {net.arch} on "
                           f"{'x'.join(map(str, net.input_shape))} input with "
                           f"{net.num_classes} classes")
    want = net.param_shapes()
    missing = [k for k in want if k not in arrays]
    if missing:
        raise WeightsError(f"weight file {path}: missing {', '.join(missing)} "
                           f"(it has {', '.join(sorted(arrays)) or 'nothing'})")
    # a checkpoint also holds momentum/* arrays and its position (meta); nothing else belongs
    extra = [k for k in arrays if k not in want and "/" not in k and k != "meta"]
    if extra:
        raise WeightsError(f"weight file {path}: {', '.join(sorted(extra))} are not parameters "
                           f"of the network {net.arch} (a file of another network?)")
    params = {}
    for k in want:
        a = arrays[k]
        if not _float32(a.dtype):
            raise WeightsError(f"weight file {path}: {k} must be float32, got {a.dtype}")
        if a.shape != want[k]:
            raise WeightsError(f"weight file {path}: {k} has shape {a.shape}, but the network "
                               f"{net.arch} on {'x'.join(map(str, net.input_shape))} input with "
                               f"{net.num_classes} classes needs {want[k]}")
        if not np.isfinite(a).all():
            raise WeightsError(f"weight file {path}: {k} holds NaN or infinite values")
        params[k] = np.ascontiguousarray(native_float32(a))
    return params


# ================================================================================================
# The network


class Head:
    """The master's part of a network: flatten, the fc layers (a ReLU after each hidden one),
    the loss, and the fc layers' SGD update, on the master's backend `host`."""

    def __init__(self, net: NetGeometry, params: dict, host):
        self.host = host
        self.names = [name for name, _, _ in net.fc_layers()]
        self.flatten = Flatten()
        self.fcs = [Linear(params[f"{name}.weight"].copy(), params[f"{name}.bias"].copy(),
                           backend=host) for name in self.names]
        self.relus = [ReLU() for _ in net.hidden]   # after each hidden fc layer
        self.loss = SoftmaxCrossEntropy()
        self.momentum = {name: {"weight": None, "bias": None} for name in self.names}

    def forward(self, h):
        """The last conv block's output (N, C, H, W) -> logits (N, M)."""
        h = self.flatten.forward(h)
        for fc, relu in zip(self.fcs, self.relus):
            h = relu.forward(fc.forward(h))
        return self.fcs[-1].forward(h)

    def train(self, h, labels) -> tuple:
        """Forward and backward on a batch: (the loss, its gradient for h)."""
        loss = self.loss.forward(self.forward(h), labels)
        d = self.fcs[-1].backward(self.loss.backward())
        for fc, relu in zip(reversed(self.fcs[:-1]), reversed(self.relus)):
            d = fc.backward(relu.backward(d))
        return loss, self.flatten.backward(d)

    def update(self, cfg: SGDConfig) -> None:
        """One SGD step of the fc layers from the gradients of the last train()."""
        for name, fc in zip(self.names, self.fcs):
            mom = self.momentum[name]
            for k in ("weight", "bias"):
                mom[k] = self.host.sgd_update(fc.params[k], fc.grads[k], mom[k], cfg)
            fc.grads = {}   # used: between steps (and fits) a large layer holds no gradient


def time_head(net: NetGeometry, batch: int, host, rounds: int = 7, seed: int = 0,
              budget_s: float = 0.25) -> float:
    """The master's own work of one training step of `net` on a batch (Head: the fc layers
    forward and backward, the loss, their update), timed on `host`: the median of `rounds`
    runs after two that warm it up, or of more where they take less than `budget_s` together
    (at most 8 * rounds: a small head takes a millisecond, which a shared machine's noise
    moves by half), on random data and weights of the real shapes."""
    rng = np.random.default_rng(seed)
    fcs = {name for name, _, _ in net.fc_layers()}
    params = {k: (rng.standard_normal(shape) * 0.01).astype(np.float32)
              for k, shape in net.param_shapes().items() if k.split(".")[0] in fcs}
    head = Head(net, params, host)
    last = net.blocks[-1]
    h = rng.standard_normal((batch, *last.out_shape)).astype(np.float32)
    labels = rng.integers(0, net.num_classes, batch)
    cfg = SGDConfig()
    times = []
    for r in range(8 * rounds + 2):
        t0 = time.perf_counter()
        head.train(h, labels)
        head.update(cfg)
        if r >= 2:
            times.append(time.perf_counter() - t0)
            if len(times) >= rounds and sum(times) >= budget_s:
                break
    return float(np.median(times))


# A step whose conv layers the calibration predicts longer than this runs no timed steps: its
# master's work is timed on its own (time_head; the difference is a fraction of a millisecond)
# and its conv layers are taken at their model's time, their trials long enough (time_in_step).
IN_STEP_MAX_S = 0.25
IN_STEP_MAX_STEPS = 400   # steps timed at most (time_in_step)


class _Timed:
    """An object whose methods named in `methods` add their seconds to timer's part `part`."""

    def __init__(self, obj, methods, timer: PartTimer, part: str):
        self._obj, self._methods, self._timer, self._part = obj, methods, timer, part

    def __getattr__(self, name):
        fn = getattr(self._obj, name)
        if name not in self._methods:
            return fn

        def timed(*args, **kwargs):
            with self._timer(self._part):
                return fn(*args, **kwargs)
        return timed


def time_in_step(net: NetGeometry, batch: int, devices, partition: dict, host,
                 predicted_s: float, rounds: int = 7, seed: int = 0,
                 budget_s: float = 1.0):
    """(the master's own work of a step, {conv layer: its seconds}) timed inside training
    steps of `net` on these devices with this partition (layer -> kernels per device), or None
    where the conv layers' `predicted_s` is above IN_STEP_MAX_S. A conv layer's seconds are its
    calls' (its forward, backward and update); the master's work is the step less them: the fc
    layers, the loss, their update and the step's own bookkeeping. In a step the master waits
    for the devices' conv layers before it runs its own work, and then runs it 2-4 times slower
    than in a loop of its own (one cpu core: 0.07 ms for the default network's fc layer at batch
    4 in a loop, 0.28 ms after a 2 ms wait, 0.22-0.29 ms in a step): a tenth of a step of a few
    milliseconds; and a short conv layer takes longer than in a loop of that layer alone (the
    same network's conv1 at batch 4 on a pair of cpu:1 devices: 1.46-1.81 ms in steps,
    0.82-1.23 ms as calibration predicted it from its trials, from one calibration to the
    next). Medians of `rounds` steps after two that warm up, or of more while they take less
    than `budget_s` together (at most IN_STEP_MAX_STEPS: a step of a few milliseconds moves by
    20-25% from one second to the next on a shared machine); the devices' shards of the layers
    are dropped after."""
    if predicted_s > IN_STEP_MAX_S:
        return None
    rng = np.random.default_rng(seed)
    params = {k: (rng.standard_normal(shape) * 0.01).astype(np.float32)
              for k, shape in net.param_shapes().items()}
    x = rng.standard_normal((batch, *net.input_shape)).astype(np.float32)
    labels = rng.integers(0, net.num_classes, batch)
    cfg, masters, total, timer = SGDConfig(), [], 0.0, PartTimer()
    layers = {g.name: [] for g in net.blocks}
    try:
        model = Net(net, params, devices, partition, host)
        model.convs = [_Timed(c, ("forward", "backward", "step", "commit"), timer, g.name)
                       for c, g in zip(model.convs, net.blocks)]
        for r in range(max(rounds, IN_STEP_MAX_STEPS) + 2):
            timer.parts.clear()
            t0 = time.perf_counter()
            model.train_step(x, labels, cfg)
            wall = time.perf_counter() - t0
            if r >= 2:
                conv = [timer.parts.get(g.name, 0.0) for g in net.blocks]
                masters.append(max(0.0, wall - sum(conv)))
                for g, t in zip(net.blocks, conv):
                    layers[g.name].append(t)
                total += wall
                if len(masters) >= rounds and total >= budget_s:
                    break
    finally:
        for g in net.blocks:
            for d in devices:
                try:
                    d.call("calibration", d.drop_shard, g.name)
                except Exception:  # noqa: BLE001 (a device that failed: its error goes on)
                    pass
    return float(np.median(masters)), {k: float(np.median(v)) for k, v in layers.items()}


class Net:
    """A network over a set of devices: every conv block partitioned over them, the fc layers
    and the loss on the master."""

    def __init__(self, net: NetGeometry, params: dict, devices, partition: dict, host):
        # partition: {"conv1": counts per device, ...}; host: the master's backend (fc, loss)
        self.shape, self.devices, self.host = net, list(devices), host
        # conv1's input is the data: it needs no gradient
        self.convs = [PartitionedConv(g, params[f"{g.name}.weight"], params[f"{g.name}.bias"],
                                      self.devices, partition[g.name], need_dx=i > 0)
                      for i, g in enumerate(net.blocks)]
        self.head = Head(net, params, host)
        # no device on another rank (pyhet.transport.mpi.RemoteDevice has a peer)
        self._local = all(getattr(d, "peer", None) is None for d in self.devices)
        self.steps_made = 0     # steps whose update is made (a Ctrl-C held to its end)

    def forward(self, x):
        """x (N, C, H, W) -> logits (N, M)."""
        h = x
        for conv in self.convs:
            h = conv.forward(h)
        return self.head.forward(h)

    def train_step(self, x, labels, cfg: SGDConfig, timer=None) -> float:
        """One SGD step on a batch; returns the loss. timer: a PartTimer that receives the time
        of the step's parts, or None."""
        t = timer if timer is not None else PartTimer()
        with t("conv_forward"):
            h = x
            for conv in self.convs:
                h = conv.forward(h)
        with t("fc"):
            loss, dh = self.head.train(h, labels)
        if not math.isfinite(loss):
            # a run ends at a non-finite loss (pyhet.train): its gradients would turn every
            # weight to NaN, so the network keeps the weights that gave it (saveable, and
            # what the error describes)
            return float(loss)
        with t("conv_backward"):
            for conv in reversed(self.convs):
                dh = conv.backward(dh)
        # every device's backward has finished before any update: the shared input gradient
        # reads the other devices' weights
        with t("update"):
            for conv in self.convs:
                conv.step(cfg)
            # every device of every layer has updated: only now does the step become final
            # (a device that fails before this leaves every layer as it was; pyhet.failover),
            # and Ctrl-C waits until every layer has it (here, where it only swaps arrays: a
            # device on another rank answers its commit, and Ctrl-C there ends every rank)
            with HeldSignals() if self._local else contextlib.nullcontext():
                for conv in self.convs:
                    conv.commit()
                self.head.update(cfg)
                self.steps_made += 1
        return float(loss)

    def failed(self) -> set:
        """The indices of the devices that failed (pyhet.failover), left out of every layer."""
        return set(self.convs[0].dead)

    def state(self, copy: bool = True, momentum: bool = True) -> tuple:
        """(params(), momentum()) from one gathering of each conv layer's shards (which gives
        the weights and the momentum together). copy=False: the fc layers' own arrays, not
        copies (the next update changes them in place: for a caller done with them before it,
        such as a checkpoint, which then needs no second copy of a large fc layer).
        momentum=False: the weights alone (the momentum None)."""
        params, moms = {}, {}
        for conv in self.convs:
            w, b, vw, vb = conv.gather_state(momentum)
            params[f"{conv.name}.weight"], params[f"{conv.name}.bias"] = w, b
            moms[conv.name] = (vw, vb)
        take = np.array if copy else np.asarray
        for name, fc in zip(self.head.names, self.head.fcs):
            params[f"{name}.weight"] = take(fc.params["weight"])
            params[f"{name}.bias"] = take(fc.params["bias"])
            moms[name] = tuple(None if v is None or not momentum else take(v)
                               for v in (self.head.momentum[name]["weight"],
                                         self.head.momentum[name]["bias"]))
        return params, moms

    def params(self, copy: bool = True) -> dict:
        """The current weights as host float32 arrays in PyTorch's layout, in layer order
        (copy=False: the fc layers' own arrays, as state() gives them; no momentum copied)."""
        params = self.state(copy=False, momentum=False)[0]
        if copy:
            for name in self.head.names:
                for k in ("weight", "bias"):
                    params[f"{name}.{k}"] = params[f"{name}.{k}"].copy()
        return params

    def momentum(self) -> dict:
        """{layer: (vw, vb)} host arrays, (None, None) before the first step."""
        return self.state()[1]

    def set_momentum(self, moms: dict) -> None:
        """Install momentum buffers {"conv1.weight": array, ...} (from a checkpoint; float32 of
        the other byte order, a big-endian machine's, as native float32)."""
        moms = {k: native_float32(v) for k, v in moms.items()}
        for conv in self.convs:
            if f"{conv.name}.weight" in moms:
                w, b, _, _ = conv.gather_state(momentum=False)
                conv.install(w, b, moms[f"{conv.name}.weight"], moms[f"{conv.name}.bias"],
                             conv.counts)
        for name in self.head.names:
            if f"{name}.weight" in moms:
                self.head.momentum[name] = {"weight": moms[f"{name}.weight"].copy(),
                                            "bias": moms[f"{name}.bias"].copy()}

    def set_state(self, params: dict, moms: dict) -> None:
        """Install whole weights (as params() gives them) and momentum (as momentum() gives
        it: (None, None) where there is none) on the devices as the layers are partitioned
        now; a fit that diverged puts back those it started with."""
        for conv in self.convs:
            conv.set_state(params[f"{conv.name}.weight"], params[f"{conv.name}.bias"],
                           *moms[conv.name])
        for name, fc in zip(self.head.names, self.head.fcs):
            fc.params = {k: np.array(params[f"{name}.{k}"], order="C")
                         for k in ("weight", "bias")}
            self.head.momentum[name] = {k: None if v is None else np.array(v, order="C")
                                        for k, v in zip(("weight", "bias"), moms[name])}

    def fail_over(self, failed, states: dict, partition: dict | None) -> None:
        """Leave the devices `failed` (indices) out from now on; every conv layer gets its
        state from `states` ({layer: consistent_state()}) on the other devices as `partition`
        ({layer: counts}) says, or keeps it on the master when no device is left (None)."""
        for conv in self.convs:
            conv.fail_over(failed, states[conv.name],
                           None if partition is None else partition[conv.name])

    def partition_counts(self) -> dict:
        """{layer: [kernels per device]} in device order."""
        return {conv.name: list(conv.counts) for conv in self.convs}

    def partition(self) -> dict:
        return {conv.name: {d.name: c for d, c in zip(self.devices, conv.counts)}
                for conv in self.convs}


def divergence_advice(lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                      python: bool = False) -> str:
    """What to change when training diverged. The weight decay's own part of SGD's update,
    w <- w - lr (m v + wd w), makes the weights grow by itself once lr x wd > 2 (1 + m) (the
    heavy-ball method's limit on a quadratic): then the decay is to blame, else the lr.
    python: name the settings as fit's arguments, not as options."""
    o = {k: option(k, python) for k in ("lr", "momentum", "weight_decay")}
    limit = 2 * (1 + momentum)
    if weight_decay > 0 and lr * weight_decay > limit:
        return (f"{o['lr']} x {o['weight_decay']} is {lr * weight_decay:g}, and above "
                f"{limit:g} (with {o['momentum']} {momentum:g}) the decay alone makes the "
                f"weights grow: try a smaller {o['weight_decay']} (now {weight_decay:g}) or "
                f"{o['lr']} (now {lr:g})")
    return f"try a smaller {o['lr']} (now {lr:g})"


def check_finite(params: dict, step: int, advice: str, consequence: "str | None") -> None:
    """TrainingError if any weight is NaN or infinite (an update too large for float32: the
    loss, computed before the update, may still have been finite). advice: what to change
    (divergence_advice)."""
    for name, w in params.items():
        if not np.isfinite(w).all():
            raise TrainingError(f"{name} holds NaN or infinite values after step {step}: "
                                f"training diverged"
                                + (f"; {consequence}" if consequence else "")
                                + f"; {advice}")
