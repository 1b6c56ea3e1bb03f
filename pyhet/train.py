"""Training: data -> devices -> network -> SGD steps -> summary.

The step loop times every step and the parts of it (conv forward/backward on the devices, the fc
layer on the master, the update), so the summary can say where the time went.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import math
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import numpy as np

from . import arch as arch_notation
from . import files, ops
from .backends.cpu import CpuBackend
from .backends.numpy_ref import NumpyBackend, host_available_memory
from .calibrate import Calibration, calibrate
from .checkpoint import DEFAULT_KEEP, CheckpointDir, dataset_identity
from .data import Dataset, data_dir_problem, iterate_batches, load_dataset
from .devices import arm_faults, make_devices
from .errors import (DataError, DeviceError, NoDeviceLeftError, PyhetError, TrainingError,
                     UsageError, flag, option, say, warn)
from .evaluation import evaluate
from .failover import Failover
from .geometry import NetGeometry
from .interrupt import Interruption
from .model import (Net, check_finite, divergence_advice, init_params, load_weights,
                    save_weights)
from .optim import SGDConfig
from .partition import Balancer, balanced, even
from .progress import Progress
from .specs import check_ranks, check_threads, cuda_device_count, for_rank, parse_devices
from .timing import PartTimer

BALANCE_MODES = ("dynamic", "static", "even")
# an image value beyond this is far from the order 1 of images prepared as networks expect
# them (normalised: a few units; raw pixel values as floats: up to 255): a run that diverged on
# such images says to scale them first
HUGE_IMAGE_VALUE = 1e3
# a run whose last training loss is above this many times ln(classes), a guess's, has diverged
# (pyhet warns), though its values stayed finite (the right class's probability below e^-230
# of 10 classes; a network of a large fc layer was at 11 times after its first three steps)
DIVERGED_LOSS_TIMES_CHANCE = 100.0


@dataclass
class TrainConfig:
    arch: str | None = None     # --arch; None: the --kernels/--kernel-size shorthand
    kernels: tuple = arch_notation.DEFAULT_KERNELS
    kernel_size: int = arch_notation.DEFAULT_KERNEL_SIZE
    dataset: str = "bundled"
    data_dir: str | None = None
    devices: str = "auto"
    balance: str = "dynamic"
    batch_size: int = 64
    epochs: int = 2
    steps: int | None = None
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    shuffle: bool = True
    init: str | None = None
    save: str | None = None
    checkpoint_dir: str | None = None
    resume: bool = False
    overwrite: bool = False        # --overwrite: delete another run's checkpoints first
    checkpoint_every: int | None = None   # also a checkpoint every N steps
    keep: int | None = None        # the newest checkpoints kept; 0: all; None: DEFAULT_KEEP
    deterministic: bool = False    # a partition that no timing decides, and no moves
    progress: bool = True
    timeout: float | None = None   # under mpiexec: seconds a rank may take to answer
    python: bool = False           # messages name Network.fit's arguments, not the options

    def option(self, name: str) -> str:
        """A setting as this run's user gives it (`--batch-size`, or fit's `batch_size`)."""
        return option(name, self.python)

    def check(self):
        o = self.option
        if self.batch_size < 1:
            raise ValueError(f"{o('batch_size')} must be >= 1, got {self.batch_size}")
        if self.epochs < 1 and self.steps is None:
            raise ValueError(f"{o('epochs')} must be >= 1, got {self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"{o('steps')} must be >= 1, got {self.steps}")
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"{o('balance')} must be one of {', '.join(BALANCE_MODES)}, "
                             f"got {self.balance!r}")
        self.check_destinations()
        SGDConfig(self.lr, self.momentum, self.weight_decay)  # checks its own ranges

    def kept(self) -> int:
        """How many checkpoints are kept: --keep, or DEFAULT_KEEP where not given."""
        return DEFAULT_KEEP if self.keep is None else self.keep

    def check_destinations(self):
        """Where the run will write (--save, --checkpoint-dir) and the checkpoint options,
        checked before any work: mistakes here are usage errors."""
        o, f = self.option, (lambda name: flag(name, self.python))
        problem = data_dir_problem(self.dataset, self.data_dir)   # before a folder is made
        if problem is not None:
            raise UsageError(problem)
        if self.save is not None:
            check_file_destination(self.save, o("save"))
            self._check_save_reads_nothing()
        if self.checkpoint_dir is None:
            for given, what in ((self.resume, f("resume")), (self.overwrite, f("overwrite")),
                                (self.checkpoint_every is not None, o("checkpoint_every")),
                                (self.keep is not None, o("keep"))):
                if given:
                    raise UsageError(f"{what} needs {o('checkpoint_dir')}")
        else:
            check_folder_destination(self.checkpoint_dir, o("checkpoint_dir"))
        if self.resume and self.overwrite:
            raise UsageError(f"{f('overwrite')} deletes the checkpoints that {f('resume')} "
                             f"continues from: give one or the other")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UsageError(f"{o('checkpoint_every')} must be >= 1, got "
                             f"{self.checkpoint_every}")
        if self.keep is not None and self.keep < 0:
            raise UsageError(f"{o('keep')} must be >= 0 (0 keeps every checkpoint), got "
                             f"{self.keep}")

    def _check_save_reads_nothing(self) -> None:
        """--save names none of the files the run reads or keeps: the npz dataset, --init, a
        dataset file in --data-dir, a checkpoint (or the lock) in --checkpoint-dir. Each was
        replaced by the weights without a word (the dataset lost; every later --resume
        warning of a damaged checkpoint; the folder's lock taken from the run holding it)."""
        o, save = self.option, self.save
        reads = [(f"{o('init')} {self.init}", self.init)]
        if self.dataset.startswith("npz:"):
            reads.append((f"{o('dataset')} {self.dataset}", self.dataset[len("npz:"):]))
        for what, path in reads:
            if path and files.same_file(save, files.user_path(path)):
                raise UsageError(f"{o('save')} {save}: the same file as {what}, which writing "
                                 f"it would replace: give another name")
        # the folders as the system resolves them (links, then ..): not os.path.abspath's
        name, folder = os.path.basename(save), files.folder_of(save)
        for what, where, names in ((o("checkpoint_dir"), self.checkpoint_dir, CHECKPOINT_NAMES),
                                   (o("data_dir"), self.data_dir, DATASET_NAMES)):
            if where and re.fullmatch(names, name) and files.same_file(
                    folder, files.user_path(where)):
                raise UsageError(f"{o('save')} {save}: a name the files of {what} {where} "
                                 f"have, which writing it would replace: give another name "
                                 f"or folder")

    @property
    def network(self) -> str:
        """The network in --arch notation."""
        return self.arch if self.arch is not None else arch_notation.shorthand(
            self.kernels, self.kernel_size)


# the names of the files a checkpoint folder and a dataset folder hold (--save refuses them)
CHECKPOINT_NAMES = r"\.?checkpoint-[0-9]+\.npz(\.tmp)?|\.lock"
DATASET_NAMES = (r"(train|t10k)-(images-idx3|labels-idx1)-ubyte(\.gz)?"
                 r"|(data_batch_[1-5]|test_batch)(\.bin)?|batches\.meta(\.txt)?")


def check_file_destination(path, option: str) -> None:
    """A file the run will write: a name, in a folder that exists and can be written."""
    path = os.fspath(path)
    if not path:
        raise UsageError(f"{option} '': give a file name")
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: a folder, not a file")
    if path.endswith(tuple(filter(None, (os.sep, os.altsep)))):
        raise UsageError(f"{option} {path}: names a folder (it ends in {path[-1]}), not a file")
    if path.lower().endswith(".npy"):   # (read back as an .npy: "no array 'x'", and the like)
        raise UsageError(f"{option} {path}: pyhet writes an .npz archive, which a name ending "
                         f"in .npy would have read back as a single array; give a name ending "
                         f"in .npz")
    # the folder as the system reaches it (link/.. is the folder above the link's target)
    problem = files.unreachable(files.folder_of(path))
    if problem is not None:
        raise UsageError(f"{option} {path}: {problem}")
    problem = files.destination_problem(path)   # write_npz's own refusals, before any work
    if problem is not None:
        raise UsageError(f"{option} {path}: {problem}")
    _probe_folder(path, files.temp_name(path), option)


def _probe_folder(path, tmp, option: str) -> None:
    """The folder takes a new file (os.access says yes to root in /proc or /sys, or on a
    read-only mount), and write_npz's temporary name is not too long for it. Where the file
    system makes files without a name (O_TMPFILE), the probe is one of those and nothing can
    be left behind; else a file of this process's own name of that length is made and removed
    (``.NAME.pNN``, else q, r, s: never that name itself, whose file may be a write of the
    same file under way in another process)."""
    folder = files.folder_of(tmp)
    shown = files.shown_folder(folder)

    def refused(e: OSError):
        why = ("is not writable" if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
               else "cannot take a new file")
        return UsageError(f"{option} {path}: the folder {shown} {why} ({e.strerror or e})")

    try:
        longest, longest_path = (os.pathconf(folder, "PC_NAME_MAX"),
                                 os.pathconf(folder, "PC_PATH_MAX"))
    except (OSError, ValueError):
        longest = longest_path = None
    # a path too long for the system as a whole: the named probe, which meets it
    if (getattr(os, "O_TMPFILE", 0) and longest is not None and longest > 0
            and longest_path is not None and len(os.fsencode(tmp)) < longest_path):
        if len(os.fsencode(os.path.basename(tmp))) > longest:
            raise refused(OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG)))
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0),
                         0o600)
        except OSError as e:
            # not on this file system (or kernel): the named probe below
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise refused(e) from e
        else:
            os.close(fd)
            return
    for probe in (f"{tmp[:-3]}{c}{os.getpid() % 100:02d}" for c in "pqrs"):
        try:
            fd = files.create_new(probe, 0o600)
        except FileExistsError:
            continue
        except OSError as e:
            raise refused(e) from e
        try:
            os.close(fd)
        except BaseException:     # an interrupt here leaves no probe behind
            with contextlib.suppress(OSError):
                os.unlink(probe)
            raise
        try:
            os.unlink(probe)
        except OSError as e:
            raise UsageError(f"{option} {path}: cannot remove {probe} from the folder "
                             f"{shown} ({e.strerror or e})") from e
        return
    if not os.access(folder, os.W_OK | os.X_OK):   # every name taken: the plain check
        raise UsageError(f"{option} {path}: the folder {shown} is not writable")


