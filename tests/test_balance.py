"""Partitioning: exact proportional shares, the cost model, memory caps, leaving out a device
that would slow the step, and the dynamic balancer's convergence, without oscillation; and
dynamic balancing in training, when a device's speed changes mid-training."""

import math
from dataclasses import replace
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import net_shape
from pyhet.backends.cpu import CpuBackend
from pyhet.calibrate import calibrate
from pyhet.devices import make_devices
from pyhet.model import Net, init_params
from pyhet.specs import parse_devices
from pyhet.optim import SGDConfig
from pyhet.partition import (EVERY_SPLIT_LIMIT, Balancer, balanced, balanced_phases, even,
                             phases_time, predicted_time, proportional)
from pyhet.train import DynamicBalance


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.lists(st.floats(0, 100), min_size=1, max_size=8))
def test_proportional_is_exact_and_fair(total, weights):
    if sum(weights) <= 0:
        with pytest.raises(ValueError):
            proportional(total, weights)
        return
    counts = proportional(total, weights)
    assert sum(counts) == total and min(counts) >= 0
    s = sum(weights)
    for c, w in zip(counts, weights):  # largest remainder: within one of the exact share
        assert abs(c - total * w / s) < 1


def test_even_and_proportional_examples():
    assert even(10, 3) == [4, 3, 3]
    assert proportional(1500, [1, 0.5]) == [1000, 500]
    assert proportional(7, [1, 1, 0]) == [4, 3, 0]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.lists(st.floats(0.1, 100), min_size=1, max_size=6),
       st.data())
def test_balanced_sums_respects_caps_and_is_near_optimal(total, speeds, data):
    n = len(speeds)
    overheads = data.draw(st.lists(st.floats(0, 5), min_size=n, max_size=n))
    caps = data.draw(st.lists(st.integers(0, total), min_size=n, max_size=n))
    if sum(caps) < total:
        with pytest.raises(ValueError, match="memory"):
            balanced(total, speeds, overheads, caps)
        return
    counts = balanced(total, speeds, overheads, caps)
    assert sum(counts) == total
    assert all(0 <= c <= cap for c, cap in zip(counts, caps))
    # no single kernel moved from the slowest-finishing device makes it better by a whole kernel
    t = predicted_time(counts, speeds, overheads)
    slack = max(1 / s for s in speeds)
    assert t <= predicted_time(proportional(total, speeds), speeds, overheads) + slack or \
        any(c > cap for c, cap in zip(proportional(total, speeds), caps))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 30), st.integers(1, 4), st.data())
def test_balanced_is_the_best_whole_kernel_split(total, n, data):
    """Against every split of a small layer: none finishes sooner (rounding the exact shares by
    their largest remainders did not, where the devices' speeds differ)."""
    import itertools

    speeds = data.draw(st.lists(st.floats(0.1, 100), min_size=n, max_size=n))
    overheads = data.draw(st.lists(st.one_of(st.just(0.0), st.floats(0, 1)), min_size=n,
                                   max_size=n))
    caps = data.draw(st.lists(st.integers(0, total), min_size=n, max_size=n))
    if sum(caps) < total:
        return
    best = min(predicted_time(list(c), speeds, overheads)
               for c in itertools.product(*(range(cap + 1) for cap in caps)) if sum(c) == total)
    counts = balanced(total, speeds, overheads, caps)
    assert predicted_time(counts, speeds, overheads) <= best * (1 + 1e-9), (counts, best)


def test_balanced_gives_the_last_kernel_to_the_device_that_finishes_it_first():
    """Exact shares 5.45 and 0.55 kernels (speeds 10 and 1 kernels/s): the largest remainder
    gave the sixth kernel to the slow device (1 s), where the fast one finishes it at 0.6 s."""
    assert balanced(6, [10.0, 1.0]) == [6, 0]


def _brute_phases(total, phases, caps):
    """The least sum over phases of the slowest time, over every split of `total`."""
    import itertools
    return min(phases_time(list(c), phases)
               for c in itertools.product(*(range(cap + 1) for cap in caps)) if sum(c) == total)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(2, 3), st.data())
