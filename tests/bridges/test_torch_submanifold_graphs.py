"""torch_bridge.submanifold.SparseGraphs: whole detector backbones and a segmentation U-Net as
CUDA graphs give their eager outputs on frames of varying size (new buckets, overflowed
capacities captured again), follow in-place parameter changes, reject bad indices as the eager
path does; and padding rows, which dense() and the global pools drop (CPU too)."""


import re

import pytest
from conftest import HAS_GPU, require
from test_submanifold import random_sites

torch = require("torch")
spconv = pytest.importorskip("torch_bridge.submanifold")
from torch_bridge.submanifold import graphs  # noqa: E402

requires_cuda = pytest.mark.skipif(not (HAS_GPU and torch.cuda.is_available()),
                                   reason="needs CUDA tensors")
SHAPE = (41, 48, 40)  # every stage of the detectors keeps sites


def _frame(rng, n, batch=2, channels=4, dtype=torch.float32, device="cuda"):
    indices = torch.from_numpy(random_sites(rng, batch, SHAPE, n)).to(device)
    features = torch.from_numpy(rng.standard_normal((indices.shape[0], channels))).to(
        device, dtype)
    return spconv.SparseConvTensor(features, indices, SHAPE, batch)


def _model(name, dtype=torch.float32, seed=0):
    from bench import detectors

    net = detectors.build("ours", spconv, name, 4, "cuda", seed=seed).to(dtype).eval()
    return spconv.fuse_bn_relu(net)


def _sparse(outputs):
    return graphs._sparse_outputs(outputs)


def _assert_same(got, want, tolerance):
    got, want = _sparse(got), _sparse(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert not g.padded and g.batch_size == w.batch_size
        assert g.spatial_shape == w.spatial_shape
        torch.testing.assert_close(g.indices, w.indices, rtol=0, atol=0)
        scale = max(1.0, w.features.float().abs().max().item())
        torch.testing.assert_close(g.features.float(), w.features.float(), rtol=0,
                                   atol=tolerance * scale)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", ["VoxelBackBone8x", "VoxelResBackBone8x", "UNetV2",
                                  "MinkUNet"])
