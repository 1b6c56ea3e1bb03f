"""The GPU backend: CuPy, imported only when a ``gpu`` device is asked for.

The array code is the reference backend's (numpy_ref is written against an ``xp`` module), run
on CuPy arrays: the GEMMs go to cuBLAS through ``@``, im2col/col2im, ReLU and max-pool are
CuPy array expressions. So the logic a GPU runs is the logic the tests check on every machine.
All calls of one device come from its single worker thread, which makes its GPU current.

Letters as in numpy_ref.
"""

from __future__ import annotations


from ..errors import DeviceError
from ..optim import sgd_update, sgd_update_into
from . import numpy_ref as ref


def import_cupy():
    """CuPy, or a DeviceError saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        raise DeviceError(f"a gpu device needs CuPy, which is not installed ({e}); install it "
                          f"with pip install '.[cuda12]' in pyhet's source folder (or "
                          f"'.[cuda13]', matching your CUDA driver)") from None
    return cupy


def gpu_count(cupy) -> int:
    """The number of CUDA GPUs, or a DeviceError when there is no usable driver."""
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError, or a missing libcuda
        raise DeviceError(f"CuPy is installed but found no usable CUDA driver or GPU "
                          f"({type(e).__name__}: {e})") from None


class CudaBackend:
    name = "gpu"

    def __init__(self, index: int = 0):
        cp = import_cupy()
        n = gpu_count(cp)
        if not 0 <= index < n:
            have = f"GPUs 0..{n - 1}" if n else "no GPU"
            raise DeviceError(f"gpu:{index} was asked for, but this machine has {have}")
        self.cp = self.xp = cp
        self.index = index
        self.device = cp.cuda.Device(index)
        self.threads = 1
        try:   # a GPU that is counted but cannot be used (busy, exclusive, failed) fails here
            with self.device:
                cp.cuda.runtime.memGetInfo()
        except Exception as e:
            raise DeviceError(f"gpu:{index} cannot be used: {type(e).__name__}: {e}") from None

    def _use(self):
        self.device.use()

    def sync(self):
        """Wait for the work queued on the GPU: Device runs it after every call, so that a
        call's time (the balancer's and calibration's) is the GPU's, not the time to queue it
        (a backward whose results stay on the GPU returns at once otherwise, and its time
        would fall into the next call that reads a result back)."""
        self.device.synchronize()

    # --- arrays -----------------------------------------------------------------------------

    def asarray(self, a):
        self._use()
        return self.cp.ascontiguousarray(self.cp.asarray(a, dtype=self.cp.float32))

    def to_host(self, a):
        self._use()
        return self.cp.asnumpy(a)

    def free_memory(self):
        self._use()
        free, _total = self.cp.cuda.runtime.memGetInfo()
        pool = self.cp.get_default_memory_pool()   # (its figures are the current GPU's)
        # the pool keeps freed blocks for reuse: they count as free too; and a limit set on it
        # (CUPY_GPU_MEMORY_LIMIT, set_limit) caps what it may hold, the blocks in use included
        free = int(free) + int(pool.free_bytes())
        limit = int(pool.get_limit())
        return free if limit <= 0 else max(0, min(free, limit - int(pool.used_bytes())))

    def free_cache(self):
        """Give the pool's free blocks back to the GPU, and the pinned host buffers that
        copies to it went through back to the host (Device.close, after the shards went)."""
        self._use()
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()

    # --- the conv block, on the reference code over CuPy arrays; g: the layer's ConvGeometry --

    def im2col(self, x, g, key=None):
        self._use()
        return ref.im2col(x, g.R, g.S, g.stride, g.pad)

    def col2im(self, dcol, x_shape, g):
        self._use()
        return ref.col2im(dcol, x_shape, g.R, g.S, g.stride, g.pad)

    def block_forward(self, col, x_shape, w, b, g, key=None):
        self._use()
        return ref.conv_block_forward(col, x_shape, w, b, g.stride, g.pad, g.pool,
                                      g.pool_stride)

    def block_backward(self, dout, saved, col, w, need_dcol):
        self._use()
        return ref.conv_block_backward(dout, saved, col, w, need_dcol)

    def sgd_update(self, p, g, v, cfg):
        self._use()
        return sgd_update(p, g, v, cfg)

    def sgd_update_into(self, p, g, v, cfg, p_out=None, v_out=None):
        self._use()
        return sgd_update_into(p, g, v, cfg, p_out, v_out)


def describe_gpus() -> list[dict]:
    """What CuPy sees, for `pyhet devices`: [{index, name, memory_total, memory_free}], or a
    one-item list with an "error" saying why there is none."""
    try:
        cp = import_cupy()
        n = gpu_count(cp)
    except DeviceError as e:
        return [{"error": str(e)}]
    out = []
    for i in range(n):
        try:
            with cp.cuda.Device(i):
                props = cp.cuda.runtime.getDeviceProperties(i)
                free, total = cp.cuda.runtime.memGetInfo()
        except Exception as e:   # one GPU that cannot be used: said, and the others listed
            out.append({"index": i, "error": f"{type(e).__name__}: {e}"})
            continue
        name = props.get("name", b"?")
        out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_total": int(total), "memory_free": int(free)})
    return out


__all__ = ["CudaBackend", "import_cupy", "gpu_count", "describe_gpus"]
