"""The block convolution kernels (kernels/blocks/block_conv.cu) run on the CPU through
tests/cuda_emulation: the kernels' own code, with the CUDA features they use emulated, behind
the real launch planning, against dense references written from the definition. So CI, which
has no GPU, checks what the kernels compute; test_block_conv.py runs the same cases (and more)
on a GPU."""

import numpy
import pytest

import cuda_emulation
import reference
import sbnet_cupy
from axes import random_array
from sbnet_cupy.blocks import block_conv
from test_block_conv import (TOLERANCE, _assert_close, _block_list, _check_res_unit,
                             _res_unit_inputs, _written)

pytestmark = [pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++"),
              pytest.mark.emulated]

TOLERANCE = {**TOLERANCE, "bfloat16": 8e-3}


@pytest.fixture(scope="module")
def kernels(emulation_dir):
    return cuda_emulation.build(
        "block_conv", {name: "BlockConvPairArgs" if name.startswith("block_conv_pair")
                       else "BlockConvArgs" for name in block_conv.instantiations()},
        emulation_dir)


@pytest.fixture
def launched(monkeypatch, kernels):
    """Launches go to the emulated kernels on a GPU of 3 SMs (few CTAs: each loops over several
    tiles, and few tiles split their reduction over warp groups); the plans made for it are
    dropped after the test."""
    caches = (block_conv._plan, block_conv._halo_plan, block_conv._tile_channels,
              block_conv._pair_plan)
    for cache in caches:
        cache.cache_clear()
    yield cuda_emulation.install(monkeypatch, kernels, sms=3)
    for cache in caches:
        cache.cache_clear()


def _storage(dtype):
    """NumPy storage of a kernel dtype (bfloat16 as its upper 16 bits of float32) and back."""
    if dtype == "bfloat16":
        return (lambda a: (numpy.asarray(a, numpy.float32).view(numpy.uint32) >> 16)
                .astype(numpy.uint16),
                lambda a: (a.astype(numpy.uint32) << 16).view(numpy.float32))
    return lambda a: numpy.asarray(a, dtype), lambda a: a.astype(numpy.float64)


def _conv(dtype, x, w, bias, indices, count, params, y, *, scale=None, shift=None,
          relu_out=False, op="Assign"):
    """One block_conv launch on NumPy arrays: x [N, H, W, cin] -> y [N, H, W, cout] on the
    listed blocks of `params` (a stride-1 'same' convolution, w HWIO)."""
    store, _ = _storage(dtype)
    x, weight = store(x), store(numpy.ascontiguousarray(w.transpose(3, 0, 1, 2)))
    kernel_size = w.shape[:2]
    arrays = [x, weight, indices, count, bias, scale, shift]
    address = [0 if a is None else a.ctypes.data for a in arrays]
    block_conv.launch_block_conv(
        0, 0, dtype, address[0], y.ctypes.data, address[1], address[2], address[3],
        len(indices), x.shape[0], x.shape[3], y.shape[3], kernel_size, params.bsize_out,
        block_conv.image_side(x.shape[1], x.shape[2], params.boffset, params.bstrides),
        block_conv.image_side(y.shape[1], y.shape[2], (0, 0), params.bsize_out),
        bias=address[4], scale=address[5], shift=address[6], relu_out=relu_out, op=op)


