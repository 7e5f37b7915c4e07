import csv
import itertools
import math
import pathlib

import numpy
import pytest

import sbnet_cupy
from sbnet_cupy import SparseKernel, pruned as skc
from sbnet_cupy.pruned.geometry import _padding
from sbnet_cupy.core import kernels as _kernels, launch as _launch, records as _records
from axes import random_array
from reference import zero_inserted_kernel
from conftest import cupy, require, requires_gpu, to_numpy

# The five sweeps, scaled down: (name, x shape, kernel shape), batch 1 and 3.
SWEEPS = [
    *[(f"k{k}", (1, 13, 21, 3), (k, k, 3, 8)) for k in (3, 5, 7, 9, 11)],
    *[(f"cin{c}", (1, 13, 21, c), (11, 11, c, 3)) for c in (1, 8, 33)],
    *[(f"cout{c}", (1, 13, 21, 3), (11, 11, 3, c)) for c in (1, 16, 65)],
    ("ratio", (1, 13, 21, 32), (11, 11, 32, 64)),
    *[(f"size{s}", (1, s, s, 3), (11, 11, 3, 64)) for s in (6, 37)],
    ("batch", (3, 13, 21, 3), (11, 11, 3, 16)),
]
# Every stride / padding / dilation combination: SAME, VALID and explicit (PyTorch-style)
# padding; unit, 2x2 and 1x3 strides; unit, 2x1 dilations.
STRIDES = [(1, 1), (2, 2), (1, 3)]
PADDINGS = ["SAME", "VALID", ((2, 1), (0, 3))]
DILATIONS = [(1, 1), (2, 1)]
COMBOS = list(itertools.product(STRIDES, PADDINGS, DILATIONS))
DENSITIES = ["zero", "one", 0.1, 1.0]
BENCH_CSV = (pathlib.Path(__file__).parent.parent.parent
             / "bench/results/sparse_kernel_conv_NVIDIA_H100_80GB_HBM3.csv")
PRECISION_DTYPES = {"tf32": "float32", "fp16": "float16"}
TOLERANCE = {numpy.float64: 1e-12, numpy.float32: 1e-5, numpy.float16: 2e-3, "bfloat16": 1.6e-2}


def pruned_weight(rng, shape, density, dtype=numpy.float32):
    """Random non-zero values on a random mask: 'zero' (no taps), 'one' (one tap) or a
    fraction of the entries."""
    w = random_array(rng, shape, dtype)
    if density == "zero":
        return numpy.zeros_like(w)
    if density == "one":
        keep = numpy.zeros(w.size, bool)
        keep[rng.integers(w.size)] = True
    else:
        keep = rng.random(w.size) < density
    return numpy.where(keep.reshape(shape), w, 0).astype(dtype)


