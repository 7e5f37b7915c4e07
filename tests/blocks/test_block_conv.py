"""The fused block convolutions (sbnet_cupy.blocks.block_conv) behind sparse_conv2d and
sparse_res_block_bottleneck with method="fused", against dense references written from the
definition. The GPU tests skip without a GPU."""

import numpy
import pytest

import sbnet_cupy
from sbnet_cupy.blocks import block_conv
from sbnet_cupy.core import launch as _launch
from axes import distinct_block_list, random_array
from conftest import HAS_GPU, cupy, requires_gpu, to_numpy, _poison_pool
import reference

# Relative error allowed against the float64 reference: TF32 products of exact inputs accumulate
# in float32; float16 rounds the output.
TOLERANCE = {numpy.float32: 1e-5, numpy.float16: 2e-3}


def _block_list(rng, n_batch, bcount, n_blocks, padding_rows):
    """Distinct blocks, then rows that point outside the batch or the image, then `padding_rows`
    in-range rows past the count (which must write nothing)."""
    rows = [distinct_block_list(rng, n_batch, bcount, n_blocks=n_blocks),
            numpy.array([(n_batch, 0, 0), (-1, 0, 0), (0, bcount[0] + 2, 0), (0, 0, -3)],
                        numpy.int32)]
    count = sum(len(r) for r in rows)
    rows.append(distinct_block_list(rng, n_batch, bcount, n_blocks=padding_rows))
    return numpy.concatenate(rows), numpy.array([count], numpy.int32)


def _written(indices, count, shape, bsize_out):
    """Output pixels of the counted blocks that lie inside the batch and the image."""
    mask = numpy.zeros(shape, bool)
    bh, bw = bsize_out
    for n, hi, wi in indices[:count]:
        if 0 <= n < shape[0] and hi >= 0 and wi >= 0:
            mask[n, hi * bh:(hi + 1) * bh, wi * bw:(wi + 1) * bw] = True
    return mask


@pytest.fixture(params=["streamed", "halo"])
def staging(request, monkeypatch):
    """Each way of staging the reduction, forced: block_conv's 32-word stages, and
    block_conv_halo's channel chunks where it applies (3x3 and 5x5 on 16-byte vectors)."""
    monkeypatch.setattr(block_conv, "STAGING", request.param)
    return request.param


def _assert_close(got, want, rtol):
    scale = numpy.abs(want).max() if want.size else 1.0
    numpy.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(scale, 1.0))


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16])
@pytest.mark.parametrize("cin, cout", [(3, 5), (8, 16), (24, 24), (33, 40), (96, 64)])
@pytest.mark.parametrize("kernel, bsize_out", [(3, (16, 16)), (1, (8, 8)), (3, (6, 10)),
                                                (5, (7, 7)), (3, (32, 32)), (3, (34, 6))])
def test_sparse_conv2d_fused_equals_dense(rng, staging, dtype, cin, cout, kernel, bsize_out):
    _poison_pool()
    shape = (2, 37, 53)
    x = random_array(rng, shape + (cin,), dtype)
    w = random_array(rng, (kernel, kernel, cin, cout), dtype)
    bias = random_array(rng, (cout,), numpy.float32)
    base = random_array(rng, shape + (cout,), dtype)
    bsize = tuple(b + kernel - 1 for b in bsize_out)
    params = sbnet_cupy.calc_block_params(shape[1:], bsize, (kernel, kernel))
    indices, count = _block_list(rng, shape[0], params.bcount, 5, 3)
    y = to_numpy(sbnet_cupy.sparse_conv2d(
        cupy.asarray(x), cupy.asarray(w), cupy.asarray(count), cupy.asarray(indices), params,
        bias=cupy.asarray(bias), base=cupy.asarray(base), method="fused"))
    written = _written(indices, int(count[0]), shape, params.bsize_out)
    assert written.any() and not written.all()
    dense = reference.conv2d_same(x, w) + bias
    _assert_close(y[written].astype(numpy.float64), dense[written], TOLERANCE[dtype])
    numpy.testing.assert_array_equal(y[~written], base[~written])


