"""The benchmarks run, as `pyhet bench NAME` runs them, and write the JSON they promise (on
tiny problems: these are smoke tests, the figures come from the real runs)."""

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess

import pytest

from pyhet import ops
from pyhet.calibrate import MIN_CONTENTION
from pyhet.cli import main


def run(capsys, *argv):
    assert main(["bench", *argv]) == 0
    return capsys.readouterr().out


def bench_module(name):
    """The benchmark module `pyhet bench NAME` runs (bench/ in the source tree)."""
    try:
        return importlib.import_module(f"pyhet.bench.{name}")
    except ImportError:
        return importlib.import_module(f"bench.{name}")


def test_bench_gemm(tmp_path, capsys):
    out = run(capsys, "gemm", "--shapes", "33x17x65,20x9x31:tn", "--threads", "1",
              "--repeat", "1", "--pause", "0", "--json", str(tmp_path / "g.json"))
    res = json.loads((tmp_path / "g.json").read_text())
    rows = res["results"]
    assert "33x17x65" in out and len(rows) == 2
    # what reproduces it
    assert (res["seed"], res["plain_max_gflop"], res["threads"], res["repeat"]) == (0, 4, [1], 1)
    kernels = res["kernels"]  # every kernel this CPU runs, side by side
    assert "portable" in kernels and ops.gemm_kernel() in kernels
    for r in rows:
        assert r["pyhet_gflops"] > 0 and r["numpy_gflops"] > 0 and r["max_rel_diff"] < 1e-5
        assert r["default_kernel"] == ops.gemm_kernel()
        assert all(r["gflops"][name] > 0 for name in kernels)
        if "avx512" in kernels and "avx2-fma" in kernels:
            assert r["ratios"]["avx512/avx2-fma"] > 0
    # The plain loop runs on the product without transposes only.
    assert rows[0]["gflops"]["plain loop"] > 0 and rows[0]["ratios"]["portable/plain loop"] > 0
    assert "plain loop" not in rows[1]["gflops"]
    assert "portable/plain loop" in out


def test_bench_gemm_strassen_beside_the_blocked_product(tmp_path, capsys):
    """A product big enough for Strassen's scheme also runs with it off (the `blocked` side), and
    the table gives the scheme's gain; a smaller one does not."""
    from pyhet import _core

    old = _core.set_gemm_strassen_min_dim(20)
    try:
        out = run(capsys, "gemm", "--shapes", "33x21x65,19x40x40", "--threads", "1", "--repeat",
                  "1", "--pause", "0", "--plain-max-gflop", "0", "--json", str(tmp_path / "g.json"))
    finally:
        _core.set_gemm_strassen_min_dim(old)
    big, small = json.loads((tmp_path / "g.json").read_text())["results"]
    gain = f"{ops.gemm_kernel()}/blocked"
    assert big["gflops"]["blocked"] > 0 and big["ratios"][gain] > 0 and big["max_rel_diff"] < 1e-5
    assert "blocked" not in small["gflops"] and gain not in small["ratios"]
    assert gain in out


def test_bench_gemm_chosen_kernels(capsys):
    out = run(capsys, "gemm", "--shapes", "9x8x7", "--threads", "1", "--repeat", "1",
              "--pause", "0", "--kernels", "portable", "--plain-max-gflop", "0")
    assert "portable/numpy" in out and "avx2-fma" not in out.split("measured:")[1]
    with pytest.raises(SystemExit) as e:
        main(["bench", "gemm", "--kernels", "sse9"])
    assert e.value.code == 2 and "expected kernels among" in capsys.readouterr().err


