"""torch_bridge.submanifold.fuse_bn_relu and the convolution's relu: a fused eval model gives the
unfused model's outputs (CPU float64, CUDA in every dtype and algorithm, split taps included),
the op's ReLU and its gradient against torch.relu of the plain op, what is left unfused, and a
residual block's folded BatchNorms, checked each call."""

import copy
import io

import pytest
from conftest import HAS_GPU, require
from test_torch_submanifold import sparse_input

torch = require("torch")
spconv = pytest.importorskip("torch_bridge.submanifold")

requires_cuda = pytest.mark.skipif(not (HAS_GPU and torch.cuda.is_available()),
                                   reason="needs CUDA tensors")


def _bn(channels, **kwargs):
    return torch.nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01, **kwargs)


class _Block(spconv.SparseModule):
    """A residual block whose own forward calls its BatchNorm and ReLU (OpenPCDet's order:
    conv1, bn1, relu): fuse folds bn1 into conv1 and leaves the ReLU."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = spconv.SubMConv3d(channels, channels, 3, padding=1, indice_key="b")
        self.bn1 = _bn(channels)
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        y = self.conv1(x)
        return y.replace_feature(self.relu(self.bn1(y.features)) + x.features)


class _PreActivation(_Block):
    """Registered as _Block, but its forward normalises the sum, not conv1's output."""

    def forward(self, x):
        y = self.conv1(x)
        return y.replace_feature(self.relu(self.bn1(y.features + x.features)))


def _model():
    """OpenPCDet-like blocks: conv + BN + ReLU (submanifold, strided, a 1x1 with bias, an
    inverse), a conv + BN without ReLU, a conv + ReLU without BN, a SparseBatchNorm and
    SparseReLU pair, a BatchNorm without running statistics, and a residual block."""
    s = spconv
    return s.SparseSequential(
        s.SparseSequential(s.SubMConv3d(4, 16, 3, padding=1, bias=False, indice_key="a"),
                           _bn(16), torch.nn.ReLU()),
        s.SparseSequential(s.SparseConv3d(16, 24, 3, 2, 1, bias=False, indice_key="down"),
                           _bn(24), torch.nn.ReLU(inplace=True)),
        s.SparseSequential(s.SubMConv3d(24, 24, 1, bias=True), _bn(24), torch.nn.ReLU()),
        _Block(24),
        s.SparseSequential(s.SubMConv3d(24, 24, 3, padding=1, indice_key="c"), _bn(24)),
        s.SparseSequential(s.SubMConv3d(24, 24, 3, padding=1, indice_key="c"),
                           torch.nn.ReLU()),
        s.SparseSequential(s.SubMConv3d(24, 24, 3, padding=1, indice_key="c", bias=False),
                           s.SparseBatchNorm(24, eps=1e-3), s.SparseReLU()),
        s.SparseSequential(s.SparseInverseConv3d(24, 16, 3, indice_key="down", bias=False),
                           _bn(16), torch.nn.ReLU()),
        s.SparseSequential(s.SubMConv3d(16, 8, 3, padding=1, indice_key="a"),
                           _bn(8, track_running_stats=False), torch.nn.ReLU()),
    )


