"""Checkpoints: one run's folder of complete snapshots of training.

A checkpoint folder belongs to one run at a time and holds

    checkpoint-000000012.npz          a complete checkpoint, after step 12 (written by
                                      pyhet.model.write_npz: a hidden temporary file, synced,
                                      renamed, so that this name never shows half a file)
    .checkpoint-000000012.npz.tmp     a write under way, or one that SIGKILL cut short (removed
                                      when the folder is next opened)
    .lock                             flock()ed by the process writing here (the kernel
                                      releases it when that process ends, however it ends)

A checkpoint is a weight file (its parameters, the ``arch`` entry) plus ``momentum/*`` arrays
and one JSON entry ``meta``: the position in the data, the settings resuming must match, and
the plan of the devices (the partition, the calibration, the balancer's estimates), so that a
resumed run on the same devices starts with the partition it had.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import stat
import time

import numpy as np

from . import errors, files, npzfile
from .calibrate import Calibration
from .errors import PyhetError, UsageError, WeightsError, say, shown
from .geometry import NetGeometry
from .model import (arch_entry, check_finite, checked_params, divergence_advice, json_int,
                    load_weights, read_weight_file, write_npz)

NAME = re.compile(r"^checkpoint-([0-9]{9,})\.npz$")
LOCK = files.LOCK_NAME
FORMAT = 2        # of the meta entry: 1 had only the position, seed, batch size and shuffle

# What a resumed run must share with the checkpoint (settings, named as their options are)
SETTINGS = {"network": "the network", "dataset": "the dataset",
            "train_images": "training images", "lr": None, "momentum": None,
            "weight_decay": None, "seed": None, "batch_size": None,
            "shuffle": "the data order (shuffle)"}


def _same(key: str, stored: dict, ours: dict) -> bool:
    """Whether a checkpoint's setting is this run's. A batch size above the training split's
    size trains batches of the whole split, as that size does: the two are the same run (the
    summary reports the batch trained, and a resume may give it)."""
    a, b = stored[key], ours[key]
    images = ours.get("train_images")
    if key == "batch_size" and stored.get("train_images") == images and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (a, b, images)):
        return min(a, images) == min(b, images)
    return a == b


def is_checkpoint(name: str) -> bool:
    """Whether a file name is one that a run writes: ``checkpoint-`` and the step in nine ASCII
    digits or more, zero-padded to nine, ``.npz`` (no other file is read, nor removed by --keep
    or --overwrite: ``checkpoint-5.npz``, ``checkpoint-0000000006.npz`` are a user's)."""
    m = NAME.match(name)
    return m is not None and name == f"checkpoint-{int(m.group(1)):09d}.npz"


def is_leftover(name: str) -> bool:
    """Whether a file name is that of a checkpoint's write under way, or cut short: ``.``, a
    checkpoint's name (is_checkpoint), ``.tmp``."""
    return name.startswith(".") and name.endswith(".tmp") and is_checkpoint(name[1:-4])


def step_of(path) -> int:
    return int(NAME.match(os.path.basename(path)).group(1))


def complete(folder) -> list:
    """The complete checkpoints in the folder, oldest first (by step)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [os.path.join(folder, n) for n in names if is_checkpoint(n)]
    return sorted(found, key=step_of)


def dataset_identity(name: str) -> str:
    """A dataset's name as the checkpoint records it: an npz file by its full path, so that
    the same file named from another folder is the same dataset."""
    if name.startswith("npz:"):
        return "npz:" + os.path.realpath(name[len("npz:"):])
    return name


DEFAULT_KEEP = 3       # the newest checkpoints a run keeps where --keep is not given


class CheckpointDir:
    """The checkpoint folder of a run: made if need be, locked for this process, and refused
    when it holds another run's checkpoints and this run neither resumes nor overwrites.

    settings: {key of SETTINGS: value} of this run; keep: the newest checkpoints kept (0: all);
    log: where warnings go (a damaged checkpoint skipped)."""

    def __init__(self, folder, settings: dict, *, resume: bool = False,
                 overwrite: bool = False, keep: int = 0, log=None, python: bool = False):
        self.folder, self.settings, self.keep, self.log = os.fspath(folder), settings, keep, log
        self.python = python     # messages name Network.fit's arguments, not the options
        option = errors.option("checkpoint_dir", python)
        self._fd = None
        self._mine = set()   # (device, inode) of the checkpoints this run wrote
        self._overwritten = []   # (path, identity) of another run's, which --overwrite deletes
        self._continued = set()   # identities of the checkpoints of the run this one resumes
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise UsageError(f"{option} {self.folder}: cannot be made: "
                             f"{e.strerror or e}") from e
        self._lock(option)
        try:
            names = os.listdir(self.folder)
            for n in names:       # a folder (or a FIFO) named as a checkpoint is not one
                p = os.path.join(self.folder, n)
                there = (files.not_regular(p) if is_checkpoint(n) else
                         files.temp_in_the_way(p) if is_leftover(n) else None)
                if there is not None:
                    raise UsageError(f"{option} {self.folder}: {n} is {there}, not a "
                                     f"checkpoint file: move it away")
            for n in names:       # writes that a killed process left behind
                if is_leftover(n):
                    os.remove(os.path.join(self.folder, n))
            found = complete(self.folder)
            if resume:           # the run this one continues: its checkpoints are not foreign
                self._continued = {_identity(p) for p in found}
            if found and not resume:
                if not overwrite:
                    raise UsageError(
                        f"{option} {self.folder} holds the checkpoints of another run "
                        f"({len(found)}, the newest after step {step_of(found[-1])}): continue "
                        f"that run with {errors.flag('resume', python)}, choose another "
                        f"folder, or give {errors.flag('overwrite', python)} to delete them")
                # deleted when this run writes its first checkpoint, not now: a run that
                # fails before that (a device, the data, --init) leaves them as they were
                self._overwritten = [(p, _identity(p)) for p in found]
        except BaseException:
            self.close()
            raise

    def _lock(self, option):
        path = os.path.join(self.folder, LOCK)
        there = files.temp_in_the_way(path)
        if there is None and os.path.islink(path):
            there = "a symbolic link"
        if there is not None:     # never written through: the pid would land in its target
            raise UsageError(f"{option} {self.folder}: its lock file {LOCK} is {there}, not "
                             f"a regular file: remove it")
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                               0o644)
        except OSError as e:
            raise UsageError(f"{option} {self.folder}: cannot write in it: "
                             f"{e.strerror or e}") from e
        mode = os.fstat(self._fd).st_mode
        if not stat.S_ISREG(mode):    # it changed since: a link is refused by O_NOFOLLOW
            os.close(self._fd)
            self._fd = None
            raise UsageError(f"{option} {self.folder}: its lock file {LOCK} is "
                             f"{files.kind(mode)}, not a regular file: remove it")
        try:
            for attempt in range(3):   # a write's check (files.held_lock) holds it a moment
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in files.HELD or attempt == 2:
                        raise
                    time.sleep(0.02)
        except OSError as e:
            if e.errno in files.NO_LOCKS:   # a file system without flock: unguarded
                if self.log is not None:
                    say(f"pyhet: warning: {option} {self.folder}: its file system takes no "
                        f"locks ({e.strerror or e}): nothing keeps another run from writing "
                        f"there too", self.log)
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, str(os.getpid()).encode(), 0)
                return
            if e.errno not in files.HELD:
                raise
            try:
                holder = os.read(self._fd, 64).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(self._fd)
            self._fd = None
            raise PyhetError(f"{option} {self.folder} is in use by another pyhet run"
                             f"{f' (process {holder})' if holder else ''}: wait for it to end, "
                             f"or choose another folder") from e
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def _still_locked(self):
        """Before a write: the folder's lock is still this run's. Where the folder was moved away
        and made anew, or its .lock removed, while the run wrote in it, the lock is taken again
        at the folder's path (the run writes by path), with a warning; another run's lock there
        is an error, as when the run started."""
        if self._fd is None:
            return
        try:
            there = os.lstat(os.path.join(self.folder, LOCK))
            mine = os.fstat(self._fd)
            if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                return
        except OSError:
            pass
        self.close()
        option = errors.option("checkpoint_dir", self.python)
        lost = f"{option} {self.folder}: its lock file {LOCK} was removed or the folder replaced"
        try:
            os.makedirs(self.folder, exist_ok=True)
            self._lock(option)
        except OSError as e:
            raise PyhetError(f"{lost} while this run wrote in it, and it cannot be made again "
                             f"({e.strerror or e}): no more checkpoints") from e
        except PyhetError as e:     # mid-run: an error of the run (status 1), not of usage
            raise PyhetError(f"{lost} while this run wrote in it; locking it again: "
                             f"{e}") from None
        known = (self._mine | self._continued      # this run's, and those of the run it resumes
                 | {identity for _, identity in self._overwritten})   # --overwrite's, to go
        foreign = [p for p in complete(self.folder) if _identity(p) not in known]
        if foreign:
            self.close()
            raise PyhetError(f"{lost} while this run wrote in it, and it holds the checkpoints "
                             f"of another run now ({len(foreign)}, the newest after step "
                             f"{step_of(foreign[-1])}): this run writes none there")
        if self.log is not None:
            say(f"pyhet: warning: {option} {self.folder}: its lock file {LOCK} was removed "
                f"or the folder replaced while this run wrote in it: locked it again", self.log)

    def _delete_overwritten(self):
        """Delete the other run's checkpoints that --overwrite found, before this run's first
        checkpoint: each only if it is still the file found (not one written since)."""
        for path, identity in self._overwritten:
            if _identity(path) == identity:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise PyhetError(f"{self.folder}: cannot delete {os.path.basename(path)}, "
                                     f"another run's checkpoint that "
                                     f"{errors.flag('overwrite', self.python)} deletes "
                                     f"({e.strerror or e})") from e
        self._overwritten = []

    def close(self):
        """Release the folder (also done by the kernel when the process ends)."""
        if self._fd is not None:
            os.close(self._fd)      # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- reading ------------------------------------------------------------------------------

    def newest(self, shape: NetGeometry):
        """(path, params, momentum, meta) of the newest complete checkpoint that can be read,
        or None when there is none. A damaged one (cut short, overwritten; its meta, weights
        or momentum not as pyhet writes them) is skipped with a warning, for the one before
        it. Settings that differ from this run's are refused, and so are weights that do not
        load from an earlier version's checkpoint, whose settings do not name its network."""
        found = complete(self.folder)
        for i, path in enumerate(reversed(found)):
            older = found[-2 - i] if i + 1 < len(found) else None
            try:
                read = read_weight_file(path)
                arrays = read[0]
                if "meta" not in arrays:
                    raise ValueError("it has no 'meta' entry: a weight file, not a checkpoint")
                meta = _meta(arrays, self.settings)
                check_named_step(meta, path)
                moms = {k[len("momentum/"):]: v for k, v in arrays.items()
                        if k.startswith("momentum/")}
            except (PyhetError, KeyError, ValueError, RecursionError) as e:
                if isinstance(e, RecursionError):   # JSON nested past Python's stack
                    e = ValueError("its meta entry is nested too deeply to be pyhet's")
                self._skip(path, e, older)
                continue
            self._check_settings(path, meta)
            problem = plan_problem(meta.get("plan"), shape)
            if problem is not None:
                meta["plan"] = None
                if self.log is not None:
                    say(f"pyhet: warning: checkpoint {path}: its plan cannot be reused "
                        f"({problem}): planning the partition afresh", self.log)
            try:
                params = load_weights(path, shape, read)
            except WeightsError as e:
                if "network" not in (meta.get("settings") or {}):
                    raise    # an earlier version's checkpoint, which may be of another network
                self._skip(path, e, older)  # its settings name this network: the file is damaged
                continue
            try:
                check_momentum(moms, shape)
            except WeightsError as e:
                self._skip(path, e, older)
                continue
            return path, params, moms, meta
        return None

    def _skip(self, path, why, older):
        """Say that a damaged checkpoint is passed over, and for which; where no older one is
        left to try, refuse (PyhetError): a run started afresh in the folder would delete it
        with the others in time (--keep), or write over it, where its weights may still be
        what the user wanted resumed."""
        if older is None:
            raise PyhetError(
                f"checkpoint {path} is damaged ({why}), and the folder holds no older one to "
                f"resume from: nothing was changed. Mend or move it, or start afresh with "
                f"{errors.flag('overwrite', self.python)} in place of "
                f"{errors.flag('resume', self.python)} (which deletes the folder's "
                f"checkpoints as it writes its own)")
        if self.log is not None:
            say(f"pyhet: warning: checkpoint {path} is damaged ({why}); "
                f"resuming from {older} instead", self.log)

    def _check_settings(self, path, meta: dict):
        stored = meta.get("settings") or {k: meta[k] for k in ("seed", "batch_size", "shuffle")
                                          if k in meta}
        for key, what in SETTINGS.items():
            if key in stored and key in self.settings and not _same(key, stored, self.settings):
                what = what or errors.option(key, self.python)
                raise UsageError(f"checkpoint {path} was made with {what} {stored[key]}, but "
                                 f"this run asks for {self.settings[key]}: resume with the same "
                                 f"settings, or start afresh in another folder (or with "
                                 f"{errors.flag('overwrite', self.python)})")

    # --- writing ------------------------------------------------------------------------------

    def save(self, net, position: dict, plan: dict, classes=None, normalization=None) -> str:
        """Write the checkpoint after step position["step"]; then delete those older than the
        `keep` newest that hold their own step. position: {"step", "epoch", "batch"} (the next
        batch to train); plan: see Plan.record."""
        arrays, moms = net.state(copy=False)   # written before the next step changes them
        # never a checkpoint of weights that diverged (the loss, computed before the update,
        # may still have been finite)
        st = self.settings
        check_finite(arrays, position["step"],
                     divergence_advice(st.get("lr", float("nan")), st.get("momentum", 0.0),
                                       st.get("weight_decay", 0.0), self.python),
                     "neither this checkpoint nor a weight file was written")
        for name, (vw, vb) in moms.items():
            if vw is not None:
                arrays[f"momentum/{name}.weight"], arrays[f"momentum/{name}.bias"] = vw, vb
        meta = {"format": FORMAT, **position,
                # format 1's keys, for readers of earlier versions
                "seed": self.settings.get("seed"), "batch_size": self.settings.get("batch_size"),
                "shuffle": self.settings.get("shuffle"),
                "settings": self.settings, "plan": plan}
        arrays["meta"] = np.array(json.dumps(meta))
        arrays["arch"] = arch_entry(net.shape, classes, normalization)
        self._still_locked()
        self._delete_overwritten()
        path = os.path.join(self.folder, f"checkpoint-{position['step']:09d}.npz")
        write_npz(path, arrays, "the checkpoint")
        self._mine.add(_identity(path))
        if self.keep:
            # the newest `keep` of those up to this one: never this one itself, whatever lies
            # past it (a damaged checkpoint a resume skipped, which the next resume skips too).
            # Only those that hold their own step count: one renamed or damaged is no
            # checkpoint to resume from, and deletes none that is (it goes once older than
            # the kept ones)
            upto = [p for p in complete(self.folder) if step_of(p) <= position["step"]]
            kept = [p for p in upto if p == path or holds_its_step(p)][-self.keep:]
            oldest = step_of(kept[0]) if kept else position["step"]
            for old in [p for p in upto if step_of(p) < oldest]:
                try:
                    os.remove(old)
                except OSError as e:
                    raise WeightsError(f"cannot delete the old checkpoint {old}: "
                                       f"{e.strerror or e}") from e
        return path


# ================================================================================================
# What a checkpoint must hold to be resumed from (an edited or foreign file is damaged)


def _identity(path) -> "tuple | None":
    """(device, inode) of a file, or None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _meta(arrays: dict, settings: "dict | None" = None) -> dict:
    """A checkpoint's meta entry read and checked (checked_meta); KeyError where it has none,
    ValueError where it is not of save()'s form."""
    return checked_meta(json.loads(str(arrays["meta"]), parse_int=json_int), settings)


def check_named_step(meta: dict, path) -> None:
    """The step of a checkpoint's meta entry (checked_meta's) is the one its name gives; else
    ValueError (a renamed file: resumed from, it would start each run at its own step)."""
    if meta["step"] != step_of(path):
        raise ValueError(f"it is named step {step_of(path)} but holds step {meta['step']}")


def holds_its_step(path) -> bool:
    """Whether a checkpoint's meta entry can be read, has save()'s form and records the step
    its name gives (its weights and momentum are not read: newest() checks those)."""
    try:
        check_named_step(_meta(npzfile.read(path, WeightsError, "a checkpoint",
                                            keys=("meta",))), path)
    except (PyhetError, KeyError, ValueError, RecursionError):
        return False
    return True


def checked_meta(meta, settings: "dict | None" = None) -> dict:
    """The meta entry, if it has the form save() writes: a known format, the position (whole
    numbers >= 0) and the settings (a dict); else ValueError. Given this run's settings (those
    of run_settings), also: each stored setting of the kind this run's is (a number, a string,
    a bool), and a position that training can reach: the batch within an epoch of
    train_images / batch_size (the checkpoint's own), the step at most the batches of the
    epochs begun (a run that goes on from an earlier fit() starts at a later epoch, at step 0).
    Its plan is advice, checked by plan_problem."""
    if not isinstance(meta, dict):
        raise ValueError(f"its meta entry is {type(meta).__name__}, not a dict")
    form = meta.get("format", 1)
    if not isinstance(form, int) or isinstance(form, bool) or not 1 <= form <= FORMAT:
        raise ValueError(f"its format is {form!r}, not one of 1..{FORMAT}")
    for key in ("step", "epoch", "batch"):
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"its position {key!r} is {v!r}, not a whole number >= 0")
    if form >= 2 and "settings" not in meta:   # format 1's were all it had; 2 writes them
        raise ValueError(f"its meta entry of format {form} has no settings")
    stored = meta.get("settings", {})
    if not isinstance(stored, dict):
        raise ValueError(f"its settings are {stored!r}, not a dict")
    if not settings:
        return meta
    for key in set(stored) & set(settings) & set(SETTINGS):
        if _kind(stored[key]) != _kind(settings[key]):
            raise ValueError(f"its setting {key!r} is {stored[key]!r}, not a "
                             f"{_kind(settings[key])}")
    # the checkpoint's own epoch length (a run with another batch size is refused afterwards,
    # by _check_settings, naming both: not taken for damage here)
    images = stored.get("train_images")
    batch_size = stored.get("batch_size", meta.get("batch_size"))
    if (isinstance(images, int) and isinstance(batch_size, int) and images > 0 < batch_size
            and not isinstance(images, bool) and not isinstance(batch_size, bool)):
        per_epoch = -(-images // batch_size)
        if meta["batch"] >= per_epoch:
            raise ValueError(f"its position is batch {meta['batch']} of an epoch, which has "
                             f"{per_epoch} batches of {batch_size}")
        if meta["step"] > meta["epoch"] * per_epoch + meta["batch"]:
            raise ValueError(f"its position is step {meta['step']}, more than the "
                             f"{meta['epoch'] * per_epoch + meta['batch']} batches before "
                             f"epoch {meta['epoch']}'s batch {meta['batch']}")
    return meta


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else type(value).__name__


def plan_problem(plan, shape: "NetGeometry | None" = None) -> "str | None":
    """What keeps a checkpoint's plan (devices, partition, calibration, balancer state) from
    being reused, or None: a plan of another form (an edited file, or one of a version whose
    calibration held other fields) is planned afresh, while the checkpoint's weights,
    momentum and position are resumed. Given the network's shape, also a partition whose
    counts do not split its layers' kernels over the plan's devices."""
    if plan is None:
        return None
    if not isinstance(plan, dict):
        return f"it is {plan!r}, not a dict"
    devices = plan.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        return f"its devices are {devices!r}, not a list of SPECs"
    partition = plan.get("partition") or {}
    if not isinstance(partition, dict) or not all(
            isinstance(counts, list) and all(isinstance(k, int) and not isinstance(k, bool)
                                             and k >= 0 for k in counts)
            for counts in partition.values()):
        return f"its partition is {partition!r}, not kernel counts per layer"
    failed = plan.get("failed")
    if failed is not None and not (isinstance(failed, list)
                                   and all(isinstance(d, str) for d in failed)):
        return f"its failed devices are {shown(failed)}, not a list of names"
    # (a run whose every device failed kept its layers on the master: no kernels on any)
    everyone_failed = bool(devices) and len(set(failed or [])) == len(devices)
    for g in (shape.blocks if shape is not None else ()):
        counts = partition.get(g.name)
        if everyone_failed and counts == [0] * len(devices):
            continue
        if counts is None or len(counts) != len(devices) or sum(counts) != g.K:
            return (f"its partition of {g.name} is {counts!r}, not the layer's {g.K} kernels "
                    f"over its {len(devices)} devices")
    cal = plan.get("calibration")
    if cal is not None:
        try:
            Calibration(**cal)
        except TypeError as e:
            return f"its calibration is not one of this version ({e})"
        speeds = cal.get("speeds")
        problem = calibration_problem(cal, len(devices), set(partition) or (
            set(speeds) if isinstance(speeds, dict) else set()))
        if problem is not None:
            return f"its calibration {problem}"
        # the devices' memory, as the calibration found it, holds each layer as split
        caps = cal.get("caps") or {}
        for g in (shape.blocks if shape is not None else ()):
            cap, counts = caps.get(g.name), partition.get(g.name)
            if cap is not None and (sum(cap) < g.K or counts is not None and any(
                    k > c for k, c in zip(counts, cap))):
                return (f"its calibration's memory caps of {g.name}, {cap}, do not hold its "
                        f"partition {counts} of the layer's {g.K} kernels")
    if not isinstance(plan.get("deterministic", False), bool):
        return f"its deterministic is {shown(plan['deterministic'])}, not true or false"
    balancer = plan.get("balancer") or {}
    if not isinstance(balancer, dict):
        return f"its balancer state is {shown(balancer)}, not a dict"
    for layer, state in balancer.items():
        if not balancer_state_fits(state):
            return f"its balancer state for {layer} is {shown(state)}"
    return None


def balancer_state_fits(state) -> bool:
    """A Balancer.state() of some number of devices: speeds > 0, noise >= 0 and the times
    alone seen (> 0, or null), one of each per device."""
    if not isinstance(state, dict) or not isinstance(state.get("speeds"), list):
        return False
    n = len(state["speeds"])
    seen = state.get("alone_seen")
    return (_numbers(state["speeds"], n, 0.0, strict=True)
            and _numbers(state.get("noise"), n, 0.0)
            and (seen is None or isinstance(seen, list) and len(seen) == n and all(
                v is None or _numbers([v], 1, 0.0, strict=True) for v in seen)))


def _numbers(values, n: int, low: float, strict: bool = False) -> bool:
    """A list of n finite numbers >= low (> low where strict), none of them bool (nor an
    integer past float's range: a damaged file's)."""
    return (isinstance(values, list) and len(values) == n and all(
        (isinstance(v, float) and math.isfinite(v)
         or isinstance(v, int) and not isinstance(v, bool) and abs(v) <= 2**53)
        and (v > low if strict else v >= low) for v in values))


def calibration_problem(cal: dict, n: int, layers: set) -> "str | None":
    """What is wrong with a checkpoint's calibration (Calibration's fields as a dict) for n
    devices and these layers, or None: per layer, n speeds > 0, overheads >= 0, whole-number
    caps; the optional fields of the same form, where given."""
    def per_layer(name, check, optional=True):
        table = cal.get(name)
        if table is None and optional:
            return None
        if not isinstance(table, dict) or (not optional and set(table) != layers):
            return f"has {name} {shown(table)}, not one entry for each of {sorted(layers)}"
        for layer, v in table.items():
            if not check(v):
                return f"has {name} {shown(v)} for {layer}"
        return None

    def optional_parts(v):
        return isinstance(v, list) and len(v) == n and all(
            p is None or (isinstance(p, dict) and _numbers(list(p.values()), len(p), 0.0))
            for p in v)

    checks = [("speeds", lambda v: _numbers(v, n, 0.0, strict=True), False),
              ("overheads", lambda v: _numbers(v, n, 0.0), False),
              ("caps", lambda v: _numbers(v, n, 0) and all(isinstance(c, int) for c in v),
               False),
              ("contention", lambda v: _numbers(v, n, 0.0, strict=True), True),
              ("whole", lambda v: _numbers(v, n, 0.0, strict=True), True),
              ("waits", lambda v: _numbers([v], 1, 1.0), True),
              ("local_waits", lambda v: _numbers([v], 1, 1.0), True),
              ("local_contention", lambda v: _numbers(v, n, 0.0, strict=True), True),
              ("fits", lambda v: isinstance(v, list) and len(v) == n
               and all(_numbers(f, 3, 0.0) for f in v), True),
              ("phases", lambda v: isinstance(v, list) and len(v) == 4
               and all(_numbers(p, n, 0.0, strict=i % 2 == 0) for i, p in enumerate(v)), True),
              ("parts", optional_parts, True)]
    for name, check, optional in checks:
        problem = per_layer(name, check, optional)
        if problem is not None:
            return problem
    for key in ("master_s", "head_s"):
        master = cal.get(key)
        if master is not None and not _numbers([master], 1, 0.0):
            return f"has {key} {master!r}"
    cpu_like = cal.get("cpu_like")
    if cpu_like is not None and not (isinstance(cpu_like, list) and len(cpu_like) == n
                                     and all(isinstance(c, bool) for c in cpu_like)):
        return f"has cpu_like {cpu_like!r}"
    return None


def check_momentum(moms: dict, shape: NetGeometry) -> None:
    """Momentum arrays of every parameter (or of none: a checkpoint written before any step
    has none), float32, of the parameters' shapes, finite; else WeightsError."""
    if moms:
        checked_params(moms, shape, "momentum", copy=False)