def check_folder_destination(path, option: str) -> None:
    """A folder the run will write in, made if need be: not a file, and writable (itself, or
    the nearest folder above it that exists)."""
    path = os.fspath(path)
    if not path:
        raise UsageError(f"{option} '': give a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{option} {path}: a file, not a folder")
    # a symbolic link to nothing, itself (dl, dl/) or above it (dl/sub): named as such
    there = path.rstrip(os.sep) or os.sep
    while not os.path.lexists(there) and os.path.dirname(there) != there:
        there = os.path.dirname(there) or os.curdir
    if os.path.islink(there) and not os.path.exists(there):
        raise UsageError(f"{option} {path}: {there} is a symbolic link to "
                         f"{os.readlink(there)}, which is not there: make that folder, or give "
                         f"another")
    # resolved as the system and os.makedirs go (links, then ..), not on the text
    above = os.path.realpath(path)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise UsageError(f"{option} {path}: cannot be made ({above} is a file)")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: " + ("is not writable" if above == os.path.realpath(
            path) else f"cannot be made (the folder {above} is not writable)"))


# ================================================================================================
# Setting up


def host_backend(devices):
    """The master's backend: the C++ core on every core, or the reference if only numpy devices
    were asked for (so that `--devices numpy` is pure NumPy end to end)."""
    if all(d.kind == "numpy" for d in devices):
        return NumpyBackend()
    return CpuBackend(ops.default_threads())


def plan_partition(shape: NetGeometry, devices, balance: str, batch: int, seed: int = 0,
                   deterministic: bool = False):
    """Kernels per device for each conv layer before training starts, and the calibration it
    came from (None for --balance even, --deterministic or a single device).

    deterministic: no timing decides it: each layer is split so that the devices would finish
    together at their declared speeds (the @S of their SPEC; equal shares when none is given)."""
    n = len(devices)
    if n == 1 or balance == "even":
        return {g.name: even(g.K, n) for g in shape.blocks}, None
    if deterministic:
        return {g.name: balanced(g.K, [d.spec.speed for d in devices])
                for g in shape.blocks}, None
    cal = calibrate(devices, shape.blocks, batch, seed)
    part = {}
    for g in shape.blocks:
        try:
            part[g.name] = cal.partition(g.name, g.K)
        except ValueError as e:
            raise DeviceError(f"{g.name}: {e}") from None
    return part, cal


