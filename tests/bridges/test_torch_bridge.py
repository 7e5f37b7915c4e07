"""torch_bridge: forward equals sbnet_cupy, gradients, opcheck, compile, CUDA graphs."""

import inspect

import numpy
import pytest

from conftest import require  # noqa: E402

torch = require("torch")

import sbnet_cupy  # noqa: E402
import torch_bridge as tb  # noqa: E402
from axes import random_array  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA,
                                                                reason="needs CUDA"))]
# (image H, W), bsize, boffset, bstride, bcount: one geometry without overlap, one with.
DISJOINT = ((11, 13), (4, 3), (-1, -1), (4, 3), (3, 5))
OVERLAPPING = ((11, 13), (4, 5), (-2, -1), (3, 4), (4, 4))


def _inputs(rng, geometry, channels=3, dtype=torch.float64, device="cpu", n_batch=2):
    (height, width), bsize, boffset, bstride, bcount = geometry
    x = torch.tensor(random_array(rng, (n_batch, height, width, channels), numpy.float64),
                     dtype=dtype, device=device)
    mask = torch.tensor(rng.random((n_batch, height, width)) > 0.7, device=device)
    found = tb.reduce_mask(mask, bcount, bsize=bsize, boffset=boffset, bstride=bstride)
    kw = dict(bsize=bsize, boffset=boffset, bstride=bstride)
    return x, found, kw


def _np(t):
    t = t.detach().cpu()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("geometry, add, atomic", [(DISJOINT, False, False),
                                                   (DISJOINT, True, False),
                                                   (OVERLAPPING, True, True)])
def test_forward_equals_sbnet_cupy(rng, device, transpose, geometry, add, atomic):
    x, found, kw = _inputs(rng, geometry, channels=5, device=device)
    indices, counts = _np(found.active_block_indices), _np(found.bin_counts)
    stack = tb.sparse_gather(x, found.bin_counts, found.active_block_indices, transpose=transpose,
                             **kw)
    want = sbnet_cupy.sparse_gather(_np(x), counts, indices, transpose=transpose, **kw)
    numpy.testing.assert_array_equal(_np(stack), want)
    blocks = torch.tensor(random_array(rng, tuple(stack.shape), numpy.float64), device=device)
    scatter_kw = dict(add=add, atomic=atomic, transpose=transpose, **kw)
    want = sbnet_cupy.sparse_scatter(_np(blocks), counts, indices, _np(x), **scatter_kw)
    y = tb.sparse_scatter(blocks, found.bin_counts, found.active_block_indices, x, **scatter_kw)
    numpy.testing.assert_array_equal(_np(y), want)  # multiples of 1/8: sums are exact
    y = x.clone()
    assert tb.sparse_scatter_var(blocks, found.bin_counts, found.active_block_indices, y,
                                 **scatter_kw) is y
    numpy.testing.assert_array_equal(_np(y), want)


@pytest.mark.parametrize("device", DEVICES)
def test_reduce_mask_equals_sbnet_cupy(rng, device):
    mask = rng.random((2, 40, 50)).astype(numpy.float32)
    for capacity in (None, 7, 100):
        got = tb.reduce_mask(torch.tensor(mask, device=device), (5, 6), bsize=10, bstride=8,
                             boffset=-1, tol=0.9, capacity=capacity)
        want = sbnet_cupy.reduce_mask(mask, (5, 6), bsize=10, bstride=8, boffset=-1, tol=0.9,
                                      capacity=capacity)
        numpy.testing.assert_array_equal(_np(got.active_block_indices), want.active_block_indices)
        numpy.testing.assert_array_equal(_np(got.bin_counts), want.bin_counts)
        assert bool(got.overflowed) == bool(want.overflowed)


