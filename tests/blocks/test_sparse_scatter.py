import numpy
import pytest

import sbnet_cupy
from axes import (CHANNELS, FLOAT_DTYPES, GEOMETRIES, MOVE_DTYPES, block_list,
                  distinct_block_list, overlapping, random_array)
from conftest import HAS_GPU, cupy, requires_gpu, to_numpy
import reference

SCATTERS = {"scatter": sbnet_cupy.sparse_scatter, "scatter_var": sbnet_cupy.sparse_scatter_var}


def _case(rng, name, channels, dtype, transpose, *, distinct, n_batch=2):
    (height, width), bsize, boffset, bstride, bcount = GEOMETRIES[name]
    ybase = random_array(rng, (n_batch, height, width, channels), dtype)
    if distinct:
        indices = distinct_block_list(rng, n_batch, bcount, n_blocks=7)
    else:
        indices = block_list(rng, n_batch, bcount, n_blocks=9)
    shape = (len(indices), channels) + bsize if transpose else (len(indices),) + bsize + (channels,)
    blocks = random_array(rng, shape, dtype)
    return blocks, indices, ybase, (bsize, boffset, bstride)


def _run(xp, scatter, blocks, indices, count, ybase, geometry, **kwargs):
    y_in = xp.array(ybase)  # a copy: the reference needs ybase as it was
    y = SCATTERS[scatter](xp.asarray(blocks), xp.asarray([count], dtype=xp.int32),
                          xp.asarray(indices), y_in, bsize=geometry[0], boffset=geometry[1],
                          bstride=geometry[2], **kwargs)
    if scatter == "scatter_var":
        assert y is y_in
    else:
        numpy.testing.assert_array_equal(to_numpy(y_in), ybase)  # ybase untouched
    return to_numpy(y)


@pytest.mark.parametrize("scatter", SCATTERS)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("name", [n for n in GEOMETRIES if not overlapping(GEOMETRIES[n][1:4])])
def test_write_matches_reference(xp, rng, name, channels, dtype, transpose, scatter):
    blocks, indices, ybase, geometry = _case(rng, name, channels, dtype, transpose, distinct=True)
    count = len(indices) - 1
    y = _run(xp, scatter, blocks, indices, count, ybase, geometry, transpose=transpose)
    expected = reference.sparse_scatter(blocks, indices, count, ybase, geometry, False, transpose)
    numpy.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("name", [n for n in GEOMETRIES if overlapping(GEOMETRIES[n][1:4])])
def test_overlapping_write_lands_one_block(xp, rng, name, transpose):
    """Where blocks overlap without add, each element holds the value of one covering block."""
    blocks, indices, ybase, geometry = _case(rng, name, 5, numpy.float32, transpose,
                                             distinct=False)
    y = _run(xp, "scatter", blocks, indices, len(indices), ybase, geometry, transpose=transpose)
    candidates = reference.covering_values(blocks, indices, len(indices), ybase.shape, geometry,
                                           transpose)
    untouched = numpy.ones(ybase.shape[:3], bool)
    for (n, h, w), values in candidates.items():
        untouched[n, h, w] = False
        assert (numpy.stack(values) == y[n, h, w]).any(axis=0).all(), (n, h, w)
    numpy.testing.assert_array_equal(y[untouched], ybase[untouched])


@pytest.mark.parametrize("scatter", SCATTERS)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("name", [n for n in GEOMETRIES if not overlapping(GEOMETRIES[n][1:4])])
def test_add_matches_reference(xp, rng, name, channels, dtype, transpose, scatter):
    blocks, indices, ybase, geometry = _case(rng, name, channels, dtype, transpose, distinct=True)
    count = len(indices) - 1
    y = _run(xp, scatter, blocks, indices, count, ybase, geometry, add=True, transpose=transpose)
    expected = reference.sparse_scatter(blocks, indices, count, ybase, geometry, True, transpose)
    numpy.testing.assert_array_equal(y, expected)  # one add per element: exact


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("name", GEOMETRIES)
def test_atomic_add_matches_reference(xp, rng, name, channels, dtype, transpose):
    """Overlaps and repeated indices accumulate; the values are multiples of 1/8, so every
    order of the additions gives the same sum in each dtype."""
    blocks, indices, ybase, geometry = _case(rng, name, channels, dtype, transpose,
                                             distinct=False)
    y = _run(xp, "scatter", blocks, indices, len(indices), ybase, geometry, add=True,
             atomic=True, transpose=transpose)
    expected = reference.sparse_scatter(blocks, indices, len(indices), ybase, geometry, True,
                                        transpose)
    numpy.testing.assert_array_equal(y, expected)


