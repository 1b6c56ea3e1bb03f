#!/usr/bin/env bash
# Two device ranks behind the master's one network interface: the master (rank 0) and ranks 1
# and 2 in network namespaces of their own, joined by a bridge in a fourth; the master's
# interface (its veth into the bridge) shaped by `tc tbf` at RATE both ways, the ranks' own
# links not. Per rate and round, `pyhet train` of the paper network under mpiexec (DEVICES,
# default 0/cpu:1,1/cpu:1@0.5,2/cpu:1@0.5: two cores of compute in all) against one process
# of cpu:1 (the master's device alone), each link's bandwidth alone and shared (measured with
# every rank's trip at once), the partition of conv2 and the cost model's step beside the
# measured one, and `pyhet plan`'s step (run under the same mpiexec, its own calibration and
# link timing, right before the training run). Run as root, with mpiexec beside the Python
# that has pyhet:
#   bash tools/shared_interface.sh [OUTDIR]      (RATES="1gbit 300mbit" ROUNDS=2 STEPS=6)
# OUTDIR (default ./shared-interface) gets a JSON summary per run and table.txt. What it made
# (namespaces, veth pairs, bridge) is removed when it ends, also when interrupted; every run
# is under a time limit.
set -uo pipefail
out="${1:-shared-interface}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
py="${PYTHON:-$(command -v python3)}"
mpiexec="$(dirname "$py")/mpiexec"
[ -x "$mpiexec" ] || mpiexec="$(command -v mpiexec)"
if [ "$(id -u)" != 0 ] || ! command -v tc >/dev/null || [ -z "$mpiexec" ]; then
  echo "shared_interface: needs root, iproute2's ip and tc, and mpiexec"; exit 1
fi
rates="${RATES:-1gbit 300mbit}"; rounds="${ROUNDS:-2}"; steps="${STEPS:-6}"
devices="${DEVICES:-0/cpu:1,1/cpu:1@0.5,2/cpu:1@0.5}"
tag="pyhsi$$"
ns=("$tag-m" "$tag-r1" "$tag-r2" "$tag-b")
made=()
cleanup() { for n in "${made[@]}"; do ip netns del "$n" 2>/dev/null; done; made=(); }
trap 'cleanup; exit 130' INT TERM
trap cleanup EXIT
for n in "${ns[@]}"; do ip netns add "$n" && made+=("$n") || exit 1; done
ip -n "$tag-b" link add br0 type bridge && ip -n "$tag-b" link set br0 up || exit 1
for i in 0 1 2; do
  n=${ns[$i]}
  # made in the bridge's namespace, one end then moved: deleted with the namespaces
  ip -n "$tag-b" link add "${tag}a$i" type veth peer name "${tag}b$i" || exit 1
  ip -n "$tag-b" link set "${tag}a$i" netns "$n" || exit 1
  ip -n "$n" addr add "10.204.$(( $$ % 250 )).$((i + 1))/24" dev "${tag}a$i"
  ip -n "$n" link set "${tag}a$i" up; ip -n "$n" link set lo up
  ip -n "$tag-b" link set "${tag}b$i" master br0; ip -n "$tag-b" link set "${tag}b$i" up
done
shape() {   # the master's interface at $1 both ways (none: unshaped)
  tc -n "$tag-m" qdisc del dev "${tag}a0" root 2>/dev/null
  tc -n "$tag-b" qdisc del dev "${tag}b0" root 2>/dev/null
  [ "$1" = none ] && return
  local bits burst limit
  bits=$("$py" -c "import re, sys; m = re.fullmatch(r'([0-9.]+)(mbit|gbit)', sys.argv[1]); print(int(float(m[1]) * {'mbit': 1e6, 'gbit': 1e9}[m[2]]))" "$1") || exit 1
  burst=$(( bits / 8 / 250 > 32768 ? bits / 8 / 250 : 32768 ))   # a 4 ms tick's worth
  limit=$(( burst + bits / 8 * 4 / 10 ))                          # 400 ms of queue
  tc -n "$tag-m" qdisc add dev "${tag}a0" root tbf rate "$1" burst $burst limit $limit
  tc -n "$tag-b" qdisc add dev "${tag}b0" root tbf rate "$1" burst $burst limit $limit
}
train=("$py" -m pyhet train --dataset synthetic --kernels 500,1500 --batch-size 16
       --steps "$steps" --balance static --quiet --json)