def host_devices(spec: str) -> int:
    """How many times this process holds the largest layer's fixed memory
    (ConvGeometry.fixed_bytes: the im2col matrix, its gradient, the input and its gradient) for
    the devices of a SPEC: once for each numpy device of rank 0 (each makes its own), once for
    a single cpu device and twice for two or more (a host group shares one im2col and packs
    its operands for all its members: the paper network's peak RSS at batch 64 was 1.80, 1.83
    and 1.60 GiB with 2, 4 and 8 cpu:1 devices); at least 1, the master's. A GPU's work arrays are
    in its own memory, another rank's on its machine."""
    mine = [d.kind for d in for_rank(parse_devices(spec, gpu_count=cuda_device_count), 0)]
    return max(1, min(2, mine.count("cpu")) + mine.count("numpy"))


def memory_needed(shape: NetGeometry, batch: int, kept: int = 0, devices: int = 1) -> int:
    """Bytes a training step of the network at this batch size needs at least, wherever its
    kernels go: every parameter with its gradient and momentum, every conv output and its
    gradient, and the largest im2col matrix with its gradient `devices` times (host_devices:
    a numpy device makes its own, a host group of cpu devices shares one and packs its
    operands), every fc layer's output, ReLU's and their gradient; and `kept` more copies of
    every parameter held beside the running network (a Network's fit keeps the weights and
    momentum it started with, to put back after a fit that diverges)."""
    fc = sum(f_in * f_out + f_out for _, f_in, f_out in shape.fc_layers())
    fc_outputs = sum(f_out for _, _, f_out in shape.fc_layers())
    params = sum(math.prod(s) for s in shape.param_shapes().values())
    return (4 * 3 * fc + 4 * 3 * batch * fc_outputs + 4 * kept * params
            + sum(g.K * g.bytes_per_kernel(batch) for g in shape.blocks)
            + devices * max(g.fixed_bytes(batch) for g in shape.blocks))


def check_memory(shape: NetGeometry, batch: int, held_batch: int = 0, kept: int = 0,
                 held_kept: int = 0, devices: int = 1) -> None:
    """Refuse, before anything is allocated, a network that cannot fit in this machine's
    available memory at this batch size, naming its largest parameter. held_batch: the batch
    the network already runs at (its memory is held, not available), with held_kept copies of
    its parameters beside it; only the rest is checked. kept, devices: see memory_needed."""
    free = host_available_memory()
    need = memory_needed(shape, batch, kept, devices)
    more = need - (memory_needed(shape, held_batch, held_kept, devices) if held_batch else 0)
    if free is None or more <= free:
        return
    shapes = shape.param_shapes()
    params = sum(math.prod(s) for s in shapes.values())
    largest = max(shapes, key=lambda k: math.prod(shapes[k]))
    held = (f", {more / 2**30:,.1f} GiB more than at batch {held_batch}, which it runs at"
            if held_batch else "")
    beside = f", and {kept} more copies of the parameters held beside them" if kept else ""
    raise DeviceError(f"the network {shape.arch} on {'x'.join(map(str, shape.input_shape))} "
                      f"images with {shape.num_classes:,} classes needs at least "
                      f"{need / 2**30:,.1f} GiB at batch {batch}{held} ({params:,} parameters, "
                      f"the largest {largest} {shapes[largest]}; the conv outputs and im2col "
                      f"matrices{beside}), but this machine has {free / 2**30:.1f} GiB available")


def open_devices(spec: str, timeout: float | None = None, comm=None):
    """The devices of a SPEC (each with its worker thread: close them), in this process; or,
    given an MPI communicator (pyhet train under mpiexec, on rank 0), the devices of every
    rank, those of the other ranks as RemoteDevices (pyhet.transport.mpi). timeout: seconds
    a rank may take to answer one request, its compute included."""
    specs = parse_devices(spec, gpu_count=cuda_device_count)
    size = 1 if comm is None else comm.Get_size()
    check_ranks(specs, size)
    if size == 1:
        check_threads(specs)
    else:   # its warnings and errors named, as the other ranks' are
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                check_threads(for_rank(specs, 0))
            except DeviceError as e:
                raise DeviceError(f"rank 0: {e}") from None
        for w in said:
            warn(f"rank 0: {w.message}", w.category)
    if comm is None:
        devices = Devices(make_devices(specs))
    else:
        from .transport import mpi  # mpi4py is optional: imported only under mpiexec

        link = mpi.MasterLink(comm, specs, mpi.DEFAULT_TIMEOUT if timeout is None else timeout,
                              spec)
        devices = Devices(link.devices(specs), link.idle_ranks(), link)
    try:
        arm_faults(devices)
    except BaseException:
        for d in devices:
            d.close()
        raise
    return devices


def measure_links(devices, blocks, batch: int, together: bool = True) -> dict:
    """Each other rank's link as MasterLink.measure_links gives it, measured at the size of the
    largest layer input ({} in one process); together: also with every rank's trips at once."""
    if devices.link is None:
        return {}
    return devices.link.measure_links(4 * max(int(np.prod(g.x_shape(batch))) for g in blocks),
                                      together=together)


class Devices(list):
    """The devices of a run, in order; under mpiexec also the ranks that hold none (they idle)
    and the master's link to the others (pyhet.transport.mpi.MasterLink)."""

    def __init__(self, devices, idle_ranks=(), link=None):
        super().__init__(devices)
        self.idle_ranks, self.link = list(idle_ranks), link


def say_calibrating(devices, log, steps: bool = False) -> None:
    """Tell `log` (a stream, or None: nothing) that these devices' calibration starts (seconds
    on small networks; on the paper network at batch 16, 16 s for two cpu:1 devices of a
    2-core Zen 1 VM, 25-35 s for one with pyhet plan's steps); `steps`: training steps of the
    network are timed after it."""
    if log is not None:
        n = len(devices)
        say(f"calibrating {n} device{'s' if n != 1 else ''} ({', '.join(d.name for d in devices)})"
            f" on the network's layer shapes" + (", then timing steps of it" if steps else "") +
            "...", log)