def test_bench_step(tmp_path, capsys):
    out = run(capsys, "step", "--kernels", "4,6", "--steps", "1", "--rounds", "1", "--blocked",
              "--json", str(tmp_path / "s.json"))
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["sides"]["pyhet"]["median_s"] > 0 and "pyhet" in out
    # what reproduces it, as the other benchmarks' files say
    assert (res["steps"], res["rounds"], res["blocked"]) == (1, 1, True)
    assert res["system"]["pyhet"] and res["system"]["pyhet_gemm_kernel"] == ops.gemm_kernel()
    # a step of milliseconds in three significant digits (0.001 beside a ratio of 0.32)
    line = out.split("peak RSS MB\n", 1)[1].splitlines()[0]
    assert line.split()[1] == _util_secs(res["sides"]["pyhet"]["median_s"]), line
    assert res["sides"]["blocked"]["median_s"] > 0 and res["ratio_pyhet_over_blocked"] > 0
    assert "ratio pyhet / blocked" in out
    if "torch" in res["sides"]:
        assert res["ratio_pyhet_over_torch"] > 0


def scaling_counts():
    return bench_module("scaling").cpu_counts(ops.default_threads())


def _util_secs(v):
    return bench_module("_util").secs(v)


def test_bench_scaling(tmp_path, capsys):
    """--kernels wins over --quick's; a --plot without a suffix is written as a PNG, and the
    file written is the one named."""
    plot = importlib.util.find_spec("matplotlib") is not None
    out = run(capsys, "scaling", "--quick", "--kernels", "8,16", "--steps", "1", "--rounds", "1",
              "--dynamic-steps", "3", "--json", str(tmp_path / "c.json"),
              *(["--plot", str(tmp_path / "myplot")] if plot else []))
    if plot:
        assert f"plot written to {tmp_path / 'myplot.png'}" in out
        assert [p.name for p in tmp_path.glob("myplot*")] == ["myplot.png"]
    res = json.loads((tmp_path / "c.json").read_text())
    assert (res["steps"], res["rounds"], res["dynamic_steps"]) == (1, 1, 3)
    assert res["cpu_devices"] == scaling_counts()
    if res["dynamic"]["settled_step_s"] is not None:
        assert f"settled step time {_util_secs(res['dynamic']['settled_step_s'])} s" in out
    else:   # conv2's partition moved at the last step (a machine that slowed a step)
        assert res["dynamic"]["conv2_settled_after_steps"] is None
        assert "has not been seen to settle (give more --dynamic-steps)" in out
    configs = {(r["config"], r["balance"]) for r in res["configs"]}
    assert ("cpu:1", None) in configs and ("cpu:1,cpu:1@0.5", "even") in configs
    for r in res["configs"]:
        assert sum(r["partition"]["conv2"].values()) == 16 and r["step_s"] > 0
        if r["balance"] != "dynamic":
            assert "settle_steps" not in r
            continue
        # timed once its balancer has settled, as bench paper's; its line says how
        scaling = bench_module("scaling")
        assert scaling.QUIET <= r["settle_steps"] <= scaling.SETTLE_MAX
        assert r["moves_before_timing"] + r["moves_timed"] == len(r["moves"])
        assert scaling.settled_line(r) in out
    assert len(res["dynamic"]["trace"]) == 4 + 3 and "Part 2" in out
    moved = [t["move_s"] for t in res["dynamic"]["trace"] if t["move_s"] is not None]
    assert res["dynamic"]["moves_s"] == moved and all(m >= 0 for m in moved)
    assert ("no repartition in these steps" in out) == (not moved)
    assert "move ms" in out


def test_scaling_warns_where_its_largest_mix_has_more_threads_than_cores(monkeypatch):
    """As pyhet train warns of its devices: once, before any configuration is made."""
    scaling = bench_module("scaling")

    class Made(Exception):
        pass

    def config(*_):
        raise Made

    monkeypatch.setattr(scaling, "Config", config)
    n = ops.default_threads() + 1
    args = argparse.Namespace(cpu_devices=[1, n], batch_size=4)
    with pytest.warns(RuntimeWarning, match=f"the cpu devices use {n} threads in all but this "
                                            f"process may run on {n - 1} cores"):
        with pytest.raises(Made):
            scaling.part1(args, None, None, None, None)


