"""Distributed training gives the single-device weights: any partition of the kernels over
mixed devices, C++ and reference, ends within float32 tolerance of one reference device."""

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_same_weights, net_shape, train_weights
from pyhet.backends.cpu import CpuBackend
from pyhet.devices import make_devices
from pyhet.model import Net, init_params
from pyhet.specs import parse_devices
from pyhet.optim import SGDConfig

CFG = SGDConfig(lr=0.05, momentum=0.9, weight_decay=1e-3)
SHAPE = net_shape((2, 13, 12), (7, 9), 3, 5)   # pooling drops a row in both blocks


def batch(seed, n=6):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n,) + SHAPE.input_shape).astype(np.float32),
            rng.integers(0, SHAPE.num_classes, n))


def train(spec, partition, steps=3):
    return train_weights(SHAPE, spec, partition, [batch(s) for s in range(steps)], CFG)


@pytest.fixture(scope="module")
def reference():
    return train("numpy", {"conv1": [7], "conv2": [9]})


def test_cpu_step_matches_reference(reference):
    params, losses = train("cpu:1", {"conv1": [7], "conv2": [9]})
    assert_same_weights(params, reference[0])
    np.testing.assert_allclose(losses, reference[1], rtol=1e-5)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from(["cpu:1", "numpy", "cpu:2"]), min_size=2, max_size=4),
       st.data())
def test_any_partition_gives_single_device_weights(reference, kinds, data):
    n = len(kinds)
    part = {}
    for layer, K in (("conv1", 7), ("conv2", 9)):
        cuts = sorted(data.draw(st.lists(st.integers(0, K), min_size=n - 1, max_size=n - 1)))
        bounds = [0] + cuts + [K]
        part[layer] = [bounds[i + 1] - bounds[i] for i in range(n)]   # zeros allowed
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # more threads than cores is fine here
        params, _ = train(",".join(kinds), part)
    assert_same_weights(params, reference[0])


def test_repartition_mid_training_keeps_the_result(reference):
    devices = make_devices(parse_devices("cpu:1,numpy,cpu:1"))
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [3, 2, 2], "conv2": [3, 3, 3]},
                  CpuBackend(1))
        net.train_step(*batch(0), CFG)
        net.convs[0].repartition([0, 1, 6])
        net.convs[1].repartition([8, 0, 1])
        net.train_step(*batch(1), CFG)
        net.convs[1].repartition([1, 4, 4])
        net.train_step(*batch(2), CFG)
        assert_same_weights(net.params(), reference[0])
    finally:
        for d in devices:
            d.close()


@pytest.mark.parametrize("started", [False, True])
def test_repartitions_move_kernels_exactly(started):
    """Random repartitions of one layer over three devices (some getting none): the layer's
    weights and momentum, read back, are what they were, bit for bit."""
    devices = make_devices(parse_devices("cpu:1,numpy,cpu:1"))
    try:
        net = Net(SHAPE, init_params(SHAPE, 3), devices, {"conv1": [3, 2, 2], "conv2": [3, 3, 3]},
                  CpuBackend(1))
        if started:
            net.train_step(*batch(1), CFG)
        conv = net.convs[1]
        want = conv.gather_state()
        rng = np.random.default_rng(4)
        for _ in range(12):
            cuts = np.sort(rng.integers(0, conv.K + 1, 2))
            counts = [int(cuts[0]), int(cuts[1] - cuts[0]), int(conv.K - cuts[1])]
            conv.repartition(counts)
            assert conv.counts == counts
            for got, ref_ in zip(conv.gather_state(), want):
                if ref_ is None:
                    assert got is None
                else:
                    np.testing.assert_array_equal(got, ref_)
    finally:
        for d in devices:
            d.close()


@contextlib.contextmanager
def stepped_net(spec, partition, seed, cfg=CFG, first=1):
    """A network on the devices of `spec` after one step with `cfg` on batch(first):
    (net, devices), closed after."""
    devices = make_devices(parse_devices(spec))
    try:
        net = Net(SHAPE, init_params(SHAPE, seed), devices, partition, CpuBackend(1))
        net.train_step(*batch(first), cfg)
        yield net, devices
    finally:
        for d in devices:
            d.close()


