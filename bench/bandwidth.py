"""The paper's bandwidth analysis, measured on real rate-limited links.

    pyhet bench bandwidth [--rates 100mbit,1gbit,10gbit,none] [--kernels 500,1500]
                          [--batch-size 16] [--steps 4] [--no-ddp] [--json FILE] [--plot FILE.png]

Run as root. The master and one device rank run in two Linux network namespaces joined by a veth
pair, each end shaped by a `tc tbf` at the rate (none: no limit); MPICH is told to go over that
link (MPIR_CVAR_NOLOCAL=1, the OFI netmod with the tcp provider on the veth), not through shared
memory. Per rate the table gives: the link bandwidth the master measured, the conv2 partition
calibration chose (`--devices 0/cpu:1,1/cpu:1 --balance static`), the step time, the speedup over
the master's device alone (one process, `--devices cpu:1`), the cost model's step time beside the
measured one (its conv time, compute plus link, and the measured rest of the step), and, where
PyTorch is installed, PyTorch DDP (gloo, 2 processes of 1 thread, half the batch each) on the
same link: the data-parallel alternative, which moves the gradients of every weight each step
where pyhet moves activations. Beside them, `pyhet plan`'s predictions of both, made by the
plan under mpiexec over the same link right before each rate's run (`pyhet plan --devices
0/cpu:1,1/cpu:1`: rank 1's device calibrated on its rank beside the master's, as the run places
them, and the link measured by the plan), so that a slow minute of this machine moves a plan
and the run it predicts together.

The namespaces and links are removed when it ends, also when interrupted. Without root, `ip`,
`tc` or mpiexec it says so and does nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

try:
    from . import _util, step
except ImportError:  # run as a script: python bench/bandwidth.py
    import _util
    import step

from pyhet.cli import Parser, kernel_counts, positive
from pyhet.errors import Interrupted, PyhetError

SUBNET = "10.201.{}.{}"
PAIR = "0/cpu:1,1/cpu:1"    # the master's device and, across the link, rank 1's


def parse_args(argv):
    p = Parser(prog="pyhet bench bandwidth", description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="100mbit,1gbit,10gbit,none",
                   help="tc tbf rates, comma-separated; 'none' for no limit (default "
                        "100mbit,1gbit,10gbit,none)")
    _util.add_paper_network_options(p)
    p.add_argument("--rounds", type=positive(int), default=1,
                   help="times the rates run, in turn; rows give medians over them (default 1)")
    p.add_argument("--no-ddp", action="store_true", help="leave out PyTorch DDP")
    p.add_argument("--timeout", type=positive(float, high=_util.TIMEOUT_MAX), default=900,
                   help="seconds one run may take (default 900)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the results to FILE (.png, .pdf or .svg; needs matplotlib)")
    args = p.parse_args(argv)
    for option, check in (("--kernels", lambda: kernel_counts(args.kernels)),
                          ("--rates", lambda: [rate_bits(r) for r in args.rates.split(",")])):
        try:
            check()
        except (argparse.ArgumentTypeError, ValueError) as e:
            p.error(f"argument {option}: {e}")
    _util.given_once(p, "--rates", [r.strip() for r in args.rates.split(",") if r.strip()])
    _util.check_outputs(p, args)
    return args


def missing_tools() -> str | None:
    """Why the benchmark cannot run here, or None."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces and tc)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed ({package})"
    return _util.missing_mpi()


sh = _util.sh
NS_PREFIX = "pyhet-bw"


# ================================================================================================
# Two namespaces joined by a veth pair


