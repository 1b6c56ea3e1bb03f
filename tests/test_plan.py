"""`pyhet plan`: the cost model of pyhet.partition applied to calibrated and described devices,
the data-parallel model beside it, and the command line. Most clusters are made of hand-made
calibrations and described devices; the tests of the master and the layers timed in steps run
small networks on real devices.

Letters as in pyhet.geometry; N is the batch size.
"""

import importlib.util
import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from pyhet import arch, plan
from pyhet.geometry import GPU_OUTPUTS
from pyhet.links import Link, link_cost
from pyhet.partition import balanced, phases_time, predicted_time

NET = arch.build("8C3-P2-12C3-P2", (1, 12, 12), 10)   # conv1 (8 kernels), conv2 (12 kernels)
N = 16


def cal(speeds, overheads=None):
    """(names, Calibration) of hand-made figures: speeds {layer: [kernels/s per device]}."""
    names = [f"d{i}" for i in range(len(next(iter(speeds.values()))))]
    return names, plan.calibration_of(speeds, overheads)


def test_prediction_is_the_partition_cost_model():
    speeds = {"conv1": [4000.0, 1500.0], "conv2": [900.0, 400.0]}
    overheads = {"conv1": [0.0, 0.002], "conv2": [0.001, 0.0]}
    cluster = plan.build_cluster(NET, N, cal(speeds, overheads))
    r = plan.plan(cluster, NET, N, master_gflops=10.0)
    conv = 0.0
    for g in NET.blocks:
        counts = balanced(g.K, speeds[g.name], overheads[g.name])
        assert list(r["partition"][g.name].values()) == counts
        t = predicted_time(counts, speeds[g.name], overheads[g.name])
        assert r["layers"][g.name]["conv_s"] == pytest.approx(t, rel=1e-6)
        conv += t
    fc_flops = 3 * 2 * NET.features * 10          # the classifier, forward and backward
    master = fc_flops * N / 10e9
    assert r["master_s"] == pytest.approx(master, rel=1e-6)
    assert r["predicted_step_s"] == pytest.approx(conv + master, rel=1e-6)
    # d0 alone: every kernel on it, plus the master's work
    alone = sum(o[0] + g.K / speeds[g.name][0]
                for g, o in zip(NET.blocks, (overheads["conv1"], overheads["conv2"])))
    assert r["best_single"]["device"] == "d0"
    assert r["speedup"] == pytest.approx((alone + master) / (conv + master), rel=1e-4)


def test_described_speed_is_gflops_over_flops_per_kernel():
    slow = plan.plan(plan.build_cluster(NET, N, described=plan.parse_describe("a:gflops=2")),
                     NET, N, master_gflops=1.0)
    fast = plan.plan(plan.build_cluster(NET, N, described=plan.parse_describe("a:gflops=4")),
                     NET, N, master_gflops=1.0)
    g = NET.blocks[1]
    per_kernel = g.flops_per_image(need_dx=True) * N / g.K
    assert slow["layers"]["conv2"]["devices"]["a"]["kernels_per_s"] == pytest.approx(
        2e9 / per_kernel, rel=1e-6)
    assert slow["predicted_conv_s"] == pytest.approx(2 * fast["predicted_conv_s"], rel=1e-6)
    # conv1 computes no input gradient: 2 GEMMs, not 3
    g1 = NET.blocks[0]
    assert slow["layers"]["conv1"]["conv_s"] == pytest.approx(
        g1.flops_per_image(need_dx=False) * N / 2e9, rel=1e-6)


