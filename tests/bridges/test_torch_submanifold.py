"""torch_bridge.submanifold (spconv's modules) against torch's dense convolutions of the
zero-filled input, gradcheck in float64, rulebook caching by indice_key; CUDA in every dtype."""

import copy
import inspect
import pathlib

import numpy
import pytest
from conftest import HAS_GPU, require
from axes import random_array
from test_submanifold import random_sites

torch = require("torch")
spconv = pytest.importorskip("torch_bridge.submanifold")
from sbnet_cupy.submanifold import conv_kernels  # noqa: E402

requires_cuda = pytest.mark.skipif(not (HAS_GPU and torch.cuda.is_available()),
                                   reason="needs CUDA tensors")
DENSE = {2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}


def sparse_input(rng, batch, shape, n, channels, dtype=torch.float64, device="cpu"):
    indices = torch.from_numpy(random_sites(rng, batch, shape, n)).to(device)
    features = torch.from_numpy(random_array(rng, (indices.shape[0], channels),
                                             numpy.float64)).to(device, dtype)
    return spconv.SparseConvTensor(features, indices, shape, batch)


def dense_reference(x, layer, stride, padding):
    """The layer's dense convolution of x.dense() (float64, CPU), channels first."""
    weight = layer.weight.detach().double().cpu()
    weight = weight.permute(0, weight.ndim - 1, *range(1, weight.ndim - 1))
    bias = None if layer.bias is None else layer.bias.detach().double().cpu()
    dense = x.dense().double().cpu()
    return DENSE[len(x.spatial_shape)](dense, weight, bias, stride=stride, padding=padding,
                                       dilation=layer.dilation)


def at_sites(dense, indices):
    """Rows of a channels-first dense tensor at int32 indices [N, 1 + D]: [N, C]."""
    moved = dense.permute(0, *range(2, dense.ndim), 1)
    return moved[tuple(indices.long().cpu().t())]


@pytest.mark.parametrize("ndim, kernel, stride, padding, dilation", [
    (2, 3, 1, 1, 1), (2, 5, 2, 2, 1), (3, 3, 2, 1, 1), (3, (1, 3, 3), (1, 2, 2), (0, 1, 1), 1),
    (3, (3, 1, 1), (2, 1, 1), 0, 1), (2, 3, 1, 2, 2)])
