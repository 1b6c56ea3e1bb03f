#!/usr/bin/env bash
# The GPU checks, as one script for a machine with a CUDA GPU and CuPy already installed:
# build pyhet, run the GPU tests, and time gpu:0 alone against gpu:0 with the CPU cores.
#   bash tools/gpu_check.sh [OUTDIR]        (results, logs and JSON go to OUTDIR, default ./gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
{
  python3 -c "import cupy; print('cupy', cupy.__version__, 'GPUs', cupy.cuda.runtime.getDeviceCount())"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 | head -5
  python3 -m pip install -q --no-build-isolation . 2>&1 | tail -3 || python3 -m pip install -q . 2>&1 | tail -3
  (cd /tmp && python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/test_cuda.py" \
     "$OLDPWD/tests/test_devices.py" "$OLDPWD/tests/test_parallel.py" 2>&1 | tail -5)
  (cd /tmp && pyhet devices --devices auto --kernels 500,1500 --dataset cifar10 --batch-size 16)
  (cd /tmp && pyhet bench scaling --steps 3 --rounds 1 --dynamic-steps 8 \
     --json "$OLDPWD/$out/scaling.json" 2>&1 | grep -v '^round')
} 2>&1 | tee "$out/gpu_check.log"