def test_a_device_without_momentum_takes_kernels_with_theirs():
    """A device that had no kernels in the first step has no momentum; kernels that move to it
    keep theirs (its own part, none, reads as zeros, as join_states has it), and the shard it
    gets shares no memory with the one it had: the update writes into it in place."""
    with stepped_net("cpu:1,cpu:1,numpy", {"conv1": [3, 2, 2], "conv2": [5, 0, 4]},
                     5) as (net, devices):
        conv = net.convs[1]
        want = conv.gather_state()
        assert all(a is not None for a in want)
        assert devices[1]._shards["conv2"].vw is None          # never updated
        old = devices[0]._shards["conv2"]
        conv.repartition([3, 4, 2])
        for got, ref_ in zip(conv.gather_state(), want):
            np.testing.assert_array_equal(got, ref_)
        new = devices[0]._shards["conv2"]
        assert all(not np.shares_memory(a, b) for a, b in
                   zip((new.w, new.b, new.vw, new.vb), (old.w, old.b, old.vw, old.vb)))
        conv.repartition([0, 9, 0])      # one device keeps nothing of its own: all arrives
        for got, ref_ in zip(conv.gather_state(), want):
            np.testing.assert_array_equal(got, ref_)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_a_host_group_repartitions_by_views_of_its_arrays(momentum):
    """Once a host group has updated, its state is in arrays of the whole layer: a repartition
    among its members hands out views of their new rows and copies nothing, its weights and
    momentum read back bit for bit; one that gives kernels to a device outside the group
    copies them as before."""
    cfg = SGDConfig(lr=0.05, momentum=momentum, weight_decay=1e-3)
    with stepped_net("cpu:1,cpu:1,numpy", {"conv1": [3, 4, 0], "conv2": [5, 4, 0]}, 6,
                     cfg) as (net, devices):
        conv = net.convs[1]
        want = conv.gather_state()
        assert (want[2] is None) == (momentum == 0)
        index, with_momentum = conv._views
        assert with_momentum == (momentum > 0)
        arrays = {n: conv._buffers[(n, index)] for n in ("w", "b", "vw", "vb")
                  if with_momentum or n[0] != "v"}
        rng = np.random.default_rng(7)
        for counts in [[9, 0, 0], [0, 9, 0]] + [
                [int(c), 9 - int(c), 0] for c in rng.integers(0, 10, 6)]:
            moves, before = conv.moves, list(conv.counts)
            conv.repartition(counts)
            assert conv.counts == counts and conv.moves == moves + (counts != before)
            for i, (k0, k1) in enumerate(conv.bounds[:2]):
                s = devices[i]._shards["conv2"]
                for name, a in arrays.items():
                    view = getattr(s, name)
                    assert view.shape[0] == k1 - k0 and (k1 == k0 or (
                        np.shares_memory(view, a) and view.base is not None))
                if not with_momentum:
                    assert s.vw is None and s.vb is None
            for got, ref_ in zip(conv.gather_state(), want):
                if ref_ is None:
                    assert got is None
                else:
                    np.testing.assert_array_equal(got, ref_)
        conv.repartition([3, 3, 3])     # the numpy device: a copy of its kernels
        assert conv._views is None
        assert not np.shares_memory(devices[2]._shards["conv2"].w, arrays["w"])
        for got, ref_ in zip(conv.gather_state(), want):
            if ref_ is not None:
                np.testing.assert_array_equal(got, ref_)


