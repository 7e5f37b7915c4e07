"""torch_bridge's modules on the fused block convolutions (method="fused"), against the same
modules run densely and through gather, cuDNN and scatter (method="gemm")."""

import contextlib
import weakref

import pytest

from conftest import require

torch = require("torch")

import torch_bridge as tb  # noqa: E402
from torch_bridge import _weights  # noqa: E402
from test_torch_sparse_res_block import _covered, _mask, _randomise_batchnorm  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Error allowed relative to the output's largest value: TF32 products, 16-bit intermediates.
TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _close(got, want, dtype):
    got, want = got.double(), want.double()
    assert (got - want).abs().max() <= TOLERANCE[dtype] * want.abs().max().clamp(min=1)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels, bottleneck, bsize_out", [(24, 8, 8), (96, 24, 16),
                                                             (35, 13, 10)])
def test_res_block_fused(rng, dtype, channels, bottleneck, bsize_out):
    torch.manual_seed(int(rng.integers(1 << 30)))
    block = tb.SparseResBlockBottleneck(channels, bottleneck, bsize_out=bsize_out)
    _randomise_batchnorm(block, rng)
    block = block.cuda().fold_batchnorm().to(dtype)
    shape = (2, 45, 61)
    x = torch.randn(*shape, channels, device="cuda").to(dtype)
    found = block.reduce_mask(_mask(rng, *shape).cuda(), capacity=64)  # padding rows too
    count = int(found.bin_counts[0])
    assert 0 < count < 64
    covered = _covered(tb.ReduceMask(found.active_block_indices[:count], found.bin_counts),
                       shape, bsize_out).cuda()
    with torch.no_grad():
        dense = block.dense(x)
        block.method = "gemm"
        gemm = block(x, found)
        block.method = "fused"
        assert block.fused(x)
        y = block(x, found)
        _close(y[covered], dense[covered], dtype)
        _close(y[covered], gemm[covered], dtype)
        assert torch.equal(y[~covered], x[~covered])
        z = x.clone()
        assert block(z, found, inplace=True) is z
        assert torch.equal(z, y)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_sparse_conv_fused(rng, dtype, kernel):
    conv = tb.SparseConv2d(7, 12, kernel, bsize_out=9).cuda().to(dtype)
    shape = (2, 41, 29)
    x = torch.randn(*shape, 7, device="cuda").to(dtype)
    found = conv.reduce_mask(_mask(rng, *shape).cuda())
    covered = _covered(found, shape, 9).cuda()
    base = torch.randn(*shape, 12, device="cuda").to(dtype)
    with torch.no_grad():
        dense = conv.dense(x)
        conv.method = "fused"
        y = conv(x, found, base)
        _close(y[covered], dense[covered], dtype)
        assert torch.equal(y[~covered], base[~covered])
        zeros = conv(x, found)
        assert torch.equal(zeros[covered], y[covered]) and not zeros[~covered].any()
        assert conv(x, found, base, inplace=True) is base and torch.equal(base, y)


@cuda
def test_fused_weights_follow_the_parameters(rng):
    """The fused kernels' prepared weights are remade when a parameter changes in place, is
    replaced, or is loaded, and when the module changes dtype."""
    conv = tb.SparseConv2d(8, 8, bsize_out=8, method="fused").cuda()
    shape = (1, 24, 24)
    x = torch.randn(*shape, 8, device="cuda")
    found = conv.reduce_mask(_mask(rng, *shape).cuda())
    covered = _covered(found, shape, 8).cuda()

    def check(x):
        _close(conv(x, found)[covered], conv.dense(x)[covered], x.dtype)

    with torch.no_grad():
        check(x)
        conv.conv.weight.mul_(-2)
        check(x)
        conv.conv.weight = torch.nn.Parameter(torch.randn_like(conv.conv.weight))
        check(x)
        conv.load_state_dict({k: torch.randn_like(v) for k, v in conv.state_dict().items()})
        check(x)
        conv.half()
        check(x.half())


def test_weight_copies_kept_per_version():
    """The kernels' copies of the weights are made once per parameter version and x dtype,
    remade when a parameter changes in place or is replaced, and not kept past the
    parameters."""
    made = []

    def prepare(x, weight, bias):
        made.append(1)
        return (weight.to(x.dtype) * 2,)

    weight, x = torch.randn(4, 3, 3, 3), torch.randn(2)
    first = _weights.prepared(prepare, x, (weight, None))
    assert _weights.prepared(prepare, x, (weight, None)) is first and len(made) == 1
    weight.mul_(3)
    assert torch.equal(_weights.prepared(prepare, x, (weight, None))[0], weight * 2)
    _weights.prepared(prepare, x.double(), (weight, None))
    bias = torch.randn(4)
    _weights.prepared(prepare, x.double(), (weight, bias))
    latest = _weights.prepared(prepare, x.double(), (weight, torch.randn(4)))
    assert len(made) == 5
    latest = weakref.ref(latest[0])
    del weight
    assert latest() is None


@cuda
@pytest.mark.parametrize("frozen", [False, True])
def test_fused_weights_in_cuda_graphs(rng, frozen):
    """A CUDA graph captured through a fused module makes the weight copies inside the graph,
    so replays follow in-place changes of the parameters; under frozen_weights it reads the
    copies made before the capture, kept in the list frozen_weights yields."""
    conv = tb.SparseConv2d(8, 8, bsize_out=8, method="fused").cuda()
    shape = (1, 24, 24)
    x = torch.randn(*shape, 8, device="cuda")
    found = conv.reduce_mask(_mask(rng, *shape).cuda(), capacity=16)
    covered = _covered(found, shape, 8).cuda()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            conv(x, found)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        context = tb.frozen_weights() if frozen else contextlib.nullcontext([])
        with context as kept, torch.cuda.graph(graph):
            y = conv(x, found)
        graph.replay()
        before = y.clone()
        _close(before[covered], conv.dense(x)[covered], x.dtype)
        conv.conv.weight.mul_(-2)
        graph.replay()
        if frozen:
            assert kept and torch.equal(y, before)
        else:
            assert not kept
            _close(y[covered], conv.dense(x)[covered], x.dtype)


@cuda
def test_stage_fused_and_trained_by_gemm(rng):
    """A stage in inference runs fused and matches the gemm method; with gradients, auto trains
    through gemm."""
    stage = tb.SparseResStage(32, 8, 3, bsize_out=8).cuda()
    _randomise_batchnorm(stage, rng)
    x = torch.randn(1, 40, 48, 32, device="cuda")
    mask = _mask(rng, 1, 40, 48).cuda()
    stage.train()
    stage(x.requires_grad_(), mask).square().sum().backward()
    assert x.grad is not None
    stage.fold_batchnorm()
    with torch.no_grad():
        assert stage.units[0].fused(x)
        y = stage(x.detach(), mask, capacity=32)
        for unit in stage.units:
            unit.method = "gemm"
        _close(y, stage(x.detach(), mask, capacity=32), torch.float32)


def test_fused_method_checks(rng):
    block = tb.SparseResBlockBottleneck(8, 4, bsize_out=6, method="fused")
    x = torch.randn(1, 20, 20, 8)
    found = block.reduce_mask(torch.ones(1, 20, 20))
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA"):
        block(x, found)
    with pytest.raises(ValueError, match="method"):
        tb.SparseConv2d(3, 3, method="fast")
    block.method = "auto"
    assert not block.fused(x)
    with torch.no_grad():
        assert block(x, found).shape == x.shape