def reference(x, w, strides, padding, dilations, bias=None):
    """The convolution from its definition, in float64: out[n, oy, ox, co] = bias[co] + sum
    over kh, kw, ci of x[n, oy*SH + kh*DH - pad_top, ox*SW + kw*DW - pad_left, ci] *
    w[kh, kw, ci, co], pixels outside x being zero. TensorFlow's SAME / VALID rules."""
    n, height, width, _ = x.shape
    k_h, k_w, _, cout = w.shape
    out, before = [], []
    for size, k, s, d, axis in zip((height, width), (k_h, k_w), strides, dilations, (0, 1)):
        extent = (k - 1) * d + 1
        if padding == "SAME":
            o = math.ceil(size / s)
            before.append(max((o - 1) * s + extent - size, 0) // 2)
        else:
            top, bottom = (0, 0) if padding == "VALID" else padding[axis]
            o = (size + top + bottom - extent) // s + 1
            before.append(top)
        out.append(o)
    y = numpy.zeros((n, *out, cout))
    for kh in range(k_h):
        for kw in range(k_w):
            rows = numpy.arange(out[0]) * strides[0] + kh * dilations[0] - before[0]
            cols = numpy.arange(out[1]) * strides[1] + kw * dilations[1] - before[1]
            inside = ((rows >= 0) & (rows < height))[:, None] & ((cols >= 0) & (cols < width))
            patch = x[:, rows.clip(0, height - 1)][:, :, cols.clip(0, width - 1)]
            patch = patch.astype(numpy.float64) * inside[None, :, :, None]
            y += patch @ w[kh, kw].astype(numpy.float64)
    return y if bias is None else y + bias.astype(numpy.float64)


def assert_close(got, expected, dtype, scale):
    """|got - expected| within the dtype's relative tolerance of `scale` (the sum of the
    products' magnitudes, so that rounding is judged against what was added up)."""
    tol = TOLERANCE[dtype]
    numpy.testing.assert_array_less(numpy.abs(to_numpy(got).astype(numpy.float64) - expected),
                                    tol * (scale + 1e-30) + 1e-30)


def _strategies(xp, compiled, dtype=numpy.float32, nnz=0):
    """Strategies to run: the rule (None) and, on CuPy, each one that applies; `compiled`: the
    compiled kernel applies to the geometry (unit vertical stride, no input dilation)."""
    if xp is numpy:
        return [None]
    compiled = compiled and nnz <= skc.COMPILED_MAX_TAPS
    return [None] + _emulated_strategies(compiled, numpy.dtype(dtype).name)


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("name, x_shape, w_shape", SWEEPS)
def test_sweep_shapes_match_reference(xp, rng, name, x_shape, w_shape, density):
    x = random_array(rng, x_shape, numpy.float32)
    w = pruned_weight(rng, w_shape, density)
    bias = random_array(rng, (w_shape[3],), numpy.float32)
    kernel = SparseKernel.from_dense(xp.asarray(w))
    expected = reference(x, w, (1, 1), "SAME", (1, 1), bias)
    scale = reference(numpy.abs(x), numpy.abs(w), (1, 1), "SAME", (1, 1), numpy.abs(bias))
    for strategy in _strategies(xp, True, nnz=kernel.nnz):
        out = sbnet_cupy.sparse_kernel_conv2d(xp.asarray(x), kernel, bias=xp.asarray(bias),
                                              strategy=strategy)
        assert out.shape == expected.shape and out.dtype == numpy.float32
        assert_close(out, expected, numpy.float32, scale)


@pytest.mark.parametrize("strides, padding, dilations", COMBOS)
def test_every_geometry_matches_reference(xp, rng, strides, padding, dilations):
    x = random_array(rng, (2, 11, 14, 5), numpy.float32)
    w = pruned_weight(rng, (3, 4, 5, 6), 0.3)
    kernel = SparseKernel.from_dense(xp.asarray(w))
    expected = reference(x, w, strides, padding, dilations)
    scale = reference(numpy.abs(x), numpy.abs(w), strides, padding, dilations)
    for strategy in _strategies(xp, strides[0] == 1):
        out = sbnet_cupy.sparse_kernel_conv2d(xp.asarray(x), kernel, strides=strides,
                                              padding=padding, dilations=dilations,
                                              strategy=strategy)
        assert_close(out, expected, numpy.float32, scale)


@pytest.mark.parametrize("strides, padding, dilations",
                         [c for c in COMBOS if not isinstance(c[1], tuple)])
def test_matches_tensorflow(rng, strides, padding, dilations):
    tf = require("tensorflow")
    x = random_array(rng, (2, 12, 17, 3), numpy.float32)
    w = pruned_weight(rng, (5, 3, 3, 7), 0.2)
    kernel = SparseKernel.from_dense(w)
    ours = sbnet_cupy.sparse_kernel_conv2d(x, kernel, strides=strides, padding=padding,
                                           dilations=dilations)
    if strides != (1, 1) and dilations != (1, 1):  # TensorFlow's CPU conv2d refuses both
        expected = reference(x, w, strides, padding, dilations)
    else:
        expected = tf.nn.conv2d(x, w, strides=strides, padding=padding,
                                dilations=dilations).numpy()
    numpy.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("strides, padding, dilations", COMBOS)
def test_gradients_match_reference(xp, rng, strides, padding, dilations):
    x = random_array(rng, (2, 9, 13, 4), numpy.float64)
    w = pruned_weight(rng, (3, 4, 4, 5), 0.3, numpy.float64)
    kernel = SparseKernel.from_dense(xp.asarray(w))
    kw = dict(strides=strides, padding=padding, dilations=dilations)
    dy = random_array(rng, reference(x, w, **kw).shape, numpy.float64)
    expected_dx, expected_dw = reference_gradients(x, w, dy, **kw)
    for strategy in _strategies(xp, strides == (1, 1), numpy.float64):
        dx = sbnet_cupy.sparse_kernel_conv2d_grad_input(xp.asarray(dy), kernel, x.shape,
                                                        strategy=strategy, **kw)
        numpy.testing.assert_allclose(to_numpy(dx), expected_dx, rtol=1e-12, atol=1e-12)
    dv = sbnet_cupy.sparse_kernel_conv2d_grad_values(xp.asarray(x), xp.asarray(dy), kernel, **kw)
    numpy.testing.assert_allclose(to_numpy(dv), expected_dw.reshape(-1)[to_numpy(kernel.positions)],
                                  rtol=1e-12, atol=1e-12)


def _geometry(in_hw, kernel_hw, strides, padding, dilations):
    """(out_hw, (pad_top, pad_left)) by sbnet_cupy's rules."""
    out_hw, pads = skc.conv_geometry(tuple(in_hw), tuple(kernel_hw), strides, padding, dilations)
    return out_hw, (pads[0][0], pads[1][0])


def reference_gradients(x, w, dy, strides, padding, dilations):
    """dx and dw (dense) of sum(dy * reference(x, w)), from the definition: every product
    x[n, y, x, ci] * w[kh, kw, ci, co] that reached out[n, oy, ox, co] sends dy there back."""
    out_hw, pads = _geometry(x.shape[1:3], w.shape[:2], strides, _padding(padding),
                                     dilations)
    dx, dw = numpy.zeros(x.shape), numpy.zeros(w.shape)
    for kh in range(w.shape[0]):
        for kw in range(w.shape[1]):
            rows = numpy.arange(out_hw[0]) * strides[0] + kh * dilations[0] - pads[0]
            cols = numpy.arange(out_hw[1]) * strides[1] + kw * dilations[1] - pads[1]
            for oy, y in enumerate(rows):
                for ox, c in enumerate(cols):
                    if 0 <= y < x.shape[1] and 0 <= c < x.shape[2]:
                        dx[:, y, c] += dy[:, oy, ox] @ w[kh, kw].T
                        dw[kh, kw] += x[:, y, c].T @ dy[:, oy, ox]
    return dx, dw


@pytest.mark.parametrize("strides, padding, dilations", [((1, 1), "SAME", (1, 1)),
                                                         ((2, 2), "VALID", (1, 1)),
                                                         ((1, 1), "SAME", (2, 1))])
def test_gradients_match_tensorflow(rng, strides, padding, dilations):
    tf = require("tensorflow")
    x = random_array(rng, (2, 10, 12, 3), numpy.float32)
    w = pruned_weight(rng, (3, 5, 3, 4), 0.3)
    kernel = SparseKernel.from_dense(w)
    kw = dict(strides=strides, padding=padding, dilations=dilations)
    xt, wt = tf.constant(x), tf.constant(w)
    with tf.GradientTape() as tape:
        tape.watch([xt, wt])
        y = tf.nn.conv2d(xt, zero_inserted_kernel(tf, wt, dilations), strides=strides,
                         padding=padding)
    dy = random_array(rng, tuple(y.shape), numpy.float32)
    dx_tf, dw_tf = tape.gradient(y, [xt, wt], output_gradients=tf.constant(dy))
    dx = sbnet_cupy.sparse_kernel_conv2d_grad_input(dy, kernel, x.shape, **kw)
    dv = sbnet_cupy.sparse_kernel_conv2d_grad_values(x, dy, kernel, **kw)
    numpy.testing.assert_allclose(dx, dx_tf.numpy(), rtol=1e-5, atol=1e-4)
    numpy.testing.assert_allclose(dv, dw_tf.numpy().reshape(-1)[kernel.positions], rtol=1e-5,
                                  atol=1e-4)


@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float64])
def test_other_dtypes(xp, rng, dtype):
    x = random_array(rng, (2, 13, 21, 3), dtype)
    w = pruned_weight(rng, (11, 11, 3, 16), 0.1, dtype)
    kernel = SparseKernel.from_dense(xp.asarray(w))
    expected = reference(x, w, (1, 1), "SAME", (1, 1))
    scale = reference(numpy.abs(x), numpy.abs(w), (1, 1), "SAME", (1, 1))
    for strategy in _strategies(xp, True, dtype):
        out = sbnet_cupy.sparse_kernel_conv2d(xp.asarray(x), kernel, strategy=strategy)
        assert out.dtype == dtype
        # One rounding of the float32 sum to the dtype, plus float32 rounding.
        assert_close(out, expected, dtype, scale)


@requires_gpu
def test_bfloat16(rng):
    x = random_array(rng, (2, 13, 21, 3), numpy.float32)
    w = pruned_weight(rng, (11, 11, 3, 16), 0.1)
    bits = lambda a: skc.float32_to_bfloat16_bits(cupy.asarray(a))
    # random_array values are exact in bfloat16.
    kernel = SparseKernel.from_dense(bits(w), dtype="bfloat16")
    expected = reference(x, w, (1, 1), "SAME", (1, 1))
    scale = reference(numpy.abs(x), numpy.abs(w), (1, 1), "SAME", (1, 1))
    for strategy in _strategies(cupy, True):
        out = sbnet_cupy.sparse_kernel_conv2d(bits(x), kernel, strategy=strategy)
        assert out.dtype == numpy.uint16
        got = (cupy.asnumpy(out).astype(numpy.uint32) << 16).view(numpy.float32)
        assert_close(got, expected, "bfloat16", scale)
    dy = random_array(rng, expected.shape, numpy.float32)
    dx = sbnet_cupy.sparse_kernel_conv2d_grad_input(bits(dy), kernel, x.shape)
    dv = sbnet_cupy.sparse_kernel_conv2d_grad_values(bits(x), bits(dy), kernel)
    as_float = lambda a: (cupy.asnumpy(a).astype(numpy.uint32) << 16).view(numpy.float32)
    exact = SparseKernel.from_dense(w)
    numpy.testing.assert_allclose(
        as_float(dx), sbnet_cupy.sparse_kernel_conv2d_grad_input(dy, exact, x.shape),
        rtol=1.6e-2, atol=1e-1)
    numpy.testing.assert_allclose(
        as_float(dv), sbnet_cupy.sparse_kernel_conv2d_grad_values(x, dy, exact),
        rtol=1.6e-2, atol=1)