def build_net(shape: NetGeometry, params: dict, devices, balance: str, batch: int,
              seed: int = 0, log=None, deterministic: bool = False, planned=None):
    """(Net, Calibration or None): the network on the devices, each conv layer partitioned as
    `balance` says for this batch size, or as `planned` ((partition, calibration or None),
    from a checkpoint) says. log: a stream told about calibration, or None."""
    if planned is not None:
        partition, cal = planned
    else:
        if log is not None and len(devices) > 1 and balance != "even" and not deterministic:
            say_calibrating(devices, log)
        partition, cal = plan_partition(shape, devices, balance, batch, seed, deterministic)
    if log is not None and len(devices) > 1:
        say("partition: " + "; ".join(
            f"{layer} " + ", ".join(f"{d.name} {c}" for d, c in zip(devices, counts))
            for layer, counts in partition.items()), log)
        for note in left_out(devices, partition, cal):
            say(f"{note['device']} gets no kernels of {note['layer']}: {note['why']}", log)
    net = Net(shape, params, devices, partition, host_backend(devices))
    net.calibration = cal    # where a failed device's kernels go (pyhet.failover)
    return net, cal


def left_out(devices, partition: dict, cal, failed=()) -> list:
    """The devices left without kernels of a layer, and why: they failed in training (failed:
    their indices), or calibration found their fixed cost per step (moving the layer's input
    and output over their link, their own im2col) more than the step the others finish in, or
    that a single kernel would make the layer take longer (in each phase, where a device has a
    link: pyhet.partition.balanced_phases)."""
    notes = [{"device": devices[i].name, "layer": layer, "overhead_s": None,
              "layer_time_s": None, "why": "it failed in training (see failures)"}
             for layer in partition for i in sorted(failed)]
    if cal is None:
        return notes
    for layer, counts in partition.items():
        overheads = cal.overheads[layer]
        parts = (cal.parts or {}).get(layer) or [None] * len(devices)
        others = cal.predicted(layer, counts)
        for i, (d, c, o, cap, part) in enumerate(zip(devices, counts, overheads,
                                                     cal.caps[layer], parts)):
            if c == 0 and i not in failed:
                where = ("its own im2col and col2im" if part is None else
                         f"{part['link_fixed_s']:.4g} s moving the layer's input and input "
                         f"gradient over its link, {part['compute_overhead_s']:.4g} s its own "
                         f"im2col and col2im")
                if cap == 0:
                    why = "its memory holds no kernel of it"
                elif o >= others:
                    why = (f"its fixed cost per step, {o:.4g} s ({where}), is more than the "
                           f"{others:.4g} s the other devices take")
                else:   # one kernel of the device with the most, moved to this one
                    one = list(counts)
                    one[max(range(len(one)), key=lambda j: one[j])] -= 1
                    one[i] += 1
                    with_one = cal.predicted(layer, one)
                    if with_one >= others:
                        why = (f"one kernel on it would make the layer take {with_one:.4g} s, "
                               f"{'as long as' if with_one == others else 'more than'} the "
                               f"{others:.4g} s the other devices take")
                    else:   # the split is of whole kernels, rounded: not every count is tried
                        why = (f"the split in whole kernels left it none, though one kernel on "
                               f"it is predicted at {with_one:.4g} s against the "
                               f"{others:.4g} s the other devices take "
                               f"({100 * (1 - with_one / others):.1f}% less)")
                notes.append({"device": d.name, "layer": layer, "overhead_s": round(o, 6),
                              "layer_time_s": round(others, 6), "why": why})
    return notes


def link_fixed(cal: Calibration, layer: str) -> list:
    """Each device's fixed seconds a step on its link for the layer (0 without one)."""
    parts = (cal.parts or {}).get(layer) or [None] * len(cal.speeds[layer])
    return [p["link_fixed_s"] if p else 0.0 for p in parts]


class DynamicBalance:
    """--balance dynamic: after every step, re-measure each device's speed on each layer from
    its busy time and move kernels when the devices stay out of balance."""

    def __init__(self, net: Net, cal: Calibration, state: dict | None = None):
        # state: {layer: Balancer.state()} from a checkpoint, to go on with its estimates
        self.net = net
        self.balancers = {conv.name: Balancer(conv.K, cal.speeds[conv.name],
                                              cal.overheads[conv.name], cal.caps[conv.name],
                                              phases=cal.phases_of(conv.name),
                                              fixed=link_fixed(cal, conv.name),
                                              alone=cal.alone_seconds(conv.name, conv.K),
                                              waits=(cal.waits or {}).get(conv.name, 1.0),
                                              linked=cal.linked(conv.name),
                                              local_waits=(cal.local_waits or {}).get(
                                                  conv.name),
                                              local_speedup=cal.local_speedup(conv.name))
                          for conv in net.convs}
        for layer, st in (state or {}).items():
            if layer in self.balancers:
                self.balancers[layer].restore(st)
        self.last = self._busy()
        self.moves = []

    def state(self) -> dict:
        return {layer: b.state() for layer, b in self.balancers.items()}

    def _busy(self):
        return {d.name: dict(d.busy_by_tag) for d in self.net.devices}

    def rebase(self):
        """Measure the next step from now: the devices' work since the last step (fit's
        callback) is no step's."""
        self.last = self._busy()

    def after_step(self, step: int):
        now = self._busy()
        for conv in self.net.convs:
            busy = [now[d.name].get(conv.name, 0.0) - self.last[d.name].get(conv.name, 0.0)
                    for d in self.net.devices]
            counts = self.balancers[conv.name].observe(conv.counts, busy)
            if counts is not None:
                conv.repartition(counts)
                self.moves.append({"step": step, "layer": conv.name, "counts": counts})
        self.last = self._busy()


# ================================================================================================
# Checkpoints: what they record of the run, and taking it up again


def run_settings(cfg: TrainConfig, ds: Dataset, shape: NetGeometry) -> dict:
    """What a resumed run must share with its checkpoint (see pyhet.checkpoint.SETTINGS)."""
    return {"network": f"{shape.arch} on {'x'.join(map(str, shape.input_shape))} input with "
                       f"{shape.num_classes} classes",
            "dataset": dataset_identity(ds.name), "train_images": int(len(ds.x_train)),
            "lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
            "seed": cfg.seed, "batch_size": cfg.batch_size, "shuffle": cfg.shuffle}


def plan_record(net: Net, cal, balance, deterministic: bool) -> dict:
    """The devices' plan as a checkpoint keeps it: the device list, each layer's kernel counts
    per device, the calibration and the dynamic balancer's estimates."""
    return {"devices": [str(d.spec) for d in net.devices],
            "partition": net.partition_counts(),
            # left out because they failed: a resume on the same devices plans afresh
            "failed": [net.devices[i].name for i in sorted(net.failed())],
            # in_step and in_step_alone are pyhet plan's alone (training's are None): a
            # checkpoint keeps the fields training plans with
            "calibration": {k: v for k, v in dataclasses.asdict(cal).items()
                            if k not in ("in_step", "in_step_alone")}
            if cal is not None else None,
            "balancer": balance.state() if balance is not None else None,
            "deterministic": deterministic}


