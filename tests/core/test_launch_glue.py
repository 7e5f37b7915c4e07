"""The launch code written once for every backend (sbnet_cupy/pruned/sparse_kernel_conv.py's
launch_conv and launch_grad_values, sbnet_cupy/dilated/reshape_plan.py's launch_reshape): what
each launch hands the driver, by field name, without a GPU, on a backend of NumPy arrays and on
torch's (CPU tensors taken for a GPU's)."""

import functools

import numpy
import pytest

from sbnet_cupy import SparseKernel
from sbnet_cupy.core import backend as _backend, kernels as _kernels, launch as _launch
from sbnet_cupy.core import plan as _plan
from sbnet_cupy.core import records as _records
from sbnet_cupy.dilated import reshape_plan as _reshapes
from sbnet_cupy.dilated.space_to_batch import space_to_batch_reshape
from sbnet_cupy.pruned import plans as _plans, sparse_kernel_conv as _skc
import cuda_emulation

# Few SMs: a small convolution splits its input channels.
INFO = _launch.DeviceInfo(sms=4, shared_per_block_optin=_launch.H100.shared_per_block_optin,
                          shared_per_sm=_launch.H100.shared_per_sm, compute_capability=(9, 0))
STREAM = 7
GENERATED = 0x6000  # the address that generated_function gives the compiled kernels


class _Host(type(_backend.NUMPY)):
    """NumPy arrays taken for a GPU's: their addresses are what the launches pass."""

    name, gpu = "host", True

    def device(self, a):
        return 0

    def pointer(self, a):
        return 0 if a is None else a.ctypes.data

    def stream(self, device):
        return STREAM

    def float_scratch(self, device, n):
        scratch = numpy.empty(n, numpy.float32)
        return scratch.ctypes.data, scratch


HOST = _Host()


@pytest.fixture
def launches(monkeypatch):
    """Launches recorded as (kernel, grid, stream, {field name: value}); the compiled kernels
    named by their name expressions, the generated ones at GENERATED."""
    recorded = []

    def launch(plan, stream, *values, grid=None, function=None):
        values += plan.constants
        assert len(values) == len(plan.record.names)
        recorded.append((function or plan.function, tuple(grid or plan.grid), stream,
                         dict(zip(plan.record.names, values))))

    compiled = []
    monkeypatch.setattr(_plan.KernelPlan, "launch", launch)
    monkeypatch.setattr(_launch, "function", lambda device, op, kernel, *args:
                        f"{kernel}<{', '.join(map(str, args))}>")
    monkeypatch.setattr(_launch, "device_info", lambda device: INFO)
    monkeypatch.setattr(_launch, "driver", cuda_emulation._Driver())
    monkeypatch.setattr(_kernels, "generated_function",
                        lambda *args: compiled.append(args) or (GENERATED, None))
    # The taps are CuPy arrays on a GPU; here NumPy's.
    monkeypatch.setattr(_skc, "_cupy_pointer", HOST.pointer)
    caches = (_plans.conv_plan, _plans.grad_values_plan, _reshapes.reshape_plan)
    for cache in caches:
        cache.cache_clear()
    yield recorded
    for cache in caches:
        cache.cache_clear()


def _weight(rng, shape, density=0.3):
    w = rng.standard_normal(shape).astype(numpy.float32)
    w[rng.random(shape) > density] = 0
    return SparseKernel.from_dense(w)


def _fields(record, **values):
    return dict(zip(record.names, record.values(**values)))


