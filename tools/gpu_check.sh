#!/usr/bin/env bash
# The GPU checks, as one script for a machine with a CUDA GPU and CuPy already installed:
# build pyhet, run the GPU tests, train, evaluate and predict with a four-block network on the
# GPU alone and beside the CPU cores, check pyhet plan's predictions of gpu:0 and gpu:0 with the
# CPU cores against measured steps, time them (bench scaling), and run the tests of the GEMM's
# AVX-512 kernel (skipped on CPUs without it).
#   bash tools/gpu_check.sh [--no-scaling] [OUTDIR]   (logs and JSON go to OUTDIR, default
#                                                      ./gpu-check; --no-scaling skips the two
#                                                      timings, plan and scaling: about 5 min
#                                                      on 16 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
scaling=1
if [ "${1:-}" = "--no-scaling" ]; then scaling=0; shift; fi
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
src="$(pwd)"
arch="16C3p1-P2-32C3p1s2-32C3p1-48C3p1-P2-64N"
{
  python3 -c "import cupy; print('cupy', cupy.__version__, 'GPUs', cupy.cuda.runtime.getDeviceCount())"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 | head -5
  python3 -m pip install -q --no-build-isolation . 2>&1 | tail -3 || python3 -m pip install -q . 2>&1 | tail -3
  cd /tmp
  python3 -m pytest -q -p no:cacheprovider "$src/tests/test_cuda.py" "$src/tests/test_devices.py" \
     "$src/tests/test_parallel.py" "$src/tests/test_arch.py" 2>&1 | tail -8
  pyhet devices --devices auto --kernels 500,1500 --dataset cifar10 --batch-size 16
  python3 -c "import numpy, pyhet; numpy.save('$out/x.npy', pyhet.load_dataset('bundled').x_test[:100])"
  for devices in gpu:0 gpu:0,cpu; do
    echo "== $arch on $devices, bundled data"
    pyhet train --arch "$arch" --devices "$devices" --steps 200 --batch-size 64 --lr 0.05 \
      --save "$out/w-${devices//[:,]/_}.npz" --quiet --json > "$out/train.json" &&
      python3 -c "import json; s = json.load(open('$out/train.json')); print('test accuracy', s['test_accuracy'], 'step', s['step_time_s'], 'partition', s['partition'])
print('step parts', s['step_parts_s'])"
    pyhet evaluate --weights "$out/w-${devices//[:,]/_}.npz" --devices "$devices" --json | tail -1
    pyhet predict --weights "$out/w-${devices//[:,]/_}.npz" --input "$out/x.npy" \
      --devices "$devices" 2>&1 | head -2
  done
  if [ "$scaling" = 1 ]; then
    rest=$(python3 -c "from pyhet import ops; print(max(1, ops.default_threads() - 1))")
    pyhet bench plan --configs "gpu:0;gpu:0,cpu:$rest;cpu:$rest" --batch-sizes 16,64 \
      --rounds 1 --json "$out/plan.json" 2>&1 | grep -v '^round'
    # where a plan misses: its conv layers and master against the run's conv layers and the rest
    python3 -c "
import json
for r in json.load(open('$out/plan.json'))['rows']:
    for x in r['rounds']:
        print(f\"{r['devices']:>14} {r['batch_size']:>3}: plan conv {x['plan_conv_s']:.4f} s + \"
              f\"master {x['plan_master_s']:.4f} s; run conv {x['conv_s']:.4f} s + rest \"
              f\"{x['step_s'] - x['conv_s']:.4f} s (update, fc layers, loss, hand-offs)\")
        print(' ' * 20 + 'run parts: ' + ', '.join(f'{k} {v:.4f} s'
                                                   for k, v in x['step_parts_s'].items()))"
    pyhet bench scaling --steps 3 --rounds 1 --dynamic-steps 8 --cpu-devices 2,4 \
      --json "$out/scaling.json" 2>&1 | grep -v '^round'
  fi
  # the GEMM's AVX-512 kernel, whose tests skip on CPUs without it (most server Xeons have it)
  python3 -c "from pyhet import ops; print('GEMM kernel in use:', ops.gemm_kernel())"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -k avx512 "$src/tests/test_gemm.py" \
    "$src/tests/test_ops.py" 2>&1 | tail -4
} 2>&1 | tee "$out/gpu_check.log"