def reused_plan(plan: dict | None, devices, shape: NetGeometry, cfg: TrainConfig, log):
    """((partition, calibration), balancer state) of a checkpoint's plan when this run has the
    same devices and the plan fits what it asks for; else (None, None), saying why on log."""
    if not plan or cfg.balance == "even" or len(devices) == 1:
        return None, None
    now = [str(d.spec) for d in devices]
    if plan.get("devices") != now:
        say(f"the checkpoint was made on the devices {','.join(plan.get('devices') or [])}, "
            f"this run has {','.join(now)}: planning the partition afresh", log)
        return None, None
    if plan.get("failed"):
        say(f"the checkpoint's partition leaves out {', '.join(plan['failed'])}, which "
            f"failed in that run: planning the partition afresh", log)
        return None, None
    if bool(plan.get("deterministic")) != cfg.deterministic:
        say(f"the checkpoint's partition was {'' if plan.get('deterministic') else 'not '}"
            f"the --deterministic one, this run's is"
            f"{'' if cfg.deterministic else ' not'}: planning the partition afresh", log)
        return None, None
    # (its partition splits this network's layers over these devices: plan_problem)
    partition = plan["partition"]
    cal = Calibration(**plan["calibration"]) if plan.get("calibration") else None
    if cal is None and not cfg.deterministic:
        say("the checkpoint's partition has no calibration to go on with: planning the "
            "partition afresh", log)
        return None, None
    say("resuming with the checkpoint's partition (the same devices)", log)
    return ({g.name: alone_again(list(partition[g.name]), (plan.get("balancer") or {}).get(
        g.name)) for g in shape.blocks}, cal), plan.get("balancer")


def alone_again(counts: list, state: dict | None) -> list:
    """A checkpoint's kernels per device of a layer, with a layer that an earlier version's
    dynamic balancer ran on one device (its state's alone_seen for that device) while each
    other device kept one kernel, put whole on that device, as the balancer now runs it
    (pyhet.partition.Balancer._alone_device): kept so, the one kernels would be measured as
    those devices' speeds."""
    seen = (state or {}).get("alone_seen") or []
    if len(counts) < 2 or len(seen) != len(counts):
        return counts
    i = max(range(len(counts)), key=lambda j: counts[j])
    others = [k for j, k in enumerate(counts) if j != i]
    if seen[i] is None or counts[i] < 2 or max(others) != 1:
        return counts
    return [sum(counts) if j == i else 0 for j in range(len(counts))]


# ================================================================================================
# Training


def train(cfg: TrainConfig, log=None, comm=None) -> dict:
    """Train as cfg says; returns the summary (the JSON object of `pyhet train --json`).
    SIGINT and SIGTERM end the run after the step under way, with a checkpoint of it (see
    pyhet.interrupt); under mpiexec (comm) the command line handles them."""
    log = log if log is not None else sys.stderr
    try:
        cfg.check()
    except UsageError:
        raise
    except ValueError as e:
        raise PyhetError(str(e)) from None
    with Interruption() if comm is None else contextlib.nullcontext() as stop:
        folder = None
        if cfg.checkpoint_dir:   # locked before any work, refused if another run's
            folder = CheckpointDir(cfg.checkpoint_dir, {}, resume=cfg.resume,
                                   overwrite=cfg.overwrite, keep=cfg.kept(), log=log)
        try:
            return _train(cfg, folder, stop, log, comm)
        finally:
            if folder is not None:
                folder.close()


def largest_batch(cfg: TrainConfig, ds) -> int:
    """The most images a step trains: --batch-size, or the whole training split where that is
    smaller (the size the devices' memory and calibration are for)."""
    return min(cfg.batch_size, len(ds.x_train))


def _train(cfg: TrainConfig, folder, stop, log, comm) -> dict:
    ds = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
    shape = arch_notation.build(cfg.network, ds.input_shape, ds.num_classes)
    batch = largest_batch(cfg, ds)
    check_memory(shape, batch, devices=host_devices(cfg.devices))

    start = {"step": 0, "epoch": 0, "batch": 0}
    moms, plan, over = {}, None, False
    if folder is not None:
        folder.settings = run_settings(cfg, ds, shape)
    found = folder.newest(shape) if folder is not None and cfg.resume else None
    if found:
        path, params, moms, meta = found
        start = {k: int(meta[k]) for k in ("step", "epoch", "batch")}
        plan = meta.get("plan")
        total = planned_steps(cfg, ds)[1]
        over = start["step"] >= total
        if over:   # the run is over: no step, the summary of none (exit 0), this line alone
            where = "the end" if start["step"] == total else "past the end"
            say(f"nothing left to train: {path} is at step {start['step']}, {where} of "
                f"this run ({total} steps); give more --epochs or --steps to go on", log)
        else:
            say(f"resuming from {path} (step {start['step']})" + (
                f"; --init {cfg.init} is not read (the run goes on from the checkpoint's "
                f"weights)" if cfg.init else ""), log)
    elif cfg.init:
        params = load_weights(cfg.init, shape)
    else:
        params = init_params(shape, cfg.seed)

    devices = open_devices(cfg.devices, cfg.timeout, comm)
    for r in devices.idle_ranks:
        say(f"rank {r} holds no device of --devices {cfg.devices!r}: it idles", log)
    try:
        if stop is not None:
            stop.devices = list(devices)
        links = measure_links(devices, shape.blocks, batch)
        # (a run that is over says only that: not how its partition was planned)
        planned, balancer_state = reused_plan(plan, devices, shape, cfg,
                                              io.StringIO() if over else log)
        net, cal = build_net(shape, params, devices, cfg.balance, batch, cfg.seed,
                             log if cfg.progress and not over else None, cfg.deterministic,
                             planned)
        if moms:
            net.set_momentum(moms)
        params = moms = found = None   # the net holds its own: a large fc layer is not kept twice
        balance = (DynamicBalance(net, cal, balancer_state)
                   if cfg.balance == "dynamic" and cal and not cfg.deterministic else None)

        def save(position):
            return folder.save(net, position, plan_record(net, cal, balance, cfg.deterministic),
                               ds.classes, ds.normalization)

        result = run_steps(cfg, ds, net, start, log, balance, stop=stop,
                           save_checkpoint=save if folder is not None else None)
        return with_plan(result, net, devices, cal, balance, links)
    finally:
        for d in devices:
            d.close()