def test_scaling_says_how_long_its_moves_took():
    scaling = bench_module("scaling")
    assert scaling.moves_summary([]) == "no repartition in these steps"
    assert scaling.moves_summary([0.0012]).endswith(": 1.20 ms")
    assert scaling.moves_summary([0.0002, 0.0031, 0.0009]).endswith(": 0.20-3.10 ms each")
    assert scaling.moves_summary([0.1, 0.2]).startswith("2 repartitions (")


def test_scaling_says_when_the_partition_was_not_seen_to_settle():
    """Part 2: the step at which the partition last moved after the change (0: never); a move
    at the last step has not been seen to settle (no settled time, no ratio)."""
    scaling = bench_module("scaling")
    key = (lambda t: t["conv2"])

    def after(*parts):          # each step's partition after it
        return [{"conv2": p} for p in parts]

    assert scaling._settled([8, 7], after([10, 5], [10, 5], [10, 5]), key) == 1
    assert scaling._settled([8, 7], after([8, 7], [9, 6], [9, 6]), key) == 2
    assert scaling._settled([8, 7], after([8, 7], [8, 7], [10, 5]), key) is None
    assert scaling._settled([8, 7], after([8, 7], [8, 7]), key) == 0      # never moved
    assert scaling._settled([8, 7], after([8, 7]), key) == 0             # one step, no move
    assert scaling._settled([8, 7], after([9, 6]), key) is None          # one step, a move
    dyn = {"best_static_partition": {"conv2": {"d0": 10, "d1": 5}}, "best_static_step_s": 1.0,
           "conv2_settled_after_steps": None, "partition_settled_after_steps": None,
           "within_5pct_of_best_static_after_steps": None, "settled_step_s": None,
           "settled_over_best_static": None}
    text = scaling.settling_summary(dyn, 3)
    assert "not been seen to settle" in text and "--dynamic-steps" in text
    assert "ratio" not in text and "10/5" in text
    dyn.update({"conv2_settled_after_steps": 2, "partition_settled_after_steps": None,
                "within_5pct_of_best_static_after_steps": 3, "settled_step_s": 1.02,
                "settled_over_best_static": 1.02})
    text = scaling.settling_summary(dyn, 3)
    # without change_at_step: the steps after the change are the table's 1, 2, 3
    assert "last moved after step 2 (2 steps after the change), steps 3-3 ran on it" in text
    assert "(conv1's still moved after the last step)" in text
    assert "from step 3 on (the last 1 step only" in text and "ratio 1.020" in text
    assert "(the median of the 1 step on conv2's final partition)" in text
    # in the table's numbers: the change before step 5, twelve steps after it (5-16)
    dyn.update({"change_at_step": 5, "conv2_settled_after_steps": 4,
                "partition_settled_after_steps": 6,
                "within_5pct_of_best_static_after_steps": 5})
    text = scaling.settling_summary(dyn, 12)
    assert text.startswith("after the change (before step 5): conv2's partition last moved "
                           "after step 8 (4 steps after the change), steps 9-16 ran on it "
                           "(conv1's last moved after step 10); the step time is within 5% "
                           "of the best static partition's from step 9 on.")
    assert "(the median of the 8 steps on conv2's final partition)" in text
    dyn.update({"conv2_settled_after_steps": 0, "partition_settled_after_steps": 0})
    assert "did not move in the 12 steps after it;" in scaling.settling_summary(dyn, 12)


