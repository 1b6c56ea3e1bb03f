"""Devices on other MPI ranks: `mpiexec -n R pyhet train` on localhost gives the one-process
weights, for placements with a rank of two devices, a rank of none and a master of none; a
--save from an MPI run is an ordinary weight file; placement errors are clear. Skipped where
mpi4py or mpiexec is missing (pip install ".[mpi]").

Tolerance: each weight within 1e-4 of its largest entry (the input gradient of a remote device
is summed in another order).
"""

import json
import re
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import load_npz, make_npz_dataset, pmi_launcher, private_mpi_job
from pyhet.arch import build

pytest.importorskip("mpi4py", reason="pip install '.[mpi]' for the MPI tests")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
    "mpiexec")
if MPIEXEC is None:
    pytest.skip("no mpiexec (pip install '.[mpi]' brings MPICH's)", allow_module_level=True)

ARCH = "4C3p1-P2-5C3s2-6C2-6N"   # 1x12x12: 12 -> P2 6 -> s2 2 -> 1 (no pool) -> 6 -> 3 classes
STEPS = 3


def run(argv, ranks, cwd, timeout=180, **env_extra):
    """`pyhet argv` in a process (ranks None), or in `ranks` processes under mpiexec, in the
    folder cwd (not the source tree, whose pyhet/ has no built core); (status, out, err)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "pyhet", *map(str, argv)]
    if ranks:
        cmd = private_mpi_job([MPIEXEC, "-n", str(ranks), *cmd], cwd)
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("mpi") / "d.npz"
    make_npz_dataset(path, n=40, shape=(1, 12, 12), classes=3, n_test=9, seed=4)
    return path


def train_argv(data, devices, out, *extra):
    return ["train", "--dataset", f"npz:{data}", "--arch", ARCH, "--devices", devices,
            "--balance", "even", "--steps", STEPS, "--batch-size", 8, "--lr", 0.05,
            "--momentum", 0.9, "--weight-decay", 1e-3, "--save", out, "--quiet", "--json", *extra]


def weights(path):
    return {k: v for k, v in load_npz(path).items() if k != "arch"}


@pytest.mark.parametrize("ranks,placement,one_process", [
    (2, "0/cpu:1,1/cpu:1", "cpu:1,cpu:1"),
    (2, "cpu:1", "cpu:1,cpu:1"),                              # unprefixed: one on every rank
    (2, "0/cpu:1,1/cpu:1,1/numpy", "cpu:1,cpu:1,numpy"),      # a rank with two devices
    (2, "0/cpu:1,1/cpu:1,1/cpu:1", "cpu:1,cpu:1,cpu:1"),      # a group on rank 1
    (2, "1/cpu:1,1/numpy,1/cpu:1", "cpu:1,numpy,cpu:1"),      # ... around another device
    (3, "0/cpu:1,2/cpu:1", "cpu:1,cpu:1"),                    # rank 1 holds none
    (2, "1/cpu:1,1/numpy", "cpu:1,numpy"),                    # the master holds none
])
def test_mpi_run_gives_the_one_process_weights(tmp_path, data, ranks, placement, one_process):
    code, out, err = run(train_argv(data, one_process, tmp_path / "one.npz"), None, tmp_path)
    assert code == 0, err
    code, out, err = run(train_argv(data, placement, tmp_path / "mpi.npz"), ranks, tmp_path)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert len(out.strip().splitlines()) == 1               # only rank 0 prints
    want, got = weights(tmp_path / "one.npz"), weights(tmp_path / "mpi.npz")
    for k in want:
        err_k = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
        assert err_k < 1e-4, (k, err_k)
    ranks_of = [d["rank"] for d in summary["devices"]]
    assert ranks_of == sorted(ranks_of)                       # names follow rank order
    assert [d["name"] for d in summary["devices"]] == [f"d{i}" for i in range(len(ranks_of))]
    remote = {r for r in ranks_of if r}
    assert set(summary["links"]) == {str(r) for r in remote}
    for r in remote:                                          # activations travel every step
        link = summary["links"][str(r)]
        assert link["bytes_sent_per_step"] > 8 * 12 * 12 * 4
        assert link["message_bytes"] == 4 * 8 * 4 * 6 * 6    # the largest layer input
        bandwidth = link["bandwidth_bytes_per_s"]    # None: too fast to time on this message
        assert 0 < link["latency_s"] < 1 and (bandwidth is None or bandwidth > 1e6)
    assert summary["idle_ranks"] == ([1] if placement == "0/cpu:1,2/cpu:1" else [])


def _dynamic_as_one_process(tmp_path, data, placement: str) -> dict:
    """The summary of --balance dynamic over two ranks on `placement` (three cpu:1 devices, or
    slowed ones), after checking its weights against the one-process run's on cpu:1 x 3."""
    code, out, err = run(train_argv(data, "cpu:1,cpu:1,cpu:1", tmp_path / "one.npz"), None,
                         tmp_path)
    assert code == 0, err
    argv = train_argv(data, placement, tmp_path / "mpi.npz")
    argv[argv.index("even")] = "dynamic"
    code, out, err = run(argv, 2, tmp_path)
    assert code == 0, err
    want, got = weights(tmp_path / "one.npz"), weights(tmp_path / "mpi.npz")
    for k in want:
        assert np.abs(got[k] - want[k]).max() / np.abs(want[k]).max() < 1e-4, k
    return json.loads(out.strip().splitlines()[-1])


def test_dynamic_balancing_across_ranks_keeps_the_result(tmp_path, data):
    """--balance dynamic with a slow device on rank 1 (kernels may move between the ranks, with
    their weights and momentum): the one-process weights all the same."""
    summary = _dynamic_as_one_process(tmp_path, data, "0/cpu:1,1/cpu:1@0.3,1/cpu:1")
    for d in summary["devices"]:                          # compute and link apart
        row = summary["calibration"]["conv2"][d["name"]]
        assert ("link_fixed_s" in row) == (d["rank"] != 0)
        if d["rank"]:
            assert row["overhead_s"] >= row["link_fixed_s"] > 0
    assert summary["predicted_step_time_s"] > 0


def test_the_masters_devices_beside_a_rank_on_its_machine_keep_the_result(tmp_path, data):
    """Two devices of the master and one of a rank on the same machine, --balance dynamic:
    the master's devices time their contention with the rank's device idle too
    (local_contention in their calibration rows, not in the rank's), and whichever split the
    balancer takes, the weights are the one-process ones."""
    summary = _dynamic_as_one_process(tmp_path, data, "0/cpu:1,0/cpu:1,1/cpu:1")
    for layer, rows in summary["calibration"].items():
        assert 0 < rows["d0"]["local_contention"] <= rows["d0"]["contention"], layer
        assert "local_contention" not in rows["d2"], layer


