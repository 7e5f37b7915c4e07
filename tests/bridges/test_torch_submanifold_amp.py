"""torch_bridge.submanifold under torch.autocast: the convolutions run in the autocast dtype (as
spconv's and torch's own matrix products do), and a training step with GradScaler gives float32
gradients close to the float32 step's. A float32 weight's and bias's gradients are computed and
returned in float32, never through float16, whose sums over many sites of GradScaler-scaled
products overflow (spconv's issue 513); a float16 model (model.half()) keeps float16 gradients.
The op's part of this (float32 parameters with float16 or bfloat16 features) also runs on the
CPU, through the dispatcher, the eager autograd route, fake tensors and torch.compile."""

import pytest

from conftest import HAS_GPU, require
from test_submanifold import random_sites

torch = require("torch")

import torch_bridge.submanifold as spconv  # noqa: E402
from torch_bridge.submanifold import conv_op as _conv_op  # noqa: E402

requires_cuda = pytest.mark.skipif(not (HAS_GPU and torch.cuda.is_available()),
                                   reason="needs CUDA")
HALF = [torch.float16, torch.bfloat16]


def _net():
    torch.manual_seed(0)
    return spconv.SparseSequential(
        # no bias before a BatchNorm (its gradient is ~0: no relative error to compare)
        spconv.SubMConv3d(4, 32, 3, bias=False, indice_key="a"), torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        spconv.SparseConv3d(32, 64, 3, stride=2, padding=1, bias=False),
        spconv.SubMConv3d(64, 64, 3, bias=True)).cuda()