class Link:
    """Namespaces ns0 (the master, 10.201.N.1) and ns1 (10.201.N.2) joined by a veth pair;
    removed by close(), also after a failed set-up: only what this run made (a name another
    run or user holds is never deleted)."""

    def __init__(self):
        tag = _util.unique_tag()
        self.ns = [f"{NS_PREFIX}{os.getpid()}-{tag}-{i}" for i in range(2)]
        self.dev = [f"pbw{tag}a", f"pbw{tag}b"]     # at most 15 characters
        self.addr = [SUBNET.format(int(tag, 16) % 250, i) for i in (1, 2)]
        self.made = []        # the namespaces made
        self.veth = False     # the veth pair made, still in this namespace (not moved)
        try:
            # each counted as made before its command, and not once the command says it failed
            # (a name already taken): a Ctrl-C that lands after the command made it, before
            # its record, would leave it
            for ns in self.ns:
                self.made.append(ns)
                try:
                    sh("ip", "netns", "add", ns)
                except PyhetError:
                    self.made.pop()
                    raise
            self.veth = True
            try:
                sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name",
                   self.dev[1])
            except PyhetError:
                self.veth = False
                raise
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                sh("ip", "link", "set", dev, "netns", ns)
                self.veth = False     # an end in a namespace of ours: deleted with it
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def shape(self, rate: str):
        """Both ends at `rate` (a tc rate such as 100mbit), or unshaped for 'none'."""
        for ns, dev in zip(self.ns, self.dev):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if rate != "none":
                # the bucket must hold what the rate sends between two timer ticks (4 ms at
                # 250 Hz), or a fast rate is throttled below itself; 400 ms of queue, in bytes
                # that fit tc's 32 bits (its own latency -> limit sum wraps above ~85gbit)
                burst = max(32 * 1024, int(rate_bits(rate) / 8 * 0.004))
                limit = min(burst + int(rate_bits(rate) / 8 * 0.4), TBF_LIMIT_MAX)
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", str(burst), "limit", str(limit))

    def close(self):
        if self.veth:         # both ends still here: deleting one deletes the pair
            sh("ip", "link", "del", self.dev[0], check=False)
            self.veth = False
        while self.made:      # a namespace's end of the veth goes with it, and the pair
            sh("ip", "netns", "del", self.made.pop(), check=False)


RATE_RANGE = (1e3, 1e12)     # 1kbit to 1000gbit: what tc takes, and a run can finish at


TBF_LIMIT_MAX = 2**32 - 1   # a tbf queue's limit is 32 bits of bytes


def rate_bits(rate: str):
    """A tc rate (a number in ASCII digits, then kbit, mbit or gbit) in bit/s; None for none."""
    if rate == "none":
        return None
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(kbit|mbit|gbit)", rate)
    if m:
        bits = float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
        if RATE_RANGE[0] <= bits <= RATE_RANGE[1]:
            return bits
        raise ValueError(f"a rate from 1kbit to 1000gbit was expected: got {rate!r}")
    raise ValueError(f"a rate > 0 like 100mbit or 1gbit, or none, was expected: got {rate!r}")


# ================================================================================================
# Runs


def train_argv(args, devices):
    return _util.train_argv(args.kernels, args.batch_size, args.steps, devices)