def test_zero_blocks(xp, rng):
    ybase = random_array(rng, (1, 8, 8, 3), numpy.float32)
    for transpose, add in ((False, False), (True, True)):
        y = sbnet_cupy.sparse_scatter(xp.zeros((0, 4, 4, 3), xp.float32) if not transpose else
                                      xp.zeros((0, 3, 4, 4), xp.float32),
                                      xp.zeros(1, xp.int32), xp.zeros((0, 3), xp.int32),
                                      xp.asarray(ybase), bsize=4, add=add, transpose=transpose)
        numpy.testing.assert_array_equal(to_numpy(y), ybase)


def test_scatter_var_into_non_contiguous_base(xp, rng):
    full = random_array(rng, (1, 8, 16, 3), numpy.float32)
    blocks = random_array(rng, (2, 4, 4, 3), numpy.float32)
    indices = numpy.array([[0, 0, 0], [0, 1, 1]], numpy.int32)
    y_full = xp.array(full)  # a copy: full stays the reference input
    view = y_full[:, :, ::2]
    out = sbnet_cupy.sparse_scatter_var(xp.asarray(blocks), xp.asarray([2], xp.int32),
                                        xp.asarray(indices), view, bsize=4, add=True)
    assert out is view
    expected = reference.sparse_scatter(blocks, indices, 2, full[:, :, ::2],
                                        ((4, 4), (0, 0), (4, 4)), True, False)
    numpy.testing.assert_array_equal(to_numpy(y_full)[:, :, ::2], expected)
    numpy.testing.assert_array_equal(to_numpy(y_full)[:, :, 1::2], full[:, :, 1::2])


def test_gather_scatter_round_trip(xp, rng):
    """Scattering what was gathered, with the same blocks, gives back the input."""
    x = xp.asarray(random_array(rng, (2, 30, 26, 16), numpy.float16))
    mask = xp.asarray(rng.random((2, 30, 26)) > 0.9)
    blocks = sbnet_cupy.reduce_mask(mask, (4, 4), bsize=(8, 8), bstride=(8, 7), boffset=(-1, -2))
    kwargs = dict(bsize=(8, 8), bstride=(8, 7), boffset=(-1, -2))
    stack = sbnet_cupy.sparse_gather(x, blocks.bin_counts, blocks.active_block_indices,
                                     transpose=True, **kwargs)
    y = sbnet_cupy.sparse_scatter(stack, blocks.bin_counts, blocks.active_block_indices,
                                  xp.zeros_like(x), transpose=True, **kwargs)
    covered = to_numpy(y) != 0
    assert covered.any()
    numpy.testing.assert_array_equal(to_numpy(y)[covered], to_numpy(x)[covered])