def test_repartitions_by_views_keep_the_result(reference):
    """Training with repartitions within a host group (views of its arrays), into one device
    (whose update then writes arrays of its own, so the next move copies) and back, ends at
    the single reference device's weights."""
    devices = make_devices(parse_devices("cpu:1,cpu:1"))
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [3, 4], "conv2": [4, 5]},
                  CpuBackend(1))
        net.train_step(*batch(0), CFG)
        assert net.convs[1]._views is not None
        net.convs[0].repartition([7, 0])
        net.convs[1].repartition([9, 0])
        net.train_step(*batch(1), CFG)
        assert net.convs[1]._views is None   # one device: its update wrote its own arrays
        net.convs[1].repartition([2, 7])
        net.convs[0].repartition([5, 2])
        net.train_step(*batch(2), CFG)
        assert_same_weights(net.params(), reference[0])
    finally:
        for d in devices:
            d.close()


def _same_state(got, want):
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            np.testing.assert_array_equal(g, w)


@pytest.fixture
def stepped_pair():
    """A network on two cpu devices (one host group) after one step: (net, devices)."""
    with stepped_net("cpu:1,cpu:1", {"conv1": [3, 4], "conv2": [4, 5]}, 0, first=0) as stepped:
        yield stepped


def test_a_move_after_set_state_moves_the_state_set(stepped_pair):
    """set_state gives each device a copy of its kernels: the group's arrays no longer hold the
    layer, and a move after it carries the state set, not the one before."""
    net, _ = stepped_pair
    params, moms = net.state()
    net.set_state({k: v + 1.0 for k, v in params.items()}, moms)
    conv = net.convs[1]
    want = conv.gather_state()
    conv.repartition([9, 0])
    _same_state(conv.gather_state(), want)


def test_a_move_after_a_step_without_momentum_keeps_the_momentum(stepped_pair):
    """A step with momentum 0 after one with momentum keeps each device's momentum as it was
    (torch's rule), in arrays of its own: a move after it carries that momentum."""
    net, _ = stepped_pair
    net.train_step(*batch(1), SGDConfig(lr=0.05, momentum=0.0, weight_decay=1e-3))
    conv = net.convs[1]
    want = conv.gather_state()
    assert want[2] is not None and np.abs(want[2]).max() > 0
    conv.repartition([2, 7])
    _same_state(conv.gather_state(), want)


def test_a_failed_update_then_a_move_keeps_the_state_before_the_step(stepped_pair):
    """An update that fails on one device commits nothing: a move within the group after it
    carries the state of the step before."""
    from pyhet.errors import DeviceError
    from pyhet.faults import Fault
    net, devices = stepped_pair
    conv = net.convs[1]
    want = conv.gather_state()
    devices[1].fault, devices[1].step = Fault("update", 1), 1
    with pytest.raises(DeviceError, match="update"):
        net.train_step(*batch(1), CFG)
    devices[1].fault = devices[1].step = None
    conv.repartition([6, 3])
    _same_state(conv.gather_state(), want)


def test_training_on_partitions_reached_by_moves_keeps_the_result():
    """Steps on partitions reached by moves within a host group of three (each by views, no
    step on one device alone in between, as dynamic balancing moves): the reference's
    weights."""
    import warnings

    ref_, _ = train_weights(SHAPE, "numpy", {"conv1": [7], "conv2": [9]},
                            [batch(s) for s in range(5)], CFG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # more threads than cores is fine here
        devices = make_devices(parse_devices("cpu:1,cpu:1,cpu:1"))
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [3, 4, 0], "conv2": [4, 5, 0]},
                  CpuBackend(1))
        moves = [([5, 1, 1], [2, 3, 4]), ([1, 6, 0], [0, 8, 1]), ([2, 2, 3], [6, 0, 3]),
                 ([4, 3, 0], [3, 3, 3])]
        for s in range(5):
            net.train_step(*batch(s), CFG)
            for conv, counts in zip(net.convs, moves[s] if s < 4 else ()):
                assert conv._views is not None
                conv.repartition(counts)
        assert_same_weights(net.params(), ref_)
    finally:
        for d in devices:
            d.close()