def test_bench_bandwidth(tmp_path, capsys):
    """Two rates on a tiny network, without DDP; where root, ip, tc or mpiexec is missing it
    says so and does nothing. It leaves no namespace behind."""
    import subprocess

    bandwidth = bench_module("bandwidth")
    why = bandwidth.missing_tools()
    out = run(capsys, "bandwidth", "--rates", "none,1gbit", "--kernels", "4,8", "--steps", "2",
              "--no-ddp", "--json", str(tmp_path / "b.json"))
    if why:
        assert f"skipped: {why}" in out
        return
    res = json.loads((tmp_path / "b.json").read_text())
    assert [r["rate"] for r in res["rates"]] == ["none", "1gbit"] and res["steps"] == 2
    for r in res["rates"]:
        # an unlimited link can be too fast to time on the message (null, as README says)
        bits = r["measured_bits_per_s"]
        assert r["step_s"] > 0 and (bits > 0 if r["rate"] != "none" else bits is None or bits > 0)
        assert sum(r["partition"]["conv2"].values()) == 8
        assert r["plan_step_s"] > 0 and r["plan_ddp_step_s"] > 0
        assert sum(r["plan_partition"].values()) == 8
    assert "plan/measured" in out
    assert "pyhet-bw" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout


@pytest.mark.parametrize("rate", ["100mbit", "85.1gbit", "1000gbit"])
def test_bench_bandwidth_queue_holds_400_ms_at_every_rate(rate):
    """tc's own latency -> limit sum wraps at 32 bits above ~85gbit (85.1gbit: a 2.6 MB limit
    under a 42 MB bucket); the queue is given in bytes, as much as fits."""
    bandwidth = bench_module("bandwidth")
    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.skip("needs root and tc")
    link = bandwidth.Link()
    try:
        link.shape(rate)
        shown = subprocess.run(["tc", "-n", link.ns[0], "qdisc", "show", "dev", link.dev[0]],
                               capture_output=True, text=True, check=True).stdout
    finally:
        link.close()
    m = re.search(r"burst (\d+)b (?:lat (\S+)|limit (\d+)b)", shown)
    assert m, shown
    if m.group(2):
        lat_s = float(m.group(2)[:-2]) * (1e-3 if m.group(2).endswith("ms") else 1)
        # at 1000gbit 400 ms is more than 32 bits of bytes: as much queue as fits
        want = min(0.4, (2**32 - 1 - int(m.group(1))) / (bandwidth.rate_bits(rate) / 8))
        assert lat_s == pytest.approx(want, rel=0.1), shown
    else:
        assert int(m.group(3)) >= int(m.group(1)), shown


def test_bench_bandwidth_rows_are_medians_of_the_rounds():
    """--rounds: a rate's row gives the medians of its rounds' times and of each round's ratio
    of a prediction to the step measured in that round, and keeps every round."""
    bandwidth = bench_module("bandwidth")

    def run_(step, plan, ddp, plan_ddp):
        return {"rate": "1gbit", "measured_bits_per_s": 9e8, "step_s": step, "speedup": 1.0,
                "conv_s": step, "predicted_conv_s": None, "predicted_step_s": None,
                "ddp_step_s": ddp, "plan_step_s": plan, "plan_ddp_step_s": plan_ddp,
                "partition": {"conv2": {"d0": 5, "d1": 3}}}

    runs = [run_(1.0, 1.1, 2.0, 1.0), run_(2.0, 1.0, None, 3.0), run_(1.5, 1.65, 4.0, 2.0)]
    row = bandwidth.summarise(runs)
    assert row["step_s"] == 1.5 and row["plan_step_s"] == 1.1 and row["ddp_step_s"] == 3.0
    assert row["plan_ratio"] == pytest.approx(1.1)          # 1.1, 0.5, 1.1
    assert row["plan_ddp_ratio"] == pytest.approx(0.5)      # 0.5, -, 0.5
    assert row["model_ratio"] is None and row["rounds"] == runs