def _randomised(model, seed):
    """model with BatchNorm statistics and affine parameters of random values, in eval mode."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.3)
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.3)
                    m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


def _fused_pair(seed=0, dtype=torch.float64, device="cpu"):
    model = _randomised(_model(), seed).to(device, dtype)
    return model, spconv.fuse_bn_relu(copy.deepcopy(model))


def test_fused_model_gives_the_unfused_outputs(rng):
    model, fused = _fused_pair()
    x = sparse_input(rng, 2, (9, 10, 11), 300, 4)
    with torch.no_grad():
        want, got = model(x), fused(x)
    torch.testing.assert_close(got.features, want.features, rtol=1e-10, atol=1e-10)
    assert torch.equal(got.indices, want.indices)
    assert (want.features == 0).any() and (want.features > 0).any()


def test_what_is_fused_and_what_is_left():
    model, fused = _fused_pair()
    kinds = [[type(m).__name__ for m in seq] if isinstance(seq, spconv.SparseSequential)
             else type(seq).__name__ for seq in fused]
    assert kinds == [["SubMConv3d"], ["SparseConv3d"], ["SubMConv3d"], "_Block",
                     ["SubMConv3d"], ["SubMConv3d"], ["SubMConv3d"], ["SparseInverseConv3d"],
                     ["SubMConv3d", "BatchNorm1d", "ReLU"]]
    relu = [seq[0].sbnet_relu for seq in fused if isinstance(seq, spconv.SparseSequential)]
    assert relu == [True, True, True, False, True, True, True, False]
    assert isinstance(fused[3].bn1, spconv.fuse.FoldedBatchNorm)  # its forward calls it
    assert fused[3].conv1.bias is not None and isinstance(fused[3].relu, torch.nn.ReLU)
    assert not [key for key in fused.state_dict() if key.startswith("3.bn1")]
    assert all(seq[0].bias is not None for seq in list(fused)[:3])  # folded shift: a bias
    assert "relu" in repr(fused[0][0])
    # Fusing again changes nothing.
    again = spconv.fuse_bn_relu(copy.deepcopy(fused))
    assert repr(again) == repr(fused)


def test_block_batchnorm_left_as_an_affine_without_blocks(rng):
    model = _randomised(_model(), 2).double()
    fused = spconv.fuse_bn_relu(copy.deepcopy(model), blocks=False)
    assert isinstance(fused[3].bn1, spconv.fuse.ChannelAffine)
    assert torch.equal(fused[3].conv1.bias, model[3].conv1.bias)
    x = sparse_input(rng, 2, (9, 10, 11), 300, 4)
    with torch.no_grad():
        torch.testing.assert_close(fused(x).features, model(x).features, rtol=1e-10,
                                   atol=1e-10)


def test_block_folded_against_its_forward_raises(rng):
    """A block whose forward gives the BatchNorm registered after conv1 something else than
    conv1's output: the fold would be wrong, so the call raises instead of answering."""
    block = _randomised(_PreActivation(4), 5).double()
    fused = spconv.fuse_bn_relu(copy.deepcopy(block))
    assert isinstance(fused.bn1, spconv.fuse.FoldedBatchNorm)
    x = sparse_input(rng, 1, (6, 7, 5), 40, 4)
    with torch.no_grad(), pytest.raises(RuntimeError, match="conv1.*blocks=False"):
        fused(x)
    with torch.no_grad():
        torch.testing.assert_close(spconv.fuse_bn_relu(copy.deepcopy(block), blocks=False)(x)
                                   .features, block(x).features)


def test_folded_block_copies_and_pickles(rng):
    """A fused model's copies (deepcopy, torch.save / load) check against their own
    convolutions, and give the unfused outputs."""
    model, fused = _fused_pair(seed=6)
    x = sparse_input(rng, 2, (9, 10, 11), 300, 4)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        want = model(x).features
        for copied in (copy.deepcopy(fused), loaded):
            torch.testing.assert_close(copied(x).features, want, rtol=1e-10, atol=1e-10)
            copied[3].conv1.weight.add_(1.0)  # its own conv: the block's output changes
            assert not torch.allclose(copied(x).features, want)
        torch.testing.assert_close(fused(x).features, want, rtol=1e-10, atol=1e-10)


def test_fuse_refuses_training_batchnorm_and_other_models():
    model = _model()  # training mode
    with pytest.raises(ValueError, match="eval"):
        spconv.fuse_bn_relu(model)
    with pytest.raises(TypeError, match="model"):
        spconv.fuse_bn_relu("a model")
    with pytest.raises(TypeError, match="blocks"):
        spconv.fuse_bn_relu(model.eval(), blocks="no")