def test_modules_match_dense_convolution(rng, ndim, kernel, stride, padding, dilation):
    shape = (9, 10) if ndim == 2 else (7, 6, 8)
    x = sparse_input(rng, 2, shape, 60, 3)
    modules = {2: (spconv.SubMConv2d, spconv.SparseConv2d),
               3: (spconv.SubMConv3d, spconv.SparseConv3d)}[ndim]
    subm = modules[0](3, 5, kernel, dilation=dilation).double()
    y = subm(x)
    assert torch.equal(y.indices, x.indices) and y.spatial_shape == list(shape)
    same = [k // 2 * d for k, d in zip(subm.kernel_size, subm.dilation)]
    ref = dense_reference(x, subm, 1, same)
    torch.testing.assert_close(y.features, at_sites(ref, x.indices))
    strided = modules[1](3, 4, kernel, stride, padding, dilation, indice_key="down").double()
    z = strided(x)
    ref = dense_reference(x, strided, strided.stride, strided.padding)
    assert z.spatial_shape == list(ref.shape[2:])
    torch.testing.assert_close(z.features, at_sites(ref, z.indices))
    # Exactly the sites the dense convolution of the active mask reaches.
    reached = dense_reference(spconv.SparseConvTensor(torch.ones_like(x.features[:, :1]),
                                                      x.indices, shape, 2),
                              _ones_like(strided), strided.stride, strided.padding)
    assert torch.equal(z.indices.long(), torch.nonzero(reached[:, 0] > 0))


def _ones_like(layer):
    ones = torch.nn.Module()
    ones.weight = torch.ones(1, *layer.kernel_size, 1, dtype=torch.float64)
    ones.bias, ones.dilation = None, layer.dilation
    return ones


@pytest.mark.parametrize("subm", [True, False])
def test_gradcheck(rng, subm):
    x = sparse_input(rng, 2, (5, 4, 6), 25, 3)
    rulebook = spconv.build_rulebook(x.indices, x.spatial_shape, 2, (3, 2, 3), 2, 1, 1, subm)
    weight = torch.from_numpy(random_array(rng, (4, 3, 2, 3, 3), numpy.float64))
    bias = torch.from_numpy(random_array(rng, (4,), numpy.float64))
    inputs = [t.clone().requires_grad_() for t in (x.features, weight, bias)]
    assert torch.autograd.gradcheck(
        lambda f, w, b: spconv.rulebook_conv(f, rulebook, w, b), inputs)
    inverse = rulebook.inverse()
    w_inv = torch.from_numpy(random_array(rng, (2, 3, 2, 3, 4), numpy.float64)).requires_grad_()
    f_inv = torch.from_numpy(random_array(rng, (rulebook.out_indices.shape[0], 4),
                                          numpy.float64)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda f, w: spconv.rulebook_conv(f, inverse, w), [f_inv, w_inv])
    assert torch.autograd.gradgradcheck(
        lambda f, w: spconv.rulebook_conv(f, rulebook, w), inputs[:2])


def test_network_shares_rulebooks_and_inverts(rng, monkeypatch):
    x = sparse_input(rng, 2, (12, 11, 10), 80, 4)

    def network(inverse):
        return spconv.SparseSequential(
            spconv.SubMConv3d(4, 8, 3, indice_key="subm1"), torch.nn.BatchNorm1d(8),
            torch.nn.ReLU(), spconv.SubMConv3d(8, 8, 3, indice_key="subm1"),
            spconv.SparseSequential(spconv.SparseConv3d(8, 16, 3, 2, 1, indice_key="down1"),
                                    torch.nn.ReLU()),
            spconv.SubMConv3d(16, 16, 3, indice_key="subm2"), inverse).double()

    net = network(spconv.SparseInverseConv3d(16, 8, 3, "down1"))  # spconv's order: the key 4th
    built = []
    build = spconv.build_rulebook
    monkeypatch.setattr(spconv.conv, "build_rulebook",
                        lambda *a, **k: built.append(k["check"]) or build(*a, **k))
    y = net(x)
    # subm1 once for two layers (the user's indices: checked), then down1 and subm2 on sites
    # a convolution made (no check needed); the inverse reuses down1.
    assert built == [True, False, False]
    assert set(y.indice_dict) == {"subm1", "down1", "subm2"}
    assert torch.equal(y.indices, x.indices) and y.spatial_shape == [12, 11, 10]
    y.features.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    assert tuple(net[0].weight.shape) == (8, 3, 3, 3, 4)  # spconv's KRSC layout
    state = net.state_dict()
    clone = network(spconv.SparseInverseConv3d(16, 8, 3, indice_key="down1"))
    clone.load_state_dict(state)
    net.eval(), clone.eval()
    torch.testing.assert_close(clone(x).features, net(x).features)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_layers_of_other_keys_share_a_rulebook_of_the_same_sites_and_geometry(rng, device):
    """CenterPoint's conv_input ("subm1") and first residual blocks ("res1") ask for the same
    submanifold rulebook under two keys: the second gets the first's; other geometries, other
    sites and a check that the first did not make get their own."""
    x = sparse_input(rng, 2, (12, 11, 10), 80, 4, device=device)
    first = spconv.SubMConv3d(4, 8, 3, indice_key="subm1").double().to(device)
    second = spconv.SubMConv3d(8, 8, 3, indice_key="res1").double().to(device)
    dilated = spconv.SubMConv3d(8, 8, 3, dilation=2, indice_key="res2").double().to(device)
    y = first(x)
    z = second(y)
    assert z.indice_dict["res1"] is z.indice_dict["subm1"]
    w = dilated(z)
    assert w.indice_dict["res2"] is not w.indice_dict["subm1"]
    assert w.indice_dict["res2"].dilation == [2, 2, 2]
    # The shared rulebook gives what a rulebook of its own gives.
    alone = second(spconv.SparseConvTensor(y.features, y.indices.clone(), y.spatial_shape, 2))
    assert "subm1" not in alone.indice_dict
    torch.testing.assert_close(z.features, alone.features, rtol=0, atol=0)
    torch.testing.assert_close(z.features, at_sites(dense_reference(y, second, 1, 1),
                                                    x.indices).to(device))
    # A build that checks shares only a checked rulebook.
    unchecked = spconv.build_rulebook(x.indices, x.spatial_shape, 2, 3, subm=True,
                                      check=False)
    checked = spconv.build_rulebook(x.indices, x.spatial_shape, 2, 3, subm=True,
                                    reuse=[unchecked])
    assert checked is not unchecked
    assert spconv.build_rulebook(x.indices, x.spatial_shape, 2, 3, subm=True,
                                 reuse=[unchecked, checked]) is checked
    assert spconv.build_rulebook(x.indices, x.spatial_shape, 2, 3, subm=True, check=False,
                                 reuse=[unchecked]) is unchecked
    # Strided: the same geometry on the same sites, or not.
    down = spconv.build_rulebook(x.indices, x.spatial_shape, 2, 3, 2, 1, reuse=[checked])
    assert down is not checked and down.out_indices.shape[0] > 0
    assert spconv.build_rulebook(x.indices, x.spatial_shape, 2, 3, 2, 1, reuse=[down]) is down
    for other in ((3, 2, 0), (3, 1, 1), (2, 2, 1), (3, 2, 1, 2)):
        assert spconv.build_rulebook(x.indices, x.spatial_shape, 2, *other,
                                     reuse=[down]) is not down
    assert spconv.build_rulebook(x.indices.clone(), x.spatial_shape, 2, 3, 2, 1,
                                 reuse=[down]) is not down
    assert spconv.build_rulebook(x.indices, [13, 11, 10], 2, 3, 2, 1, reuse=[down]) is not down
    assert spconv.build_rulebook(x.indices, x.spatial_shape, 3, 3, 2, 1, reuse=[down]) is not down
    assert spconv.build_rulebook(down.out_indices, down.out_shape, 2, 3, 2, 1,
                                 reuse=[down.inverse()]) is not down


def test_dense_and_replace_feature(rng):
    x = sparse_input(rng, 3, (4, 5), 12, 2)
    dense = x.dense()
    assert dense.shape == (3, 2, 4, 5)
    torch.testing.assert_close(at_sites(dense, x.indices), x.features)
    assert x.dense(channels_first=False).shape == (3, 4, 5, 2)
    back = spconv.SparseConvTensor.from_dense(x.dense(channels_first=False))
    torch.testing.assert_close(back.dense(), dense)
    y = x.replace_feature(x.features * 2)
    assert y.indices is x.indices and y.indice_dict is x.indice_dict


def test_errors(rng):
    from sbnet_cupy import submanifold as core

    x = sparse_input(rng, 1, (6, 6), 10, 3)
    with pytest.raises(ValueError, match="needs the indice_key"):
        spconv.SparseConvolution(2, 3, 3, 3, inverse=True)
    with pytest.raises(ValueError, match="indice_key 'nope' must name the rulebook"):
        spconv.SparseInverseConv2d(3, 3, 3, indice_key="nope").double()(x)
    with pytest.raises(ValueError, match="input has 3 channels, this layer takes 4"):
        spconv.SubMConv2d(4, 3, 3).double()(x)
    with pytest.raises(TypeError, match="indices must be int32"):
        spconv.SparseConvTensor(x.features, x.indices.long(), [6, 6], 1)
    with pytest.raises(ValueError, match="groups must be 1"):
        spconv.SubMConv2d(4, 4, 3, groups=2)
    bad = x.indices.clone()
    bad[0, 1] = 6
    with pytest.raises(ValueError, match="coords row 0 = .* is outside"):
        spconv.SubMConv2d(3, 3, 3).double()(spconv.SparseConvTensor(x.features, bad, [6, 6], 1))
    rulebook = spconv.build_rulebook(x.indices, [6, 6], 1, 3, subm=True)
    with pytest.raises(TypeError, match="weight must have features' dtype"):
        spconv.rulebook_conv(x.features, rulebook, torch.zeros(2, 3, 3, 3))
    weight = torch.zeros(2, 3, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="bias must be a float64 array of shape \\(2,\\)"):
        spconv.rulebook_conv(x.features, rulebook, weight, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="algo must be None or one of"):
        spconv.rulebook_conv(x.features, rulebook, weight, algo="fused")
    with pytest.raises(TypeError, match="rulebook must be a torch_bridge.submanifold.Rulebook"):
        spconv.rulebook_conv(x.features, core.submanifold_rulebook(
            x.indices.numpy(), [6, 6], 1, 3), weight)


def test_a_remembered_check_rejects_each_field_it_reads(rng):
    """rulebook_conv remembers a passed check by the fields it reads: a call after a good one
    that differs in any of them still raises."""
    x = sparse_input(rng, 1, (6, 6), 10, 3)
    rulebook = spconv.build_rulebook(x.indices, [6, 6], 1, 3, subm=True)
    weight, bias = torch.zeros(2, 3, 3, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    spconv.rulebook_conv(x.features, rulebook, weight, bias)  # checked and remembered
    long_maps = copy.copy(rulebook)
    long_maps.neighbors = rulebook.neighbors.long()
    for call, error, message in [
            (lambda: spconv.rulebook_conv(x.features[:9], rulebook, weight, bias), ValueError,
             "features must be \\[N, C\\] with N = 10"),
            (lambda: spconv.rulebook_conv(x.features.float(), rulebook, weight, bias), TypeError,
             "weight must have features' dtype"),
            (lambda: spconv.rulebook_conv(x.features, rulebook, weight.float(), bias), TypeError,
             "weight must have features' dtype"),
            (lambda: spconv.rulebook_conv(x.features, rulebook, weight[..., :2], bias), ValueError,
             "weight must be \\[Cout, 3, 3, 3\\]"),
            (lambda: spconv.rulebook_conv(x.features, rulebook, weight, bias.float()), ValueError,
             "bias must be a float64 array"),
            (lambda: spconv.rulebook_conv(x.features, rulebook, weight, bias[:1]), ValueError,
             "bias must be a float64 array"),
            (lambda: spconv.rulebook_conv(x.features, long_maps, weight, bias), TypeError,
             "the rulebook's maps must be int32"),
            (lambda: spconv.rulebook_conv(x.features, rulebook, weight, bias, algo="implicit"),
             ValueError, "algo must be None or one of")]:
        with pytest.raises(error, match=message):
            call()


@requires_cuda
def test_mirrored_order_captures_in_a_cuda_graph(rng):
    """A submanifold rulebook's transposed order, made from its forward order with no sort,
    runs on the device alone: a CUDA graph captures it, and its replay writes the forward
    order with the map rows reversed, the transposed map's columns in that order."""
    shape = (20, 22, 24)
    indices = torch.from_numpy(random_sites(rng, 2, shape, 2000)).cuda()
    rulebook = spconv.build_rulebook(indices, list(shape), 2, 3, subm=True)
    rows = rulebook.fused_order()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mirrored = rulebook.fused_order(transposed=True)
    mirrored.fill_(-7)  # poisoned: the replay writes every element
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(mirrored[0], rows[0])
    assert torch.equal(mirrored[1:], rulebook.neighbors_t[:, rows[0].long()])


@requires_cuda
@pytest.mark.parametrize("algo", ["gemm", "fused", "fused-sorted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cuda_matches_cpu(rng, monkeypatch, dtype, algo):
    """fused-sorted: every layer's tiles take the rows sorted by neighbour mask (the
    rulebooks' fused_order, forward and the backward's transposed maps)."""
    if algo.startswith("fused") and dtype == torch.float64:
        pytest.skip("the fused kernel computes on tensor cores: no float64")
    if algo == "fused-sorted":
        monkeypatch.setattr(conv_kernels, "_SORT_EVERY", True)
        algo = "fused"
    x = sparse_input(rng, 2, (20, 30, 25), 400, 16)
    net = spconv.SparseSequential(
        spconv.SubMConv3d(16, 32, 3, indice_key="s"), torch.nn.ReLU(),
        spconv.SparseConv3d(32, 32, 3, 2, 1, indice_key="d"),
        spconv.SubMConv3d(32, 32, (1, 3, 3)),
        spconv.SparseInverseConv3d(32, 16, 3, indice_key="d")).double()
    expected = net(x)
    gpu = net.to("cuda", dtype)
    for module in gpu.modules():
        if isinstance(module, spconv.SparseConvolution):
            module.sbnet_algo = algo
    x_gpu = spconv.SparseConvTensor(x.features.to("cuda", dtype).requires_grad_(),
                                    x.indices.cuda(), x.spatial_shape, 2)
    y = gpu(x_gpu)
    assert torch.equal(y.indices.cpu(), expected.indices)
    tolerance = {torch.float64: 1e-10, torch.float32: 2e-2, torch.float16: 5e-2,
                 torch.bfloat16: 2e-1}[dtype]
    torch.testing.assert_close(y.features.double().cpu(), expected.features.detach(),
                               atol=tolerance * expected.features.abs().max().item(),
                               rtol=tolerance)
    y.features.float().sum().backward()
    assert torch.isfinite(x_gpu.features.grad).all()
    # Deterministic backward: the same gradients twice, bit for bit.
    first = [p.grad.clone() for p in gpu.parameters()]
    gpu.zero_grad()
    gpu(x_gpu).features.float().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, gpu.parameters()))


def test_compiles_with_a_built_rulebook(rng):
    """With its rulebook built, the convolution traces as one op (fullgraph), forward and
    backward (aot_eager: what inductor would get)."""
    x = sparse_input(rng, 2, (6, 5, 7), 30, 3)
    rulebook = spconv.build_rulebook(x.indices, x.spatial_shape, 2, 3, 2, 1)
    weight = torch.from_numpy(random_array(rng, (4, 3, 3, 3, 3), numpy.float64))
    bias = torch.from_numpy(random_array(rng, (4,), numpy.float64))

    def loss(f, w, b):
        return spconv.rulebook_conv(f, rulebook, w, b).square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        inputs = [t.clone().requires_grad_() for t in (x.features, weight, bias)]
        value = fn(*inputs)
        value.backward()
        results.append([value.detach()] + [t.grad for t in inputs])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)


@requires_cuda
@pytest.mark.parametrize("sorted_rows", [False, True], ids=["unsorted", "sorted"])
def test_cuda_graph_with_cached_rulebooks(rng, monkeypatch, sorted_rows):
    """Once its rulebooks are built, a forward makes no host sync: it captures in a CUDA graph
    and replays the eager result (with the rulebooks' fused orders, which they keep)."""
    if sorted_rows:
        monkeypatch.setattr(conv_kernels, "_SORT_EVERY", True)
    x = sparse_input(rng, 2, (30, 40, 20), 2000, 16, torch.float16, "cuda")
    net = spconv.SparseSequential(
        spconv.SubMConv3d(16, 32, 3, indice_key="s"), torch.nn.ReLU(),
        spconv.SparseConv3d(32, 32, 3, 2, 1, indice_key="d"),
        spconv.SubMConv3d(32, 32, 3, indice_key="s2")).cuda().half().eval()
    with torch.no_grad():
        eager = net(x)
        cached = dict(eager.indice_dict)

        def run():
            return net(spconv.SparseConvTensor(x.features, x.indices, x.spatial_shape, 2,
                                               indice_dict=cached)).features

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(out, eager.features)



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_column_major_indices(rng, device):
    """Indices as torch's nonzero() returns them (column-major, strides (1, N)) give the same
    sites and features as row-major ones, and the dense convolution's; the tensor keeps them
    row-major (spconv 2.3.8 reads any indices as row-major and would lose every neighbour)."""
    mask = torch.from_numpy(rng.random((2, 9, 11)) < 0.6).to(device)
    indices = mask.nonzero().int()
    assert indices.stride() == (1, indices.shape[0])
    features = torch.from_numpy(random_array(rng, (indices.shape[0], 3), numpy.float64))
    layer = spconv.SubMConv2d(3, 4, 3, indice_key="s").double().to(device)
    outs = [layer(spconv.SparseConvTensor(features.to(device), i, [9, 11], 2))
            for i in (indices, indices.contiguous())]
    assert outs[0].indices.is_contiguous()  # stored row-major, as spconv hands them on
    assert torch.equal(outs[0].indices, outs[1].indices)
    torch.testing.assert_close(outs[0].features, outs[1].features, rtol=0, atol=0)
    x = spconv.SparseConvTensor(features, indices.cpu(), [9, 11], 2)
    want = at_sites(dense_reference(x, layer, 1, 1), x.indices)
    torch.testing.assert_close(outs[0].features.cpu(), want)


@requires_cuda
def test_same_as_spconv(rng):
    """spconv 2.3.8 (where installed) on the same weights gives the same sites and features:
    submanifold, strided and inverse convolutions, 3D and 2D."""
    reference = pytest.importorskip("spconv.pytorch")

    def net(ns, ndim):
        subm, strided, inverse = ((ns.SubMConv3d, ns.SparseConv3d, ns.SparseInverseConv3d)
                                  if ndim == 3 else
                                  (ns.SubMConv2d, ns.SparseConv2d, ns.SparseInverseConv2d))
        return ns.SparseSequential(
            subm(16, 32, 3, indice_key="s1"), torch.nn.ReLU(),
            strided(32, 32, 3, 2, 1, indice_key="d1"),
            subm(32, 32, (1, 3, 3) if ndim == 3 else (1, 3), indice_key="s2"),
            strided(32, 64, (3, 1, 1) if ndim == 3 else (3, 1), (2, 1, 1) if ndim == 3 else
                    (2, 1), 0, indice_key="d2"),
            inverse(64, 32, (3, 1, 1) if ndim == 3 else (3, 1), "d2"),
            inverse(32, 16, 3, "d1")).cuda()

    for shape in ((21, 40, 36), (50, 44)):
        x = sparse_input(rng, 2, shape, 1500, 16, torch.float32, "cuda")
        ours = net(spconv, len(shape))
        theirs = net(reference, len(shape))
        theirs.load_state_dict(ours.state_dict())
        with torch.no_grad():
            y = ours(x)
            z = theirs(reference.SparseConvTensor(x.features, x.indices, list(shape), 2))
        order_y = torch.argsort(_keys(y.indices, shape))
        order_z = torch.argsort(_keys(z.indices, shape))
        assert torch.equal(y.indices[order_y], z.indices[order_z])
        scale = y.features.abs().max().item()
        torch.testing.assert_close(y.features[order_y], z.features[order_z], rtol=2e-3,
                                   atol=2e-3 * scale)  # spconv may run float32 as TF32


def _keys(indices, shape):
    key = indices[:, 0].long()
    for axis, size in enumerate(shape):
        key = key * size + indices[:, 1 + axis].long()
    return key


def test_reusable_table_needs_the_same_indices_grid_and_check():
    """build_rulebook reuses a table only of the very indices tensor, on the same grid, and a
    checked one where it must check."""
    from sbnet_cupy import submanifold as core
    from sbnet_cupy.submanifold import cuda_rulebook

    indices, other = torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.int32)
    table = cuda_rulebook._Table(None, 0, 0, 1, 1, 0, 1, 0, (4, 5, 6), 2, False)
    rulebook = spconv.Rulebook(None, None, other, indices, [7, 8, 9], [4, 5, 6], 2, [3] * 3,
                               [2] * 3, [1] * 3, [1] * 3, False)
    rulebook._tables = (None, table)
    find = spconv.rulebook._reusable_table
    assert find([rulebook], indices, (4, 5, 6), 2, False) is table
    assert find([rulebook, "not a rulebook"], indices, (4, 5, 6), 2, False) is table
    assert find([rulebook], indices, (4, 5, 6), 2, True) is None  # unchecked sites
    assert find([rulebook], other, (4, 5, 6), 2, False) is None  # no table of its inputs
    assert find([rulebook], indices.clone(), (4, 5, 6), 2, False) is None
    assert find([rulebook], indices, (4, 5, 7), 2, False) is None
    assert find([rulebook], indices, (4, 5, 6), 1, False) is None
    inverse = rulebook.inverse()  # the core's inverse(), of the torch class, tables swapped
    assert type(inverse) is spconv.Rulebook and isinstance(inverse, core.Rulebook)
    assert inverse.in_indices is indices and inverse.out_indices is other
    assert inverse._tables == (table, None) and inverse.inverted
    assert find([inverse], indices, (4, 5, 6), 2, False) is table
    assert find([], indices, (4, 5, 6), 2, False) is None