def test_the_cpu_devices_of_a_rank_share_one_message(tmp_path, data):
    """Two cpu devices on rank 1 share their im2col and input gradient there: the layer input
    travels once for both, so the master sends less than to a cpu and a numpy device (each its
    own input), with the same partition."""
    sent = {}
    for placement in ("0/cpu:1,1/cpu:1,1/cpu:1", "0/cpu:1,1/cpu:1,1/numpy"):
        code, out, err = run(train_argv(data, placement, tmp_path / "w.npz"), 2, tmp_path)
        assert code == 0, err
        summary = json.loads(out.strip().splitlines()[-1])
        sent[placement] = summary["links"]["1"]["bytes_sent_per_step"]
    x_bytes = sum(4 * int(np.prod(g.x_shape(8))) for g in build(ARCH, (1, 12, 12), 3).blocks)
    # one layer input less per layer (less the group's small plan of who computes what)
    assert sent["0/cpu:1,1/cpu:1,1/numpy"] - sent["0/cpu:1,1/cpu:1,1/cpu:1"] >= 0.95 * x_bytes


@pytest.mark.parametrize("placement,fault", [
    ("0/cpu:1,1/cpu:1", "d1:update:2"),              # a device on rank 1, mid-update
    ("0/cpu:1,1/cpu:1,1/cpu:1", "d1:forward:2"),     # the first of rank 1's group
    ("0/cpu:1,1/cpu:1,1/cpu:1", "d0:backward:3"),    # the master's own device
])
def test_a_failed_device_on_any_rank_fails_over(tmp_path, data, placement, fault):
    """Its kernels move to the other devices from the state before the step (read back from
    its rank), the step is redone: the one-process weights all the same."""
    one = ",".join(["cpu:1"] * len(placement.split(",")))
    code, out, err = run(train_argv(data, one, tmp_path / "one.npz"), None, tmp_path)
    assert code == 0, err
    code, out, err = run(train_argv(data, placement, tmp_path / "mpi.npz"), 2, tmp_path,
                         PYHET_FAULT=fault)
    assert code == 0, err
    want, got = weights(tmp_path / "one.npz"), weights(tmp_path / "mpi.npz")
    for k in want:
        assert np.abs(got[k] - want[k]).max() / np.abs(want[k]).max() < 1e-4, k
    (event,) = json.loads(out.strip().splitlines()[-1])["failures"]
    assert event["device"] == fault.split(":")[0] and "warning" in err


@pytest.mark.parametrize("phase", ["im2col", "input_gradient"])
def test_a_fault_in_a_phase_a_rank_does_not_have_apart_is_refused(tmp_path, data, phase):
    """On its own rank a device's im2col and input gradient run inside the master's forward
    and backward requests, which are all a fault is checked at: it would never fire."""
    code, out, err = run(train_argv(data, "0/cpu:1,1/cpu:1,1/cpu:1", tmp_path / "w.npz"), 2,
                         tmp_path, timeout=60, PYHET_FAULT=f"d1:{phase}:2")
    assert code == 1 and not (tmp_path / "w.npz").exists(), err
    assert f"PYHET_FAULT: d1 is on rank 1, where {phase} is part of" in err, err


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_fault_on_a_ranks_second_cpu_device_in_its_group_request_is_refused(tmp_path, data,
                                                                             phase):
    """A rank's cpu devices go as one request through the first one's worker, where alone a
    fault is checked: d2's forward or backward fault never fired, and the run ended with 0."""
    code, out, err = run(train_argv(data, "0/cpu:1,1/cpu:1,1/cpu:1", tmp_path / "w.npz"), 2,
                         tmp_path, timeout=60, PYHET_FAULT=f"d2:{phase}:2")
    assert code == 1 and not (tmp_path / "w.npz").exists(), err
    assert f"PYHET_FAULT: d2 is on rank 1 with d1, whose request carries the {phase}" in err


def test_a_timeout_past_the_start_up_timer_is_none(tmp_path, data):
    """--timeout 1e10 gave an OverflowError traceback on every rank (the timer takes at most
    about 9.2e9 s); and the model's figures are null without a calibration (--balance even)."""
    code, out, err = run(train_argv(data, "0/cpu:1,1/cpu:1", tmp_path / "w.npz", "--timeout",
                                    "1e10"), 2, tmp_path, timeout=60)
    assert code == 0 and "Traceback" not in err, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["predicted_conv_time_s"] is None and summary["predicted_step_time_s"] is None


def test_a_save_from_mpi_is_an_ordinary_weight_file(tmp_path, data):
    code, out, err = run(train_argv(data, "0/cpu:1,1/cpu:1", tmp_path / "w.npz"), 2, tmp_path)
    assert code == 0, err
    accuracy = json.loads(out.strip().splitlines()[-1])["test_accuracy"]
    code, out, err = run(["evaluate", "--weights", tmp_path / "w.npz", "--dataset",
                          f"npz:{data}", "--devices", "cpu:1", "--batch-size", 8, "--json"],
                         None, tmp_path)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["accuracy"] == accuracy