def _input():
    gen = torch.Generator().manual_seed(1)
    flat = torch.randperm(2 * 16 * 20 * 20, generator=gen)[:3000]
    indices = torch.stack([flat // 6400, flat // 400 % 16, flat // 20 % 20, flat % 20], 1)
    features = torch.randn(3000, 4, generator=gen)
    return spconv.SparseConvTensor(features.cuda(), indices.int().cuda(), (16, 20, 20), 2)


@requires_cuda
@pytest.mark.parametrize("dtype", HALF)
def test_autocast_runs_in_its_dtype_with_float32_gradients(dtype):
    net, x = _net(), _input()
    with torch.no_grad():
        want = net(x).features
    with torch.autocast("cuda", dtype=dtype):
        out = net(x).features
    assert out.dtype == dtype
    error = (out.float() - want).norm() / want.norm()
    assert error < (2e-3 if dtype == torch.float16 else 1.5e-2), error.item()
    out.float().square().mean().backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
    amp = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    net(x).features.square().mean().backward()
    for name, p in net.named_parameters():
        error = (amp[name] - p.grad).norm() / p.grad.norm()
        assert error < (5e-2 if dtype == torch.float16 else 1e-1), (name, error.item())


# --- large sums: what a float16 gradient cannot hold --------------------------------------

SITES, GRID, CIN, COUT = 20000, (32, 32, 32), 16, 16


def _large(rng, device):
    """20000 sites (density 0.6: ~12000 pairs a tap), features ~30, a 3x3x3 submanifold
    rulebook, a float32 weight (~0.1) and bias, and an output gradient as GradScaler's 65536
    makes it of a loss averaged over the sites (~3 an entry, exact in float16 and bfloat16):
    each weight gradient entry sums ~12000 products of ~100, ~10^6 (float16 holds 65504),
    as does the bias's."""
    indices = torch.from_numpy(random_sites(rng, 1, GRID, SITES))
    features = torch.from_numpy(25 + 10 * rng.random((SITES, CIN))).float()
    weight = torch.from_numpy(rng.normal(0, 0.1, (COUT, 3, 3, 3, CIN))).float()
    bias = torch.from_numpy(rng.normal(0, 0.1, COUT)).float()
    dy = torch.from_numpy(rng.integers(8, 40, (SITES, COUT)) / 8).float()  # 1 .. 5, in 1/8
    rulebook = spconv.build_rulebook(indices.to(device), GRID, 1, 3, subm=True)
    return (rulebook, features.to(device), weight.to(device), bias.to(device), dy.to(device))


def _reference(rulebook, features, weight, bias, dy, dtype):
    """float64 gradients (features, weight, bias) of the convolution of features and weight
    rounded to dtype (what the op multiplies), on the CPU."""
    neighbors = rulebook.neighbors.cpu()
    x = features.to(dtype).double().cpu()
    w = weight.to(dtype).double().cpu()
    g = dy.double().cpu()
    # dw[:, k] = g^T @ x[neighbors[k]] (absent neighbours read a zero row)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    gathered = padded[neighbors.long()]  # [K, N_out, Cin]
    dw = torch.einsum("oc,koi->cki", g, gathered).reshape(weight.shape)
    # dx[i] = sum over the pairs (k, o) reading i of w[:, k]^T g[o]
    taps = w.reshape(w.shape[0], -1, w.shape[-1])  # [Cout, K, Cin]
    contributions = torch.einsum("oc,cki->koi", g, taps)  # [K, N_out, Cin]
    dx = torch.zeros_like(padded)
    dx.index_add_(0, torch.where(neighbors >= 0, neighbors, x.shape[0]).long().reshape(-1),
                  contributions.reshape(-1, x.shape[1]))
    return dx[:-1], dw, g.sum(0)


def _relative(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()


@requires_cuda
@pytest.mark.parametrize("algo", ["gemm", "fused"])
@pytest.mark.parametrize("dtype", HALF)
def test_autocast_weight_gradient_stays_finite(rng, dtype, algo):
    """A float32 weight and bias under autocast: their gradients are float32, finite where a
    float16 product's output overflows, and equal a float64 reference within what the float16
    (bfloat16) operands allow; the features' gradient comes back in float32."""
    rulebook, features, weight, bias, dy = _large(rng, "cuda")
    x, w, b = (t.clone().requires_grad_() for t in (features, weight, bias))
    with torch.autocast("cuda", dtype=dtype):
        y = spconv.rulebook_conv(x, rulebook, w, b, algo=algo)
    assert y.dtype == dtype
    y.backward(dy.to(dtype))
    for name, t in (("features", x), ("weight", w), ("bias", b)):
        assert t.grad.dtype == torch.float32, name
        assert torch.isfinite(t.grad).all(), name
    dx, dw, db = _reference(rulebook, features, weight, bias, dy, dtype)
    assert dw.abs().max() > 65504  # what float16 cannot hold
    # float32 sums of exact products of float16 (bfloat16) operands
    assert _relative(w.grad, dw) < 1e-4, _relative(w.grad, dw)
    assert _relative(b.grad, db) < 1e-5, _relative(b.grad, db)
    # the features' gradient: float16 (bfloat16) output, then cast to float32
    tolerance = 2e-3 if dtype == torch.float16 else 1.5e-2
    assert _relative(x.grad, dx) < tolerance, _relative(x.grad, dx)


@requires_cuda
def test_half_model_keeps_half_gradients(rng):
    """A float16 model (model.half(): float16 weight and bias, no autocast): its gradients stay
    float16, computed as before, so the same sums overflow there (the reason AMP keeps float32
    parameters); under autocast a float16 weight is unchanged too."""
    rulebook, features, weight, bias, dy = _large(rng, "cuda")
    x, w, b = (t.half().requires_grad_() for t in (features, weight, bias))
    spconv.rulebook_conv(x, rulebook, w, b).backward(dy.half())
    for name, t in (("features", x), ("weight", w), ("bias", b)):
        assert t.grad.dtype == torch.float16, name
    assert not torch.isfinite(w.grad).all()
    w.grad = None
    with torch.autocast("cuda", dtype=torch.float16):
        y = spconv.rulebook_conv(x, rulebook, w, b)
    y.backward(dy.half())
    assert w.grad.dtype == torch.float16


@requires_cuda
def test_grad_scaler_step_is_not_skipped(rng):
    """SubMConv3d on the large input, one AMP step with GradScaler at its initial scale 65536
    and a loss averaged over the sites: no gradient overflows, so the step is taken and the
    scale kept; the unscaled gradients are close to a float32 step's."""
    rulebook, features, weight, bias, dy = _large(rng, "cuda")
    indices = rulebook.in_indices
    conv = spconv.SubMConv3d(CIN, COUT, 3, bias=True).cuda()
    with torch.no_grad():
        conv.weight.copy_(weight)
        conv.bias.copy_(bias)
    x = spconv.SparseConvTensor(features, indices, GRID, 1)
    conv(x).features.sum().div(SITES).backward()
    want = {n: p.grad.clone() for n, p in conv.named_parameters()}
    conv.zero_grad()
    opt = torch.optim.SGD(conv.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cuda", init_scale=65536.0)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = conv(x).features.float().sum().div(SITES)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    for name, p in conv.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
        error = (p.grad - want[name]).norm() / want[name].norm()
        assert error < 1e-3, (name, error.item())
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 65536.0  # no inf found: the step was not skipped


@requires_cuda
@pytest.mark.parametrize("algo", ["gemm", "fused"])
def test_autocast_compiles(rng, algo):
    """Traced (aot_eager, fullgraph) under autocast: the same float32 gradients as eager."""
    rulebook, features, weight, bias, dy = _large(rng, "cuda")

    def loss(f, w, b):
        with torch.autocast("cuda", dtype=torch.float16):
            y = spconv.rulebook_conv(f, rulebook, w, b, algo=algo)
        return (y.float() * dy).sum() / SITES

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        inputs = [t.clone().requires_grad_() for t in (features, weight, bias)]
        fn(*inputs).backward()
        assert all(t.grad.dtype == torch.float32 for t in inputs)
        results.append([t.grad for t in inputs])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)


# --- the op with float32 parameters, on the CPU --------------------------------------------

def _op_args(rulebook, features, weight, bias):
    return (features, weight, bias, rulebook.neighbors, rulebook.neighbors_t, None, None,
            "gemm")


def _dispatched(*args):
    return torch.ops.sbnet.submanifold_conv(*args)


def _eager(*args):
    return _conv_op._conv_autograd(*args)


@pytest.mark.parametrize("route", [_dispatched, _eager], ids=["dispatcher", "eager"])
@pytest.mark.parametrize("dtype", HALF)
def test_op_takes_float32_parameters_cpu(rng, dtype, route):
    """The op (as rulebook_conv calls it under CUDA autocast) with float16 or bfloat16 features
    and a float32 weight and bias: output and features' gradient in the features' dtype, the
    parameters' gradients in float32, finite and equal the float64 reference's, where a
    float16 one would overflow."""
    rulebook, features, weight, bias, dy = _large(rng, "cpu")
    x = features.to(dtype).requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    y = route(*_op_args(rulebook, x, w, b))
    assert y.dtype == dtype
    y.backward(dy.to(dtype))
    assert x.grad.dtype == dtype
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    assert torch.isfinite(w.grad).all() and torch.isfinite(b.grad).all()
    dx, dw, db = _reference(rulebook, features, weight, bias, dy, dtype)
    assert dw.abs().max() > 65504
    assert _relative(w.grad, dw) < 1e-5, _relative(w.grad, dw)
    assert _relative(b.grad, db) < 1e-6, _relative(b.grad, db)
    tolerance = 2e-3 if dtype == torch.float16 else 1.5e-2
    assert _relative(x.grad, dx) < tolerance, _relative(x.grad, dx)
    # the forward multiplies by the weight cast to the features' dtype
    want = route(*_op_args(rulebook, x.detach(), weight.to(dtype), bias.to(dtype)))
    torch.testing.assert_close(y.detach(), want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF)
def test_op_fake_dtypes(dtype):
    """The fake kernels (what torch.compile and torch.export trace) of the op and of its
    weight gradient with mixed dtypes: output in the features' dtype, the weight's gradient in
    the dtype asked for."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        features = torch.empty(50, 4, dtype=dtype)
        weight = torch.empty(8, 3, 3, 3, 4)
        bias = torch.empty(8)
        neighbors = torch.empty(27, 40, dtype=torch.int32)
        neighbors_t = torch.empty(27, 50, dtype=torch.int32)
        y = torch.ops.sbnet.submanifold_conv(features, weight, bias, neighbors, neighbors_t,
                                             None, None, "gemm")
        dw = torch.ops.sbnet.submanifold_conv_grad_weight(
            features, torch.empty(40, 8, dtype=dtype), neighbors, [8, 3, 3, 3, 4],
            torch.float32)
        same = torch.ops.sbnet.submanifold_conv_grad_weight(
            features, torch.empty(40, 8, dtype=dtype), neighbors, [8, 3, 3, 3, 4], dtype)
    assert (y.shape, y.dtype) == ((40, 8), dtype)
    assert (tuple(dw.shape), dw.dtype) == ((8, 3, 3, 3, 4), torch.float32)
    assert same.dtype == dtype


def test_op_compiles_with_float32_parameters_cpu(rng):
    """The op with float16 features and float32 parameters traces as one op (fullgraph,
    aot_eager), forward and backward: the eager gradients, in their dtypes."""
    indices = torch.from_numpy(random_sites(rng, 1, (8, 8, 8), 200))
    rulebook = spconv.build_rulebook(indices, (8, 8, 8), 1, 3, subm=True)
    features = torch.from_numpy(rng.normal(0, 1, (indices.shape[0], 4))).half()
    weight = torch.from_numpy(rng.normal(0, 0.1, (8, 3, 3, 3, 4))).float()
    bias = torch.from_numpy(rng.normal(0, 0.1, 8)).float()

    def loss(f, w, b):
        return _dispatched(*_op_args(rulebook, f, w, b)).float().square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        inputs = [t.clone().requires_grad_() for t in (features, weight, bias)]
        fn(*inputs).backward()
        assert [t.grad.dtype for t in inputs] == [torch.float16, torch.float32, torch.float32]
        results.append([t.grad for t in inputs])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)


def test_mixed_dtypes_rejected_outside_autocast(rng):
    """Outside CUDA autocast a float32 weight with float16 features is a TypeError naming the
    weight (and a float32 bias with a float16 weight names the bias), as before; the autocast
    path's check takes float32 parameters, and only those."""
    indices = torch.from_numpy(random_sites(rng, 1, (6, 6), 20))
    rulebook = spconv.build_rulebook(indices, (6, 6), 1, 3, subm=True)
    features = torch.zeros(indices.shape[0], 3, dtype=torch.float16)
    weight = torch.zeros(2, 3, 3, 3)
    with pytest.raises(TypeError, match="weight must have features' dtype float16, got float32"):
        spconv.rulebook_conv(features, rulebook, weight)
    with pytest.raises(ValueError, match="bias must be a float16 array of shape \\(2,\\)"):
        spconv.rulebook_conv(features, rulebook, weight.half(), torch.zeros(2))
    args = (rulebook.neighbors, (3, 3), indices.shape[0], "gemm")
    _conv_op._check_conv(features, weight, torch.zeros(2), *args, True)
    _conv_op._check_conv(features, weight.half(), torch.zeros(2), *args, True)
    with pytest.raises(TypeError, match="weight must have features' dtype float16, got float64"):
        _conv_op._check_conv(features, weight.double(), None, *args, True)
    with pytest.raises(ValueError, match="weight must be \\[Cout, 3, 3, 3\\]"):
        _conv_op._check_conv(features, torch.zeros(2, 3, 3, 4), None, *args, True)
    with pytest.raises(TypeError, match="weight must have features' dtype float16, got float32"):
        _conv_op._check_conv(features, weight, None, *args, False)