def test_balanced_phases_is_near_the_best_split(total, n, data):
    speeds = st.lists(st.floats(1, 50), min_size=n, max_size=n)
    overheads = st.lists(st.one_of(st.just(0.0), st.floats(0, 1)), min_size=n, max_size=n)
    phases = [(data.draw(speeds), data.draw(overheads)) for _ in range(2)]
    caps = data.draw(st.lists(st.integers(0, total), min_size=n, max_size=n))
    if sum(caps) < total:
        with pytest.raises(ValueError, match="memory"):
            balanced_phases(total, phases, caps)
        return
    counts = balanced_phases(total, phases, caps)
    assert sum(counts) == total and all(0 <= c <= cap for c, cap in zip(counts, caps))
    best = _brute_phases(total, phases, caps)
    if math.comb(total + n - 1, n - 1) <= EVERY_SPLIT_LIMIT:
        # few enough splits to weigh them all: the best one (single kernels moved from the
        # rounded exact split stopped short of it by up to 4%)
        assert phases_time(counts, phases) <= best * (1 + 1e-9)
    # rounding to whole kernels can miss the best split, by at most about a kernel a phase
    slack = sum(max(1 / s for s in speeds) for speeds, _ in phases)
    assert phases_time(counts, phases) <= best + slack


def test_balanced_phases_weighs_every_split_of_a_small_layer():
    """A fast device whose overhead is a step of its own: moving single kernels from the
    rounded exact split stopped at 4 + 1 + 3 kernels (3.8% slower than 6 + 2)."""
    phases = [([337461.1, 83.26, 2328.2, 6956.2, 35.52, 5308.8],
               [9.525e-4, 2.684e-5, 6.212e-4, 6.212e-4, 9.403e-3, 3.056e-3]),
              ([337461.1, 83.26, 2328.2, 6956.2, 35.52, 5308.8],
               [1.0397e-3, 4.838e-5, 1.003e-6, 1.003e-6, 2.0e-4, 4.570e-3])]
    counts = balanced_phases(8, phases, [8] * 6)
    assert phases_time(counts, phases) <= _brute_phases(8, phases, [8] * 6) * (1 + 1e-9)


def test_balanced_phases_leaves_out_a_linked_device_the_exact_split_leaves_out():
    """A linked device whose forward alone (its input's transfer) outlasts the others' forward:
    the exact split gives it nothing, and the kernels left by rounding went to it, the device
    that finishes one kernel first over both phases (3.3 + 3.4 ms against the fast device's
    2.7 + 5.4 ms), lengthening the forward by 0.6 ms; single moves could not undo that."""
    phases = [([5.412e5, 2.831e5, 5280, 5519, 8712], [0, 3.27e-3, 0, 1.589e-3, 4.401e-4]),
              ([2.706e5, 1.596e5, 2640, 2760, 4358], [0, 3.404e-3, 0, 3.103e-3, 4.541e-4])]
    counts = balanced_phases(1500, phases, [1500] * 4 + [1000])
    assert counts[1] == 0, counts
    assert phases_time(counts, phases) <= phases_time([1461, 0, 14, 6, 19], phases) * (1 + 1e-9)


def test_balanced_phases_of_many_devices_rounds_by_the_phases():
    """Nineteen devices (too many to move single kernels between): the kernels left by
    rounding, each to the device that lengthens the phases' sum least, not to the first to
    finish over both phases. A linked device more then shortens the layer, as the exact split
    says it does, where it had lengthened it (15.59 against 15.40 ms without it)."""
    fast = ([18750.0] * 16 + [6250.0] * 2, [1 / 3000] * 16 + [0.0] * 2)
    back = ([9375.0] * 16 + [3125.0] * 2, [2 / 3000] * 16 + [0.0] * 2)
    without = [fast, back]
    linked = [(fast[0] + [18571.7], fast[1] + [2.36037e-3]),
              (back[0] + [9330.21], back[1] + [2.71371e-3])]
    alone = phases_time(balanced_phases(1500, without), without)
    counts = balanced_phases(1500, linked)
    assert sum(counts) == 1500 and counts[-1] > 0
    assert phases_time(counts, linked) < alone * 0.98, (phases_time(counts, linked), alone)


