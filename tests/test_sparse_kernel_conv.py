import itertools
import math

import numpy
import pytest

import sbnet_cupy
from sbnet_cupy import SparseKernel, sparse_kernel_conv as skc
from axes import random_array
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


def _strategies(xp, strides, dtype=numpy.float32):
    """Strategies the backend takes for this geometry: the rule (None) and, on CuPy, each one
    that applies."""
    if xp is numpy:
        return [None]
    window = strides[0] == 1 and dtype != numpy.float64
    return [None, "direct"] + (["taps", "patches"] if window else [])


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("name, x_shape, w_shape", SWEEPS)
def test_sweep_shapes_match_reference(xp, rng, name, x_shape, w_shape, density):
    x = random_array(rng, x_shape, numpy.float32)
    w = pruned_weight(rng, w_shape, density)
    bias = random_array(rng, (w_shape[3],), numpy.float32)
    kernel = SparseKernel.from_dense(xp.asarray(w))
    expected = reference(x, w, (1, 1), "SAME", (1, 1), bias)
    scale = reference(numpy.abs(x), numpy.abs(w), (1, 1), "SAME", (1, 1), numpy.abs(bias))
    for strategy in _strategies(xp, (1, 1)):
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
    for strategy in _strategies(xp, strides):
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
    for strategy in _strategies(xp, (1, 1) if strides == (1, 1) else strides, numpy.float64):
        dx = sbnet_cupy.sparse_kernel_conv2d_grad_input(xp.asarray(dy), kernel, x.shape,
                                                        strategy=strategy, **kw)
        numpy.testing.assert_allclose(to_numpy(dx), expected_dx, rtol=1e-12, atol=1e-12)
    dv = sbnet_cupy.sparse_kernel_conv2d_grad_values(xp.asarray(x), xp.asarray(dy), kernel, **kw)
    numpy.testing.assert_allclose(to_numpy(dv), expected_dw.reshape(-1)[to_numpy(kernel.positions)],
                                  rtol=1e-12, atol=1e-12)


def reference_gradients(x, w, dy, strides, padding, dilations):
    """dx and dw (dense) of sum(dy * reference(x, w)), from the definition: every product
    x[n, y, x, ci] * w[kh, kw, ci, co] that reached out[n, oy, ox, co] sends dy there back."""
    out_hw, pads = skc.conv_geometry(x.shape[1:3], w.shape[:2], strides, skc._padding(padding),
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
        y = tf.nn.conv2d(xt, wt, **kw)
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
    for strategy in _strategies(xp, (1, 1), dtype):
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
    for strategy in _strategies(cupy, (1, 1)):
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
    with pytest.raises(ValueError, match=r"out must be a C-contiguous float32 array of shape "
                                         r"\(1, 8, 9, 4\)"):
        sbnet_cupy.sparse_kernel_conv2d(xp.asarray(x), kernel, out=out[..., :3])


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


def test_rule():
    assert skc.choose_strategy("float32", 3, 64, (11, 11), (1, 1), (1, 1)) == "taps"
    assert skc.choose_strategy("float16", 64, 64, (3, 3), (1, 2), (1, 1)) == "patches"
    assert skc.choose_strategy("float32", 3, 64, (3, 3), (2, 2), (1, 1)) == "direct"
    assert skc.choose_strategy("float64", 3, 64, (3, 3), (1, 1), (1, 1)) == "direct"
    assert skc.choose_strategy("float32", 3, 64, (3, 3), (1, 1), (1, 1), (2, 2)) == "direct"