def _case(rng, dtype, cin, cout, kernel, bsize_out, shape, *, op="Assign", prologue=False,
          relu_out=False, n_blocks=4, padding_rows=2):
    kernel_dtype = numpy.float32 if dtype == "bfloat16" else numpy.dtype(dtype)
    store, load = _storage(dtype)
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    x = random_array(rng, shape + (cin,), kernel_dtype)
    w = random_array(rng, (kh, kw, cin, cout), kernel_dtype)
    bias = random_array(rng, (cout,), numpy.float32)
    scale = shift = None
    if prologue:
        scale = random_array(rng, (cin,), numpy.float32) / 4
        shift = random_array(rng, (cin,), numpy.float32) / 4
    params = sbnet_cupy.calc_block_params(
        shape[1:], (bsize_out[0] + kh - 1, bsize_out[1] + kw - 1), (kh, kw))
    indices, count = _block_list(rng, shape[0], params.bcount, n_blocks, padding_rows)
    base = random_array(rng, shape + (cout,), kernel_dtype)
    # Added into base, or written over NaN (which the pixels left unwritten keep).
    y = store(base if op == "Add" else numpy.full(base.shape, numpy.nan, kernel_dtype)).copy()
    _conv(dtype, x, w, bias, indices, count, params, y, scale=scale, shift=shift,
          relu_out=relu_out, op=op)
    source = x.astype(numpy.float64)
    if prologue:
        source = numpy.maximum(source * scale + shift, 0)
    want = reference.conv2d_same(source, w) + bias
    if relu_out:
        want = numpy.maximum(want, 0)
    if op == "Add":
        want += base
    written = _written(indices, int(count[0]), shape, params.bsize_out)
    got = load(y)
    assert written.any()
    _assert_close(got[written], want[written],
                  TOLERANCE["bfloat16" if dtype == "bfloat16" else numpy.dtype(dtype).type])
    if op == "Add":
        numpy.testing.assert_array_equal(got[~written], load(store(base))[~written])
    else:
        assert numpy.isnan(got[~written]).all()


# The wide cases that float32 leaves to the GPU tests, each covered here in float16 and its
# float32 path by the narrower cases (float32's halo in several chunks: 48 channels, halo).
_FLOAT16_ONLY = {(48, "streamed"), (96, "streamed"), (96, "halo")}