def test_host_group_packs_its_shared_operands_once(reference):
    """Two cpu devices pack the shared im2col once for both products, straight from the input,
    each the columns of its share of the images (one device alone makes col); the packed
    operands follow the GEMM's micro-kernel when it changes between steps, and the weights stay
    those of one reference device."""
    from pyhet import _core, ops

    devices = make_devices(parse_devices("cpu:1,cpu:2,numpy"))
    packed_images, whole = [], []
    for d in devices[:2]:
        be = d.backend
        be.im2col_pack_part = (lambda x, g, fwd, t, images, f=be.im2col_pack_part:
                               (packed_images.append(images), f(x, g, fwd, t, images))[1])
        be.im2col_into = (lambda x, g, col, name=d.name, f=be.im2col_into:
                          (whole.append((name, col.shape)), f(x, g, col))[1])
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [3, 4, 0], "conv2": [0, 4, 5]},
                  CpuBackend(1))
        x, y = batch(0)
        net.train_step(x, y, CFG)
        pair, alone = net.convs[0]._shared, net.convs[1]._shared
        assert pair.fwd is not None and pair.col_t is not None
        assert (pair.fwd.k, pair.fwd.n) == pair.col.shape
        assert (pair.col_t.k, pair.col_t.n) == pair.col.shape[::-1]
        # the images go to the pair in proportion to their kernels (3 : 4), all of them
        n = len(x)
        assert sorted(packed_images) == [(0, round(n * 3 / 7)), (round(n * 3 / 7), n)]
        # conv2's only cpu device makes col whole
        assert whole == [(devices[1].name, alone.col.shape)]
        assert alone.fwd is None and alone.col_t is None
        _core.set_gemm_kernel("portable")
        try:
            net.train_step(*batch(1), CFG)
            assert pair.fwd.kernel == pair.col_t.kernel == "portable" == ops.gemm_kernel()
        finally:
            _core.set_gemm_kernel("auto")
        net.train_step(*batch(2), CFG)
        assert pair.fwd.kernel == ops.gemm_kernel()
        assert_same_weights(net.params(), reference[0])
    finally:
        for d in devices:
            d.close()


@pytest.mark.parametrize("images", [6, 5])
def test_host_group_packs_in_quadrants_where_strassen_pays(images):
    """Where Strassen's scheme pays for a member's share (here made to, by the GEMM's threshold
    lowered to 2), a host group packs the forward's operand as its quadrants' sums, when the
    layer's input has an even batch and channel count (conv1: 2 channels; not conv2: 7), each
    device the sums of its share of each half of the batch, and not col^T: each member's
    weight gradient reads those sums transposed. The weights stay those of one reference
    device. An odd batch packs them whole, and col^T too (conv1 has no input gradient)."""
    from pyhet import _core, ops

    data = [batch(s, images) for s in range(3)]
    want = train_weights(SHAPE, "numpy", {"conv1": [7], "conv2": [9]}, data, CFG)
    devices = make_devices(parse_devices("cpu:1,cpu:1"))
    halves = []
    for d in devices:
        be = d.backend
        be.im2col_pack_part = (  # the parts packed in quadrants
            lambda x, g, fwd, t, part, f=be.im2col_pack_part:
            (isinstance(fwd, ops.PackedQuadrants) and halves.append(part),
             f(x, g, fwd, t, part))[1])
    old = _core.set_gemm_strassen_min_dim(2)
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [3, 4], "conv2": [4, 5]},
                  CpuBackend(1))
        for x, y in data:
            net.train_step(x, y, CFG)
        conv1, conv2 = (c._shared for c in net.convs)
        even = images % 2 == 0
        assert conv1.quadrants == even and not conv2.quadrants
        assert isinstance(conv1.fwd, ops.PackedQuadrants) == even
        assert (conv1.col_t is None) == even and conv1.dw_operand is not None
        assert isinstance(conv2.fwd, _core.PackedB)
        if even:   # the 3 x 7 (image, sum) units, in proportion to the kernels (3 : 4)
            assert sorted(set(halves)) == [(0, 9), (9, 21)] and len(halves) == 6
        else:
            assert halves == []
        assert_same_weights(net.params(), want[0])
    finally:
        _core.set_gemm_strassen_min_dim(old)
        for d in devices:
            d.close()