def test_graphs_give_the_eager_outputs(rng, monkeypatch, name, dtype):
    """Frames of 2600, 2900 and 2750 sites (one bucket: captured once) and 5000 (a second),
    each against the eager forward; an earlier call's outputs are copies that later replays
    leave alone."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    net = _model(name, dtype)
    graphed = spconv.SparseGraphs(net, minimum=4096)
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    kept = []
    with torch.no_grad():
        for n in (2600, 2900, 2750, 5000):
            x = _frame(rng, n, dtype=dtype)
            got = graphed(x)
            _assert_same(got, net(x), tolerance)
            kept.append((got, net(x)))
    assert len(graphed.graphs) == 2
    for got, want in kept:
        _assert_same(got, want, tolerance)


@requires_cuda
def test_overflowed_capacity_is_captured_again(rng, monkeypatch):
    """With no margin, a frame of the bucket with more strided outputs than the recorded one
    overflows: the bucket is recorded and captured again on it, and the call gives its eager
    outputs."""
    monkeypatch.setattr(graphs, "_MARGIN", 0.0)
    net = _model("VoxelBackBone8x")
    graphed = spconv.SparseGraphs(net, minimum=4096)
    first = _frame(rng, 1500)
    with torch.no_grad():
        graphed(first)
        (before,) = graphed.graphs.values()
        denser = _frame(rng, 4000)  # the same bucket, more output sites at every stride
        _assert_same(graphed(denser), net(denser), 1e-5)
    (after,) = graphed.graphs.values()
    assert after is not before
    assert all(a >= b for a, b in zip(after.capacities, before.capacities))
    assert after.capacities != before.capacities


@requires_cuda
def test_in_place_parameter_changes_reach_the_graphs(rng):
    net = _model("VoxelResBackBone8x")
    graphed = spconv.SparseGraphs(net)
    x = _frame(rng, 2000)
    with torch.no_grad():
        graphed(x)
        net.load_state_dict(_model("VoxelResBackBone8x", seed=1).state_dict())
        _assert_same(graphed(x), net(x), 1e-5)


@requires_cuda
@pytest.mark.parametrize("bad, message", [
    (lambda i: i.__setitem__(7, i[3].clone()), "duplicate rows"),
    (lambda i: i.__setitem__((7, 2), SHAPE[1]), "row 7 .* is outside"),
    (lambda i: i.__setitem__((7, 0), -1), "row 7 .* is outside"),
    (lambda i: i.__setitem__(7, -1), "row 7 .* is outside")])
def test_bad_indices_raise_as_eager(rng, bad, message):
    """A duplicate row, one outside the grid, one of batch -1, one of -1 alone (what padding
    rows are): the ValueError of the eager path, after a good frame captured the bucket;
    check=False trusts them."""
    net = _model("VoxelBackBone8x")
    graphed = spconv.SparseGraphs(net)
    x = _frame(rng, 2000)
    with torch.no_grad():
        graphed(x)
        bad(x.indices)
        with pytest.raises(ValueError, match=message):
            graphed(x)
        spconv.SparseGraphs(net, check=False)(x)


@requires_cuda
def test_what_a_graph_cannot_run(rng):
    x = _frame(rng, 500)
    with pytest.raises(ValueError, match="eval"):
        spconv.SparseGraphs(_model("VoxelBackBone8x").train())(x)
    with pytest.raises(ValueError, match="CUDA"):
        spconv.SparseGraphs(_model("VoxelBackBone8x"))(_frame(rng, 500, device="cpu"))
    with pytest.raises(TypeError, match="SparseConvTensor"):
        spconv.SparseGraphs(_model("VoxelBackBone8x"))(x.features)
    transposed = spconv.SparseConvTranspose3d(4, 8, 3, 2).cuda().eval()
    with pytest.raises(ValueError, match="transposed"):
        spconv.SparseGraphs(transposed)(x)


@requires_cuda
def test_dense_and_global_pools_in_the_graph(rng):
    """fn's own dense() and global pools on padded tensors: padding rows dropped."""
    conv = spconv.SparseConv3d(4, 8, 3, 2, 1).cuda().eval()
    pool = spconv.SparseGlobalMaxPool()

    def fn(x):
        y = conv(x)
        return y.dense(), pool(y), y

    graphed = spconv.SparseGraphs(fn)
    with torch.no_grad():
        for n in (700, 900):
            x = _frame(rng, n)
            dense, pooled, y = graphed(x)
            want_dense, want_pooled, want_y = fn(x)
            torch.testing.assert_close(dense, want_dense)
            torch.testing.assert_close(pooled, want_pooled)
            _assert_same(y, want_y, 1e-6)


@requires_cuda
def test_autocast_has_its_own_graphs(rng):
    net = _model("VoxelBackBone8x")
    graphed = spconv.SparseGraphs(net)
    x = _frame(rng, 2000)
    with torch.no_grad():
        graphed(x)
        with torch.autocast("cuda", dtype=torch.float16):
            got, want = graphed(x), net(x)
    assert len(graphed.graphs) == 2
    assert _sparse(got)[0].features.dtype == torch.float16
    _assert_same(got, want, 4e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_padding_rows_dropped_by_dense_and_global_pools(rng, device):
    """A tensor of padding rows (batch index and coordinates -1) after its sites: dense() and
    the global pools give the unpadded tensor's."""
    x = _frame(rng, 60, channels=3, dtype=torch.float64, device=device)
    padding = torch.full((9, 4), -1, dtype=torch.int32, device=device)
    padded = spconv.SparseConvTensor(
        torch.cat([x.features, torch.randn(9, 3, dtype=torch.float64, device=device)]),
        torch.cat([x.indices, padding]), SHAPE, 2)
    padded.padded = True
    torch.testing.assert_close(padded.dense(), x.dense(), rtol=0, atol=0)
    for pool in (spconv.SparseGlobalMaxPool(), spconv.SparseGlobalAvgPool()):
        torch.testing.assert_close(pool(padded), pool(x), rtol=0, atol=1e-15)
    assert padded.replace_feature(padded.features).padded


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="fn"):
        spconv.SparseGraphs(3)
    with pytest.raises(ValueError, match="ratio"):
        spconv.SparseGraphs(lambda x: x, ratio=1)
    with pytest.raises(ValueError, match="minimum"):
        spconv.SparseGraphs(lambda x: x, minimum=4)