def test_bench_bandwidth_refuses_a_bad_rounds(capsys):
    """Refused before anything is set up (no root needed): one usage error, exit status 2."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "bandwidth", "--rounds", "0"])
    assert e.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def test_bench_bandwidth_times_a_ddp_replica_in_each_framework():
    """The DDP plan's replica speed: pyhet's time on one replica's work over PyTorch's."""
    pytest.importorskip("torch")
    from argparse import Namespace
    bandwidth = bench_module("bandwidth")
    r = bandwidth.replica_speed(Namespace(kernels="4,8", batch_size=4, timeout=300), rounds=1)
    assert r["pyhet_s"] > 0 and r["torch_s"] > 0
    assert r["speed"] == pytest.approx(r["pyhet_s"] / r["torch_s"])


def test_bench_ranks(tmp_path, capsys):
    """One quota on a tiny network; where root, the cgroup cpu controller or mpiexec is missing
    it says so and does nothing. It leaves no cgroup behind."""
    ranks = bench_module("ranks")
    why = ranks.missing_tools()
    out = run(capsys, "ranks", "--quotas", "0.5", "--kernels", "4,8", "--steps", "2",
              "--json", str(tmp_path / "r.json"))
    if why:
        assert f"skipped: {why}" in out
        return
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["steps"] == 2
    (row,) = res["quotas"]
    assert row["quota"] == 0.5 and row["slow_alone_step_s"] > 0
    for name in ("static", "dynamic", "emulated"):
        assert row[name]["step_s"] > 0 and 0 < row[name]["efficiency"]
        assert sum(row[name]["partition"]["conv2"].values()) == 8
    assert not list(ranks.CGROUP_CPU.glob("pyhet-bench-*"))


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.5, 1.0])
def test_bench_ranks_quota_the_kernel_takes(fraction):
    """A quota under the kernel's 1 ms (0.05 of a 10 ms period) takes a longer period: the
    cgroup holds the fraction asked for, not an EINVAL traceback."""
    ranks = bench_module("ranks")
    if os.geteuid() != 0 or not ranks.CGROUP_CPU.is_dir():
        pytest.skip("needs root and the cgroup cpu controller")
    q = ranks.Quota(fraction)
    try:
        quota = int((q.path / "cpu.cfs_quota_us").read_text())
        period = int((q.path / "cpu.cfs_period_us").read_text())
    finally:
        q.close()
    assert quota >= 1000 and quota / period == pytest.approx(fraction, rel=1e-3)
    assert not q.path.exists()


def test_bench_paper(tmp_path, capsys):
    """Every analysis on tiny networks: a section each in the JSON, the paper's figures beside
    ours, the bandwidth section read from a bench bandwidth JSON, and a PNG per analysis where
    matplotlib is installed."""
    bw = {"kernels": "4,8", "batch_size": 4, "alone_step_s": 0.2,
          "rates": [{"rate": "100mbit", "measured_bits_per_s": 9.5e7, "step_s": 0.4,
                     "partition": {"conv1": {"d0": 2, "d1": 2}, "conv2": {"d0": 5, "d1": 3}}},
                    {"rate": "none", "measured_bits_per_s": None, "step_s": 0.1,
                     "partition": {"conv1": {"d0": 2, "d1": 2}, "conv2": {"d0": 4, "d1": 4}}}]}
    (tmp_path / "bw.json").write_text(json.dumps(bw))
    plots = importlib.util.find_spec("matplotlib") is not None   # --plot needs it (else exit 2)
    out = run(capsys, "paper", "--quick", "--kernels-list", "4,8/6,12", "--batch-sizes", "2,4",
              "--network", "4,8", "--steps", "2", "--bandwidth-json", str(tmp_path / "bw.json"),
              "--json", str(tmp_path / "p.json"),
              *(["--plot", str(tmp_path / "png")] if plots else []))
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["conv_share"]["paper"]["conv_time_fraction"] == [0.6, 0.9]
    shares = res["conv_share"]["rows"]
    assert [(r["sweep"], r["kernels"], r["batch_size"]) for r in shares] == [
        ("kernels", [4, 8], 16), ("kernels", [6, 12], 16), ("batch", [4, 8], 2),
        ("batch", [4, 8], 4)]
    assert all(0 < r["cpu1"] <= 1 for r in shares)
    sp = res["speedup"]
    assert sp["paper"] == {"speedup_4_cpus": 3.28, "speedup_3_gpus": 2.45}
    assert sp["devices"][0]["devices"] == 1
    assert sp["devices"][-1]["devices"] == ops.default_threads()
    assert sp["devices"][0]["speedup"] == pytest.approx(1.0)
    assert [r["batch_size"] for r in sp["batch"]] == [2, 4]
    assert [r["kernels"] for r in sp["network"]] == [[4, 8], [6, 12]]
    for r in sp["batch"] + sp["network"]:
        assert r["speedup"] > 0 and 0 < r["efficiency"] and sum(r["partition"].values()) == \
            r["kernels"][1]
    mixes = [r for r in res["speed_mix"]["rows"] if r["balance"]]
    assert {r["balance"] for r in mixes} == {"even", "static", "dynamic"}
    assert all(r["ideal_speedup"] == pytest.approx(1.5) for r in mixes if len(r["speeds"]) == 2)
    paper = bench_module("paper")
    # a dynamic mix is timed once its balancer has settled (or SETTLE_MAX steps on), and says
    # how long that took; the others take no such steps
    for r in mixes:
        if r["balance"] != "dynamic":
            assert "settle_steps" not in r
            continue
        assert paper.QUIET <= r["settle_steps"] <= paper.SETTLE_MAX
        assert r["moves_before_timing"] >= 0 and r["moves_timed"] >= 0
        n = r["moves_before_timing"]
        assert (f"{r['config']} dynamic: timed after {r['settle_steps']} untimed steps to settle "
                f"({n} move{'' if n == 1 else 's'} from") in out
    rates = res["bandwidth"]["rows"]
    assert [r["rate"] for r in rates] == ["100mbit", "none"]
    assert [r["speedup"] for r in rates] == pytest.approx([0.5, 2.0])
    assert "3.28x on 4 CPUs" in out and "60%-90%" in out
    if not plots:
        return
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "paper_bandwidth.png", "paper_conv_share.png", "paper_speed_mix.png",
        "paper_speedup.png"]


def test_bench_paper_quick_skips_bandwidth_and_bad_options(capsys):
    out = run(capsys, "paper", "--quick", "--kernels-list", "4,8", "--batch-sizes", "2",
              "--network", "4,8", "--steps", "2")
    assert "--quick: no bandwidth run" in out
    with pytest.raises(SystemExit) as e:
        main(["bench", "paper", "--steps", "1"])
    assert e.value.code == 2 and "expected at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "paper", "--kernels-list", "4"])
    assert e.value.code == 2 and "expected two kernel counts" in capsys.readouterr().err


def test_bench_paper_a_bandwidth_rate_without_a_step(tmp_path, capsys):
    """A rate whose run gave no step time (the file's check lets step_s be null): its row
    says "-". Printing it raised a TypeError after every analysis, and --json was not written."""
    bw = {"kernels": "4,8", "batch_size": 4, "alone_step_s": 0.2,
          "rates": [{"rate": "10mbit", "measured_bits_per_s": None, "step_s": None,
                     "partition": None},
                    {"rate": "none", "measured_bits_per_s": None, "step_s": 0.1,
                     "partition": {"conv1": {"d0": 2, "d1": 2}, "conv2": {"d0": 4, "d1": 4}}}]}
    (tmp_path / "bw.json").write_text(json.dumps(bw))
    out = run(capsys, "paper", "--kernels-list", "4,8", "--batch-sizes", "2", "--network", "4,8",
              "--steps", "2", "--bandwidth-json", str(tmp_path / "bw.json"),
              "--json", str(tmp_path / "p.json"))
    rows = json.loads((tmp_path / "p.json").read_text())["bandwidth"]["rows"]
    assert [(r["rate"], r["step_s"], r["speedup"]) for r in rows] == [
        ("10mbit", None, None), ("none", 0.1, pytest.approx(2.0))]
    line = next(t for t in out.splitlines() if t.lstrip().startswith("10mbit"))
    assert line.split()[1:4] == ["-", "-", "-"], line


def test_bench_paper_bad_bandwidth_json(tmp_path, capsys):
    """Read before any analysis runs: a usage error, nothing measured and lost."""
    (tmp_path / "bw.json").write_text('{"rates": []}')
    with pytest.raises(SystemExit) as e:
        main(["bench", "paper", "--quick", "--kernels-list", "4,8", "--batch-sizes", "2",
              "--network", "4,8", "--steps", "2", "--bandwidth-json", str(tmp_path / "bw.json")])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert "expected the JSON of `pyhet bench bandwidth" in err


def test_bench_paper_unwritable_plot_dir(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["bench", "paper", "--quick", "--kernels-list", "4,8", "--batch-sizes", "2",
              "--network", "4,8", "--steps", "2", "--plot", str(tmp_path / "file" / "png")])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert "is a regular file, not a folder" in err


def test_bench_pair(tmp_path, capsys):
    out = run(capsys, "pair", "--configs", "cpu:1;cpu:1,numpy", "--arch", "4C3-P2-6C3-P2",
              "--batch-size", "4", "--steps", "2", "--rounds", "2", "--json",
              str(tmp_path / "p.json"))
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["reference"] == "cpu:1" and len(res["reference_step_s"]) == 2
    assert res["rounds"] == 2
    [row] = res["rows"]
    assert row["devices"] == "cpu:1,numpy" and len(row["ratios"]) == 2
    assert row["ratios"] == [a / b for a, b in zip(res["reference_step_s"], row["step_s"])]
    assert row["median_ratio"] == statistics.median(row["ratios"])
    assert "median ratio" in out
    for bad in (["--configs", "cpu:1"], ["--configs", "cpu:2;cpu:x"], ["--steps", "1"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "pair", *bad])
        assert e.value.code == 2


def test_bench_plan(tmp_path, capsys):
    out = run(capsys, "plan", "--configs", "cpu:1;cpu:1,numpy", "--batch-sizes", "2",
              "--kernels", "4,6", "--steps", "2", "--rounds", "2",
              "--json", str(tmp_path / "p.json"))
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [(r["devices"], r["batch_size"]) for r in rows] == [("cpu:1", 2), ("cpu:1,numpy", 2)]
    for r in rows:
        assert r["plan_step_s"] > 0 and r["step_s"] > 0
        # the row's figures are the medians of its rounds' (of two: their mean)
        assert len(r["rounds"]) == 2
        for x in r["rounds"]:       # each round's plan and training summary, whole
            assert x["plan"]["predicted_step_s"] == x["plan_step_s"]
            assert x["run"]["step_time_s"]["median"] == x["step_s"]
        for key in ("plan_step_s", "step_s"):
            assert r[key] == pytest.approx(sum(x[key] for x in r["rounds"]) / 2)
        assert r["plan_ratio"] == pytest.approx(
            sum(x["plan_step_s"] / x["step_s"] for x in r["rounds"]) / 2)
        assert sum(r["plan_partition"].values()) == sum(r["partition"].values()) == 6
        # a single device at least 1; among several at least MIN_CONTENTION
        low = 1.0 if len(r["contention"]) == 1 else MIN_CONTENTION
        assert all(v >= low for v in r["contention"].values())
    assert rows[0]["train_model_step_s"] is None and rows[1]["train_model_step_s"] > 0
    assert "plan/measured" in out and "largest difference" in out and "medians of 2" in out
    # the pair's plan's best single device: where it is cpu:1, that row's measured step
    # beside it, and the two speedups
    assert rows[0]["plan_single"] == "cpu:1" and "single_ratio" not in rows[0]
    assert rows[1]["plan_single"] in ("cpu:1", "numpy")
    if rows[1]["plan_single"] == "cpu:1":
        assert rows[1]["single_ratio"] == pytest.approx(
            rows[1]["plan_single_s"] / rows[0]["step_s"])
        assert rows[1]["measured_speedup"] == pytest.approx(rows[0]["step_s"] / rows[1]["step_s"])
        assert rows[1]["plan_speedup"] == pytest.approx(
            rows[1]["plan_single_s"] / rows[1]["plan_step_s"])
        assert "plan speedup" in out


def test_bench_plan_names_the_plans_best_single_device_by_its_entry():
    """The plan's best single device is named by its --devices entry, without its rank (the
    devices in rank order), to be found among the run's configurations; rows whose best single
    device is a row of the same batch get that row's step and both speedups."""
    plan = bench_module("plan")
    two = [{"name": "d0"}, {"name": "d1"}]
    assert plan.single_entry("cpu:1,cpu:1@0.5", {"best_single": {"device": "d0"},
                                                 "devices": two}) == "cpu:1"
    assert plan.single_entry("1/cpu:1@0.5,0/cpu:2", {"best_single": {"device": "d0"},
                                                     "devices": two}) == "cpu:2"
    assert plan.single_entry("cpu:1", {"best_single": None, "devices": two[:1]}) is None
    assert plan.single_entry("cpu:1", {"best_single": {"device": "d0"}, "devices": two}) is None
    rows = [{"devices": "cpu:1", "batch_size": 16, "step_s": 4.0, "plan_step_s": 4.1,
             "plan_single": "cpu:1", "plan_single_s": 4.1},
            {"devices": "cpu:1,cpu:1", "batch_size": 16, "step_s": 2.0, "plan_step_s": 2.2,
             "plan_single": "cpu:1", "plan_single_s": 4.4},
            {"devices": "cpu:1,cpu:1", "batch_size": 32, "step_s": 4.0, "plan_step_s": 4.2,
             "plan_single": "cpu:1", "plan_single_s": 8.4}]
    plan.with_singles(rows)
    assert "single_ratio" not in rows[0] and "single_ratio" not in rows[2]
    assert rows[1]["single_ratio"] == pytest.approx(1.1)
    assert rows[1]["plan_speedup"] == pytest.approx(2.0)
    assert rows[1]["measured_speedup"] == pytest.approx(2.0)