@requires_cuda
@pytest.mark.parametrize("kernel", [3, (2, 3, 2)], ids=["odd", "even"])
def test_reused_tables_give_the_same_rulebooks(rng, kernel):
    """Rulebooks that reuse a submanifold rulebook's hash table or a strided one's bitmap
    equal those built from scratch and the CPU's."""
    x = sparse_input(rng, 2, (23, 30, 17), 900, 1)
    maps = ("neighbors", "neighbors_t", "in_indices", "out_indices")

    def same(got, want):
        for name in maps:
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name

    def both(indices, shape, *args, reuse=(), **kwargs):
        cpu = spconv.build_rulebook(indices.cpu(), shape, 2, *args, **kwargs)
        fresh = spconv.build_rulebook(indices, shape, 2, *args, **kwargs)
        reused = spconv.build_rulebook(indices, shape, 2, *args, **kwargs, reuse=reuse)
        same(fresh, cpu), same(reused, cpu)
        return reused

    indices = x.indices.cuda()
    first = both(indices, x.spatial_shape, kernel, subm=True)
    assert first._tables[0] is first._tables[1] and first._tables[0].checked
    down = both(first.out_indices, x.spatial_shape, 3, 2, 1, check=False, reuse=[first])
    assert down._tables[0] is first._tables[0] and down._tables[1].bits
    after = both(down.out_indices, down.out_shape, kernel, subm=True, check=False,
                 reuse=[first, down])
    assert after._tables[0] is down._tables[1]  # the bitmap, no table built
    again = both(down.out_indices, down.out_shape, kernel, 2, 0, check=False, reuse=[after])
    assert again._tables[0] is down._tables[1]
    # A check reuses a table of checked sites only (a rulebook's output sites are).
    checked = both(down.out_indices, down.out_shape, 3, subm=True, reuse=[down])
    assert checked._tables[0] is down._tables[1]
    unchecked = both(indices, x.spatial_shape, 3, subm=True, check=False)
    assert not unchecked._tables[0].checked
    rechecked = both(indices, x.spatial_shape, 3, subm=True, reuse=[unchecked])
    assert rechecked._tables[0] is not unchecked._tables[0] and rechecked._tables[0].checked