@pytest.mark.parametrize("spec,counts", [
    ("cpu:1,cpu:1", {"conv1": [3, 3], "conv2": [4, 5]}),
    ("cpu:1,cpu:2,cpu:1", {"conv1": [1, 3, 2], "conv2": [2, 4, 3]}),
])
def test_host_group_weight_gradient_from_the_forward_quadrant_sums(spec, counts):
    """In quadrants, col^T's sums are not packed: in a layer with an input gradient (conv2, 6
    channels) the group makes the weight gradient with the input gradient, each device its
    share of the columns of each half of dw, from the forward's sums read transposed; in one
    without (conv1) each member makes its own kernels' from them. The weights stay those of
    one reference device."""
    from pyhet import _core, ops

    shape = net_shape((2, 13, 12), (6, 9), 3, 5)
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal((6,) + shape.input_shape).astype(np.float32),
             rng.integers(0, shape.num_classes, 6)) for _ in range(3)]
    want = train_weights(shape, "numpy", {"conv1": [6], "conv2": [9]}, data, CFG)
    devices = make_devices(parse_devices(spec))
    old = _core.set_gemm_strassen_min_dim(2)
    try:
        net = Net(shape, init_params(shape, 0), devices, counts, CpuBackend(1))
        for x, y in data:
            net.train_step(x, y, CFG)
        conv1, conv2 = (c._shared for c in net.convs)
        for shared in (conv1, conv2):
            assert shared.quadrants and isinstance(shared.fwd, ops.PackedQuadrants)
            assert shared.col_t is None
        assert conv2.dw_from_fwd and conv2.dw_operand is None
        assert not conv1.dw_from_fwd and conv1.dw_operand is conv1.fwd
        assert_same_weights(net.params(), want[0])
    finally:
        _core.set_gemm_strassen_min_dim(old)
        for d in devices:
            d.close()


@pytest.mark.parametrize("fused", [False, True])
def test_host_group_multiplies_all_its_kernels_at_once(reference, fused, monkeypatch):
    """A host group's update writes its members' new weights into their rows of one array of the
    whole layer (two, taking turns), and its backward their dy into one array, so that each
    member's part of the input gradient is one product over all of the group's kernels (not one
    per shard), and so is its part of the weight gradient (the columns of its channels), from
    col packed for the forward, read transposed: col^T is not packed for a layer with an input
    gradient (conv2), and is for one without (conv1). A device of another kind between them
    leaves the parts apart. fused: the input gradient's product and col2im in one, a block at
    a time (few kernels, ops.col2im_product), else sgemm then col2im. The weights stay those
    of one reference device."""
    from pyhet import ops
    from pyhet.backends import cpu

    if not fused:
        monkeypatch.setattr(cpu, "COL2IM_PRODUCT_KERNELS", 0)
    for spec, counts, joined in (("cpu:1,cpu:2,cpu:1", [2, 3, 4], True),
                                 ("cpu:1,numpy,cpu:1", [4, 2, 3], False)):
        devices = make_devices(parse_devices(spec))
        products, inside, grads = [], [], []
        original, part = ops.sgemm, cpu.CpuBackend.input_grad_part
        original_t, original_fused = ops.sgemm_packed_t, ops.col2im_product

        def counting(*args, **kwargs):
            if inside:   # w^T @ dy: the input gradient's products (kernels, from where)
                products.append((args[0].shape[0], np.shares_memory(args[0], weights[0])))
            return original(*args, **kwargs)

        def counting_fused(ws, *args, **kwargs):   # (kernels, from where) of each part
            products.append(tuple((w.shape[0], np.shares_memory(w, weights[0])) for w in ws))
            return original_fused(ws, *args, **kwargs)

        def counting_t(*args, **kwargs):   # dy @ col[rows]^T: the weight gradient's
            grads.append(args[0].shape[0])
            return original_t(*args, **kwargs)

        def input_grad_part(*args):
            inside.append(1)
            try:
                return part(*args)
            finally:
                inside.pop()

        try:
            net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [3, 2, 2],
                                                              "conv2": counts}, CpuBackend(1))
            net.train_step(*batch(0), CFG)
            conv = net.convs[1]
            group = [devices[i]._shards["conv2"].w.reshape(counts[i], -1) for i in conv.group]
            whole = cpu._joined_rows(group)
            weights = [devices[conv.group[0]]._shards["conv2"].w]
            assert (whole is not None) == joined
            if joined:    # the committed weights are one array, in kernel order
                assert whole.shape == (9, conv.g.C * conv.g.R * conv.g.S)
                np.testing.assert_array_equal(whole, np.concatenate(group))
            cpu.ops.sgemm, cpu.CpuBackend.input_grad_part = counting, input_grad_part
            cpu.ops.sgemm_packed_t, cpu.ops.col2im_product = counting_t, counting_fused
            try:
                net.train_step(*batch(1), CFG)
            finally:
                cpu.ops.sgemm, cpu.CpuBackend.input_grad_part = original, part
                cpu.ops.sgemm_packed_t, cpu.ops.col2im_product = original_t, original_fused
            conv1, conv2 = (c._shared for c in net.convs)
            assert conv2.fwd is not None and conv2.col_t is None and conv2.dw_from_fwd
            assert conv1.col_t is not None and not conv1.dw_from_fwd
            # conv2's weight gradient: one product per member of all its kernels when joined,
            # one per shard per member when not (the numpy device's own)
            assert sorted(grads) == ([9, 9, 9] if joined else [3, 3, 4, 4])
            # conv2's input gradient: one product per member, of all 9 kernels, when joined
            # straight from the group's weights; apart, one per member from joined copies of the
            # shards' columns (JOIN_KERNELS), or, fused, the shards' weights as they are
            if fused:
                assert sorted(products) == ([((9, True),)] * 3 if joined else
                                            [((4, True), (3, False))] * 2)
            else:
                assert sorted(products) == ([(9, True)] * 3 if joined else [(7, False)] * 2)
            net.train_step(*batch(2), CFG)
            assert_same_weights(net.params(), reference[0])
        finally:
            for d in devices:
                d.close()


