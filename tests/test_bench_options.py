"""The benchmarks' options and outputs checked before any work: a bad value, a --json or --plot
that cannot be written, a --bandwidth-json that cannot be read, a missing matplotlib are usage
errors (exit status 2, one line, nothing run); a run of pyhet in a process that fails ends the
benchmark with one line naming it (exit status 1), never a traceback."""

import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from pyhet.cli import main
from pyhet.errors import PyhetError


def bench(name):
    """The benchmark module `pyhet bench NAME` runs."""
    try:
        return importlib.import_module(f"pyhet.bench.{name}")
    except ImportError:
        return importlib.import_module(f"bench.{name}")


@pytest.fixture(autouse=True)
def never_set_up_links_or_cgroups(monkeypatch):
    """bench bandwidth and bench ranks are only given options they refuse here; were one
    taken, they say they are skipped instead of setting up namespaces and cgroups as root."""
    for name in ("bandwidth", "ranks"):
        monkeypatch.setattr(bench(name), "missing_tools", lambda: "not in these tests")


def refused(capsys, *argv):
    """The one line a benchmark's usage error writes, after checking it exited with status 2
    before any work (nothing on stdout)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, says", [
    (["--shapes", ""], "expected at least one shape"),
    (["--shapes", ","], "expected at least one shape"),
    (["--shapes", "1_0x8x8"], "expected a shape like"),
    (["--shapes", "\uff18x8x8"], "expected a shape like"),      # a fullwidth 8
    (["--seed", "-1"], "expected a value >= 0"),
    (["--pause", "inf"], "expected a finite number"),
    (["--pause", "nan"], "expected a finite number"),
    (["--pause", "1e300"], "at most 3600"),
    (["--plain-max-gflop", "nan"], "expected a finite number"),
    (["--plain-max-gflop", "inf"], "expected a finite number"),
    (["--threads", "5000"], "each from 1 to 1024"),
    (["--threads", "1_0"], "expected thread counts"),
])
def test_gemm_refuses_bad_options(capsys, argv, says):
    assert says in refused(capsys, "gemm", "--shapes", "8x8x8", "--threads", "1", "--repeat", "1",
                           "--pause", "0", *argv)


def test_step_threads_within_the_cores_limit(capsys):
    from pyhet import ops

    assert f"at most {ops.MAX_THREADS}" in refused(capsys, "step", "--kernels", "4,6",
                                                   "--steps", "1", "--rounds", "1",
                                                   "--threads", str(ops.MAX_THREADS + 1))


def test_scaling_device_counts_within_the_cores_limit(capsys):
    assert "at most 1024" in refused(capsys, "scaling", "--cpu-devices", "1,100000")


def test_plan_refuses_kernels_beside_arch(capsys):
    err = refused(capsys, "plan", "--configs", "cpu:1", "--batch-sizes", "2", "--steps", "2",
                  "--kernels", "2,2", "--arch", "2C5-P2")
    assert "--arch describes the whole network" in err
    args = bench("plan").parse_args(["--arch", "2C5-P2"])
    assert args.kernels is None and args.arch == "2C5-P2"
    assert bench("plan").parse_args([]).kernels == "500,1500"


@pytest.mark.parametrize("name", ["bandwidth", "ranks", "plan", "pair", "paper"])
def test_the_first_step_warms_up_everywhere(capsys, name):
    """Options only: bandwidth and ranks are never run here (they set up namespaces and
    cgroups as root)."""
    assert "expected at least 2 (the first warms up)" in refused(capsys, name, "--steps", "1")


def test_scaling_quick_keeps_explicit_kernels():
    scaling = bench("scaling")
    assert scaling.parse_args(["--quick", "--kernels", "2,2"]).kernels == (2, 2)
    assert scaling.parse_args(["--quick"]).kernels == (64, 128)
    assert scaling.parse_args([]).kernels == (500, 1500)
    # the usage line gives the default of --steps
    assert f"[--steps {scaling.parse_args([]).steps}]" in scaling.__doc__


# ------------------------------------------------------------------------------------------------
# --json and --plot: checked before the work


@pytest.mark.parametrize("name", ["gemm", "step", "scaling", "plan", "pair", "paper",
                                  "bandwidth", "ranks"])
def test_json_destination_checked_first(capsys, tmp_path, name):
    (tmp_path / "file").write_text("")
    err = refused(capsys, name, "--json", str(tmp_path / "file" / "x.json"))
    assert "argument --json" in err and "not a folder" in err
    assert "a folder, not a file" in refused(capsys, name, "--json", str(tmp_path))
    assert "give a file name" in refused(capsys, name, "--json", "")
    # a name too long for the folder (255 bytes at most): refused, not found after the run
    assert "cannot take a new file" in refused(capsys, name, "--json",
                                               str(tmp_path / ("a" * 300 + ".json")))


def test_json_destination_in_a_folder_that_takes_no_file(capsys):
    """/proc: os.access says yes to root, the file cannot be made all the same."""
    err = refused(capsys, "step", "--json", "/proc/nope/x.json")
    assert "the folder /proc cannot take a new file" in err


def test_a_json_write_that_is_interrupted_leaves_the_file_before_it_whole(tmp_path,
                                                                          monkeypatch):
    """Results written over an earlier file, interrupted half way: the earlier file was left
    cut short; it stays whole, and no temporary file is left."""
    util = bench("_util")
    out = tmp_path / "r.json"
    util.write_json(str(out), {"run": 1})
    real_dump = json.dump

    def cut(data, f, **kw):
        f.write('{"run": ')
        f.flush()
        raise KeyboardInterrupt
    monkeypatch.setattr(json, "dump", cut)
    with pytest.raises(KeyboardInterrupt):
        util.write_json(str(out), {"run": 2})
    monkeypatch.setattr(json, "dump", real_dump)
    assert json.loads(out.read_text()) == {"run": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    util.write_json(str(out), {"run": 3})
    assert json.loads(out.read_text()) == {"run": 3} and len(list(tmp_path.iterdir())) == 1


def test_a_json_of_the_longest_name_and_its_permissions(tmp_path):
    """A --json name of 255 bytes (the most a name may have) is written, not refused for its
    temporary name; a file written over keeps its permissions."""
    util = bench("_util")
    out = tmp_path / ("\u00e9" * 120 + "r" * 10 + ".json")     # 255 bytes, é two each
    assert len(os.fsencode(out.name)) == 255
    util.write_json(str(out), {"run": 1})
    os.chmod(out, 0o640)
    util.write_json(str(out), {"run": 2})
    assert json.loads(out.read_text()) == {"run": 2}
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_a_json_that_cannot_be_written_after_the_run_is_kept(tmp_path):
    util = bench("_util")
    (tmp_path / "file").write_text("")
    data = {"benchmark": "test", "results": [1.5]}
    with pytest.raises(SystemExit) as e:
        util.write_json(str(tmp_path / "file" / "x.json"), data)
    message = str(e.value.code)
    assert message.startswith("pyhet: error: cannot write the JSON file")
    kept = message.split("the results are in ")[1]
    try:
        with open(kept) as f:
            assert json.load(f) == data
    finally:
        os.unlink(kept)


@pytest.mark.parametrize("name", ["scaling", "bandwidth", "ranks"])
def test_plot_file_checked_first(capsys, tmp_path, name):
    pytest.importorskip("matplotlib")
    err = refused(capsys, name, "--plot", str(tmp_path))
    assert "it names a folder; give a file name" in err
    err = refused(capsys, name, "--plot", str(tmp_path / "new") + os.sep)
    assert "it names a folder; give a file name" in err
    assert "expected a file name ending in .png" in refused(capsys, name, "--plot",
                                                            str(tmp_path / "x.jpg"))
    assert "cannot take a new file" in refused(capsys, name, "--plot", "/proc/nope/x.png")
    assert "give a file name" in refused(capsys, name, "--plot", "")


def test_plot_without_a_suffix_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    scaling = bench("scaling")
    assert scaling.parse_args(["--plot", str(tmp_path / "p")]).plot == str(tmp_path / "p.png")
    assert scaling.parse_args(["--plot", str(tmp_path / "p.svg")]).plot == str(
        tmp_path / "p.svg")


def test_save_plot_writes_the_file_it_names(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    util = bench("_util")
    plt = util.pyplot()
    util.save_plot(plt.figure(), str(tmp_path / "sub" / "p.png"), dpi=20)
    assert (tmp_path / "sub" / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out == f"plot written to {tmp_path / 'sub' / 'p.png'}\n"
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        util.save_plot(plt.figure(), str(tmp_path / "file" / "p.png"), dpi=20)
    assert str(e.value.code).startswith("pyhet: error: cannot write the plot")


def test_paper_plot_folder_checked_first(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("")
    assert "it is a file, not a folder" in refused(capsys, "paper", "--plot",
                                                    str(tmp_path / "file"))
    assert "cannot take a new file" in refused(capsys, "paper", "--plot", "/proc/nope")
    # a plot's file name, which other benchmarks take, is not made a folder of that name
    err = refused(capsys, "paper", "--plot", str(tmp_path / "x.png"))
    assert "not a file name" in err and f"--plot {tmp_path / 'x'}" in err, err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv", [["scaling", "--plot", "x.png"], ["paper", "--plot", "d"]])
def test_plot_without_matplotlib_is_refused_first(tmp_path, argv):
    """A matplotlib that cannot be imported (a stand-in first on the path) stops the benchmark
    before its run, which could not draw the plot."""
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    p = subprocess.run([sys.executable, "-m", "pyhet", "bench", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert "pip install matplotlib" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


# ------------------------------------------------------------------------------------------------
# --bandwidth-json: read before the work


def bandwidth_json(tmp_path, text):
    path = tmp_path / "bw.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, says", [
    ("{", "not JSON"),
    ("[]", "an object was expected"),
    ('{"rates": []}', "it has no 'alone_step_s'"),
    ('{"rates": [], "alone_step_s": 0}', "'alone_step_s' must be a time > 0"),
    ('{"rates": [], "alone_step_s": NaN}', "'alone_step_s' must be a time > 0"),
    ('{"rates": [1], "alone_step_s": 1}', "'rates' must be a list of objects"),
    ('{"rates": [{"rate": "1gbit", "step_s": "x"}], "alone_step_s": 1}', "'step_s' must be"),
    ('{"rates": [{"step_s": 1}], "alone_step_s": 1}', "'rate' must be a string"),
    ('{"rates": [{"rate": "1gbit", "partition": 3}], "alone_step_s": 1}', "'partition' must"),
])
def test_paper_bandwidth_json_checked_first(capsys, tmp_path, text, says):
    err = refused(capsys, "paper", "--quick", "--bandwidth-json", bandwidth_json(tmp_path, text))
    assert "argument --bandwidth-json" in err and says in err


def test_paper_bandwidth_json_that_cannot_be_read(capsys, tmp_path):
    err = refused(capsys, "paper", "--bandwidth-json", str(tmp_path / "missing.json"))
    assert "cannot read it: No such file or directory" in err
    err = refused(capsys, "paper", "--bandwidth-json", str(tmp_path))
    assert "it is a folder, not a regular file" in err
    os.mkfifo(tmp_path / "fifo")            # never waited on
    assert "it is a FIFO" in refused(capsys, "paper", "--bandwidth-json", str(tmp_path / "fifo"))


def test_paper_bandwidth_json_of_a_bandwidth_run_is_taken():
    paper = bench("paper")
    data = {"alone_step_s": 0.2, "rates": [
        {"rate": "100mbit", "measured_bits_per_s": 9.5e7, "step_s": 0.4,
         "partition": {"conv2": {"d0": 5, "d1": 3}}},
        {"rate": "none", "measured_bits_per_s": None, "step_s": None, "partition": None}]}
    assert paper.bandwidth_json_problem(data) is None


# ------------------------------------------------------------------------------------------------
# Runs in processes that fail


def test_run_json_names_the_failed_run():
    util = bench("_util")
    fail = [sys.executable, "-c", "import sys; print('progress', file=sys.stderr); "
            "sys.exit('pyhet: error: no such device')", "-m", "pyhet", "train", "--devices",
            "gpu:7", "--json"]
    with pytest.raises(PyhetError) as e:
        util.run_json(fail, 60, None)
    assert str(e.value) == ("pyhet train --devices gpu:7 ... failed (exit status 1): "
                            "no such device")
    with pytest.raises(PyhetError) as e:
        util.run_json([sys.executable, "-c", "import time; time.sleep(30)"], 0.5, None)
    assert "ran past --timeout (0.5 s)" in str(e.value)
    with pytest.raises(PyhetError) as e:
        util.run_json([sys.executable, "-c", "print('not json')"], 60, None)
    assert "printed no JSON summary last: got 'not json'" in str(e.value)


def test_plan_whose_run_fails_says_why_in_one_line(capsys):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: gpu:0 may run here")
    assert main(["bench", "plan", "--configs", "gpu:0", "--batch-sizes", "2", "--kernels",
                 "4,6", "--steps", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pyhet: error: pyhet plan --devices gpu:0 ... failed (exit status 1):")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_plan_keeps_what_it_measured_before_a_run_failed(capsys, tmp_path):
    """cpu:1 is measured, then gpu:0 fails (no CuPy): the cpu:1 row is in --json, with the
    error, and the error line says where."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: gpu:0 may run here")
    out = tmp_path / "p.json"
    assert main(["bench", "plan", "--configs", "cpu:1;gpu:0", "--batch-sizes", "2",
                 "--kernels", "4,6", "--steps", "2", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"what was measured before it is in {out}" in err and len(err.splitlines()) == 1
    kept = json.loads(out.read_text())
    assert [r["devices"] for r in kept["rows"]] == ["cpu:1"] and "gpu" in kept["error"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_plan_keeps_what_it_measured_before_it_was_interrupted(capsys, tmp_path, monkeypatch,
                                                               signum):
    """Ctrl-C, or a time limit's SIGTERM, after the first row: that row is in --json (the
    whole file was lost), and the line says where."""
    from pyhet.errors import Interrupted

    plan = bench("plan")
    measured = []

    def measure(spec, batch, args, cwd):
        if measured:
            raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted(signum)
        measured.append(spec)
        return {"plan_step_s": 1.0, "step_s": 1.0, "train_model_step_s": None,
                "plan_conv_s": 0.9, "plan_master_s": 0.1, "conv_s": 0.9, "layer": "conv2",
                "plan_partition": {"conv2": 8}, "partition": {"conv2": 8},
                "plan_single": spec, "plan_single_s": 1.0}
    monkeypatch.setattr(plan, "measure", measure)
    out = tmp_path / "p.json"
    assert main(["bench", "plan", "--configs", "cpu:1;cpu:2", "--batch-sizes", "2",
                 "--kernels", "4,6", "--steps", "2", "--json", str(out)]) == 128 + signum
    err = capsys.readouterr().err
    assert err == (f"pyhet: interrupted by {signal.Signals(signum).name} (what was measured "
                   f"before it is in {out})\n"), err
    kept = json.loads(out.read_text())
    assert [r["devices"] for r in kept["rows"]] == ["cpu:1"]
    assert kept["error"] == f"interrupted by {signal.Signals(signum).name}"


def test_pair_whose_run_fails_says_why_in_one_line(capsys, tmp_path):
    assert main(["bench", "pair", "--configs", "cpu:1;cpu:1,gpu:99", "--steps", "2",
                 "--rounds", "1", "--batch-size", "2", "--arch", "2C3-P2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pyhet: error: pyhet train --devices cpu:1,gpu:99 ... failed (exit "
                          "status 1): "), err
    assert "gpu" in err and len(err.strip().splitlines()) == 1


def test_pair_checks_its_dataset_before_any_work(capsys, tmp_path):
    """A dataset file it cannot read was found by its first run, after the system's header."""
    err = refused(capsys, "pair", "--dataset", f"npz:{tmp_path / 'none.npz'}", "--steps", "2",
                  "--rounds", "1")
    assert "argument --dataset" in err and "none.npz" in err, err


def test_step_whose_worker_fails_says_why_in_one_line(capsys, tmp_path, monkeypatch):
    """A worker that ends with a traceback: its last line, not the traceback."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                      "echo 'RuntimeError: the worker broke' >&2\nexit 1\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    assert main(["bench", "step", "--kernels", "4,6", "--steps", "1", "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert err == ("pyhet: error: the pyhet worker (its steps in a process of their own) failed "
                   "(exit status 1): RuntimeError: the worker broke\n")


@pytest.mark.parametrize("argv, option", [
    (["bandwidth", "--kernels", "0,1"], "--kernels"),
    (["bandwidth", "--rates", "foo"], "--rates"),
    (["ranks", "--kernels", "0,1"], "--kernels"),
    (["plan", "--batch-sizes", "0"], "--batch-sizes"),
    (["plan", "--kernels", "0,1"], "--kernels"),
    (["plan", "--configs", "tpu"], "--configs"),
    (["pair", "--configs", "cpu:1;bogus"], "--configs"),
])
def test_a_bad_value_names_its_option(capsys, argv, option):
    """(They said what was wrong, not where: "kernel counts must be >= 1, got '0,1'".)"""
    assert f"argument {option}: " in refused(capsys, *argv)


@pytest.mark.parametrize("argv, says", [
    # tc refused these after the first run, in a traceback
    (["bandwidth", "--rates", "1_000mbit"], "like 100mbit"),
    (["bandwidth", "--rates", "1e12gbit"], "like 100mbit"),
    (["bandwidth", "--rates", "0.0001kbit"], "from 1kbit to 1000gbit"),
    (["bandwidth", "--rates", "2000gbit"], "from 1kbit to 1000gbit"),
    (["ranks", "--quotas", "\u0661"], "fractions such as 0.5"),     # an Arabic-Indic 1
    # past what Python's clocks take (an OverflowError's traceback after the first run)
    (["bandwidth", "--timeout", "1e10"], "--timeout"),
    (["ranks", "--timeout", "1e10"], "--timeout"),
    (["plan", "--timeout", "1e10"], "--timeout"),
    (["pair", "--timeout", "1e10"], "--timeout"),
])
def test_values_the_tools_would_refuse_are_refused_first(capsys, argv, says):
    assert says in refused(capsys, *argv)


def test_a_rate_in_range_is_taken():
    rate_bits = bench("bandwidth").rate_bits
    assert [rate_bits(r) for r in ("1kbit", "1.5mbit", "1000gbit", "none")] == [
        1e3, 1.5e6, 1e12, None]


def test_a_child_that_ends_its_process_group_leaves_the_benchmark_running(tmp_path):
    """mpiexec ends its job's process group with SIGTERM when a rank fails: that reached the
    benchmark, which said "interrupted" instead of the rank's error."""
    # (in a process of its own, in a group of its own: where the child's SIGTERM reached its
    # group, it would end these tests)
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('u', {bench('_util').__file__!r})\n"
            "util = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(util)\n"
            "try:\n"
            "    util.run_json([sys.executable, '-c', 'import os, signal; "
            "os.killpg(0, signal.SIGTERM)'], 60, None, own_group=True)\n"
            "except Exception as e:\n"
            "    print('said:', e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, start_new_session=True, cwd=tmp_path)   # not the source
    assert p.returncode == 0 and "said:" in p.stdout and "killed by SIGTERM" in p.stdout, (
        p.returncode, p.stdout, p.stderr)


def test_an_interrupted_benchmark_asks_its_child_to_stop_and_reaps_it(tmp_path):
    """Ctrl-C (or SIGTERM) while a run is under way: the child gets SIGTERM, so that it ends
    as it would be asked to (mpiexec removes its files; killing it at once left them), and is
    reaped (it was killed after 0.25 s and left running, with a warning)."""
    util = bench("_util")
    marker = tmp_path / "stopped"
    child = ("import signal, sys, time\n"
             "def stop(*_):\n"
             f"    open({str(marker)!r}, 'w').close()\n"
             "    sys.exit(143)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             "print('ready', flush=True)\n"
             "time.sleep(60)\n")

    def interrupt(*_):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 3.0)   # (the child's handler in place: about 50 ms)
    try:
        with pytest.raises(KeyboardInterrupt):
            util.run_json([sys.executable, "-c", child], 60, None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert marker.exists()


def test_what_a_killed_run_left_is_named_not_deleted(capsys):
    util = bench("_util")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f"pyhet-bw{dead.pid}-abc123-0", f"pyhet-bw{os.getpid()}-abc123-0", "pyhet-bwx-0",
             f"other{dead.pid}-0"]
    left = util.left_behind(names, "pyhet-bw")
    assert left == [f"pyhet-bw{dead.pid}-abc123-0"]
    util.note_left_behind("bandwidth", "network namespaces", left, "ip netns del NAME")
    err = capsys.readouterr().err
    assert err == (f"pyhet bench bandwidth: note: network namespaces of earlier runs that were "
                   f"killed are left: {left[0]} (remove them with: ip netns del NAME)\n")


def test_a_link_whose_name_is_taken_deletes_nothing_it_did_not_make(monkeypatch):
    """A namespace of the same name (a pid come round again after a killed run): the set-up
    failed in a traceback and deleted it, and its twin."""
    bandwidth = bench("bandwidth")
    util = bench("_util")
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and ip")
    monkeypatch.setattr(util, "unique_tag", lambda: "ee0001")
    taken = f"pyhet-bw{os.getpid()}-ee0001-1"     # the second of the pair
    subprocess.run(["ip", "netns", "add", taken], check=True)
    try:
        with pytest.raises(PyhetError) as e:
            bandwidth.Link()
        assert f"ip netns add {taken} failed" in str(e.value)
        assert "\n" not in str(e.value)
        names = util.namespaces()
        assert taken in names and f"pyhet-bw{os.getpid()}-ee0001-0" not in names
    finally:
        subprocess.run(["ip", "netns", "del", taken])


def test_an_mpi_job_past_its_time_is_killed_with_everything_it_started(tmp_path,
                                                                        monkeypatch):
    """A job in a group of its own whose children ignore SIGTERM (a rank stuck in a call):
    after the grace, the whole group is killed, not only the job's first process."""
    util = bench("_util")
    real = util.stop_child
    monkeypatch.setattr(util, "stop_child", lambda p, **kw: real(p, grace=0.5, **kw))
    job = ("trap '' TERM; sh -c \"trap '' TERM; sleep 30\" & echo $$ > pgid; wait; "
           "sleep 30")
    t0 = time.monotonic()
    with pytest.raises(PyhetError, match="ran past --timeout"):
        util.run_json(["sh", "-c", job], 1.0, str(tmp_path), own_group=True, what="the job")
    assert time.monotonic() - t0 < 20
    pgid = int((tmp_path / "pgid").read_text())
    for _ in range(50):        # the kernel may take a moment to reap the last of the group
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process group {pgid} outlived the job")


def test_a_quota_that_cannot_be_made_is_one_line(monkeypatch, tmp_path):
    ranks = bench("ranks")
    monkeypatch.setattr(ranks, "CGROUP_CPU", tmp_path / "no" / "cgroup")
    with pytest.raises(PyhetError, match=r"^cannot make the cgroup .*no/cgroup/pyhet-bench-"):
        ranks.Quota(0.5)


def test_a_quota_the_kernel_refuses_is_one_line_and_leaves_no_cgroup(monkeypatch, tmp_path):
    ranks = bench("ranks")
    monkeypatch.setattr(ranks, "CGROUP_CPU", tmp_path)

    def refused(self, text, *args, **kwargs):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(ranks.Path, "write_text", refused)
    with pytest.raises(PyhetError, match=r"^cannot set the CPU quota of .*pyhet-bench-.* \(5000 "
                                         r"us in 10000 us\): Invalid argument$"):
        ranks.Quota(0.5)
    assert list(tmp_path.iterdir()) == []


def test_a_quota_that_still_holds_processes_is_named(monkeypatch, tmp_path, capsys):
    """A cgroup that cannot be removed (its processes not yet gone after 5 s) is left and
    named with the command that removes it."""
    ranks = bench("ranks")
    monkeypatch.setattr(ranks, "CGROUP_CPU", tmp_path)
    monkeypatch.setattr(ranks.time, "sleep", lambda s: None)
    q = ranks.Quota.__new__(ranks.Quota)
    q.path = tmp_path / "pyhet-bench-1-abc-500"
    q.path.mkdir()
    (q.path / "cgroup.procs").write_text("")      # a folder that is not empty: rmdir fails
    q.close()
    err = capsys.readouterr().err
    assert f"the cgroup {q.path} still holds processes" in err
    assert f"rmdir {q.path}" in err and q.path.exists()


def test_a_namespace_whose_set_up_fails_is_removed(monkeypatch):
    ranks = bench("ranks")
    calls = []

    def sh(*argv, check=True):
        calls.append(argv)
        if argv[:2] == ("ip", "-n"):
            raise PyhetError("ip -n NAME link set lo up failed: no such device")
    monkeypatch.setattr(ranks._util, "sh", sh)
    with pytest.raises(PyhetError, match="link set lo up failed"):
        ranks.Namespace()
    assert calls[0][:3] == ("ip", "netns", "add")
    assert calls[-1] == ("ip", "netns", "del", calls[0][3])


@pytest.mark.parametrize("after", ["netns", "link"])
def test_a_link_interrupted_as_its_command_returns_leaves_nothing(monkeypatch, after):
    """Ctrl-C just after `ip netns add` or `ip link add` made its part, before the part was
    recorded: the part was left (a veth pair in this machine's namespace)."""
    bandwidth = bench("bandwidth")
    util = bench("_util")
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and ip")
    real = bandwidth.sh

    def sh(*argv, **kw):
        real(*argv, **kw)
        if argv[1:3] == (after, "add"):
            raise KeyboardInterrupt
    monkeypatch.setattr(bandwidth, "sh", sh)
    monkeypatch.setattr(util, "unique_tag", lambda: "ee0002")
    with pytest.raises(KeyboardInterrupt):
        bandwidth.Link()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "pbwee0002" not in links
    assert not [n for n in util.namespaces() if "-ee0002-" in n]


@pytest.mark.parametrize("argv, says", [
    (["--batch-sizes", "8,,16"], "without empty entries, got '8,,16'"),
    (["--batch-sizes", ""], "expected at least one batch size"),
    (["--kernels-list", ""], "expected at least one A,B"),
    (["--kernels-list", "/"], "expected at least one A,B"),
    (["--kernels-list", "8,16//4,8"], "without empty entries"),
])
def test_paper_lists_without_empty_entries(capsys, argv, says):
    """8,,16 was taken as 8,16; an empty list said "expected one argument, got '--'"."""
    err = refused(capsys, "paper", *argv)
    assert says in err and f"argument {argv[0]}: " in err, err


@pytest.mark.parametrize("argv", [["step", "--kernels", "200000,200000"],
                                  ["scaling", "--quick", "--kernels", "200000,200000"],
                                  ["paper", "--quick", "--network", "200000,200000"],
                                  ["paper", "--quick", "--kernels-list", "8,16/200000,200000"]])
def test_a_network_too_large_for_memory_is_refused_before_any_work(capsys, argv):
    """As pyhet train refuses it: one line naming the sizes, exit status 1, nothing measured
    (they printed the system's header and ran into NumPy's MemoryError or a traceback)."""
    assert main(["bench", *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert "200000C5-P2-200000C5-P2" in err and "GiB" in err and "available" in err


def _shown(value, option) -> str:
    """A default as the options are written: 500,1500; 50,150/100,300; 0.5,0.25; 8 to 256;
    cpu:2;cpu:1,cpu:1."""
    if option == "--configs":
        return ";".join(value)
    if isinstance(value, (tuple, list)):
        if option == "--batch-sizes" and len(value) > 2:
            return f"{value[0]} to {value[-1]}"
        return ("/" if value and isinstance(value[0], (tuple, list)) else ",").join(
            _shown(v, None) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


@pytest.mark.parametrize("name", list(__import__("pyhet.cli").cli.BENCHMARKS))
def test_every_option_with_a_default_says_it_in_help(capsys, name):
    """`pyhet bench step --help` listed --batch-size, --rounds and --threads without their
    defaults (README gave them; pyhet train --help gives its own)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out.split("options:", 1)[1]
    blocks = {}
    for block in re.split(r"\n(?=  -)", text):
        m = re.match(r"\s*(?:-\w, )?(--[\w-]+)", block)
        if m:
            blocks[m.group(1)] = " ".join(block.split())
    module = bench(name)
    defaults = vars(module.parse_args([]) if hasattr(module, "parse_args") else
                    module.make_parser().parse_args([]))
    checked = 0
    for option, block in blocks.items():
        value = defaults.get(option[2:].replace("-", "_"))
        if value in (None, False, [], "") or option == "--help":
            continue
        checked += 1
        assert re.search(rf"\(default:? .*{re.escape(_shown(value, option))}", block.replace(
            "'", "")), (option, value, block)
    assert checked >= 3, blocks


@pytest.mark.parametrize("name, argv, says", [
    ("pair", ["--configs", "cpu:1;cpu:1"], "--configs: cpu:1 is given twice"),
    ("plan", ["--configs", "cpu:1; cpu:2 ;cpu:2"], "--configs: cpu:2 is given twice"),
    ("gemm", ["--kernels", "portable,portable"], "--kernels: portable is given twice"),
    ("gemm", ["--threads", "1,1"], "--threads: 1 is given twice"),
    ("gemm", ["--shapes", "8x8x8,9x9x9,8x8x8:nn"], "--shapes: 8x8x8 is given twice"),
    ("scaling", ["--cpu-devices", "2,1,2"], "--cpu-devices: 2 is given twice"),
    ("paper", ["--batch-sizes", "8,8"], "--batch-sizes: 8 is given twice"),
    ("paper", ["--kernels-list", "4,8/4,8"], "--kernels-list: 4,8 is given twice"),
    ("ranks", ["--quotas", "0.5,0.50"], "--quotas: 0.5 is given twice"),
    ("bandwidth", ["--rates", "1gbit,none,1gbit"], "--rates: 1gbit is given twice")])
def test_a_list_option_naming_one_value_twice_is_refused(capsys, name, argv, says):
    """bench pair filed both runs of --configs "cpu:1;cpu:1" under one key: its ratios were a
    list over itself (1.000, four for two rounds); bench plan's row held both runs."""
    assert says in refused(capsys, name, *argv)