def test_direct_conv_with_split_channels(rng, launches):
    """"direct" on one small image: the kernel leaves partial sums in the scratch, the split sum
    adds them and the bias into the output."""
    kernel = _weight(rng, (11, 11, 64, 8))
    x = rng.standard_normal((1, 8, 8, 64)).astype(numpy.float32)
    out, bias = numpy.empty((1, 8, 8, 8), numpy.float32), numpy.ones(8, numpy.float32)
    _skc.launch_conv(HOST, "float32", x, out, bias, kernel._taps, kernel._launch_values, False,
                     (1, 1), (1, 1), (5, 5), (1, 1), "direct")
    plan = _plans.conv_plan("direct", "float32", 1, (8, 8), 64, (8, 8), 8, (11, 11), (1, 1),
                            (1, 1), (5, 5), (1, 1), kernel.nnz, 0)
    (conv, conv_grid, stream, got), (split, _, split_stream, summed) = launches
    assert (conv, conv_grid, stream) == ("sparse_kernel_conv_direct<float, 8, 4>", plan.kernel.grid,
                                         STREAM)
    ranges, taps, _ = kernel._taps.arrays(False, None)
    assert got == dict(zip(_records.CONV_ARGS.names, (
        x.ctypes.data, out.ctypes.data, bias.ctypes.data, ranges.ctypes.data, taps.ctypes.data,
        kernel.values.ctypes.data, got["partial"], *plan.kernel.constants)))
    assert got["partial"] and got["split_cin"] < 64
    splits = -(-64 // got["split_cin"])
    assert plan.scratch == splits * 64 * 8
    assert (split, split_stream) == ("split_sum<float>", STREAM)
    assert summed == _fields(_records.SPLIT_SUM_ARGS, partial=got["partial"],
                             bias=bias.ctypes.data, out=out.ctypes.data, rows=64, cols=8,
                             pitch=8, splits=splits, relu=0)


def test_compiled_conv_runs_the_masks_kernel(rng, launches):
    """"compiled": the kernel generated for the weight's mask (compiled once), its values in
    the program's order; no bias; the input gradient's transposed weight has a kernel of its
    own."""
    kernel = _weight(rng, (3, 3, 4, 6))
    x = rng.standard_normal((2, 9, 40, 4)).astype(numpy.float32)
    out = numpy.empty((2, 9, 40, 6), numpy.float32)
    for _ in range(2):
        _skc.launch_conv(HOST, "float32", x, out, None, kernel._taps, kernel._launch_values,
                         False, (1, 1), (1, 1), (1, 1), (1, 1), "compiled")
    plan = _plans.conv_plan("compiled", "float32", 2, (9, 40), 4, (9, 40), 6, (3, 3), (1, 1),
                            (1, 1), (1, 1), (1, 1), kernel.nnz, 0)
    program = kernel._taps.program(plan.layout)
    values = kernel._launch_values(False, plan.layout, None)
    numpy.testing.assert_array_equal(values, kernel.values[program.order])
    for function, grid, _, got in launches:
        assert (function, grid) == (GENERATED, plan.kernel.grid)
        assert (got["x"], got["out"], got["bias"], got["ranges"], got["taps"], got["partial"]) \
            == (x.ctypes.data, out.ctypes.data, 0, 0, 0, 0)
        assert got["values"] == values.ctypes.data
    assert program.function("float32", 0) == GENERATED  # compiled on the first launch only
    dx = numpy.empty_like(x)
    strides_t, pads_t, input_dilation = _skc.transposed_geometry(kernel.shape, (1, 1), (1, 1),
                                                                 (1, 1))
    _skc.launch_conv(HOST, "float32", out, dx, None, kernel._taps, kernel._launch_values, True,
                     strides_t, (1, 1), pads_t, input_dilation, "compiled")
    assert launches[-1][3]["cin"] == 6 and launches[-1][3]["cout"] == 4


def test_grad_values_adds_into_zeros(rng, launches):
    kernel = _weight(rng, (3, 5, 4, 6))
    x = rng.standard_normal((2, 9, 10, 4)).astype(numpy.float64)
    dy = rng.standard_normal((2, 9, 10, 6))
    grad = _skc.launch_grad_values(HOST, "float64", x, dy, kernel._taps, (1, 1), (1, 1), (1, 2))
    assert grad.dtype == numpy.float64 and grad.shape == (kernel.nnz,) and not grad.any()
    plan = _plans.grad_values_plan("float64", 2, (9, 10), 4, (9, 10), 6, (3, 5), (1, 1), (1, 1),
                                   (1, 2), 0)
    ranges, taps, _ = kernel._taps.arrays(False, None)
    ((function, _, _, got),) = launches
    assert function == "sparse_kernel_conv_grad_values<double, 16>"
    assert got == dict(zip(_records.GRAD_VALUES_ARGS.names, (
        x.ctypes.data, dy.ctypes.data, ranges.ctypes.data, taps.ctypes.data, grad.ctypes.data,
        *plan.constants)))
    assert _skc.launch_grad_values(HOST, "float64", x[:0], dy[:0], kernel._taps, (1, 1), (1, 1),
                                   (1, 2)).shape == (kernel.nnz,)
    assert len(launches) == 1  # nothing to add up


@pytest.mark.parametrize("strategy", ["direct", "compiled"])
def test_torch_launches_as_cupy_does(rng, launches, monkeypatch, strategy):
    """torch_bridge's path into launch_conv (TORCH, the taps of `positions`, the values put in
    the launch's order per call) launches what sbnet_cupy's does, but for the addresses."""
    torch = pytest.importorskip("torch")
    from torch_bridge.backend import TORCH
    from torch_bridge.pruned import sparse_kernel_conv as bridge

    monkeypatch.setattr(TORCH, "stream", lambda device: STREAM)
    kernel = _weight(rng, (3, 3, 5, 7))
    x = rng.standard_normal((1, 6, 35, 5)).astype(numpy.float32)
    out = numpy.empty((1, 6, 35, 7), numpy.float32)
    _skc.launch_conv(HOST, "float32", x, out, None, kernel._taps, kernel._launch_values, False,
                     (1, 1), (1, 1), (1, 1), (1, 1), strategy)
    values = torch.from_numpy(kernel.values)
    positions = torch.from_numpy(kernel.positions)
    taps = bridge._taps(positions, kernel.shape)
    x_t = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)  # strided
    _skc.launch_conv(TORCH, "float32", x_t, torch.from_numpy(out), None, taps,
                     functools.partial(bridge._in_order, values, positions, kernel.shape), False,
                     (1, 1), (1, 1), (1, 1), (1, 1), strategy)
    (mine, grid, _, want), (theirs, torch_grid, _, got) = launches
    pointers = ("x", "out", "ranges", "taps", "values", "partial")
    assert (theirs, torch_grid) == (mine, grid)
    assert {k: v for k, v in got.items() if k not in pointers} == \
        {k: v for k, v in want.items() if k not in pointers}
    assert got["out"] == out.ctypes.data and got["x"] != x_t.data_ptr()  # a contiguous copy


@pytest.mark.parametrize("op", ["space_to_batch", "batch_to_space"])
def test_reshape_launch_passes_x_then_y(launches, op):
    g = space_to_batch_reshape((2, 5, 7, 3), (2, 3), ((1, 0), (1, 1)), "NHWC")
    x, y = numpy.zeros(g.x_shape, numpy.float32), numpy.zeros(g.y_shape, numpy.float32)
    src, dst = (x, y) if op == "space_to_batch" else (y, x)
    _reshapes.launch_reshape(HOST, op, src, dst, g)
    plan = _reshapes.reshape_plan(0, op, g, 4, 16)
    ((function, grid, stream, got),) = launches
    assert (function, grid, stream) == (plan.function, plan.grid, STREAM)
    assert got == dict(zip(plan.record.names, (x.ctypes.data, y.ctypes.data, *plan.constants)))
    empty = space_to_batch_reshape((0, 4, 4, 3), (2, 2), ((0, 0), (0, 0)), "NHWC")
    _reshapes.launch_reshape(HOST, op, numpy.zeros(0), numpy.zeros(0), empty)
    assert len(launches) == 1  # nothing to move