plan=("$py" -m pyhet plan --dataset synthetic --kernels 500,1500 --batch-size 16 --json)
ranks() {   # mpiexec of $@ on the master and the two ranks, each in its namespace
  env -u PYTHONPATH MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp \
    timeout --foreground -k 10 900 ip netns exec "$tag-m" "$mpiexec" \
    -n 1 -env FI_TCP_IFACE "${tag}a0" ip netns exec "$tag-m" "$@" --devices "$devices" : \
    -n 1 -env FI_TCP_IFACE "${tag}a1" ip netns exec "$tag-r1" "$@" --devices "$devices" : \
    -n 1 -env FI_TCP_IFACE "${tag}a2" ip netns exec "$tag-r2" "$@" --devices "$devices"
}
cd /tmp
printf "%-8s %5s %8s %8s %9s %8s %8s %18s %19s %8s %9s\n" rate round "step s" "model s" \
  model/meas "alone s" speedup "link/shared MB/s" "conv2" "plan s" plan/meas | tee "$out/table.txt"
for round in $(seq "$rounds"); do
  for rate in $rates; do
    shape "$rate"
    planned="$out/plan-$rate-$round.json"
    ranks "${plan[@]}" 2> "$out/plan-$rate-$round.err" | tail -1 > "$planned"
    status=${PIPESTATUS[0]}    # a signal's (Ctrl-C) ends the loop; 124: the time limit
    if [ "$status" -gt 128 ]; then cleanup; exit 130; fi
    json="$out/mpi-$rate-$round.json"
    ranks "${train[@]}" 2> "$out/mpi-$rate-$round.err" | tail -1 > "$json"
    status=${PIPESTATUS[0]}
    if [ "$status" -gt 128 ]; then cleanup; exit 130; fi
    alone="$out/alone-$rate-$round.json"
    timeout --foreground -k 10 600 env -u PYTHONPATH "${train[@]}" --devices cpu:1 2>/dev/null | tail -1 > "$alone"
    "$py" - "$json" "$alone" "$rate" "$round" "$planned" <<'EOF' | tee -a "$out/table.txt"
import json, sys
try:
    d, a = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
except ValueError:
    print(f"{sys.argv[3]:<8} {sys.argv[4]:>5} failed: see {sys.argv[1][:-5]}.err")
    sys.exit(0)
step, alone = d["step_time_s"]["median"], a["step_time_s"]["median"]
try:
    p = json.load(open(sys.argv[5]))
    planned = (f"{p['predicted_step_s']:8.3f} {p['predicted_step_s'] / step:9.2f}  plan conv2 "
               + "/".join(str(v) for v in p["partition"]["conv2"].values()))
except (ValueError, KeyError):
    planned = f"plan failed: see {sys.argv[5][:-5]}.err"

links = " ".join(f"{(l['bandwidth_bytes_per_s'] or 0) / 1e6:.0f}/"
                 f"{(l.get('shared_bandwidth_bytes_per_s') or 0) / 1e6:.0f}"
                 for l in d["links"].values())
print(f"{sys.argv[3]:<8} {sys.argv[4]:>5} {step:8.3f} {d['predicted_step_time_s']:8.3f} "
      f"{d['predicted_step_time_s'] / step:9.2f} {alone:8.3f} {alone / step:7.2f}x "
      f"{links:>18}  conv2 " + "/".join(str(v) for v in d["partition"]["conv2"].values())
      + f"  {planned}")
EOF
  done
done
