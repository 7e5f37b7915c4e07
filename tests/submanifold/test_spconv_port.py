"""torch_bridge.submanifold as a drop-in for spconv 2.x: the backbones of OpenPCDet, VoxelNeXt,
mmdetection3d and Pointcept (bench/spconv_models.py, written from the published architectures)
built with our namespace, against a dense reference of every layer (tests/spconv_dense.py, in
float64: runs everywhere) and against spconv 2.3.8's CPU build on the same weights (where it is
installed); checkpoint loading as those projects do it; spconv's other names (pools, tables,
tensor methods, module paths, version, constants)."""

import inspect
import sys

import numpy
import pytest
from conftest import require

torch = require("torch")
ours = pytest.importorskip("torch_bridge.submanifold")

import spconv_dense as dense  # noqa: E402
from bench import spconv_models as models  # noqa: E402

SHAPE = (25, 16, 12)  # z, y, x: z >= 25 leaves the (3, 1, 1) output convolution a site
MODELS = ["voxel_backbone_8x", "voxel_res_backbone_8x", "unet_v2", "sparse_encoder",
          "sparse_unet", "spunet"]


def scene(rng, batch=2, shape=SHAPE, n=150, channels=4, dtype=torch.float64):
    """Random distinct sites, sorted by (batch, coordinates), and random features."""
    sites = []
    for b in range(batch):
        flat = numpy.sort(rng.choice(numpy.prod(shape), n, replace=False))
        sites.append(numpy.concatenate([numpy.full((n, 1), b),
                                        numpy.stack(numpy.unravel_index(flat, shape), 1)], 1))
    indices = torch.from_numpy(numpy.concatenate(sites).astype(numpy.int32))
    features = torch.from_numpy(rng.standard_normal((indices.shape[0], channels))).to(dtype)
    return features, indices, list(shape), batch


@pytest.fixture
def spconv(monkeypatch):
    """spconv.pytorch (skips where not installed), single-threaded: its CPU build's strided
    convolutions give wrong, varying results with more than one thread (2.3.8); backward
    with get_current_stream patched to 0, as its CPU build needs."""
    reference = pytest.importorskip("spconv.pytorch")
    monkeypatch.setattr(reference.ops, "get_current_stream", lambda: 0, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield reference
    torch.set_num_threads(threads)


def keys(indices, shape):
    key = indices[:, 0].long()
    for axis, size in enumerate(shape):
        key = key * size + indices[:, 1 + axis].long()
    return key


def by_site(t):
    """(indices, features) of a SparseConvTensor, rows sorted by site."""
    order = torch.argsort(keys(t.indices, t.spatial_shape))
    return t.indices[order], t.features[order]


def run(name, ns, model, x):
    """The model's output: features (sites sorted) or a dense tensor."""
    if name == "spunet":
        return model(*x)
    y = model(ns.SparseConvTensor(*x))
    y = y[0] if isinstance(y, tuple) else y
    return y if isinstance(y, torch.Tensor) else by_site(y)


def build(name, ns, state=None):
    model = getattr(models, name)(ns)
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("name", MODELS)
def test_models_match_dense_reference(rng, name):
    """float64, training mode (BatchNorm on the batch): every layer as the dense reference's,
    output sites, features and every parameter's gradient."""
    x = scene(rng)
    model = build(name, ours).double()
    reference = build(name, dense, model.state_dict()).double()
    got, want = run(name, ours, model, x), run(name, dense, reference, x)
    if isinstance(got, tuple):
        assert torch.equal(got[0], want[0])
        got, want = got[1], want[1]
    assert got.abs().max() > 0.1  # no vacuous zeros
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    got.square().sum().backward()
    want.square().sum().backward()
    for (key, p), q in zip(model.named_parameters(), reference.parameters()):
        # UNetV2's encoder output (conv_out) feeds a detection head, not the decoder.
        if key.startswith("encoder.conv_out"):
            assert p.grad is None and q.grad is None
            continue
        assert p.grad.abs().sum() > 0, key
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-9, msg=key)