def test_balanced_phases_rounds_no_worse_than_by_each_devices_finish():
    """Giving each leftover kernel to the device that lengthens the phases' sum least can end,
    after single moves, a little behind giving it to the first to finish over both phases
    (0.0432406 against 0.0431752 s here): both are tried, the better kept."""
    phases = [([6351, 19230, 3004, 16650, 4305], [0.003139, 0.003383, 0.001653, 0.004777, 0]),
              ([2470, 7477, 1168, 6473, 1674], [0.004902, 0.001859, 0.001391, 0.003427, 0])]
    for every in (True, False):
        counts = balanced_phases(500, phases, every_split=every)
        assert phases_time(counts, phases) <= phases_time([59, 201, 32, 160, 48], phases) * (
            1 + 1e-9), counts


def test_balanced_phases_of_a_device_behind_a_link():
    """A device whose input arrives in the forward and whose input gradient leaves in the
    backward (0.55 s each) beside one without a link: the forward is the linked device's in
    any split, so the best split balances the backward alone, with more kernels on the linked
    device than a balance of the whole step's times gives."""
    f, b, lk = 0.375e-3, 0.78e-3, 2e-6
    phases = [([1 / f, 1 / (f + lk)], [0.0, 0.55]), ([1 / b, 1 / (b + lk)], [0.0, 0.55])]
    counts = balanced_phases(1500, phases)
    best = min(range(1501), key=lambda k: phases_time([1500 - k, k], phases))
    assert counts == [1500 - best, best]
    whole = balanced(1500, [1 / (f + b), 1 / (f + b + 2 * lk)], [0.0, 1.1])
    assert counts[1] > whole[1]
    assert phases_time(counts, phases) < phases_time(whole, phases)


def test_balanced_phases_in_proportion_is_balanced():
    speeds, overheads = [100.0, 50.0, 30.0], [0.1, 0.2, 0.0]
    phases = [([3 * s for s in speeds], [o / 3 for o in overheads]),
              ([1.5 * s for s in speeds], [2 * o / 3 for o in overheads])]
    assert balanced_phases(500, phases) == balanced(500, speeds, overheads)
    assert balanced_phases(500, [(speeds, overheads)]) == balanced(500, speeds, overheads)
    with pytest.raises(ValueError, match="phases"):
        balanced_phases(500, phases * 2)
    with pytest.raises(ValueError, match="no device"):
        balanced_phases(5, [([0.0, 1.0], [0, 0]), ([1.0, 0.0], [0, 0])])
    # a device that can never finish (an infinite fixed cost) takes nothing; NaN is an error
    assert balanced_phases(10, [([1, 1], [0, math.inf]), ([1, 1], [0, 0])]) == [10, 0]
    with pytest.raises(ValueError, match="overheads must be numbers"):
        balanced_phases(10, [([1, 1], [0, math.nan]), ([1, 1], [0, 0])])


def test_balancer_with_phases_keeps_their_split():
    """The balancer's phase model follows each device's measured speed: measured as
    calibrated, it proposes nothing (its link's fixed time, most of its busy time, is not
    taken for slowness); the linked device twice as fast, more kernels for it."""
    f, b, lk = 0.375e-3, 0.78e-3, 2e-6
    phases = [([1 / f, 1 / (f + lk)], [0.0, 0.55]), ([1 / b, 1 / (b + lk)], [0.0, 0.55])]
    speeds, overheads = [1 / (f + b), 1 / (f + b + 2 * lk)], [0.0, 1.1]
    bal = Balancer(1500, speeds, overheads, phases=phases, patience=1, fixed=[0.0, 1.1])
    counts = bal.partition()
    assert counts == balanced_phases(1500, phases)
    busy = [o + k / s for k, s, o in zip(counts, speeds, overheads)]
    assert all(bal.observe(counts, busy) is None for _ in range(5))
    model = bal.model()
    assert model[0][0] == pytest.approx(phases[0][0])
    bal.speeds[1] *= 2
    assert bal.partition()[1] > counts[1]


def test_balanced_leaves_out_a_device_that_would_slow_the_step():
    # a fast device, and one whose fixed cost alone exceeds the whole step on the first
    assert balanced(100, [100.0, 50.0], [0.0, 2.0]) == [100, 0]
    # with a small fixed cost it takes its (smaller) part
    counts = balanced(100, [100.0, 50.0], [0.0, 0.1])
    assert 0 < counts[1] < 33


def test_balanced_follows_memory_caps():
    assert balanced(1500, [10.0, 1.0], caps=[300, 1500]) == [300, 1200]