GRAD_CASES = [
    # geometry, op, add, atomic
    (DISJOINT, "gather", None, None),
    (OVERLAPPING, "gather", None, None),
    (DISJOINT, "scatter", False, False),
    (DISJOINT, "scatter", True, False),
    (OVERLAPPING, "scatter", True, True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("geometry, op, add, atomic", GRAD_CASES)
def test_gradients(rng, device, geometry, op, add, atomic, transpose):
    x, found, kw = _inputs(rng, geometry, device=device)
    args = (found.bin_counts, found.active_block_indices)
    if op == "gather":
        x.requires_grad_(True)
        fn = lambda x: tb.sparse_gather(x, *args, transpose=transpose, **kw)  # noqa: E731
        inputs = (x,)
    else:
        stack = tb.sparse_gather(x, *args, transpose=transpose, **kw)
        blocks = torch.tensor(random_array(rng, tuple(stack.shape), numpy.float64),
                              device=device, requires_grad=True)
        x.requires_grad_(True)
        fn = lambda b, y: tb.sparse_scatter(b, *args, y, add=add, atomic=atomic,  # noqa: E731
                                            transpose=transpose, **kw)
        inputs = (blocks, x)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8)


def test_eager_autograd_binds_no_signature(rng, monkeypatch):
    """An eager call that records a gradient runs the op's autograd.Function through its C
    apply: the Python apply binds the arguments with inspect.signature on every call (~20-30 us
    of host time), so a call through it fails here."""
    x, found, kw = _inputs(rng, OVERLAPPING)
    args = (found.bin_counts, found.active_block_indices)
    x.requires_grad_(True)

    def refuse(*_args, **_kwargs):
        raise AssertionError("inspect.signature called on an eager op call")

    monkeypatch.setattr(inspect, "signature", refuse)
    stack = tb.sparse_gather(x, *args, **kw)
    y = tb.sparse_scatter(stack * 2, *args, x, add=True, atomic=True, **kw)
    y.sum().backward()
    monkeypatch.undo()
    want = torch.autograd.grad(tb.sparse_scatter(tb.sparse_gather(x, *args, **kw) * 2, *args,
                                                 x, add=True, atomic=True, **kw).sum(), x)[0]
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(rng, device):
    x, found, kw = _inputs(rng, OVERLAPPING, device=device)
    geometry = [list(kw["bsize"]), list(kw["boffset"]), list(kw["bstride"])]
    args = (found.bin_counts, found.active_block_indices)
    stack = tb.sparse_gather(x, *args, **kw)
    x.requires_grad_(True)
    mask = (x[..., 0] > 0).detach()
    cases = [
        (torch.ops.sbnet.reduce_mask.default,
         (mask, [4, 4], *geometry, 0.5, False, 20), {}),
        (torch.ops.sbnet.sparse_gather.default, (x, *args, *geometry, False, None, None, False),
         {}),
        (torch.ops.sbnet.sparse_gather.default, (x, *args, *geometry, True, None, None, False),
         {}),
        (torch.ops.sbnet.sparse_gather.default,
         (x, *args, *geometry, False, torch.rand(3, dtype=x.dtype, device=device) + 0.5,
          torch.rand(3, dtype=x.dtype, device=device) - 0.5, True), {}),
        (torch.ops.sbnet.sparse_scatter.default,
         (stack.detach().requires_grad_(True), *args, x, *geometry, True, True, False), {}),
        (torch.ops.sbnet.sparse_scatter_.default,
         (stack.detach(), *args, x.detach().clone(), *geometry, True, True, False), {}),
    ]
    for op, op_args, op_kwargs in cases:
        torch.library.opcheck(op, op_args, op_kwargs)


def test_bad_arguments():
    x = torch.ones(1, 8, 8, 4)
    counts, indices = torch.ones(1, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="bsize must be two positive ints"):
        tb.sparse_gather(x, counts, indices, bsize=(0, 4))
    with pytest.raises(ValueError, match=r"x must be 4-D"):
        tb.sparse_gather(x[0], counts, indices, bsize=4)
    with pytest.raises(TypeError, match="blocks dtype torch.float64 differs"):
        tb.sparse_scatter(torch.ones(1, 4, 4, 4, dtype=torch.float64), counts, indices, x,
                          bsize=4)
    with pytest.raises(ValueError, match="needs atomic=True"):
        tb.sparse_scatter(torch.ones(1, 4, 4, 4), counts, indices, x, bsize=4, bstride=2,
                          add=True)
    with pytest.raises(TypeError, match="bfloat16 on the GPU only"):
        tb.sparse_scatter(torch.ones(1, 4, 4, 4, dtype=torch.bfloat16), counts, indices,
                          x.bfloat16(), bsize=4, add=True)


# --- GPU only ------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _pipeline(mask, x, weight, capacity):
    """reduce_mask(capacity) -> gather (NCHW blocks) -> 3x3 conv -> scatter into x."""
    found = tb.reduce_mask(mask, (6, 8), bsize=10, bstride=8, boffset=-1, capacity=capacity)
    blocks = tb.sparse_gather(x, found.bin_counts, found.active_block_indices, bsize=10,
                              bstride=8, boffset=-1, transpose=True)
    out = torch.nn.functional.conv2d(blocks, weight)  # 10x10 -> 8x8, VALID
    return tb.sparse_scatter(out, found.bin_counts, found.active_block_indices, x, bsize=8,
                             transpose=True)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_graph_matches_eager(rng, dtype):
    mask = torch.zeros(2, 48, 64, device="cuda")
    x = torch.randn(2, 48, 64, 16, device="cuda", dtype=dtype)
    weight = torch.randn(16, 16, 3, 3, device="cuda", dtype=dtype) / 12
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile the kernels outside the capture
        for _ in range(2):
            _pipeline(mask, x, weight, 40)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _pipeline(mask, x, weight, 40)
    for _ in range(3):  # new inputs each replay
        mask.copy_(torch.tensor(rng.random((2, 48, 64)) > 0.97, device="cuda"))
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager = _pipeline(mask, x, weight, 40)
        torch.testing.assert_close(static_out, eager, rtol=0, atol=0)
        assert (static_out != x).any()


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(rng, device):
    """The ops in one graph, with a capacity and with a data-dependent block count."""
    mask = torch.tensor(rng.random((2, 48, 64)) > 0.97, device=device)
    x = torch.randn(2, 48, 64, 16, device=device)
    weight = torch.randn(16, 16, 3, 3, device=device) / 12
    for capacity in (40, None):
        torch._dynamo.reset()
        compiled = torch.compile(_pipeline, fullgraph=True,
                                 backend="inductor" if device == "cuda" else "aot_eager")
        torch.testing.assert_close(compiled(mask, x, weight, capacity),
                                   _pipeline(mask, x, weight, capacity))


@cuda_only
def test_side_stream(rng):
    x, found, kw = _inputs(rng, DISJOINT, channels=8, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)  # the side stream is busy: ordering must come from it
        stack = tb.sparse_gather(x * 2, found.bin_counts, found.active_block_indices, **kw)
        y = tb.sparse_scatter(stack, found.bin_counts, found.active_block_indices,
                              torch.zeros_like(x), **kw)
    torch.cuda.current_stream().wait_stream(side)
    want = sbnet_cupy.sparse_scatter(
        sbnet_cupy.sparse_gather(_np(x) * 2, _np(found.bin_counts),
                                 _np(found.active_block_indices), **kw),
        _np(found.bin_counts), _np(found.active_block_indices), numpy.zeros(x.shape, "f4"), **kw)
    numpy.testing.assert_array_equal(_np(y), want)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_adds(rng, dtype):
    x, found, kw = _inputs(rng, OVERLAPPING, channels=8, dtype=dtype, device="cuda")
    blocks = tb.sparse_gather(x, found.bin_counts, found.active_block_indices, transpose=True,
                              **kw)
    y = tb.sparse_scatter(blocks, found.bin_counts, found.active_block_indices,
                          torch.zeros_like(x), add=True, atomic=True, transpose=True, **kw)
    # Values are multiples of 1/8 below 8 and each pixel is covered at most 4 times: exact.
    want = sbnet_cupy.sparse_scatter(
        _np(blocks).astype(numpy.float32), _np(found.bin_counts), _np(found.active_block_indices),
        numpy.zeros(x.shape, numpy.float32), add=True, atomic=True, transpose=True, **kw)
    numpy.testing.assert_array_equal(_np(y).astype(numpy.float32), want)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_blocks(device):
    x = torch.randn(1, 16, 16, 4, device=device)
    found = tb.reduce_mask(torch.zeros(1, 16, 16, device=device), (2, 2), bsize=8)
    assert found.active_block_indices.shape == (0, 3) and int(found.bin_counts[0]) == 0
    stack = tb.sparse_gather(x, found.bin_counts, found.active_block_indices, bsize=8)
    assert stack.shape == (0, 8, 8, 4)
    y = tb.sparse_scatter(stack, found.bin_counts, found.active_block_indices, x, bsize=8,
                          add=True)
    assert torch.equal(y, x)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_batchnorm_gather_gradient(rng, device):
    x, found, kw = _inputs(rng, OVERLAPPING, device=device)
    scale = torch.tensor(rng.uniform(0.5, 2, 3), device=device)
    shift = torch.tensor(rng.uniform(-1, 1, 3), device=device)
    x.requires_grad_(True)
    args = (found.bin_counts, found.active_block_indices)
    fused = tb.sparse_gather(x, *args, scale=scale, shift=shift, relu=True, **kw)
    inside = tb.sparse_gather(torch.ones_like(x[..., :1]), *args, **kw)
    unfused = torch.relu(tb.sparse_gather(x, *args, **kw) * scale + shift) * inside
    torch.testing.assert_close(fused, unfused)
    assert torch.autograd.gradcheck(
        lambda x: tb.sparse_gather(x, *args, scale=scale, shift=shift, relu=True, **kw), (x,),
        eps=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="scale and shift of sparse_gather get no gradient"):
        tb.sparse_gather(x, *args, scale=scale.requires_grad_(True), shift=shift, **kw)


@pytest.mark.parametrize("mask_dtype, dtype", [(torch.bool, torch.uint8),
                                               (torch.uint8, torch.int8),
                                               (torch.int32, torch.int16),
                                               (torch.float16, torch.bool)])
def test_cuda_path_plans_every_dtype_on_the_cpu(rng, monkeypatch, mask_dtype, dtype):
    """The CUDA lines of reduce_mask, sparse_gather and sparse_scatter without a GPU: CPU tensors
    taken for CUDA ones (is_cuda, the TORCH backend's device and stream), compiled kernels named
    by their name expressions, launches recorded. Masks of bool and uint8 and data of any dtype
    (docs/blocks.md) plan their kernels from the TORCH backend's dtype names, as on a GPU."""
    from sbnet_cupy.blocks import reduce_mask as _reduce_mask
    from sbnet_cupy.blocks import sparse_gather as _gather, sparse_scatter as _scatter
    from sbnet_cupy.core import launch as _launch, plan as _plan
    from torch_bridge.backend import TORCH
    from torch_bridge.blocks import ops

    launched = []
    caches = (_reduce_mask._plan, _gather._gather_plan, _scatter._scatter_plan)
    for cache in caches:
        cache.cache_clear()
    monkeypatch.setattr(_plan.KernelPlan, "launch",
                        lambda plan, stream, *values, grid=None: launched.append(plan.name))
    monkeypatch.setattr(_launch, "function", lambda device, op, kernel, *args: kernel)
    monkeypatch.setattr(_reduce_mask, "shared_workspace", lambda device, stream, n: 4096)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(TORCH, "device", lambda t: 0)
    monkeypatch.setattr(TORCH, "stream", lambda device: 0)
    mask = torch.tensor(rng.random((1, 16, 16)) > 0.5).to(mask_dtype)
    x = torch.tensor(rng.integers(0, 2, (1, 16, 16, 4))).to(dtype)
    geometry = ((8, 8), (0, 0), (8, 8))
    try:
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        indices, counts = ops._reduce_mask_impl(mask, (2, 2), *geometry, 0.5, False, 4)
        ops._gather_impl(x, counts, indices, *geometry, False, None, None, False)
        ops._scatter_into(x.new_empty((4, 8, 8, 4)), counts, indices, x, *geometry, False,
                          False, False)
    finally:
        monkeypatch.undo()
        for cache in caches:
            cache.cache_clear()
    kernels = [name.split("<")[0] for name in launched]
    assert kernels == ["reduce_mask", "sparse_gather", "sparse_scatter"], launched
    ctype = sbnet_cupy.core.kernels.MASK_CTYPES[str(mask_dtype)[6:]]
    assert launched[0].startswith(f"reduce_mask<{ctype},"), launched