@requires_cuda
def test_network_syncs_once_per_strided_rulebook(rng, monkeypatch):
    """A SECOND-like network reads the device once for its checked input and once per strided
    rulebook, and builds each site set's table once."""
    from sbnet_cupy.submanifold import cuda_rulebook as core

    x = sparse_input(rng, 1, (21, 40, 36), 2000, 4, device="cuda")
    net = spconv.SparseSequential(
        spconv.SubMConv3d(4, 8, 3, indice_key="subm1"),
        spconv.SubMConv3d(8, 8, 3, indice_key="subm1"),
        spconv.SparseConv3d(8, 16, 3, 2, 1, indice_key="spconv2"),
        spconv.SubMConv3d(16, 16, 3, indice_key="subm2"),
        spconv.SparseConv3d(16, 16, 3, 2, (0, 1, 1), indice_key="spconv3"),
        spconv.SubMConv3d(16, 16, 3, indice_key="subm3"),
        spconv.SparseConv3d(16, 16, (3, 1, 1), (2, 1, 1), indice_key="spconv4"))
    net = net.double().cuda()
    reads, builds = [], []
    read, build = core._read_ints, core._build_table
    monkeypatch.setattr(core, "_read_ints", lambda *a: reads.append(a) or read(*a))
    monkeypatch.setattr(core, "_build_table", lambda *a: builds.append(a) or build(*a))
    with torch.no_grad():
        y = net(x)
    assert len(reads) == 1 + 3 and len(builds) == 1
    expected = net.cpu()(spconv.SparseConvTensor(x.features.cpu(), x.indices.cpu(),
                                                 x.spatial_shape, 1))
    assert torch.equal(y.indices.cpu(), expected.indices)
    torch.testing.assert_close(y.features.cpu(), expected.features)


