"""`pyhet devices`: the host, the GPUs, and the devices of a SPEC with their calibrated speed on
a network (and the partition calibration gives)."""

from __future__ import annotations

from dataclasses import replace

from . import arch, ops
from .backends.numpy_ref import host_available_memory
from .calibrate import PLAN_WHOLE_BUDGET_S, _group_size, calibrate
from .data import input_shape_of
from .devices import make_devices
from .errors import DeviceError, DeviceSpecError, PyhetError
from .model import time_head, time_in_step
from .specs import check_ranks, check_threads, cuda_device_count, parse_devices
from .train import (check_memory, host_backend, host_devices, left_out, measure_links,
                    open_devices, say_calibrating)


def _gpus() -> list[dict]:
    try:
        from .backends.cuda import describe_gpus  # CuPy is optional: imported only here

        return describe_gpus()
    except DeviceError as e:
        return [{"error": str(e)}]


def describe_devices(spec: str, arch_spec: str, dataset: str, batch: int,
                     calibrate_them: bool = True, data_dir=None, log=None) -> dict:
    """The report of `pyhet devices` as a dict (its --json). log: a stream told when the
    calibration starts (seconds to minutes), or None."""
    avail = host_available_memory()
    report = {"host": {"cores": ops.default_threads(), "openmp": ops.have_openmp(),
                       "gemm_kernel": ops.gemm_kernel(),
                       "memory_available_gib": (avail or 0) / 2**30},
              "gpus": _gpus()}
    in_shape, classes = input_shape_of(dataset, data_dir)
    net = arch.build(arch_spec, in_shape, classes)
    check_memory(net, batch, devices=host_devices(spec))
    report["network"] = {"arch": net.arch, "kernels": list(net.kernels),
                         "kernel_size": net.kernel_size, "input_shape": list(net.input_shape),
                         "batch_size": batch}
    specs = parse_devices(spec, gpu_count=cuda_device_count)
    check_ranks(specs, 1, "devices")   # calibrated here, in one process
    check_threads(specs)
    devices = make_devices(specs)
    try:
        report["devices"] = [{"name": d.name, "spec": str(d.spec), "kind": d.kind,
                              "emulated_speed": d.spec.speed if d.spec.speed != 1 else None}
                             for d in devices]
        report["calibration"] = report["partition"] = report["left_out"] = None
        if calibrate_them:
            say_calibrating(devices, log)
            cal = calibrate(devices, net.blocks, batch)
            report["calibration"] = cal.as_dict(devices)
            counts = {g.name: cal.partition(g.name, g.K) for g in net.blocks}
            report["partition"] = {layer: dict(zip([d.name for d in devices], c))
                                   for layer, c in counts.items()}
            # a device without kernels of a layer, and why (as pyhet train's summary says)
            report["left_out"] = left_out(devices, counts, cal)
    finally:
        for d in devices:
            d.close()
    return report


def calibrate_spec(spec: str, net, batch: int, in_step: bool = True, log=None):
    """(device names, Calibration) of the devices of a SPEC on the network `net`
    (a NetGeometry) at this batch size: `pyhet plan`'s devices that are here. The master is
    here too: the Calibration's master_s is its own work of a step, timed, and with it each
    conv layer's time in steps (_with_master; in_step False: no step is run, the master is
    timed on its own only). A single device's whole layers are timed on PLAN_WHOLE_BUDGET_S:
    three runs where a training run's calibration takes one. log: a stream told when the
    calibration starts, or None. (Under mpiexec, calibrate_ranks.)"""
    specs = parse_devices(spec, gpu_count=cuda_device_count)
    for s in specs:
        if s.rank not in (None, 0):
            raise DeviceSpecError(f"--devices {spec}: {s} is placed on rank {s.rank}; pyhet plan "
                                  f"calibrates a device of another rank only under mpiexec (as "
                                  f"pyhet train runs it), else describe it with --describe (its "
                                  f"speed and link)")
    check_threads(specs)
    devices = make_devices(specs)
    try:
        say_calibrating(devices, log, in_step)
        cal = calibrate(devices, net.blocks, batch, whole_budget_s=PLAN_WHOLE_BUDGET_S,
                        fastest_whole=True)
        return [d.name for d in devices], _with_master(cal, net, batch, devices, in_step)
    finally:
        for d in devices:
            d.close()


