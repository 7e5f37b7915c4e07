"""torch_bridge.submanifold under torch.autocast: the convolutions run in the autocast dtype (as
spconv's and torch's own matrix products do), and a training step with GradScaler gives float32
gradients close to the float32 step's."""

import pytest

from conftest import require

torch = require("torch")

import torch_bridge.submanifold as spconv  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
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
