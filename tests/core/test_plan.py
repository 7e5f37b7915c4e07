"""The plan layer's rules and the backends (sbnet_cupy/core/plan.py, backend.py,
torch_bridge/backend.py), checked from their definitions."""

import inspect
import pathlib
import types

import numpy
import pytest

from sbnet_cupy.core import backend, launch as _launch, plan, records
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
    least one CTA), the sizes as the plan's constants, in the record's order, or each call's."""
    p = plan.split_sum_plan(None, "submanifold", "half_t", rows=1000, cols=24, pitch=32,
                            splits=3, dependent=True)
    assert p.name == "split_sum<half_t>" and p.dependent
    assert p.grid == (-(-1000 * 24 // p.block[0]), 1, 1)
    assert p.constants == (1000, 24, 32, 3, 0)
    relu = plan.split_sum_plan(None, "submanifold", "half_t", 1000, 24, 32, 3, relu=True)
    assert relu.constants == (1000, 24, 32, 3, 1)
    assert plan.split_sum_plan(None, "common", "float", 1, 1, 1, 2).grid == (1, 1, 1)
    # Sizes left None are each call's, with its grid (the submanifold layer's changing sites).
    per_call = plan.split_sum_plan(None, "submanifold", "half_t", relu=True)
    assert (per_call.grid, per_call.constants) == ((1, 1, 1), (1,))
    assert plan.split_sum_grid(1000, 24) == p.grid and plan.split_sum_grid(1, 1) == (1, 1, 1)


class _Driver:
    """The driver calls a launch makes, recorded: the plain launch, with the frame that made
    it (frames[i]: inspect's FrameInfo of the caller)."""

    CUDADriverError = RuntimeError

    def __init__(self):
        self.calls, self.frames = [], []

    def launchKernel(self, *args):
        self.calls.append(("plain", args))
        self.frames.append(inspect.stack(0)[1])


class _Runtime:
    """A host whose current device is `current`; setDevice calls recorded."""

    def __init__(self, current):
        self.current, self.set = current, []

    def getDevice(self):
        return self.current

    def setDevice(self, device):
        self.set.append(device)


@pytest.fixture
def driver(monkeypatch):
    """KernelPlan.launch's driver calls recorded, on a host of two devices (0 current), 0 of
    compute capability 9.0 and 1 before it; compiled kernels at 0x10."""
    fake = _Driver()
    ex_calls = []

    def launch_ex(config, kernel, params, extra):
        ex_calls.append((config, kernel, params, extra))
        fake.frames.append(inspect.stack(0)[1])
        return 0

    monkeypatch.setattr(_launch, "driver", fake)
    monkeypatch.setattr(_launch, "runtime", _Runtime(0))
    monkeypatch.setattr(_launch, "function", lambda *args: 0x10)
    monkeypatch.setattr(_launch, "_dependent", {0: launch_ex, 1: None})
    monkeypatch.setattr(_launch, "DEPENDENT_LAUNCH", True)
    monkeypatch.setattr(_launch.thread_state, "devices", set())  # no real context made current
    fake.ex_calls = ex_calls
    return fake


def _split_sum(device, dependent):
    return plan.KernelPlan(device, "common", "split_sum", ("float",), (5, 6, 7), (128, 1, 2),
                           4096, records.SPLIT_SUM_ARGS, (7, 5, 8, 3, 0), dependent)


def test_a_dependent_launch_fills_the_config_of_cuLaunchKernelEx(driver):
    """A dependent plan on a stream of a device that takes them: cuLaunchKernelEx with this
    thread's config (the programmatic stream serialization attribute, the launch's shape and
    stream) and argument buffer, packed with the values and the plan's constants."""
    state = _launch.thread_state
    _split_sum(0, True).launch(0xabc, 100, 200, 300)
    (config, kernel, params, extra), = driver.ex_calls
    assert (kernel, params, extra, driver.calls) == (0x10, state.kernel_params, None, [])
    assert config is state.config_ref
    c = state.config
    assert (tuple(c.grid), tuple(c.block), c.shared_mem, c.stream) == ((5, 6, 7), (128, 1, 2),
                                                                         4096, 0xabc)
    assert c.num_attrs == 1 and (c.attrs[0].id, c.attrs[0].value) == (6, 1)
    packed = records.SPLIT_SUM_ARGS.pack(100, 200, 300, 7, 5, 8, 3, 0)
    assert state.arguments.tobytes()[:len(packed)] == packed


@pytest.mark.parametrize("device, stream, dependent, enabled", [
    (0, 0, True, True),         # the legacy default stream
    (0, 0xabc, False, True),    # not a dependent plan
    (0, 0xabc, True, False),    # DEPENDENT_LAUNCH off
    (1, 0xabc, True, True),     # a device that takes none
])
def test_other_launches_are_plain(driver, monkeypatch, device, stream, dependent, enabled):
    monkeypatch.setattr(_launch, "DEPENDENT_LAUNCH", enabled)
    _split_sum(device, dependent).launch(stream, 100, 200, 300, grid=(9, 1, 1))
    assert driver.calls == [("plain", (0x10, 9, 1, 1, 128, 1, 2, 4096, stream,
                                       _launch.thread_state.kernel_params, 0))]
    assert not driver.ex_calls


def test_a_launch_on_another_device_makes_it_current_and_back(driver, monkeypatch):
    """The first launch of a thread on a device, or one on a device other than the current:
    its context made current for the launch, the current device restored after."""
    p = _split_sum(1, False)
    p.launch(0, 1, 2, 3)
    assert _launch.runtime.set == [1, 0]
    _launch.runtime.current = 1
    p.launch(0, 1, 2, 3)  # now current, and launched on before
    assert _launch.runtime.set == [1, 0]
    assert len(driver.calls) == 2


@pytest.mark.parametrize("dependent", [False, True])
def test_the_driver_is_called_from_the_plans_launch(driver, dependent):
    """Issue 35's four frames: KernelPlan.launch packs the record and calls the driver itself
    (plain or dependent), no frame of sbnet_cupy between them."""
    _split_sum(0, dependent).launch(0xabc, 1, 2, 3)
    frame, = driver.frames
    assert (pathlib.Path(frame.filename), frame.function) == (pathlib.Path(plan.__file__),
                                                              "launch")


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
    """What the TORCH backend answers of any tensor: NumPy's dtype names (of every dtype: the
    blocks family takes bool and uint8 masks and moves any data), a NumPy copy."""
    torch = pytest.importorskip("torch")
    from sbnet_cupy.core import checks
    from torch_bridge.backend import TORCH

    for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64", "bool", "uint8",
                 "int8", "int16", "complex64"):
        assert TORCH.dtype_name(torch.zeros(1, dtype=getattr(torch, name))) == name
    for dtype in (d for d in vars(torch).values() if isinstance(d, torch.dtype)):
        # A stand-in with the dtype: some dtypes' tensors warn when made.
        assert TORCH.dtype_name(types.SimpleNamespace(dtype=dtype)) == checks.name_of(dtype)
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
