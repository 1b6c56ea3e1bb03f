"""A slower machine for real: one device rank under a cgroup CPU quota, beside the master.

    pyhet bench ranks [--quotas 0.5,0.25] [--kernels 500,1500] [--batch-size 16] [--steps 4]
                      [--json FILE] [--plot FILE.png]

Run as root (cgroup v1's cpu controller, /sys/fs/cgroup/cpu). Rank 1's process is put in a
cgroup whose CPU quota is the given fraction of one core (cpu.cfs_quota_us over
cpu.cfs_period_us), so its device computes that much slower, as a slower machine would, with no
emulation in pyhet. Per quota it measures, each as one run of `pyhet train --balance static`:

- the master's device alone (`--devices cpu:1`, one process) and the slowed device alone (the same,
  inside the cgroup): their throughputs a and b;
- the pair, `mpiexec -n 2 pyhet train --devices 0/cpu:1,1/cpu:1` with rank 1 in the cgroup, static
  and dynamic: throughput p, its speedup over the master alone, and its heterogeneous efficiency
  p / (a + b): the share of the two devices' summed throughput that the split turns into training;
- beside it, the same speed ratio emulated with @S (`0/cpu:1,1/cpu:1@S`, S = b / a measured), to
  compare a real slow machine with the emulation.

The cgroups are removed when it ends, also when interrupted. Without root, the cpu controller or
mpiexec it says so and does nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import _util
except ImportError:  # run as a script: python bench/ranks.py
    import _util

from pyhet.cli import Parser, kernel_counts, positive, ranged
from pyhet.errors import Interrupted, PyhetError, say

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000   # a short period: throttling finer than any timing (calibration trials too)
MIN_QUOTA_US = 1_000   # the smallest cfs quota the kernel takes


def parse_args(argv):
    p = Parser(prog="pyhet bench ranks", description=__doc__.split("\n")[0])
    p.add_argument("--quotas", default="0.5,0.25",
                   help="rank 1's CPU quota as fractions of one core, comma-separated "
                        "(default 0.5,0.25)")
    _util.add_paper_network_options(p)
    p.add_argument("--timeout", type=positive(float, high=_util.TIMEOUT_MAX), default=900,
                   help="seconds one run may take (default 900)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the results to FILE (.png, .pdf or .svg; needs matplotlib)")
    args = p.parse_args(argv)
    try:
        kernel_counts(args.kernels)
    except argparse.ArgumentTypeError as e:
        p.error(f"argument --kernels: {e}")
    try:
        args.quotas = [ranged(float)(q) for q in args.quotas.split(",") if q.strip()]
    except argparse.ArgumentTypeError:
        p.error(f"--quotas: fractions such as 0.5,0.25 were expected, got {args.quotas!r}")
    if not args.quotas or any(not 0.01 <= q <= 1 for q in args.quotas):
        p.error(f"--quotas: each must be between 0.01 and 1, got {args.quotas}")
    _util.given_once(p, "--quotas", args.quotas, lambda q: f"{q:g}")
    _util.check_outputs(p, args)
    return args


def missing_tools() -> str | None:
    """Why the benchmark cannot run here, or None."""
    if os.geteuid() != 0:
        return "it needs root (a cgroup CPU quota)"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"there is no cgroup v1 cpu controller at {CGROUP_CPU}"
    for tool, package in (("ip", "iproute2"), ("nsenter", "util-linux"),
                          ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed ({package})"
    return _util.missing_mpi()


CGROUP_PREFIX = "pyhet-bench-"
NS_PREFIX = "pyhet-rk"


class Quota:
    """A cgroup with a CPU quota of `fraction` of one core; `wrap(cmd)` runs cmd inside it.
    Removed by close() (once no process is left in it)."""

    def __init__(self, fraction: float):
        self.path = CGROUP_CPU / (f"{CGROUP_PREFIX}{os.getpid()}-{_util.unique_tag()}-"
                                  f"{int(fraction * 1000)}")
        try:
            self.path.mkdir()
        except OSError as e:
            raise PyhetError(f"cannot make the cgroup {self.path}: {e.strerror or e}") from None
        # the kernel refuses a quota under 1 ms: a small fraction takes a longer period
        self.period_us = max(PERIOD_US, math.ceil(MIN_QUOTA_US / fraction))
        self.quota_us = max(MIN_QUOTA_US, round(fraction * self.period_us))
        try:
            (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        except OSError as e:
            self.close()
            raise PyhetError(f"cannot set the CPU quota of {self.path} ({self.quota_us} us in "
                             f"{self.period_us} us): {e.strerror or e}") from None
        except BaseException:
            self.close()
            raise

    def wrap(self, cmd):
        # the shell joins the cgroup, then becomes the command (which stays in it)
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *cmd]

    def close(self):
        for _ in range(50):   # its last processes may still be ending
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        say(f"pyhet bench ranks: note: the cgroup {self.path} still holds processes and was "
            f"left (remove it with: rmdir {self.path})")


class Namespace:
    """A network namespace with only its loopback up, for the MPI jobs: their launcher's and
    ranks' ports are open there, not on this machine's interfaces. Removed by close()."""

    def __init__(self):
        self.name = f"{NS_PREFIX}{os.getpid()}-{_util.unique_tag()}"
        try:
            _util.sh("ip", "netns", "add", self.name)
        except PyhetError:      # a name taken: nothing made here (a Ctrl-C: removed below)
            raise
        except BaseException:
            self.close()
            raise
        try:
            _util.sh("ip", "-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def wrap(self, cmd):
        # nsenter, not ip netns exec: that mounts a /sys of its own, without the cgroups
        return ["nsenter", f"--net=/run/netns/{self.name}", *cmd]

    def close(self):
        _util.sh("ip", "netns", "del", self.name, check=False)


def train_argv(args, devices, balance="static"):
    return _util.train_argv(args.kernels, args.batch_size, args.steps, devices, balance)


def pair(args, quota: Quota | None, devices, balance, cwd, ns: Namespace):
    """`mpiexec -n 2 pyhet train` in the namespace, rank 1 inside the quota's cgroup (if
    any)."""
    rank1 = train_argv(args, devices, balance)
    cmd = [_util.mpiexec(), "-n", "1", *train_argv(args, devices, balance), ":", "-n", "1",
           *(quota.wrap(rank1) if quota else rank1)]
    return _util.run_json(_util.private_tmp(ns.wrap(cmd)), args.timeout, cwd, own_group=True)


def step_s(summary) -> float:
    return summary["step_time_s"]["median"]


def _interrupt(signum, _frame):
    raise Interrupted(signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    why = missing_tools()
    if why:
        print(f"pyhet bench ranks: skipped: {why}")
        return 0
    _util.check_memory([(kernel_counts(args.kernels), args.batch_size)])
    _util.note_left_behind("ranks", "cgroups", _util.left_behind(
        sorted(p.name for p in CGROUP_CPU.iterdir() if p.is_dir()), CGROUP_PREFIX),
        f"rmdir {CGROUP_CPU}/NAME")
    _util.note_left_behind("ranks", "network namespaces",
                           _util.left_behind(_util.namespaces(), NS_PREFIX), "ip netns del NAME")
    info = _util.system_info()
    print(_util.describe_system(info))
    old = signal.signal(signal.SIGTERM, _interrupt)   # remove the cgroups either way
    rows = []
    ns = None
    try:
        ns = Namespace()
        with tempfile.TemporaryDirectory(prefix="pyhet-ranks-") as cwd:
            alone = step_s(_util.run_json(train_argv(args, "cpu:1"), args.timeout, cwd))
            print(f"master's device alone (cpu:1): {_util.secs(alone)} s a step", flush=True)
            for fraction in args.quotas:
                quota = Quota(fraction)
                try:
                    slow = step_s(_util.run_json(quota.wrap(train_argv(args, "cpu:1")),
                                                 args.timeout, cwd))
                    a, b = 1 / alone, 1 / slow
                    row = {"quota": fraction, "alone_step_s": alone, "slow_alone_step_s": slow,
                           "relative_speed": b / a}
                    for balance in ("static", "dynamic"):
                        s = pair(args, quota, "0/cpu:1,1/cpu:1", balance, cwd, ns)
                        row[balance] = {"step_s": step_s(s), "speedup": alone / step_s(s),
                                        "efficiency": (1 / step_s(s)) / (a + b),
                                        "partition": s["partition"],
                                        "predicted_step_s": s.get("predicted_step_time_s")}
                    speed = round(max(0.01, min(1.0, b / a)), 3)
                    s = pair(args, None, f"0/cpu:1,1/cpu:1@{speed}", "static", cwd, ns)
                    row["emulated"] = {"speed": speed, "step_s": step_s(s),
                                       "speedup": alone / step_s(s),
                                       "efficiency": (1 / step_s(s)) / (a + b),
                                       "partition": s["partition"]}
                finally:
                    quota.close()
                rows.append(row)
                print(f"quota {fraction:g}: slowed device alone {_util.secs(slow)} s, pair "
                      f"static {_util.secs(row['static']['step_s'])} s, dynamic "
                      f"{_util.secs(row['dynamic']['step_s'])} s", flush=True)
    finally:
        if ns is not None:
            ns.close()
        signal.signal(signal.SIGTERM, old)

    print(f"\n--devices 0/cpu:1,1/cpu:1 under mpiexec -n 2, rank 1 in a cgroup CPU quota; kernels "
          f"{args.kernels}, batch {args.batch_size}; master's device alone {_util.secs(alone)} s "
          f"a step")
    table = []
    for r in rows:
        for name in ("static", "dynamic", "emulated"):
            m = r[name]
            conv2 = "/".join(str(v) for v in m["partition"]["conv2"].values())
            table.append([f"{r['quota']:g}" if name == "static" else "",
                          f"{r['relative_speed']:.2f}" if name == "static" else "",
                          name if name != "emulated" else f"@{m['speed']:g} (no quota)",
                          conv2, _util.secs(m["step_s"]), f"{m['speedup']:.2f}x",
                          f"{m['efficiency']:.3f}",
                          "-" if not m.get("predicted_step_s") else
                          _util.secs(m["predicted_step_s"])])
    print(_util.format_table(["quota", "b/a", "split", "conv2 partition", "step s",
                              "speedup", "efficiency", "model step s"], table))
    result = {"benchmark": "ranks", "system": info, "kernels": args.kernels,
              "batch_size": args.batch_size, "steps": args.steps, "alone_step_s": alone,
              "quotas": rows}
    _util.save_outputs(result, args, plot)
    return 0


def plot(result, path):
    plt = _util.pyplot()
    if plt is None:
        return
    rows = result["quotas"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    for n, name in enumerate(("static", "dynamic", "emulated")):
        ax.bar([x + (n - 1) * 0.27 for x in xs], [r[name]["efficiency"] for r in rows], 0.27,
               label=name if name != "emulated" else "@S emulation")
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.set_xticks(list(xs), [f"{r['quota']:g} core" for r in rows])
    ax.set_ylabel("heterogeneous efficiency")
    ax.set_xlabel("rank 1's CPU quota")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _util.save_plot(fig, path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