@pytest.mark.parametrize("kernel", [3, 1])
def test_op_relu_and_its_gradient(rng, kernel):
    """rulebook_conv(relu=True) is relu(rulebook_conv(...)), and its gradients are those of
    the composition (float64, CPU: the op's autograd with the output saved)."""
    x = sparse_input(rng, 1, (8, 9, 7), 120, 5)
    rulebook = spconv.build_rulebook(x.indices, x.spatial_shape, 1, (kernel,) * 3, 1,
                                     kernel // 2, 1, True)
    weight = torch.randn(6, *(kernel,) * 3, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    features = x.features.clone().requires_grad_()
    got = spconv.rulebook_conv(features, rulebook, weight, bias, relu=True)
    want = torch.relu(spconv.rulebook_conv(features, rulebook, weight, bias))
    torch.testing.assert_close(got, want)
    assert (want == 0).any() and (want > 0).any()
    upstream = torch.randn_like(want)
    grads = torch.autograd.grad(got, (features, weight, bias), upstream)
    expected = torch.autograd.grad(want, (features, weight, bias), upstream)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


def test_op_with_relu_passes_opcheck(rng):
    x = sparse_input(rng, 1, (6, 7, 5), 40, 3)
    rulebook = spconv.build_rulebook(x.indices, x.spatial_shape, 1, (3, 3, 3), 1, 1, 1, True)
    weight = torch.randn(4, 3, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    args = (x.features.clone().requires_grad_(), weight, None, rulebook.neighbors,
            rulebook.neighbors_t, None, None, "gemm", True)
    torch.library.opcheck(torch.ops.sbnet.submanifold_conv.default, args)


@requires_cuda
@pytest.mark.parametrize("dtype, algo", [(torch.float16, "fused"), (torch.bfloat16, "fused"),
                                         (torch.float32, "fused"), (torch.float32, "gemm")])
@pytest.mark.parametrize("sites", [150, 4000])
def test_cuda_fused_model_gives_the_unfused_outputs(rng, dtype, algo, sites):
    """On CUDA: the fused kernel's epilogue ReLU (few sites: the split sum's), the gemm
    algorithm's; against the unfused model in the same dtype and in float64 on the CPU."""
    reference, _ = _fused_pair(seed=1)
    model = copy.deepcopy(reference).to("cuda", dtype)
    fused = spconv.fuse_bn_relu(copy.deepcopy(model))
    for m in (*model.modules(), *fused.modules()):
        if isinstance(m, spconv.SparseConvolution):
            m.sbnet_algo = algo
    x = sparse_input(rng, 2, (20, 21, 22), sites, 4, dtype, "cuda")
    x64 = spconv.SparseConvTensor(x.features.double().cpu(), x.indices.cpu(), x.spatial_shape,
                                  x.batch_size)
    with torch.no_grad():
        want, got, exact = model(x), fused(x), reference(x64)
    scale = exact.features.abs().max().item()
    tolerance = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-2}[dtype]
    for y in (want, got):
        assert torch.equal(y.indices.cpu(), exact.indices)
        err = (y.features.double().cpu() - exact.features).abs().max().item()
        assert err <= tolerance * scale, err
    assert (got.features == 0).any() and (got.features > 0).any()


@pytest.mark.parametrize("shape", [(50, 6), (50, 6, 7)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_channel_affine_is_the_eval_batchnorm(shape, dtype):
    """The BatchNorm fuse_bn_relu cannot fold becomes a ChannelAffine with its outputs: [N, C]
    and [N, C, L] inputs, a SparseConvTensor's features (SparseBatchNorm), its input's dtype
    where the statistics have another."""
    bn = _randomised(torch.nn.Sequential(_bn(6)), 3)[0].to(dtype)
    holder = torch.nn.ModuleDict({"bn": copy.deepcopy(bn)})
    spconv.fuse_bn_relu(holder)
    affine = holder["bn"]
    assert type(affine) is spconv.fuse.ChannelAffine
    x = torch.randn(*shape, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(affine(x), bn(x))
        if dtype == torch.float32:
            torch.testing.assert_close(affine(x.half()), bn(x.half()), atol=2e-3, rtol=2e-3)
            assert affine(x.half()).dtype == torch.float16


def test_sparse_batchnorm_becomes_a_channel_affine(rng):
    x = sparse_input(rng, 1, (6, 7, 5), 40, 6)
    bn = _randomised(spconv.SparseSequential(spconv.SparseBatchNorm(6)), 4)[0].double()
    holder = torch.nn.ModuleDict({"bn": copy.deepcopy(bn)})
    spconv.fuse_bn_relu(holder)
    with torch.no_grad():
        got, want = holder["bn"](x), bn(x)
    assert type(holder["bn"]) is spconv.fuse.ChannelAffine
    torch.testing.assert_close(got.features, want.features)
    assert torch.equal(got.indices, want.indices)