def with_plan(result: dict, net: Net, devices, cal, balance, links=None) -> dict:
    """The summary of run_steps with what decided the partition: the calibration, the devices
    left without kernels and why, the moves of dynamic balancing, the cost model's conv time;
    under mpiexec the idle ranks and each rank's measured link."""
    result["calibration"] = cal.as_dict(devices) if cal else None
    result["idle_ranks"] = getattr(devices, "idle_ranks", [])
    result["left_out"] = left_out(devices, net.partition_counts(), cal, net.failed())
    for r, figures in (links or {}).items():
        result["links"].setdefault(str(r), {}).update(
            {k: (None if v is None else round(v, 6) if k == "latency_s" else round(v))
             for k, v in figures.items()})
    # the cost model's conv time for the final partition (null without a calibration)
    result["predicted_conv_time_s"] = result["predicted_step_time_s"] = None
    if cal is not None:
        result["predicted_conv_time_s"] = round(sum(
            cal.predicted(conv.name, conv.counts)
            for conv in net.convs), 6)
        # ... and the step: that, plus the measured rest of the step (the master's fc layers,
        # loss and batch work, which are not partitioned)
        if result["step_time_s"] and result["conv_time_s"] is not None:
            rest = max(0.0, result["step_time_s"]["median"] - result["conv_time_s"])
            result["predicted_step_time_s"] = round(result["predicted_conv_time_s"] + rest, 6)
    result["partition_moves"] = balance.moves if balance else []
    return result


def planned_steps(cfg: TrainConfig, ds: Dataset) -> tuple:
    """(steps per epoch, steps of the whole run): --steps, or --epochs whole epochs."""
    per_epoch = math.ceil(ds.x_train.shape[0] / cfg.batch_size)
    if per_epoch == 0:
        raise DataError(f"{ds.name}: no training images")
    return per_epoch, cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch


def run_steps(cfg: TrainConfig, ds: Dataset, net: Net, start: dict, log, balance=None,
              callback=None, save_checkpoint=None, stop=None, at=None) -> dict:
    """The step loop from `start` ({"step", "epoch", "batch"}) to the end, then the test split's
    evaluation, --save and the summary. callback(info) is called after every step with
    {"step", "steps", "epoch", "loss", "step_time_s", "images"}. save_checkpoint(position)
    writes a checkpoint of the step just made and returns its path (position: the step and the
    next batch, {"step", "epoch", "batch"}), at each epoch's end, every cfg.checkpoint_every
    steps and at the end. stop: a pyhet.interrupt.Interruption, asked after every step. at: a
    dict updated to the position after every step (where training got, should it stop early).

    Non-finite numbers: the loss is checked after every step (it costs nothing), the weights
    before every checkpoint and once after the last step, before the evaluation and --save; a
    non-finite one ends training with TrainingError, and nothing non-finite is written. NumPy's
    warnings of overflow and NaN are off on this thread meanwhile, as on the devices' workers
    (pyhet.devices): the master's part of a step (the fc layers, the loss, their update, an
    update without momentum) runs NumPy code here, and those checks say what happened in one
    line. The callback runs under the caller's own settings."""
    if callback is not None:
        caller, user = np.geterr(), callback

        def callback(info):
            with np.errstate(**caller):
                user(info)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _run_steps(cfg, ds, net, start, log, balance, callback, save_checkpoint, stop, at)