def over_link(link: Link, args, cwd, argv):
    """The JSON summary of `argv` run as rank 0 (the master) and rank 1, one in each namespace,
    MPICH sent over the link (not through shared memory)."""
    env = dict(os.environ, MPIR_CVAR_NOLOCAL="1", MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")
    env.pop("PYTHONPATH", None)
    # the launcher in ns0 too: its port is open there, not on this machine's interfaces
    cmd = ["ip", "netns", "exec", link.ns[0], _util.mpiexec()]
    for i, (ns, dev) in enumerate(zip(link.ns, link.dev)):
        if i:
            cmd.append(":")
        cmd += ["-n", "1", "-env", "FI_TCP_IFACE", dev, "ip", "netns", "exec", ns, *argv]
    return _util.run_json(_util.private_tmp(cmd), args.timeout, cwd, env, own_group=True)


def pyhet_over(link: Link, args, cwd):
    return over_link(link, args, cwd, train_argv(args, PAIR))


def plan_over(link: Link, args, cwd, ddp_speed: float = 1.0) -> dict:
    """`pyhet plan` of the pair as the run places it, under mpiexec over the same link: rank 1's
    device calibrated on its rank beside the master's (their slowing of each other as two
    processes of this machine), the link measured by the plan itself; DDP's replicas at
    ddp_speed (PyTorch's speed relative to pyhet's)."""
    r = over_link(link, args, cwd, [
        sys.executable, "-m", "pyhet", "plan", "--dataset", "synthetic",
        *_util.network_argv(args.kernels, None),
        "--batch-size", str(args.batch_size), "--devices", PAIR, "--ddp-speed",
        f"{ddp_speed:.6g}", "--json"])
    d1 = next(d for d in r["devices"] if d["name"] == "d1")
    return {"plan_step_s": r["predicted_step_s"], "plan_partition": r["partition"]["conv2"],
            "plan_ddp_step_s": r["ddp"]["step_s"],
            "plan_bits_per_s": (None if d1.get("bandwidth_bytes_per_s") is None
                                else 8 * d1["bandwidth_bytes_per_s"])}


DDP = textwrap.dedent('''
    import statistics, sys, time
    import numpy as np, torch, torch.distributed as dist
    from torch import nn
    rank, addr, batch, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    A, B = (int(k) for k in sys.argv[5].split(","))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:29517", rank=rank, world_size=2)
    torch.manual_seed(0)
    # the network pyhet trains: AC5-P2-BC5-P2 on 3x32x32, then fc to 10 classes
    net = nn.Sequential(nn.Conv2d(3, A, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(A, B, 5),
                        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(B * 5 * 5, 10))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(rank)
    x = torch.from_numpy(rng.standard_normal((batch, 3, 32, 32)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, batch))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(statistics.median(times[1:]))
    dist.destroy_process_group()
''')


def ddp_over(link: Link, args, cwd):
    """Median step time of PyTorch DDP, 2 processes over the link, half the batch each."""
    script = Path(cwd) / "ddp_step.py"
    script.write_text(DDP)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    procs = []
    for rank, (ns, dev) in enumerate(zip(link.ns, link.dev)):
        env_r = dict(env, GLOO_SOCKET_IFNAME=dev)
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(script), str(rank), link.addr[0],
             str(args.batch_size // 2), str(args.steps), args.kernels],
            env=env_r, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd))
    try:
        outs = [p.communicate(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        raise PyhetError(f"PyTorch DDP ran past --timeout ({args.timeout:g} s) and was "
                         f"stopped") from None
    finally:
        for p in procs:       # stopped and reaped, its pipes closed
            _util.stop_child(p, grace=2.0)
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode:
            raise _util.child_error(f"PyTorch DDP's rank {rank}", p.returncode, err)
    return float(outs[0][0].strip().splitlines()[-1])


# ================================================================================================


def replica_speed(args, rounds: int = 2) -> dict:
    """PyTorch's speed relative to pyhet's on one DDP replica's work (one process, 1 thread,
    batch / 2 images, as `pyhet bench step` runs them): pyhet's step time over PyTorch's, each
    the median of the 3 steps after a warm-up step of `rounds` runs, the two sides in turn,
    each run a fresh process (one short timing carries the machine's noise into every DDP
    prediction)."""
    from argparse import Namespace
    from statistics import median

    half = Namespace(kernels=kernel_counts(args.kernels), batch_size=max(1, args.batch_size // 2),
                     threads=1, steps=3)
    runs = {"pyhet": [], "torch": []}
    for _ in range(rounds):
        for side in runs:
            runs[side] += step._run_worker(side, half, args.timeout)["times"]
    times = {side: median(t) for side, t in runs.items()}
    return {"pyhet_s": times["pyhet"], "torch_s": times["torch"],
            "speed": times["pyhet"] / times["torch"]}


def summarise(runs: list) -> dict:
    """One rate's row from its rounds: the last round's partitions and link figures, the
    medians of the times, and the medians of each round's ratios to its measured step (the
    plan, the training's own model, the DDP plan to DDP's measured step); `rounds` keeps
    every round."""
    row = dict(runs[-1])
    median = _util.median_or_none
    for key in ("measured_bits_per_s", "step_s", "speedup", "conv_s", "predicted_conv_s",
                "predicted_step_s", "ddp_step_s", "plan_step_s", "plan_ddp_step_s"):
        row[key] = median(r[key] for r in runs)

    def ratio(key, of="step_s"):
        return median(None if r[key] is None or not r[of] else r[key] / r[of] for r in runs)

    row["plan_ratio"] = ratio("plan_step_s")
    row["model_ratio"] = ratio("predicted_step_s")
    row["plan_ddp_ratio"] = ratio("plan_ddp_step_s", "ddp_step_s")
    row["rounds"] = runs
    return row


def mbit(bits_per_s) -> str:
    return "-" if bits_per_s is None else f"{bits_per_s / 1e6:.0f}"


def _interrupt(signum, _frame):
    raise Interrupted(signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for r in rates:
        rate_bits(r)
    why = missing_tools()
    if why:
        print(f"pyhet bench bandwidth: skipped: {why}")
        return 0
    try:
        import torch  # noqa: F401
        ddp = not args.no_ddp
    except ImportError:
        ddp = False
        print("PyTorch is not installed: no DDP comparison", file=sys.stderr)
    _util.check_memory([(kernel_counts(args.kernels), args.batch_size)])
    _util.note_left_behind("bandwidth", "network namespaces",
                           _util.left_behind(_util.namespaces(), NS_PREFIX), "ip netns del NAME")
    info = _util.system_info()
    print(_util.describe_system(info))

    # SIGTERM ends the run like Ctrl-C, so the namespaces are removed either way
    old = signal.signal(signal.SIGTERM, _interrupt)
    # DDP's replicas run PyTorch's convolutions, not pyhet's: the plan gets their speed
    replica = replica_speed(args) if ddp else None
    if replica is not None:
        print(f"one DDP replica's step (batch {max(1, args.batch_size // 2)}, 1 thread): pyhet "
              f"{_util.secs(replica['pyhet_s'])} s, PyTorch {_util.secs(replica['torch_s'])} s: "
              f"the plan's DDP replicas compute at {replica['speed']:.2f} of pyhet's speed",
              flush=True)
    with tempfile.TemporaryDirectory(prefix="pyhet-bw-") as cwd:
        alone = _util.run_json(train_argv(args, "cpu:1"), args.timeout, cwd)
        alone_s = alone["step_time_s"]["median"]
        print(f"master's device alone (cpu:1): {_util.secs(alone_s)} s a step", flush=True)
        link = Link()
        runs = {rate: [] for rate in rates}
        try:
            for rnd, rate in ((r, rate) for r in range(args.rounds) for rate in rates):
                link.shape(rate)
                # pyhet plan's view of the same two ranks over the same link, calibrated
                # beside the run it predicts (once for all rates, one slow minute moved every
                # plan by 20%+)
                planned = plan_over(link, args, cwd,
                                    replica["speed"] if replica is not None else 1.0)
                s = pyhet_over(link, args, cwd)
                figures = s["links"]["1"]
                row = {"rate": rate, "set_bits_per_s": rate_bits(rate),
                       "measured_bits_per_s": None if figures["bandwidth_bytes_per_s"] is None
                       else 8 * figures["bandwidth_bytes_per_s"],
                       "latency_s": figures["latency_s"],
                       "partition": s["partition"],
                       "step_s": s["step_time_s"]["median"],
                       "speedup": alone_s / s["step_time_s"]["median"],
                       "conv_s": s["conv_time_s"],
                       "predicted_conv_s": s.get("predicted_conv_time_s"),
                       "predicted_step_s": s.get("predicted_step_time_s"),
                       "bytes_per_step": figures["bytes_sent_per_step"] +
                       figures["bytes_received_per_step"],
                       # each device's busy seconds a step (its rank's compute for d1, with
                       # its messages for the master's view of it)
                       "busy_s_per_step": {d["name"]: d["busy_s"] / s["steps"]
                                           for d in s["devices"]},
                       "ddp_step_s": ddp_over(link, args, cwd) if ddp else None}
                row.update(planned)
                runs[rate].append(row)
                print((f"round {rnd + 1}/{args.rounds}: " if args.rounds > 1 else "") +
                      f"{rate}: measured {mbit(row['measured_bits_per_s'])} Mbit/s, step "
                      f"{_util.secs(row['step_s'])} s, plan {_util.secs(row['plan_step_s'])} s" +
                      (f", DDP {_util.secs(row['ddp_step_s'])} s" if row["ddp_step_s"] else ""),
                      flush=True)
        finally:
            link.close()
            signal.signal(signal.SIGTERM, old)
    rows = [summarise(rate_runs) for rate_runs in runs.values()]

    print(f"\n--devices {PAIR} (rank 1 across the link), kernels {args.kernels}, batch "
          f"{args.batch_size}; master's device alone {_util.secs(alone_s)} s a step" +
          (f"; medians of {args.rounds} rounds (ratios: of each round's)" if args.rounds > 1
           else ""))
    table = []
    for r in rows:
        within = (None if not r["set_bits_per_s"] or not r["measured_bits_per_s"] else
                  r["measured_bits_per_s"] / r["set_bits_per_s"])
        table.append([r["rate"], mbit(r["measured_bits_per_s"]) +
                      (f" ({100 * within:.0f}%)" if within else ""),
                      "/".join(str(v) for v in r["partition"]["conv2"].values()),
                      _util.secs(r["step_s"]), f"{r['speedup']:.2f}x",
                      "-" if r["predicted_step_s"] is None else _util.secs(r["predicted_step_s"]),
                      "-" if r["model_ratio"] is None else f"{r['model_ratio']:.2f}",
                      f"{r['bytes_per_step'] / 1e6:.1f}",
                      "-" if r["ddp_step_s"] is None else f"{_util.secs(r['ddp_step_s'])}",
                      "-" if r["ddp_step_s"] is None else f"{r['step_s'] / r['ddp_step_s']:.2f}",
                      f"{_util.secs(r['plan_step_s'])}", f"{r['plan_ratio']:.2f}",
                      f"{_util.secs(r['plan_ddp_step_s'])}",
                      "-" if r["plan_ddp_ratio"] is None else f"{r['plan_ddp_ratio']:.2f}"])
    print(_util.format_table(["rate", "Mbit/s measured", "conv2 partition", "step s", "speedup",
                              "model step s", "model/measured", "MB/step", "DDP step s",
                              "pyhet/DDP", "plan s", "plan/measured", "plan DDP s",
                              "plan DDP/measured"], table))
    result = {"benchmark": "bandwidth", "system": info, "kernels": args.kernels,
              "batch_size": args.batch_size, "steps": args.steps, "alone_step_s": alone_s,
              "rounds": args.rounds,
              "ddp_replica": replica, "rates": rows}
    _util.save_outputs(result, args, plot)
    return 0


def plot(result, path):
    plt = _util.pyplot()
    if plt is None:
        return
    rows = result["rates"]
    labels = [r["rate"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["step_s"] for r in rows], 0.4, label="pyhet (2 ranks)")
    if any(r["ddp_step_s"] for r in rows):
        ax.bar([x + 0.2 for x in xs], [r["ddp_step_s"] or 0 for r in rows], 0.4,
               label="PyTorch DDP (2 processes)")
    if all(r.get("plan_step_s") for r in rows):
        ax.plot([x - 0.2 for x in xs], [r["plan_step_s"] for r in rows], "k_", ms=18, mew=2,
                label="pyhet plan's prediction")
    ax.axhline(result["alone_step_s"], color="k", ls="--", lw=1, label="one device alone")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("step time (s)")
    ax.set_xlabel("link rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _util.save_plot(fig, path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