def simulate(balancer, speeds_at, steps, total, noise, seed=0):
    rnd = random.Random(seed)
    counts = even(total, len(speeds_at(0)))
    history = []
    for step in range(steps):
        sp = speeds_at(step)
        busy = [c / s * rnd.uniform(1 - noise, 1 + noise) if c else 0.0
                for c, s in zip(counts, sp)]
        new = balancer.observe(counts, busy)
        if new is not None:
            assert sum(new) == total
            counts = new
        history.append(list(counts))
    return history


@pytest.mark.parametrize("noise", [0.0, 0.05, 0.2])
def test_balancer_settles_after_a_speed_change_without_oscillating(noise):
    total = 1500
    speeds_at = (lambda step: [1.0, 1.0] if step < 10 else [1.0, 0.25])
    history = simulate(Balancer(total, [1.0, 1.0]), speeds_at, 40, total, noise)
    assert all(h == history[0] for h in history[:10])      # balanced: nothing moves
    ideal = 0.2 * total
    settled = next(i for i in range(10, 40) if abs(history[i][1] - ideal) < 0.05 * total)
    assert settled - 10 < 10                                # within 10 steps of the change
    moves_after = sum(1 for a, b in zip(history[settled:], history[settled + 1:]) if a != b)
    assert moves_after <= 1                                 # and it stays put


def test_balancer_ignores_noise_when_balanced():
    history = simulate(Balancer(500, [1.0, 1.0, 1.0]), lambda s: [1.0, 1.0, 1.0], 60, 500, 0.2)
    assert len({tuple(h) for h in history}) <= 2


# ------------------------------------------------------------------------------------------------
# In training: the emulated speed of a device changes mid-training


def _train_through_a_speed_change(change: int) -> list:
    """d1's share of conv2 after each of 30 steps on two cpu:1 devices, d1 4x slower from step
    `change` on (the test hook)."""
    # big enough that a layer's work (tens of ms) outweighs the fixed cost of handing it to
    # the devices' threads
    shape = net_shape((3, 32, 32), (48, 192), 5, 10)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, 32)
    devices = make_devices(parse_devices("cpu:1,cpu:1"))
    try:
        cal = calibrate(devices, shape.blocks, 32)
        part = {g.name: balanced(g.K, cal.speeds[g.name]) for g in shape.blocks}
        net = Net(shape, init_params(shape, 0), devices, part, CpuBackend(1))
        balance = DynamicBalance(net, cal)
        history = []
        for step in range(1, 31):
            if step == change:
                devices[1].speed = 0.25          # the test hook: d1 becomes 4x slower
            net.train_step(x, y, SGDConfig())
            balance.after_step(step)
            history.append(net.convs[1].counts[1] / 192)
    finally:
        for d in devices:
            d.close()
    return history


def test_dynamic_balancing_follows_a_speed_change_in_training():
    change = 6

    def verdict(history):
        """What is wrong with a run, or None."""
        report = " ".join(f"{s:.2f}" for s in history)
        if not all(0.4 <= s <= 0.6 for s in history[:change - 1]):
            return f"uneven before the change: {report}"      # even machines, even
        # within 15 steps of the change d1 has lost most of its share: about a fifth is right
        # (it took 3 to 9 steps in runs on a quiet 2-core machine; a loaded one makes the
        # busy times noisier, and the balancer waits for a gain that beats the noise)
        moved = next((i for i in range(change - 1, len(history)) if history[i] < 0.36), None)
        if moved is None or moved - (change - 1) >= 15:
            return f"no move within 15 steps of the change: {report}"
        if not all(s <= 0.36 for s in history[moved:]):
            return f"the share came back: {report}"
        # d0 alone (d1 then holding none) may be tried where d0's calibrated time alone beats
        # the split; it is left again if d0 alone turns out slower: one such visit at most,
        # and few moves in all
        visits = sum(1 for a, b in zip(history[moved:], history[moved + 1:]) if b < 0.05 <= a)
        moves_after = sum(1 for a, b in zip(history[moved:], history[moved + 1:]) if a != b)
        if visits > 1 or moves_after > 4:
            return f"{visits} visits of d0 alone, {moves_after} moves after: {report}"
        return None

    # Other work on the machine slows one core more than the other, and the balancer is right
    # to follow that: then the equal devices are not equal before the change, and the run
    # says nothing about the change (seen once in CI, on 2 cores shared with MPI tests: d1's
    # share fell to 0.01 before the change); such a stretch after the change delays the move
    # (seen once: 15 steps, where runs take 3 to 9) or disturbs it. A run is tried three
    # times; a balancer that does not follow the change fails every one.
    said = []
    for _ in range(3):
        said.append(verdict(_train_through_a_speed_change(change)))
        if said[-1] is None:
            break
    assert said[-1] is None, said


