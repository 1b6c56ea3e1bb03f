"""The benchmarks run, as `pyhet bench NAME` runs them, and write the JSON they promise (on
tiny problems: these are smoke tests, the figures come from the real runs)."""

import json

import pytest

from pyhet.cli import main


def run(capsys, *argv):
    assert main(["bench", *argv]) == 0
    return capsys.readouterr().out


def test_bench_gemm(tmp_path, capsys):
    out = run(capsys, "gemm", "--shapes", "33x17x65,20x9x31:tn", "--threads", "1",
              "--repeat", "1", "--json", str(tmp_path / "g.json"))
    res = json.loads((tmp_path / "g.json").read_text())
    rows = res["results"] if isinstance(res, dict) and "results" in res else res
    assert "33x17x65" in out and len(rows) == 2
    for r in rows:
        assert r["pyhet_gflops"] > 0 and r["numpy_gflops"] > 0 and r["max_rel_diff"] < 1e-5


def test_bench_step(tmp_path, capsys):
    out = run(capsys, "step", "--kernels", "4,6", "--steps", "1", "--rounds", "1",
              "--json", str(tmp_path / "s.json"))
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["sides"]["pyhet"]["median_s"] > 0 and "pyhet" in out
    if "torch" in res["sides"]:
        assert res["ratio_pyhet_over_torch"] > 0


def test_bench_scaling(tmp_path, capsys):
    pytest.importorskip("numpy")
    out = run(capsys, "scaling", "--kernels", "8,16", "--steps", "1", "--rounds", "1",
              "--dynamic-steps", "3", "--json", str(tmp_path / "c.json"))
    res = json.loads((tmp_path / "c.json").read_text())
    configs = {(r["config"], r["balance"]) for r in res["configs"]}
    assert ("cpu:1", None) in configs and ("cpu:1,cpu:1@0.5", "even") in configs
    for r in res["configs"]:
        assert sum(r["partition"]["conv2"].values()) == 16 and r["step_s"] > 0
    assert len(res["dynamic"]["trace"]) == 4 + 3 and "Part 2" in out
