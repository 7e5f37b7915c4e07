import itertools
import math

import numpy
import pytest

import sbnet_cupy
from sbnet_cupy.dilated.reshape_plan import _divisor, reshape_plan
from sbnet_cupy.dilated.space_to_batch import (dilated_conv_geometry, same_padding,
                                               space_to_batch_reshape)
from axes import MOVE_DTYPES, random_array
from conftest import cupy, require, requires_gpu, to_numpy
import reference

# name: (N, C, H, W), block, paddings
RESHAPES = {
    "block-1-padded": ((2, 3, 5, 7), 1, ((1, 0), (0, 2))),
    "block-2-exact": ((2, 4, 8, 6), 2, ((0, 0), (0, 0))),
    "non-square-padded": ((3, 3, 7, 5), (2, 3), ((1, 0), (2, 2))),
    "rate-5-odd-sizes": ((1, 5, 9, 11), 5, ((3, 3), (2, 2))),
    "block-larger-than-image": ((2, 2, 3, 2), 4, ((1, 0), (0, 2))),
    "wide-rows-odd-channels": ((1, 3, 4, 67), 3, ((1, 1), (2, 3))),
}
DTYPES = MOVE_DTYPES + (numpy.uint16, numpy.complex128)
FORMATS = ("NHWC", "NCHW")


def _shape(dims, data_format):
    n, c, h, w = dims
    return (n, h, w, c) if data_format == "NHWC" else (n, c, h, w)


def _pair(block):
    return (block, block) if isinstance(block, int) else block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("name", RESHAPES)