def _run_steps(cfg, ds, net, start, log, balance, callback, save_checkpoint, stop, at) -> dict:
    sgd = SGDConfig(cfg.lr, cfg.momentum, cfg.weight_decay)
    per_epoch, total_steps = planned_steps(cfg, ds)
    step, epoch, skip = start["step"], start["epoch"], start["batch"]
    step_times, step_images, losses = [], [], []
    part_times = []                          # {part: seconds} of each step (Net.train_step's)
    # the devices' busy times, the layers' phase times and the traffic go on adding up over
    # calibration, earlier fit() calls and the evaluation: count only this run's steps
    busy0, phases0, traffic0 = _counters(net)
    first_phases = None                      # {layer: {phase: s}} of this run's first step
    failover = Failover(net, getattr(net, "calibration", None), balance, log,
                        declared=cfg.deterministic and cfg.balance != "even")
    t_train = time.perf_counter()
    saved = {"step": step, "path": None}     # the checkpoint of the step just made, if any
    every = cfg.checkpoint_every
    position = None                          # where the step after the last one made starts

    if stop is not None:
        stop.deferring = True        # a signal now lets the step under way finish
    try:
        while step < total_steps:
            # Each epoch's order comes from (seed, epoch) alone, so a resumed run sees the
            # same data.
            rng = np.random.default_rng([cfg.seed, epoch])
            todo = min(per_epoch - skip, total_steps - step)
            bar = Progress(todo, f"epoch {epoch + 1}", log, enabled=cfg.progress)
            batches = iterate_batches(ds.x_train, ds.y_train, cfg.batch_size, cfg.shuffle, rng)
            for b, (xb, yb) in enumerate(batches):
                if b < skip:
                    continue
                if step >= total_steps:
                    break
                timer = PartTimer()
                t0 = time.perf_counter()
                made = getattr(net, "steps_made", 0)
                try:
                    loss = failover.train_step(xb, yb, sgd, timer, step + 1)
                except KeyboardInterrupt:
                    # Ctrl-C held until the step's update was made (Net.train_step): the
                    # step is made, and the next one starts after it
                    if at is not None and getattr(net, "steps_made", 0) > made:
                        at.update(_next(step + 1, epoch, b, per_epoch))
                    raise
                except NoDeviceLeftError as e:
                    bar.close()
                    if save_checkpoint is None:
                        raise
                    # the state before this step: resuming redoes it, batch b of this epoch
                    path = save_checkpoint({"step": step, "epoch": epoch, "batch": b})
                    raise NoDeviceLeftError(f"{e}; the state before step {step + 1} is in "
                                            f"{path}") from None
                dt = time.perf_counter() - t0
                step += 1
                position = _next(step, epoch, b, per_epoch)    # where the next step starts
                if at is not None:     # before the callback, which may stop the run
                    at.update(position)
                if not math.isfinite(loss):
                    bar.close()
                    # a later fit of a network counts its steps from 0 and its epochs on
                    # from the network's earlier fits (pyhet.api: the next epoch's data order)
                    where = (f"at step {step} of this fit (epoch {epoch + 1} of the network's "
                             f"fits, batch {b + 1})"
                             if start["step"] == 0 and start["epoch"] > 0 else
                             f"at step {step} (epoch {epoch + 1}, batch {b + 1})")
                    if step == start["step"] + 1:   # before this run's first update
                        peak = float(np.abs(xb).max()) if xb.size else 0.0
                        raise TrainingError(
                            f"the loss is {loss} {where}, before this run updated any weight: "
                            f"the network's outputs overflow on these inputs (their largest "
                            f"magnitude is {peak:.3g}; images as the network expects them are "
                            f"of order 1) or weights it started from")
                    raise TrainingError(f"the loss became {loss} {where}: training diverged; "
                                        + _advice(cfg, xb))
                if balance is not None:
                    balance.after_step(step)
                step_times.append(dt)
                if first_phases is None:     # the warm-up step, which the figures leave out
                    first_phases = {c.name: {k: v - phases0[c.name].get(k, 0.0)
                                             for k, v in c.phases.parts.items()}
                                    for c in net.convs}
                step_images.append(int(xb.shape[0]))
                part_times.append(dict(timer.parts))
                losses.append(loss)
                bar.update(1, loss=f"{loss:.4f}", **{"img/s": f"{xb.shape[0] / dt:.1f}"})
                # the step's checkpoint before the callback: a callback that raises (or is
                # interrupted) leaves the step made and written, not redone by a resume
                if save_checkpoint is not None and (position["batch"] == 0 or
                                                    step == total_steps or
                                                    (every and step % every == 0)):
                    saved = {"step": step, "path": save_checkpoint(position)}
                if callback is not None:
                    before = _counters(net)
                    callback({"step": step, "steps": total_steps, "epoch": epoch + 1,
                              "loss": loss, "step_time_s": dt, "images": int(xb.shape[0])})
                    # what the callback ran on the devices (an evaluation, a predict) is no
                    # step's: out of the summary's busy, phase and traffic figures, and of the
                    # balancer's next measurement
                    _leave_out(net, before, busy0, phases0, traffic0)
                    if balance is not None:
                        balance.rebase()
                if stop is not None and stop.signum is not None:
                    bar.close()
                    _stop(stop, step, position, saved, save_checkpoint)
            bar.close()
            # this pass trained batches skip .. skip + todo - 1 of the epoch (b is not that
            # count: after a break it is the first batch left untrained)
            epoch, skip = (epoch + 1, 0) if skip + todo >= per_epoch else (epoch, skip + todo)
    finally:
        if stop is not None:
            stop.deferring = False
    if stop is not None and stop.signum is not None:   # came as the last step ended
        _stop(stop, step, position, saved, save_checkpoint)
    train_s = time.perf_counter() - t_train
    busy = {d.name: d.busy_s - busy0[d.name] for d in net.devices}
    moved = {r: {k: v - traffic0[r][k] for k, v in t.items()}
             for r, t in traffic(net.devices).items()}
    phases = {conv.name: {k: v - phases0[conv.name].get(k, 0.0)
                          for k, v in conv.phases.parts.items()} for conv in net.convs}
    if len(step_times) > 1:   # the timed steps alone, as the step's median and parts take them
        phases = {layer: {k: v - first_phases[layer].get(k, 0.0) for k, v in parts.items()}
                  for layer, parts in phases.items()}
    params = net.params(copy=False)   # read before anything changes them: no second copy
    check_finite(params, step, _advice(cfg), "the weights were not saved" if cfg.save else None)

    # on the whole test split, in batches of the training size (the memory the devices were
    # sized for)
    t_eval = time.perf_counter()
    test = (evaluate(net, ds.x_test, ds.y_test, largest_batch(cfg, ds))
            if ds.x_test is not None else None)
    eval_s = time.perf_counter() - t_eval if test is not None else None
    if test is not None and not math.isfinite(test["loss"]):
        # finite weights so large that the outputs overflow float32
        raise TrainingError(f"the test loss is {test['loss']} after step {step}: the network's "
                            f"outputs overflow, training diverged"
                            + ("; the weights were not saved" if cfg.save else "")
                            + "; " + _advice(cfg, ds.x_test[:largest_batch(cfg, ds)]))
    if test is None and step > 0:
        # no test split to tell: the same check on a batch of training images (weights that
        # give NaN on every input are not a run that ended well, saved or not; fit() puts back
        # the weights it started from)
        n = largest_batch(cfg, ds)
        probe = evaluate(net, ds.x_train[:n], ds.y_train[:n], n)["loss"]
        if not math.isfinite(probe):
            raise TrainingError(f"the loss on the first {n} training images is {probe} after "
                                f"step {step}: the network's outputs overflow, training "
                                f"diverged" + ("; the weights were not saved" if cfg.save
                                               else "") + "; "
                                 + _advice(cfg, ds.x_train[:n]))
    final = losses[-1] if losses else None
    chance = math.log(ds.num_classes)
    if final is not None and final > DIVERGED_LOSS_TIMES_CHANCE * chance:
        # finite, but far past what guessing costs: a run whose weights grew without overflowing
        # (an lr of 1e5 ended at a loss of 1.4e5 and weights of 3e10, and said nothing)
        n = largest_batch(cfg, ds)
        warn(f"the training loss ended at {final:.4g}, {final / chance:.0f} times a guess's "
             f"(ln {ds.num_classes} = {chance:.3g}): training diverged, though its values "
             f"stayed finite" + ("; the weights are saved as they are" if cfg.save else "")
             + "; " + _advice(cfg, ds.x_train[:n]))
    if cfg.save:
        save_weights(cfg.save, params, net.shape, ds.classes, ds.normalization)
    result = summary(cfg, ds, net, step_times, part_times, losses, busy, train_s, test,
                     epochs=step / per_epoch, steps=step, moved=moved, images=step_images,
                     phases=phases, eval_s=eval_s)
    result["failures"] = failover.failures   # devices that failed, and where their kernels went
    result["start_step"] = start["step"]     # steps and epochs count from 0, this run's from it
    return result


def _next(step: int, epoch: int, b: int, per_epoch: int) -> dict:
    """Where the step after `step` (batch b of the epoch) starts."""
    return ({"step": step, "epoch": epoch, "batch": b + 1} if b + 1 < per_epoch
            else {"step": step, "epoch": epoch + 1, "batch": 0})