# The compiled kernel's own cases: (x shape, w shape, density, strides, padding, dilations,
# dtype): a partial last group (Cout = 20, Q = 16), batch 2 with columns and rows past a CTA's
# tile, Q = 8 and Q = 4 groups, one tap, every tap, no taps, a chunked input with dilations, a
# horizontal stride with explicit padding.
COMPILED_CASES = [
    ((1, 13, 21, 3), (11, 11, 3, 20), 0.1, (1, 1), "SAME", (1, 1), numpy.float32),
    ((2, 37, 70, 3), (11, 11, 3, 64), 0.1, (1, 1), "SAME", (1, 1), numpy.float16),
    ((1, 9, 33, 5), (3, 3, 5, 7), "one", (1, 1), "VALID", (1, 1), "bfloat16"),
    ((1, 20, 40, 2), (5, 5, 2, 3), 1.0, (1, 1), "SAME", (1, 1), numpy.float32),
    ((2, 16, 35, 6), (3, 5, 6, 9), "zero", (1, 1), "SAME", (1, 1), numpy.float32),
    ((1, 30, 40, 40), (5, 3, 40, 19), 0.05, (1, 1), "SAME", (3, 2), numpy.float16),
    ((2, 19, 45, 4), (4, 3, 4, 10), 0.3, (1, 2), ((2, 1), (0, 3)), (1, 1), numpy.float32),
    ((1, 35, 70, 1), (1, 1, 1, 32), 0.6, (1, 1), "SAME", (1, 1), numpy.float32),
]


@requires_gpu
@pytest.mark.parametrize("case", COMPILED_CASES, ids=str)
def test_compiled_matches_reference(rng, case):
    """Forward (with bias) and, at unit strides, input gradient of the compiled kernel against
    the definition; float32 exactly (the test values make every sum exact), float16 and
    bfloat16 within one rounding."""
    _check_strategy(rng, case, "compiled")


# "direct" with its input channels split over CTAs (few tiles, several chunks of channels): a
# last split shorter than the others (27 = 8 + 8 + 8 + 3 channels), two groups of which the
# second is partial (Cout = 6), strides and VALID padding.
SPLIT_CASES = [
    ((1, 21, 45, 27), (11, 11, 27, 3), 0.1, (1, 1), "SAME", (1, 1), numpy.float32),
    ((2, 17, 33, 20), (5, 5, 20, 6), 0.3, (1, 1), "SAME", (1, 1), numpy.float16),
    ((1, 19, 40, 40), (3, 3, 40, 5), 0.5, (2, 1), "VALID", (1, 1), "bfloat16"),
]


@requires_gpu
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_direct_split_matches_reference(rng, case):
    """"direct" with split input channels (partial sums, then the split sum with the bias)
    against the definition, as test_compiled_matches_reference."""
    x_shape, w_shape, _, strides, padding, dilations, dtype = case
    out_hw, pads = _geometry(x_shape[1:3], w_shape[:2], strides, _padding(padding),
                             dilations)
    plan = skc.conv_plan("direct", "float32", x_shape[0], x_shape[1:3], w_shape[2], out_hw,
                         w_shape[3], w_shape[:2], strides, dilations, pads, (1, 1), 1,
                         info=_launch.H100)
    assert plan.split_sum is not None
    _check_strategy(rng, case, "direct")


def _check_strategy(rng, case, strategy):
    x_shape, w_shape, density, strides, padding, dilations, dtype = case
    x = random_array(rng, x_shape, numpy.float32)
    w = pruned_weight(rng, w_shape, density)
    bias = random_array(rng, (w_shape[3],), numpy.float32)
    if dtype == "bfloat16":
        device = lambda a: skc.float32_to_bfloat16_bits(cupy.asarray(a))
        host = lambda a: (cupy.asnumpy(a).astype(numpy.uint32) << 16).view(numpy.float32)
        kernel = SparseKernel.from_dense(device(w), dtype="bfloat16")
    else:
        device = lambda a: cupy.asarray(a.astype(dtype))
        host = lambda a: cupy.asnumpy(a).astype(numpy.float32)
        kernel = SparseKernel.from_dense(device(w))
    kw = dict(strides=strides, padding=padding, dilations=dilations)
    expected = reference(x, w, bias=bias, **kw)
    scale = reference(numpy.abs(x), numpy.abs(w), bias=numpy.abs(bias), **kw)
    out = device(numpy.full(expected.shape, numpy.nan, numpy.float32))  # poisoned
    sbnet_cupy.sparse_kernel_conv2d(device(x), kernel, bias=device(bias), out=out,
                                    strategy=strategy, **kw)
    assert_close(host(out), expected, dtype if dtype == "bfloat16" else numpy.dtype(dtype).type,
                 scale)
    if strides == (1, 1):
        dy = random_array(rng, expected.shape, numpy.float32)
        expected_dx, _ = reference_gradients(x, w, dy, **kw)
        scale_dx, _ = reference_gradients(numpy.abs(x), numpy.abs(w), numpy.abs(dy), **kw)
        dx = sbnet_cupy.sparse_kernel_conv2d_grad_input(device(dy), kernel, x_shape,
                                                        strategy=strategy, **kw)
        assert_close(host(dx), expected_dx, dtype if dtype == "bfloat16"
                     else numpy.dtype(dtype).type, scale_dx)


def test_from_dense(xp, rng):
    w = pruned_weight(rng, (3, 2, 4, 5), 0.3)
    w[0, 0, 0, 0] = -0.0  # a pruned tap too
    kernel = SparseKernel.from_dense(xp.asarray(w))
    mask = w != 0
    assert kernel.shape == w.shape and kernel.dtype == "float32"
    assert kernel.nnz == mask.sum() and kernel.density == pytest.approx(mask.mean())
    assert kernel.device == (None if xp is numpy else cupy.cuda.Device().id)
    # Canonical order: output channel, input channel, kh, kw.
    co, ci, kh, kw = numpy.nonzero(mask.transpose(3, 2, 0, 1))
    numpy.testing.assert_array_equal(to_numpy(kernel.values), w[kh, kw, ci, co])
    numpy.testing.assert_array_equal(to_numpy(kernel.positions),
                                     numpy.ravel_multi_index((kh, kw, ci, co), w.shape))
    numpy.testing.assert_array_equal(to_numpy(kernel.to_dense()), numpy.where(mask, w, 0))
    twice = kernel.with_values(kernel.values * 2)
    numpy.testing.assert_array_equal(to_numpy(twice.to_dense()), 2 * numpy.where(mask, w, 0))
    assert "nnz=" in repr(kernel)


def test_zero_sized(xp, rng):
    kernel = SparseKernel.from_dense(xp.asarray(pruned_weight(rng, (3, 3, 2, 4), 0.5)))
    out = sbnet_cupy.sparse_kernel_conv2d(xp.zeros((0, 5, 5, 2), xp.float32), kernel)
    assert out.shape == (0, 5, 5, 4)
    out = sbnet_cupy.sparse_kernel_conv2d(xp.zeros((1, 0, 5, 2), xp.float32), kernel)
    assert out.shape == (1, 0, 5, 4)


def test_out_argument(xp, rng):
    x = random_array(rng, (1, 8, 9, 2), numpy.float32)
    w = pruned_weight(rng, (3, 3, 2, 4), 0.5)
    kernel = SparseKernel.from_dense(xp.asarray(w))
    out = xp.full((1, 8, 9, 4), numpy.nan, xp.float32)
    assert sbnet_cupy.sparse_kernel_conv2d(xp.asarray(x), kernel, out=out) is out
    assert_close(out, reference(x, w, (1, 1), "SAME", (1, 1)), numpy.float32,
                 reference(numpy.abs(x), numpy.abs(w), (1, 1), "SAME", (1, 1)))
    with pytest.raises(ValueError, match=r"out must be a C-contiguous float32 \w+ array of "
                                         r"shape \(1, 8, 9, 4\)"):
        sbnet_cupy.sparse_kernel_conv2d(xp.asarray(x), kernel, out=out[..., :3])