def test_joined_rows_only_joins_consecutive_rows_of_one_array():
    from pyhet.backends.cpu import _joined_rows

    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    flat = a.reshape(12, 5)
    np.testing.assert_array_equal(_joined_rows([flat[1:3], flat[3:4], flat[4:9]]), flat[1:9])
    np.testing.assert_array_equal(_joined_rows([a[0].reshape(4, 5), a[1].reshape(4, 5)]),
                                  flat[:8])
    assert _joined_rows([flat[0:2], flat[3:5]]) is None           # a gap
    assert _joined_rows([flat[2:4], flat[0:2]]) is None           # out of order
    assert _joined_rows([flat[0:2], flat[2:4].copy()]) is None    # another array
    assert _joined_rows([flat[0:2, :3], flat[2:4, :3]]) is None   # not whole rows
    assert _joined_rows([np.zeros((2, 5), np.float32)]) is None   # owns its memory
    assert _joined_rows([flat.astype(np.float64)[0:2]]) is None
    assert _joined_rows([flat.reshape(-1)[:10]]) is None            # not a matrix


def test_an_update_never_writes_over_the_current_weights():
    devices = make_devices(parse_devices("cpu:1"))
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [7], "conv2": [9]},
                  CpuBackend(1))
        net.train_step(*batch(0), CFG)
        d, s = devices[0], devices[0]._shards["conv2"]
        with pytest.raises(ValueError, match=r"apart from the current ones, got \(9, 7, 3, 3\) "
                                             r"over them"):
            d.sgd_stage("conv2", CFG, s.w[:])
        with pytest.raises(ValueError, match=r"a buffer of shape \(9, 7, 3, 3\).*got \(8, 7, 3"):
            d.sgd_stage("conv2", CFG, np.empty((8, 7, 3, 3), np.float32))
        with pytest.raises(ValueError, match=r"new biases need a buffer of shape \(9,\) apart "
                                             r"from the current ones, got \(9,\) over them"):
            d.sgd_stage("conv2", CFG, None, s.b[:])
        with pytest.raises(ValueError, match=r"new momentum need a buffer of shape "
                                             r"\(9, 7, 3, 3\).*got \(9, 63\)$"):
            d.sgd_stage("conv2", CFG, None, None, np.empty((9, 63), np.float32))
        with pytest.raises(ValueError, match=r"new bias momentum .* over them"):
            d.sgd_stage("conv2", CFG, None, None, None, s.vb[:])
        assert s.staged is None          # nothing staged by a refused update
    finally:
        devices[0].close()


