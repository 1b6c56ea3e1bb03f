"""Fault injection, FOR TESTING: make a device fail at a given training step and phase, to see
what a failing device does to a run (its kernels move to the other devices and the step is
redone; see pyhet.failover).

    PYHET_FAULT=d1:forward:5            device d1 fails in its forward work of step 5
    PYHET_FAULT=d0:update:3,d1:backward:4

The phases are those of a conv layer's step on a device: im2col (the host group's shared
im2col), forward, backward, input_gradient (the host group's shared input gradient) and update.
A fault fires at the first work of that phase at the step or after it (a device without
kernels of any layer at that step does no work), inside the device's worker, where it is
turned into the DeviceError naming the device exactly as a real failure is; from then on
all its step work raises too, while reading its shards back and closing it still work, as on
a GPU that ran out of memory (whose memory is still there). Steps count from 1 as in the
summary, also after --resume. From Python: Device.inject_fault(phase, step), or the variable
set before the devices are made (pyhet.Network makes them at its first fit, predict or
evaluate).
"""

from __future__ import annotations

import os
import re

import numpy as np

from .errors import DeviceError, shown

ENV = "PYHET_FAULT"
PHASES = ("im2col", "forward", "backward", "input_gradient", "update")


class InjectedFault(RuntimeError):
    """What an injected fault raises inside the device's worker."""


class Fault:
    """Fail at the first work of `phase` at training step `step` or after; then keep failing."""

    def __init__(self, phase: str, step: int, where: str = ENV, error=DeviceError):
        """A wrong phase or step raises error("WHERE: what was expected, got what came")."""
        if not isinstance(phase, str) or phase not in PHASES:
            raise error(f"{where}: phase must be one of {', '.join(PHASES)}, got {shown(phase)}")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise error(f"{where}: step must be a whole number >= 1, got {shown(step)}")
        self.phase, self.step, self.fired = phase, int(step), False

    def check(self, phase: str | None, step: int | None) -> None:
        """Raise InjectedFault if the device must fail now. phase: the phase of the work (None
        for work that is not part of a training step, such as reading a shard back); step: the
        training step under way, or None outside training."""
        if not self.fired and (phase != self.phase or step is None or step < self.step):
            return
        if self.fired and phase is None:   # not step work: reading shards back, closing
            return
        if not self.fired:
            self.fired = True
            raise InjectedFault(f"injected fault ({ENV}) at step {step}, {phase}")
        raise InjectedFault(f"the device failed earlier (injected fault, {ENV})")


def parse(text: str) -> dict:
    """{device name: Fault} from the variable's text, entries DEVICE:PHASE:STEP joined by
    commas; raises DeviceError (one line, what was expected) on anything else."""
    faults = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        parts = entry.split(":")
        # ASCII digits: isdigit() takes '²', which int() refuses
        if len(parts) != 3 or not re.fullmatch(r"[0-9]{1,18}", parts[2].strip()):
            raise DeviceError(f"{ENV}: entry {entry!r} is not DEVICE:PHASE:STEP, e.g. "
                              f"'d1:forward:5'")
        name, phase, step = parts[0].strip(), parts[1].strip(), int(parts[2])
        if name in faults:     # one fault a device: the first would be dropped
            raise DeviceError(f"{ENV}: {name} is given twice; one fault a device")
        faults[name] = Fault(phase, step)
    return faults


def from_environment(names) -> dict:
    """The faults PYHET_FAULT asks for, {device name: Fault}, checked against the names of the
    devices of this run ({} when the variable is unset or empty). The one place it is read."""
    faults = parse(os.environ.get(ENV, ""))
    unknown = [n for n in faults if n not in names]
    if unknown:
        raise DeviceError(f"{ENV}: no device {', '.join(unknown)} in this run (its devices are "
                          f"{', '.join(names)})")
    return faults
