import numpy
import pytest

import sbnet_cupy
from axes import GEOMETRIES
from conftest import requires_gpu, to_numpy
import reference

MASK_DTYPES = (numpy.bool_, numpy.uint8, numpy.int32, numpy.float16, numpy.float32,
               numpy.float64)


def _mask(rng, shape, dtype, avgpool):
    """Sparse random masks: binary for avgpool (sums stay exact), graded values for max."""
    if avgpool or dtype in (numpy.bool_, numpy.uint8, numpy.int32):
        return (rng.random(shape) > 0.8).astype(dtype)
    return (rng.random(shape) * (rng.random(shape) > 0.7)).astype(dtype)


def _call(xp, mask, bcount, geometry, **kwargs):
    return sbnet_cupy.reduce_mask(xp.asarray(mask), bcount, bsize=geometry[0],
                                  boffset=geometry[1], bstride=geometry[2], **kwargs)


@pytest.mark.parametrize("avgpool, tol", [(False, 0.5), (False, 0.0), (True, 0.25),
                                          (True, 0.0)])
@pytest.mark.parametrize("dtype", MASK_DTYPES)
@pytest.mark.parametrize("name", GEOMETRIES)
def test_matches_reference(xp, rng, name, dtype, avgpool, tol):
    (height, width), bsize, boffset, bstride, bcount = GEOMETRIES[name]
    mask = _mask(rng, (3, height, width), dtype, avgpool)
    geometry = (bsize, boffset, bstride)
    result = _call(xp, mask, bcount, geometry, tol=tol, avgpool=avgpool)
    expected = reference.reduce_mask(mask, bcount, geometry, tol, avgpool)
    assert result.active_block_indices.dtype == numpy.int32
    assert result.bin_counts.dtype == numpy.int32 and result.bin_counts.shape == (1,)
    numpy.testing.assert_array_equal(to_numpy(result.active_block_indices), expected)
    assert int(result.bin_counts[0]) == len(expected)
    assert not bool(result.overflowed)


def test_channel_axis_and_bcount_past_the_image(xp, rng):
    mask = _mask(rng, (2, 20, 30), numpy.float32, False)
    geometry = ((6, 6), (-2, -2), (5, 5))
    result = _call(xp, mask[..., None], (8, 9), geometry)  # rows of blocks entirely outside
    numpy.testing.assert_array_equal(to_numpy(result.active_block_indices),
                                     reference.reduce_mask(mask, (8, 9), geometry, 0.5, False))


@pytest.mark.parametrize("extra", [-3, 0, 5])
def test_capacity(xp, rng, extra):
    mask = _mask(rng, (2, 40, 40), numpy.float32, False)
    geometry = ((8, 8), (-1, -1), (6, 6))
    expected = reference.reduce_mask(mask, (7, 7), geometry, 0.5, False)
    capacity = len(expected) + extra
    result = _call(xp, mask, (7, 7), geometry, capacity=capacity)
    indices = to_numpy(result.active_block_indices)
    assert indices.shape == (capacity, 3)
    assert int(result.bin_counts[0]) == len(expected)  # the true count, even past capacity
    kept = min(capacity, len(expected))
    numpy.testing.assert_array_equal(indices[:kept], expected[:kept])
    assert (indices[kept:] == -1).all()
    assert bool(result.overflowed) == (extra < 0)


def test_empty_mask_gives_no_blocks(xp):
    mask = xp.zeros((2, 16, 16), xp.float32)
    result = sbnet_cupy.reduce_mask(mask, (2, 2), bsize=8)
    assert result.active_block_indices.shape == (0, 3)
    assert int(result.bin_counts[0]) == 0
    result = sbnet_cupy.reduce_mask(mask, (0, 2), bsize=8, capacity=3)
    assert (to_numpy(result.active_block_indices) == -1).all()
    assert int(result.bin_counts[0]) == 0


def test_full_mask_lists_every_block_in_order(xp):
    result = sbnet_cupy.reduce_mask(xp.ones((2, 70, 33), xp.float16), (9, 5), bsize=8)
    expected = numpy.argwhere(numpy.ones((2, 9, 5), bool))
    numpy.testing.assert_array_equal(to_numpy(result.active_block_indices), expected)


