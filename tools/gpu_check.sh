#!/usr/bin/env bash
# The GPU checks, as one script for a machine with a CUDA GPU and CuPy already installed, in
# the order of what they settle, each step under its own time limit (and all of them under
# one deadline) so that one that hangs costs its limit and not the rest: build pyhet; run the
# CuPy backend's tests; check pyhet plan's predictions of gpu:0, then of gpu:0 with the CPU
# cores, against measured steps (each in its own JSON, kept also when its limit stops it;
# then the plan-vs-run split of each row); run the other GPU tests; train, evaluate and
# predict with a four-block network on the GPU alone and beside the CPU cores; run the tests
# of the GEMM's AVX-512 kernel (skipped on CPUs without it); and, with --scaling, time bench
# scaling (CPU devices: minutes).
#   bash tools/gpu_check.sh [--scaling] [OUTDIR]    (default OUTDIR ./gpu-check; about 7 min
#                                                    on 16 cores without --scaling)
# OUTDIR gets gpu_check.log (everything, written as it goes), plan-gpu.json, plan-mixed.json
# and train-*.json: five files, six with scaling.json. GPU_CHECK_SECONDS (default 540) is the
# deadline of the whole script, under a 600 s limit on one command; a step that would start
# with under 15 s left is skipped, saying so. GPU_CHECK_NO_INSTALL=1 uses the pyhet already
# installed.
set -uo pipefail
cd "$(dirname "$0")/.."
scaling=0
if [ "${1:-}" = "--scaling" ]; then scaling=1; shift; fi
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
src="$(pwd)"
work="$(mktemp -d)"            # weights and images: not kept
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1      # every line reaches the log when printed
arch="16C3p1-P2-32C3p1s2-32C3p1-48C3p1-P2-64N"
deadline=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-540} ))
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }
# limited N CMD...: CMD under N seconds, or under what is left before the deadline (less 5 s);
# SIGKILL 10 s after the SIGTERM (a call stuck in the GPU does not return to Python's handler)
limited() {
  local want=$1; shift
  local left=$(( deadline - $(date +%s) - 5 ))
  if [ "$left" -lt 15 ]; then
    echo "gpu_check: skipped (the deadline is near): $*"
    return 124
  fi
  timeout -k 10 $(( want < left ? want : left )) "$@"
}
# where a plan misses: its conv layers and master against the run's conv layers and the rest
plan_split() {
  [ -f "$1" ] && limited 30 python3 -c "
import json
for r in json.load(open('$1'))['rows']:
    for x in r['rounds']:
        print(f\"{r['devices']:>14} {r['batch_size']:>3}: plan conv {x['plan_conv_s']:.4f} s + \"
              f\"master {x['plan_master_s']:.4f} s; run conv {x['conv_s']:.4f} s + rest \"
              f\"{x['step_s'] - x['conv_s']:.4f} s (update, fc layers, loss, hand-offs)\")
        print(' ' * 20 + 'run parts: ' + ', '.join(
            f'{k} {v:.4f} s' for k, v in (x.get('step_parts_s') or {}).items()))"
}
{
  step "CuPy and the GPU"
  limited 60 python3 -c "import cupy; r = cupy.cuda.runtime; print('cupy', cupy.__version__, 'CUDA runtime', r.runtimeGetVersion(), 'driver', r.driverGetVersion(), 'GPUs', r.getDeviceCount())"
  limited 30 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm,power.draw \
    --format=csv 2>&1 | head -5
  step "install"
  if [ -n "${GPU_CHECK_NO_INSTALL:-}" ]; then     # pyhet as installed already (a dry run)
    echo "gpu_check: using the pyhet installed: $(cd /tmp && python3 -c 'import pyhet; print(pyhet.__file__)')"
  else
    # what the build (--no-build-isolation: nothing is downloaded) needs, said before it runs
    limited 30 python3 -c "
import importlib.metadata as m, shutil, sys
have = []
for name in ('scikit-build-core', 'pybind11', 'cmake', 'ninja'):
    try:
        have.append(f'{name} {m.version(name)}')
    except m.PackageNotFoundError:
        tool = shutil.which(name)
        have.append(f'{name} ' + (f'at {tool}' if tool else 'MISSING'))
print('python', sys.version.split()[0] + ';', ', '.join(have))"
    if ! limited 300 python3 -m pip install -q --no-build-isolation --no-index . 2>&1; then
      echo "gpu_check: pyhet did not install; nothing else can run"
      exit 1
    fi
  fi
  cd /tmp
  limited 30 python3 -c "import pyhet; from pyhet import ops; print('pyhet', pyhet.__version__, 'OpenMP', 'on' if ops.have_openmp() else 'OFF', 'threads', ops.default_threads(), 'GEMM kernel', ops.gemm_kernel())"
  rest=$(python3 -c "from pyhet import ops; print(max(1, ops.default_threads() - 1))")
  step "the CuPy backend's tests"
  limited 120 python3 -m pytest -q -p no:cacheprovider "$src/tests/test_cuda.py" 2>&1 |
    grep -v "^SKIPPED"
  step "pyhet plan against measured steps: gpu:0"
  # 30 steps a run (a GPU's step is milliseconds; its runs moved by 20% at the default 6)
  limited 150 python3 -m pyhet bench plan --configs "gpu:0" --batch-sizes 16,64 --rounds 1 \
    --steps 30 --timeout 60 --json "$out/plan-gpu.json" 2>&1
  plan_split "$out/plan-gpu.json"
  step "pyhet plan against measured steps: gpu:0,cpu:$rest"
  limited 200 python3 -m pyhet bench plan --configs "gpu:0,cpu:$rest" --batch-sizes 16,64 \
    --steps 30 --rounds 1 --timeout 90 --json "$out/plan-mixed.json" 2>&1
  plan_split "$out/plan-mixed.json"
  step "the other GPU tests"
  limited 150 python3 -m pytest -q -p no:cacheprovider "$src/tests/test_devices.py" \
    "$src/tests/test_parallel.py" "$src/tests/test_arch.py" 2>&1 | grep -v "^SKIPPED"
  step "pyhet devices"
  limited 90 python3 -m pyhet devices --devices auto --kernels 500,1500 --dataset cifar10 \
    --batch-size 16 2>&1
  limited 60 python3 -c "import numpy, pyhet; numpy.save('$work/x.npy', pyhet.load_dataset('bundled').x_test[:100])"
  for devices in gpu:0 "gpu:0,cpu:$rest"; do
    name=${devices//[:,]/_}
    step "$arch on $devices, bundled data"
    limited 150 python3 -m pyhet train --arch "$arch" --devices "$devices" --steps 150 \
      --batch-size 64 --lr 0.05 --save "$work/w-$name.npz" --quiet --json \
      > "$out/train-$name.json" &&
      limited 30 python3 -c "import json; s = json.load(open('$out/train-$name.json')); print('test accuracy', s['test_accuracy'], 'step', s['step_time_s'], 'partition', s['partition'])
print('step parts', s['step_parts_s'])"
    limited 60 python3 -m pyhet evaluate --weights "$work/w-$name.npz" --devices "$devices" \
      --json 2>&1 | tail -1
    limited 60 python3 -m pyhet predict --weights "$work/w-$name.npz" --input "$work/x.npy" \
      --devices "$devices" 2>&1 | head -2
  done
  # the GEMM's AVX-512 kernel, whose tests skip on CPUs without it (most server Xeons have it)
  step "the GEMM's AVX-512 kernel"
  limited 30 python3 -c "from pyhet import ops; print('GEMM kernel in use:', ops.gemm_kernel())"
  limited 120 python3 -m pytest -q -p no:cacheprovider -k avx512 "$src/tests/test_gemm.py" \
    "$src/tests/test_ops.py" 2>&1 | tail -4
  if [ "$scaling" = 1 ]; then
    step "bench scaling"
    limited 420 python3 -m pyhet bench scaling --steps 3 --rounds 1 --dynamic-steps 8 \
      --cpu-devices 2,4 --json "$out/scaling.json" 2>&1 | grep -v '^round'
  fi
  step "done"
} 2>&1 | tee "$out/gpu_check.log"