def test_space_to_batch_matches_reference(xp, rng, name, data_format, dtype):
    dims, block, paddings = RESHAPES[name]
    x = random_array(rng, _shape(dims, data_format), dtype)
    out = sbnet_cupy.space_to_batch(xp.asarray(x), block, paddings, data_format=data_format)
    expected = reference.space_to_batch(x, _pair(block), paddings, data_format == "NCHW")
    assert out.dtype == x.dtype and out.shape == expected.shape
    numpy.testing.assert_array_equal(to_numpy(out), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("name", RESHAPES)
def test_batch_to_space_matches_reference(xp, rng, name, data_format, dtype):
    dims, block, crops = RESHAPES[name]
    (bh, bw), ((top, bottom), (left, right)) = _pair(block), crops
    n, c, h, w = dims
    y_dims = (bh * bw * n, c, (h + top + bottom) // bh, (w + left + right) // bw)
    y = random_array(rng, _shape(y_dims, data_format), dtype)
    out = sbnet_cupy.batch_to_space(xp.asarray(y), block, crops, data_format=data_format)
    expected = reference.batch_to_space(y, (bh, bw), crops, data_format == "NCHW")
    assert out.dtype == y.dtype and out.shape == _shape(dims, data_format)
    numpy.testing.assert_array_equal(to_numpy(out), expected)


@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("name", RESHAPES)
def test_round_trip_is_identity(xp, rng, name, data_format):
    dims, block, paddings = RESHAPES[name]
    x = xp.asarray(random_array(rng, _shape(dims, data_format), numpy.float32))
    y = sbnet_cupy.space_to_batch(x, block, paddings, data_format=data_format)
    back = sbnet_cupy.batch_to_space(y, block, paddings, data_format=data_format)
    numpy.testing.assert_array_equal(to_numpy(back), to_numpy(x))


@pytest.mark.parametrize("block", [1, 2, 3, 4, 5, (2, 5)])
@pytest.mark.parametrize("size", [(6, 10), (7, 9)])
def test_matches_tensorflow(xp, rng, size, block):
    """tf.space_to_batch / tf.batch_to_space on CPU, NHWC, sizes padded up to the block; the NCHW
    form is the same op on transposed tensors."""
    tf = require("tensorflow")
    (bh, bw), (h, w) = _pair(block), size
    paddings = ((1, (-h - 1) % bh), (2, (-w - 2) % bw))
    x = random_array(rng, (3, h, w, 5), numpy.float32)
    expected = tf.space_to_batch(x, [bh, bw], paddings).numpy()
    y = sbnet_cupy.space_to_batch(xp.asarray(x), block, paddings)
    numpy.testing.assert_array_equal(to_numpy(y), expected)
    y_nchw = sbnet_cupy.space_to_batch(xp.asarray(x.transpose(0, 3, 1, 2)), block, paddings,
                                       data_format="NCHW")
    numpy.testing.assert_array_equal(to_numpy(y_nchw), expected.transpose(0, 3, 1, 2))

    crops = ((0, 1), (1, 0)) if bh * bw > 1 else ((0, 0), (0, 0))
    expected = tf.batch_to_space(expected, [bh, bw], crops).numpy()
    numpy.testing.assert_array_equal(to_numpy(sbnet_cupy.batch_to_space(y, block, crops)),
                                     expected)
    out = sbnet_cupy.batch_to_space(y_nchw, block, crops, data_format="NCHW")
    numpy.testing.assert_array_equal(to_numpy(out), expected.transpose(0, 3, 1, 2))


@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize("name", RESHAPES)
def test_batch_format_nhwc_moves_channels_last(xp, rng, name, dtype):
    """data_format NCHW with batch_format NHWC: the NCHW result, its channels last."""
    dims, block, paddings = RESHAPES[name]
    x = random_array(rng, dims, dtype)
    y = sbnet_cupy.space_to_batch(xp.asarray(x), block, paddings, data_format="NCHW",
                                  batch_format="NHWC")
    expected = reference.space_to_batch(x, _pair(block), paddings, True).transpose(0, 2, 3, 1)
    assert y.shape == expected.shape and y.flags.c_contiguous
    numpy.testing.assert_array_equal(to_numpy(y), expected)
    back = sbnet_cupy.batch_to_space(y, block, paddings, data_format="NCHW", batch_format="NHWC")
    assert back.shape == x.shape
    numpy.testing.assert_array_equal(to_numpy(back), x)


def test_batch_format_checks(xp):
    x = xp.ones((2, 3, 8, 6), xp.float32)
    with pytest.raises(ValueError, match="batch_format must be None, data_format"):
        sbnet_cupy.space_to_batch(x, 2, data_format="NHWC", batch_format="NCHW")
    with pytest.raises(ValueError, match="batch_format must be None, data_format"):
        sbnet_cupy.batch_to_space(x, 1, batch_format="CHWN")
    y = sbnet_cupy.space_to_batch(x, 2, data_format="NCHW", batch_format="NCHW")
    assert y.shape == (8, 3, 4, 3)


@pytest.mark.parametrize("data_format", FORMATS)
def test_out_and_non_contiguous_input(xp, rng, data_format):
    base = random_array(rng, (2, 9, 12, 6), numpy.float32)
    x = xp.asarray(base)[:, :, ::2, 1:4]  # strided in both inner axes
    paddings = ((1, 2), (0, 0)) if data_format == "NHWC" else ((1, 1), (0, 1))
    expected = reference.space_to_batch(numpy.ascontiguousarray(base[:, :, ::2, 1:4]), (2, 2),
                                        paddings, data_format == "NCHW")
    out = xp.empty(expected.shape, xp.float32)
    y = sbnet_cupy.space_to_batch(x, 2, paddings, data_format=data_format, out=out)
    assert y is out
    numpy.testing.assert_array_equal(to_numpy(out), expected)
    back = xp.empty_like(x)
    assert sbnet_cupy.batch_to_space(y[:, :], 2, paddings, data_format=data_format,
                                     out=back) is back
    numpy.testing.assert_array_equal(to_numpy(back), to_numpy(x))


@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("dims, block, paddings, y_dims", [
    ((0, 3, 4, 4), 2, 0, (0, 3, 2, 2)),
    ((2, 0, 4, 4), 2, 0, (8, 0, 2, 2)),
    ((2, 3, 0, 4), 2, ((1, 1), (0, 0)), (8, 3, 1, 2)),  # only padding
    ((2, 3, 4, 4), 2, ((0, 0), (0, 0)), (8, 3, 2, 2)),
])
def test_empty_inputs(xp, data_format, dims, block, paddings, y_dims):
    x = xp.ones(_shape(dims, data_format), xp.float32)
    y = sbnet_cupy.space_to_batch(x, block, paddings, data_format=data_format)
    assert y.shape == _shape(y_dims, data_format)
    assert float(y.sum()) == x.size  # every element written, the padding as zeros
    back = sbnet_cupy.batch_to_space(y, block, paddings, data_format=data_format)
    assert back.shape == x.shape
    everything = ((block * y_dims[2], 0), (0, 0))
    nothing = sbnet_cupy.batch_to_space(y, block, everything, data_format=data_format)
    assert nothing.shape == _shape((dims[0], dims[1], 0, dims[3]), data_format)


@pytest.mark.parametrize("call, error, match", [
    (lambda x: sbnet_cupy.space_to_batch(x, 0), ValueError,
     r"block must be two positive ints, got \(0, 0\)"),
    (lambda x: sbnet_cupy.space_to_batch(x, (1, 2, 3)), TypeError, "block must be an int or"),
    (lambda x: sbnet_cupy.space_to_batch(x, 3), ValueError,
     r"paddings \(\(0, 0\), \(0, 0\)\) make the padded image 8x6, not a multiple of block"),
    (lambda x: sbnet_cupy.space_to_batch(x, 2, -1), ValueError, "paddings must be >= 0"),
    (lambda x: sbnet_cupy.space_to_batch(x, 2, ((1, 1), 2)), TypeError,
     r"paddings must be an int or \[\[top, bottom\], \[left, right\]\] ints"),
    (lambda x: sbnet_cupy.space_to_batch(x, 2, data_format="CHWN"), ValueError,
     "data_format must be 'NHWC' or 'NCHW', got 'CHWN'"),
    (lambda x: sbnet_cupy.space_to_batch(x[0], 2), ValueError,
     r"x must be 4-D \[N, H, W, C\], got shape \(8, 6, 3\)"),
    (lambda x: sbnet_cupy.space_to_batch(x, 2, out=x), ValueError,
     r"out must be a C-contiguous float32 array of shape \(8, 4, 3, 3\)"),
    (lambda x: sbnet_cupy.space_to_batch([1, 2], 2), TypeError, "x must be a numpy.ndarray"),
    (lambda x: sbnet_cupy.batch_to_space(x, 2), ValueError,
     "y's batch 2 is not a multiple of block 2x2 = 4"),
    (lambda x: sbnet_cupy.batch_to_space(x, (1, 2), ((5, 4), (0, 0))), ValueError,
     r"crops \(\(5, 4\), \(0, 0\)\) remove more than the 8x12 image"),
    (lambda x: sbnet_cupy.batch_to_space(x, (1, 2), "a"), TypeError, "crops must be an int or"),
])
def test_bad_arguments(xp, call, error, match):
    x = xp.ones((2, 8, 6, 3), xp.float32)
    with pytest.raises(error, match=match):
        call(x)


def test_paddings_as_arrays():
    """TensorFlow code passes paddings as arrays."""
    x = numpy.arange(2 * 5 * 3, dtype=numpy.float32).reshape(1, 5, 3, 2)
    paddings = numpy.array([[1, 0], [0, 1]], numpy.int64)
    numpy.testing.assert_array_equal(sbnet_cupy.space_to_batch(x, 2, paddings),
                                     sbnet_cupy.space_to_batch(x, 2, ((1, 0), (0, 1))))


@pytest.mark.version_free
def test_kernel_division_is_exact():
    """The kernels divide by (n * mul) >> shift with the host's _divisor: exact on [0, 2**31)."""
    rng = numpy.random.default_rng(0)
    divisors = list(range(1, 300)) + [2**k + e for k in range(9, 30) for e in (-1, 0, 1)]
    edges = numpy.array([0, 1, 2**31 - 1, 2**31 - 2, 2**30, 2**30 - 1], numpy.int64)
    for d in divisors:
        _, mul, shift = _divisor(d)
        assert mul < 2**32
        n = numpy.concatenate([edges, rng.integers(0, 2**31, 2000),
                               d * rng.integers(0, 2**31 // d, 200),
                               d * rng.integers(1, 2**31 // d, 200) - 1]).astype(object)
        assert all((v * mul) >> shift == v // d for v in n)


@pytest.mark.version_free
@pytest.mark.parametrize("layouts", [("NHWC", "NHWC"), ("NCHW", "NCHW"), ("NCHW", "NHWC")],
                         ids="-".join)
def test_launch_plans_fit_the_kernels(layouts):
    """The plans (no GPU needed) on shapes around the benchmark's and odd ones: arguments that
    pack into the kernels' structs, shared memory under the 48 KiB a launch gets without opting
    in, vectors the pointers' alignment allows, channels-last tiles within one band row."""
    data_format, batch_format = layouts
    rng = numpy.random.default_rng(0)
    shapes = [(64, 64, 64, 64), (1, 2048, 64, 64), (16, 256, 64, 64), (3, 24, 23, 37)]
    shapes += [tuple(int(v) for v in rng.integers(1, 40, 4)) for _ in range(12)]
    for (n, c, h, w), rate, itemsize, align in itertools.product(
            shapes, (1, 2, 3, 5, 8, 12), (1, 2, 4, 8, 16), (16, 4, 2)):
        if data_format != batch_format and (itemsize not in (2, 4, 8) or align < itemsize):
            continue
        paddings = ((rate // 2, (-h - rate // 2) % rate), (rate - 1, (-w - rate + 1) % rate))
        shape = (n, c, h, w) if data_format == "NCHW" else (n, h, w, c)
        g = space_to_batch_reshape(shape, (rate, rate), paddings, data_format, batch_format)
        for op in ("space_to_batch", "batch_to_space"):
            plan = reshape_plan(None, op, g, itemsize, align)
            plan.record.pack(0, 0, *plan.constants)
            named = dict(zip(plan.record.names[2:], plan.constants))  # the fields after x and y
            assert (plan.shared_mem <= 48 * 1024 and max(plan.grid[1:]) < 2**16
                    and numpy.prod(plan.block) <= 1024)
            if plan.name.split("<")[0].endswith("_nchw"):
                vector, vector_y, channels_last = plan.template_args[1:]
                assert max(vector, vector_y) * itemsize <= align
                assert channels_last == (batch_format == "NHWC")
                tile_bands, tile_cols, col_vectors = (
                    named["tile_bands.d"], named["tile_cols.d"], named["col_vectors.d"])
                if channels_last:
                    assert c % tile_bands == 0 and tile_bands % vector == 0
                    assert vector_y == vector
                else:  # y's vectors tile each (i, j)'s run and never leave y's sub-lattice
                    w_out, bands = g.y_hw[1], n * c * g.y_hw[0]
                    assert col_vectors * vector_y == tile_bands * tile_cols
                    assert (bands * w_out) % vector_y == 0
                    run = tile_bands * w_out if tile_cols == w_out else math.gcd(tile_cols, w_out)
                    assert run % vector_y == 0


def _transliterated_nchw(op, g, src, itemsize, align):
    """kernels/dilated/space_to_batch.cu's NCHW kernels as NumPy runs them: the plan of
    reshape_plan, every CTA's x vectors (locate_x) into a tile of element slots at tile_at's
    addresses and y's vectors (locate_y, y_element) out of it, or the other way round. Checks the
    tile's bounds, that nothing reads a slot no one wrote, and that every output element is written
    once.
    Returns y as [block_h * block_w, bands * out_w] or x as [planes, h, w]."""
    plan = reshape_plan(None, op, g, itemsize, align)
    (_, vx, vy, cl), grid, smem = plan.template_args, plan.grid, plan.shared_mem
    a = dict(zip(plan.record.names[2:], plan.constants))  # nchw_args's fields after x and y
    h, w, out_w, block_h, bands, off_h, off_w, row_words, band_words = (a[name] for name in (
        "height", "width", "out_w", "block_h", "bands", "off_h", "off_w", "row_words",
        "band_words"))
    out_h, block_w, channels, tile_rows, tile_bands, tile_cols, row_vectors, col_vectors = (
        a[f"{name}.d"] for name in ("out_h", "block_w", "channels", "tile_rows", "tile_bands",
                                    "tile_cols", "row_vectors", "col_vectors"))

    def tile_at(row, byte):  # a pad word after every 32
        word = byte >> 2
        return (row + word + (word >> 5)) * 4 + (byte & 3)

    y = numpy.full((block_h * block_w, bands * out_w), numpy.nan)
    x = numpy.full((g.x_dims[0] * g.x_dims[1], h, w), numpy.nan)
    if op == "space_to_batch":
        x[...] = src.reshape(x.shape)
    else:
        y[...] = src.reshape(y.shape)
    written = numpy.zeros((y if op == "space_to_batch" else x).shape, int)
    for bx, by, bz in itertools.product(*(range(n) for n in grid)):
        band0, i0, q0 = bx * tile_bands, by * tile_rows, bz * tile_cols
        n_bands, n_rows = min(tile_bands, bands - band0), min(tile_rows, block_h - i0)
        tile = numpy.full(smem // itemsize, numpy.nan)  # slots of one element
        # locate_x
        t = numpy.arange(n_bands * tile_rows * row_vectors)
        r, k = t // row_vectors, t % row_vectors
        band_in_tile, ii = r // tile_rows, r % tile_rows
        band = band0 + band_in_tile
        if cl:
            bq = band // channels
            plane, hq = bq // out_h * channels + band % channels, bq % out_h
        else:
            plane, hq = band // out_h, band % out_h
        row_x = hq * block_h + i0 + ii - off_h
        col_x = q0 * block_w - off_w + k * vx
        inside_x = (ii < n_rows) & (row_x >= 0) & (row_x < h) & (col_x >= 0) & (col_x < w)
        at_x = tile_at(band_in_tile * band_words + ii * row_words, k * vx * itemsize)
        assert at_x.min() >= 0 and at_x.max() + vx * itemsize <= smem
        # locate_y and y_element
        t = numpy.arange(n_rows * block_w * col_vectors * (tile_cols if cl else 1))
        r, v = t // col_vectors, t % col_vectors
        if cl:
            ij, o = r // tile_cols, r % tile_cols
            q = q0 + o
            y_index = (band0 // channels * out_w + q) * channels + band0 % channels + v * vy
            inside_y = q < out_w
        else:
            ij, flat = r, v * vy
            o, q = flat // tile_cols, q0 + flat % tile_cols
            y_index = (band0 + o) * out_w + q
            inside_y = (o < n_bands) & (q < out_w)
        ii_y, j = ij // block_w, ij % block_w
        sub_lattice = (i0 + ii_y) * block_w + j

        def y_slots(e):
            if cl:
                at = tile_at((v * vy + e) * band_words + ii_y * row_words,
                             (o * block_w + j) * itemsize)
            else:
                f = flat + e
                at = tile_at(f // tile_cols * band_words + ii_y * row_words,
                             (f % tile_cols * block_w + j) * itemsize)
            assert at[inside_y].min(initial=0) >= 0 and at[inside_y].max(initial=0) < smem
            return at // itemsize

        x_slot = [(at_x + e * itemsize) // itemsize for e in range(vx)]
        if op == "space_to_batch":
            for e in range(vx):
                tile[x_slot[e]] = numpy.where(inside_x, x[plane * inside_x, row_x * inside_x,
                                                         (col_x + e) * inside_x], 0)
            for e in range(vy):
                values_e = tile[y_slots(e)][inside_y]
                assert not numpy.isnan(values_e).any(), "read a tile slot no one wrote"
                y[sub_lattice[inside_y], y_index[inside_y] + e] = values_e
                numpy.add.at(written, (sub_lattice[inside_y], y_index[inside_y] + e), 1)
        else:
            for e in range(vy):
                tile[y_slots(e)[inside_y]] = y[sub_lattice[inside_y], y_index[inside_y] + e]
            for e in range(vx):
                values_e = tile[x_slot[e]][inside_x]
                assert not numpy.isnan(values_e).any(), "read a tile slot no one wrote"
                where = plane[inside_x], row_x[inside_x], col_x[inside_x] + e
                x[where] = values_e
                numpy.add.at(written, where, 1)
    assert (written == 1).all(), "an output element written other than once"
    return y if op == "space_to_batch" else x


@pytest.mark.version_free
@pytest.mark.parametrize("dims, rate, left, itemsize, batch_format", [
    ((1, 1024, 64, 64), 12, 4, 2, None),  # DeepLab's 6-pixel rows: vectors of 4 (x), 8 (y)
    ((8, 256, 16, 8), 8, 0, 2, None),  # one pixel a row of y: y's vectors span 4 rows
    ((2, 300, 10, 6), 2, 0, 4, None),
    ((64, 9, 33, 35), 3, 1, 1, None),  # x's vectors of one element, y's of 16
    ((2, 3, 20, 4100), 2, 0, 4, None),  # several column tiles: y's vectors stay in a row
    ((2, 300, 10, 6), 2, 0, 2, "NHWC"),  # channels last: vectors of bands
    ((4, 64, 12, 12), 12, 0, 8, "NHWC"),
])
def test_nchw_kernels_transliterated(rng, dims, rate, left, itemsize, batch_format):
    """The NCHW kernels' index arithmetic, run on the CPU (_transliterated_nchw) against the
    NumPy backend, space_to_batch and back: x's and y's vector widths apart, y's vectors across
    y's rows, column tiles, channels last."""
    n, c, h, w = dims
    paddings = ((rate // 2, (-h - rate // 2) % rate), (left, (-w - left) % rate))
    g = space_to_batch_reshape(dims, (rate, rate), paddings, "NCHW", batch_format)
    x = rng.standard_normal(dims)
    want = sbnet_cupy.space_to_batch(x, rate, paddings, data_format="NCHW",
                                     batch_format=batch_format)
    got = _transliterated_nchw("space_to_batch", g, x, itemsize, 16)
    numpy.testing.assert_array_equal(got.reshape(want.shape), want)
    back = _transliterated_nchw("batch_to_space", g, want, itemsize, 16)
    numpy.testing.assert_array_equal(back.reshape(x.shape), x)


# --- atrous_conv2d --------------------------------------------------------------------------

@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("rate", [1, 2, 3, 4, 5])
def test_atrous_conv2d_matches_reference_and_tensorflow(xp, rng, rate, padding):
    tf = require("tensorflow")
    x = random_array(rng, (2, 13, 11, 3), numpy.float64)  # sizes no rate divides but 1
    w = random_array(rng, (3, 2, 3, 5), numpy.float64)
    out = sbnet_cupy.atrous_conv2d(xp.asarray(x), xp.asarray(w), rate, padding)
    paddings = (same_padding((3, 2), (rate, rate)) if padding == "SAME"
                else ((0, 0), (0, 0)))
    expected = reference.dilated_conv2d(x, w, (rate, rate), paddings)
    assert out.shape == expected.shape
    numpy.testing.assert_allclose(to_numpy(out), expected, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(to_numpy(out), tf.nn.atrous_conv2d(x, w, rate, padding).numpy(),
                                  rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32])
def test_atrous_conv2d_low_precision(xp, rng, dtype):
    """Within what TensorFlow's own convolution in that precision achieves."""
    tf = require("tensorflow")
    x = random_array(rng, (1, 10, 9, 7), dtype)
    w = random_array(rng, (3, 3, 7, 4), dtype)
    exact = reference.dilated_conv2d(x, w, (2, 2), ((2, 2), (2, 2)))
    out = to_numpy(sbnet_cupy.atrous_conv2d(xp.asarray(x), xp.asarray(w), 2, "SAME"))
    assert out.dtype == dtype
    baseline = tf.nn.atrous_conv2d(x, w, 2, "SAME").numpy().astype(numpy.float64)
    tolerance = max(numpy.abs(baseline - exact).max(),
                    numpy.finfo(dtype).eps * numpy.abs(exact).max())
    assert numpy.abs(out - exact).max() <= 4 * tolerance


@pytest.mark.parametrize("size, kernel, rate, padding", [
    ((16, 16), (3, 3), (2, 2), ((2, 2), (2, 2))),  # the seed's case: no padding in the reshape
    ((13, 11), (3, 3), (4, 4), ((4, 4), (4, 4))),
    ((9, 7), (2, 4), (3, 2), ((1, 2), (3, 0))),
    ((5, 5), (3, 3), (5, 5), ((0, 0), (0, 0))),  # the image is smaller than the kernel
    ((64, 64), (3, 3), (12, 12), ((12, 12), (12, 12))),
])
@pytest.mark.parametrize("conv_padding", [False, True])
def test_dilated_conv_geometry(rng, size, kernel, rate, padding, conv_padding):
    """space_to_batch -> convolution padded by conv_padding -> batch_to_space equals the dilated
    convolution, with or without the ordinary convolution's own padding."""
    if size[0] + sum(padding[0]) < rate[0] * (kernel[0] - 1):
        with pytest.raises(ValueError, match="smaller than the dilated kernel"):
            dilated_conv_geometry(size, kernel, rate, padding,
                                             conv_padding=conv_padding)
        return
    x = random_array(rng, (2, *size, 3), numpy.float64)
    w = random_array(rng, (*kernel, 3, 2), numpy.float64)
    g = dilated_conv_geometry(size, kernel, rate, padding, conv_padding=conv_padding)
    assert conv_padding or g.conv_padding == (0, 0)
    assert g.crops[0][0] == g.crops[1][0] == 0
    y = sbnet_cupy.space_to_batch(x, rate, g.paddings)
    (ph, pw) = g.conv_padding
    z = sbnet_cupy.conv2d_valid(numpy.pad(y, ((0, 0), (ph, ph), (pw, pw), (0, 0))), w)
    out = sbnet_cupy.batch_to_space(z, rate, g.crops)
    expected = reference.dilated_conv2d(x, w, rate, padding)
    assert out.shape == expected.shape and g.out_size == expected.shape[1:3]
    numpy.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_dilated_conv_geometry_moves_padding_into_the_convolution():
    g = dilated_conv_geometry((64, 64), (3, 3), (2, 2), ((2, 2), (2, 2)),
                                         conv_padding=True)
    assert g == ((((0, 0), (0, 0))), (1, 1), ((0, 0), (0, 0)), (64, 64))


def test_atrous_conv2d_empty_output_and_bad_arguments(xp):
    x = xp.ones((2, 6, 9, 3), xp.float32)
    w = xp.ones((3, 3, 3, 4), xp.float32)
    assert sbnet_cupy.atrous_conv2d(x, w, (2, 3), "VALID").shape == (2, 2, 3, 4)
    # A dilated kernel one pixel larger than the image: an empty output, as TensorFlow gives.
    assert sbnet_cupy.atrous_conv2d(x, w, 3, "VALID").shape == (2, 0, 3, 4)
    for args, error, match in [
        ((w, 5, "VALID"), ValueError, "smaller than the dilated kernel"),
        ((w, 2, "same"), ValueError, "padding must be 'SAME' or 'VALID', got 'same'"),
        ((w, 0, "SAME"), ValueError, "rate must be two positive ints"),
        ((w[:, :, :2], 2, "SAME"), ValueError, r"w must be \[KH, KW, C, K\] with C = 3"),
        ((w.astype(xp.float64), 2, "SAME"), TypeError, "w dtype float64 differs from x dtype"),
    ]:
        with pytest.raises(error, match=match):
            sbnet_cupy.atrous_conv2d(x, *args)


# --- GPU only: launch shapes the small cases above do not reach ------------------------------

@requires_gpu
@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("dims, block, paddings", [
    ((2, 3, 20, 4100), 2, ((0, 0), (0, 0))),  # several column tiles a row
    ((1, 2, 6, 30), 600, ((0, 594), (0, 570))),
    ((1, 2, 6, 30), (1, 9000), ((0, 0), (0, 8970))),  # a block too wide for the NCHW tile
    ((64, 9, 33, 35), 3, ((0, 0), (1, 0))),  # many tiles of units
    ((3, 5, 12, 12), 12, ((12, 12), (0, 12))),
])
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32, numpy.float64, numpy.int8])
def test_large_shapes_match_numpy(rng, data_format, dims, block, paddings, dtype):
    x = random_array(rng, _shape(dims, data_format), dtype)
    y = sbnet_cupy.space_to_batch(cupy.asarray(x), block, paddings, data_format=data_format)
    expected = sbnet_cupy.space_to_batch(x, block, paddings, data_format=data_format)
    numpy.testing.assert_array_equal(cupy.asnumpy(y), expected)
    back = sbnet_cupy.batch_to_space(y, block, paddings, data_format=data_format)
    numpy.testing.assert_array_equal(cupy.asnumpy(back), x)


# (x layout, y layout): the three kernel families.
LAYOUTS = [("NHWC", "NHWC"), ("NCHW", "NCHW"), ("NCHW", "NHWC")]


@requires_gpu
@pytest.mark.parametrize("layouts", LAYOUTS, ids="-".join)
@pytest.mark.parametrize("rate", range(1, 13))
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32, numpy.float64, numpy.int8,
                                   numpy.complex128])
def test_rates_and_odd_sizes_match_numpy(rng, layouts, rate, dtype):
    """Every kernel path at rates 1 to 12, on sizes no rate but 1 divides and paddings that do
    not split evenly: the tiles' vector widths (16 bytes down to one element), column and row
    ends, bands of many planes, channels in tiles."""
    data_format, batch_format = layouts
    if data_format != batch_format and numpy.dtype(dtype).itemsize not in (2, 4, 8):
        pytest.skip("the NCHW -> NHWC kernels move 2, 4 and 8-byte elements")
    for dims, top, left in [((3, 16, 23, 37), rate // 2, rate - 1), ((2, 8, 64, 64), 0, 0),
                            ((1, 24, 13, 48), rate, 2 * rate)]:
        (_, _, h, w), (bh, bw) = dims, (rate, rate)
        paddings = ((top, (-h - top) % bh), (left, (-w - left) % bw))
        shape = _shape(dims, data_format)
        x = random_array(rng, shape, dtype)
        expected = sbnet_cupy.space_to_batch(x, rate, paddings, data_format=data_format,
                                             batch_format=batch_format)
        y = sbnet_cupy.space_to_batch(cupy.asarray(x), rate, paddings, data_format=data_format,
                                      batch_format=batch_format)
        numpy.testing.assert_array_equal(cupy.asnumpy(y), expected)
        back = sbnet_cupy.batch_to_space(y, rate, paddings, data_format=data_format,
                                         batch_format=batch_format)
        numpy.testing.assert_array_equal(cupy.asnumpy(back), x)
        crops = ((top + 1, 0), (0, left)) if h > 1 else paddings  # crops past the padding
        numpy.testing.assert_array_equal(
            cupy.asnumpy(sbnet_cupy.batch_to_space(y, rate, crops, data_format=data_format,
                                                   batch_format=batch_format)),
            sbnet_cupy.batch_to_space(expected, rate, crops, data_format=data_format,
                                      batch_format=batch_format))


@requires_gpu
def test_batch_format_needs_a_kernel_size():
    x = cupy.ones((1, 2, 4, 4), cupy.int8)
    with pytest.raises(ValueError, match="needs elements of 2, 4 or 8 bytes"):
        sbnet_cupy.space_to_batch(x, 2, data_format="NCHW", batch_format="NHWC")


@requires_gpu
@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_misaligned_pointers(rng, data_format, offset):
    """Views that start past an element boundary of 16 bytes take narrower accesses."""
    x = random_array(rng, (3, 2, 8, 8), numpy.float32)
    x_gpu = cupy.asarray(x.reshape(-1))
    view = cupy.concatenate([x_gpu[:offset], x_gpu])[offset:].reshape(x.shape)
    assert view.data.ptr % 16 == (offset * 4) % 16
    y = sbnet_cupy.space_to_batch(view, 2, ((2, 0), (0, 2)), data_format=data_format)
    numpy.testing.assert_array_equal(
        cupy.asnumpy(y), sbnet_cupy.space_to_batch(x, 2, ((2, 0), (0, 2)), data_format=data_format))
    out = cupy.empty(y.size + offset, x.dtype)[offset:].reshape(y.shape)
    sbnet_cupy.space_to_batch(view, 2, ((2, 0), (0, 2)), data_format=data_format, out=out)
    numpy.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(y))