def _frames_to_forward(stack):
    """'file:function' of the frames of `stack` (inspect's, innermost first: the frame that
    called the driver) up to SubMConv3d's forward, inclusive."""
    forward = next(i for i, f in enumerate(stack) if f.function == "forward"
                   and f.filename == spconv.conv.__file__)
    return [f"{pathlib.Path(f.filename).name}:{f.function}" for f in stack[:forward + 1]]


class _RecordingDriver:
    """A driver module's stand-in that records the stack of every launchKernel call (innermost
    first, from its caller) in `stacks`, and passes every call on to `real` (None: none)."""

    def __init__(self, real, stacks):
        self.real, self.stacks = real, stacks

    def __getattr__(self, name):
        return getattr(self.real, name)

    def launchKernel(self, *args):
        self.stacks.append(inspect.stack(0)[1:])
        if self.real is not None:
            self.real.launchKernel(*args)


@requires_cuda
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
@pytest.mark.parametrize("algo", ["fused", "gemm"])
def test_module_call_reaches_the_launch_in_four_frames(rng, monkeypatch, algo, side_stream):
    """Issue 35: an inference call of a SubMConv3d with its rulebook cached reaches the driver
    in at most four frames, from the module's forward to the frame that calls the driver (both
    inclusive): forward, rulebook_conv, the launch function, KernelPlan.launch; no dispatcher
    between them. On a side stream the fused kernel is a dependent launch (cuLaunchKernelEx on
    sm_90), counted the same way."""
    from sbnet_cupy.core import launch as _launch

    x = sparse_input(rng, 1, (12, 11, 10), 300, 16, torch.float16, "cuda")
    layer = spconv.SubMConv3d(16, 16, 3, indice_key="subm1").cuda().half()
    layer.sbnet_algo = algo
    stacks, dependent_launch = [], _launch.dependent_launch

    def recording_dependent_launch(device, stream):
        launch_ex = dependent_launch(device, stream)
        if launch_ex is None:
            return None

        def recording(*args):
            stacks.append(inspect.stack(0)[1:])
            return launch_ex(*args)
        return recording

    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs, made on the current stream
    with torch.no_grad(), torch.cuda.stream(stream):
        y = layer(x)  # builds and caches the rulebook
        monkeypatch.setattr(_launch, "driver", _RecordingDriver(_launch.driver, stacks))
        monkeypatch.setattr(_launch, "dependent_launch", recording_dependent_launch)
        layer(y)
    stream.synchronize()
    assert stacks  # every launch of the call: the convolution's, and a split sum's
    for stack in stacks:
        frames = _frames_to_forward(stack)
        assert len(frames) <= 4, frames
        assert frames[0] == "plan.py:launch", frames