# ------------------------------------------------------------------------------------------------
# Memory caps and devices left out


def test_balancer_never_proposes_more_than_a_memory_cap():
    # d0 is ten times as fast, but its memory holds only 30 of the 100 kernels
    balancer = Balancer(100, [1.0, 1.0], caps=[30, 100], patience=1)
    counts, proposals = [30, 70], []
    for _ in range(12):
        new = balancer.observe(counts, [30 / 10.0, 70 / 1.0])
        if new is not None:
            proposals.append(new)
            counts = new
    assert all(c[0] <= 30 and sum(c) == 100 for c in proposals), proposals
    assert counts == [30, 70]
    # without the cap the same measurements move most kernels to d0
    free = Balancer(100, [1.0, 1.0], patience=1)
    moved = [free.observe([30, 70], [30 / 10.0, 70 / 1.0]) for _ in range(12)]
    assert any(m is not None and m[0] > 30 for m in moved)


def test_balancer_gives_nothing_to_a_device_left_out():
    balancer = Balancer(60, [1.0, 1.0, 1.0], patience=1)
    balancer.leave_out([1])
    counts = [30, 0, 30]
    for _ in range(8):   # d1 was the fastest; it still gets nothing
        new = balancer.observe(counts, [30 / 1.0, 0.0, 30 / 2.0])
        if new is not None:
            assert new[1] == 0 and sum(new) == 60
            counts = new
    assert counts[0] < counts[2]


def test_calibration_keeps_a_layer_on_one_device_when_alone_is_faster():
    """Calibration.partition: the split of two devices that slow each other is predicted
    slower than the faster one on its own (as timed alone): the whole layer goes to it."""
    from pyhet.calibrate import Calibration
    speeds, overheads = {"c": [100.0, 90.0]}, {"c": [0.0, 0.0]}
    # fits: (seconds per kernel, fixed seconds, shared) of each device on its own
    fits = {"c": [[0.25 / 60, 0.0, 1], [0.3 / 60, 0.0, 1]]}
    cal = Calibration(speeds, overheads, {"c": [60, 60]}, fits=fits)
    split = balanced(60, speeds["c"], overheads["c"])
    assert predicted_time(split, speeds["c"]) > 0.25
    assert cal.partition("c", 60) == [60, 0]
    assert cal.predicted("c", [60, 0]) == pytest.approx(0.25)
    # the device that could hold the layer is the only candidate
    assert cal.partition("c", 60, caps=[59, 60]) == [0, 60]
    # a split predicted faster than either alone stays
    cal.fits["c"] = [[0.9 / 60, 0.0, 1], [0.9 / 60, 0.0, 1]]
    assert cal.partition("c", 60) == split


def test_balancer_keeps_a_layer_that_is_faster_on_one_device():
    """Given each device's time on its own, the balancer's target is the faster device alone
    where that beats the split, and it proposes no split from there; slowed to a third of its
    speed, that device loses the layer to the split again."""
    speeds, overheads = [100.0, 90.0], [0.0, 0.0]
    bal = Balancer(60, speeds, overheads, patience=1, alone=[0.25, 0.9])
    assert bal.partition() == [60, 0]
    assert bal.time([60, 0]) == pytest.approx(0.25)
    # alone, it runs as calibrated (faster than its speed in the split says): it stays alone
    assert all(bal.observe([60, 0], [0.25, 0.0]) is None for _ in range(5))
    assert bal.speeds == speeds
    # before it has run alone, its calibrated time alone follows its speed in the split
    slowed = Balancer(60, speeds, overheads, patience=1, alone=[0.25, 0.9])
    slowed.speeds[0] /= 3   # its time alone is now 0.75 s, the split's about 0.5 s
    assert sum(1 for k in slowed.partition() if k) == 2