@pytest.mark.parametrize("name", MODELS + ["voxelnext"])
def test_models_match_spconv(rng, spconv, name):
    """spconv's state_dict loads into ours with strict=True and gives spconv's outputs (float32,
    training mode; eval mode too where no layer has a bias, which spconv's CPU build refuses)
    and, for two of them, its gradients. The weights come from a seed of the test's own: in
    float32, training-mode BatchNorm over the deep layers' few sites amplifies rounding, so
    that some weights give either library's gradients a few percent from its float64 ones."""
    torch.manual_seed(int(rng.integers(2**31)))
    x = scene(rng, dtype=torch.float32)
    theirs = build(name, spconv)
    model = build(name, ours, theirs.state_dict())
    for mode in ("train", "eval"):
        if mode == "eval" and name in ("voxelnext", "spunet"):
            continue  # their heads have a bias
        model.train(mode == "train"), theirs.train(mode == "train")
        got, want = run(name, ours, model, x), run(name, spconv, theirs, x)
        if isinstance(got, tuple):
            assert torch.equal(got[0], want[0])
            got, want = got[1], want[1]
        scale = want.abs().max().item()
        assert scale > 1e-3  # eval mode with fresh BatchNorm statistics gives small values
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)
    if name in ("voxel_res_backbone_8x", "unet_v2"):
        model.train(), theirs.train()
        for net, ns in ((model, ours), (theirs, spconv)):
            run(name, ns, net, x)[1].square().sum().backward()
        for (key, p), q in zip(model.named_parameters(), theirs.parameters()):
            if q.grad is None:  # UNetV2's conv_out, unused here
                assert p.grad is None, key
                continue
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3,
                                       atol=1e-3 * q.grad.abs().max().item(), msg=key)


def find_all_spconv_keys(model, prefix=""):
    """The weights of every sparse convolution, found as OpenPCDet does: a walk of the
    children that tests isinstance(child, spconv.conv.SparseConvolution)."""
    found = set()
    for name, child in model.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, ours.conv.SparseConvolution):
            found.add(f"{path}.weight")
        found |= find_all_spconv_keys(child, path)
    return found


def load_adapting_layout(model, checkpoint):
    """OpenPCDet's loading: a sparse convolution weight of another shape is a spconv 1.x
    checkpoint's [*kernel, Cin, Cout] (or [*kernel, Cout, Cin]), permuted to [Cout, *kernel,
    Cin]."""
    spconv_keys, state = find_all_spconv_keys(model), model.state_dict()
    adapted = {}
    for key, value in checkpoint.items():
        if key in spconv_keys and value.shape != state[key].shape:
            swapped = value.transpose(-1, -2)
            value = swapped if swapped.shape == state[key].shape else value.permute(
                4, 0, 1, 2, 3)
            value = value.contiguous()
        adapted[key] = value
    model.load_state_dict(adapted, strict=True)


def test_checkpoint_loading_through_find_all_spconv_keys(rng):
    """A spconv 1.x-layout checkpoint of UNetV2 (every convolution's weight [*kernel, Cin,
    Cout]) loads through the find_all_spconv_keys walk and gives the saved model's outputs."""
    x = scene(rng)
    saved = build("unet_v2", ours).double()
    spconv_keys = find_all_spconv_keys(saved)
    convs = [m for m in saved.modules() if isinstance(m, ours.SparseConvolution)]
    assert len(spconv_keys) == len(convs) > 20
    old = {k: v.permute(1, 2, 3, 4, 0) if k in spconv_keys else v
           for k, v in saved.state_dict().items()}
    loaded = build("unet_v2", ours).double()
    load_adapting_layout(loaded, old)
    saved.eval(), loaded.eval()
    torch.testing.assert_close(run("unet_v2", ours, loaded, x), run("unet_v2", ours, saved, x),
                               rtol=0, atol=0)