@pytest.mark.parametrize("staging", ["streamed", "halo"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
# n_blocks: 2 where they make as many CTAs, each looping over several tiles, as 4 would.
@pytest.mark.parametrize("cin, cout, kernel, bsize_out, n_blocks", [
    (3, 5, 3, (16, 16), 4), (8, 16, 3, (6, 10), 4), (24, 24, 3, (16, 16), 2),
    (33, 40, 5, (7, 7), 4), (48, 40, 5, (7, 7), 4), (96, 64, 3, (17, 6), 2),
    (6, 70, 1, (8, 8), 4)])
def test_conv_equals_dense(rng, launched, monkeypatch, staging, dtype, cin, cout, kernel,
                           bsize_out, n_blocks):
    """Every kind of launch: 16-byte vectors through cp.async and narrower ones through
    registers, 1x1 / 3x3 / 5x5, odd channel counts, part tiles of pixels and channels, rows
    outside the batch and padding rows past the count; each staging forced (the halo's where
    it applies: wider than 1x1 on 16-byte vectors, here in one to three chunks)."""
    if dtype == "float32" and (cin, staging) in _FLOAT16_ONLY:
        pytest.skip("float32 at 48-96 channels: test_block_conv.py on the GPU (96, each staging)")
    monkeypatch.setattr(block_conv, "STAGING", staging)
    _case(rng, dtype, cin, cout, kernel, bsize_out, (2, 23, 37), n_blocks=n_blocks)
    halo = staging == "halo" and kernel > 1 and cin % (16 // numpy.dtype(dtype).itemsize) == 0
    assert launched and all(name.startswith("block_conv_halo<" if halo else "block_conv<")
                            for name, *_ in launched)


@pytest.mark.parametrize("dtype, cin, rows, groups", [
    ("float32", 24, "few", 1), ("float32", 16, "many", 1), ("float32", 48, "few", 0),
    ("float32", 96, "few", 3), ("float32", 96, "many", 0), ("float16", 24, "few", 0),
    ("float16", 192, "few", 0)])
def test_auto_staging(rng, launched, dtype, cin, rows, groups):
    """"auto" stages float32 by halo where the channels are one unpadded chunk of at most
    HALO_AUTO_CHANNELS, or where few tiles (5 rows of one tile each on 3 SMs) split the chunks
    over at least HALO_AUTO_GROUPS warp groups (96 channels: three chunks; 48 are two); with
    more tiles (16 rows) they stream, as fp16 always does (groups 0: the streamed kernel)."""
    n_blocks, padding_rows = {"few": (1, 0), "many": (10, 2)}[rows]
    _case(rng, dtype, cin, 8, 3, (6, 6), (2, 30, 30), n_blocks=n_blocks,
          padding_rows=padding_rows)
    (name, grid, block, shared), = launched
    assert name.startswith("block_conv_halo<" if groups else "block_conv<")
    assert not groups or block == groups * block_conv.THREADS


@pytest.mark.parametrize("seed", range(5))
def test_random_geometries(launched, seed):
    """Seeded random convolutions: kernels 3x3, 5x5, 3x1, 1x3 and 3x5 (one a seed), float32 and
    float16, output blocks 1 to 19 pixels a side, channel counts that are whole 16-byte vectors
    or not."""
    rng = numpy.random.default_rng(seed)
    dtype = ["float32", "float16"][seed % 2]
    cin = int(rng.integers(1, 13)) * (4 if seed % 3 else 3)
    kernel = [(3, 3), (5, 5), (3, 1), (1, 3), (3, 5)][seed % 5]
    bsize_out = tuple(int(b) for b in rng.integers(1, 20, 2))
    shape = (int(rng.integers(1, 3)), *(int(s) for s in rng.integers(4, 40, 2)))
    _case(rng, dtype, cin, int(rng.integers(1, 80)), kernel, bsize_out, shape,
          n_blocks=int(rng.integers(1, 6)), padding_rows=int(rng.integers(0, 3)))


@pytest.mark.parametrize("op", ["Assign", "Add"])
@pytest.mark.parametrize("kernel", [1, 3])
def test_prologue_relu_and_add(rng, launched, op, kernel):
    """The affine + ReLU on load (registers path), ReLU on the output, and adding into y."""
    _case(rng, "float16", 16, 24, kernel, (8, 8), (1, 19, 21), op=op, prologue=True,
          relu_out=True)


def test_bfloat16(rng, launched):
    _case(rng, "bfloat16", 16, 24, 3, (8, 8), (1, 19, 21))


def test_reduction_split_over_warp_groups(rng, launched, monkeypatch):
    """Two blocks of one tile each on 3 SMs: the streamed launch splits the 3x3's 432-element
    reduction over warp groups, whose sums group 0 adds."""
    monkeypatch.setattr(block_conv, "STAGING", "streamed")
    _case(rng, "float32", 48, 32, 3, (8, 8), (1, 16, 16), n_blocks=2, padding_rows=0)
    (name, grid, block, shared), = launched
    assert block > block_conv.THREADS


@pytest.mark.parametrize("dtype, cin, cout, groups", [
    ("float32", 96, 32, 2), ("float32", 80, 32, 2), ("float16", 160, 32, 2),
    ("float32", 200, 32, 2), ("float32", 96, 40, 3)])
def test_halo_chunks_split_over_warp_groups(rng, launched, monkeypatch, dtype, cin, cout,
                                            groups):
    """Six block-list rows of one tile each on 3 SMs: the halo launch splits its chunks (of 32
    words; the last one part-full where cin is not a multiple) over two warp groups, which take
    two and one chunks (four and three of 200 channels' seven), or over three, one chunk each,
    where two groups' two slots each would not fit (tiles of 48 channels); group 0 adds the
    other groups' sums."""
    monkeypatch.setattr(block_conv, "STAGING", "halo")
    _case(rng, dtype, cin, cout, 3, (8, 8), (1, 16, 16), n_blocks=2, padding_rows=0)
    (name, grid, block, shared), = launched
    assert name.startswith("block_conv_halo<") and block == groups * block_conv.THREADS


@pytest.mark.parametrize("count", [0, 9])
def test_count_zero_and_past_the_rows(rng, launched, count):
    shape = (1, 20, 30)
    x = random_array(rng, shape + (8,), numpy.float32)
    w = random_array(rng, (3, 3, 8, 8), numpy.float32)
    params = sbnet_cupy.calc_block_params(shape[1:], (10, 10), (3, 3))
    indices = numpy.array([(0, 0, 0), (0, 1, 2), (0, 2, 1)], numpy.int32)
    y = numpy.full(shape + (8,), numpy.nan, numpy.float32)
    _conv("float32", x, w, None, indices, numpy.array([count], numpy.int32), params, y)
    written = _written(indices, min(count, 3), shape, params.bsize_out)
    _assert_close(y[written], reference.conv2d_same(x, w)[written], 1e-5)
    assert numpy.isnan(y[~written]).all()


def _res_unit(rng, dtype, channels, bottleneck, bsize_out, shape=(1, 29, 31), n_blocks=3):
    """launch_res_unit on NumPy arrays, checked against the dense unit; its launches."""
    x, folded, ours, params, indices, count = _res_unit_inputs(
        numpy, rng, dtype, channels, bottleneck, bsize_out, shape, n_blocks)
    ohwi = [numpy.ascontiguousarray(ours[name].transpose(3, 0, 1, 2))
            for name in ("conv1", "conv2", "conv3")]
    weights = (*ours["bn1"], ohwi[0], ours["bias1"], ohwi[1], ours["bias2"], ohwi[2])
    y = x.copy()
    # The stacks come from the backend, poisoned.
    block_conv.launch_res_unit(cuda_emulation.HostMemory(), y, y, weights, indices, count,
                               params)
    _check_res_unit(y, x, folded, indices, count, params, dtype)


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16])
# n_blocks: the fewest that make the same launches (CTAs) as 3.
@pytest.mark.parametrize("channels, bottleneck, bsize_out, n_blocks", [
    (12, 4, (8, 8), 3), (33, 17, (10, 14), 1), (96, 24, (8, 16), 2)])
def test_res_unit_equals_dense(rng, launched, monkeypatch, dtype, channels, bottleneck,
                               bsize_out, n_blocks):
    """SBNet's bottleneck unit as its three launches (launch_res_unit, the pair kernel off): the
    bn1 prologue and the out-of-image zeros into a stack, the 3x3 from stack to stack, the last
    1x1 added into x."""
    monkeypatch.setattr(block_conv, "PAIR", False)
    _res_unit(rng, dtype, channels, bottleneck, bsize_out, n_blocks=n_blocks)
    assert len(launched) == 3


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16])
@pytest.mark.parametrize("channels, bottleneck, bsize_out, n_blocks", [
    (40, 8, (6, 10), 3),    # one tile of 32 channels holds 8; the 1x1's 40 as 48
    (96, 24, (16, 16), 1),  # four pixel tiles a block; the 1x1 in two tiles of 48
    (70, 48, (8, 8), 1),    # one tile, its 3x3 split over warp groups; 70 as two tiles of 48
    (130, 64, (5, 7), 2)])  # 64 channels; the 1x1 in three tiles of 48 (144)
def test_res_unit_pair_equals_dense(rng, launched, monkeypatch, dtype, channels, bottleneck,
                                    bsize_out, n_blocks):
    """The unit's 3x3 and last 1x1 as one block_conv_pair launch after the first 1x1: the 3x3's
    tile kept in shared memory and multiplied on, tile by tile of the 1x1's channels."""
    monkeypatch.setattr(block_conv, "STAGING", "streamed")
    _res_unit(rng, dtype, channels, bottleneck, bsize_out, n_blocks=n_blocks)
    names = [name for name, *_ in launched]
    assert len(names) == 2 and names[1].startswith("block_conv_pair")
