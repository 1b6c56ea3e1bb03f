"""`pyhet devices`: the host, the GPUs, and the devices of a SPEC with their calibrated speed on
a network (and the partition calibration gives)."""

from __future__ import annotations

from dataclasses import replace

from . import arch, ops
from .backends.numpy_ref import host_available_memory
from .calibrate import calibrate
from .data import input_shape_of
from .devices import make_devices
from .errors import DeviceError, DeviceSpecError
from .model import time_head
from .specs import check_ranks, check_threads, cuda_device_count, parse_devices
from .train import check_memory, host_backend


def _gpus() -> list[dict]:
    try:
        from .backends.cuda import describe_gpus  # CuPy is optional: imported only here

        return describe_gpus()
    except DeviceError as e:
        return [{"error": str(e)}]


def describe_devices(spec: str, arch_spec: str, dataset: str, batch: int,
                     calibrate_them: bool = True, data_dir=None) -> dict:
    """The report of `pyhet devices` as a dict (its --json)."""
    avail = host_available_memory()
    report = {"host": {"cores": ops.default_threads(), "openmp": ops.have_openmp(),
                       "gemm_kernel": ops.gemm_kernel(),
                       "memory_available_gib": (avail or 0) / 2**30},
              "gpus": _gpus()}
    in_shape, classes = input_shape_of(dataset, data_dir)
    net = arch.build(arch_spec, in_shape, classes)
    check_memory(net, batch)
    report["network"] = {"arch": net.arch, "kernels": list(net.kernels),
                         "kernel_size": net.blocks[0].R, "input_shape": list(net.input_shape),
                         "batch_size": batch}
    specs = parse_devices(spec, gpu_count=cuda_device_count)
    check_ranks(specs, 1, "devices")   # calibrated here, in one process
    check_threads(specs)
    devices = make_devices(specs)
    try:
        report["devices"] = [{"name": d.name, "spec": str(d.spec), "kind": d.kind,
                              "emulated_speed": d.spec.speed if d.spec.speed != 1 else None}
                             for d in devices]
        report["calibration"] = report["partition"] = None
        if calibrate_them:
            cal = calibrate(devices, net.blocks, batch)
            report["calibration"] = cal.as_dict(devices)
            report["partition"] = {
                g.name: dict(zip([d.name for d in devices],
                                 cal.partition(g.name, g.K))) for g in net.blocks}
    finally:
        for d in devices:
            d.close()
    return report


def calibrate_spec(spec: str, net, batch: int):
    """(device names, Calibration) of the devices of a SPEC on the network `net`
    (a NetGeometry) at this batch size: `pyhet plan`'s devices that are here. The master is
    here too: the Calibration's master_s is its own work of a step, timed."""
    specs = parse_devices(spec, gpu_count=cuda_device_count)
    for s in specs:
        if s.rank not in (None, 0):
            raise DeviceSpecError(f"--devices {spec}: {s} is placed on rank {s.rank}; pyhet plan "
                                  f"calibrates the devices of this machine only: describe the "
                                  f"others with --describe (their speed and link)")
    check_threads(specs)
    devices = make_devices(specs)
    try:
        cal = calibrate(devices, net.blocks, batch)
        # the master runs on this machine: its own work timed on the backend training gives it
        master_s = time_head(net, batch, host_backend(devices))
        return [d.name for d in devices], replace(cal, master_s=master_s,
                                                  cpu_like=[d.kind != "gpu" for d in devices])
    finally:
        for d in devices:
            d.close()
