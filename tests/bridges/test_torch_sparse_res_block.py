"""torch_bridge.SparseConv2d and SparseResBlockBottleneck against their dense counterparts."""

import numpy
import pytest

from conftest import require

torch = require("torch")

import torch_bridge as tb  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


def _covered(found, shape, bsize_out):
    """Pixels of the output blocks of the active blocks."""
    covered = torch.zeros(shape, dtype=torch.bool)
    for n, hi, wi in found.active_block_indices.tolist():
        covered[n, hi * bsize_out:(hi + 1) * bsize_out, wi * bsize_out:(wi + 1) * bsize_out] = 1
    return covered


def _mask(rng, n, height, width):
    """Two clusters per image, one touching the bottom-right border."""
    mask = torch.zeros(n, height, width)
    for i in range(n):
        r, c = rng.integers(0, height - 8), rng.integers(0, width - 8)
        mask[i, r:r + 6, c:c + 9] = 1
        mask[i, -3:, -5:] = 1
    return mask


def _randomise_batchnorm(module, rng):
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.tensor(rng.uniform(-1, 1, m.num_features)))
            m.running_var.copy_(torch.tensor(rng.uniform(0.5, 2, m.num_features)))
            m.weight.data.copy_(torch.tensor(rng.uniform(0.5, 1.5, m.num_features)))
            m.bias.data.copy_(torch.tensor(rng.uniform(-1, 1, m.num_features)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 50, 70), (1, 37, 33)])
def test_res_block_equals_dense_on_active_blocks(rng, device, shape):
    torch.manual_seed(int(rng.integers(1 << 30)))
    block = tb.SparseResBlockBottleneck(24, 8, bsize_out=8).double().to(device)
    _randomise_batchnorm(block, rng)
    block.eval()
    x = torch.randn(*shape, 24, dtype=torch.float64, device=device)
    found = block.reduce_mask(_mask(rng, *shape).to(device))
    covered = _covered(found, shape, 8)
    assert 0 < covered.float().mean() < 0.6
    with torch.no_grad():
        dense = block.dense(x).cpu()
        for fold in (False, True):
            if fold:
                block.fold_batchnorm()
            y = block(x, found).cpu()
            torch.testing.assert_close(y[covered], dense[covered], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(y[~covered], x.cpu()[~covered], rtol=0, atol=0)
            y = block(x.clone(), found, inplace=True).cpu()
            torch.testing.assert_close(y[covered], dense[covered], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_res_block_trains(rng, device):
    """Gradients reach x and every weight, through gather, the unit and the scatter-add."""
    block = tb.SparseResBlockBottleneck(16, 4, bsize_out=8).double().to(device)
    x = torch.randn(1, 30, 30, 16, dtype=torch.float64, device=device, requires_grad=True)
    found = block.reduce_mask(_mask(rng, 1, 30, 30).to(device))
    block(x, found).square().sum().backward()
    assert x.grad is not None and all(p.grad is not None and p.grad.abs().sum() > 0
                                      for p in block.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_conv_equals_dense_on_active_blocks(rng, device):
    conv = tb.SparseConv2d(6, 6, bsize_out=8).double().to(device)
    x = torch.randn(2, 41, 29, 6, dtype=torch.float64, device=device)
    found = conv.reduce_mask(_mask(rng, 2, 41, 29).to(device))
    covered = _covered(found, (2, 41, 29), 8)
    with torch.no_grad():
        y, dense = conv(x, found, base=x).cpu(), conv.dense(x).cpu()
        zeros_base = conv(x, found).cpu()
    torch.testing.assert_close(y[covered], dense[covered], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y[~covered], x.cpu()[~covered], rtol=0, atol=0)
    assert (zeros_base[~covered] == 0).all()


def test_capacity_bucket():
    buckets = sorted({tb.capacity_bucket(m) for m in range(1, 5000)})
    assert buckets[0] == 8 and all(b % 8 == 0 for b in buckets)
    for m in range(1, 5000):
        bucket = tb.capacity_bucket(m)
        assert bucket >= m and (bucket <= 8 or bucket <= numpy.ceil(m * 1.125 / 8) * 8 + 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capacity_graphs_match_eager(rng):
    """One graph per bucket, replayed with new inputs, equals the eager module."""
    block = tb.SparseResBlockBottleneck(16, 8, bsize_out=8).cuda().eval()
    _randomise_batchnorm(block, rng)
    block.fold_batchnorm()
    mask = torch.zeros(1, 64, 64, device="cuda")
    x = torch.randn(1, 64, 64, 16, device="cuda")

    def unit(capacity):
        return block(x, block.reduce_mask(mask, capacity=capacity))

    graphs = tb.CapacityGraphs(unit)
    with torch.no_grad():
        for density in (0.02, 0.2, 0.02):
            mask.copy_(torch.tensor(rng.random((1, 64, 64)) < density, device="cuda"))
            x.copy_(torch.randn_like(x))
            count = int(block.reduce_mask(mask).bin_counts[0])
            torch.testing.assert_close(graphs(count), unit(None))  # cuDNN may pick other algorithms
    assert len(graphs.graphs) == 2