@requires_gpu
def test_large_mask_matches_numpy(rng):
    """A LiDAR-sized mask: thousands of blocks, so many CTAs race for the ticket."""
    import cupy

    for _ in range(3):
        mask = _mask(rng, (2, 800, 1408), numpy.float32, False)
        for capacity in (None, 500):
            got = sbnet_cupy.reduce_mask(cupy.asarray(mask), (50, 88), bsize=18, boffset=-1,
                                         bstride=16, capacity=capacity)
            want = sbnet_cupy.reduce_mask(mask, (50, 88), bsize=18, boffset=-1, bstride=16,
                                          capacity=capacity)
            numpy.testing.assert_array_equal(to_numpy(got.active_block_indices),
                                             want.active_block_indices)
            numpy.testing.assert_array_equal(to_numpy(got.bin_counts), want.bin_counts)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bsize=0), ValueError, r"bsize must be two positive ints, got \(0, 0\)"),
    (dict(bsize=4, bstride=(2, 0)), ValueError, "bstride must be two positive ints"),
    (dict(bsize=4, capacity=-1), ValueError, "capacity must be None or an int >= 0"),
    (dict(bsize=4, tol="high"), TypeError, "tol must be a number"),
])
def test_bad_arguments(xp, kwargs, error, match):
    with pytest.raises(error, match=match):
        sbnet_cupy.reduce_mask(xp.ones((1, 8, 8), xp.float32), (2, 2), **kwargs)


def test_bad_masks(xp):
    with pytest.raises(ValueError, match=r"mask must be \[N, H, W\] or \[N, H, W, 1\]"):
        sbnet_cupy.reduce_mask(xp.ones((1, 8, 8, 2), xp.float32), (2, 2), bsize=4)
    with pytest.raises(ValueError, match=r"mask must be \[N, H, W\]"):
        sbnet_cupy.reduce_mask(xp.ones((8, 8), xp.float32), (2, 2), bsize=4)
    with pytest.raises(TypeError, match="mask dtype must be one of"):
        sbnet_cupy.reduce_mask(xp.ones((1, 8, 8), xp.complex64), (2, 2), bsize=4)
    with pytest.raises(ValueError, match=r"bcount must be two >= 0 ints"):
        sbnet_cupy.reduce_mask(xp.ones((1, 8, 8), xp.float32), (-1, 2), bsize=4)


def test_out_and_workspace(xp, rng):
    mask = _mask(rng, (2, 40, 40), numpy.float32, False)
    geometry = ((8, 8), (-1, -1), (6, 6))
    expected = reference.reduce_mask(mask, (7, 7), geometry, 0.5, False)
    indices, counts = xp.full((100, 3), 7, xp.int32), xp.full(1, 7, xp.int32)
    workspace = xp.zeros(5, dtype=xp.uint32) if xp is not numpy else None  # 98 blocks: 4 words
    result = _call(xp, mask, (7, 7), geometry, capacity=100, out=(indices, counts),
                   workspace=workspace)
    assert result.active_block_indices is indices and result.bin_counts is counts
    numpy.testing.assert_array_equal(to_numpy(indices)[:len(expected)], expected)
    assert int(counts[0]) == len(expected)
    assert (to_numpy(indices)[len(expected):] == -1).all()
    if workspace is not None:
        assert int(workspace[0]) == 0  # the kernel leaves the ticket counter at zero
    with pytest.raises(ValueError, match="out needs capacity"):
        _call(xp, mask, (7, 7), geometry, out=(indices, counts))
    with pytest.raises(ValueError, match=r"out active_block_indices must be a C-contiguous "
                                         r"int32 array of shape \(40, 3\)"):
        _call(xp, mask, (7, 7), geometry, capacity=40, out=(indices, counts))
    if workspace is not None:
        with pytest.raises(ValueError, match="workspace must be a 1-D uint32 array of at least 5"):
            _call(xp, mask, (7, 7), geometry, capacity=100, workspace=workspace[:4])