def test_a_group_makes_both_of_its_weight_arrays_in_the_first_step():
    """A host group's members write their new weights into one of two arrays of the whole
    layer, in turn: the first step makes both (the second written, its pages touched then), so
    the second step makes none and the two arrays alternate from then on."""
    devices = make_devices(parse_devices("cpu:1,cpu:1"))
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [3, 4], "conv2": [4, 5]},
                  CpuBackend(1))
        conv = net.convs[1]
        net.train_step(*batch(0), CFG)
        made = dict(conv._buffers)
        arrays = [made[("w", 0)], made[("w", 1)]]
        assert all(a.shape == (9, 7, 3, 3) for a in arrays)
        for n in (1, 2, 3):
            net.train_step(*batch(n), CFG)
            assert set(conv._buffers) == set(made)
            assert all(conv._buffers[k] is a for k, a in made.items())
            # the current weights are rows of the array the last update wrote
            assert np.shares_memory(devices[0]._shards["conv2"].w, arrays[n % 2])
    finally:
        for d in devices:
            d.close()


def test_a_group_member_without_its_weight_gradient_rows_says_so():
    """Where the group packed only the forward's operand, a member's backward without its rows
    of the group's weight gradient (dw_out) would have nothing to make dw from: it refuses."""
    from pyhet.errors import DeviceError

    devices = make_devices(parse_devices("cpu:1,cpu:1"))
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, {"conv1": [3, 4], "conv2": [4, 5]},
                  CpuBackend(1))
        x, y = batch(0)
        net.train_step(x, y, CFG)
        conv = net.convs[1]
        h = net.convs[0].forward(x)
        out = conv.forward(h)
        assert conv._shared.dw_from_fwd
        with pytest.raises(DeviceError, match="conv2: the group packed only the forward's "
                                              "operand.*dw_out"):
            devices[0].call("backward", devices[0].conv_backward, "conv2",
                            np.ones_like(out[:, :4]), "shared")
    finally:
        for d in devices:
            d.close()


@pytest.mark.parametrize("spec,counts", [("cpu:1", ([7], [9])),
                                         ("cpu:1,numpy", ([4, 3], [5, 4]))])
def test_the_weights_are_gathered_without_the_momentum_and_copied_once(spec, counts):
    """params() asks no device for its momentum, and a layer on one device is its shard's one
    copy, not that copy joined again (a large layer's gathered weights were held three times
    at the end of training, beside its shards)."""
    from pyhet import devices as devices_module
    devices = make_devices(parse_devices(spec))
    asked = []
    try:
        net = Net(SHAPE, init_params(SHAPE, 0), devices, dict(zip(("conv1", "conv2"), counts)),
                  CpuBackend(1))
        net.train_step(*batch(0), CFG)
        for d in devices:
            get = d.get_shard
            d.get_shard = (lambda get: lambda *a: asked.append(a[3:]) or get(*a))(get)
        params, moms = net.params(), net.momentum()
        assert all(a == (False,) for a in asked[:2 * len(devices)])
        assert all(v is not None for pair in moms.values() for v in pair)
        state = net.state()
        for k, v in params.items():
            np.testing.assert_array_equal(v, state[0][k], err_msg=k)
    finally:
        for d in devices:
            d.close()
    part = (np.ones((2, 3)), np.ones(2), None, None)
    assert all(a is b for a, b in zip(devices_module.join_states([part]), part))