def test_a_layer_that_goes_to_one_device_leaves_the_others_none():
    """From a split, where one device alone beats it, the move puts every kernel on that
    device: the others keep no kernel to be measured (a kernel each measured nothing of their
    speed and cost the layer their products' fixed part and its waits). A split that leaves a
    device one kernel is priced as a split, not as the other device alone."""
    speeds, overheads = [100.0, 90.0], [0.0, 0.0]
    bal = Balancer(60, speeds, overheads, patience=1, alone=[0.25, 0.9])
    counts = [32, 28]                            # 0.32 s split; d0 alone 0.25 s
    moved = next(m for m in (bal.observe(counts, [0.32, 0.31]) for _ in range(6)) if m)
    assert moved == [60, 0]
    assert bal.time([59, 1]) == pytest.approx(0.59)    # d0's 59 kernels at 100/s
    assert bal.time([60, 0]) == pytest.approx(0.25)


def test_balancer_takes_the_layers_waits_as_calibration_does():
    """A split's time takes the layer's waits between phases (Calibration.waits), as
    calibration's partition does: a split predicted faster than one device alone by the
    devices' speeds, but slower with its waits, is not made; busy times that keep to the
    estimates move nothing. Without the waits the same balancer splits the layer."""
    from pyhet.calibrate import Calibration

    speeds, overheads = [100.0, 100.0], [0.0, 0.0]
    split = balanced(60, speeds, overheads)
    assert predicted_time(split, speeds) == pytest.approx(0.3)    # alone: 0.4 s
    plain = Balancer(60, speeds, overheads, patience=1, alone=[0.4, 0.4])
    assert plain.partition() == split
    waiting = Balancer(60, speeds, overheads, patience=1, alone=[0.4, 0.4], waits=1.5)
    assert waiting.time(split) == pytest.approx(0.45)
    assert waiting.time([60, 0]) == pytest.approx(0.4)       # one device: no waits
    assert waiting.partition() == [60, 0]
    assert all(waiting.observe([60, 0], [0.4, 0.0]) is None for _ in range(6))
    # the same decision as calibration's
    fits = {"c": [[0.4 / 60, 0.0, 1], [0.4 / 60, 0.0, 1]]}
    cal = Calibration({"c": speeds}, {"c": overheads}, {"c": [60, 60]}, fits=fits,
                      waits={"c": 1.5})
    assert cal.partition("c", 60) == [60, 0]


def test_a_split_among_devices_of_this_process_takes_no_waits_of_ranks():
    """Where devices of other ranks take part, a layer's waits are those of a split that gives
    them kernels (calibration times that split as a step runs it: its phases wait on their
    messages); a split among the devices of this process alone does not take them, and
    calibration's partition and the balancer weigh it beside the full split and one device
    alone (of two local cpu:1 and one of another rank, a short layer split over all three was
    slower than over the two, which were not weighed)."""
    from pyhet.calibrate import Calibration
    from pyhet.partition import local_split, split_waits

    linked = [False, False, True]
    assert split_waits(2.0, [3, 3, 0], linked) == 1.0      # the two of this process
    assert split_waits(2.0, [3, 0, 3], linked) == 2.0      # one of another rank takes part
    assert split_waits(2.0, [6, 0, 0], linked) == 1.0      # one device: no waits
    assert split_waits(2.0, [3, 3, 0], None) == 2.0        # not known: as measured
    assert split_waits(2.0, [3, 3, 0], [False] * 3) == 2.0  # all of this process
    speeds, overheads = [100.0] * 3, [0.0] * 3
    assert local_split(60, [(speeds, overheads)], [60] * 3, linked) == [30, 30, 0]
    assert local_split(60, [(speeds, overheads)], [60, 0, 60], linked) is None   # one left
    assert local_split(60, [(speeds, overheads)], [20, 20, 60], linked) is None  # too small
    assert local_split(60, [(speeds, overheads)], [60] * 3, [False] * 3) is None
    # over all three: 0.2 s and its waits (2): 0.4 s; over the two: 0.3 s; one alone: 0.6 s
    bal = Balancer(60, speeds, overheads, patience=1, alone=[0.6] * 3, waits=2.0,
                   linked=linked)
    assert bal.time([20, 20, 20]) == pytest.approx(0.4)
    assert bal.time([30, 30, 0]) == pytest.approx(0.3)
    assert bal.partition() == [30, 30, 0]
    unknown = Balancer(60, speeds, overheads, patience=1, alone=[0.6] * 3, waits=2.0)
    assert unknown.partition() == [20, 20, 20] and unknown.time([30, 30, 0]) == 0.6
    part = {"compute_kernels_per_s": 100.0, "compute_overhead_s": 0.0, "link_fixed_s": 0.0,
            "link_s_per_kernel": 0.0}
    cal = Calibration({"c": speeds}, {"c": overheads}, {"c": [60] * 3},
                      parts={"c": [None, None, part]}, fits={"c": [[0.01, 0.0, 1]] * 3},
                      waits={"c": 2.0})
    assert cal.linked("c") == linked and cal.linked("d") is None
    assert cal.predicted("c", [30, 30, 0]) == pytest.approx(0.3)
    assert cal.predicted("c", [20, 20, 20]) == pytest.approx(0.4)
    assert cal.partition("c", 60) == [30, 30, 0]
    assert replace(cal, parts=None).partition("c", 60) == [20, 20, 20]
    assert replace(cal, waits=None).partition("c", 60) == [20, 20, 20]
    net = __import__("types").SimpleNamespace(
        convs=[__import__("types").SimpleNamespace(name="c", K=60)], devices=[])
    assert DynamicBalance(net, cal).balancers["c"].linked == linked
    assert DynamicBalance(net, cal).balancers["c"].local_speedup is None
    # the two compute 1.5 times as fast with the rank's device idle: 0.2 s for the split
    timed = replace(cal, contention={"c": [1.5, 1.5, 1.2]},
                    local_contention={"c": [1.0, 1.0, 1.2]})
    assert timed.local_speedup("c") == pytest.approx([1.5, 1.5, 1.0])
    assert timed.predicted("c", [30, 30, 0]) == pytest.approx(0.2)
    assert timed.predicted("c", [20, 20, 20]) == pytest.approx(0.4)
    assert DynamicBalance(net, timed).balancers["c"].local_speedup == pytest.approx(
        [1.5, 1.5, 1.0])