def test_like_and_count_and_memory():
    names, c = cal({"conv1": [1000.0], "conv2": [300.0]})
    cluster = plan.build_cluster(NET, N, (names, c), plan.parse_describe(
        "twice:like=d0,factor=2,count=3"))
    assert cluster.names == ["d0", "twice.0", "twice.1", "twice.2"]
    assert [x.speed for x in cluster.costs["conv2"]] == [300.0, 600.0, 600.0, 600.0]
    g = NET.blocks[1]
    mem = (g.fixed_bytes(N) + 5 * g.bytes_per_kernel(N)) / plan.MEMORY_SHARE + 1
    small = plan.build_cluster(NET, N, described=plan.parse_describe(f"s:gflops=1,mem={mem:.0f}"))
    assert small.costs["conv2"][0].cap == 5
    # a copy of a GPU counts a kernel's memory as calibration counts a GPU's (its CPU's count
    # gave it more kernels than the device it copies could hold)
    gpu_mem = (g.fixed_bytes(N) + 5 * g.bytes_per_kernel(N, GPU_OUTPUTS)) / plan.MEMORY_SHARE + 1
    copies = plan.parse_describe(f"g:like=d0,mem={gpu_mem:.0f};h:like=d1,mem={gpu_mem:.0f}")
    names, c = cal({"conv1": [1000.0, 1000.0], "conv2": [300.0, 300.0]})
    mixed = plan.build_cluster(NET, N, (names, replace(c, master_s=0.01, cpu_like=[False, True])),
                               copies)
    assert [x.cap for x in mixed.costs["conv2"][2:]] == [5, int(
        (gpu_mem * plan.MEMORY_SHARE - g.fixed_bytes(N)) // g.bytes_per_kernel(N))]


def test_slow_link_leaves_the_device_out_and_is_the_bottleneck():
    local = cal({"conv1": [2000.0], "conv2": [500.0]})
    far = plan.parse_describe("far:gflops=1000,bw=1mbit,lat=1ms")
    r = plan.plan(plan.build_cluster(NET, N, local, far), NET, N, master_gflops=100.0)
    assert r["partition"]["conv2"]["far"] == 0 and r["partition"]["conv1"]["far"] == 0
    assert r["bottleneck"] == "link far"
    assert r["best_single"]["device"] == "d0" and r["speedup"] == pytest.approx(1.0)
    # the same device over a fast link takes most of the kernels, and compute limits
    near = plan.parse_describe("far:gflops=0.1,bw=100gbit,lat=1us")
    r = plan.plan(plan.build_cluster(NET, N, local, near), NET, N, master_gflops=100.0)
    assert r["partition"]["conv2"]["far"] > r["partition"]["conv2"]["d0"]
    assert r["bottleneck"] == "compute" and r["speedup"] > 1


def test_a_link_splits_the_layer_by_phases():
    """Behind a link, the layer's input moves in the forward and its input gradient in the
    backward, with a barrier between: the predicted layer time is the sum over the two phases
    of the slowest device's, and the partition the best split under it."""
    local = cal({"conv1": [2000.0], "conv2": [500.0]})
    far = plan.parse_describe("far:gflops=0.2,bw=20mbit,lat=100us")
    cluster = plan.build_cluster(NET, N, local, far)
    r = plan.plan(cluster, NET, N, master_gflops=100.0)
    for i, g in enumerate(NET.blocks):
        cs = cluster.costs[g.name]
        share = g.forward_share(need_dx=i > 0)
        assert [c.forward_share for c in cs] == [share, share]
        phases = plan.layer_phases(cs)
        # the two phases add up to the whole step's cost, for any share
        for k in (1, 5, g.K):
            whole = cs[1].total_overhead + k / cs[1].total_speed
            assert phases[0][1][1] + k / phases[0][0][1] + phases[1][1][1] + \
                k / phases[1][0][1] == pytest.approx(whole)
        split = [r["partition"][g.name][n] for n in ("d0", "far")]
        best = min(range(g.K + 1), key=lambda k: phases_time([g.K - k, k], phases))
        assert phases_time(split, phases) == pytest.approx(
            phases_time([g.K - best, best], phases))
        assert r["layers"][g.name]["conv_s"] == pytest.approx(phases_time(split, phases))


def test_link_figures_are_those_of_pyhet_links():
    link = plan.parse_link("8mbit@2ms")
    assert link == Link(0.002, 1e6)
    cluster = plan.build_cluster(NET, N, described=plan.parse_describe("a:gflops=1"),
                                 default_link=link)
    for i, g in enumerate(NET.blocks):
        assert (cluster.costs[g.name][0].link_fixed, cluster.costs[g.name][0].link_per_kernel) \
            == link_cost(link, g, N, need_dx=i > 0)


def test_a_calibrated_device_behind_a_link():
    """--describe NAME:bw=...,lat=... with NAME a calibrated device puts that device behind the
    link (as a rank of this machine would be): its compute as calibrated, with the others, plus
    its link's figures; like= of it takes its compute without the link."""
    names, c = cal({"conv1": [1000.0, 1100.0], "conv2": [300.0, 320.0]})
    link = Link(plan.parse_latency("100us"), 125e6)
    cluster = plan.build_cluster(NET, N, (names, c), plan.parse_describe(
        "d1:bw=1gbit,lat=100us;twin:like=d1"))
    assert cluster.names == ["d0", "d1", "twin"] and cluster.links == [None, link, None]
    for i, g in enumerate(NET.blocks):
        d1, twin = cluster.costs[g.name][1], cluster.costs[g.name][2]
        assert (d1.link_fixed, d1.link_per_kernel) == link_cost(link, g, N, need_dx=i > 0)
        assert d1.speed == twin.speed == c.speeds[g.name][1]
        assert (twin.link_fixed, twin.link_per_kernel) == (0.0, 0.0)


def host_group():
    """(fits, contention, speeds, Calibration) of two devices calibrated as one host group
    (sharing their im2col: its fixed time folded into their speeds)."""
    from pyhet.calibrate import Calibration

    fits = {"conv1": [[0.001, 0.004, 1], [0.002, 0.004, 1]],
            "conv2": [[0.003, 0.010, 1], [0.003, 0.010, 1]]}
    contention = {"conv1": [1.0, 1.0], "conv2": [1.5, 1.5]}
    speeds = {g.name: [1.0 / (f[0] + f[1] / g.K) for f in fits[g.name]] for g in NET.blocks}
    c = Calibration(speeds, {k: [0.0, 0.0] for k in speeds}, {k: [99, 99] for k in speeds},
                    None, contention, fits)
    return fits, contention, speeds, c


def test_a_described_device_without_kernels_leaves_the_plan_as_it_was():
    """The layers' times in steps (Calibration.in_step, in_step_alone, waits) were dropped where
    a described device joined the calibrated ones: one that took no kernel made the plan 20%
    faster (a pair of cpu:1 at batch 16, 9.74 -> 7.68 ms). The calibrated devices carry them in
    their figures there; a copy of one on this machine too; a described device not."""
    _, _, _, c = host_group()
    pure = plan.build_cluster(NET, N, (["d0", "d1"], c))
    timed = plan.partition_of(pure, NET, N)
    c = replace(c, waits={"conv1": 1.1},
                in_step={layer: (counts, 1.3 * plan.layer_seconds(
                    pure.costs[layer], counts, plan.own_costs(pure, layer),
                    1.1 if layer == "conv1" else 1.0)) for layer, counts in timed.items()},
                in_step_alone={"conv1": ([8, 0], 1.4 * plan._alone_s(
                    plan.own_costs(pure, "conv1")[0], 8)), "conv2": ([0, 12], 1.6 * plan._alone_s(
                        plan.own_costs(pure, "conv2")[1], 12))})
    pure = plan.build_cluster(NET, N, (["d0", "d1"], c))
    assert pure.in_step == pytest.approx({"conv1": 1.3, "conv2": 1.3})
    want = plan.plan(pure, NET, N, master_gflops=1.0)
    beside = plan.build_cluster(NET, N, (["d0", "d1"], c), plan.parse_describe("x:gflops=1e-6"))
    got = plan.plan(beside, NET, N, master_gflops=1.0)
    assert [list(p.values())[2] for p in got["partition"].values()] == [0, 0]
    # the partition that ran is predicted at its time in steps either way (beside x, the
    # host group's fixed work is carried apart from its kernels: another model, whose plan
    # may differ by a kernel)
    seconds = {layer: t for layer, (_, t) in c.in_step.items()}
    assert plan.conv_seconds(pure, NET, timed) == pytest.approx(seconds, rel=1e-9)
    assert plan.conv_seconds(beside, NET, {k: v + [0] for k, v in timed.items()}) == (
        pytest.approx(seconds, rel=1e-9))
    assert got["predicted_step_s"] == pytest.approx(want["predicted_step_s"], rel=0.05)
    assert got["best_single"]["device"] == want["best_single"]["device"]
    assert got["best_single"]["step_s"] == pytest.approx(want["best_single"]["step_s"], rel=1e-9)
    assert all("in_step" in got["layers"][g.name]["devices"][d] and
               "in_step" not in got["layers"][g.name]["devices"]["x"]
               for g in NET.blocks for d in ("d0", "d1"))
    # a copy of d1 carries them as d1 does, here or behind a link (its compute, not its
    # link's time: a copy elsewhere was the best single device, 1.4x faster than d1 alone);
    # where d1 is placed behind one, d0 and d1 carry them (each layer whole on one device at
    # its time alone, as timed: d0's time alone no faster because d1 moved)
    far = plan.build_cluster(NET, N, (["d0", "d1"], c),
                             plan.parse_describe("t:like=d1;u:like=d1,bw=1gbit;v:gflops=1e-6"))
    assert [None if f is None else f["conv2"][1] for f in far.carried] == [
        pytest.approx(1.6)] * 4 + [None]
    assert plan.plan(far, NET, N, master_gflops=1.0)["best_single"]["device"] in ("d0", "d1")
    moved = plan.build_cluster(NET, N, (["d0", "d1"], c), plan.parse_describe("d1:bw=1gbit"))
    assert [{k: v[1] for k, v in f.items()} for f in moved.carried] == [
        pytest.approx({"conv1": 1.4, "conv2": 1.6})] * 2
    assert plan.alone_seconds(moved, NET, 0, 0.0) == pytest.approx(
        plan.alone_seconds(pure, NET, 0, 0.0), rel=1e-9)


def test_a_devices_printed_rate_is_the_same_beside_described_devices():
    """One calibrated device: its cost model folds its fixed work into its speed when alone and
    carries it as an overhead beside a described device; its GFLOP/s (the plan's first line,
    the JSON's devices) was its speed, so the same device showed 112 GFLOP/s alone and 200
    beside one. It is its rate on the whole largest layer, fixed work included, in both, and
    beside a copy of itself."""
    from pyhet.calibrate import Calibration

    fits = {"conv1": [[0.001, 0.004, 1]], "conv2": [[0.003, 0.010, 1]]}
    speeds = {g.name: [1.0 / (fits[g.name][0][0] + fits[g.name][0][1] / g.K)]
              for g in NET.blocks}
    c = Calibration(speeds, {k: [0.0] for k in speeds}, {k: [99] for k in speeds}, None,
                    {k: [1.0] for k in speeds}, fits)
    alone = plan.build_cluster(NET, N, (["d0"], c))
    beside = plan.build_cluster(NET, N, (["d0"], c),
                                plan.parse_describe("x:gflops=1,overhead=1ms"))
    g = NET.blocks[1]                     # the largest layer
    whole_s = fits["conv2"][0][1] + g.K * fits["conv2"][0][0]
    want = g.flops_per_image(need_dx=True) * N / whole_s / 1e9
    # a copy of it on this machine joins its host group, sharing its fixed work: the copy and
    # the device were both shown faster than the device alone (by 60% on the default network)
    copied = plan.build_cluster(NET, N, (["d0"], c), plan.parse_describe("b:like=d0"))
    assert copied.costs["conv2"][0].overhead < fits["conv2"][0][1]       # shared, in the model
    shown = [[d["gflops"] for d in plan.plan(c, NET, N, master_gflops=1.0)["devices"]]
             for c in (alone, beside, copied)]
    assert shown[0][0] == pytest.approx(want, rel=1e-3)     # (the JSON's 4 figures)
    assert shown[1][0] == pytest.approx(want, rel=1e-3)
    assert shown[1][1] == 1.0         # as described, its overhead apart
    assert shown[2] == pytest.approx([want, want], rel=1e-3)
    # the model runs the fc layers at the rate without the fixed work, as before
    per_kernel = g.flops_per_image(need_dx=True) * N / g.K
    assert beside.gflops[0] == pytest.approx(per_kernel / fits["conv2"][0][0] / 1e9)


def test_a_layer_on_one_member_of_a_host_group_pays_the_groups_fixed_work():
    """Beside a described device, each member of a host group carries an equal part of the
    group's fixed work (its im2col). Where one member holds a whole layer it does all of it:
    the plan took it at its part, and so predicted a speedup over itself alone (1.5x, every
    kernel on d0)."""
    from pyhet.calibrate import Calibration

    fits = {"conv1": [[0.001, 0.010, 1], [0.1, 0.010, 1]],
            "conv2": [[0.003, 0.010, 1], [0.3, 0.010, 1]]}
    speeds = {g.name: [1.0 / (f[0] + f[1] / g.K) for f in fits[g.name]] for g in NET.blocks}
    c = Calibration(speeds, {k: [0.0, 0.0] for k in speeds}, {k: [99, 99] for k in speeds},
                    None, {k: [1.0, 1.0] for k in speeds}, fits)
    cluster = plan.build_cluster(NET, N, (["d0", "d1"], c),
                                 plan.parse_describe("x:gflops=1e-6,bw=1mbit"))
    r = plan.plan(cluster, NET, N, master_gflops=10.0)
    for g in NET.blocks:
        assert r["partition"][g.name] == {"d0": g.K, "d1": 0, "x": 0}
        slope, fixed, _ = fits[g.name][0]
        assert r["layers"][g.name]["conv_s"] == pytest.approx(fixed + g.K * slope, rel=1e-3)
    assert r["best_single"]["device"] == "d0"
    assert r["speedup"] == pytest.approx(1.0, rel=1e-3)
    # DDP of one image: one replica, d0, a process of its own doing all its fixed work
    one = plan.build_cluster(NET, 1, (["d0", "d1"], c),
                             plan.parse_describe("x:gflops=1e-6,bw=1mbit"))
    d = plan.plan(one, NET, 1, master_gflops=10.0)["ddp"]
    conv = sum(f[0][1] + g.K * f[0][0] for g, f in ((g, fits[g.name]) for g in NET.blocks))
    assert d["replicas"] == 1 and d["slowest_device"] == "d0"
    assert d["compute_s"] == pytest.approx(conv + plan.fc_flops(NET, 1) / (one.gflops[0] * 1e9),
                                           rel=1e-3)


def test_a_moved_device_pays_its_own_fixed_work():
    """Calibrated as one host group, two devices share their im2col (its fixed time folded into
    their speeds). Moved behind a link, a device pays its whole fixed work, and so does the one
    that stays; with a described device beside them, the two share it, half each, and described
    copies of a member on this machine share it too, while those on another machine pay all of
    it."""
    fits, contention, speeds, c = host_group()
    alone = plan.build_cluster(NET, N, (["d0", "d1"], c))
    assert [x.speed for x in alone.costs["conv2"]] == speeds["conv2"]      # as calibrated
    moved = plan.build_cluster(NET, N, (["d0", "d1"], c), plan.parse_describe("d1:bw=1gbit"))
    beside = plan.build_cluster(NET, N, (["d0", "d1"], c), plan.parse_describe("x:gflops=1"))
    for g in NET.blocks:
        (s0, f0, _), (s1, f1, _) = fits[g.name]
        k = contention[g.name][0]
        d0, d1 = moved.costs[g.name]
        assert (d0.speed, d0.overhead) == pytest.approx((1 / (s0 * k), f0 * k))
        assert (d1.speed, d1.overhead) == pytest.approx((1 / (s1 * k), f1 * k))
        assert d1.link_fixed > 0 and d0.link_fixed == 0
        b0, b1, _ = beside.costs[g.name]
        assert (b0.overhead, b1.overhead) == pytest.approx((f0 * k / 2, f1 * k / 2))
        # copies of d0: on this machine they join the group; on another, each does its own
        local, far = (plan.build_cluster(NET, N, (["d0", "d1"], c), plan.parse_describe(
            f"x:like=d0,count=2{link}")).costs[g.name] for link in ("", ",bw=1gbit"))
        assert [x.overhead for x in local] == pytest.approx([f0 * k / 4, f1 * k / 4,
                                                             f0 * k / 4, f0 * k / 4])
        assert [x.overhead for x in far] == pytest.approx([f0 * k / 2, f1 * k / 2,
                                                           f0 * k, f0 * k])


@pytest.mark.parametrize("describe", [None, "x:like=d0", "x:like=d0,count=2;y:gflops=1e-3",
                                      "x:like=d0,bw=1gbit"])
def test_the_best_single_device_pays_its_whole_fixed_work(describe):
    """Alone, a device of a host group does its own im2col and col2im: its time is its fits'
    (fixed work and per-kernel time alone), however many devices share that work in the
    cluster (it was the cluster's share of it, a third with two copies beside it)."""
    fits, contention, speeds, c = host_group()
    described = () if describe is None else plan.parse_describe(describe)
    r = plan.plan(plan.build_cluster(NET, N, (["d0", "d1"], c), described), NET, N,
                  master_gflops=1e6)
    alone = r["master_s"] + sum(fits[g.name][0][1] + g.K * fits[g.name][0][0]
                                for g in NET.blocks)
    assert r["best_single"]["device"] in ("d0", "x", "x.0")   # x: a copy of d0, as fast
    assert r["best_single"]["step_s"] == pytest.approx(alone, rel=1e-6)


def test_a_device_calibrated_on_another_rank_keeps_its_rank_and_link():
    """Calibrated under mpiexec, a device of another rank is its rank's compute (the
    calibration's compute figures, its rank's group sharing its fixed work) behind the link the
    plan measured, its per-kernel traffic counted once per member of its rank's group; with
    described devices beside it, it stays as calibrated; a described link of its own
    (NAME:bw=...) takes the measured one's place, its fixed work then its own."""
    from pyhet.calibrate import Calibration

    fits = {"conv1": [[0.001, 0.004, 1], [0.002, 0.006, 0]],
            "conv2": [[0.003, 0.010, 1], [0.004, 0.012, 0]]}
    contention = {"conv1": [1.2, 1.4], "conv2": [1.3, 1.5]}
    parts = {layer: [None, {"compute_kernels_per_s": 1.0 / (f[1][0] * contention[layer][1]),
                            "compute_overhead_s": f[1][1] * contention[layer][1] / 2,
                            "link_fixed_s": 0.5, "link_s_per_kernel": 0.5}]
             for layer, f in fits.items()}
    # the calibration's speeds of d1 hold its link too: the plan must not take them
    speeds = {k: [1.0 / (f[0][0] * contention[k][0]), 1.0] for k, f in fits.items()}
    c = Calibration(speeds, {k: [0.0, 9.0] for k in speeds}, {k: [99, 99] for k in speeds},
                    parts, contention, fits)
    measured = Link(2e-4, 50e6)
    ranked = {"d1": (measured, 2)}
    for described in ((), plan.parse_describe("x:gflops=1")):
        cluster = plan.build_cluster(NET, N, (["d0", "d1"], c), described, ranked=ranked)
        assert cluster.links[:2] == [None, measured]
        for i, g in enumerate(NET.blocks):
            d1 = cluster.costs[g.name][1]
            part = parts[g.name][1]
            assert (d1.speed, d1.overhead) == pytest.approx(
                (part["compute_kernels_per_s"], part["compute_overhead_s"]))
            fixed, per = link_cost(measured, g, N, need_dx=i > 0)
            assert (d1.link_fixed, d1.link_per_kernel) == pytest.approx((fixed, 2 * per))
            assert d1.contention == contention[g.name][1]
    own = Link(plan.parse_latency("50us"), 125e6)
    moved = plan.build_cluster(NET, N, (["d0", "d1"], c), plan.parse_describe("d1:bw=1gbit"),
                               ranked=ranked)
    assert moved.links == [None, own]
    for i, g in enumerate(NET.blocks):
        d1 = moved.costs[g.name][1]
        slope, intercept, _ = fits[g.name][1]
        k = contention[g.name][1]
        assert (d1.speed, d1.overhead) == pytest.approx((1 / (slope * k), intercept * k))
        assert (d1.link_fixed, d1.link_per_kernel) == link_cost(own, g, N, need_dx=i > 0)


def test_a_rank_devices_layers_in_steps_are_taken_behind_their_measured_links():
    """Under mpiexec the layers' times in steps were dropped: a short network split over two
    ranks of cpu:1 on one machine ran 27 ms a step where the plan said 18-19 ms (every phase
    of a split layer waits on its messages there and back). They are kept where the devices
    of other ranks stay behind their measured links, so the partition that ran is predicted
    at its time in steps, its waits with it; a described link of a rank's device's own drops
    them (the steps did not run behind it)."""
    from pyhet.calibrate import Calibration

    fits = {"conv1": [[0.001, 0.004, 1], [0.002, 0.006, 0]],
            "conv2": [[0.003, 0.010, 1], [0.004, 0.012, 0]]}
    parts = {layer: [None, {"compute_kernels_per_s": 1.0 / f[1][0],
                            "compute_overhead_s": f[1][1], "link_fixed_s": 0.001,
                            "link_s_per_kernel": 0.0001}]
             for layer, f in fits.items()}
    speeds = {k: [1.0 / f[0][0], 1.0 / (f[1][0] + 0.0001)] for k, f in fits.items()}
    c = Calibration(speeds, {k: [0.0, f[1][1] + 0.001] for k, f in fits.items()},
                    {k: [99, 99] for k in speeds}, parts, {k: [1.0, 1.0] for k in speeds},
                    fits, waits={"conv1": 1.2})
    ranked = {"d1": (Link(1e-4, 1e9), 1)}
    bare = plan.build_cluster(NET, N, (["d0", "d1"], c), ranked=ranked)
    ran = {"conv1": [5, 3], "conv2": [7, 5]}
    timed = {layer: (counts, 1.5 * plan.layer_seconds(
        bare.costs[layer], counts, plan.own_costs(bare, layer), 1.2 if layer == "conv1" else 1.0))
        for layer, counts in ran.items()}
    c = replace(c, in_step=timed)
    cluster = plan.build_cluster(NET, N, (["d0", "d1"], c), ranked=ranked)
    assert cluster.waits == {"conv1": 1.2}
    assert cluster.in_step == pytest.approx({"conv1": 1.5, "conv2": 1.5})
    assert plan.conv_seconds(cluster, NET, ran) == pytest.approx(
        {layer: t for layer, (_, t) in timed.items()}, rel=1e-9)
    moved = plan.build_cluster(NET, N, (["d0", "d1"], c), plan.parse_describe("d1:bw=1gbit"),
                               ranked=ranked)
    assert (moved.in_step, moved.waits, moved.carried) == (None, None, None)
    # a described device beside them: the factors would go into the compute's figures alone,
    # where d1's holds its messages' time too: none is taken
    beside = plan.build_cluster(NET, N, (["d0", "d1"], c), plan.parse_describe("x:gflops=1e-6"),
                                ranked=ranked)
    assert (beside.in_step, beside.carried) == (None, None)


def test_alone_a_device_has_no_contention_but_its_typical_time():
    """The calibrated speeds of several devices are those of the devices computing together
    (contention); a device alone is taken without it, at its typical time alone (its
    whole-layer factor: its spread). A single device's contention is its own typical time over
    its best: alone, it keeps it, so its plan is its best single device."""
    names, c = cal({"conv1": [1000.0], "conv2": [300.0]})
    c.contention = {"conv1": [2.0], "conv2": [2.0]}
    r = plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N, master_gflops=1e6)
    conv = sum(g.K / c.speeds[g.name][0] for g in NET.blocks)
    assert r["predicted_conv_s"] == pytest.approx(conv, rel=1e-6)
    assert r["best_single"]["step_s"] == pytest.approx(conv + r["master_s"], rel=1e-6)
    assert r["speedup"] == pytest.approx(1.0)
    names, c = cal({"conv1": [1000.0, 500.0], "conv2": [300.0, 100.0]})
    c.contention = {"conv1": [2.0, 2.0], "conv2": [2.0, 2.0]}
    c.whole = {"conv1": [1.1, 1.0], "conv2": [1.1, 1.0]}
    r = plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N, master_gflops=1e6)
    alone = sum(g.K / c.speeds[g.name][0] / 2 * 1.1 for g in NET.blocks)
    assert r["best_single"] == {"device": "d0", "step_s": pytest.approx(alone + r["master_s"])}


