import numpy
import pytest

import sbnet_cupy
from axes import CHANNELS, GEOMETRIES, MOVE_DTYPES, block_list, random_array
from conftest import to_numpy
import reference


def _case(rng, xp, name, channels, dtype, n_batch=2):
    (height, width), bsize, boffset, bstride, bcount = GEOMETRIES[name]
    x = random_array(rng, (n_batch, height, width, channels), dtype)
    indices = block_list(rng, n_batch, bcount, n_blocks=9)
    geometry = (bsize, boffset, bstride)
    return x, indices, geometry


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("name", GEOMETRIES)
def test_matches_reference(xp, rng, name, channels, dtype, transpose):
    x, indices, geometry = _case(rng, xp, name, channels, dtype)
    count = len(indices) - 2  # the last two rows are past the count
    out = sbnet_cupy.sparse_gather(xp.asarray(x), xp.asarray([count], dtype=xp.int32),
                                   xp.asarray(indices), bsize=geometry[0], boffset=geometry[1],
                                   bstride=geometry[2], transpose=transpose)
    expected = reference.sparse_gather(x, indices, count, geometry, transpose)
    assert out.dtype == x.dtype and out.shape == expected.shape
    numpy.testing.assert_array_equal(to_numpy(out), expected)


def test_zero_blocks(xp):
    x = xp.ones((1, 8, 8, 4), xp.float32)
    for transpose, shape in ((False, (0, 4, 4, 4)), (True, (0, 4, 4, 4))):
        out = sbnet_cupy.sparse_gather(x, xp.zeros(1, xp.int32), xp.zeros((0, 3), xp.int32),
                                       bsize=4, transpose=transpose)
        assert out.shape == shape


def test_count_past_rows_uses_all_rows(xp, rng):
    """Capacity mode reports the true count, which may exceed the rows of the list."""
    x = random_array(rng, (1, 8, 8, 2), numpy.float32)
    indices = numpy.array([[0, 0, 0], [0, 1, 1]], numpy.int32)
    out = sbnet_cupy.sparse_gather(xp.asarray(x), xp.asarray([5], xp.int32), xp.asarray(indices),
                                   bsize=4)
    numpy.testing.assert_array_equal(to_numpy(out),
                                     reference.sparse_gather(x, indices, 2,
                                                             ((4, 4), (0, 0), (4, 4)), False))


def test_non_contiguous_input(xp, rng):
    base = random_array(rng, (2, 12, 20, 6), numpy.float32)
    x = base[:, :, ::2, 1:5]  # strided in W and C
    indices = block_list(rng, 2, (3, 3), n_blocks=6, out_of_range=False)
    out = sbnet_cupy.sparse_gather(xp.asarray(base)[:, :, ::2, 1:5], xp.asarray([6], xp.int32),
                                   xp.asarray(indices), bsize=(4, 4), boffset=(-1, -1))
    expected = reference.sparse_gather(numpy.ascontiguousarray(x), indices, 6,
                                       ((4, 4), (-1, -1), (4, 4)), False)
    numpy.testing.assert_array_equal(to_numpy(out), expected)


def test_int64_indices_are_accepted(xp, rng):
    x = random_array(rng, (1, 8, 8, 3), numpy.float32)
    indices = numpy.array([[0, 1, 0], [0, 0, 1]], numpy.int64)
    out = sbnet_cupy.sparse_gather(xp.asarray(x), xp.asarray([2]), xp.asarray(indices), bsize=4)
    numpy.testing.assert_array_equal(
        to_numpy(out), reference.sparse_gather(x, indices, 2, ((4, 4), (0, 0), (4, 4)), False))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bsize=(0, 4)), ValueError, r"bsize must be two positive ints, got \(0, 4\)"),
    (dict(bsize=4, bstride=(-1, 4)), ValueError, "bstride must be two positive ints"),
    (dict(bsize=(4, 4, 4)), TypeError, "bsize must be an int or a pair of ints"),
    (dict(bsize=4, boffset="a"), TypeError, "boffset must be an int or a pair of ints"),
])
def test_bad_geometry(xp, kwargs, error, match):
    x = xp.ones((1, 8, 8, 4), xp.float32)
    with pytest.raises(error, match=match):
        sbnet_cupy.sparse_gather(x, xp.ones(1, xp.int32), xp.zeros((1, 3), xp.int32), **kwargs)