def _advice(cfg: TrainConfig, x=None) -> str:
    """What to change after a run diverged; x: the images it diverged on, whose scale goes
    first where they are far from what networks expect (no lr helps with images of 1e30)."""
    advice = divergence_advice(cfg.lr, cfg.momentum, cfg.weight_decay, cfg.python)
    if x is None or not x.size or x.dtype == np.uint8:   # (raw pixels are scaled to [0, 1])
        return advice
    peak = float(np.max(np.abs(x)))
    if math.isfinite(peak) and peak <= HUGE_IMAGE_VALUE:
        return advice
    return (f"the images are far from order 1, as networks expect them (their largest "
            f"magnitude is {peak:.3g}): scale them; then, if it still diverges, {advice}")


def _stop(stop, step: int, position, saved: dict, save_checkpoint):
    """A signal asked to stop: a checkpoint of the step just made (unless written already),
    then pyhet.errors.Interrupted saying where it is."""
    if save_checkpoint is None:
        stop.check(f"after step {step} (no --checkpoint-dir: nothing saved)")
    if position is None:            # no step made in this run: the checkpoints are as they were
        stop.check(f"at step {step}")
    path = saved["path"] if saved["step"] == step and saved["path"] else save_checkpoint(position)
    stop.check(f"after step {step}: wrote the checkpoint {path} (continue with --resume)")


def _counters(net) -> tuple:
    """What the devices have done so far: ({device: busy s}, {layer: {phase: s}}, traffic)."""
    return ({d.name: d.busy_s for d in net.devices},
            {c.name: dict(c.phases.parts) for c in net.convs}, traffic(net.devices))


def _leave_out(net, before, busy0, phases0, traffic0) -> None:
    """Add the devices' work since `before` (busy, phases, traffic) to the run's starting
    figures, so that the run's totals leave it out."""
    busy, phases, moved = before
    for d in net.devices:
        busy0[d.name] += d.busy_s - busy[d.name]
    for c in net.convs:
        for k, v in c.phases.parts.items():
            phases0[c.name][k] = phases0[c.name].get(k, 0.0) + v - phases[c.name].get(k, 0.0)
    for r, t in traffic(net.devices).items():
        for k, v in t.items():
            traffic0[r][k] += v - moved[r][k]


def traffic(devices) -> dict:
    """{rank: {"sent": bytes, "received": bytes}} to and from the devices on other MPI ranks
    so far, seen from the master (empty in a one-process run)."""
    peers = {d.peer.rank: d.peer for d in devices if hasattr(d, "peer")}
    return {r: {"sent": p.sent, "received": p.received} for r, p in sorted(peers.items())}


def summary(cfg, ds, net, step_times, parts, losses, busy, train_s, test,
            epochs, steps, images, phases, moved=None, eval_s=None) -> dict:
    """The summary of a run. parts: each step's {part: seconds} (Net.train_step's:
    conv_forward, fc, conv_backward, update); images: the images of each step (the last batch
    of an epoch, or a batch larger than the dataset, holds fewer than --batch-size); phases:
    {layer: {phase: seconds}} of the timed steps alone (the warm-up step left out where
    there are others); eval_s: the test split's evaluation, or
    None."""
    warm = 1 if len(step_times) > 1 else 0                          # the first step warms up
    timed = step_times[warm:]
    parts = parts[warm:]
    conv = [p.get("conv_forward", 0) + p.get("conv_backward", 0) for p in parts]
    # each part's median over the timed steps, and what the step spent outside them (the
    # step's median less the parts' medians: hand-offs, the failover's bookkeeping)
    step_parts = {k: statistics.median(p.get(k, 0.0) for p in parts)
                  for k in ("conv_forward", "fc", "conv_backward", "update")} if parts else None
    if step_parts is not None and timed:
        step_parts["other"] = max(0.0, statistics.median(timed) - sum(step_parts.values()))
    total = sum(step_times)
    devices = []
    for d in net.devices:
        devices.append({"name": d.name, "spec": str(d.spec), "rank": d.spec.rank or 0,
                        "busy_s": round(busy[d.name], 4),
                        "idle_fraction": round(max(0.0, 1 - busy[d.name] / total), 4)
                        if total else None,
                        "emulated_speed": d.speed if d.spec.speed != 1.0 else None})
    return {
        "steps": steps,
        "epochs": round(epochs, 4),
        "batch_size": largest_batch(cfg, ds),   # the whole split where --batch-size is more
        "devices": devices,
        "partition": net.partition(),
        "balance": cfg.balance,
        "deterministic": cfg.deterministic,
        "step_time_s": {"median": statistics.median(timed), "min": min(timed),
                        "max": max(timed)} if timed else None,
        # the images the timed steps trained, over their time
        "images_per_s": (sum(images[warm:]) / sum(timed)) if timed and sum(timed) else None,
        "train_loss": losses[-1] if losses else None,
        "test_accuracy": test["accuracy"] if test else None,
        "test_loss": test["loss"] if test else None,
        "conv_time_fraction": (sum(conv) / sum(timed)) if timed and sum(timed) else None,
        "conv_time_s": statistics.median(conv) if conv else None,   # median per step
        # the step's parts in order, medians per step: the conv layers' forward, the master's
        # fc layers and loss (forward and backward), the conv layers' backward, the update of
        # every layer; other: the rest of the step's median
        "step_parts_s": ({k: round(v, 6) for k, v in step_parts.items()}
                         if step_parts is not None else None),
        "dataset": ds.name,
        "arch": net.shape.arch,
        "kernels": list(net.shape.kernels),
        # the kernel size of every block, or one number when they are all the same
        "kernel_size": net.shape.kernel_size,
        "train_time_s": round(train_s, 3),
        # the test split's evaluation (after training, not in any figure above); None without
        "eval_time_s": round(eval_s, 4) if eval_s is not None else None,
        "emulated": any(d.spec.speed != 1.0 for d in net.devices),
        # where each conv layer's time went (wall seconds per timed step, the mean; the
        # phases follow each other)
        "phase_time_s": {layer: {k: round(v / max(1, len(timed)), 6)
                                 for k, v in parts.items()} for layer, parts in phases.items()},
        # under mpiexec: the bytes the master sent to and received from each rank per step
        "links": {str(r): {"bytes_sent_per_step": round(t["sent"] / max(1, len(step_times))),
                           "bytes_received_per_step": round(t["received"] /
                                                            max(1, len(step_times)))}
                  for r, t in (moved or {}).items()},
    }