def test_the_balancer_moves_to_the_split_among_its_own_devices():
    """From a split over all three devices to the faster split among the two of this process:
    the device of another rank keeps no kernel to be measured (one kernel on it would cost the
    split its waits, and the move would never gain); a split among the two takes their own
    waits (local_waits) where timed."""
    linked = [False, False, True]
    bal = Balancer(60, [100.0] * 3, [0.0] * 3, patience=1, alone=[0.6] * 3, waits=2.0,
                   linked=linked)
    counts = [20, 20, 20]                                      # 0.4 s; the two: 0.3 s
    moved = next(m for m in (bal.observe(counts, [0.2, 0.2, 0.2]) for _ in range(6)) if m)
    assert moved == [30, 30, 0]
    timed = Balancer(60, [100.0] * 3, [0.0] * 3, patience=1, alone=[0.6] * 3, waits=2.0,
                     linked=linked, local_waits=1.5)
    assert timed.time([30, 30, 0]) == pytest.approx(0.45)
    assert timed.partition() == [20, 20, 20]                  # 0.4 s against 0.45 s
    # a split among the two keeps measuring its devices
    assert bal.observe([30, 30, 0], [0.3, 0.3, 0.0]) is None


def test_the_balancer_prices_a_split_among_its_own_devices_at_their_local_speed():
    """Devices that compute twice as fast with the rank's device idle (local_speedup 2): a
    split among them is priced at that speed, and their busy times in it are taken back to
    their speeds in a split over all (the estimates stay where the split runs as predicted,
    and a split over all is not predicted faster than it is)."""
    linked = [False, False, True]
    bal = Balancer(60, [50.0] * 3, [0.0] * 3, patience=1, alone=[2.0] * 3, waits=1.0,
                   linked=linked, local_speedup=[2.0, 2.0, 1.0])
    assert bal.time([30, 30, 0]) == pytest.approx(0.3)         # 30 / (2 x 50)
    assert bal.time([20, 20, 20]) == pytest.approx(0.4)        # 20 / 50
    assert bal.partition() == [30, 30, 0]
    for _ in range(8):
        assert bal.observe([30, 30, 0], [0.3, 0.3, 0.0]) is None
    assert bal.speeds[:2] == [pytest.approx(50.0)] * 2
    # without the speedup the same busy times read as twice the speed over all
    plain = Balancer(60, [50.0] * 3, [0.0] * 3, patience=1, alone=[2.0] * 3, linked=linked)
    for _ in range(8):
        plain.observe([30, 30, 0], [0.3, 0.3, 0.0])
    assert plain.speeds[0] > 60.0
    # none without a device of another rank
    assert Balancer(60, [50.0] * 2, local_speedup=[2.0, 2.0]).local_speedup is None
    # the machine slowed twice while the split among the two runs: every estimate takes it
    # (the rank's device computes on it too), and the speedup stays, so that both splits are
    # priced as they would run and the split among the two is kept
    slowed = Balancer(60, [50.0] * 3, [0.0] * 3, patience=1, alone=[9.0] * 3, linked=linked,
                      local_speedup=[1.25, 1.25, 1.0], waits=1.5)
    for _ in range(30):
        assert slowed.observe([30, 30, 0], [30 / (1.25 * 25), 30 / (1.25 * 25), 0.0]) is None
    assert slowed.time([30, 30, 0]) == pytest.approx(0.96, rel=0.05)
    assert slowed.time([20, 20, 20]) == pytest.approx(1.2, rel=0.05)
    # a calibrated speedup is taken within the bounds (at least 1)
    assert Balancer(60, [50.0] * 3, linked=linked,
                    local_speedup=[0.8, 9.0, 1.0]).local_speedup == [1.0, 5.0, 1.0]