@requires_gpu
@pytest.mark.parametrize("strategy", skc.STRATEGIES)
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16])
def test_out_one_element_into_its_allocation(rng, dtype, strategy):
    """The kernels store a pixel's channels 16 bytes at a time where `out` allows: an `out`
    that starts one element into its buffer gets scalar stores, and nothing outside it."""
    x = random_array(rng, (2, 9, 40, 3), numpy.float32)
    w = pruned_weight(rng, (3, 3, 3, 16), 0.3)
    bias = random_array(rng, (16,), numpy.float32)
    buffer = cupy.full(2 + x[..., :1].size * 16, numpy.nan, dtype)
    out = buffer[1:-1].reshape(2, 9, 40, 16)
    kernel = SparseKernel.from_dense(cupy.asarray(w.astype(dtype)))
    assert sbnet_cupy.sparse_kernel_conv2d(cupy.asarray(x.astype(dtype)), kernel, out=out,
                                           bias=cupy.asarray(bias.astype(dtype)),
                                           strategy=strategy) is out
    kw = dict(strides=(1, 1), padding="SAME", dilations=(1, 1))
    assert_close(out, reference(x, w, bias=bias, **kw), dtype,
                 reference(numpy.abs(x), numpy.abs(w), bias=numpy.abs(bias), **kw))
    assert numpy.isnan(to_numpy(buffer[[0, -1]])).all()


def test_bad_input(xp, rng):
    w = pruned_weight(rng, (3, 3, 2, 4), 0.5)
    kernel = SparseKernel.from_dense(xp.asarray(w))
    x = xp.ones((1, 6, 6, 2), xp.float32)
    conv = sbnet_cupy.sparse_kernel_conv2d
    with pytest.raises(ValueError, match=r"x has 3 channels but kernel expects 2"):
        conv(xp.ones((1, 6, 6, 3), xp.float32), kernel)
    with pytest.raises(ValueError, match=r"x must be 4-D"):
        conv(x[0], kernel)
    with pytest.raises(TypeError, match=r"kernel was converted for float32 \(float32\) but x is "
                                        r"float64"):
        conv(x.astype(xp.float64), kernel)
    with pytest.raises(TypeError, match="kernel must be a SparseKernel"):
        conv(x, xp.asarray(w))
    with pytest.raises(ValueError, match=r"strides must be two positive ints, got \(0, 1\)"):
        conv(x, kernel, strides=(0, 1))
    with pytest.raises(ValueError, match=r"strides must be two positive ints, got \(-1, -1\)"):
        conv(x, kernel, strides=-1)
    with pytest.raises(ValueError, match="dilations must be two positive ints"):
        conv(x, kernel, dilations=(1, 0))
    with pytest.raises(ValueError, match="kernel is larger than the padded input"):
        conv(xp.ones((1, 2, 6, 2), xp.float32), kernel, padding="VALID")
    with pytest.raises(ValueError, match="kernel is larger than the padded input"):
        conv(xp.ones((1, 6, 6, 2), xp.float32), kernel, padding="VALID", dilations=(3, 1))
    with pytest.raises(ValueError, match="padding must be"):
        conv(x, kernel, padding="FULL")
    with pytest.raises(ValueError, match="padding must be"):
        conv(x, kernel, padding=((1, -1), (0, 0)))
    with pytest.raises(ValueError, match=r"bias must be a float32 array of shape \(4,\)"):
        conv(x, kernel, bias=xp.ones(3, xp.float32))
    with pytest.raises(ValueError, match="strategy must be None or one of"):
        conv(x, kernel, strategy="fft")
    with pytest.raises(ValueError, match=r"w must be 4-D \[KH, KW, Cin, Cout\]"):
        SparseKernel.from_dense(xp.asarray(w[0]))
    with pytest.raises(TypeError, match="w must be float16, float32 or float64"):
        SparseKernel.from_dense(xp.asarray(w).astype(xp.int32))
    with pytest.raises(TypeError, match=r"dtype='bfloat16' needs w to hold bfloat16 patterns"):
        SparseKernel.from_dense(xp.asarray(w), dtype="bfloat16")
    with pytest.raises(ValueError, match=r"dy must have the forward output's shape \(1, 6, 6, 4\)"):
        sbnet_cupy.sparse_kernel_conv2d_grad_input(xp.ones((1, 5, 6, 4), xp.float32), kernel,
                                                   (1, 6, 6, 2))
    with pytest.raises(ValueError, match=r"input_shape must be \(N, H, W, Cin\)"):
        sbnet_cupy.sparse_kernel_conv2d_grad_input(xp.ones((1, 6, 6, 4), xp.float32), kernel,
                                                   (1, 6, 6, 3))
    with pytest.raises(ValueError, match=r"values must be a float32 array of shape"):
        kernel.with_values(kernel.values[:1])
    if xp is numpy:
        with pytest.raises(TypeError, match="bfloat16 needs CuPy arrays"):
            conv(x.astype(numpy.uint16), SparseKernel.from_dense(w.astype(numpy.uint16),
                                                                 dtype="bfloat16"))


@requires_gpu
def test_kernel_of_another_backend_or_device(rng):
    w = pruned_weight(rng, (3, 3, 2, 4), 0.5)
    host = SparseKernel.from_dense(w)
    with pytest.raises(TypeError, match="kernel was converted for numpy arrays but x is a cupy"):
        sbnet_cupy.sparse_kernel_conv2d(cupy.ones((1, 6, 6, 2), cupy.float32), host)
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cupy.cuda.Device(1):
        other = SparseKernel.from_dense(cupy.asarray(w))
    with pytest.raises(ValueError, match="kernel was converted on device 1 but x is on device 0"):
        sbnet_cupy.sparse_kernel_conv2d(cupy.ones((1, 6, 6, 2), cupy.float32), other)


