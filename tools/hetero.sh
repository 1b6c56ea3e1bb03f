#!/usr/bin/env bash
# Heterogeneous efficiency on the paper network: `cpu:1` (6 steps), `cpu:1@0.5` (4) and
# `cpu:1,cpu:1@0.5 --balance static` (6), each a `pyhet train` process, ROUNDS rounds in turn;
# per round the efficiency, the ideal step 1 / (1 / t1 + 1 / t0.5) over the pair's; and before
# each round, a core's GEMM rate alone and beside the other (tools/cores_alone.py, 2 s each): a
# ratio above 1 is a clock that one busy core gets and two do not, which lowers the efficiency.
#   OUT=DIR ROUNDS=5 BATCH=16 bash tools/hetero.sh     (each run's JSON summary in DIR; python3
#                                                      and pyhet those of pyhet's environment)
set -euo pipefail
OUT=${OUT:-hetero-out}; ROUNDS=${ROUNDS:-5}; BATCH=${BATCH:-16}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
for r in $(seq 1 "$ROUNDS"); do
  python3 "$here/cores_alone.py" 2 1 | sed -n "s/^round 1: /round $r, before it: /p" ||
    echo "round $r, before it: tools/cores_alone.py failed (its message above)"
  for cfg in "cpu:1 6" "cpu:1@0.5 4" "cpu:1,cpu:1@0.5 6"; do
    set -- $cfg
    timeout 900 pyhet train --dataset synthetic --kernels 500,1500 --batch-size "$BATCH" \
      --steps "$2" --devices "$1" --balance static --quiet --json | tail -1 \
      > "$OUT/r$r-${1//[:,@.]/_}.json"
  done
  python3 - "$OUT" "$r" <<'PY'
import json, sys
out, r = sys.argv[1], sys.argv[2]
runs = {k: json.load(open(f"{out}/r{r}-{k}.json"))
        for k in ("cpu_1", "cpu_1_0_5", "cpu_1_cpu_1_0_5")}
t = {k: s["step_time_s"]["median"] for k, s in runs.items()}
ideal = 1 / (1 / t["cpu_1"] + 1 / t["cpu_1_0_5"])
pair = runs["cpu_1_cpu_1_0_5"]
idle = ", ".join(f"{d['name']} idle {100 * d['idle_fraction']:.1f}%" for d in pair["devices"])
print(f"round {r}: cpu:1 {t['cpu_1']:.3f} s, cpu:1@0.5 {t['cpu_1_0_5']:.3f} s, pair "
      f"{t['cpu_1_cpu_1_0_5']:.3f} s, efficiency {ideal / t['cpu_1_cpu_1_0_5']:.3f} "
      f"(conv2 {'/'.join(map(str, pair['partition']['conv2'].values()))}; {idle})", flush=True)
PY
done