def test_a_resumed_layer_on_one_device_beside_one_kernel_each_goes_whole_on_it():
    """An earlier version's balancer ran a layer on one device while the others kept a kernel
    each ([K-1, 1], its alone_seen set): a resume puts it whole on that device, as the balancer
    now runs it (else the one kernels would be measured as those devices' speeds). A split
    that is not so is kept."""
    from pyhet.train import alone_again

    seen = {"speeds": [100.0, 90.0], "noise": [0.0, 0.0], "alone_seen": [0.26, None]}
    assert alone_again([59, 1], seen) == [60, 0]
    assert alone_again([58, 1, 1], dict(seen, alone_seen=[0.26, None, None])) == [60, 0, 0]
    assert alone_again([59, 1], dict(seen, alone_seen=[None, None])) == [59, 1]
    assert alone_again([59, 1], None) == [59, 1]
    assert alone_again([50, 10], seen) == [50, 10]
    assert alone_again([60, 0], seen) == [60, 0]


def test_dynamic_balance_gives_each_layer_its_waits():
    import types

    from pyhet.calibrate import Calibration

    net = types.SimpleNamespace(convs=[types.SimpleNamespace(name=n, K=60) for n in "cd"],
                                devices=[])
    two = {n: [100.0, 100.0] for n in "cd"}
    cal = Calibration(two, {n: [0.0, 0.0] for n in "cd"}, {n: [60, 60] for n in "cd"},
                      waits={"c": 1.5})
    got = DynamicBalance(net, cal).balancers
    assert (got["c"].waits, got["d"].waits) == (1.5, 1.0)
    assert DynamicBalance(net, replace(cal, waits=None)).balancers["c"].waits == 1.0


def test_balancer_goes_back_to_the_split_when_alone_runs_slower_than_calibrated():
    """A layer moved to one device alone, which then takes longer than its calibrated time
    alone (and than the split): its measured time alone replaces the calibrated one and the
    split comes back. The other device, holding none of the layer meanwhile, keeps its
    estimates."""
    speeds, overheads = [100.0, 90.0], [0.0, 0.0]
    bal = Balancer(60, speeds, overheads, patience=2, alone=[0.25, 0.9])
    assert bal.partition() == [60, 0]
    counts, moves = [60, 0], []
    for _ in range(12):
        # d0 takes 0.46 s for the layer
        new = bal.observe(counts, [0.46, 0.0])
        if new is not None:
            moves.append(new)
            counts = new
            break
    assert moves and all(k > 1 for k in moves[0]), moves
    assert bal.speeds == speeds                  # nothing was learnt of their split speeds
    # seen as longer than calibrated (an average from it, towards the 0.46 s measured)
    assert 0.3 < bal.time([60, 0]) <= 0.46
    assert bal.time([60, 0]) > bal.time(moves[0])
    # in the split it stays: the time alone as seen is the longer
    assert bal.partition() == moves[0]