def _rule(dtype, n, hw, k, cin, cout, nnz, strides=(1, 1), dilations=(1, 1),
          input_dilation=(1, 1)):
    """choose_strategy for a SAME convolution of an [n, *hw, cin] input by a kxk weight."""
    out_hw = tuple(-(-size // s) for size, s in zip(hw, strides))
    pads = tuple((k - 1) * d // 2 for d in dilations)
    return skc.choose_strategy(dtype, n, hw, cin, out_hw, cout, (k, k), strides, dilations, pads,
                               input_dilation, nnz, info=_launch.H100)


def test_rule():
    """Where "compiled" applies; where it does, "compiled" unless it takes two passes or more
    over the input channels with fewer CTAs than SMs (cases of the committed H100 run, the faster
    one of each in a comment, ms)."""
    most = skc.COMPILED_MAX_TAPS
    assert _rule("bfloat16", 1, (256, 512), 11, 32, 64, most) == "compiled"
    assert _rule("float32", 1, (256, 512), 11, 32, 64, most + 1) == "direct"
    assert _rule("float16", 1, (56, 56), 3, 4, 64, 100, strides=(1, 2)) == "compiled"
    assert _rule("float32", 1, (56, 56), 3, 3, 64, 100, strides=(2, 2)) == "direct"
    assert _rule("float64", 1, (56, 56), 3, 3, 64, 100) == "direct"
    assert _rule("float32", 1, (56, 56), 3, 3, 64, 100, input_dilation=(2, 2)) == "direct"
    assert _rule("float32", 1, (56, 56), 3, 3, 64, 100, dilations=(17, 1)) == "direct"  # 35 rows
    # One pass: 11x11x3x64 compiled 0.039 (direct 0.082), at batch 8 0.292 (0.588); 3x3x3x64
    # 0.019 (0.041), at batch 8 0.140 (0.430); 11x11x3x3 on one image (32 CTAs).
    assert _rule("float32", 1, (256, 512), 11, 3, 64, 2323) == "compiled"
    assert _rule("float32", 8, (256, 512), 11, 3, 64, 2323) == "compiled"
    assert _rule("float32", 8, (256, 512), 3, 3, 64, 173) == "compiled"
    assert _rule("float32", 1, (256, 512), 11, 3, 3, 109) == "compiled"
    # 11x11xCinx3 on one image, 32 CTAs ("direct" 64 tiles, its channels split): direct 0.023
    # (compiled 0.036) at Cin 8 fp16 (2 passes), 0.041 (0.085) at Cin 16 fp16, 0.128 (0.411)
    # at Cin 64.
    assert _rule("float16", 1, (256, 512), 11, 8, 3, 290) == "direct"
    assert _rule("float16", 1, (256, 512), 11, 16, 3, 581) == "direct"
    assert _rule("float32", 1, (256, 512), 11, 64, 3, 2323) == "direct"
    # The same at batch 8, 256 CTAs: compiled 0.061 (direct 0.110) at Cin 8, 0.110 (0.210) at
    # Cin 16 fp16, 0.367 (0.448) at Cin 32 fp16, 1.007 (1.023) at Cin 64 (22 passes over 256 MB).
    assert _rule("float32", 8, (256, 512), 11, 8, 3, 290) == "compiled"
    assert _rule("float16", 8, (256, 512), 11, 16, 3, 581) == "compiled"
    assert _rule("float16", 8, (256, 512), 11, 32, 3, 1162) == "compiled"
    assert _rule("float32", 8, (256, 512), 11, 64, 3, 2323) == "compiled"
    # 11x11x32x64 in 3 passes of 512 CTAs: at 1% (19 taps a channel a group) compiled 0.144
    # (direct 0.162) in fp16, at batch 8 1.085 (1.155); at 2% 0.164 (0.220).
    assert _rule("float16", 1, (256, 512), 11, 32, 64, 2478) == "compiled"
    assert _rule("float32", 8, (256, 512), 11, 32, 64, 2478) == "compiled"
    assert _rule("float16", 1, (256, 512), 11, 32, 64, 4956) == "compiled"
    assert _rule("float32", 8, (0, 512), 11, 64, 3, 2323) == "compiled"  # nothing to compute


def test_rule_matches_the_benchmark():
    """The rule on every case of the committed H100 run where both strategies were timed:
    within 10% or 5 us of the faster everywhere, 1% over all of them; and the run scored with
    it."""
    with open(BENCH_CSV) as f:
        rows = [row for row in csv.DictReader(f) if row["compiled_ms"]]
    assert len(rows) >= 92
    total = best_total = 0.0
    for row in rows:
        n, k, cin, cout, nnz = (int(row[key]) for key in ("batch", "k", "cin", "cout", "nnz"))
        hw = tuple(int(side) for side in row["size"].split("x"))
        strategy = _rule(PRECISION_DTYPES[row["precision"]], n, hw, k, cin, cout, nnz)
        times = {s: float(row[f"{s}_ms"]) for s in skc.STRATEGIES}
        best = min(times.values())
        assert times[strategy] <= max(1.1 * best, best + 0.005), (row, strategy)
        assert row["strategy"] == strategy, (
            "the committed run was scored with another rule: python -m bench.sparse_kernel_conv "
            "--rescore", row)
        total, best_total = total + times[strategy], best_total + best
    assert total <= 1.01 * best_total


def test_rule_falls_back_where_compiled_finds_no_room():
    """Chosen by the rule, "compiled" gives way to "direct" when its tile and values overflow
    shared memory (8192 taps: 32 KB of values; a tile 1032 columns wide, which "direct" has no
    room for either: its error is the one raised); asked for, it refuses."""
    args = ("float32", 1, (300, 300), 64, (300, 300), 64, (11, 11), (1, 1), (1, 100), (5, 500),
            (1, 1), 8192)
    with pytest.raises(ValueError, match=r"dilations \(1, 100\) with a 11x11 kernel need"):
        skc.conv_plan(None, *args, info=_launch.H100)
    with pytest.raises(ValueError, match="strategy 'compiled' needs an input tile"):
        skc.conv_plan("compiled", *args, info=_launch.H100)
    with pytest.raises(ValueError, match="at most 8192 non-zero taps"):
        skc.conv_plan("compiled", *args[:-1], 8193, info=_launch.H100)
    with pytest.raises(ValueError, match="needs a device or a DeviceInfo"):
        skc.conv_plan("compiled", *args)


# --- The CUDA kernels, transliterated -------------------------------------------------------
# No GPU runs here, so the launch plans and index arrays that CuPy calls hand to
# kernels/pruned/sparse_kernel_conv.cu are checked on the CPU by a line-by-line NumPy
# transliteration of the kernels (vectorised over lanes, rows and taps). Shared memory starts as NaN
# and every read is bounds-checked, so a word the kernels would read before staging it, or a tile
# too small for its plan, fails the comparison; so does an output the kernels would not write.

# The int fields of the records, whose values a plan's constants hold (the pointers come
# first).
CONV_FIELDS = _records.CONV_ARGS.names[_records.CONV_ARGS.names.index("n"):]
GRAD_FIELDS = _records.GRAD_VALUES_ARGS.names[_records.GRAD_VALUES_ARGS.names.index("n"):]


def _read(smem, index):
    assert index.size == 0 or index.min() >= 0 and index.max() < smem.size, \
        "shared-memory read out of bounds"
    return smem[index]


def _stage(smem, x, n, a, y0, x0, ci0, nci, idil=(1, 1)):
    rows, cols, pitch = a["tile_rows"], a["tile_cols"], a["pitch"]
    yv, xv = y0 + numpy.arange(rows), x0 + numpy.arange(cols)
    y_ok = (yv >= 0) & (yv % idil[0] == 0) & (yv // idil[0] < a["in_h"])
    x_ok = (xv >= 0) & (xv % idil[1] == 0) & (xv // idil[1] < a["in_w"])
    values = numpy.zeros((nci, cols, rows))
    picked = x[n][(yv[y_ok] // idil[0])[:, None], xv[x_ok] // idil[1], ci0:ci0 + nci]
    values[:, numpy.flatnonzero(x_ok)[:, None], numpy.flatnonzero(y_ok)] = picked.transpose(2, 1, 0)
    index = ((numpy.arange(nci)[:, None, None] * cols + numpy.arange(cols)[:, None]) * pitch
             + numpy.arange(rows))
    assert index.max() < smem.size, "tile larger than the plan's shared memory"
    smem[index] = values


def _store(out, acc, a, n, oy0, ox0, co0, q_per_warp, bias):
    """store_output: acc [warps_q, warps_y, Q, P, 32], each thread its own P rows x Q channels."""
    warps_q, warps_y, _, p_rows, _ = acc.shape
    for wq, wy, q, p in itertools.product(range(warps_q), range(warps_y), range(q_per_warp),
                                          range(p_rows)):
        oy, ox, co = oy0 + wy * p_rows + p, ox0 + numpy.arange(32), co0 + wq * q_per_warp + q
        if oy < a["out_h"] and co < a["cout"]:
            ok = ox < a["out_w"]
            out[n, oy, ox[ok], co] = acc[wq, wy, q, p, ok] + (0 if bias is None else bias[co])


def _store_staged(out, acc, a, n, oy0, ox0, co0, q_per_warp, bias, smem_bytes, itemsize):
    """store_output_staged: each warp's rows through its 32 x Q words of shared memory, rotated
    chunks (slot), read back by C lanes a pixel; store_output where 16-byte stores do not fit."""
    chunk_words = 16 // itemsize
    c_count = q_per_warp // chunk_words
    if co0 >= a["cout"]:
        return
    if a["cout"] % chunk_words or co0 + q_per_warp > a["cout"]:
        return _store(out, acc, a, n, oy0, ox0, co0, q_per_warp, bias)
    lanes = numpy.arange(32)

    def slot(pixel, c):
        return pixel * c_count + (c ^ (pixel // (8 // c_count) % c_count))

    _, warps_y, _, p_rows, _ = acc.shape
    assert warps_y * 32 * q_per_warp * itemsize <= smem_bytes, "output rows beyond shared memory"
    for wy, p in itertools.product(range(warps_y), range(p_rows)):
        oy = oy0 + wy * p_rows + p
        if oy >= a["out_h"]:
            continue
        staged = numpy.full((32 * c_count, chunk_words), numpy.nan)  # the warp's room, in chunks
        for c in range(c_count):
            channels = slice(c * chunk_words, (c + 1) * chunk_words)
            staged[slot(lanes, c)] = (acc[0, wy, channels, p].T
                                      + (0 if bias is None else bias[co0:][channels]))
        for i in range(c_count):
            pixel, c = i * (32 // c_count) + lanes // c_count, lanes % c_count
            ok = ox0 + pixel < a["out_w"]
            co = co0 + c[ok, None] * chunk_words + numpy.arange(chunk_words)
            out[n, oy, (ox0 + pixel[ok])[:, None], co] = _read(staged, slot(pixel[ok], c[ok]))


def launch_arrays(kernel, transposed, layout):
    """(ranges, taps, values) that launch_conv hands to the kernel of a plan's layout."""
    ranges, codes, order = kernel._taps.arrays(transposed, layout)
    return ranges, codes, kernel._launch_values(transposed, layout, order)


def emulate_conv(conv, x, out_shape, arrays, bias=None, program=None):
    """sparse_kernel_conv_direct, or _compiled running `program`, as
    kernels/pruned/sparse_kernel_conv.cu runs the ConvPlan `conv`."""
    plan = conv.kernel
    if conv.strategy == "compiled":
        return emulate_compiled(plan, program, x, out_shape, arrays[2], bias)
    a = dict(zip(CONV_FIELDS, plan.constants))
    ranges, taps, values = (to_numpy(v) for v in arrays)
    values = values.astype(numpy.float64)
    p_rows, q_per_warp = plan.template_args[1:3]
    out = numpy.full(out_shape, numpy.nan)
    smem = numpy.empty(plan.shared_mem // (8 if plan.template_args[0] == "double" else 4))
    lanes = numpy.arange(32)
    group_blocks = -(-a["groups"] // a["warps_q"])
    images = a["n"] * group_blocks
    splits = plan.grid[2] // images if images else 1
    assert splits == -(-a["cin"] // a["split_cin"]) or a["cin"] == 0
    assert (conv.split_sum is None) == (splits == 1)
    # Split channels: [split, n, out_h, out_w, padded channels] (float64 here: the emulation
    # checks indices and coverage, not float32 rounding).
    partial = numpy.full((splits, *out_shape[:3], a["groups"] * q_per_warp), numpy.nan)
    for bz, by, bx in itertools.product(*(range(g) for g in plan.grid[::-1])):
        split, z = divmod(bz, images)
        n, g0 = z // group_blocks, (z % group_blocks) * a["warps_q"]
        oy0, ox0 = by * a["warps_y"] * p_rows, bx * 32
        acc = numpy.zeros((a["warps_q"], a["warps_y"], q_per_warp, p_rows, 32))
        ci_end = min(a["cin"], (split + 1) * a["split_cin"])
        for ci0 in range(split * a["split_cin"], ci_end, a["chunk"]):
            nci = min(a["chunk"], ci_end - ci0)
            smem[:] = numpy.nan
            _stage(smem, x, n, a, oy0 * a["str_h"] - a["pad_h"], ox0 * a["str_w"] - a["pad_w"],
                   ci0, nci, (a["idil_h"], a["idil_w"]))
            for wq, wy in itertools.product(range(a["warps_q"]), range(a["warps_y"])):
                g = g0 + wq
                if g >= a["groups"]:
                    continue
                lane_base = lanes * a["str_w"] * a["pitch"] + wy * p_rows * a["str_h"]
                for q in range(q_per_warp):
                    co = g * q_per_warp + q
                    if co >= a["cout"]:
                        break
                    first = ranges[co * a["cin"] + ci0]
                    last = ranges[co * a["cin"] + ci0 + nci]
                    tap = taps[first:last]
                    src = ((((tap >> 16) - ci0) * a["tile_cols"] + (tap & 255) * a["dil_w"])
                           * a["pitch"] + ((tap >> 8) & 255) * a["dil_h"])
                    index = (src[:, None, None] + lane_base[:, None]
                             + numpy.arange(p_rows) * a["str_h"])  # [T, 32, P]
                    acc[wq, wy, q] += numpy.einsum("t,tlp->pl", values[first:last],
                                                   _read(smem, index))
        if splits > 1:
            _store_partial(partial[split], acc, a, n, oy0, ox0, g0)
        else:
            _store(out, acc, a, n, oy0, ox0, g0 * q_per_warp, q_per_warp,
                   None if bias is None else bias.astype(numpy.float64))
    if splits > 1:  # split_sum (kernels/core/common.cuh) with the plan's rows, cols and pitch
        rows, cols, pitch, summed, relu = conv.split_sum.constants
        assert conv.scratch == partial.size
        assert (rows, cols, pitch, summed, relu) == (out.size // a["cout"], a["cout"],
                                                     a["groups"] * q_per_warp, splits, 0)
        sums = partial.reshape(splits, rows, pitch)[:, :, :cols].sum(axis=0)
        out[...] = (sums if bias is None else sums + bias).reshape(out_shape)
    assert not numpy.isnan(out).any(), "outputs left unwritten"
    return out


def _store_partial(partial, acc, a, n, oy0, ox0, g0):
    """store_partial: each thread's P rows x its group's Q channels of the padded pixel, no bias."""
    warps_q, warps_y, q_per_warp, p_rows, _ = acc.shape
    for wq, wy, p in itertools.product(range(warps_q), range(warps_y), range(p_rows)):
        oy, ox, g = oy0 + wy * p_rows + p, ox0 + numpy.arange(32), g0 + wq
        if oy < a["out_h"] and g < a["groups"]:
            ok = ox < a["out_w"]
            group = slice(g * q_per_warp, (g + 1) * q_per_warp)
            partial[n, oy, ox[ok], group] = acc[wq, wy, :, p, ok]


def emulate_compiled(plan, program, x, out_shape, values, bias=None):
    """sparse_kernel_conv_compiled<T, Program> running `program` (its groups and columns, which
    the generated code spells out) as kernels/pruned/sparse_kernel_conv.cu runs `plan`."""
    a = dict(zip(CONV_FIELDS, plan.constants))
    p_rows, q_per_warp = program.p, program.q
    assert (a["warps_q"], plan.block[0]) == (1, 32 * a["warps_y"])
    assert a["tile_rows"] <= a["pitch"] and a["pitch"] % 8 == 4, "pitch: 16-byte loads, banks"
    values = to_numpy(values).astype(numpy.float64)
    itemsize = 4 if plan.template_args[0] == "float" else 2
    out = numpy.full(out_shape, numpy.nan)
    smem = numpy.empty(plan.shared_mem // 4)
    vals_at = a["chunk"] * a["tile_cols"] * a["pitch"]
    lanes = numpy.arange(32)
    assert plan.grid[2] == a["n"] and plan.grid[0] % a["groups"] == 0
    for bz, by, bx in itertools.product(*(range(g) for g in plan.grid[::-1])):
        g, n = bx % a["groups"], bz
        oy0, ox0 = by * a["warps_y"] * p_rows, bx // a["groups"] * 32
        y0, x0 = oy0 - a["pad_h"], ox0 * a["str_w"] - a["pad_w"]
        acc = numpy.zeros((1, a["warps_y"], q_per_warp, p_rows, 32))
        first, count, chunks = program.groups[g] if g < len(program.groups) else (0, 0, [])
        smem[:] = numpy.nan
        for c, (ci0, columns) in enumerate(chunks):
            if c == 0:  # frame.begin: the group's values, zeros to a multiple of 4
                padded = -(-count // 4) * 4
                assert vals_at + padded <= smem.size, "values beyond shared memory"
                smem[vals_at:vals_at + padded] = numpy.concatenate(
                    [values[first:first + count], numpy.zeros(padded - count)])
            smem[:vals_at] = numpy.nan
            _stage(smem, x, n, a, y0, x0, ci0, min(a["chunk"], a["cin"] - ci0))
            for wy in range(a["warps_y"]):
                s = lanes * a["str_w"] * a["pitch"] + wy * p_rows
                for column in columns:
                    window = {}
                    for i in column.quads:
                        start = s + column.offset + 4 * i
                        assert (start % 4 == 0).all(), "window loads must be 16-byte aligned"
                        assert (start + 4 <= vals_at).all(), "window load beyond the tile"
                        quad = _read(smem, start[:, None] + numpy.arange(4))  # [32, 4]
                        window.update({4 * i + e: quad[:, e] for e in range(4)})
                    for t, (q, row) in enumerate(column.taps, column.first):
                        v = _read(smem, numpy.array([vals_at + t]))[0]
                        for p in range(p_rows):
                            acc[0, wy, q, p] += v * window[row + p]  # KeyError: not loaded
        bias64 = None if bias is None else bias.astype(numpy.float64)
        if q_per_warp * itemsize >= 32:
            _store_staged(out, acc, a, n, oy0, ox0, g * q_per_warp, q_per_warp, bias64,
                          plan.shared_mem, itemsize)
        else:
            _store(out, acc, a, n, oy0, ox0, g * q_per_warp, q_per_warp, bias64)
    assert not numpy.isnan(out).any(), "outputs left unwritten"
    return out


def emulate_grad_values(plan, x, dy, ranges, taps, nnz):
    """sparse_kernel_conv_grad_values, as kernels/pruned/sparse_kernel_conv.cu runs `plan`."""
    a = dict(zip(GRAD_FIELDS, plan.constants))
    ranges, taps = to_numpy(ranges), to_numpy(taps)
    p_rows = plan.template_args[1]
    grad = numpy.zeros(nnz)
    smem = numpy.empty(plan.shared_mem // (8 if plan.template_args[0] == "double" else 4))
    dys_at = a["chunk"] * a["tile_cols"] * a["pitch"]
    co_blocks = -(-a["cout"] // a["co_chunk"])
    lanes = numpy.arange(32)
    for bz, by, bx in itertools.product(*(range(g) for g in plan.grid[::-1])):
        n, co0 = bz // co_blocks, (bz % co_blocks) * a["co_chunk"]
        nco = min(a["co_chunk"], a["cout"] - co0)
        oy0, ox0 = by * p_rows, bx * 32
        oy, ox = oy0 + numpy.arange(p_rows)[:, None], ox0 + lanes
        inside = (oy < a["out_h"]) & (ox < a["out_w"])
        d = numpy.zeros((nco, p_rows, 32))
        pixels = dy[n, oy.clip(max=a["out_h"] - 1), ox.clip(max=a["out_w"] - 1)]  # [P, 32, Cout]
        d[:, inside] = pixels[inside].T[co0:co0 + nco]
        assert dys_at + nco * p_rows * 32 <= smem.size, "dy tile beyond shared memory"
        for ci0 in range(0, a["cin"], a["chunk"]):
            nci = min(a["chunk"], a["cin"] - ci0)
            smem[:] = numpy.nan
            _stage(smem, x, n, a, oy0 * a["str_h"] - a["pad_h"], ox0 * a["str_w"] - a["pad_w"],
                   ci0, nci)
            for c in range(nco):
                co = co0 + c
                first, last = ranges[co * a["cin"] + ci0], ranges[co * a["cin"] + ci0 + nci]
                tap = taps[first:last]
                src = ((((tap >> 16) - ci0) * a["tile_cols"] + (tap & 255) * a["dil_w"])
                       * a["pitch"] + ((tap >> 8) & 255) * a["dil_h"])
                index = (src[:, None, None] + (lanes * a["str_w"] * a["pitch"])[None, :, None]
                         + numpy.arange(p_rows) * a["str_h"])  # [T, 32, P]
                grad[first:last] += numpy.einsum("pl,tlp->t", d[c], _read(smem, index))
    return grad


EMULATED = [s for s in SWEEPS if s[0] in ("k3", "k11", "cin1", "cin33", "cout65", "size37",
                                          "batch")]


def _emulated_strategies(compiled, dtype):
    return ["direct"] + (["compiled"] if compiled and dtype != "float64" else [])


def _emulate(kernel, strategy, transposed, x, out_shape, dtype, n, in_hw, cin, out_hw, cout,
             strides, dilations, pads, input_dilation=(1, 1), bias=None):
    """The plan of `strategy` and the emulated kernel's output."""
    plan = skc.conv_plan(strategy, dtype, n, in_hw, cin, out_hw, cout, kernel.shape[:2], strides,
                         dilations, pads, input_dilation, kernel.nnz, info=_launch.H100)
    assert plan.strategy == strategy
    program = None
    if strategy == "compiled":
        taps = kernel._taps.transposed()[0] if transposed else kernel._taps
        program = taps.program(plan.layout)
    return emulate_conv(plan, x, out_shape, launch_arrays(kernel, transposed, plan.layout), bias,
                        program)


@pytest.mark.version_free
@pytest.mark.parametrize("dtype", ["float32", "float16"])  # the plans' layouts (and stores) differ
@pytest.mark.parametrize("name, x_shape, w_shape", EMULATED)
def test_kernels_transliterated_on_sweep_shapes(rng, name, x_shape, w_shape, dtype):
    x = random_array(rng, x_shape, numpy.float32)
    w = pruned_weight(rng, w_shape, 0.1)
    bias = random_array(rng, (w_shape[3],), numpy.float32)
    kernel = SparseKernel.from_dense(w)
    expected = reference(x, w, (1, 1), "SAME", (1, 1), bias)
    out_hw, pads = _geometry(x_shape[1:3], w_shape[:2], (1, 1), "SAME", (1, 1))
    for strategy in _emulated_strategies(True, dtype):
        out = _emulate(kernel, strategy, False, x, expected.shape, dtype, x_shape[0],
                       x_shape[1:3], w_shape[2], out_hw, w_shape[3], (1, 1), (1, 1), pads,
                       bias=bias)
        numpy.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-9, err_msg=strategy)


@pytest.mark.version_free
@pytest.mark.parametrize("strides, padding, dilations", COMBOS)
def test_kernels_transliterated_on_every_geometry(rng, strides, padding, dilations):
    """Forward, input gradient (the transposed weight, zeros between dy's pixels) and values
    gradient, at every stride / padding / dilation, with a kernel taller than a quad of rows."""
    x = random_array(rng, (2, 19, 37, 5), numpy.float64)
    w = pruned_weight(rng, (9, 4, 5, 6), 0.3, numpy.float64)
    kernel = SparseKernel.from_dense(w)
    kw = dict(strides=strides, padding=padding, dilations=dilations)
    expected = reference(x, w, **kw)
    dy = random_array(rng, expected.shape, numpy.float64)
    expected_dx, expected_dw = reference_gradients(x, w, dy, **kw)
    out_hw, pads = _geometry(x.shape[1:3], w.shape[:2], strides, _padding(padding),
                             dilations)
    cin, cout = w.shape[2:]
    strides_t, pads_t, input_dilation = skc.transposed_geometry(w.shape, strides, dilations, pads)
    for strategy in _emulated_strategies(strides[0] == 1, "float32"):
        out = _emulate(kernel, strategy, False, x, expected.shape, "float32", 2, x.shape[1:3],
                       cin, out_hw, cout, strides, dilations, pads)
        numpy.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, err_msg=strategy)
    for strategy in _emulated_strategies(strides == (1, 1), "float32"):
        dx = _emulate(kernel, strategy, True, dy, x.shape, "float32", 2, out_hw, cout,
                      x.shape[1:3], cin, strides_t, dilations, pads_t, input_dilation)
        numpy.testing.assert_allclose(dx, expected_dx, rtol=1e-12, atol=1e-12, err_msg=strategy)
    plan = skc.grad_values_plan("float64", 2, x.shape[1:3], cin, out_hw, cout, w.shape[:2],
                                strides, dilations, pads)
    ranges, taps, _ = launch_arrays(kernel, False, None)
    dv = emulate_grad_values(plan, x, dy, ranges, taps, kernel.nnz)
    numpy.testing.assert_allclose(dv, expected_dw.reshape(-1)[kernel.positions], rtol=1e-12,
                                  atol=1e-12)


@pytest.mark.version_free
def test_kernels_transliterated_on_large_dilation(rng):
    """A kernel spanning several quads of rows, and a chunked input (more channels than a tile
    holds) whose first chunks have no taps for some groups."""
    x = random_array(rng, (1, 40, 33, 70), numpy.float32)
    w = pruned_weight(rng, (5, 3, 70, 19), 0.05)
    w[:, :, :20, :16] = 0  # group 0 (Q = 16) starts past the first chunk
    kernel = SparseKernel.from_dense(w)
    expected = reference(x, w, (1, 1), "SAME", (5, 2))
    out_hw, pads = _geometry(x.shape[1:3], w.shape[:2], (1, 1), "SAME", (5, 2))
    for strategy in ("compiled", "direct"):
        plan = skc.conv_plan(strategy, "float32", 1, x.shape[1:3], 70, out_hw, 19, w.shape[:2],
                             (1, 1), (5, 2), pads, (1, 1), kernel.nnz, info=_launch.H100)
        assert dict(zip(CONV_FIELDS, plan.kernel.constants))["chunk"] < 20
        out = _emulate(kernel, strategy, False, x, expected.shape, "float32", 1, x.shape[1:3], 70,
                       out_hw, 19, (1, 1), (5, 2), pads)
        numpy.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-9, err_msg=strategy)


@pytest.mark.version_free
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kernels_transliterated_where_the_outputs_need_more_room_than_the_tile(rng, dtype):
    """A 1x1 kernel on 1 channel: the tile is smaller than the rows that the compiled kernel's
    warps pass through shared memory on their way out."""
    x = random_array(rng, (1, 35, 70, 1), numpy.float32)
    w = pruned_weight(rng, (1, 1, 1, 32), 0.6)
    bias = random_array(rng, (32,), numpy.float32)
    kernel = SparseKernel.from_dense(w)
    expected = reference(x, w, (1, 1), "SAME", (1, 1), bias)
    plan = skc.conv_plan("compiled", dtype, 1, (35, 70), 1, (35, 70), 32, (1, 1), (1, 1), (1, 1),
                         (0, 0), (1, 1), kernel.nnz, info=_launch.H100)
    a = dict(zip(CONV_FIELDS, plan.kernel.constants))
    assert a["tile_cols"] * a["pitch"] * 4 < a["warps_y"] * 32 * 16 * numpy.dtype(dtype).itemsize
    out = _emulate(kernel, "compiled", False, x, expected.shape, dtype, 1, (35, 70), 1, (35, 70),
                   32, (1, 1), (1, 1), (0, 0), bias=bias)
    numpy.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.version_free
@pytest.mark.parametrize("density", ["zero", "one", 1.0])
def test_kernels_transliterated_on_edge_densities(rng, density):
    """No taps (the layouts hold only the end marker), one tap, every tap: forward and input
    gradient."""
    x = random_array(rng, (2, 17, 40, 6), numpy.float32)
    w = pruned_weight(rng, (5, 3, 6, 9), density)
    kernel = SparseKernel.from_dense(w)
    expected = reference(x, w, (1, 1), "SAME", (1, 1))
    dy = random_array(rng, expected.shape, numpy.float32)
    expected_dx, _ = reference_gradients(x, w, dy, (1, 1), "SAME", (1, 1))
    out_hw, pads = _geometry(x.shape[1:3], w.shape[:2], (1, 1), "SAME", (1, 1))
    strides_t, pads_t, input_dilation = skc.transposed_geometry(w.shape, (1, 1), (1, 1), pads)
    for strategy in _emulated_strategies(True, "float32"):
        out = _emulate(kernel, strategy, False, x, expected.shape, "float32", 2, x.shape[1:3], 6,
                       out_hw, 9, (1, 1), (1, 1), pads)
        numpy.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-9, err_msg=strategy)
        dx = _emulate(kernel, strategy, True, dy, x.shape, "float32", 2, out_hw, 9, x.shape[1:3],
                      6, strides_t, (1, 1), pads_t, input_dilation)
        numpy.testing.assert_allclose(dx, expected_dx, rtol=1e-9, atol=1e-9, err_msg=strategy)


@pytest.mark.version_free
@pytest.mark.parametrize("arch", ["80", "90"])
def test_compiled_programs_compile(rng, arch):
    """Generated Programs compile with NVRTC (no GPU needed): strides and dilations, a chunked
    input, a partial group, no taps, the transposed weight, every dtype it takes."""
    from test_kernels_compile import compile_with_nvrtc

    sources, names = [], []
    for shape, density, strides, dilations, dtype, transposed in [
            ((3, 4, 5, 17), 0.3, (1, 3), (2, 1), "float32", False),
            ((3, 4, 5, 6), 0.3, (1, 1), (2, 1), "float32", True),
            ((5, 3, 70, 19), 0.02, (1, 1), (5, 2), "float16", False),
            ((11, 11, 3, 20), 0.1, (1, 1), (1, 1), "bfloat16", False),
            ((3, 3, 4, 3), "zero", (1, 1), (1, 1), "float32", False)]:
        kernel = SparseKernel.from_dense(pruned_weight(rng, shape, density))
        cin, cout = shape[2:][::-1] if transposed else shape[2:]
        plan = skc.conv_plan("compiled", dtype, 1, (40, 50), cin, (40, 50), cout, shape[:2],
                             strides, dilations, (1, 1), (1, 1), kernel.nnz, info=_launch.H100)
        taps = kernel._taps.transposed()[0] if transposed else kernel._taps
        program = taps.program(plan.layout)
        sources.append(program.source)
        names.append(program.kernel_name(dtype))
    source = "\n".join([_kernels.kernel_source("sparse_kernel_conv"), *sources])
    # NVRTC 13.x's fast-compile mode did not finish these generated programs for sm_90 in
    # minutes (the library's own options take seconds), so they compile as the library does.
    cubin, mapping = compile_with_nvrtc(source, "sparse_kernel_conv.cu", names, arch, fast=False)
    assert len(cubin) > 0 and sorted(mapping) == sorted(names)