def test_bad_arrays(xp):
    x = xp.ones((1, 8, 8, 4), xp.float32)
    counts, indices = xp.ones(1, xp.int32), xp.zeros((1, 3), xp.int32)
    with pytest.raises(ValueError, match=r"x must be 4-D \[N, H, W, C\]"):
        sbnet_cupy.sparse_gather(x[0], counts, indices, bsize=4)
    with pytest.raises(ValueError, match=r"active_block_indices must be \[M, 3\]"):
        sbnet_cupy.sparse_gather(x, counts, xp.zeros((1, 2), xp.int32), bsize=4)
    with pytest.raises(TypeError, match="active_block_indices must be integers"):
        sbnet_cupy.sparse_gather(x, counts, xp.zeros((1, 3), xp.float32), bsize=4)
    with pytest.raises(ValueError, match="bin_counts must be one integer"):
        sbnet_cupy.sparse_gather(x, xp.ones(2, xp.int32), indices, bsize=4)
    with pytest.raises(TypeError, match="x must be a numpy.ndarray or cupy.ndarray, got list"):
        sbnet_cupy.sparse_gather([[1]], counts, indices, bsize=4)


def test_out_argument(xp, rng):
    x = random_array(rng, (1, 8, 8, 3), numpy.float32)
    indices = numpy.array([[0, 1, 0], [0, 0, 1]], numpy.int32)
    out = xp.full((2, 3, 4, 4), numpy.nan, xp.float32)
    result = sbnet_cupy.sparse_gather(xp.asarray(x), xp.asarray([2], xp.int32),
                                      xp.asarray(indices), bsize=4, transpose=True, out=out)
    assert result is out
    numpy.testing.assert_array_equal(
        to_numpy(out), reference.sparse_gather(x, indices, 2, ((4, 4), (0, 0), (4, 4)), True))
    with pytest.raises(ValueError, match=r"out must be a C-contiguous float32 array of shape "
                                         r"\(2, 4, 4, 3\)"):
        sbnet_cupy.sparse_gather(xp.asarray(x), xp.asarray([2], xp.int32), xp.asarray(indices),
                                 bsize=4, out=out)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize("channels", [3, 32])
def test_fused_batchnorm(xp, rng, channels, dtype, relu):
    """In-image pixels become x * scale + shift (then ReLU); out-of-image pixels stay zero."""
    x, indices, geometry = _case(rng, xp, "negative-offset-overlap-nonsquare", channels, dtype)
    scale = rng.uniform(0.5, 2, channels)
    shift = rng.uniform(-1, 1, channels)
    acc = numpy.float64 if dtype == numpy.float64 else numpy.float32
    out = sbnet_cupy.sparse_gather(
        xp.asarray(x), xp.asarray([len(indices) - 1], dtype=xp.int32), xp.asarray(indices),
        bsize=geometry[0], boffset=geometry[1], bstride=geometry[2],
        scale=xp.asarray(scale, dtype=acc), shift=xp.asarray(shift, dtype=acc), relu=relu)
    count = len(indices) - 1
    plain = reference.sparse_gather(x, indices, count, geometry, False).astype(acc)
    inside = reference.sparse_gather(numpy.ones(x.shape[:3] + (1,), dtype), indices, count,
                                     geometry, False) > 0
    expected = plain * scale.astype(acc) + shift.astype(acc)
    if relu:
        expected = numpy.maximum(expected, 0)
    expected = numpy.where(inside, expected, 0).astype(dtype)
    tol = 1e-3 if dtype == numpy.float16 else 1e-6
    numpy.testing.assert_allclose(to_numpy(out), expected, rtol=tol, atol=tol)


def test_fused_batchnorm_bad_arguments(xp):
    x = xp.ones((1, 8, 8, 4), xp.float32)
    counts, indices = xp.ones(1, xp.int32), xp.zeros((1, 3), xp.int32)
    scale = xp.ones(4, xp.float32)
    with pytest.raises(ValueError, match="scale and shift go together"):
        sbnet_cupy.sparse_gather(x, counts, indices, bsize=4, scale=scale)
    with pytest.raises(ValueError, match="relu=True needs scale and shift"):
        sbnet_cupy.sparse_gather(x, counts, indices, bsize=4, relu=True)
    with pytest.raises(ValueError, match="scale and shift need transpose=False"):
        sbnet_cupy.sparse_gather(x, counts, indices, bsize=4, scale=scale, shift=scale,
                                 transpose=True)
    with pytest.raises(ValueError, match=r"shift must have shape \(4,\)"):
        sbnet_cupy.sparse_gather(x, counts, indices, bsize=4, scale=scale, shift=scale[:3])
    with pytest.raises(TypeError, match="scale and shift need a float x"):
        sbnet_cupy.sparse_gather(x.astype(xp.int32), counts, indices, bsize=4, scale=scale,
                                 shift=scale)