def test_the_whole_layer_factor_counts_only_where_a_device_runs_the_whole_layer():
    """A device whose whole layer runs faster than its model (calibration's whole-layer factor,
    here 0.9: its GEMM takes Strassen's scheme there) computes it in 0.9 of its model's time,
    alone or as the only device; its share of a split, and its copies' shares (like=), run at
    the model's rate."""
    names, c = cal({"conv1": [1000.0], "conv2": [300.0]})
    c.whole = {"conv1": [1.0], "conv2": [0.9]}
    cluster = plan.build_cluster(NET, N, (names, c))
    r = plan.plan(cluster, NET, N, master_gflops=1e6)
    conv2 = NET.blocks[1]
    assert r["layers"]["conv2"]["conv_s"] == pytest.approx(0.9 * conv2.K / 300.0, rel=1e-6)
    assert r["best_single"]["step_s"] == pytest.approx(
        NET.blocks[0].K / 1000.0 + 0.9 * conv2.K / 300.0 + r["master_s"], rel=1e-6)
    pair = plan.build_cluster(NET, N, (names, c), [plan.Described("x", like="d0")])
    r2 = plan.plan(pair, NET, N, master_gflops=1e6)
    counts = [r2["partition"]["conv2"][n] for n in ("d0", "x")]
    assert all(counts) and r2["layers"]["conv2"]["conv_s"] == pytest.approx(
        max(counts) / 300.0, rel=1e-6)


@pytest.mark.parametrize("link", [None, "1tbit"])
def test_a_device_slower_typically_than_at_its_best_is_so_in_a_share_too(link):
    """A whole-layer factor above 1 (a device's typical time over the best time its model
    gives) holds for a share as for the whole layer: the device and a copy of it (like=) each
    take a share at 1.2 times the model's rate, and the pair is not predicted more than twice
    as fast as the device alone (it was 2.27x for a calibrated cpu:1 and its copy, whose
    shares ran at the best time and the device alone at its typical time)."""
    speedups = []
    for slower in (None, 1.3):
        names, c = cal({"conv1": [1000.0], "conv2": [300.0]})
        c.whole = {"conv1": [1.2], "conv2": [1.2]}
        if slower:   # a single device's: its typical time over its best at its short trial
            c.contention = {"conv1": [slower], "conv2": [slower]}
        copy = "x:like=d0" + ("" if link is None else f",bw={link},lat=0")
        pair = plan.build_cluster(NET, N, (names, c), plan.parse_describe(copy))
        r = plan.plan(pair, NET, N, master_gflops=1e6)
        alone = plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N, master_gflops=1e6)
        for g in NET.blocks:
            counts = [r["partition"][g.name][n] for n in ("d0", "x")]
            assert all(counts)
            speed = c.speeds[g.name][0] * (slower or 1)       # its best
            assert r["layers"][g.name]["conv_s"] >= 1.2 * max(counts) / speed * 0.999
        assert r["predicted_step_s"] >= alone["predicted_step_s"] / 2 * 0.999
        assert r["speedup"] <= 2.0
        speedups.append(r["speedup"])
    # the typical time at the trial is not counted on top of the whole layer's
    assert speedups[0] == pytest.approx(speedups[1], rel=1e-6)


def test_devices_calibrated_together_take_their_shares_as_their_trial_timed_them():
    """The host group's devices calibrated together (no device of another rank) ran their
    shares in a trial of the layer as a step runs it: their contention is their shares' time
    there, and the plan prices a split at it, as training's prediction does, even where it is
    below their whole-layer factor (a share taking Strassen's scheme that the fit's trials did
    not: the plan of a calibrated pair was 9-10% slow on max(c, w)). A device outside the
    host group (a GPU), or beside described devices, keeps the share no faster than its
    typical time alone."""
    from pyhet.calibrate import Calibration

    names = ["d0", "d1"]
    layers = [g.name for g in NET.blocks]
    for group, factor in ((1, 1.0), (0, 1.03 / 0.94)):
        c = Calibration({n: [500.0, 250.0] for n in layers}, {n: [0.0, 0.0] for n in layers},
                        {g.name: [g.K] * 2 for g in NET.blocks},
                        contention={n: [0.94, 0.94] for n in layers},
                        fits={n: [[1 / (500 * 0.94), 0.0, group], [1 / (250 * 0.94), 0.0, group]]
                              for n in layers},
                        whole={n: [1.03, 1.03] for n in layers})
        r = plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N, master_gflops=1e6)
        for g in NET.blocks:
            counts = [r["partition"][g.name][n] for n in names]
            assert all(counts)
            assert r["layers"][g.name]["conv_s"] == pytest.approx(
                c.predicted(g.name, counts) * factor, rel=1e-6)
            if group:
                assert counts == c.partition(g.name, g.K)
        # a described device joining (here too slow for a kernel): the shares are no longer
        # those timed, and take the larger factor
        joined = plan.plan(plan.build_cluster(NET, N, (names, c),
                                              plan.parse_describe("x:gflops=0.000001")),
                           NET, N, master_gflops=1e6)
        for g in NET.blocks:
            counts = [joined["partition"][g.name][n] for n in names]
            assert joined["partition"][g.name]["x"] == 0
            assert joined["layers"][g.name]["conv_s"] == pytest.approx(
                c.predicted(g.name, counts) * 1.03 / 0.94, rel=1e-6)


def test_a_device_with_the_whole_layer_shows_the_time_the_layer_takes():
    """Per device, `compute_s` (with its link's seconds) is what the layer takes where it has
    the whole layer, alone or among several: its typical time alone, not its shared rate."""
    names, c = cal({"conv1": [1000.0, 10.0], "conv2": [300.0, 1.0]})
    c.contention = {"conv1": [1.5, 1.5], "conv2": [1.5, 1.5]}
    c.whole = {"conv1": [1.2, 1.0], "conv2": [1.2, 1.0]}
    for cluster in (plan.build_cluster(NET, N, (names, c)),
                    plan.build_cluster(NET, N, (names, c), plan.parse_describe("d0:bw=1gbit"))):
        r = plan.plan(cluster, NET, N, master_gflops=1e6)
        for g in NET.blocks:
            layer = r["layers"][g.name]
            assert layer["devices"]["d0"]["kernels"] == g.K   # d1 is far too slow to share
            row = layer["devices"]["d0"]
            assert row["compute_s"] + row["link_s"] == pytest.approx(layer["conv_s"], rel=1e-6)
            assert row["compute_s"] == pytest.approx(g.K / c.speeds[g.name][0] / 1.5 * 1.2,
                                                     rel=1e-6)


def test_every_devices_compute_is_rebuilt_from_its_row():
    """README: a share's compute_s is (overhead_s + kernels / kernels_per_s) times in_step; the
    whole layer's, that over its contention, times whole_layer and in_step. The whole-layer
    factor was not in the row, so its compute_s could not be rebuilt (off by it: 2 here)."""
    names, c = cal({"conv1": [1000.0, 900.0], "conv2": [300.0, 1.0]}, {"conv1": [1e-4, 2e-4],
                                                                     "conv2": [1e-4, 1e-4]})
    c.contention = {"conv1": [1.5, 1.3], "conv2": [1.5, 1.5]}
    c.whole = {"conv1": [1.2, 1.0], "conv2": [2.0, 1.0]}
    r = plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N, master_gflops=1e6)
    whole = shared = 0
    for g in NET.blocks:
        layer = r["layers"][g.name]
        for row in layer["devices"].values():
            if not row["kernels"]:
                continue
            t = (row["overhead_s"] + row["kernels"] / row["kernels_per_s"]) * layer.get(
                "in_step", 1.0)
            if row["kernels"] == g.K:
                t *= row["whole_layer"] / row["contention"]
                whole += 1
            else:
                shared += 1
            assert row["compute_s"] == pytest.approx(t, rel=1e-3), (g.name, row)
    assert whole and shared, r["layers"]


def test_a_single_ddp_replica_is_the_first_of_equals():
    """Two devices of one speed, the second behind a link: the first is the replica (the
    second was, by a rounding of its compute: (x + link) - link a hair below x)."""
    net = arch.build("2C5-P2", (3, 32, 32), 10)
    for link in ("1gbit", "10gbit", "3mbit"):
        cluster = plan.build_cluster(net, 1, described=plan.parse_describe(
            f"a:gflops=10;b:gflops=10,bw={link}"))
        d = plan.ddp(cluster, net, 1)
        assert d["replicas"] == 1 and d["slowest_device"] == "a", (link, d)


def test_master_bottleneck():
    huge = arch.build("2C3-P2-2C3-P2-4096N", (1, 12, 12), 10)
    cluster = plan.build_cluster(huge, N, described=plan.parse_describe("a:gflops=100"))
    assert plan.plan(cluster, huge, N, master_gflops=0.01)["bottleneck"] == "master"


def test_a_timed_master_is_its_measured_time():
    """Where the master was timed here (Calibration.master_s), its time is the plan's master
    term and sets the rate a DDP replica that computes like this machine's CPU cores runs its
    fc layers at (its own rate times the one the master reached over the calibrated CPU
    devices'); --master-gflops still gives the FLOP model."""
    M = 1e-5   # the master's measured seconds
    names, c = cal({"conv1": [4000.0, 2000.0], "conv2": [900.0, 450.0]})
    timed = plan.build_cluster(NET, N, (names, replace(c, master_s=M, cpu_like=[True, True])))
    r = plan.plan(timed, NET, N)
    assert r["master_timed"] is True and r["master_s"] == pytest.approx(M)
    assert r["predicted_step_s"] == pytest.approx(r["predicted_conv_s"] + M, rel=1e-6)
    fc = plan.fc_flops(NET, N)
    assert r["master_gflops"] == pytest.approx(fc / M / 1e9, rel=1e-3)
    assert r["best_single"]["step_s"] == pytest.approx(
        sum(g.K / s for g, s in zip(NET.blocks, (4000.0, 900.0))) + M, rel=1e-6)
    # the replicas: each device's fc layers at its rate times the master's measured over the
    # rate of the master's devices together (both local: the sum of their rates)
    rate = fc / M / sum(d["gflops"] * 1e9 for d in r["devices"])
    d = plan.ddp(timed, NET, N, fc_rate=rate)
    assert r["ddp"]["step_s"] == pytest.approx(d["step_s"], rel=1e-6)
    slow = 1   # d1, the slower replica: half of every layer's kernels' work on N / 2 images
    conv = sum(g.K / ({"conv1": 2000.0, "conv2": 450.0}[g.name] * 2) for g in NET.blocks)
    fc_s = fc / 2 / (r["devices"][slow]["gflops"] * 1e9 * rate)
    assert d["compute_s"] == pytest.approx(conv + fc_s, rel=1e-3)
    # the FLOP model where --master-gflops is given, or where the master was not timed
    for r2 in (plan.plan(timed, NET, N, master_gflops=10.0),
               plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N, master_gflops=10.0)):
        assert r2["master_timed"] is False
        assert r2["master_s"] == pytest.approx(fc / 10e9, rel=1e-6)
    untimed = plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N)
    assert untimed["master_timed"] is False
    assert untimed["master_s"] == pytest.approx(
        fc / (sum(d["gflops"] for d in untimed["devices"]) * 1e9), rel=1e-3)
    # the timed master stays with the cluster when a device moves behind a link
    assert timed.without_links([0]).master_s == M
    # the fc rate is set against the calibrated CPU devices only: beside a GPU (not cpu-like)
    # and a described device, the CPU device's replica still runs its fc layers at the rate
    # the master showed over it, the others at their GFLOP/s
    mixed = plan.build_cluster(NET, N, (names, replace(c, master_s=M, cpu_like=[True, False])),
                               plan.parse_describe("far:gflops=7,bw=1gbit;twin:like=d0"))
    assert mixed.cpu_like == [True, False, False, True]
    assert mixed.cpu_gflops == pytest.approx(mixed.gflops[0])
    rate = fc / M / 1e9 / mixed.gflops[0]
    n = 4
    d = plan.ddp(mixed, NET, N, fc_rate=rate)
    r = plan.plan(mixed, NET, N)
    assert r["ddp"]["step_s"] == pytest.approx(d["step_s"], rel=1e-6)
    for i, share in enumerate((rate, 1.0, 1.0, rate)):
        conv_i = sum(mixed.costs[g.name][i].overhead + g.K / (mixed.costs[g.name][i].speed * n)
                     for g in NET.blocks)
        assert d["replica_compute_s"][i] == pytest.approx(
            conv_i + fc / n / (mixed.gflops[i] * share * 1e9), rel=1e-9)


def test_time_head_times_the_masters_work():
    from pyhet.backends.numpy_ref import NumpyBackend
    from pyhet.model import time_head

    wide = arch.build("2C3-P2-2C3-P2-512N", (1, 12, 12), 10)
    small = time_head(NET, N, NumpyBackend(), rounds=3, budget_s=0.05)
    big = time_head(wide, 64, NumpyBackend(), rounds=3, budget_s=0.05)
    assert 0 < small < big < 10
    # the head trains: its loss falls on a fixed batch (the same code as Net's step)
    from pyhet.model import Head
    from pyhet.optim import SGDConfig
    rng = np.random.default_rng(1)
    params = {k: (rng.standard_normal(s) * 0.05).astype(np.float32)
              for k, s in wide.param_shapes().items() if k.startswith("fc")}
    head = Head(wide, params, NumpyBackend())
    h = rng.standard_normal((8, *wide.blocks[-1].out_shape)).astype(np.float32)
    labels = rng.integers(0, 10, 8)
    losses = []
    for _ in range(20):
        loss, dh = head.train(h, labels)
        head.update(SGDConfig(lr=0.05))
        losses.append(float(loss))
    assert dh.shape == h.shape and losses[-1] < 0.5 * losses[0]