@pytest.mark.parametrize("ranks,devices,words", [
    (None, "0/cpu:1,1/cpu:1", ["rank 1", "one process", "mpiexec -n 2"]),
    (2, "0/cpu:1,3/cpu:1", ["rank 3", "2 ranks", "mpiexec -n 4"]),
])
def test_placement_errors_name_the_rank_and_what_to_run(tmp_path, data, ranks, devices, words):
    code, out, err = run(train_argv(data, devices, tmp_path / "w.npz"), ranks, tmp_path,
                         timeout=60)
    assert code != 0 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "w.npz").exists()


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_that_cannot_start_its_threads_ends_the_job_naming_itself(tmp_path, data, rank):
    """A rank's devices need more threads than its limits allow (1,024 of 8 MiB of stack in 4
    GiB): the master ends the job with that rank's error, naming it (a serving rank's, not a
    wait for a rank that has gone)."""
    limits = 'ulimit -v 4194304 && ulimit -s 8192 && exec "$0" -m pyhet "$@"'
    devices = "0/cpu:1,1/cpu:1024" if rank == 1 else "0/cpu:1024,1/cpu:1"
    argv = train_argv(data, devices, tmp_path / "w.npz")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(private_mpi_job([MPIEXEC, "-n", "2", "sh", "-c", limits, sys.executable,
                                        *argv], tmp_path), cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    if "ulimit" in p.stderr and "pyhet" not in p.stderr:
        pytest.skip(f"the shell cannot set these limits: {p.stderr.strip()}")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert f"error: rank {rank}: " in p.stderr and "could start only" in p.stderr, p.stderr
    assert "libgomp" not in p.stderr and "did not answer" not in p.stderr, p.stderr
    assert not (tmp_path / "w.npz").exists()


CORES = len(os.sched_getaffinity(0))


# rank 1 alone asks for more threads than it has cores; it does not, but with rank 0's one it
# does (on one machine); neither (where there are two cores or more)
@pytest.mark.parametrize("rank1_threads", [CORES + 1, CORES, max(1, CORES - 1)])
def test_a_serving_rank_warns_through_the_master(tmp_path, data, rank1_threads):
    """A serving rank prints nothing itself; what it warns of (more threads than its cores)
    reaches stderr through rank 0, naming the rank. Ranks on one machine that ask for more
    threads together than its cores are named too (each rank counts only its own)."""
    alone, together = rank1_threads > CORES, rank1_threads + 1 > CORES
    code, out, err = run(train_argv(data, f"0/cpu:1,1/cpu:{rank1_threads}",
                                    tmp_path / "w.npz"), 2, tmp_path)
    assert code == 0, err
    assert ("rank 1: the cpu devices use" in err) == alone, err
    line = f"ranks 0, 1 on {os.uname().nodename} ask for {rank1_threads + 1} cpu threads in all"
    assert (line in err) == together and (f"run on {CORES} cores there" in err) == together, err


def test_the_masters_own_thread_warning_names_its_rank(tmp_path, data):
    """Under mpiexec, rank 0's warning of more threads than its cores names rank 0, as a
    serving rank's names that rank."""
    code, out, err = run(train_argv(data, f"0/cpu:{CORES + 1},1/cpu:1", tmp_path / "w.npz"), 2,
                         tmp_path)
    assert code == 0, err
    assert "rank 0: the cpu devices use" in err and "rank 1: the cpu" not in err, err


def test_ranks_on_one_machine_are_counted_on_the_cores_they_may_run_on():
    """Threads are summed per machine name, against the union of the ranks' cores: ranks bound
    to cores of their own do not compete; a rank that does not say where it runs is left out."""
    from pyhet.transport.mpi import shared_host_warnings

    assert shared_host_warnings({0: "a\t2\t0,1", 1: "a\t2\t2,3", 2: "b\t4\t0,1,2,3"}) == []
    (line,) = shared_host_warnings({0: "a\t1\t0,1", 1: "b\t2\t0,1", 2: "a\t3\t1,2", 3: "x"})
    assert line == ("ranks 0, 2 on a ask for 4 cpu threads in all but run on 3 cores there: "
                    "they will compete for them")
    assert shared_host_warnings({0: "a\t4\t0,1"}) == []   # one rank: its own check says it


def test_the_masters_machine_is_crowded_where_its_ranks_threads_outnumber_its_cores():
    """The ranks on the master's machine ask for more cpu threads than the cores they may run
    on: its devices take turns (pyhet.calibrate times their splits as a step runs them); a
    crowded machine of other ranks, or the master alone, is not the master's."""
    from pyhet.transport.mpi import master_crowded

    assert master_crowded({0: "a\t1\t0,1", 1: "a\t1\t0,1", 2: "a\t1\t0,1"})
    assert not master_crowded({0: "a\t1\t0,1", 1: "a\t1\t0,1", 2: "b\t1\t0,1"})
    assert not master_crowded({0: "a\t1\t0,1", 1: "b\t2\t0", 2: "b\t1\t0"})
    assert not master_crowded({0: "a\t4\t0,1"})
    assert not master_crowded({0: "x", 1: "a\t3\t0,1"})


def test_a_rank_on_the_masters_machine_is_told_by_its_name():
    """Ranks on the master's machine (the name host_of() gives) have devices on it, whose
    idling the master's devices' own together trial times (pyhet.calibrate); a rank that did
    not say where it runs is taken as on it."""
    from pyhet.transport.mpi import same_machine

    hosts = {0: "a\t2\t0,1", 1: "a\t1\t0,1", 2: "b\t4\t0,1,2,3"}
    assert same_machine(hosts, 1) and not same_machine(hosts, 2)
    assert same_machine(hosts, 3)


def test_plan_under_mpiexec_calibrates_each_rank_behind_its_measured_link(tmp_path, data):
    """`mpiexec -n 2 pyhet plan --devices 0/cpu:1,1/cpu:1`: rank 1's device calibrated on its
    rank, behind the link the plan measured (a described link of its own replaces it); the
    job ends cleanly. Without mpiexec, or without --devices under it, a clear error."""
    argv = ["plan", "--dataset", f"npz:{data}", "--arch", ARCH, "--batch-size", 8,
            "--devices", "0/cpu:1,1/cpu:1", "--json"]
    code, out, err = run(argv, 2, tmp_path)
    assert code == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    d0, d1 = r["devices"]
    assert d0["link"] == "local" and d1["link"] != "local" and d1["latency_s"] > 0, r["devices"]
    assert d1["link_measured"] and "link_measured" not in d0
    assert r["predicted_step_s"] > 0 and r["speedup"] > 0
    for layer, counts in r["partition"].items():
        assert sum(counts.values()) == next(g.K for g in build(ARCH, (1, 12, 12), 3).blocks
                                            if g.name == layer)
    code, out, err = run([*argv, "--describe", "d1:bw=1mbit,lat=10ms"], 2, tmp_path)
    assert code == 0, err
    d1 = json.loads(out.strip().splitlines()[-1])["devices"][1]
    assert (d1["link"], d1["latency_s"], d1["bandwidth_bytes_per_s"]) == ("1mbit", 0.01, 125e3)
    assert "link_measured" not in d1
    # an entry without R/ is on every rank: d1 is rank 1's, and may be described
    code, out, err = run([*argv[:-3], "--devices", "cpu:1", "--describe", "d1:bw=1mbit",
                          "--json"], 2, tmp_path)
    assert code == 0, err
    assert [d["link"] for d in json.loads(out.strip().splitlines()[-1])["devices"]] == [
        "local", "1mbit"]
    code, out, err = run(argv[:-1], 2, tmp_path)   # the table says which link was measured
    # (its rate in three digits: it was 25.9536gbit; or too fast to time)
    assert code == 0 and re.search(r", ([0-9.,]+ [GMk]?bit/s|untimed bandwidth) measured\)",
                                   out.splitlines()[0]), out
    code, out, err = run([*argv[:-3], "--describe", "x:gflops=10"], 2, tmp_path, timeout=60)
    assert code == 2 and "give --devices placing them" in err and "Traceback" not in err, err
    code, out, err = run(argv, None, tmp_path, timeout=60)
    assert code != 0 and "only under mpiexec" in err and "Traceback" not in err, err


def test_other_commands_refuse_mpiexec(tmp_path, data):
    """A usage error (status 2), said once."""
    code, out, err = run(["evaluate", "--weights", tmp_path / "w.npz", "--dataset",
                          f"npz:{data}"], 2, tmp_path, timeout=60)
    assert code == 2 and err.count("runs in one process") == 1, (code, err)
    # --debug: its traceback once too (every rank printed its own)
    code, out, err = run(["--debug", "evaluate", "--weights", tmp_path / "w.npz"], 2, tmp_path,
                         timeout=60)
    assert code == 2 and err.count("Traceback") == 1, (code, err)
    assert err.strip().splitlines()[-1].startswith("pyhet: error: pyhet evaluate runs in")


def test_a_plan_too_large_for_memory_under_mpiexec_says_so_in_one_line(tmp_path):
    """The link's measurement (messages of the layer's input) ran out of memory first: a
    traceback, where one process says "out of memory" in one line. The memory the master's
    devices need is now checked before any calibration, as pyhet train checks it."""
    code, out, err = run(["plan", "--devices", "0/cpu:1,1/cpu:1", "--kernels", "4,8",
                          "--batch-size", "99999999"], 2, tmp_path, timeout=120)
    assert code == 1 and "Traceback" not in err, (code, err)
    (line,) = err.strip().splitlines()
    assert line.startswith("pyhet: error: the network 4C5-P2-8C5-P2 on 1x28x28 images with 10 "
                           "classes needs at least ") and "at batch 99999999" in line, err
    assert line.endswith("GiB available"), err


def test_ranks_started_with_other_devices_are_refused(tmp_path, data):
    """mpiexec -n 1 A : -n 1 B with another --devices on rank 1: it idled where the master gave
    it a device (or made its own), silently."""
    pyhet = [sys.executable, "-m", "pyhet", "train", "--dataset", f"npz:{data}", "--arch", ARCH,
             "--steps", "2", "--quiet", "--devices"]
    p = subprocess.run(private_mpi_job([MPIEXEC, "-n", "1", *pyhet, "0/cpu:1,1/cpu:1", ":", "-n",
                                        "1", *pyhet, "0/cpu:1"], tmp_path), cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "rank 1 was started with --devices '0/cpu:1', rank 0 with '0/cpu:1,1/cpu:1'" in \
        p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("rank1", [["train", "--lr", "-1"], ["evaluate", "--weights", "w.npz"]],
                         ids=["a bad option", "another command"])
def test_a_rank_refused_alone_before_mpi_starts_ends_the_job(tmp_path, data, rank1):
    """mpiexec -n 1 A : -n 1 B, where only rank 1's command line is refused: it exited with 2
    saying nothing (rank 0, given the same command line, says why), and rank 0 waited for it
    in MPI's start-up until --timeout (300 s). It says why, naming its rank, and ends the job
    after a few seconds."""
    pyhet = [sys.executable, "-m", "pyhet"]
    train = ["train", "--dataset", f"npz:{data}", "--arch", ARCH, "--steps", "2", "--quiet",
             "--devices", "0/cpu:1,1/cpu:1"]
    rest = train[1:] if rank1[0] == "train" else []
    p = subprocess.run(private_mpi_job([MPIEXEC, "-n", "1", *pyhet, *train, ":", "-n", "1",
                                        *pyhet, *rank1[:1], *rest, *rank1[1:]], tmp_path),
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)    # not a hang until timeout=120
    lines = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and ": error: rank 1: " in lines[0], p.stderr
    assert ("--lr" if rank1[0] == "train" else "runs in one process") in lines[0]
    assert "Traceback" not in p.stderr


def test_the_same_refused_command_line_on_every_rank_is_said_once_at_once(tmp_path, data):
    """Rank 0 says why and ends the job; the others, refused the same way, are ended with it
    before they would say it again."""
    code, out, err = run(["train", "--dataset", f"npz:{data}", "--arch", ARCH, "--lr", "-1",
                          "--devices", "0/cpu:1,1/cpu:1"], 2, tmp_path, timeout=60)
    assert code == 2 and err.count("--lr") == 1 and "rank 1" not in err, (code, err)


# ================================================================ a rank that fails

def rank_pid(marker: str, rank: int):
    """The pid of the process of MPI rank `rank` whose command line holds `marker`, or None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and b"mpiexec" not in cmdline.split(b"\0")[0] and \
                f"PMI_RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def pids_with(marker: str):
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("signal_name", ["SIGSTOP", "SIGKILL"])
def test_a_rank_that_stops_or_dies_ends_the_run(tmp_path, signal_name):
    """Rank 1 stopped (it no longer answers) or killed mid-training: the run ends within the
    timeout plus 30 s, with a non-zero status, and leaves no process behind. A rank killed is
    mpiexec's to report, with the rank's status, 9 (README)."""
    import signal
    import time

    data = tmp_path / "long.npz"
    make_npz_dataset(data, n=64, shape=(1, 12, 12), classes=3, seed=5)
    argv = [MPIEXEC, "-n", "2", sys.executable, "-m", "pyhet", "train", "--dataset",
            f"npz:{data}", "--arch", ARCH, "--devices", "0/cpu:1,1/cpu:1", "--balance", "even",
            "--steps", "1000000", "--batch-size", "8", "--timeout", "5", "--quiet",
            "--checkpoint-dir", "ck", "--checkpoint-every", "20"]
    p = subprocess.Popen(private_mpi_job(argv, tmp_path), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    with p:
        try:
            deadline = time.monotonic() + 60
            pid = None
            # well into training: rank 1 started and rank 0 has written a checkpoint (a rank
            # killed while MPI starts is mpiexec's alone to report, and in a moment)
            while time.monotonic() < deadline and (
                    pid is None or not list((tmp_path / "ck").glob("*.npz"))):
                time.sleep(0.2)
                pid = rank_pid(str(data), 1)
            assert pid is not None, "rank 1 did not start"
            assert list((tmp_path / "ck").glob("*.npz")), "no checkpoint written in 60 s"
            os.kill(pid, getattr(signal, signal_name))
            start = time.monotonic()
            out, err = p.communicate(timeout=5 + 30)
            took = time.monotonic() - start
        finally:
            if p.poll() is None:
                p.kill()
    err = err.decode()
    assert p.returncode != 0, err
    assert took < 5 + 30
    if signal_name == "SIGKILL":
        assert p.returncode == 9, (p.returncode, err)
    if signal_name == "SIGSTOP":
        assert "rank 1 (1/cpu:1) did not answer within 5 s" in err, err
        # a request and its reply within --timeout together (each in turn took twice it, and
        # closing the silent rank's devices waited for it once more: 15 s)
        assert took < 9, (took, err)
    time.sleep(1)
    assert pids_with(str(data)) == [], "processes left behind"


def test_an_idle_rank_stopped_before_the_end_ends_the_job_after_the_timeout(tmp_path):
    """Rank 2 holds no device and is stopped while the others train: the run's summary is
    printed, then the job ends within --timeout with an error naming rank 2 (it hung in
    MPI_Finalize, which waits for every rank, however long)."""
    import signal
    import time

    data = tmp_path / "long.npz"
    make_npz_dataset(data, n=64, shape=(1, 12, 12), classes=3, seed=5)
    argv = [MPIEXEC, "-n", "3", sys.executable, "-m", "pyhet", "train", "--dataset",
            f"npz:{data}", "--arch", ARCH, "--devices", "0/cpu:1,1/cpu:1", "--balance", "even",
            "--steps", "200", "--batch-size", "8", "--timeout", "3", "--quiet", "--json",
            "--checkpoint-dir", "ck", "--checkpoint-every", "5"]
    p = subprocess.Popen(private_mpi_job(argv, tmp_path), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    pid = None
    with p:
        try:
            deadline = time.monotonic() + 60
            # in training (a checkpoint written): in MPI's start-up a stopped rank is the
            # launcher's to end
            while time.monotonic() < deadline and (
                    pid is None or not list((tmp_path / "ck").glob("*.npz"))):
                time.sleep(0.05)
                pid = rank_pid(str(data), 2)
            assert pid is not None, "rank 2 did not start"
            os.kill(pid, signal.SIGSTOP)
            out, err = p.communicate(timeout=60 + 3 + 30)
        finally:
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
            if p.poll() is None:
                p.kill()
    err = err.decode()
    assert p.returncode != 0, err
    assert json.loads(out.decode().splitlines()[-1])["steps"] == 200     # the summary first
    assert "rank 2 did not answer the end of the job within 3 s" in err, err
    time.sleep(1)
    assert pids_with(str(data)) == [], "processes left behind"


def test_a_rank_that_never_starts_mpi_ends_the_job_after_the_timeout(tmp_path, data):
    """Rank 1 is not pyhet at all (it never starts MPI, as a rank stopped before it did):
    rank 0's start-up, which waits for it inside MPI where no handler runs, ends after
    --timeout (at least MIN_STARTUP_S: 5 s) by SIGALRM, and mpiexec the job; nothing is
    left."""
    import time

    argv = [MPIEXEC, "-n", "1", sys.executable, "-m", "pyhet", "train", "--dataset",
            f"npz:{data}", "--arch", ARCH, "--devices", "0/cpu:1,1/cpu:1", "--steps", "2",
            "--timeout", "3", "--quiet", ":", "-n", "1", "sleep", "47"]
    start = time.monotonic()
    p = subprocess.run(private_mpi_job(argv, tmp_path), cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    took = time.monotonic() - start
    assert p.returncode != 0 and 5 <= took < 5 + 20, (p.returncode, took, p.stderr)
    time.sleep(1)
    assert pids_with("sleep 47") == [] and pids_with(str(data)) == [], "processes left"


@pytest.mark.parametrize("stubbed", [[1], [0, 1]])
def test_a_rank_without_mpi4py_ends_the_job_at_once(tmp_path, data, stubbed):
    """A rank that fails before MPI starts (here mpi4py is a stand-in that cannot be imported)
    says why and ends the job through the launcher at once, with status 1 and no banner; the
    others used to wait in MPI's start-up until --timeout, then end with mpiexec's banner."""
    import time

    stub = tmp_path / "stub" / "mpi4py"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no mpi4py here (a stand-in)')\n")
    argv = []
    for rank in (0, 1):
        env = ["-env", "PYTHONPATH", str(stub.parent)] if rank in stubbed else []
        argv += [":"] * bool(argv) + ["-n", "1", *env, sys.executable, "-m", "pyhet",
                                      *map(str, train_argv(data, "0/cpu:1,1/cpu:1",
                                                           tmp_path / "w.npz", "--timeout",
                                                           "120"))]
    start = time.monotonic()
    p = subprocess.run(private_mpi_job([MPIEXEC, *argv], tmp_path), cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    took = time.monotonic() - start
    assert p.returncode == 1 and took < 30, (p.returncode, took, p.stdout, p.stderr)
    assert p.stdout == "" and "mpi4py is not installed" in p.stderr, (p.stdout, p.stderr)
    assert set(p.stderr.splitlines()) == {p.stderr.splitlines()[0]}, p.stderr
    assert not (tmp_path / "w.npz").exists()
    time.sleep(1)
    assert pids_with(str(data)) == [], "processes left"


def test_a_checkpoint_from_mpi_resumes_in_one_process(tmp_path, data):
    """One epoch on two ranks with checkpoints, then --resume in one process on other devices:
    the weights of two uninterrupted epochs."""
    def argv(devices, *extra):
        return ["train", "--dataset", f"npz:{data}", "--arch", ARCH, "--devices", devices,
                "--balance", "even", "--batch-size", 8, "--lr", 0.05, "--quiet", *extra]

    code, out, err = run(argv("0/cpu:1,1/cpu:1", "--epochs", 1, "--checkpoint-dir",
                              tmp_path / "ck"), 2, tmp_path)
    assert code == 0, err
    code, out, err = run(argv("cpu:1,numpy,cpu:1", "--epochs", 2, "--checkpoint-dir",
                              tmp_path / "ck", "--resume", "--save", tmp_path / "resumed.npz"),
                         None, tmp_path)
    assert code == 0 and "resuming from" in err, err
    code, out, err = run(argv("cpu:1", "--epochs", 2, "--save", tmp_path / "whole.npz"), None,
                         tmp_path)
    assert code == 0, err
    want, got = weights(tmp_path / "whole.npz"), weights(tmp_path / "resumed.npz")
    for k in want:
        assert np.abs(got[k] - want[k]).max() / np.abs(want[k]).max() < 1e-4, k


def catches_sigterm(pid) -> bool:
    """Whether the process has a handler of SIGTERM (its SigCgt mask in /proc), as a rank has
    once MPI has started (pyhet.cli.run_rank; before, the signal's default action)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)
    return caught is not None and bool(int(caught.group(1), 16) >> 14 & 1)


def start_long_run(tmp_path, devices):
    """mpiexec -n 2 pyhet train of a million steps, once both ranks have started MPI (their
    handlers of SIGTERM in place) and a second more: (the Popen, the marker of its processes'
    command lines). (A fixed 2 s after rank 1 appeared was too short on a loaded machine.)"""
    import time

    data = tmp_path / "long.npz"
    make_npz_dataset(data, n=64, shape=(1, 12, 12), classes=3, seed=6)
    argv = [MPIEXEC, "-n", "2", sys.executable, "-m", "pyhet", "train", "--dataset",
            f"npz:{data}", "--arch", ARCH, "--devices", devices, "--balance", "even",
            "--steps", "1000000", "--batch-size", "8", "--quiet"]
    p = subprocess.Popen(private_mpi_job(argv, tmp_path), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and p.poll() is None and not all(
            catches_sigterm(rank_pid(str(data), r)) for r in (0, 1)):
        time.sleep(0.2)
    if not all(catches_sigterm(rank_pid(str(data), r)) for r in (0, 1)):
        p.kill()
        _, err = p.communicate(timeout=30)
        pytest.fail(f"the two ranks did not both start MPI within 90 s: {err[-2000:]!r}")
    time.sleep(1)
    return p, str(data)


@pytest.mark.parametrize("signal_name, to_rank, status, line, devices", [
    ("SIGINT", None, 130, "pyhet: interrupted", "0/cpu:1,1/cpu:1"),
    ("SIGTERM", None, 143, "pyhet: terminated by SIGTERM", "0/cpu:1,1/cpu:1"),
    # rank 1 alone gets it: serving, or idle (it holds no device)
    ("SIGTERM", 1, 143, "pyhet: rank 1 terminated by SIGTERM", "0/cpu:1,1/cpu:1"),
    ("SIGINT", 1, 130, "pyhet: rank 1 interrupted", "0/cpu:1,1/cpu:1"),
    ("SIGTERM", 1, 143, "pyhet: rank 1 terminated by SIGTERM", "0/cpu:1"),
])
def test_ctrl_c_or_sigterm_ends_every_rank_at_once(tmp_path, signal_name, to_rank, status,
                                                  line, devices):
    """SIGINT (Ctrl-C) or SIGTERM (a scheduler's) to mpiexec, or to a serving or idle rank
    alone: the job ends within seconds, with 130 or 143 and one line on stderr (not
    MPI_Abort's own, nor mpiexec's banner), nothing left."""
    import signal
    import time

    p, marker = start_long_run(tmp_path, devices)
    with p:
        try:
            if to_rank is None:
                p.send_signal(getattr(signal, signal_name))
            else:
                os.kill(rank_pid(marker, to_rank), getattr(signal, signal_name))
            start = time.monotonic()
            _, err = p.communicate(timeout=30)
            took = time.monotonic() - start
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == status and took < 10, (p.returncode, took, err)
    said = [s for s in err.decode().strip().splitlines() if not s.endswith(": it idles")]
    assert said == [line], err
    time.sleep(1)
    assert pids_with(marker) == [], "processes left behind"


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used (user and system), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_rank_waits_without_a_busy_core(tmp_path):
    """A rank that holds no device waits for the master's end in Python, polling with sleeps
    (it used 1.5% of a core here): a blocking receive, where MPICH busy-polls, would take a
    whole core from the training for its length."""
    import time

    p, marker = start_long_run(tmp_path, "0/cpu:1")
    with p:
        try:
            pid = rank_pid(marker, 1)
            before, t0 = cpu_seconds(pid), time.monotonic()
            time.sleep(3)
            used, took = cpu_seconds(pid) - before, time.monotonic() - t0
        finally:
            p.kill()
            p.communicate(timeout=30)
    assert used < 0.25 * took, (used, took)


def printed(code: str, cwd) -> str:
    """What Python code run in a process of its own prints (in cwd, not the source folder,
    whose pyhet/ has no built core; without initialising MPI in the tests' process)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout


class _SharedWire:
    """Stand-in peers for MasterLink.measure_links: rank r's link moves links[r] bytes/s (or
    `links` for every rank) each way, and all of them cross one interface of `interface` bytes/s
    each way (full duplex), which the transfers under way one way share as a switch does (the
    slower links take what they can, the others share the rest evenly); a transfer's rate is
    fixed by those under way its way SETTLE_S after it starts. A message takes LATENCY_S each
    way beside its bytes. `shares` records, per op, how many transfers were under way each
    transfer's way when its rate was fixed."""
    SETTLE_S = 0.1      # (0.02: one thread woken 20 ms late on a loaded machine missed the other)
    LATENCY_S = 0.03

    def __init__(self, links, interface, fail_rank=None):
        import threading
        self.links, self.interface, self.fail_rank = links, interface, fail_rank
        self.lock, self.trips_together = threading.Lock(), 0
        self.active = {"out": set(), "in": set()}
        self.shares = {}     # op -> [transfers under way its way when each one's rate was fixed]

    def rate(self, rank, way):
        def link(r):
            return self.links[r] if isinstance(self.links, dict) else self.links
        left, rates = self.interface, {}
        ranks = sorted(self.active[way], key=link)
        for i, r in enumerate(ranks):
            rates[r] = min(link(r), left / (len(ranks) - i))
            left -= rates[r]
        return rates[rank]

    def peer(self, rank):
        import contextlib
        import time
        wire = self

        class Peer:
            link = None

            @contextlib.contextmanager
            def request(self):
                yield

            def send(self, tag, op, arrays, patient=True):
                # a round trip's bytes there and back (timed alone: the ways one after the
                # other, at the same rate); "sink": there only; "source": the count asked
                # for, back only
                nbytes = {"ok": 2 * arrays[0].nbytes, "sink": arrays[0].nbytes,
                          "source": 4 * int(arrays[0][0]) if arrays else 0}[op]
                self.way = "in" if op == "source" else "out"
                time.sleep(wire.LATENCY_S)
                with wire.lock:
                    wire.active[self.way].add(rank)
                time.sleep(wire.SETTLE_S)
                with wire.lock:
                    sharing = len(wire.active[self.way])
                    wire.shares.setdefault(op, []).append(sharing)
                    wire.trips_together += sharing > 1
                    self.took = nbytes / wire.rate(rank, self.way)
                    if sharing > 1 and rank == wire.fail_rank:
                        wire.active[self.way].discard(rank)
                        raise RuntimeError(f"rank {rank} failed")

            def receive(self, tag, patient=True):
                time.sleep(self.took)
                with wire.lock:
                    wire.active[self.way].discard(rank)
                time.sleep(wire.LATENCY_S)
                return "ok", [], tag
        return Peer()


def _master_link(wire, ranks):
    from pyhet.transport import mpi
    ml = object.__new__(mpi.MasterLink)
    ml.peers = {r: wire.peer(r) for r in range(1, ranks + 1)}
    ml.ranks_devices = {0: ["cpu:1"], **{r: ["cpu:1"] for r in ml.peers}}
    ml.ranks_devices[ranks] = []              # a rank that holds no device: not measured
    return ml


@pytest.mark.parametrize("interface_links", [1, 8])
def test_links_that_cross_one_interface_are_measured_together(interface_links):
    """With two ranks that hold devices, measure_links times their trips once more, all at once:
    where their bytes cross one interface as fast as one link, each gets half of it, and that
    is the link the cost model takes (alone, each would be taken at its whole rate); where the
    interface is much faster than the links, each keeps its own rate. A rank without devices is
    not measured; together=False times each link alone only."""
    import threading
    link = 2e6
    wire = _SharedWire(link, interface_links * link)
    ml = _master_link(wire, 3)
    out = ml.measure_links(200_000, rounds=3)
    assert sorted(out) == [1, 2]
    # timed alone, then both ranks' bytes out together, then both back together
    assert set(wire.shares) == {"ok", "sink", "source"}
    assert set(wire.shares["sink"] + wire.shares["source"]) == {2}
    for r in (1, 2):
        alone, shared = out[r]["bandwidth_bytes_per_s"], out[r]["shared_bandwidth_bytes_per_s"]
        assert alone == pytest.approx(link, rel=0.1)
        if interface_links == 1:
            assert shared == pytest.approx(link / 2, rel=0.1)
            assert ml.peers[r].link.bandwidth_bytes_per_s == shared
        else:
            assert shared == pytest.approx(link, rel=0.1)
            assert ml.peers[r].link.bandwidth_bytes_per_s == pytest.approx(link, rel=0.1)
    assert not [t for t in threading.enumerate() if t.name.startswith("pyhet-link")]
    ml = _master_link(_SharedWire(link, link), 3)
    out = ml.measure_links(100_000, rounds=2, together=False)
    assert all(out[r]["shared_bandwidth_bytes_per_s"] is None for r in (1, 2))
    assert all(ml.peers[r].link.bandwidth_bytes_per_s == out[r]["bandwidth_bytes_per_s"]
               for r in (1, 2))


def test_unlike_links_through_one_interface_each_get_their_share():
    """A fast link beside a slow one through one interface: each is taken at the rate it moves
    at while the other moves too (the slow one at its own, the fast one at the rest of the
    interface), not at the pace of the slowest. Their messages take as long alone, so the fast
    one's, at 7/8 of its rate, ends last each way: each rank's bytes over that time, the slow
    one's 7/8 of its rate too (a step's phase waits for both). Each way's transfers start
    together: the slow rank's bytes back wait for the fast one's to have gone out, and then move
    beside the fast one's coming back, as in a step."""
    fast, slow = 8e6, 1e6
    wire = _SharedWire({1: fast, 2: slow}, fast)
    ml = _master_link(wire, 3)
    out = ml.measure_links(200_000, rounds=3)
    assert out[1]["bandwidth_bytes_per_s"] == pytest.approx(fast, rel=0.1)
    assert out[1]["shared_bandwidth_bytes_per_s"] == pytest.approx(fast - slow, rel=0.1)
    assert out[2]["shared_bandwidth_bytes_per_s"] == pytest.approx(slow * 7 / 8, rel=0.1)
    assert ml.peers[2].link.bandwidth_bytes_per_s == pytest.approx(slow * 7 / 8, rel=0.1)
    assert set(wire.shares["sink"] + wire.shares["source"]) == {2}


def test_a_rank_answers_the_timing_of_its_link():
    """A rank's answers when the master times its link: the message back ("ok"), nothing
    ("sink"), or as many float32 zeros as asked, at most MEASURE_MAX_BYTES' worth ("source")."""
    from pyhet.transport import mpi
    a = [np.arange(5, dtype=np.float32)]
    assert mpi._echo("ok", a) is a
    assert mpi._echo("sink", a) == []
    (back,) = mpi._echo("source", [np.array([7], np.int64)])
    assert back.dtype == np.float32 and back.shape == (7,) and not back.any()
    (most,) = mpi._echo("source", [np.array([1 << 40], np.int64)])
    assert most.nbytes == mpi.MEASURE_MAX_BYTES


def test_a_rank_that_fails_while_the_links_are_timed_together_stops_them_all():
    """A trip that fails while every rank's are timed at once raises its error, after the
    others have stopped: no thread of the measurement is left."""
    import threading
    wire = _SharedWire(2e6, 2e6, fail_rank=2)
    ml = _master_link(wire, 3)
    with pytest.raises(RuntimeError, match="rank 2 failed"):
        ml.measure_links(100_000, rounds=3)
    assert wire.trips_together > 0
    assert not [t for t in threading.enumerate() if t.name.startswith("pyhet-link")]


def test_the_links_timed_together_over_mpi(tmp_path):
    """Two ranks' round trips timed at once over MPI (a thread each, as a step's devices send):
    every trip of every round comes back (no message of one rank's thread mixed with another's,
    nothing left waiting), within the deadline, and the job ends as usual."""
    script = tmp_path / "together.py"
    script.write_text(
        "import sys, time\n"
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "from pyhet.specs import parse_devices\n"
        "from pyhet.transport import mpi\n"
        "from pyhet.train import open_devices\n"
        "comm, spec = MPI.COMM_WORLD, '1/cpu:1,2/cpu:1'\n"
        "if comm.Get_rank():\n"
        "    mpi.serve(comm, parse_devices(spec), spec)\n"
        "    sys.exit(0)\n"
        "devices = open_devices(spec, 60, comm)\n"
        "t0 = time.perf_counter()\n"
        "trips = devices.link._trips_together({1: 300_000, 2: 50_000}, 4)\n"
        "took = time.perf_counter() - t0\n"
        "out = devices.link.measure_links(1_200_000, rounds=2)\n"
        "peer = devices.link.peers[2]\n"
        "peer.send(mpi.TAG_ECHO, 'source', [np.array([1234], np.int64)])\n"
        "_, (back,), _ = peer.receive(mpi.TAG_ECHO)\n"
        "peer.send(mpi.TAG_ECHO, 'sink', [np.ones(99, np.float32)])\n"
        "assert back.shape == (1234,) and peer.receive(mpi.TAG_ECHO)[1] == []\n"
        "ways = [w for r in (1, 2) for t in trips[r] for w in t]\n"
        "print(len(trips[1]), len(trips[2]), sum(len(t) == 2 for t in trips[1] + trips[2]),\n"
        "      max(ways), sum(trips[1][-1]), took, sorted(out))\n"
        "for d in devices:\n"
        "    d.close()\n"
        "mpi.dismiss(comm, 60)\n")
    cmd = private_mpi_job([MPIEXEC, "-n", "3", sys.executable, str(script)], tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    first, second, pairs, longest, last, took, rest = p.stdout.split(maxsplit=6)
    assert (first, second) == ("4", "4")          # the warm-up round is not counted
    assert pairs == "8"                           # each round: the time out, the time in
    assert 0 < float(longest) and float(last) <= float(took) < 60
    assert rest.startswith("[1, 2]"), p.stdout


def test_transfer_polls_are_paced_only_on_slow_links(tmp_path):
    """A transfer under way is polled without pausing until a rate is known, on a fast link
    (shared memory moves only while both sides poll) however large, and where the pause would
    be short; on a slow link with pauses of 1/64 of its expected time, at most 1 ms."""
    code = (
        "from pyhet.transport.mpi import transfer_pause as p\n"
        "print(p(6 << 20, None), p(256 << 20, 2e9), p(6 << 20, 12.5e6), p(1 << 20, 125e6),"
        " p(64 << 10, 12.5e6))\n")
    unknown, fast, slow, mid, short = (float(v) for v in printed(code, tmp_path).split())
    assert unknown == 0.0 and fast == 0.0 and short == 0.0   # short: a 78 us pause
    assert slow == pytest.approx(1e-3)                      # 0.5 s expected: capped
    assert mid == pytest.approx((1 << 20) / 125e6 / 64)     # 8.4 ms expected: 131 us


def test_a_message_long_in_coming_is_seen_soon_after_it_comes(tmp_path):
    """Waiting for a message to begin, the polls sleep a sixteenth of the time waited (20 us to
    2 ms): a reply that comes after T is seen by T * 17/16 (or T + 2 ms), and a long wait wakes
    at most about 500 times a second (on a clock that moves only by the sleeps)."""
    code = (
        "import types\n"
        "from pyhet.transport import mpi\n"
        "clock = [0.0]\n"
        "mpi.time = types.SimpleNamespace(monotonic=lambda: clock[0],\n"
        "    sleep=lambda s: clock.__setitem__(0, clock[0] + s))\n"
        "class Req:\n"
        "    def __init__(self, at): self.at, self.polls = at, 0\n"
        "    def Test(self, *a):\n"
        "        self.polls += 1\n"
        "        return clock[0] >= self.at\n"
        "for at in (1e-4, 3e-3, 0.02, 0.15, 10.0):\n"
        "    clock[0] = 0.0\n"
        "    r = Req(at)\n"
        "    mpi.wait(r, timeout=60)\n"
        "    print(at, clock[0], r.polls)\n")
    for line in printed(code, tmp_path).split("\n")[:-1]:
        at, seen, polls = (float(v) for v in line.split())
        assert at <= seen <= at + min(at / 16, 2e-3) + 20e-6, line
        assert polls <= 60 + 16 * math.log(max(at, 320e-6) / 320e-6) + at / 2e-3, line
    assert polls >= 10.0 / 2e-3   # ... never sleeping more than 2 ms


def test_a_ranks_group_takes_its_weight_gradient_from_the_forwards_operand():
    """A group's messages on a rank, handled in this process: in a layer with an input gradient
    the group packs only the forward's operand, its members' dy go to one array and their
    weight gradient is made with the input gradient, split by input channels; the outputs, dx
    and every shard's dw are those of one reference device."""
    from pyhet.devices import channel_shares, make_devices
    from pyhet.specs import parse_devices
    from pyhet.transport import mpi

    g = build(ARCH, (1, 12, 12), 3).blocks[1]      # 4 -> 5 kernels of 3x3, stride 2
    rng = np.random.default_rng(5)
    x = rng.standard_normal(g.x_shape(6)).astype(np.float32)
    w = rng.standard_normal((g.K, g.C, g.R, g.S)).astype(np.float32)
    b = rng.standard_normal(g.K).astype(np.float32)
    devices = make_devices(parse_devices("numpy,cpu:1,cpu:1"))
    try:
        ref, members = devices[0], devices[1:]
        ref.call("load", ref.load_shard, "conv2", g, w, b)
        out_ref = ref.call("forward", ref.conv_forward, "conv2", x)
        dout = rng.standard_normal(out_ref.shape).astype(np.float32)
        dx_ref = ref.call("backward", ref.conv_backward, "conv2", dout, "own")
        for d, (k0, k1) in zip(members, ((0, 2), (2, 5))):
            d.call("load", d.load_shard, "conv2", g, w[k0:k1], b[k0:k1])
        shares = channel_shares(g.C, [2, 3])
        plan = np.array([(1, 2, *shares[0]), (2, 3, *shares[1])], np.int64)
        by_index, buffers = {1: members[0], 2: members[1]}, {}
        (out,), _ = mpi._handle_group(by_index, buffers, "group_forward",
                                      [mpi.text("conv2"), x, plan, np.array([1], np.int64)])
        assert buffers[("conv2", "col")].dw_from_fwd
        (dx,), _ = mpi._handle_group(by_index, buffers, "group_backward",
                                     [mpi.text("conv2"), dout, plan, np.array([1], np.int64)])
        tol = dict(rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(out, out_ref, **tol)
        np.testing.assert_allclose(dx, dx_ref, **tol)
        dw = np.concatenate([d._shards["conv2"].dw for d in members])
        np.testing.assert_allclose(dw, ref._shards["conv2"].dw, **tol)
        np.testing.assert_allclose(np.concatenate([d._shards["conv2"].db for d in members]),
                                   ref._shards["conv2"].db, **tol)
        # a "drop" of the layer forgets the group's arrays of it, and only those
        buffers[("conv1", "col")] = object()
        mpi.drop_group_arrays(buffers, "conv2")
        assert list(buffers) == [("conv1", "col")]
    finally:
        for d in devices:
            d.close()


@pytest.mark.parametrize("rank, said", [(0, "pyhet: interrupted\n"), (1, "")])
def test_ctrl_c_before_mpi_starts_asks_the_launcher_to_end_the_job(monkeypatch, capsys, rank,
                                                                   said):
    """Ctrl-C on a rank before MPI starts in it (before run_rank's handlers): it asks MPICH's
    launcher, over its PMI socket, to end every rank with 130, as a rank whose mpi4py is
    missing does; the others may already wait in MPI's start-up. In this process, with the
    launcher's end of the socket played by a thread."""
    from pyhet import cli

    def interrupted(*_):
        raise KeyboardInterrupt

    with pmi_launcher(monkeypatch, rank) as heard:
        monkeypatch.setattr(cli, "run_rank", interrupted)
        monkeypatch.setattr(cli, "_mpi_started", lambda: False)   # as before MPI_Init
        assert cli.main(["train", "--devices", "0/cpu:1,1/cpu:1"]) == 130
    assert heard == [b"cmd=init pmi_version=1 pmi_subversion=1\n", b"cmd=abort exitcode=130\n"]
    assert capsys.readouterr().err == said


def test_a_launcher_without_a_pmi_socket_or_answer_is_not_asked(monkeypatch):
    """No PMI_FD (another launcher), or a socket that answers anything but a good init: the
    job cannot be ended this way, and the rank says so by returning False at once."""
    import socket

    from pyhet import transport

    monkeypatch.delenv("PMI_FD", raising=False)
    assert transport.end_job_unstarted(1) is False
    ours, launcher = socket.socketpair()
    with ours, launcher:
        launcher.sendall(b"cmd=response_to_init rc=-1\n")
        monkeypatch.setenv("PMI_FD", str(ours.fileno()))
        assert transport.end_job_unstarted(1) is False
        launcher.close()
        assert transport.end_job_unstarted(1) is False    # the launcher's end is gone
