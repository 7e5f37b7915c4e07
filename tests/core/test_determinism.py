"""Under torch.use_deterministic_algorithms(True), every op's forward and backward on the GPU
give the same bits on every run: the adds that are atomic by default (scatter with atomic adds,
the gather's gradient, the pruned kernel's value gradient) take their deterministic paths.
tests/conftest.py sets CUBLAS_WORKSPACE_CONFIG, which cuBLAS needs for that mode."""

import pytest

from conftest import require

torch = require("torch")

import torch_bridge as tb  # noqa: E402
import torch_bridge.submanifold as spconv  # noqa: E402
from torch_bridge.blocks import ops  # noqa: E402
from sbnet_cupy.core import checks as _checks  # noqa: E402

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _mask(n=2, size=48):
    mask = torch.zeros(n, size, size)
    mask[:, 5:20, 9:30] = 1
    mask[:, -4:, -6:] = 1
    return mask


def _gather_scatter(dtype):
    x = torch.randn(2, 48, 48, 8, generator=_gen(0)).to("cuda", dtype).requires_grad_()
    found = tb.reduce_mask(_mask().cuda(), (6, 6), bsize=10, bstride=8, boffset=(-1, -1))
    blocks = tb.sparse_gather(x, found.bin_counts, found.active_block_indices, bsize=10,
                              bstride=8, boffset=(-1, -1))
    base = torch.randn(2, 48, 48, 8, generator=_gen(1)).to("cuda", dtype).requires_grad_()
    y = tb.sparse_scatter(blocks * 1.5, found.bin_counts, found.active_block_indices, base,
                          bsize=10, bstride=8, boffset=(-1, -1), add=True, atomic=True)
    return y, (x, base)


def _res_unit(method, dtype):
    torch.manual_seed(2)
    unit = tb.SparseResBlockBottleneck(16, 8, bsize_out=8, method=method).to("cuda", dtype)
    x = torch.randn(2, 48, 48, 16, generator=_gen(3)).to("cuda", dtype)
    if method == "fused":
        unit.fold_batchnorm()
        with torch.no_grad():
            return unit(x, unit.reduce_mask(_mask().cuda())), ()
    x.requires_grad_()
    return unit(x, unit.reduce_mask(_mask().cuda())), (x, *unit.parameters())


def _submanifold(dtype):
    torch.manual_seed(4)
    net = spconv.SparseSequential(
        spconv.SubMConv3d(4, 32, 3, indice_key="a"), torch.nn.ReLU(),
        spconv.SparseConv3d(32, 32, 3, stride=2, padding=1),
        spconv.SubMConv3d(32, 16, 3)).to("cuda", dtype)
    flat = torch.randperm(2 * 20 * 30 * 30, generator=_gen(5))[:5000]
    indices = torch.stack([flat // 18000, flat // 900 % 20, flat // 30 % 30, flat % 30], 1)
    features = torch.randn(5000, 4, generator=_gen(6)).to("cuda", dtype).requires_grad_()
    out = net(spconv.SparseConvTensor(features, indices.int().cuda(), (20, 30, 30), 2))
    return out.features, (features, *net.parameters())


def _pruned(dtype):
    dense = torch.randn(16, 8, 3, 3, generator=_gen(7))
    dense[torch.rand(dense.shape, generator=_gen(8)) < 0.6] = 0
    conv = tb.SparseKernelConv2d(dense, torch.randn(16, generator=_gen(9)), padding=1)
    conv = conv.to("cuda", dtype)
    x = torch.randn(2, 8, 40, 44, generator=_gen(10)).to("cuda", dtype).requires_grad_()
    return conv(x), (x, *conv.parameters())


def _dilated(method, dtype):
    torch.manual_seed(11)
    conv = tb.DilatedConv2d(8, 16, 3, dilation=2, padding=2, method=method).to("cuda", dtype)
    x = torch.randn(2, 8, 40, 40, generator=_gen(12)).to("cuda", dtype).to(
        memory_format=torch.channels_last).requires_grad_()
    return conv(x), (x, *conv.parameters())


def _reduce_mask(capacity):
    found = tb.reduce_mask(_mask().cuda(), (6, 6), bsize=10, bstride=8, boffset=(-1, -1),
                           capacity=capacity)
    return found.active_block_indices.float(), ()


CASES = {
    "gather_scatter_atomic": _gather_scatter,
    "res_unit_gemm": lambda dtype: _res_unit("gemm", dtype),
    "res_unit_fused": lambda dtype: _res_unit("fused", dtype),
    "submanifold": _submanifold,
    "pruned_kernel": _pruned,
    "dilated_reshape": lambda dtype: _dilated("reshape", dtype),
    "dilated_native": lambda dtype: _dilated("native", dtype),
    "reduce_mask": lambda dtype: _reduce_mask(None),
    "reduce_mask_capacity": lambda dtype: _reduce_mask(100),
}


def _run(case, dtype):
    """The output and the gradients of a sum of its squares, as float64 on the CPU."""
    out, inputs = CASES[case](dtype)
    grads = ()
    if inputs:
        grads = torch.autograd.grad(out.float().square().sum(), inputs)
    return [t.detach().double().cpu() for t in (out, *grads)]


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_two_runs_give_the_same_bits(case, dtype):
    torch.use_deterministic_algorithms(True)
    try:
        first, second = _run(case, dtype), _run(case, dtype)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert torch.equal(a, b), case


@pytest.mark.parametrize("bsize,bstride", [((10, 10), (8, 8)), ((18, 5), (16, 2)),
                                           ((4, 4), (4, 4)), ((3, 7), (1, 3))])
def test_apart_lists_hold_every_block_once_without_overlap(bsize, bstride):
    """ops._apart: every row of the block list is valid in exactly one list, and within a
    list no two valid blocks share a pixel."""
    gen = _gen(13)
    rows = torch.stack([torch.randint(0, 2, (60,), generator=gen),
                        torch.randint(0, 9, (60,), generator=gen),
                        torch.randint(0, 9, (60,), generator=gen)], 1).int()
    rows = torch.unique(rows, dim=0)
    lists = ops._apart(rows, _checks.BlockGeometry(bsize, (0, 0), bstride))
    valid = torch.stack([r[:, 0] >= 0 for r in lists])
    assert torch.equal(valid.sum(0), torch.ones(rows.shape[0], dtype=torch.int64))
    for r, keep in zip(lists, valid):
        assert torch.equal(r[keep], rows[keep])
        blocks = r[keep].tolist()
        for i, (n, hi, wi) in enumerate(blocks):
            for n2, hi2, wi2 in blocks[i + 1:]:
                overlap = (n == n2 and abs(hi - hi2) * bstride[0] < bsize[0]
                           and abs(wi - wi2) * bstride[1] < bsize[1])
                assert not overlap, ((n, hi, wi), (n2, hi2, wi2))
