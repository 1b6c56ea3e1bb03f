"""A device that fails during a training step (a GPU out of memory, a rank that dies, an
injected fault): its kernels move to the other devices, from every layer's state as it was
before the step (pyhet.parallel says where that state lives and what keeping it costs), and
the step is redone on them, so the run ends with the weights a run without the failure would
have had. The failed device is closed and not used again. When no device is left, the network
keeps that last consistent state on the master and NoDeviceLeftError is raised (the training loop
writes a checkpoint of it when it has a checkpoint folder).

The new partition follows the run's --balance: dynamic uses the balancer's current speed
estimates, static the calibration, even an equal share, and --deterministic the devices'
declared speeds; always within the memory caps.
"""

from __future__ import annotations

import sys

from .errors import DeviceError, NoDeviceLeftError, say
from .partition import balanced, proportional


class Failover:
    """Runs training steps on a Net, moving a failed device's kernels to the others and redoing
    the step. `failures` records each event: step, device, phase, message, new partition."""

    def __init__(self, net, calibration=None, balance=None, log=None, declared=False):
        # calibration: pyhet.calibrate.Calibration or None; balance: the run's DynamicBalance
        # or None; log: where the one-line warning goes (stderr when None); declared: split by
        # the devices' declared speeds (--deterministic), where there is neither
        self.net, self.calibration, self.balance = net, calibration, balance
        self.declared = declared
        self.log = log if log is not None else sys.stderr
        self.failures: list = []

    def train_step(self, x, labels, cfg, timer=None, step=None):
        """Net.train_step, redone on the remaining devices after each device failure. step: the
        training step's number (1-based, as the summary counts), for the record and for
        injected faults."""
        while True:
            for d in self.net.devices:
                d.step = step
            try:
                return self.net.train_step(x, labels, cfg, timer)
            except DeviceError as e:
                if not self._a_device_failed(e):
                    raise   # not a device that failed (a bug, bad input), or a lost rank
                # with the devices that failed in the same phase (each with its own error)
                first = {e.device: e}
                for o in getattr(e, "also", []):
                    if self._a_device_failed(o):
                        first.setdefault(o.device, o)
                self._recover(list(first.values()), step)
            finally:
                for d in self.net.devices:
                    d.step = None

    # ------------------------------------------------------------------------------------------

    def _a_device_failed(self, e) -> bool:
        """Whether e is the failure of one of the net's devices, which failover can take out
        (not a bug, bad input, or a rank lost with its memory)."""
        return (isinstance(e, DeviceError) and getattr(e, "device", None) in self.net.devices
                and not getattr(e.__cause__, "ends_run", False))

    def _recover(self, errors, step):
        net = self.net
        error = errors[0]
        failed = [net.devices.index(e.device) for e in errors]
        try:
            states = {conv.name: conv.consistent_state() for conv in net.convs}
        except DeviceError as lost:   # gone with its memory (a rank that died)
            raise DeviceError(f"{error}; the state before the step could not be read back from "
                              f"it ({lost}): the run ends here (resume from the newest "
                              f"checkpoint)") from None
        for e in errors:
            e.device.close()
        # every device that failed: in the phase, then any that failed taking their kernels
        said = "; ".join(map(str, errors))
        while True:
            alive = [i not in failed and i not in net.convs[0].dead
                     for i in range(len(net.devices))]
            partition = None
            if any(alive):
                try:
                    partition = {conv.name: self._plan(conv, alive) for conv in net.convs}
                except ValueError as e:   # the others' memory cannot hold a layer
                    net.fail_over(failed, states, None)
                    raise NoDeviceLeftError(f"{said}; the remaining devices cannot take its "
                                       f"kernels: {e}") from None
            try:
                net.fail_over(failed, states, partition)
                break
            except DeviceError as e:      # another device failed while taking kernels
                other = getattr(e, "device", None)
                if other is None or other not in net.devices:
                    raise
                failed.append(net.devices.index(other))
                other.close()
                said += f"; {e}"
        if partition is None:
            raise NoDeviceLeftError(f"{said}, and no device is left to train on")
        partition = net.partition()
        moved = "; ".join(f"{layer} " + ", ".join(f"{d} {c}" for d, c in counts.items() if c)
                          for layer, counts in partition.items())
        for e in errors:
            self.failures.append({"step": step, "device": e.device.name,
                                  "phase": e.what.split(" ", 1)[-1].replace(" ", "_"),
                                  "layer": e.what.split(" ", 1)[0] if " " in e.what else None,
                                  "message": str(e), "partition": partition})
            say(f"pyhet: warning: {e}: its kernels moved to the other devices "
                f"({moved}) and step {step} is redone", self.log)

    def _plan(self, conv, alive) -> list:
        """Kernels per device of a layer over the devices still alive, as the run's balance
        mode would split them."""
        total, name = conv.K, conv.name
        caps = (self.calibration.caps[name] if self.calibration is not None
                else [total] * len(alive))
        caps = [c if a else 0 for c, a in zip(caps, alive)]
        if self.balance is not None:                  # dynamic: the current estimates
            balancer = self.balance.balancers[name]
            balancer.leave_out([i for i, a in enumerate(alive) if not a])
            return balancer.partition()
        if self.calibration is not None:              # static (no kernels where caps is 0)
            return self.calibration.partition(name, total, caps)
        if self.declared:                             # --deterministic: the declared speeds
            return balanced(total, [d.spec.speed for d in self.net.devices], caps=caps)
        return proportional(total, [1.0 if a else 0.0 for a in alive])   # even