def _with_master(cal, net, batch: int, devices, in_step: bool = True):
    """The calibration with the master's own work of a step timed here (the master runs on
    this machine), on the backend training gives it: inside training steps on these devices,
    with the calibration's partition, where the conv layers take a short time (time_in_step,
    whose conv layers' times go beside it: in_step, the devices of other ranks behind their
    links as in training, and with them those of the layers it splits, timed whole on one
    device: _whole_in_step), else on its own (time_head)."""
    host = host_backend(devices)
    head_s = time_head(net, batch, host)
    timed = layers = whole = None
    if in_step:
        try:
            partition = {g.name: cal.partition(g.name, g.K) for g in net.blocks}
            got = time_in_step(net, batch, devices, partition, host,
                               sum(cal.predicted(layer, c) for layer, c in partition.items()))
        except (ValueError, MemoryError, PyhetError):
            # the devices' memory holds no whole layer (described devices may take the rest:
            # the plan says), or no whole step of them: the master's work timed on its own
            got = None
        if got is not None:
            timed, seconds = got
            layers = {k: (list(partition[k]), s) for k, s in seconds.items()}
            whole = _whole_in_step(cal, net, batch, devices, partition, host)
    return replace(cal, master_s=head_s if timed is None else timed, head_s=head_s,
                   cpu_like=[d.kind != "gpu" for d in devices], in_step=layers,
                   in_step_alone=whole)


def _whole_in_step(cal, net, batch: int, devices, partition: dict, host):
    """{layer: (kernels per device, seconds)} of each conv layer the partition splits over
    several devices, timed inside other training steps (time_in_step) with the layer whole on
    the device calibration predicts fastest at it alone, of those whose memory holds it (as
    Calibration.partition picks one); None where no layer is split or these steps did not run.
    A layer split in a short step waits on hand-offs between its devices that a device with
    the whole layer does not, so pyhet plan takes each device alone at this time
    (pyhet.plan.Cluster.in_step_alone), not at the split's."""
    whole, moved = dict(partition), []
    for g in net.blocks:
        counts = partition[g.name]
        alone = cal.alone_seconds(g.name, g.K)
        fits = [i for i, c in enumerate(cal.caps[g.name]) if c >= g.K]
        if sum(1 for k in counts if k) < 2 or alone is None or not fits:
            continue
        i = min(fits, key=lambda j: alone[j])
        whole[g.name] = [g.K if j == i else 0 for j in range(len(counts))]
        moved.append(g.name)
    if not moved:
        return None
    try:
        got = time_in_step(net, batch, devices, whole, host,
                           sum(cal.predicted(layer, c) for layer, c in whole.items()))
    except (ValueError, MemoryError, PyhetError):
        got = None
    return None if got is None else {k: (list(whole[k]), got[1][k]) for k in moved}


def calibrate_ranks(spec: str, net, batch: int, comm, timeout: float | None = None,
                    in_step: bool = True, links_together: bool = True, log=None):
    """((device names, Calibration), {name: (Link, members)}) of the devices of a SPEC placed
    on the ranks of an MPI job, on rank 0: each calibrated on its rank by pyhet train's
    calibration (a device of another rank timed by its rank, computing beside the others, so
    that the slowing of devices that share a machine is the job's own), with each rank's link
    measured as pyhet train measures it (links_together: each taken at its rate with every
    rank's bytes moving at once where that is lower; else alone, for a plan given the master's
    interface, which would otherwise be counted twice). The second item names the devices of
    the other ranks: the link to their rank, and how many devices of that rank share its
    messages (the cpu devices of a rank, which share their im2col and input gradient; else
    1). log: a stream told when the calibration starts, or None."""
    devices = open_devices(spec, timeout, comm)
    try:
        say_calibrating(devices, log, in_step)
        measure_links(devices, net.blocks, batch, together=links_together)
        cal = _with_master(calibrate(devices, net.blocks, batch, fastest_whole=True), net, batch,
                           devices, in_step)
        ranked = {d.name: (d.link, _group_size(devices, d)) for d in devices
                  if d.link is not None}
        return ([d.name for d in devices], cal), ranked
    finally:
        for d in devices:
            d.close()