def register_spconv2(ns, monkeypatch):
    """What mmdetection3d's register_spconv2 does to the library it finds: imports its
    convolutions by name (the transposed ones included), marks SparseModule's state_dict
    version 2 and loads spconv 1.x checkpoints (version < 2) by moving the last axis of every
    parameter first."""
    from torch_bridge.submanifold import (SparseConvTranspose1d, SparseConvTranspose2d,  # noqa
                                          SparseConvTranspose3d, SparseConvTranspose4d)

    def load(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        version = local_metadata.get("version", None)
        for name, param in self._parameters.items():
            key = prefix + name
            if param is None:
                continue
            if key not in state_dict:
                missing.append(key)
                continue
            value = state_dict[key]
            if version != 2:
                value = value.permute(value.ndim - 1, *range(value.ndim - 1))
            with torch.no_grad():
                param.copy_(value)

    monkeypatch.setattr(ns.SparseModule, "_version", 2, raising=False)
    monkeypatch.setattr(ns.SparseModule, "_load_from_state_dict", load)
    return models.spconv2_registry(ns)


def test_mmdet3d_registration_and_checkpoints(rng, monkeypatch):
    """mmdetection3d's registration finds every name (SparseConvTranspose1d-4d included) and its
    patched SparseModule loads both a version-2 checkpoint and a spconv 1.x one (version 1,
    weights [*kernel, Cin, Cout]) into its SparseEncoder, giving the saved model's output."""
    x = scene(rng)
    saved = build("sparse_encoder", ours).double().eval()
    want = run("sparse_encoder", ours, saved, x)
    registry = register_spconv2(ours, monkeypatch)
    assert registry["SparseConvTranspose3d"] is ours.SparseConvTranspose3d
    current = saved.state_dict()
    assert current._metadata["conv_input.0"]["version"] == 2
    old = current.copy()
    old._metadata = {k: dict(v, version=1) for k, v in current._metadata.items()}
    for key in find_all_spconv_keys(saved):
        old[key] = current[key].permute(1, 2, 3, 4, 0).contiguous()
    for state in (current, old):
        loaded = build("sparse_encoder", ours).double().eval()
        loaded.load_state_dict(state)
        torch.testing.assert_close(run("sparse_encoder", ours, loaded, x), want, rtol=0, atol=0)


def test_voxelnext_replace_feature_with_more_rows(rng):
    """replace_feature takes more rows than sites (VoxelNeXt concatenates three stages'
    features, then sets the indices); a layer given the tensor before the indices follow
    raises ValueError; the merged tensor's BEV sum is the manual one."""
    x = ours.SparseConvTensor(*scene(rng, dtype=torch.float32))
    y = ours.SubMConv3d(4, 4, 3, indice_key="s")(x)
    merged = y.replace_feature(torch.cat([y.features, x.features]))
    assert merged.features.shape[0] == 2 * y.indices.shape[0] and merged.indices is y.indices
    with pytest.raises(ValueError, match="set indices to match after replace_feature"):
        ours.SubMConv3d(4, 4, 3)(merged)
    merged.indices = torch.cat([y.indices, x.indices])
    assert not merged.indices_checked  # duplicate sites now: the next rulebook checks
    with pytest.raises(ValueError, match="duplicate rows"):
        ours.SubMConv3d(4, 4, 3)(merged)
    net = models.voxelnext(ours)
    out = net(ours.SparseConvTensor(*scene(rng, dtype=torch.float32)))
    assert out.spatial_shape == [2, 2] and out.features.shape[1] == 32
    bev = net._bev(merged)
    flat = merged.indices[:, [0, 2, 3]].long()
    want = torch.zeros(x.batch_size, *SHAPE[1:], 4).index_put_(tuple(flat.t()), merged.features,
                                                           accumulate=True)
    torch.testing.assert_close(bev.dense(channels_first=False), want)


def test_transposed_convolution(rng, spconv_or_none):
    """SparseConvTranspose3d: the dense transposed convolution at every site it reaches (and
    spconv's result where installed); SparseInverseConv3d on its indice_key returns to the
    input sites."""
    features, indices, shape, batch = scene(rng, shape=(7, 9, 8), n=40, channels=3)
    x = ours.SparseConvTensor(features, indices, shape, batch)
    layer = ours.SparseConvTranspose3d(3, 5, (3, 2, 3), 2, 1, indice_key="up").double()
    y = layer(x)
    w = layer.weight.detach().movedim(-1, 0)  # [Cin, Cout, *kernel]
    want = torch.nn.functional.conv_transpose3d(x.dense(), w, layer.bias.detach(), 2, 1)
    reach = torch.nn.functional.conv_transpose3d(x.dense()[:, :1].ne(0).double(),
                                                 torch.ones(1, 1, 3, 2, 3, dtype=torch.float64),
                                                 None, 2, 1)
    assert y.spatial_shape == [13, 16, 15] == list(want.shape[2:])
    assert torch.equal(y.indices.long(), torch.nonzero(reach[:, 0] > 0))
    torch.testing.assert_close(y.features, want.movedim(1, -1)[tuple(y.indices.long().t())])
    back = ours.SparseInverseConv3d(5, 2, (3, 2, 3), indice_key="up").double()(y)
    assert torch.equal(back.indices, indices) and back.spatial_shape == shape
    if spconv_or_none is not None:
        theirs = spconv_or_none.SparseConvTranspose3d(3, 5, (3, 2, 3), 2, 1)
        theirs.load_state_dict(layer.float().state_dict())
        z = theirs(spconv_or_none.SparseConvTensor(features.float(), indices, shape, batch))
        got = layer(ours.SparseConvTensor(features.float(), indices, shape, batch))
        torch.testing.assert_close(by_site(got), by_site(z), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="duplicate rows"):
        layer(ours.SparseConvTensor(features[:2], indices[[0, 0]], shape, batch))


@pytest.fixture
def spconv_or_none(monkeypatch):
    try:
        import spconv.pytorch as reference
    except ImportError:
        yield None
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield reference
    torch.set_num_threads(threads)


def pooled_dense(x, kernel, stride, padding, mean):
    """Dense max (or mean over present sites) pool of x, and the sites it reaches."""
    mask = x.dense()[:, :1].ne(0).any(1, keepdim=True).double()
    fill = x.dense() if mean else x.dense().masked_fill(mask == 0, float("-inf"))
    pool = torch.nn.functional.avg_pool3d if mean else torch.nn.functional.max_pool3d
    args = (kernel, stride, padding)
    out = pool(fill, *args) if not mean else pool(fill, *args, count_include_pad=True)
    count = torch.nn.functional.avg_pool3d(mask, *args, count_include_pad=True)
    if mean:
        out = out / count.clamp(min=1e-12)
    return out, count[:, 0] > 0


@pytest.mark.parametrize("mean", [False, True], ids=["max", "avg"])
def test_pools(rng, spconv_or_none, mean):
    """SparseMaxPool3d / SparseAvgPool3d: the dense pool over the sites present, at the sites
    the window reaches; gradients reach the inputs; max pool as spconv's on non-negative
    features (spconv's CPU build starts its max from zero; it has no average pool)."""
    features, indices, shape, batch = scene(rng, shape=(8, 9, 10), n=60, channels=3)
    features = features + 0.5 * features.sign()  # no feature near 0 (the dense mask reads it)
    x = ours.SparseConvTensor(features.clone().requires_grad_(), indices, shape, batch)
    layer = (ours.SparseAvgPool3d if mean else ours.SparseMaxPool3d)(3, 2, 1, indice_key="p")
    y = layer(x)
    want, reached = pooled_dense(x, 3, 2, 1, mean)
    assert torch.equal(y.indices.long(), torch.nonzero(reached))
    torch.testing.assert_close(y.features, want.movedim(1, -1)[tuple(y.indices.long().t())])
    y.features.sum().backward()
    assert x.features.grad.abs().sum() > 0
    assert ours.SparseMaxPool2d(2).stride == [2, 2]  # stride None: the kernel's
    up = ours.SparseInverseConv3d(3, 3, 3, indice_key="p").double()(y)
    assert torch.equal(up.indices, indices)
    if spconv_or_none is not None and not mean:
        positive = features.abs().float()
        theirs = spconv_or_none.SparseMaxPool3d(3, 2, 1)(
            spconv_or_none.SparseConvTensor(positive, indices, shape, batch))
        got = ours.SparseMaxPool3d(3, 2, 1)(ours.SparseConvTensor(positive, indices, shape,
                                                                  batch))
        torch.testing.assert_close(by_site(got), by_site(theirs))


def test_global_pools_tables_and_feature_modules(rng):
    features, indices, shape, batch = scene(rng, batch=3, shape=(5, 6), n=12, channels=4)
    x = ours.SparseConvTensor(features, indices, shape, batch)
    for pool, reduce in ((ours.SparseGlobalMaxPool(), "amax"), (ours.SparseGlobalAvgPool(),
                                                                 "mean")):
        got = pool(x)
        want = torch.stack([getattr(features[indices[:, 0] == b], reduce)(0)
                            for b in range(batch)])
        torch.testing.assert_close(got, want)
    branch = ours.SubMConv2d(4, 4, 3, indice_key="s").double()
    table = ours.ConcatTable().add(ours.Identity()).add(branch)
    both = table(x)
    joined, added = ours.JoinTable()(both), ours.AddTable()(both)
    torch.testing.assert_close(joined.features, torch.cat([features, both[1].features], 1))
    torch.testing.assert_close(added.features, features + both[1].features)
    torch.testing.assert_close((x + both[1]).features, added.features)
    with pytest.raises(ValueError, match="same sites"):
        ours.AddTable()([x, x.select_by_index(torch.arange(3))])
    seq = ours.SparseSequential(ours.SparseBatchNorm(4), ours.SparseReLU(),
                                ours.SparseIdentity(), ours.RemoveGrid()).double()
    y = seq(x)
    assert y.grid is None and x.grid is not None and torch.equal(y.indices, x.indices)
    bn = torch.nn.functional.batch_norm(features, None, None, training=True, eps=1e-5)
    torch.testing.assert_close(y.features, torch.relu(bn))
    assert ours.ToDense()(x).shape == (3, 4, 5, 6)


def test_tensor_methods(rng):
    features, indices, shape, batch = scene(rng, batch=2, shape=(6, 7), n=10, channels=3)
    x = ours.SparseConvTensor(features, indices, shape, batch, voxel_num=torch.tensor([20]),
                              benchmark=True)
    assert x.benchmark and x.voxel_num.item() == 20 and x.grid.numel() == 0
    y = ours.SubMConv2d(3, 3, 3, indice_key="k").double()(x)
    assert y.benchmark and y.voxel_num is x.voxel_num and "k" in y.indice_dict
    keep = torch.tensor([1, 4, 7])
    sub = y.select_by_index(keep)
    assert torch.equal(sub.indices, y.indices[keep]) and not sub.indice_dict and y.indice_dict
    torch.testing.assert_close(sub.features, y.features[keep])
    torch.testing.assert_close((y + y.features).features, 2 * y.features)
    torch.testing.assert_close(y.minus().features, -y.features)
    with pytest.raises(ValueError, match="x \\+ y needs features of one shape"):
        y + sub
    with pytest.raises(TypeError, match="int32"):
        ours.SparseConvTensor(features, indices.long(), shape, batch)


def test_sparse_add(rng):
    """functional.sparse_add: the dense sum; the larger operand's sites, order and rulebooks
    are kept where they are the union, else the sites are sorted."""
    features, indices, shape, batch = scene(rng, batch=2, shape=(6, 7), n=15, channels=3)
    x = ours.SparseConvTensor(features, indices, shape, batch)
    x = ours.SubMConv2d(3, 3, 3, indice_key="k").double()(x)
    part = x.select_by_index(torch.arange(0, 30, 3))
    total = ours.functional.sparse_add(part, x)
    assert total.indices is x.indices and "k" in total.indice_dict
    torch.testing.assert_close(total.dense(), x.dense() + part.dense())
    other = ours.SparseConvTensor(*scene(rng, batch=2, shape=(6, 7), n=9, channels=3))
    union = ours.functional.sparse_add(x, other)
    torch.testing.assert_close(union.dense(), x.dense() + other.dense())
    assert not union.indice_dict and torch.equal(
        keys(union.indices, shape), torch.sort(keys(union.indices, shape)).values)
    misaligned = ours.tables.AddTableMisaligned()([x, other])
    torch.testing.assert_close(misaligned.dense(), union.dense())


def test_version_constants_paths_and_algo(monkeypatch):
    """The version checks of OpenPCDet (float(__version__[2:]) >= 2.2) and mmdetection3d
    (__version__ >= '2.0.0') pass; constants can be set; spconv's module paths import; algo
    takes ConvAlgo members and nothing else."""
    assert float(ours.__version__[2:]) >= 2.2 and ours.__version__ >= "2.0.0"
    assert ours.SPCONV_VERSION_NUMBERS[0] == 2
    monkeypatch.setattr(ours.constants, "SPCONV_USE_DIRECT_TABLE", False)
    from torch_bridge.submanifold.conv import SparseConvolution
    from torch_bridge.submanifold.core import SparseConvTensor
    from torch_bridge.submanifold.modules import SparseModule
    from torch_bridge.submanifold.ops import get_conv_output_size, get_deconv_output_size
    from torch_bridge.submanifold.pool import SparseMaxPool3d
    assert SparseConvolution is ours.SparseConvolution and SparseModule is ours.SparseModule
    assert SparseConvTensor is ours.SparseConvTensor and SparseMaxPool3d is ours.SparseMaxPool3d
    assert get_conv_output_size([41, 1600, 1408], [3] * 3, [2] * 3, [1] * 3, [1] * 3) == [
        21, 800, 704]
    assert get_deconv_output_size([5], [3], [2], [1], [1], [1]) == [10]
    layer = ours.SubMConv3d(2, 2, 3, algo=ours.ConvAlgo.Native)
    assert layer.algo is ours.ConvAlgo.Native
    for cls in (ours.ConvAlgo.MaskImplicitGemm, ours.ConvAlgo.MaskSplitImplicitGemm):
        ours.SparseConv2d(2, 2, 3, algo=cls)
    with pytest.raises(TypeError, match="algo must be None or a ConvAlgo"):
        ours.SubMConv3d(2, 2, 3, algo="native")
    params = list(inspect.signature(ours.SparseInverseConv3d).parameters)
    assert params[:5] == ["in_channels", "out_channels", "kernel_size", "indice_key", "bias"]
    params = list(inspect.signature(ours.SparseConvTranspose2d).parameters)
    assert params[:9] == ["in_channels", "out_channels", "kernel_size", "stride", "padding",
                          "dilation", "groups", "bias", "indice_key"]


def test_point_to_voxel_is_imported_lazily(monkeypatch):
    """utils.PointToVoxel comes from torch_bridge.point_to_voxel when asked for; without that
    module, a clear ImportError."""
    import importlib.util

    from torch_bridge.submanifold import utils

    if importlib.util.find_spec("torch_bridge.point_to_voxel") is not None:
        from torch_bridge.point_to_voxel import PointToVoxel
        assert utils.PointToVoxel is PointToVoxel
    monkeypatch.setitem(sys.modules, "torch_bridge.point_to_voxel", None)
    with pytest.raises(ImportError, match="PointToVoxel needs torch_bridge.point_to_voxel"):
        from torch_bridge.submanifold.utils import PointToVoxel  # noqa: F401
    with pytest.raises(AttributeError):
        utils.NotAName
    features = torch.arange(6.).reshape(3, 2)
    out = utils.gather_features_by_pc_voxel_id(features, torch.tensor([2, -1, 0]), -5)
    torch.testing.assert_close(out, torch.tensor([[4., 5.], [-5., -5.], [0., 1.]]))


def test_record_voxel_count_and_errors(rng):
    x = ours.SparseConvTensor(*scene(rng, shape=(6, 7, 8), n=20, channels=2))
    layer = ours.SparseConv3d(2, 3, 3, 2, 1, record_voxel_count=True).double()
    y = layer(x)
    assert layer.get_max_num_voxels().item() == y.indices.shape[0] > 0
    assert "max_num_voxels_during_training" in layer.state_dict()
    fresh = ours.SparseConv3d(2, 3, 3, 2, 1, record_voxel_count=True)
    state = {k: v for k, v in layer.state_dict().items() if "max_num" not in k}
    fresh.load_state_dict(state)  # a checkpoint without the count loads (as spconv's)
    with pytest.raises(ValueError, match="at most one of subm, transposed and inverse"):
        ours.SparseConvolution(3, 2, 2, subm=True, transposed=True)
    with pytest.raises(ValueError, match="indice_key 'p' exists"):
        ours.SparseMaxPool3d(2, indice_key="p")(ours.SparseMaxPool3d(2, indice_key="p")(x))


@pytest.mark.parametrize("kernel, stride, subm, inverse", [
    (3, 1, True, False), ((2, 3, 2), 1, True, False), (3, 2, False, False),
    ((3, 3, 1), (2, 2, 1), False, True)])
def test_cpu_tap_plans_match_dense_gather(rng, monkeypatch, kernel, stride, subm, inverse):
    """The CPU's tap-at-a-time products (with the plans build_rulebook seeds for both maps, the
    mirrored half of an odd submanifold kernel) give the dense gather's forward and gradients."""
    from torch_bridge.submanifold import cpu_conv as module

    features, indices, shape, batch = scene(rng, shape=(9, 12, 10), n=300, channels=3)
    results = []
    for dense_entries in (module._DENSE_MAX_ENTRIES, 10**9):
        monkeypatch.setattr(module, "_DENSE_MAX_ENTRIES", dense_entries)
        rulebook = ours.build_rulebook(indices, shape, batch, kernel, stride, 1, 1, subm)
        if inverse:
            rulebook = rulebook.inverse()
        plan = module._cpu_plan(rulebook.neighbors)[0]
        assert plan == ("taps" if dense_entries < 10**6 else "dense")
        n_in = rulebook.in_indices.shape[0]
        x = torch.from_numpy(rng.standard_normal((n_in, 3))) if not results else results[0][0]
        w = torch.from_numpy(rng.standard_normal((4, *rulebook.kernel_size, 3))) if not \
            results else results[0][1]
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = ours.rulebook_conv(x, rulebook, w)
        y.square().sum().backward()
        results.append((x, w, y.detach(), x.grad, w.grad))
    for taps, gathered in zip(results[0][2:], results[1][2:]):
        torch.testing.assert_close(taps, gathered)


def brute_force(x, weight, kind, stride, padding, dilation, out_shape):
    """{site: features} of a convolution by loops over sites and taps (any ndim): "subm",
    "strided" (o * stride - padding + k * dilation reads), "transposed" (input i feeds
    i * stride - padding + k * dilation) or "max" (a strided max pool; weight unused)."""
    import itertools

    sites = {tuple(s): f for s, f in zip(x.indices.tolist(), x.features)}
    kernel = list(weight.shape[1:-1]) if kind != "max" else weight
    out = {}
    for (b, *i), f in sites.items():
        for k in itertools.product(*map(range, kernel)):
            if kind == "subm":
                o = [c - (kk - n // 2) * d for c, kk, n, d in zip(i, k, kernel, dilation)]
                if (b, *o) not in sites:
                    continue
            elif kind == "transposed":
                o = [c * s - p + kk * d for c, s, p, kk, d in zip(i, stride, padding, k,
                                                                  dilation)]
            else:  # o * s - p + k * d = i
                num = [c + p - kk * d for c, p, kk, d in zip(i, padding, k, dilation)]
                if any(v % s for v, s in zip(num, stride)):
                    continue
                o = [v // s for v, s in zip(num, stride)]
            if not all(0 <= v < n for v, n in zip(o, out_shape)):
                continue
            key = (b, *o)
            if kind == "max":
                out[key] = f if key not in out else torch.maximum(out[key], f)
            else:
                index = (slice(None), *k, slice(None))
                out[key] = out.get(key, 0) + weight[index] @ f
    return out


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_every_dimension_against_loops(rng, ndim):
    """SubMConv, SparseConv, SparseConvTranspose, SparseInverseConv and SparseMaxPool of 1 to 4
    dimensions against loops over sites and taps."""
    shape = {1: (11,), 2: (6, 7), 3: (4, 5, 4), 4: (3, 4, 3, 4)}[ndim]
    n = max(3, int(numpy.prod(shape)) // 3)
    x = ours.SparseConvTensor(*scene(rng, batch=2, shape=shape, n=n, channels=2))
    name = f"{ndim}d"
    kernel = (3, 2, 3, 2)[:ndim]
    cases = [
        ("subm", getattr(ours, f"SubMConv{name}")(2, 3, 3, dilation=1, indice_key="s"), 3),
        ("strided", getattr(ours, f"SparseConv{name}")(2, 3, kernel, 2, 1, indice_key="d"),
         kernel),
        ("transposed", getattr(ours, f"SparseConvTranspose{name}")(2, 3, kernel, 2, 1), kernel)]
    for kind, layer, k in cases:
        layer = layer.double()
        y = layer(x)
        want = brute_force(x, layer.weight.detach(), kind, layer.stride, layer.padding,
                           layer.dilation, y.spatial_shape)
        got = {tuple(s): f for s, f in zip(y.indices.tolist(), y.features.detach())}
        assert got.keys() == want.keys() and len(got) > 0, kind
        for site, f in got.items():
            torch.testing.assert_close(f, want[site] + layer.bias.detach(), msg=kind)
        if kind == "strided":
            back = getattr(ours, f"SparseInverseConv{name}")(3, 2, kernel, "d").double()(y)
            assert torch.equal(back.indices, x.indices)
    pool = getattr(ours, f"SparseMaxPool{name}")(2, 2)(x)
    want = brute_force(x, [2] * ndim, "max", [2] * ndim, [0] * ndim, [1] * ndim,
                       pool.spatial_shape)
    got = {tuple(s): f for s, f in zip(pool.indices.tolist(), pool.features)}
    assert got.keys() == want.keys()
    for site, f in got.items():
        torch.testing.assert_close(f, want[site])