@requires_gpu
@pytest.mark.parametrize("rows, count", [(6, 0), (3, 9), (0, 0)])
def test_sparse_conv2d_fused_count_past_rows_and_empty(rng, rows, count):
    """count 0 writes nothing; a count past the rows (an overflowed capacity) convolves the rows
    there are."""
    shape = (1, 20, 30)
    x = random_array(rng, shape + (8,), numpy.float32)
    w = random_array(rng, (3, 3, 8, 8), numpy.float32)
    base = random_array(rng, shape + (8,), numpy.float32)
    params = sbnet_cupy.calc_block_params(shape[1:], (10, 10), (3, 3))
    indices = distinct_block_list(rng, 1, params.bcount, n_blocks=rows)
    y = to_numpy(sbnet_cupy.sparse_conv2d(
        cupy.asarray(x), cupy.asarray(w), cupy.asarray([count], dtype=cupy.int32),
        cupy.asarray(indices.reshape(-1, 3)), params, base=cupy.asarray(base), method="fused"))
    written = _written(indices, min(count, rows), shape, params.bsize_out)
    dense = reference.conv2d_same(x, w)
    _assert_close(y[written], dense[written], 1e-5)
    numpy.testing.assert_array_equal(y[~written], base[~written])


def _folded(xp, rng, channels, bottleneck, dtype):
    weights = sbnet_cupy.random_bottleneck_weights(rng, channels, bottleneck, numpy.float64)
    folded = sbnet_cupy.fold_batchnorm(weights)
    # Weights rounded to the dtype first, so that the reference sees what the kernels see.
    for name in ("conv1", "conv2", "conv3"):
        folded[name] = folded[name].astype(dtype).astype(numpy.float64)
    ours = {k: tuple(xp.asarray(a, numpy.float32) for a in v) if isinstance(v, tuple)
            else xp.asarray(v, dtype if k.startswith("conv") else numpy.float32)
            for k, v in folded.items()}
    return folded, ours


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16])
@pytest.mark.parametrize("channels, bottleneck, bsize_out", [
    (12, 4, (8, 8)), (9, 5, (6, 6)), (96, 24, (16, 16)), (33, 17, (10, 14)),
    (64, 64, (32, 32)), (130, 48, (8, 8))])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("pair", [True, False], ids=["pair", "three"])
def test_sparse_res_block_fused_equals_dense(rng, monkeypatch, staging, dtype, channels,
                                             bottleneck, bsize_out, inplace, pair):
    """The unit in three launches, or with its 3x3 and last 1x1 as one (block_conv_pair, where
    the 3x3 streams and its tile holds every bottleneck channel)."""
    monkeypatch.setattr(block_conv, "PAIR", pair)
    _poison_pool()
    shape = (2, 41, 53)
    x, folded, ours, params, indices, count = _res_unit_inputs(
        cupy, rng, dtype, channels, bottleneck, bsize_out, shape, 4)
    x_d = cupy.asarray(x)
    y = to_numpy(sbnet_cupy.sparse_res_block_bottleneck(
        x_d, cupy.asarray(count), cupy.asarray(indices), params, ours, inplace=inplace,
        method="fused"))
    if inplace:
        assert numpy.array_equal(to_numpy(x_d), y)
    _check_res_unit(y, x, folded, indices, count, params, dtype)


def _res_unit_inputs(xp, rng, dtype, channels, bottleneck, bsize_out, shape, n_blocks):
    """x, the folded unit (float64, and ours on xp), its block geometry and a block list of
    n_blocks blocks, bad rows and two padding rows."""
    x = (random_array(rng, shape + (channels,), numpy.float32) / 8).astype(dtype)
    folded, ours = _folded(xp, rng, channels, bottleneck, dtype)
    params = sbnet_cupy.calc_block_params_res_block(
        shape[1:], tuple(b + 2 for b in bsize_out), [(1, 1), (3, 3), (1, 1)])
    indices, count = _block_list(rng, shape[0], params.bcount, n_blocks, 2)
    return x, folded, ours, params, indices, count