@pytest.mark.parametrize("algo", ["fused", "gemm"])
def test_module_call_reaches_the_driver_in_four_frames_on_the_cpu(rng, monkeypatch, algo):
    """The four frames without a GPU: CPU tensors taken for CUDA ones (is_cuda, and the TORCH
    backend's device and stream), a device of 4 SMs, compiled kernels named by their name
    expressions, and a driver that records where it is called from (and runs nothing)."""
    from sbnet_cupy.core import launch as _launch
    from torch_bridge.backend import TORCH
    import cuda_emulation

    x = sparse_input(rng, 1, (12, 11, 10), 300, 16, torch.float32)
    layer = spconv.SubMConv3d(16, 16, 3, indice_key="subm1")
    layer.sbnet_algo = algo
    stacks = []
    info = _launch.DeviceInfo(sms=4, shared_per_block_optin=_launch.H100.shared_per_block_optin,
                              shared_per_sm=_launch.H100.shared_per_sm, compute_capability=(9, 0))
    plans = (conv_kernels._fused_plan, conv_kernels._gather_plan)
    for cache in plans:
        cache.cache_clear()
    with torch.no_grad():
        y = layer(x)  # builds and caches the rulebook, on the CPU
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        monkeypatch.setattr(TORCH, "device", lambda t: 0)
        monkeypatch.setattr(TORCH, "stream", lambda device: 0)
        monkeypatch.setattr(TORCH, "float_scratch",
                            lambda device, n: (lambda t: (t.data_ptr(), t))(torch.empty(n)))
        monkeypatch.setattr(_launch, "runtime", cuda_emulation._Runtime(info.sms))
        monkeypatch.setattr(_launch, "device_info", lambda device: info)
        monkeypatch.setattr(_launch, "function", lambda device, op, kernel, *args: kernel)
        monkeypatch.setattr(_launch, "driver", _RecordingDriver(None, stacks))
        monkeypatch.setattr(_launch, "DEPENDENT_LAUNCH", False)
        monkeypatch.setattr(_launch.thread_state, "devices", set())
        try:
            layer(y)
        finally:
            for cache in plans:
                cache.cache_clear()
    assert stacks
    for stack in stacks:
        frames = _frames_to_forward(stack)
        assert len(frames) <= 4, frames
        assert frames[0] == "plan.py:launch" and frames[-2] == "conv_op.py:rulebook_conv", frames
