"""The plan layer's rules and the backends (sbnet_cupy/core/plan.py, backend.py,
torch_bridge/backend.py), checked from their definitions."""

import numpy
import pytest

from sbnet_cupy.core import backend, plan, records
from conftest import requires_gpu


@pytest.mark.parametrize("tiles, parts, sms, want", [
    (0, 27, 132, 1),      # nothing to split
    (10, 1, 132, 1),      # one part: nothing to split
    (264, 27, 132, 1),    # the tiles alone give two CTAs an SM
    (263, 27, 132, 2),    # one short: two splits
    (10, 27, 132, 27),    # capped at one a part
    (33, 64, 132, 8),     # ceil(264 / 33)
    (33, 64, 78, 5),      # another GPU's SM count: ceil(156 / 33)
])
def test_reduction_splits(tiles, parts, sms, want):
    assert plan.reduction_splits(tiles, parts, sms) == want


@pytest.mark.parametrize("tiles, parts, sms, want", [
    (263, 27, 132, 1),    # one wave short of two CTAs an SM: not split
    (131, 27, 132, 2),
    (10, 27, 132, 26),    # floor(264 / 10)
    (10, 8, 132, 8),      # capped at one a part
    (300, 27, 132, 1),
])
def test_reduction_splits_rounded_down(tiles, parts, sms, want):
    assert plan.reduction_splits(tiles, parts, sms, round_up=False) == want


def test_plan_without_a_device():
    """A plan for tables and tests (no device): the name NVRTC and the profiler see, the launch
    shape as 3-tuples, the record's constants kept in order."""
    record = records.SPLIT_SUM_ARGS
    p = plan.KernelPlan(None, "common", "split_sum", ("float",), [4, 1, 1], (256, 1, 1), 0,
                        record, constants=[3])
    assert p.function is None
    assert p.name == "split_sum<float>"
    assert (p.grid, p.block, p.shared_mem, p.constants) == ((4, 1, 1), (256, 1, 1), 0, (3,))
    assert "split_sum<float>" in repr(p)


def test_split_sum_plan_without_a_device():
    """The split sum after a reduction cut in splits: a grid-stride loop over rows x cols (at
    least one CTA), the sizes as the plan's constants, in the record's order."""
    p = plan.split_sum_plan(None, "submanifold", "half_t", rows=1000, cols=24, pitch=32,
                            splits=3, dependent=True)
    assert p.name == "split_sum<half_t>" and p.dependent
    assert p.grid == (-(-1000 * 24 // p.block[0]), 1, 1)
    assert p.constants == (1000, 24, 32, 3)
    assert plan.split_sum_plan(None, "common", "float", 1, 1, 1, 2).grid == (1, 1, 1)


def test_numpy_backend():
    a = numpy.arange(12, dtype=numpy.float32).reshape(3, 4)[:, ::2]
    b = backend.NUMPY.contiguous(a)
    assert b.flags.c_contiguous and numpy.array_equal(a, b)
    e = backend.NUMPY.empty((2, 5), a, "float16")
    assert (e.shape, e.dtype) == ((2, 5), numpy.float16)
    assert backend.NUMPY.empty((1,), a).dtype == numpy.float32
    assert backend.NUMPY.dtype_name(e) == "float16" and backend.NUMPY.host(a) is a
    z = backend.NUMPY.zeros((3,), a, "float64")
    assert z.dtype == numpy.float64 and not z.any() and backend.NUMPY.itemsize(z) == 8
    p = backend.NUMPY.padded(a, 5)
    assert p.shape == (3, 5) and numpy.array_equal(p[:, :2], a) and not p[:, 2:].any()
    assert not backend.NUMPY.gpu
    assert backend.backend_of(a) is backend.NUMPY


@requires_gpu
def test_cupy_backend():
    import cupy

    a = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)[:, ::2]
    b = backend.CUPY.contiguous(a)
    assert b.flags.c_contiguous and bool((a == b).all())
    c = cupy.zeros(3)
    assert backend.CUPY.contiguous(c) is c
    assert backend.CUPY.pointer(c) == c.data.ptr and backend.CUPY.pointer(None) == 0
    assert backend.CUPY.device(c) == c.data.device_id
    assert backend.CUPY.stream(0) == cupy.cuda.get_current_stream().ptr
    address, owner = backend.CUPY.float_scratch(0, 7)
    assert owner.size == 7 and owner.dtype == cupy.float32 and address == owner.data.ptr
    assert backend.backend_of(c) is backend.CUPY
    assert backend.CUPY.dtype_name(c) == "float64"
    numpy.testing.assert_array_equal(backend.CUPY.host(c), numpy.zeros(3))


def test_torch_backend_on_the_host():
    """What the TORCH backend answers of any tensor: NumPy's dtype names, a NumPy copy."""
    torch = pytest.importorskip("torch")
    from torch_bridge.backend import TORCH

    for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64"):
        assert TORCH.dtype_name(torch.zeros(1, dtype=getattr(torch, name))) == name
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    numpy.testing.assert_array_equal(TORCH.host(t), numpy.arange(6).reshape(2, 3))


@requires_gpu
def test_torch_backend():
    torch = pytest.importorskip("torch")
    from torch_bridge.backend import TORCH

    t = torch.arange(12.0, device="cuda").reshape(3, 4).t()
    c = TORCH.contiguous(t)
    assert c.is_contiguous() and torch.equal(c, t)
    assert TORCH.pointer(c) == c.data_ptr() and TORCH.pointer(None) == 0
    assert TORCH.device(c) == torch.cuda.current_device()
    assert TORCH.stream(TORCH.device(c)) == torch.cuda.current_stream().cuda_stream
    p = TORCH.padded(c, 7)
    assert p.shape == (4, 7) and torch.equal(p[:, :3], c) and not p[:, 3:].any()
    e = TORCH.empty((2, 2), c, "float16")
    assert e.dtype == torch.float16 and e.device == c.device
    address, owner = TORCH.float_scratch(TORCH.device(c), 5)
    assert owner.numel() == 5 and owner.dtype == torch.float32 and address == owner.data_ptr()