def _check_res_unit(y, x, folded, indices, count, params, dtype):
    """y is the dense unit on the counted blocks' output pixels and x elsewhere."""
    dense = sbnet_cupy.res_block_bottleneck(x.astype(numpy.float64), folded)
    written = _written(indices, int(count[0]), x.shape[:3], params.bsize_out)
    assert written.any() and not written.all()
    _assert_close(y[written].astype(numpy.float64), dense[written],
                  3e-3 if dtype == numpy.float32 else 1e-2)
    numpy.testing.assert_array_equal(y[~written], x[~written])


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16])
def test_sparse_res_block_fused_every_block(rng, dtype):
    """Every block active: enough tiles that each runs on one warp group (no split reduction),
    and the whole image equals the dense unit."""
    shape, channels, bottleneck = (1, 150, 203), 16, 8
    x = (random_array(rng, shape + (channels,), numpy.float32) / 8).astype(dtype)
    folded, ours = _folded(cupy, rng, channels, bottleneck, dtype)
    params = sbnet_cupy.calc_block_params_res_block(shape[1:], (10, 10),
                                                    [(1, 1), (3, 3), (1, 1)])
    found = sbnet_cupy.reduce_mask(cupy.ones(shape, cupy.float32), params.bcount,
                                   bsize=params.bsize, boffset=params.boffset,
                                   bstride=params.bstrides)
    assert int(found.bin_counts[0]) == params.bcount[0] * params.bcount[1] > 400
    y = to_numpy(sbnet_cupy.sparse_res_block_bottleneck(
        cupy.asarray(x), found.bin_counts, found.active_block_indices, params, ours,
        method="fused"))
    dense = sbnet_cupy.res_block_bottleneck(x.astype(numpy.float64), folded)
    _assert_close(y.astype(numpy.float64), dense, 3e-3 if dtype == numpy.float32 else 1e-2)


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_dependent_launches_equal_plain_ones(rng, monkeypatch, dtype, graphed):
    """A stage of in-place units (each unit's first convolution reads what the previous unit's
    last one wrote; reduce_mask before them) with the block convolutions launched as programmatic
    dependents (sm_90) gives what plain launches give, bit for bit, eagerly and in a CUDA graph."""

    shape, channels, bottleneck = (2, 45, 61), 32, 16
    x = (random_array(rng, shape + (channels,), numpy.float32) / 8).astype(dtype)
    mask = cupy.asarray(rng.random(shape) < 0.05, numpy.float32)
    units = [_folded(cupy, rng, channels, bottleneck, dtype)[1] for _ in range(4)]
    params = sbnet_cupy.calc_block_params_res_block(shape[1:], (10, 10),
                                                    [(1, 1), (3, 3), (1, 1)])

    def stage(y):
        found = sbnet_cupy.reduce_mask(mask, params.bcount, bsize=params.bsize,
                                       boffset=params.boffset, bstride=params.bstrides,
                                       capacity=params.bcount[0] * params.bcount[1] * shape[0])
        for ours in units:
            sbnet_cupy.sparse_res_block_bottleneck(y, found.bin_counts, found.active_block_indices,
                                                   params, ours, inplace=True, method="fused")
        return found  # the graph's block list: kept until the graph has run

    def run(dependent):  # on a stream of its own: the default stream takes no dependents
        monkeypatch.setattr(_launch, "DEPENDENT_LAUNCH", dependent)
        stream = cupy.cuda.Stream(non_blocking=True)
        # The mask and weights were made on the default stream, which a non-blocking stream
        # does not wait for.
        stream.wait_event(cupy.cuda.get_current_stream().record())
        with stream:
            y = cupy.asarray(x)
            if graphed:
                stage(cupy.asarray(x))  # compiles and caches outside the capture
                stream.begin_capture()
                found = stage(y)
                graph = stream.end_capture()
                graph.launch(stream)
            else:
                found = stage(y)
            stream.synchronize()
        del found
        return to_numpy(y)

    plain = run(False)
    assert not numpy.array_equal(plain, x)
    numpy.testing.assert_array_equal(run(True), plain)


def test_tile_channels_pad_least_and_fill_the_gpu():
    pick = block_conv.tile_channels
    assert pick(24, 1000, 4, 132) == 32   # 48 and 64 pad more
    assert pick(40, 1000, 4, 132) == 48
    assert pick(96, 128, 4, 132) == 32    # ties with 48, which pays only where it pads less
    assert pick(96, 16, 2, 132) == 32     # conv-5's first 1x1
    assert pick(192, 128, 1, 132) == 64   # conv-3's last 1x1: 384 tiles of 64
    assert pick(256, 48, 1, 132) == 32    # conv-4's last 1x1: 192 tiles of 64 would not
    assert pick(64, 48, 1, 132) == 32     # conv-4's 3x3
    assert pick(5, 0, 1, 132) == 32