@requires_cuda
def test_strided_grids_past_the_eager_bitmap(rng, monkeypatch):
    """Output grids too large for the eager bitmap (forced: none fits), which eagerly hash and
    sort: the graph's bounded builds take the bitmap and give the same outputs; past its own
    bound too, the graph raises ValueError."""
    from sbnet_cupy.submanifold import cuda_rulebook

    monkeypatch.setattr(cuda_rulebook, "_BITMAP_MAX_BITS", 0)
    net = _model("UNetV2")
    x = _frame(rng, 2000)
    with torch.no_grad():
        _assert_same(spconv.SparseGraphs(net)(x), net(x), 1e-5)
        monkeypatch.setattr(cuda_rulebook, "_BOUNDED_BITMAP_MAX_BITS", 0)
        with pytest.raises(ValueError, match="hashing and sorting"):
            spconv.SparseGraphs(net)(x)


def test_outputs_cut_to_their_sites_and_copied(rng):
    """_copied then _unpadded on what fn may return (a namedtuple of a list and a dict of
    SparseConvTensors and tensors): every tensor a copy, whole; each SparseConvTensor then cut
    to its count, in _sparse_outputs' order, with no rulebooks and unpadded."""
    import collections

    Out = collections.namedtuple("Out", ["stages", "extra"])
    x, y = _frame(rng, 40, device="cpu"), _frame(rng, 30, device="cpu")
    for t in (x, y):
        t.padded, t.indice_dict = True, {"k": None}
    dense = torch.randn(3, 4)
    outputs = Out([x, dense], {"y": y, "n": 7})
    assert _sparse(outputs) == [x, y]
    copies = graphs._copied(outputs)
    for c, t in zip(_sparse(copies), (x, y)):
        assert c.padded and c.indice_dict == {}
        assert torch.equal(c.features, t.features) and torch.equal(c.indices, t.indices)
    originals = [(t.features.clone(), t.indices.clone()) for t in (x, y)]
    for t in (x, y):  # the next replay overwrites the graph's memory
        t.features.fill_(-7)
        t.indices.fill_(-7)
    got = graphs._unpadded(copies, [25, 12])
    assert isinstance(got, Out) and got.extra["n"] == 7
    (gx, gdense), gy = got.stages, got.extra["y"]
    for g, (features, indices), count in ((gx, originals[0], 25), (gy, originals[1], 12)):
        assert not g.padded and g.indice_dict == {} and g.indices_checked
        assert torch.equal(g.features, features[:count])
        assert torch.equal(g.indices, indices[:count])
        assert g.features.is_contiguous() and g.indices.is_contiguous()
    assert torch.equal(gdense, dense) and gdense.data_ptr() != dense.data_ptr()


@pytest.mark.parametrize("shape, dtype", [((40, 1 << 20, 1 << 9), torch.int64),
                                          ((40, (1 << 21) - 1, 1 << 4), torch.int32)])
def test_site_faults_keys_fit_the_grid(shape, dtype):
    """The check's keys are int32 where the grid's sites (and a key past them a row) fit, int64
    where not: sites whose int64 keys differ by a multiple of 2^32 (equal in int32) are
    distinct, a repeated site far into the grid is found and named; a row outside the grid,
    whose int32 key would wrap around, repeats none."""
    from torch_bridge.submanifold.rulebook import _check_sites, _site_faults

    far = [0, shape[0] - 1, shape[1] - 2, shape[2] - 3]
    step = (1 << 32) // (shape[1] * shape[2])  # rows d0 apart of keys 2^32 apart
    second = 1 + step if 1 + step < shape[0] else 2  # (none in a grid of int32 keys)
    indices = torch.tensor([[0, 1, 5, 7], [0, second, 5, 7], far, [0, 0, 0, 1]],
                           dtype=torch.int32)
    outside, ordered, repeated = _site_faults(indices, shape, 1)
    assert ordered.dtype == dtype
    assert not outside.any() and not repeated.any()
    _check_sites(indices, shape, 1)
    with pytest.raises(ValueError, match=re.escape(f"duplicate rows, e.g. {tuple(far)}")):
        _check_sites(torch.cat([indices, indices[2:3]]), shape, 1)
    wrapped = torch.cat([indices, torch.tensor([[0, 1 << 30, 5, 7]], dtype=torch.int32)])
    outside, _, repeated = _site_faults(wrapped, shape, 1)
    assert outside.tolist() == [False] * 4 + [True] and not repeated.any()