def test_bench_plan_runs_a_spec_of_ranks_under_mpiexec(tmp_path, capsys, monkeypatch):
    """A configuration that places devices on ranks runs its plan and its training run under
    mpiexec (the plan then measures rank 1's link); without MPI, a clear usage error."""
    _util = bench_module("_util")
    why = _util.missing_mpi()
    with monkeypatch.context() as m:
        m.setattr(_util, "missing_mpi", lambda: why or "there is no mpiexec (say)")
        with pytest.raises(SystemExit) as e:
            main(["bench", "plan", "--configs", "cpu:1;0/cpu:1,1/cpu:1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "places devices on MPI ranks, but there is no" in err, err
    if why:
        return
    run(capsys, "plan", "--configs", "0/cpu:1,1/cpu:1", "--batch-sizes", "2", "--kernels",
        "4,6", "--steps", "2", "--json", str(tmp_path / "p.json"))
    (row,) = json.loads((tmp_path / "p.json").read_text())["rows"]
    (x,) = row["rounds"]
    assert [d.get("link_measured", False) for d in x["plan"]["devices"]] == [False, True]
    assert x["run"]["links"]["1"]["latency_s"] > 0     # the run's rank 1, over MPI
    assert sum(row["plan_partition"].values()) == sum(row["partition"].values()) == 6
    # a network by --arch: the plan and the training run both take it
    out = run(capsys, "plan", "--configs", "cpu:1", "--batch-sizes", "2", "--arch",
              "3C3-P2-16N", "--steps", "2", "--json", str(tmp_path / "a.json"))
    r = json.loads((tmp_path / "a.json").read_text())
    assert r["arch"] == "3C3-P2-16N" and r["rows"][0]["partition"] == {"d0": 3}
    assert r["rows"][0]["plan_partition"] == {"d0": 3} and "3C3-P2-16N" in out
    for bad in (["--configs", "cpu:x"], ["--rounds", "0"], ["--arch", "3C3-Q"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "plan", *bad])
        assert e.value.code == 2