def test_the_masters_work_is_timed_inside_steps(monkeypatch):
    """The plan's master term for a short step is timed inside training steps on the devices
    with their partition (a master that has waited for the conv layers runs its own work
    slower than in a loop of its own): the step less its conv layers' calls. Here the fc work
    is made 5 ms longer and each conv layer's forward 50 ms longer: the figure moves by the
    first, not the second. A step predicted longer than IN_STEP_MAX_S is not run (None). The
    devices hold no shard after."""
    import time
    from pyhet.devices import make_devices
    from pyhet.model import IN_STEP_MAX_S, Head, time_in_step
    from pyhet.parallel import PartitionedConv
    from pyhet.specs import parse_devices
    from pyhet.train import host_backend

    devices = make_devices(parse_devices("cpu:1,cpu:1"))
    partition = {g.name: [g.K // 2, g.K - g.K // 2] for g in NET.blocks}
    try:
        host = host_backend(devices)
        # (medians of 7: a stall of a loaded machine in a step moves none of them)
        base, layers = time_in_step(NET, N, devices, partition, host, 0.01, rounds=7,
                                    budget_s=0.0)
        assert 0 < base < 0.05 and set(layers) == {"conv1", "conv2"}
        assert all(0 < t < 0.05 for t in layers.values())
        train, forward = Head.train, PartitionedConv.forward
        monkeypatch.setattr(Head, "train", lambda self, h, labels: (time.sleep(0.005),
                                                                    train(self, h, labels))[1])
        monkeypatch.setattr(PartitionedConv, "forward", lambda self, x: (time.sleep(0.05),
                                                                         forward(self, x))[1])
        slow, slow_layers = time_in_step(NET, N, devices, partition, host, 0.01, rounds=7,
                                         budget_s=0.0)
        assert 0.005 <= slow < base + 0.045      # (a forward's 50 ms counted there: 0.1)
        # each conv layer's calls are its own: its forward's 50 ms, not the master's 5
        assert all(0.05 <= slow_layers[k] < layers[k] + 0.05 + 0.045 for k in layers)
        assert time_in_step(NET, N, devices, partition, host, IN_STEP_MAX_S * 1.01) is None
        assert all(not d._shards for d in devices)
    finally:
        for d in devices:
            d.close()


def test_the_plan_takes_the_master_in_steps_where_it_can(monkeypatch):
    """calibrate_spec's master term is the in-step figure where there is one, else the master
    timed on its own (head_s, kept beside it either way): where the step cannot run (the
    devices' memory holds no whole layer, a device fails) the plan goes on with that."""
    import pyhet.report as report
    from pyhet.calibrate import Calibration
    from pyhet.errors import DeviceError

    monkeypatch.setattr(report, "time_head", lambda net, batch, host: 0.002)
    monkeypatch.setattr(report, "time_in_step",
                        lambda *a, **k: (0.005, {"conv1": 0.003, "conv2": 0.004}))
    _, cal = report.calibrate_spec("cpu:1", NET, N)
    assert (cal.master_s, cal.head_s) == (0.005, 0.002)
    # the conv layers' times in those steps go beside it, with the partition they ran
    assert cal.in_step == {"conv1": ([8], 0.003), "conv2": ([12], 0.004)}
    # in_step False: no step is run
    _, cal = report.calibrate_spec("cpu:1", NET, N, in_step=False)
    assert (cal.master_s, cal.head_s, cal.in_step) == (0.002, 0.002, None)

    def fails(*a, **k):
        raise DeviceError("d0 failed")
    monkeypatch.setattr(report, "time_in_step", fails)
    _, cal = report.calibrate_spec("cpu:1", NET, N)
    assert (cal.master_s, cal.head_s, cal.in_step) == (0.002, 0.002, None)
    monkeypatch.setattr(Calibration, "partition", lambda self, layer, total, caps=None: (
        _ for _ in ()).throw(ValueError("the devices' memory holds 6 kernels of this layer")))
    _, cal = report.calibrate_spec("cpu:1", NET, N)
    assert (cal.master_s, cal.head_s) == (0.002, 0.002)


def test_the_layers_in_steps_are_kept_with_devices_of_other_ranks_too(monkeypatch):
    """Under mpiexec (calibrate_ranks) the master and the layers are timed in steps as here,
    a device of another rank behind its link as in training: a short layer split over ranks
    waits on every phase's messages, which the model's figures of the devices and links do
    not carry (pyhet.plan.build_cluster keeps the factors unless a described device joins)."""
    import types

    import pyhet.report as report
    from pyhet.links import Link

    monkeypatch.setattr(report, "time_head", lambda net, batch, host: 0.002)
    monkeypatch.setattr(report, "time_in_step",
                        lambda *a, **k: (0.005, {"conv1": 0.003, "conv2": 0.004}))
    _, c = cal({"conv1": [4000.0, 2000.0], "conv2": [900.0, 450.0]})
    here = [types.SimpleNamespace(kind="cpu", link=None) for _ in range(2)]
    got = report._with_master(c, NET, N, here)
    assert (got.master_s, got.head_s) == (0.005, 0.002)
    assert set(got.in_step) == {"conv1", "conv2"}
    ranked = [here[0], types.SimpleNamespace(kind="cpu", link=Link(1e-4, 1e9))]
    got = report._with_master(c, NET, N, ranked)
    assert (got.master_s, got.head_s) == (0.005, 0.002)
    assert set(got.in_step) == {"conv1", "conv2"}


def test_a_layer_split_in_steps_is_timed_whole_on_its_fastest_device_too(monkeypatch):
    """Where the calibration's partition splits a layer, _with_master times other steps with
    that layer whole on the device predicted fastest at it alone (whose memory holds it):
    a device alone makes no hand-off between devices, so it takes that time (in_step_alone),
    not the split's. None where no layer is split, or where those steps do not run; with a
    device of another rank too."""
    import types

    import pyhet.report as report
    from pyhet.errors import DeviceError
    from pyhet.links import Link

    ran = []

    def in_step(net, batch, devices, partition, host, predicted_s, **k):
        ran.append({k: list(v) for k, v in partition.items()})
        return 0.005, {"conv1": 0.003 * len(ran), "conv2": 0.004 * len(ran)}
    monkeypatch.setattr(report, "time_head", lambda net, batch, host: 0.002)
    monkeypatch.setattr(report, "time_in_step", in_step)
    speeds = {"conv1": [4000.0, 2000.0], "conv2": [900.0, 1800.0]}
    _, c = cal(speeds)
    c = replace(c, fits={k: [[1 / v, 0.0, 0] for v in vs] for k, vs in speeds.items()})
    split = {g.name: c.partition(g.name, g.K) for g in NET.blocks}
    assert all(min(v) > 0 for v in split.values())     # both layers split
    here = [types.SimpleNamespace(kind="cpu", link=None) for _ in range(2)]
    got = report._with_master(c, NET, N, here)
    assert ran == [split, {"conv1": [8, 0], "conv2": [0, 12]}]
    assert got.in_step == {"conv1": (split["conv1"], 0.003), "conv2": (split["conv2"], 0.004)}
    assert got.in_step_alone == {"conv1": ([8, 0], 0.006), "conv2": ([0, 12], 0.008)}
    # d1's memory holds no whole conv2: it goes whole on d0; where neither's does, it stays
    for caps, whole in (([10**9, 11], [12, 0]), ([11, 11], None)):
        ran.clear()
        capped = replace(c, caps={"conv1": [10**9] * 2, "conv2": caps})
        split2 = {g.name: capped.partition(g.name, g.K) for g in NET.blocks}
        got = report._with_master(capped, NET, N, here)
        assert ran == [split2, {"conv1": [8, 0], "conv2": whole or split2["conv2"]}]
        assert got.in_step_alone == {"conv1": ([8, 0], 0.006),
                                     **({"conv2": (whole, 0.008)} if whole else {})}
    # the second steps fail: the split's times stay
    ran.clear()

    def second_fails(*a, **k):
        if ran:
            raise DeviceError("d1 failed")
        return in_step(*a, **k)
    monkeypatch.setattr(report, "time_in_step", second_fails)
    got = report._with_master(c, NET, N, here)
    assert (len(ran), got.in_step_alone) == (1, None)
    assert set(got.in_step) == {"conv1", "conv2"}
    monkeypatch.setattr(report, "time_in_step", in_step)
    # a device of another rank: both, as here
    ran.clear()
    far = [here[0], types.SimpleNamespace(kind="cpu", link=Link(1e-4, 1e9))]
    got = report._with_master(c, NET, N, far)
    assert len(ran) == 2 and set(got.in_step) == {"conv1", "conv2"}
    assert set(got.in_step_alone) == {"conv1", "conv2"}
    # no layer split (one device): no second steps
    ran.clear()
    _, one = cal({"conv1": [4000.0], "conv2": [900.0]})
    got = report._with_master(one, NET, N, here[:1])
    assert (len(ran), got.in_step_alone) == (1, None)
    assert set(got.in_step) == {"conv1", "conv2"}


def test_master_gflops_still_takes_the_conv_layers_at_their_time_in_steps(cli, monkeypatch):
    """pyhet plan --master-gflops G replaces the master's timed work by the fc layers' FLOPs
    at G, but still runs the steps that time each conv layer, and takes their factors; where
    described devices join, the calibrated device carries them in its figures."""
    import pyhet.report as report

    ran = []

    def in_step(net, batch, devices, partition, host, predicted_s, **k):
        ran.append(partition)   # a master of 0.5 s, each layer 100 s: a factor of 4 (clamped)
        return 0.5, {g.name: 100.0 for g in net.blocks}
    monkeypatch.setattr(report, "time_in_step", in_step)
    argv = ["plan", "--devices", "cpu:1", "--kernels", "4,6", "--dataset", "synthetic",
            "--batch-size", "2", "--json"]
    res = cli(*argv, "--master-gflops", "7")
    assert res.code == 0, res.err
    r = json.loads(res.out.strip().splitlines()[-1])
    assert len(ran) == 1
    assert r["master_timed"] is False and r["master_gflops"] == pytest.approx(7)
    assert r["master_s"] < 0.01    # the fc layers' FLOPs at 7 GFLOP/s, not the 0.5 s timed
    assert {k: v["in_step"] for k, v in r["layers"].items()} == {
        "conv1": plan.IN_STEP_BOUNDS[1], "conv2": plan.IN_STEP_BOUNDS[1]}
    # a described device joins: the steps still time the layers, whose factors the
    # calibrated device carries (the described one not), the layers' own left out
    for extra in (("--master-gflops", "7"), ()):
        res = cli(*argv, *extra, "--describe", "far:gflops=1e-6")
        assert res.code == 0, res.err
        r = json.loads(res.out.strip().splitlines()[-1])
        assert all("in_step" not in v for v in r["layers"].values())
        assert {k: v["devices"]["d0"]["in_step"] for k, v in r["layers"].items()} == {
            "conv1": plan.IN_STEP_BOUNDS[1], "conv2": plan.IN_STEP_BOUNDS[1]}
        assert all("in_step" not in v["devices"]["far"] for v in r["layers"].values())
        assert r["master_s"] == (pytest.approx(0.5) if not extra else r["master_s"])
    assert len(ran) == 3


def test_under_mpiexec_master_gflops_runs_no_steps_where_devices_are_on_other_ranks(
        monkeypatch):
    """Under mpiexec a device of another rank is behind its link, so the layers' times in
    steps are not kept: with --master-gflops the ranks run no timed steps; with every device
    on rank 0 they do, as without MPI. The links are timed together as well unless
    --master-link gives the master's interface."""
    from pyhet import cli as cli_module

    asked, together = [], []

    class Stop(Exception):
        pass

    def calibrate_ranks(spec, net, batch, comm, timeout=None, in_step=True,
                        links_together=True, log=None):
        asked.append(in_step)
        together.append(links_together)
        raise Stop

    class Comm:
        def Get_size(self):
            return 2
    monkeypatch.setattr(cli_module, "calibrate_ranks", calibrate_ranks)
    parser = cli_module.build_parser()
    for devices, gflops, expected in [("0/cpu:1,1/cpu:1", ["--master-gflops", "7"], False),
                                      ("cpu:1", ["--master-gflops", "7"], False),
                                      ("0/cpu:1,1/cpu:1", [], True),
                                      ("0/cpu:1", ["--master-gflops", "7"], True)]:
        args = parser.parse_args(["plan", "--devices", devices, "--kernels", "4,6",
                                  "--dataset", "synthetic", *gflops])
        with pytest.raises(Stop):
            cli_module.cmd_plan(args, parser, Comm())
        assert asked.pop() is expected, devices
    # the links of several ranks timed together too, but alone where the plan is given the
    # master's interface (their shared rates would count it twice)
    assert together == [True] * 4
    for extra, expected in [([], True), (["--master-link", "1gbit"], False),
                            (["--master-link", "links"], False)]:
        args = parser.parse_args(["plan", "--devices", "0/cpu:1,1/cpu:1", "--kernels",
                                  "4,6", "--dataset", "synthetic", *extra])
        with pytest.raises(Stop):
            cli_module.cmd_plan(args, parser, Comm())
        assert together.pop() is expected, extra


def test_a_ddp_replicas_fc_layers_run_at_the_masters_rate_on_its_own():
    """The plan's step takes the master's work as timed in a step (master_s); a DDP
    replica's fc layers, which follow its own conv layers without waiting for devices, the
    master's rate in a loop of its own (head_s)."""
    from pyhet.calibrate import Calibration

    fc_net = arch.build("4C3-P2-256N", (1, 12, 12), 10)   # fc layers that weigh in a step
    speeds = {g.name: [1e4, 1e4] for g in fc_net.blocks}
    base = Calibration(speeds, {g.name: [0.0, 0.0] for g in fc_net.blocks},
                       {g.name: [g.K, g.K] for g in fc_net.blocks}, master_s=0.01,
                       cpu_like=[True, True])
    plans = {}
    for head in (None, 0.01, 0.002):
        cal = replace(base, head_s=head)
        cluster = plan.build_cluster(fc_net, N, calibrated=(["d0", "d1"], cal))
        plans[head] = plan.plan(cluster, fc_net, N)
    assert plans[None]["ddp"]["step_s"] == pytest.approx(plans[0.01]["ddp"]["step_s"])
    assert plans[0.002]["ddp"]["step_s"] < plans[0.01]["ddp"]["step_s"]
    assert plans[0.002]["predicted_step_s"] == pytest.approx(plans[0.01]["predicted_step_s"])
    assert plans[0.002]["master_s"] == pytest.approx(0.01)


def test_ddp_arithmetic_by_hand():
    # two described devices, 1 GFLOP/s and 3 GFLOP/s, behind links of 1e6 and 2e6 bytes/s
    cluster = plan.build_cluster(NET, N, described=plan.parse_describe(
        "a:gflops=1,bw=8mbit,lat=1ms;b:gflops=3,bw=16mbit,lat=3ms"))
    d = plan.ddp(cluster, NET, N)
    flops = sum(NET.flops_per_image().values()) * N / 2          # each replica: N / 2 images
    params = sum(math.prod(s) for s in NET.param_shapes().values())
    assert d["weight_bytes"] == 4 * params
    assert d["compute_s"] == pytest.approx(flops / 1e9, rel=1e-9)   # the slower device, a
    assert d["slowest_device"] == "a"
    # ring of n = 2: 2 (n - 1) / n of the bytes over the slowest link, 2 (n - 1) latencies
    assert d["allreduce_s"] == pytest.approx(4 * params / 1e6 + 2 * 0.003, rel=1e-9)
    assert d["step_s"] == pytest.approx(d["compute_s"] + d["allreduce_s"], rel=1e-9)
    # devices on the master's machine exchange through memory
    local = plan.build_cluster(NET, N, described=plan.parse_describe("a:gflops=1;b:gflops=3"))
    assert plan.ddp(local, NET, N)["allreduce_s"] == 0.0
    # a link too fast to time (as measured: bandwidth None) pays only its latencies
    fast = plan.build_cluster(NET, N, described=[plan.Described("a", gflops=1.0),
                                                 plan.Described("b", gflops=3.0,
                                                                link=Link(0.003, None))])
    assert plan.ddp(fast, NET, N)["allreduce_s"] == pytest.approx(2 * 0.003, rel=1e-9)
    assert plan.plan(fast, NET, N, master_gflops=1.0)["predicted_step_s"] > 0
    # replicas of a framework at 0.8 of pyhet's speed: their compute takes 1 / 0.8 as long,
    # the all-reduce as long as before, and pyhet's own step does not change
    slow = plan.ddp(cluster, NET, N, speed=0.8)
    assert slow["compute_s"] == pytest.approx(d["compute_s"] / 0.8, rel=1e-9)
    assert slow["allreduce_s"] == d["allreduce_s"]
    both = [plan.plan(cluster, NET, N, master_gflops=1.0, ddp_speed=s) for s in (1.0, 0.8)]
    assert both[0]["predicted_step_s"] == both[1]["predicted_step_s"]
    assert both[1]["ddp"]["speed"] == 0.8
    assert both[1]["ddp"]["step_s"] == pytest.approx(slow["step_s"], rel=1e-6)


def test_sweep_rows():
    rows = plan.sweep(NET, N, [1, 2, 4], [plan.parse_link("1gbit"), plan.parse_link("10gbit")],
                      described=plan.parse_describe("g:gflops=5"), master_gflops=5.0)
    assert [(r["devices"], r["link"]) for r in rows] == [
        (1, "1gbit"), (2, "1gbit"), (4, "1gbit"), (1, "10gbit"), (2, "10gbit"), (4, "10gbit")]
    assert all(r["winner"] in ("pyhet", "ddp") for r in rows)
    assert rows[0]["speedup"] == pytest.approx(1.0)


def test_a_sweeps_link_leaves_a_calibrated_devices_own_link_alone():
    """--sweep's link is the described devices'; a calibrated device given its own link by a
    link-only entry stays behind it (it sat behind the column's link)."""
    names, c = cal({"conv1": [2000.0, 2000.0], "conv2": [500.0, 500.0]})
    desc = plan.parse_describe("d1:bw=1kbit,lat=1ms;g:gflops=0.01")
    row = plan.sweep(NET, N, [1], [plan.parse_link("100gbit")], (names, c), desc,
                     master_gflops=5.0)[0]
    own = plan.plan(plan.build_cluster(NET, N, (names, c), plan.parse_describe(
        "d1:bw=1kbit,lat=1ms;g:gflops=0.01,bw=100gbit")), NET, N, 5.0)
    assert row["predicted_step_s"] == own["predicted_step_s"]
    assert row["ddp_step_s"] == own["ddp"]["step_s"] > 1.0      # a 1 kbit/s link's all-reduce


@pytest.mark.parametrize("describe, net, batch", [
    # a fast device whose overhead is far above its time per kernel: its fill point rounded
    # short of its cap, and the search for the split's time went on to a later point
    ("a:gflops=2.26e5,overhead=4.4ms;b:gflops=7.95e5,bw=130mbit", ["--kernels", "42,37"], 1),
    ("d0:gflops=7.95e5,overhead=20ms,bw=430mbit;d1:gflops=628,bw=350mbit;"
     "d2:gflops=8.1e4,overhead=0.87ms", ["--kernels", "3,50"], 2),
])
def test_a_plan_is_never_slower_than_its_best_single_device(cli, describe, net, batch):
    res = cli("plan", "--describe", describe, *net, "--batch-size", str(batch), "--dataset",
              "synthetic", "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out)["speedup"] >= 1.0


def test_random_plans_are_never_slower_than_their_best_single_device():
    """Any single device may take a whole layer, so no plan is slower than the best of them."""
    rng = np.random.default_rng(0)       # three of these plans were slower, before the fix
    net = arch.build("11C1-6C5-P2", (3, 12, 12), 10)
    for _ in range(300):
        entries = []
        for i in range(int(rng.integers(2, 4))):
            e = (f"x{i}:gflops={10 ** rng.uniform(0, 6):.6g},"
                 f"overhead={10 ** rng.uniform(-6, -1):.6g}s")
            if rng.random() < 0.5:
                e += f",bw={10 ** rng.uniform(6, 11):.6g}bit"
            entries.append(e)
        cluster = plan.build_cluster(net, 2, None, plan.parse_describe(";".join(entries)))
        r = plan.plan(cluster, net, 2, master_gflops=100.0)
        assert r["speedup"] >= 1.0 - 1e-9, (entries, r["partition"], r["speedup"])


@pytest.mark.parametrize("text, words", [
    ("a:gflops=5,speed=3", ["unknown field", "speed=3"]),
    ("a:gflops", ["field 'gflops' has no value", "gflops=VALUE"]),
    ("a:gflops=5,bw=-1gbit", ["bandwidth", "-1gbit", "is negative"]),
    ("a:gflops=5,bw=-1parsecs", ["bandwidth '-1parsecs': expected a number and a unit"]),
    ("a:gflops=5,bw=1gbit,lat=-0us", ["latency '-0us': expected a number and a unit"]),
    ("a:gflops=5,bw=10parsecs", ["bandwidth", "10parsecs"]),
    ("a:gflops=5,bw=100Mb", ["bandwidth '100Mb'", "ambiguous", "mbit", "MB"]),
    ("a:gflops=5,bw=1gb/s", ["bandwidth '1gb/s'", "ambiguous", "gbit", "GB"]),
    ("a:gflops=0", ["gflops must be 1e-06 to 1e+09, got 0"]),
    # quantities beyond any hardware, whose sums in the model were no longer numbers
    ("a:gflops=1e-300,bw=10gbit", ["gflops must be 1e-06 to 1e+09, got 1e-300"]),
    ("a:gflops=1e300", ["gflops", "1e+300"]),
    ("a:gflops=1,bw=10gbit,lat=1e300s", ["latency '1e300s': expected 0 to 3600 s"]),
    ("a:gflops=1,overhead=1e300s", ["overhead '1e300s': expected 0 to 3600 s"]),
    ("a:gflops=1,bw=1e300gbit", ["bandwidth '1e300gbit': expected 1bit to 1000TB"]),
    ("a:gflops=1,bw=1e-300bit", ["bandwidth '1e-300bit'"]),
    ("a:like=d0,factor=1e9", ["factor must be 1e-06 to 1e+06"]),
    ("d0:bw=1gbit,count=2", ["give its speed as gflops=G, or as like=DEVICE"]),
    ("a:like=d0,gflops=3", ["gflops", "like"]),
    ("a:gflops=3,count=0", ["count"]),
    ("gflops=3", ["NAME"]),
    (" ; ", ["no device"]),
])
def test_bad_descriptions_are_usage_errors(cli, text, words):
    res = cli("plan", "--describe", text, "--arch", "8C3-P2-12C3-P2", "--dataset", "synthetic")
    from test_cli import assert_one_error_line
    assert_one_error_line(res, *words, code=2)


@pytest.mark.parametrize("argv, words", [
    ([], ["empty"]),
    (["--describe", "a:gflops=1", "--link", "1gbit,2gbit"], ["--sweep"]),
    (["--describe", "a:gflops=1", "--sweep", "devices=0,2"], ["--sweep"]),
    (["--describe", "a:gflops=1", "--link", "0gbit"], ["bandwidth"]),
    # a value after its option that starts with a minus and a digit is the option's value
    # (argparse said "expected one argument")
    (["--describe", "a:gflops=1", "--master-link", "-1gbit"],
     ["--master-link", "'-1gbit'", "is negative"]),
    (["--describe", "a:gflops=1", "--link", "-1gbit"], ["--link", "'-1gbit'", "is negative"]),
    (["--describe", "a:gflops=1", "--master-gflops", "-.5"], ["--master-gflops", "'-.5'"]),
    (["--describe", "a:gflops=1", "-1gbit"], ["unrecognized arguments: -1gbit"]),
    (["--describe", "a:like=d7"], ["like=d7"]),
    (["--describe", "d3:bw=1gbit"], ["d3", "calibrated device"]),
    (["--describe", "x:lat=1ms"], ["bw="]),
    (["--describe", "a:gflops=1", "--link", "1gbit@1e300s"], ["latency", "3600 s"]),
    (["--devices", "cpu:1,cpu:1", "--describe", "d1:bw=1gbit;d1:bw=2gbit"],
     ["the link of d1 is given twice"]),
    (["--describe", "a:gflops=1", "--master-gflops", "1e300"], ["at most 1e+09"]),
    (["--describe", "a:gflops=1", "--ddp-speed", "1e300"], ["at most 1e+06"]),
    (["--describe", "a:gflops=1", "--master-gflops", "1e-300"], [">= 1e-06"]),
    # described names against the SPEC's, before calibration (the test's --devices is none:
    # these need no calibrated device to be refused)
    (["--describe", "g:like=d5"], ["like=d5", "no calibrated device", "gives none"]),
    (["--describe", "d3:bw=1gbit"], ["d3", "must name a calibrated device"]),
    (["--describe", "g:gflops=1,factor=2"], ["factor=", "like="]),
    (["--describe", "g:gflops=1", "--link", ""], ["--link", "bandwidth"]),
    (["--describe", "g:gflops=1", "--link", "1gbit@"], ["no latency after @"]),
    (["--describe", "d0:bw=1gbit", "--devices", "cpu:1", "--sweep", "devices=1,2"],
     ["--sweep counts described devices"]),
    (["--describe", "g:gflops=1", "--sweep", "devices=2,1,2"], ["2 given twice"]),
    (["--describe", "g:gflops=1", "--sweep", "devices=2", "--link", "1gbit,1gbit@50us"],
     ["1gbit@50us given twice"]),
    (["--describe", "g:gflops=1", "--sweep", "devices=65536,65535,65534", "--link",
      "1gbit,10gbit"], ["at most 262,144 devices planned", "393,210"]),
    (["--devices", "cpu:1", "--link", "1gbit"], ["--link", "there is none"]),
    (["--describe", "a:gflops=1", "--ddp-speed", "1e-300"], [">= 1e-06"]),
])
def test_bad_plans_are_usage_errors(cli, argv, words):
    from test_cli import assert_one_error_line
    res = cli("plan", *argv, "--kernels", "4,6", "--dataset", "synthetic")
    assert_one_error_line(res, *words, code=2)


def test_cli_json_keys(cli):
    res = cli("plan", "--describe", "a:gflops=50;b:gflops=20,bw=1gbit", "--kernels", "4,6",
              "--dataset", "synthetic", "--batch-size", "8", "--json")
    assert res.code == 0, res.err
    r = json.loads(res.out.strip().splitlines()[-1])
    assert {"partition", "predicted_step_s", "speedup", "bottleneck", "ddp", "layers",
            "winner"} <= set(r)
    assert r["partition"]["conv1"] == {"a": r["partition"]["conv1"]["a"],
                                       "b": 4 - r["partition"]["conv1"]["a"]}
    assert {"step_s", "speedup", "allreduce_s", "speed"} <= set(r["ddp"])
    assert r["ddp"]["speed"] == 1.0
    res = cli("plan", "--describe", "a:gflops=50;b:gflops=20,bw=1gbit", "--kernels", "4,6",
              "--dataset", "synthetic", "--batch-size", "8", "--ddp-speed", "0.5")
    assert res.code == 0 and "predicted step" in res.out and "bottleneck" in res.out
    assert "replicas at 0.5 of pyhet's speed" in res.out
    res = cli("plan", "--describe", "a:gflops=50", "--kernels", "4,6", "--dataset", "synthetic",
              "--ddp-speed", "0")
    assert res.code == 2 and "--ddp-speed" in res.err


def test_table_rates_read_as_numbers(cli):
    # a fast device's rate with one decimal, not 2e+04; a slow one's not rounded to 0.0
    res = cli("plan", "--describe", "g:gflops=20000;s:gflops=0.004", "--kernels", "4,6",
              "--dataset", "synthetic", "--master-gflops", "25.9")
    assert res.code == 0, res.err
    assert "g (20000.0 GFLOP/s, local), s (0.004 GFLOP/s, local)" in res.out
    assert "master (fc layers at 25.9 GFLOP/s)" in res.out


def test_cli_sweep(cli):
    res = cli("plan", "--describe", "g:gflops=100", "--sweep", "devices=1,2,4",
              "--link", "1gbit,10gbit", "--kernels", "4,6", "--dataset", "synthetic", "--json")
    assert res.code == 0, res.err
    rows = json.loads(res.out.strip().splitlines()[-1])["sweep"]
    assert len(rows) == 6
    res = cli("plan", "--describe", "g:gflops=100", "--sweep", "devices=1,2",
              "--link", "1gbit,10gbit", "--kernels", "4,6", "--dataset", "synthetic")
    assert res.code == 0 and "10gbit" in res.out


def test_cli_calibrates_a_spec(cli):
    res = cli("plan", "--devices", "numpy", "--describe", "twin:like=d0,factor=2",
              "--kernels", "4,6", "--dataset", "synthetic", "--batch-size", "4", "--json")
    assert res.code == 0, res.err
    r = json.loads(res.out.strip().splitlines()[-1])
    assert set(r["partition"]["conv2"]) == {"d0", "twin"}
    # the master is here: its own work is timed, not modelled
    assert r["master_timed"] is True and r["master_s"] > 0
    res = cli("plan", "--devices", "numpy", "--kernels", "4,6", "--dataset", "synthetic",
              "--batch-size", "4")
    assert res.code == 0 and "timed here" in res.out
    # calibration takes seconds to minutes: it says so on stderr (the plan's output unchanged)
    assert res.err == ("calibrating 1 device (d0) on the network's layer shapes, then timing "
                       "steps of it...\n")
    res = cli("plan", "--describe", "a:gflops=50", "--kernels", "4,6", "--dataset", "synthetic")
    assert res.code == 0 and res.err == ""   # nothing to calibrate
    if importlib.util.find_spec("cupy") is None:
        # a device that cannot be made: its error alone, no calibration said to start
        res = cli("plan", "--devices", "gpu:0", "--kernels", "4,6", "--dataset", "synthetic")
        assert res.code != 0 and len(res.err.splitlines()) == 1, res.err
        assert res.err.startswith("pyhet") and "calibrating" not in res.err, res.err


def test_one_device_on_its_own_when_the_split_would_be_slower():
    """Devices that slow each other while they all compute (contention 2.5 each) are each
    faster on their own than the two together: the plan gives one of them the whole layer,
    and predicts its time on its own; with mild contention it splits."""
    names, c = cal({"conv1": [100.0, 100.0], "conv2": [100.0, 100.0]})
    c.contention = {"conv1": [2.5, 2.5], "conv2": [2.5, 2.5]}
    r = plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N, master_gflops=1e6)
    for g in NET.blocks:
        assert r["partition"][g.name] == {"d0": g.K, "d1": 0}
        assert r["layers"][g.name]["conv_s"] == pytest.approx(g.K / 250.0)
    c.contention = {"conv1": [1.2, 1.2], "conv2": [1.2, 1.2]}
    r = plan.plan(plan.build_cluster(NET, N, (names, c)), NET, N, master_gflops=1e6)
    assert all(0 < k for g in NET.blocks for k in r["partition"][g.name].values())


def test_a_sweeps_links_of_one_bandwidth_are_told_apart_by_their_latency(cli):
    """Two --link values of one bandwidth were one column (the second's figures in it) and
    rows of the same name."""
    argv = ("plan", "--describe", "g:gflops=2000", "--sweep", "devices=2,4", "--kernels", "8,16",
            "--batch-size", "64", "--dataset", "synthetic", "--link", "1gbit@10us,1gbit@100ms")
    res = cli(*argv, "--json")
    assert res.code == 0, res.err
    rows = json.loads(res.out)["sweep"]
    assert [(r["devices"], r["link"]) for r in rows] == [
        (2, "1gbit@10us"), (4, "1gbit@10us"), (2, "1gbit@100ms"), (4, "1gbit@100ms")]
    near, far = rows[0]["speedup"], rows[2]["speedup"]
    assert near > far                                  # the 100 ms link costs more
    res = cli(*argv)
    header = res.out.splitlines()[1].split()
    assert header == ["devices", "1gbit@10us", "1gbit@100ms"], res.out
    assert f"{near:.2f}" in res.out and f"{far:.2f}" in res.out


def test_the_times_of_fast_devices_keep_their_digits(cli):
    """Nine decimals made 0.0 of a fast described device's times, and the speedup disagreed
    with them; the table printed 0.00000 s."""
    res = cli("plan", "--describe", "x:gflops=9e7", "--kernels", "8,16", "--batch-size", "4",
              "--master-gflops", "1e9", "--dataset", "synthetic", "--json")
    r = json.loads(res.out)
    assert r["predicted_step_s"] > 0 and r["best_single"]["step_s"] > 0
    assert r["speedup"] == pytest.approx(r["best_single"]["step_s"] / r["predicted_step_s"],
                                         rel=1e-3)
    res = cli("plan", "--describe", "gpu:gflops=50000,count=2", "--kernels", "8,16",
              "--batch-size", "1", "--dataset", "synthetic")
    assert "0.00000 s" not in res.out.split("data parallel")[0], res.out


def test_the_tables_times_have_four_significant_digits():
    """Five decimals gave 0.00110 s and 1615.20495 s in one line (three digits and nine)."""
    from pyhet.cli import _secs

    assert [_secs(s) for s in (0.0, 1.97e-7, 3.4512e-5, 9.5467e-4, 0.0011041, 0.026664, 0.18432,
                               5.1224, 955.95375, 1615.20495, 123456.7)] == [
        "0", "1.97e-07", "3.45e-05", "0.0009547", "0.001104", "0.02666", "0.1843", "5.122",
        "956.0", "1615", "123457"]
    # the digits of the value rounded (they were counted before: 10.000, 1.0000, 0.10000)
    assert [_secs(s) for s in (9.99995, 0.99995, 0.099995, 999.96, 9.9996e-5)] == [
        "10.00", "1.000", "0.1000", "1000", "0.0001000"]


def test_a_memory_too_small_for_one_kernel_says_so(cli):
    res = cli("plan", "--describe", "g:gflops=10,mem=8M,count=3", "--kernels", "8,16",
              "--batch-size", "64", "--dataset", "synthetic")
    from test_cli import assert_one_error_line
    assert_one_error_line(res, "conv1: the devices' memory holds 0 of its 8 kernels at batch 64",
                          "MiB", "mem=", "--batch-size", code=1)


def test_described_names_are_checked_against_auto_with_its_gpus(cli, monkeypatch):
    """`--devices auto` on a machine with a GPU is d0 (the GPU) and d1 (the CPU): the check
    before calibration counts the GPU too (it took auto for d0 alone)."""
    from pyhet import cli as cli_module

    monkeypatch.setattr(cli_module, "cuda_device_count", lambda: 1)
    res = cli("plan", "--devices", "auto", "--describe", "d2:bw=1gbit", "--kernels", "4,6",
              "--dataset", "synthetic")
    assert res.code == 2 and "the --devices SPEC gives d0, d1" in res.err, res.err


# ================================================================================================
# Many devices alike; DDP's whole images; the sweep's rows and entries


def _counting_steps(monkeypatch):
    """A list that grows by one at every re-plan of a whole cluster (plan._step)."""
    calls, step = [], plan._step
    monkeypatch.setattr(plan, "_step", lambda *a: calls.append(1) or step(*a))
    return calls


def test_the_bottleneck_replans_devices_alike_once(monkeypatch):
    """The bottleneck re-planned the cluster once per device behind a link: 65,536 devices took
    hours. Devices alike (the same figures behind the same link) save the same: their class is
    re-planned once, however many there are."""
    calls = _counting_steps(monkeypatch)
    cluster = plan.build_cluster(NET, N, described=plan.parse_describe("g:gflops=1,count=512"),
                                 default_link=plan.parse_link("1gbit"))
    bottleneck = plan.plan(cluster, NET, N, master_gflops=1e6)["bottleneck"]
    assert len(calls) <= 2, len(calls)
    assert bottleneck == "link g.0"
    # two classes (and a device on the master's machine, which has no link): a re-plan each, and
    # one with every link free
    del calls[:]
    cluster = plan.build_cluster(NET, N, described=plan.parse_describe(
        "g:gflops=1,count=300;h:gflops=2,bw=100mbit,count=200;m:gflops=3"),
        default_link=plan.parse_link("1gbit"))
    assert plan.plan(cluster, NET, N, master_gflops=1e6)["bottleneck"].startswith("link ")
    assert len(calls) <= 3, len(calls)
    # many classes: the MAX_REPLANNED paying the most link time, and all of them together
    del calls[:]
    cluster = plan.build_cluster(NET, N, described=plan.parse_describe(
        ";".join(f"x{j}:gflops={1 + j},count=20" for j in range(9))),
        default_link=plan.parse_link("1gbit"))
    assert plan.plan(cluster, NET, N, master_gflops=1e6)["bottleneck"].startswith("link x")
    assert len(calls) <= plan.MAX_REPLANNED + 1, len(calls)
    # a sweep's row: as a plan's
    del calls[:]
    plan.sweep(NET, N, [1000], [plan.parse_link("1gbit")],
               described=plan.parse_describe("g:gflops=1"), master_gflops=1e6)
    assert len(calls) <= 2, len(calls)


def test_a_plan_makes_each_layers_own_costs_once(monkeypatch):
    """The best device alone made every device's own costs once per device: a plan of 65,536
    devices took minutes. They are made once per layer (and once more for DDP)."""
    real, calls = plan.own_costs, []

    def counted(cluster, layer):
        calls.append(layer)
        return real(cluster, layer)
    monkeypatch.setattr(plan, "own_costs", counted)
    cluster = plan.build_cluster(NET, N, described=plan.parse_describe("g:gflops=1,count=200"))
    plan.plan(cluster, NET, N, master_gflops=1e6)
    assert len(calls) <= 4 * len(NET.blocks), len(calls)


def test_a_split_is_chosen_only_where_it_beats_the_best_device_with_its_factor_in_steps():
    """A layer's time in steps over its model's differs split (in_step) and whole (in_step_alone):
    the choice between them compared the models alone, and a plan could predict itself slower
    than its own best single device."""
    from dataclasses import replace
    cluster = plan.build_cluster(NET, N, described=plan.parse_describe("g:gflops=1,count=2"))
    split = plan.partition_of(cluster, NET, N)
    assert all(sum(1 for k in counts if k) == 2 for counts in split.values()), split
    slow_split = replace(cluster, in_step={g.name: 3.0 for g in NET.blocks},
                         in_step_alone={g.name: 1.0 for g in NET.blocks})
    whole = plan.partition_of(slow_split, NET, N)
    assert all(sum(1 for k in counts if k) == 1 for counts in whole.values()), whole
    p = plan.plan(slow_split, NET, N, master_gflops=1e6)
    assert p["speedup"] >= 1.0 - 1e-9, p["speedup"]


def test_many_links_alike_are_the_bottleneck_together():
    """16 devices alike, each link taking 8 times its compute: freeing one link saved nothing
    (the other 15 still pay theirs), so the bottleneck was 'compute'; freeing them all takes
    the step from 1 ms to 0.12 ms."""
    cluster = plan.build_cluster(NET, N, described=plan.parse_describe("g:gflops=1,count=16"),
                                 default_link=plan.parse_link("1gbit"))
    r = plan.plan(cluster, NET, N, master_gflops=1e6)
    free = cluster
    for i in range(16):
        free = free.without_links([i])
    free = plan._step(free, NET, r["master_s"])
    assert free < 0.2 * r["predicted_step_s"]
    assert r["bottleneck"] == "link g.0"
    # beside them a fast device on the master's machine: the links still dominate
    both = plan.build_cluster(NET, N, described=plan.parse_describe(
        "m:gflops=1;g:gflops=1,bw=1gbit,count=16"))
    assert plan.plan(both, NET, N, master_gflops=1e6)["bottleneck"] == "link g.0"
    # links that cost little next to the compute: 'compute'
    fast = plan.build_cluster(NET, N, described=plan.parse_describe("g:gflops=0.01,count=16"),
                              default_link=plan.parse_link("100gbit@1us"))
    assert plan.plan(fast, NET, N, master_gflops=1e6)["bottleneck"] == "compute"


def test_the_bottleneck_names_the_class_whose_links_cost_most():
    """Two classes behind links: the one whose links, made free, save the most is named (by its
    first device), whatever the order of the entries."""
    for text in ("slow:gflops=1,bw=10mbit,count=4;quick:gflops=1,bw=10gbit,count=4",
                 "quick:gflops=1,bw=10gbit,count=4;slow:gflops=1,bw=10mbit,count=4"):
        cluster = plan.build_cluster(NET, N, described=plan.parse_describe(text))
        r = plan.plan(cluster, NET, N, master_gflops=1e6)
        assert r["bottleneck"] == "link slow.0", (text, r["bottleneck"])


def test_ddp_takes_whole_images():
    """A replica cannot take a fraction of an image: 256 replicas of a batch of 8 predicted a
    speedup of 256. At most `batch` replicas (the fastest devices) take part, in the compute and
    in the all-reduce, each on ceil(batch / replicas) images."""
    many = plan.build_cluster(NET, 8, described=plan.parse_describe("g:gflops=1,count=256"))
    one = plan.build_cluster(NET, 8, described=plan.parse_describe("g:gflops=1"))
    d, alone = plan.ddp(many, NET, 8), plan.ddp(one, NET, 8)
    flops = sum(NET.flops_per_image().values())
    assert d["compute_s"] == pytest.approx(flops / 1e9, rel=1e-9)      # one image each
    assert alone["compute_s"] / d["compute_s"] == pytest.approx(8, rel=1e-9)
    assert d["replicas"] == 8 and d["replica_images"] == 1
    r = plan.plan(many, NET, 8, master_gflops=1e6)
    assert r["ddp"]["replicas"] == 8 and r["ddp"]["speedup"] <= 8 + 1e-9
    # 16 images on 3 replicas: the slowest takes 6 (DistributedSampler pads to 18)
    three = plan.build_cluster(NET, N, described=plan.parse_describe("g:gflops=1,count=3"))
    d = plan.ddp(three, NET, N)
    assert d["replicas"] == 3 and d["replica_images"] == 6
    assert d["compute_s"] == pytest.approx(6 * flops / 1e9, rel=1e-9)
    # beyond the batch, the fastest devices are the replicas: the slow one is left out, of the
    # all-reduce too (its slow link not counted)
    mixed = plan.build_cluster(NET, 2, described=plan.parse_describe(
        "a:gflops=2,bw=10gbit;slow:gflops=0.1,bw=1mbit;b:gflops=2,bw=10gbit"))
    d = plan.ddp(mixed, NET, 2)
    assert d["replicas"] == 2 and d["slowest_device"] == "a"
    assert d["replica_compute_s"][1] is None
    weights = d["weight_bytes"]
    assert d["allreduce_s"] == pytest.approx(weights / 1.25e9 + 2 * 50e-6, rel=1e-9)
    # a device a little faster behind a slow link is no replica where a local one serves
    # (its link's part of the all-reduce counts in the choice, not its compute alone)
    linked = plan.build_cluster(NET, 2, described=plan.parse_describe(
        "far:gflops=2.2,bw=1mbit;a:gflops=2;b:gflops=2"))
    d = plan.ddp(linked, NET, 2)
    assert d["replica_compute_s"][0] is None and d["allreduce_s"] == 0.0
    # where the batch divides, the figures are as before: batch / n images each
    even = plan.build_cluster(NET, N, described=plan.parse_describe("g:gflops=1,count=4"))
    assert plan.ddp(even, NET, N)["compute_s"] == pytest.approx(4 * flops / 1e9, rel=1e-12)


def test_cli_ddp_says_how_many_replicas(cli):
    res = cli("plan", "--describe", "g:gflops=100,count=32", "--kernels", "4,6", "--dataset",
              "synthetic", "--batch-size", "8")
    assert res.code == 0, res.err
    line = res.out.splitlines()[-1]
    assert line.startswith("data parallel (DDP, 8 of the 32 devices as replicas, 1 image each)")
    speedup = float(line.split("speedup ")[1].split("x")[0])
    assert speedup <= 8


def test_a_described_name_of_a_calibrated_device_is_refused_before_calibration(cli,
                                                                               monkeypatch):
    """--devices cpu:1,cpu:1 gives d0 and d1: a described d1 was refused only after calibrating
    them (seconds), and as 'pyhet: error:' where the other plan usage errors say 'pyhet plan:
    error:'."""
    from pyhet import cli as cli_module
    from test_cli import assert_one_error_line

    def calibrate(*_, **__):
        raise AssertionError("calibrated")
    monkeypatch.setattr(cli_module, "calibrate_spec", calibrate)
    res = cli("plan", "--devices", "cpu:1,cpu:1", "--describe", "d1:gflops=100", "--kernels",
              "4,6", "--dataset", "synthetic")
    assert_one_error_line(res, "two devices named 'd1'", "d0, d1, d1", code=2)
    assert res.err.startswith("pyhet plan: error: --describe"), res.err
    # under mpiexec, the names are those of every rank's devices: cpu:1 on each of 2 ranks is
    # d0 and d1
    parser = cli_module.build_parser()

    class TwoRanks:
        def Get_size(self):
            return 2
    args = parser.parse_args(["plan", "--devices", "cpu:1", "--describe", "d1:gflops=5",
                              "--kernels", "4,6", "--dataset", "synthetic"])
    with pytest.raises(SystemExit) as e:
        cli_module.cmd_plan(args, parser, TwoRanks())
    assert e.value.code == 2


def test_a_sweep_row_without_memory_enough_is_n_a(cli):
    """One device cannot hold conv2 at this batch, two can: the sweep stopped with the error and
    no table; now that row is n/a, with the reason below the table. Where every row fails, the
    error as before."""
    argv = ["plan", "--dataset", "synthetic", "--kernels", "500,1500", "--describe",
            "a:gflops=100,mem=1100M;big:gflops=100", "--sweep", "devices=1,2,3"]
    res = cli(*argv)
    assert res.code == 0, res.err
    lines = res.out.splitlines()
    assert lines[2].split() == ["1", "n/a", "/", "n/a"], res.out
    assert "n/a" not in lines[3] + lines[4], res.out
    assert lines[5].startswith("n/a at 1 described (own): conv2: the devices' memory holds 772 "
                               "of its 1500 kernels"), res.out
    assert len(lines) == 6
    rows = json.loads(cli(*argv, "--json").out)["sweep"]
    assert rows[0]["predicted_step_s"] is None and rows[0]["speedup"] is None
    assert rows[0]["winner"] is None and "772 of its 1500" in rows[0]["error"]
    assert rows[1]["speedup"] > 1 and "error" not in rows[1]
    # the audit's: rows of two and four fit, though no device holds a layer alone
    res = cli("plan", "--dataset", "synthetic", "--kernels", "500,1500", "--describe",
              "a:gflops=100,mem=1100M", "--sweep", "devices=1,2,4")
    assert res.code == 0, res.err
    assert res.out.splitlines()[-2].startswith("n/a at 1 described (own): conv2")
    assert res.out.splitlines()[-1].startswith(
        "n/a elsewhere: no device holds every layer alone")
    from test_cli import assert_one_error_line
    res = cli("plan", "--dataset", "synthetic", "--kernels", "8,16", "--batch-size", "64",
              "--describe", "g:gflops=10,mem=8M", "--sweep", "devices=1,2")
    assert_one_error_line(res, "conv1: the devices' memory holds 0 of its 8 kernels", code=1)


@pytest.mark.parametrize("argv, words", [
    # --link is the link of described devices without one of their own: here there is none
    (["--describe", "g:gflops=1,bw=1gbit", "--link", "10gbit"],
     ["--link", "every described device gives its own bw="]),
    # the fastest of the devices' links: no device has one (it was ignored)
    (["--describe", "g:gflops=100", "--master-link", "links"],
     ["--master-link links", "no device has one"]),
    # a sweep takes its described devices in turn, one at a time: count= has no place there
    (["--describe", "a:gflops=10,count=5;b:gflops=1000", "--sweep", "devices=1,2"],
     ["--sweep", "count=5", "a"]),
    # two entries of one name: a plan's devices would share names; a sweep's too, in their turn
    (["--describe", "a:gflops=1;a:gflops=2"], ["two devices named 'a'"]),
    (["--describe", "a:gflops=1;a:gflops=2", "--sweep", "devices=1,2"],
     ["two entries named 'a'"]),
])
def test_more_bad_plans_are_usage_errors(cli, argv, words):
    from test_cli import assert_one_error_line
    res = cli("plan", *argv, "--kernels", "4,6", "--dataset", "synthetic")
    assert_one_error_line(res, *words, code=2)


def test_a_sweeps_link_replaces_a_described_devices_own():
    """In a sweep the column's link is every described device's (so --link applies even where
    each gives bw=)."""
    rows = plan.sweep(NET, N, [2], [plan.parse_link("1kbit")],
                      described=plan.parse_describe("g:gflops=1,bw=100gbit"), master_gflops=1e6)
    assert rows[0]["ddp_step_s"] > 1.0         # a 1 kbit/s link's all-reduce


@pytest.mark.parametrize("text", ["10G", "10g", "10GB", "10gb", "10GiB", "10gib", "10 GiB"])
def test_memory_is_in_binary_units(text):
    """mem= counts in powers of 1024 whatever the spelling (README), unlike a bandwidth's GB."""
    assert plan.parse_memory(text) == 10 * 2 ** 30
    assert plan.parse_memory("512M") == plan.parse_memory("0.5G") == 2 ** 29
    assert plan.parse_memory("1000") == 1000.0
    assert plan.parse_bandwidth("10GB") == 1e10


def test_a_device_that_takes_no_kernel_leaves_a_real_calibrations_plan_as_it_was():
    """tools/plan_beside.py plans one calibration of real devices (its layers timed in steps)
    alone and beside described devices: beside one that takes no kernel, the predicted step and
    the best single device's are the same figures."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "plan_beside.py"
    res = subprocess.run([sys.executable, str(tool), "--kernels", "4,6", "--batch-size", "2",
                          "--rounds", "1", "--describe", "c:gflops=1e-6", "--describe",
                          "e:like=d1,bw=1gbit"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    row = res.stdout.splitlines()[1]
    got = re.fullmatch(r"round 1: alone ([\d.]+) \(([\d.]+)\) \| beside c:gflops=1e-6 "
                       r"([\d.]+) \(([\d.]+)\) \| beside e:like=d1,bw=1gbit ([\d.]+) .*", row)
    assert got and got[1] == got[3] and got[2] == got[4], row
    assert float(got[5]) > 0


def test_the_in_step_tool_prints_each_layer_predicted_planned_and_after():
    """tools/in_step.py (each conv layer as calibration predicts it, as pyhet plan times it in
    steps, and in the steps after) runs and prints, per round, one line a layer and the step,
    each figure a positive number of milliseconds."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "in_step.py"
    res = subprocess.run([sys.executable, str(tool), "--devices", "cpu:1,cpu:1", "--kernels",
                          "4,6", "--batch-size", "2", "--steps", "3", "--rounds", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("4C5-P2-6C5-P2 on cpu:1,cpu:1, batch 2")
    rows = [re.match(r"round (\d) (conv1|conv2|step)\b.*?: (.*)$", line) for line in lines[1:]]
    assert [(m[1], m[2]) for m in rows] == [(r, k) for r in "12" for k in
                                            ("conv1", "conv2", "step")]
    for m in rows:
        figures = [float(v) for v in re.findall(r"(?:predicted|in steps|after) ([\d.]+)", m[3])]
        assert len(figures) == (2 if m[2] == "step" else 3) and all(f > 0 for f in figures)
    bad = subprocess.run([sys.executable, str(tool), "--steps", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--steps" in bad.stderr


def _core_tool(name: str):
    """(path of tools/NAME, the cores this process may use), skipping where the tool cannot
    run: it pins a thread to each of two cores."""
    import os
    from pathlib import Path

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs Linux's core affinity")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    return Path(__file__).resolve().parents[1] / "tools" / name, allowed


def test_the_core_drift_tool_prints_each_window_and_what_a_fixed_split_waits():
    """tools/core_drift.py (two cores' speeds side by side, BENCHMARKS.md) prints a line per
    window, the two cores' times over their medians and their ratio, then the range and what
    a half and half split waits for (at least 0%); and refuses a window it cannot make and a
    core this process may not use, saying so."""
    import subprocess
    import sys

    tool, allowed = _core_tool("core_drift.py")
    res = subprocess.run([sys.executable, str(tool), "1.5", "0.5"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"cores {allowed[0]} and {allowed[1]}: median call")
    rows = [re.fullmatch(r"\s*([\d.]+)s\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line)
            for line in lines[2:-1]]
    # windows in which a core began no call are left out (a slow machine's calls are long)
    assert rows and all(rows) and {float(m[1]) for m in rows} <= {0.0, 0.5, 1.0}
    for m in rows:
        a, b, ratio = float(m[2]), float(m[3]), float(m[4])
        assert a > 0 and b > 0 and ratio == pytest.approx(b / a, rel=5e-3, abs=2e-3)
    last = re.search(r"times per 0.5 s: ([\d.]+) to ([\d.]+), .* waits for the slower core: "
                     r"([\d.]+)% longer", lines[-1])
    assert last and float(last[1]) <= float(last[2]) and float(last[3]) >= 0
    for args, said in ((["2", "0"], "0 < WINDOW <= SECONDS"),
                       (["1", "2"], "0 < WINDOW <= SECONDS"),
                       (["1", "1", str(allowed[0]), str(allowed[0])], "two different cores"),
                       (["1", "1", str(allowed[0]), str(max(allowed) + 1)], "may use")):
        bad = subprocess.run([sys.executable, str(tool), *args], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and said in bad.stderr, (args, bad.stderr)
    # too short to time: a run that ends before its first call (making its operands takes
    # longer), and windows too short for both cores to begin a call in one; one line each
    for args, said in ((["0.001", "0.001"], ("no GEMM call ended in 0.001 s",)),
                       (["0.05", "0.00001"], ("no GEMM call ended", "no window of 1e-05 s"))):
        bad = subprocess.run([sys.executable, str(tool), *args], capture_output=True,
                             text=True, timeout=60)
        assert bad.stdout == "" or bad.stdout.startswith("cores"), (args, bad.stdout)
        assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1, (args, bad.stderr)
        assert any(bad.stderr.startswith(f"core_drift.py: {w}") for w in said), bad.stderr


def test_the_cores_alone_tool_prints_each_rounds_rates_and_their_ratio():
    """tools/cores_alone.py (a core's GEMM rate alone against all of them at once, which
    tools/hetero.sh prints each round) prints a line per round, the rates and their ratio,
    then the median ratio; and refuses what it cannot time, saying so."""
    import subprocess
    import sys

    tool, allowed = _core_tool("cores_alone.py")
    res = subprocess.run([sys.executable, str(tool), "1", "2"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 3, lines
    ratios = []
    for r, line in enumerate(lines[:2], 1):
        m = re.fullmatch(rf"round {r}: core {allowed[0]} alone ([\d.]+) GFLOP/s; cores "
                         rf"{allowed[0]}, {allowed[1]} at once ([\d.]+) ([\d.]+); alone / at "
                         rf"once ([\d.]+)", line)
        assert m, line
        alone, first, ratio = float(m[1]), float(m[2]), float(m[4])
        assert alone > 0 and first > 0 and float(m[3]) > 0
        # (from rates printed to 0.1 GFLOP/s, a ratio to 0.001: however slow the machine)
        assert abs(ratio - alone / first) <= ratio * (0.06 / alone + 0.06 / first) + 1e-3, line
        ratios.append(ratio)
    m = re.fullmatch(r"median alone / at once over 2 rounds: ([\d.]+)", lines[2])
    assert m and float(m[1]) == pytest.approx(sum(ratios) / 2, abs=2e-3)
    for args, said in ((["0"], "0 < SECONDS <= 600"), (["1", "0"], "1 <= ROUNDS"),
                       (["1", "1", str(allowed[0])], "two or more different cores"),
                       (["1", "1", str(allowed[0]), str(allowed[0])], "different cores"),
                       (["1", "1", str(allowed[0]), str(max(allowed) + 1)], "may use")):
        bad = subprocess.run([sys.executable, str(tool), *args], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and said in bad.stderr, (args, bad.stderr)
    # too short for a call after the first (its operands and a warm-up call take longer)
    bad = subprocess.run([sys.executable, str(tool), "0.001", "1"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and bad.stdout == "", bad.stdout
    assert bad.stderr.startswith("cores_alone.py: no GEMM call ended in 0.001 s"), bad.stderr


def test_master_traffic_is_every_links_bytes_through_the_master():
    """The bytes a step moves through the master's own interface (the model takes the links as
    independent): per layer, each link that carries kernels moves the layer's input (and its
    gradient, past the first layer) once and its kernels' slices both ways; the devices of one
    rank share their rank's link, so its input crosses once."""
    desc = plan.parse_describe("a:gflops=0.05,bw=1gbit;b:gflops=0.05,bw=1gbit;h:gflops=0.05")
    cluster = plan.build_cluster(NET, N, described=desc)
    r = plan.plan(cluster, NET, N, master_gflops=5.0)
    want = 0
    for j, g in enumerate(NET.blocks):
        fixed, per = g.link_bytes(N, need_dx=j > 0)
        counts = r["partition"][g.name]
        linked = [counts["a"], counts["b"]]
        want += sum(fixed + k * per for k in linked if k)
    assert want > 0 and r["master_traffic"]["bytes"] == want
    assert r["master_traffic"]["gbit_per_s"] == pytest.approx(
        want * 8 / r["predicted_step_s"] / 1e9, rel=1e-6)
    # the same devices as one rank's (one link, one key): each layer's input crosses once
    shared = replace(cluster, link_groups=[("rank", 1), ("rank", 1), 2])
    partition = {layer: list(c.values()) for layer, c in r["partition"].items()}
    once = sum(g.link_bytes(N, need_dx=j > 0)[0] for j, g in enumerate(NET.blocks)
               if partition[g.name][0] and partition[g.name][1])
    assert once > 0 and plan.master_traffic(shared, NET, N, partition) == want - once
    # no link, no traffic
    local = plan.plan(plan.build_cluster(NET, N, described=plan.parse_describe("h:gflops=5")),
                      NET, N, master_gflops=5.0)
    assert local["master_traffic"] == {"bytes": 0, "gbit_per_s": 0.0,
                                       "interface_bytes_per_s": None, "bound_layers": []}


def test_cli_plan_and_sweep_say_what_the_masters_interface_carries(cli):
    args = ("--kernels", "4,6", "--dataset", "synthetic", "--batch-size", "4")
    res = cli("plan", "--describe", "g:gflops=100,bw=1gbit,count=2", *args, "--json")
    assert res.code == 0, res.err
    r = json.loads(res.out.strip().splitlines()[-1])
    res = cli("plan", "--describe", "g:gflops=100,bw=1gbit,count=2", *args)
    assert res.code == 0, res.err
    line = next(x for x in res.out.splitlines() if x.startswith("master's network interface"))
    rate = r["master_traffic"]["gbit_per_s"]
    assert (f"{rate:.3g} Gbit/s" if rate >= 1 else f"{rate * 1000:.3g} Mbit/s") in line, line
    res = cli("plan", "--describe", "g:gflops=100", "--sweep", "devices=1,4",
              "--link", "1gbit,10gbit", *args, "--json")
    rows = json.loads(res.out.strip().splitlines()[-1])["sweep"]
    assert all(r["master_gbit_per_s"] > 0 for r in rows)
    res = cli("plan", "--describe", "g:gflops=100", "--sweep", "devices=1,4",
              "--link", "1gbit,10gbit", *args)
    assert "master's network interface carries at most" in res.out
    assert "(1gbit, 4 described)" in res.out and "(10gbit, 4 described)" in res.out
    # without a link, nothing crosses it: no line
    res = cli("plan", "--describe", "g:gflops=100,count=2", *args)
    assert res.code == 0 and "network interface" not in res.out


PAPER = arch.build("500C5-P2-1500C5-P2", (3, 32, 32), 10)


def test_a_master_interface_bounds_each_layer_and_the_partition_leaves_devices_out():
    """--master-link: every link's bytes cross the master's interface, so a layer takes at
    least its bytes over it; the partition then weighs splits over fewer linked devices (each
    costs its input and input gradient there) and keeps the fastest."""
    desc = plan.parse_describe("g:gflops=2000,bw=10gbit,count=8")
    free = plan.build_cluster(PAPER, 64, described=desc)
    shared = replace(free, master_bandwidth=1.25e9)
    a = plan.plan(free, PAPER, 64, master_gflops=2000.0)
    b = plan.plan(shared, PAPER, 64, master_gflops=2000.0)
    assert a["master_traffic"]["interface_bytes_per_s"] is None
    assert a["master_traffic"]["bound_layers"] == []
    assert b["master_traffic"]["interface_bytes_per_s"] == 1.25e9
    for j, g in enumerate(PAPER.blocks):
        counts = list(b["partition"][g.name].values())
        assert b["layers"][g.name]["conv_s"] >= plan.layer_traffic(
            shared, PAPER, j, 64, counts) / 1.25e9 * (1 - 1e-9)
        # fewer devices than the independent links' split, and no slower under the interface
        assert sum(1 for k in counts if k) < sum(1 for k in a["partition"][g.name].values() if k)
    theirs = plan.conv_seconds(shared, PAPER, {g: list(c.values())
                                               for g, c in a["partition"].items()})
    assert b["predicted_conv_s"] <= sum(theirs.values()) * (1 + 1e-9)
    assert b["bottleneck"] == "master interface" and b["master_traffic"]["bound_layers"]
    assert b["predicted_step_s"] > a["predicted_step_s"]
    # alone, a linked device's bytes cross the interface too
    slow = replace(free, master_bandwidth=1e6)
    assert plan.alone_seconds(slow, PAPER, 0, 0.0) > plan.alone_seconds(free, PAPER, 0, 0.0)


def test_a_sweep_under_the_master_interface_stops_gaining():
    """With the master's interface as fast as each column's link, more devices never make a
    row slower (the partition may leave them out) and the gains end: over 1 Gbit/s a second
    device already costs more through the interface than it saves."""
    rows = plan.sweep(PAPER, 64, [1, 2, 4, 8, 16], [plan.parse_link("1gbit"),
                                                    plan.parse_link("10gbit")],
                      described=plan.parse_describe("g:gflops=2000"), master_gflops=2000.0,
                      master_link="links")
    by = {(r["devices"], r["link"]): r for r in rows}
    assert all(r["master_interface_bytes_per_s"] in (1.25e8, 1.25e9) for r in rows)
    for lk in ("1gbit", "10gbit"):
        s = [by[(n, lk)]["speedup"] for n in (1, 2, 4, 8, 16)]
        assert all(x <= y * (1 + 1e-9) for x, y in zip(s, s[1:])), s
        assert by[(16, lk)]["speedup"] == by[(8, lk)]["speedup"]
    assert by[(16, "1gbit")]["speedup"] == 1.0
    # every count, not only halves: 3 devices beat 4 over 10 Gbit/s, and 5 to 12 keep that
    rows = plan.sweep(PAPER, 64, list(range(1, 13)), [plan.parse_link("10gbit")],
                      described=plan.parse_describe("g:gflops=2000"), master_gflops=2000.0,
                      master_link="links")
    s = [r["speedup"] for r in rows]
    assert all(x <= y * (1 + 1e-9) for x, y in zip(s, s[1:])), s
    assert s[2] > s[1] and s[-1] == s[2], s
    # more linked devices than a layer's kernels: still the split over a few of them
    many = plan.plan(replace(plan.build_cluster(PAPER, 64, described=plan.parse_describe(
        "g:gflops=2000,bw=10gbit,count=600")), master_bandwidth=1.25e9), PAPER, 64, 2000.0)
    assert many["speedup"] == pytest.approx(s[-1], rel=1e-9)
    independent = plan.sweep(PAPER, 64, [16], [plan.parse_link("10gbit")],
                             described=plan.parse_describe("g:gflops=2000"),
                             master_gflops=2000.0)[0]
    assert by[(16, "10gbit")]["speedup"] < independent["speedup"] / 2


def test_cli_master_link(cli):
    args = ("--kernels", "500,1500", "--dataset", "synthetic", "--batch-size", "64",
            "--describe", "g:gflops=2000,bw=10gbit,count=8")
    res = cli("plan", *args, "--master-link", "links")
    assert res.code == 0, res.err
    assert "master's network interface (10gbit)" in res.out
    assert "it sets the time of conv" in res.out and "bottleneck: master interface" in res.out
    res = cli("plan", *args, "--master-link", "1.25GB", "--json")
    r = json.loads(res.out.strip().splitlines()[-1])
    assert r["master_traffic"]["interface_bytes_per_s"] == 1.25e9
    for bad in ("10mb", "fast", "0gbit"):
        res = cli("plan", *args, "--master-link", bad)
        assert res.code == 2 and "--master-link" in res.err and "'links'" in res.err, res.err


def test_a_sweeps_own_links_column_keeps_one_master_interface():
    """--master-link links without --link: the described devices keep their own links, and the
    master's interface is the fastest of them all in every row (a row's own fastest sped it
    up as faster devices joined)."""
    rows = plan.sweep(PAPER, 64, [1, 2], [None], described=plan.parse_describe(
        "a:gflops=2000,bw=1gbit;b:gflops=2000,bw=100gbit"), master_gflops=2000.0,
                      master_link="links")
    assert [r["master_interface_bytes_per_s"] for r in rows] == [1.25e10, 1.25e10]


def test_a_split_among_the_devices_without_a_link_takes_no_waits_of_ranks():
    """A layer's waits (Cluster.waits, calibration's) were timed on a split that gives devices
    of other ranks kernels: a split among the devices without a link does not take them, and
    the plan weighs it (two devices here and one behind a link, a layer whose split over all
    three waits twice its model's time goes on the two)."""
    link = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
    costs = {}
    for g in NET.blocks:
        fixed, per = link_cost(link, g, N, g is not NET.blocks[0])
        costs[g.name] = [plan.Cost(1000.0, 0.0, g.K), plan.Cost(1000.0, 0.0, g.K),
                         plan.Cost(1000.0, 0.0, g.K, fixed, per)]
    cluster = plan.Cluster(["d0", "d1", "r1"], [None, None, link], costs, [1.0] * 3,
                           waits={"conv2": 2.0})
    part = plan.partition_of(cluster, NET, N)
    assert part["conv2"][2] == 0 and min(part["conv2"][:2]) > 0
    assert min(part["conv1"]) > 0                    # no waits: all three
    waited = plan.layer_seconds(costs["conv2"], [4, 4, 4], waits=2.0)
    assert waited == pytest.approx(2 * plan.layer_seconds(costs["conv2"], [4, 4, 4]))
    assert plan.layer_seconds(costs["conv2"], [6, 6, 0], waits=2.0) == pytest.approx(
        plan.layer_seconds(costs["conv2"], [6, 6, 0]))
    assert plan.conv_seconds(cluster, NET, part)["conv2"] == pytest.approx(0.006, rel=0.01)


def test_a_split_among_the_devices_without_a_link_computes_at_their_local_speed():
    """Devices that compute twice as fast with the linked device idle (Cluster.local_speedup,
    calibration's local contention): a split among them is predicted at that speed, shown so
    in the plan's rows, and chosen where it beats the split over all; a split that gives the
    linked device kernels keeps its figures."""
    link = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
    costs = {}
    for g in NET.blocks:
        fixed, per = link_cost(link, g, N, g is not NET.blocks[0])
        costs[g.name] = [plan.Cost(500.0, 0.0, g.K, contention=2.0),
                         plan.Cost(500.0, 0.0, g.K, contention=2.0),
                         plan.Cost(1000.0, 0.0, g.K, fixed, per)]
    speedup = {g.name: [2.0, 2.0, 1.0] for g in NET.blocks}
    cluster = plan.Cluster(["d0", "d1", "r1"], [None, None, link], costs, [1.0] * 3,
                           local_speedup=speedup)
    k = NET.blocks[1].K
    half = [k // 2, k - k // 2, 0]
    assert plan.layer_seconds(costs["conv2"], half, local_speedup=speedup["conv2"]) == \
        pytest.approx(plan.layer_seconds(costs["conv2"], half) / 2)
    spread = [k // 4, k // 4, k - 2 * (k // 4)]
    assert plan.layer_seconds(costs["conv2"], spread, local_speedup=speedup["conv2"]) == \
        pytest.approx(plan.layer_seconds(costs["conv2"], spread))
    part = plan.partition_of(cluster, NET, N)
    assert part["conv2"] == half
    assert plan.partition_of(replace(cluster, local_speedup=None), NET, N)["conv2"][2] > 0
    out = plan.plan(cluster, NET, N, master_gflops=10.0)
    row = out["layers"]["conv2"]["devices"]["d0"]
    assert row["kernels_per_s"] == pytest.approx(1000.0)
    assert row["contention"] == pytest.approx(1.0)


def test_the_local_speedup_of_a_modelled_device_keeps_its_share_no_faster_than_alone():
    """Calibrated devices of the master beside one of another rank: the plan's local speedup
    is their contention over their local contention, folded as their cost folds their
    contention with their whole-layer factor (contention 2, local 1, whole 1.3: 2 / 1.3, not
    2, so that a share is never faster than the device's typical time alone); a device whose
    figures were measured as a step runs them takes the ratio itself."""
    from pyhet.calibrate import Calibration

    names = ["d0", "d1", "d2"]
    part = {"compute_kernels_per_s": 800.0, "compute_overhead_s": 0.0, "link_fixed_s": 1e-4,
            "link_s_per_kernel": 1e-6}
    layers = [g.name for g in NET.blocks]
    cal = Calibration({n: [500.0, 500.0, 800.0] for n in layers},
                      {n: [0.0] * 3 for n in layers},
                      {g.name: [g.K] * 3 for g in NET.blocks},
                      parts={n: [None, None, part] for n in layers},
                      contention={n: [2.0, 2.0, 1.0] for n in layers},
                      fits={n: [[1e-3, 0.0, 1], [1e-3, 0.0, 1], [1e-3, 0.0, 0]] for n in layers},
                      whole={n: [1.3, 1.3, 1.0] for n in layers},
                      local_contention={n: [1.0, 1.0, 1.0] for n in layers})
    link = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
    cluster = plan.build_cluster(NET, N, (names, cal), ranked={"d2": (link, 1)})
    for n in layers:
        assert cluster.local_speedup[n] == pytest.approx([2 / 1.3, 2 / 1.3, 1.0])
    alone = plan.own_costs(cluster, "conv2")[0]
    k = NET.blocks[1].K
    local = plan.split_costs(cluster.costs["conv2"], [k // 2, k - k // 2, 0],
                             cluster.local_speedup["conv2"])[0]
    assert local.speed == pytest.approx(alone.speed * alone.contention / alone.whole)
    # described devices joining: not timed for them, none
    joined = plan.build_cluster(NET, N, (names, cal), plan.parse_describe("cpu:gflops=10"),
                                ranked={"d2": (link, 1)})
    assert joined.local_speedup is None
    assert plan._local_factor(2.0, 1.0, 1.3, True) == 2.0
    assert plan._local_factor(2.0, 1.0, 0.9, False) == 2.0