def test_bad_arguments(xp):
    ybase = xp.ones((1, 8, 8, 4), xp.float32)
    counts, indices = xp.ones(1, xp.int32), xp.zeros((1, 3), xp.int32)
    blocks = xp.ones((1, 4, 4, 4), xp.float32)
    scatter = sbnet_cupy.sparse_scatter
    with pytest.raises(ValueError, match=r"blocks must have shape \[M, BH, BW, C\] = "
                                         r"\[M, 4, 4, 4\], got \(1, 4, 4, 3\)"):
        scatter(xp.ones((1, 4, 4, 3), xp.float32), counts, indices, ybase, bsize=4)
    with pytest.raises(ValueError, match=r"blocks must have shape \[M, C, BH, BW\]"):
        scatter(blocks[:, :, :2], counts, indices, ybase, bsize=4, transpose=True)
    with pytest.raises(ValueError, match="blocks has 2 rows but active_block_indices has 1"):
        scatter(xp.ones((2, 4, 4, 4), xp.float32), counts, indices, ybase, bsize=4)
    with pytest.raises(TypeError, match="blocks dtype float64 differs from ybase dtype float32"):
        scatter(blocks.astype(xp.float64), counts, indices, ybase, bsize=4)
    with pytest.raises(TypeError, match="add=True needs a float dtype"):
        scatter(blocks.astype(xp.int32), counts, indices, ybase.astype(xp.int32), bsize=4,
                add=True)
    with pytest.raises(ValueError, match=r"overlapping blocks .* needs atomic=True"):
        scatter(blocks, counts, indices, ybase, bsize=4, bstride=3, add=True)
    with pytest.raises(ValueError, match=r"ybase must be 4-D"):
        scatter(blocks, counts, indices, ybase[0], bsize=4)
    with pytest.raises(TypeError, match="ybase must be a numpy.ndarray or cupy.ndarray"):
        scatter(blocks, counts, indices, [[1.0]], bsize=4)
    if xp is not numpy:
        with pytest.raises(TypeError, match="mixed backends: blocks is a cupy array, .* "
                                            "ybase is a numpy array"):
            scatter(blocks, counts, indices, numpy.ones((1, 8, 8, 4), numpy.float32), bsize=4)


@requires_gpu
def test_tensors_past_int32_elements():
    """Offsets past 2**31 elements (64-bit index arithmetic), gather and scatter, both layouts."""
    import cupy

    width, channels = 1 << 20, 1100  # 2 * 2**20 * 1100 = 2.3e9 elements
    x = cupy.zeros((1, 2, width, channels), dtype=cupy.uint8)
    tail = cupy.random.randint(1, 255, size=(2, 8, channels), dtype=cupy.uint8)
    x[0, :, width - 8:] = tail
    indices = cupy.asarray([[0, 0, width // 4 - 2], [0, 0, width // 4 - 1]], dtype=cupy.int32)
    counts = cupy.asarray([2], dtype=cupy.int32)
    for transpose in (False, True):
        stack = sbnet_cupy.sparse_gather(x, counts, indices, bsize=(2, 4), transpose=transpose)
        got = stack.transpose(0, 2, 3, 1) if transpose else stack
        assert bool((got[0] == tail[:, :4]).all()) and bool((got[1] == tail[:, 4:]).all())
        y = cupy.zeros_like(x)
        sbnet_cupy.sparse_scatter_var(stack, counts, indices, y, bsize=(2, 4), transpose=transpose)
        assert bool((y[0, :, width - 8:] == tail).all())
        assert int(y[0, :, :width - 8].max()) == 0
        del y


@pytest.mark.skipif(not HAS_GPU or cupy.cuda.runtime.getDeviceCount() < 2,
                    reason="needs two CUDA GPUs")
def test_arrays_on_a_non_default_device(rng):
    ybase = random_array(rng, (1, 8, 8, 3), numpy.float32)
    blocks = random_array(rng, (2, 4, 4, 3), numpy.float32)
    indices = numpy.array([[0, 0, 0], [0, 1, 1]], numpy.int32)
    with cupy.cuda.Device(1):
        args = [cupy.asarray(a) for a in (blocks, [2], indices, ybase)]
        args[1] = args[1].astype(cupy.int32)
    y = sbnet_cupy.sparse_scatter(*args, bsize=4, add=True)  # device 0 is current here
    assert y.device.id == 1
    with cupy.cuda.Device(1):  # CuPy's own ops allocate on the current device
        mask = args[3][..., 0] > 0
    found = sbnet_cupy.reduce_mask(mask, (2, 2), bsize=4)
    stack = sbnet_cupy.sparse_gather(y, found.bin_counts, found.active_block_indices, bsize=4)
    assert found.active_block_indices.device.id == 1 and stack.device.id == 1
    numpy.testing.assert_array_equal(
        cupy.asnumpy(y), reference.sparse_scatter(blocks, indices, 2, ybase,
                                                  ((4, 4), (0, 0), (4, 4)), True, False))