@requires_gpu
@pytest.mark.parametrize("width", block_conv.TILE_CHANNELS)
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16])
def test_every_tile_width(rng, monkeypatch, staging, width, dtype):
    """Each tile width the rule can pick, forced, on channel counts that leave a part tile."""
    monkeypatch.setattr(block_conv, "TILE_CHANNELS", (width,))
    block_conv._tile_channels.cache_clear()
    try:
        test_sparse_res_block_fused_equals_dense(rng, monkeypatch, staging, dtype, 70, 40, (8, 8),
                                                False, True)
    finally:
        monkeypatch.undo()
        block_conv._tile_channels.cache_clear()


def test_k_groups_fill_the_gpu():
    ctas = (528, 264, 132, 132)
    assert block_conv.k_groups(1000, 20, ctas) == 1
    assert block_conv.k_groups(40, 20, ctas) == 4
    assert block_conv.k_groups(40, 2, ctas) == 2
    assert block_conv.k_groups(100, 20, ctas) == 3


def test_method_is_checked(rng):
    x = numpy.ones((1, 8, 8, 2), numpy.float32)
    w = numpy.ones((3, 3, 2, 2), numpy.float32)
    params = sbnet_cupy.calc_block_params((8, 8), (6, 6), (3, 3))
    found = sbnet_cupy.reduce_mask(numpy.ones((1, 8, 8), numpy.float32), params.bcount,
                                   bsize=params.bsize, boffset=params.boffset,
                                   bstride=params.bstrides)
    with pytest.raises(ValueError, match="method"):
        sbnet_cupy.sparse_conv2d(x, w, *found[::-1], params, method="fast")
    with pytest.raises(ValueError, match="needs CuPy arrays"):
        sbnet_cupy.sparse_conv2d(x, w, *found[::-1], params, method="fused")
    if HAS_GPU:
        with pytest.raises(TypeError, match="float64"):
            sbnet_cupy.sparse_conv2d(cupy.asarray(x, numpy.float64), cupy.asarray(w),
                                     *(cupy.asarray(a) for a in found[::-1]), params,
                                     method="fused")


def test_halo_layout_and_chunks():
    """block_conv_halo's shared memory, as kernels/blocks/block_conv.cu's halo_layout lays it out,
    and the chunks the launch picks: T1 conv-2's 3x3 (24 channels, blocks of 16) is one chunk on 6
    halo rows of 18 pixels; 48 channels on blocks of 8 are two chunks of 24 unless the slots must
    fit 96 KB (then three of 16); no chunk fits where even 8 words a row do not."""
    layout, chunk = block_conv.halo_layout, block_conv.halo_chunk
    assert layout(4, 24, (3, 3), (16, 16), 32, 24) == (1, (108 + 9 * 32) * 28 * 4)
    assert layout(2, 96, (3, 3), (8, 8), 32, 48) == (2, 2 * (100 + 9 * 32) * 28 * 4)
    assert layout(4, 8, (5, 5), (3, 40), 48, 8) == (1, ((3 + 4) * 44 + 25 * 48) * 12 * 4)
    assert chunk(4, 24, (3, 3), (16, 16), 32, 96 * 1024) == 24
    assert chunk(2, 96, (3, 3), (8, 8), 32, 228 * 1024) == 48
    assert chunk(4, 48, (3, 3), (8, 8), 48, 228 * 1024) == 24
    assert chunk(4, 48, (3, 3), (8, 8), 48, 96 * 1024) == 16
    assert chunk(4, 8, (5, 5), (3, 200), 64, 16 * 1024) is None
    # Warp groups splitting the chunks: two slots each where a group takes several chunks, one
    # where it takes one; at least room for the partial sums of the groups past the first.
    slot = (100 + 9 * 32) * 36 * 4
    assert layout(4, 96, (3, 3), (8, 8), 32, 32, 2) == (3, 2 * 2 * slot)
    assert layout(4, 96, (3, 3), (8, 8), 32, 32, 3) == (3, 3 * slot)
    assert layout(4, 8, (3, 1), (1, 1), 64, 8, 1) == (1, (3 + 3 * 64) * 12 * 4)
    assert layout(4, 32, (3, 1), (1, 1), 32, 8, 4) == (4, 3 * 16 * 128 * 4)
