"""Convolutions on a list of blocks run straight from and into the NHWC tensors, on tensor cores
(kernels/blocks/block_conv.cu): what sparse_conv2d and sparse_res_block_bottleneck use on the GPU in
place of gather -> GEMM -> scatter.

One launch convolves every listed block: it reads the block and its halo from the source (an
image through the block list, or a stack of per-block intermediates), multiplies on tensor
cores (TF32 for float32, fp16, bf16; fp32 accumulation) and writes or adds the output pixels
into the destination. The kernels read the block count from the device and loop over the tiles
of the counted blocks only, so a generous capacity costs nothing. A bottleneck unit is two
launches (1x1 into a stack, then block_conv_pair: the 3x3 from the stack, each tile kept in
shared memory for the 1x1 added into the image), or three where the pair does not apply.
"""

import functools
import math
import os
from collections import namedtuple

from ..core import checks as _checks, kernels as _kernels, launch as _launch, records as _records
from ..core import plan as _plans

# The kernels' argument records (sbnet_cupy/core/records.py): the launches below pass their values
# in these records' order.
BLOCK_SIDE = _records.BLOCK_SIDE
BLOCK_CONV_ARGS = _records.BLOCK_CONV_ARGS
BLOCK_CONV_PAIR_ARGS = _records.BLOCK_CONV_PAIR_ARGS
# As block_conv_tile in the kernel: threads of a warp group, output pixels a tile, words of the
# reduction a stage, words a shared-memory tile row, stages a warp group keeps in shared memory.
THREADS, TILE_PIXELS, TILE_WORDS, PITCH, SLOTS = 128, 64, 32, 36, 3
TILE_CHANNELS = (32, 48, 64)  # output channels a tile: the kernel's BN choices
MAX_K_GROUPS = 4  # warp groups that may split a tile's reduction (the kernel's launch bounds)
DTYPES = ("float32", "float16", "bfloat16")  # float32 runs as TF32

# The output side of a launch: "Assign" writes, "Add" adds without atomics (the output blocks
# of a list must not overlap, which reduce_mask's lists of stride-1 geometry never do).
OPS = ("Assign", "Add")

# ctas[g - 1]: CTAs of g warp groups that the GPU holds at once (as many entries as the shared
# memory allows groups).
BlockConvPlan = namedtuple("BlockConvPlan", ["function", "group_bytes", "ctas"])
# block_conv_halo's: channels a chunk and chunks; by group count (1, 2, ...) the shared bytes (0
# where they do not fit) and the CTAs the GPU holds; the GPU's SMs.
HaloPlan = namedtuple("HaloPlan", ["function", "chunk", "chunks", "shared", "ctas", "sms"])


def image_side(height, width, boffset, bstride):
    """A side that is an NHWC image [N, height, width, C]: block (n, hi, wi) of the list starts
    at (boffset[0] + bstride[0] * hi, boffset[1] + bstride[1] * wi). The values of a BlockSide,
    in its order (tests/core/test_records.py checks them against BLOCK_SIDE.values)."""
    return (height, width, boffset[0], boffset[1], bstride[0], bstride[1], 0)


def stack_side(bh, bw):
    """A side that is a stack [rows, bh, bw, C], one entry per row of the block list (a
    BlockSide's values, as image_side's)."""
    return (bh, bw, 0, 0, 0, 0, 1)


def tf32_allowed():
    """Whether CuPy lets float32 matrix products run as TF32 (CUPY_TF32=1): sparse_conv2d's
    method="auto" follows it for float32, as cuBLAS does."""
    return os.environ.get("CUPY_TF32", "0") != "0"


def stride_one(block_params, kernel_size):
    """Whether block_params (calc_block_params) describe a stride-1 convolution of kernel_size,
    the geometry the kernels compute: output blocks bsize - k + 1, tiled without overlap."""
    return all(b - o == k - 1 and s == o for b, o, k, s in zip(
        block_params.bsize, block_params.bsize_out, kernel_size, block_params.bstrides))


def instantiations():
    """Every block_conv<T, BN, V, Op>, block_conv_halo<T, BN, Op> and block_conv_pair<T, BN,
    BN2> the plans can ask for."""
    names = []
    for name in DTYPES:
        itemsize, ctype = _kernels.ITEMSIZES[name], _kernels.ARITHMETIC_CTYPES[name]
        for bn in TILE_CHANNELS:
            for vector in (v for v in (1, 2, 4, 8) if v * itemsize <= 16):
                names += [_kernels.name_expression("block_conv", ctype, bn, vector, op)
                          for op in OPS]
            names += [_kernels.name_expression("block_conv_halo", ctype, bn, op) for op in OPS]
            names += [_kernels.name_expression("block_conv_pair", ctype, bn, bn2)
                      for bn2 in TILE_CHANNELS]
    return names


_kernels.register_instantiations("block_conv", instantiations)

# How the reduction reaches shared memory: "auto" (the rule in _halo_plan), or forced: "streamed"
# (block_conv: 32-word stages of the flattened taps and channels) or "halo" (block_conv_halo,
# where it applies).
STAGING = "auto"
# "auto" takes the halo for float32 (TF32) where its channels are one chunk of at most
# HALO_AUTO_CHANNELS, or where the launch splits its chunks over at least HALO_AUTO_GROUPS warp
# groups: where it measured faster (bench/README.md, "Staging"). Two groups measured level with
# the streamed stages; fp16 and bf16 stream.
HALO_AUTO_CHANNELS = 24
HALO_AUTO_GROUPS = 3


def halo_layout(itemsize, cin, kernel_size, out_size, width, chunk, groups=1):
    """kernels/blocks/block_conv.cu halo_layout: (chunks, bytes of shared memory a CTA) of
    block_conv_halo for this convolution with tiles of `width` output channels, `chunk`
    channels a chunk and `groups` warp groups splitting the chunks."""
    (kh, kw), (oh, ow) = kernel_size, out_size
    pitch = chunk * itemsize // 4 + 4
    in_w = ow + kw - 1
    # A tile starts at a multiple of TILE_PIXELS: at most ow - gcd(TILE_PIXELS, ow) into a row.
    spanned = (ow - math.gcd(TILE_PIXELS, ow) + TILE_PIXELS - 1) // ow + 1
    pixels = (min(oh, spanned) + kh - 1) * in_w
    slot_words = (pixels + kh * kw * width) * pitch
    chunks = math.ceil(cin / chunk)
    group_words = (2 if chunks > groups else 1) * slot_words
    # Groups past the first leave their float sums (2 * width / 16 * 4 a thread) in the slots.
    partial_words = (groups - 1) * width // 2 * THREADS
    return chunks, max(groups * group_words, partial_words) * 4


def halo_chunk(itemsize, cin, kernel_size, out_size, width, limit):
    """Channels a chunk for block_conv_halo (a multiple of the MMA's k), or None where none fits
    in `limit` bytes: the fewest chunks of at most 32, 16 or 8 words whose slots fit, the
    channels split evenly between them (48 as two of 24, not 32 and 16)."""
    kstep = 32 // itemsize
    for words in (TILE_WORDS, TILE_WORDS // 2, TILE_WORDS // 4):
        chunks = math.ceil(cin / (words * 4 // itemsize))
        chunk = math.ceil(math.ceil(cin / chunks) / kstep) * kstep
        if halo_layout(itemsize, cin, kernel_size, out_size, width, chunk)[1] <= limit:
            return chunk
    return None


def tile_channels(cout, rows, pixel_tiles, sms):
    """Output channels a tile for `rows` blocks of `pixel_tiles` pixel tiles each: the narrowest
    of the widths that pad cout least, or the widest width where it pads as little and its tiles
    still give each of the `sms` SMs two. Wide tiles load each input tile once for more
    channels; where blocks are few, narrow ones keep more of the GPU busy; 48 pays only where it
    pads less (measured on the res-unit benchmarks: bench/README.md)."""
    padded = [math.ceil(cout / bn) * bn for bn in TILE_CHANNELS]
    least = [bn for bn, p in zip(TILE_CHANNELS, padded) if p == min(padded)]
    widest = max(TILE_CHANNELS)
    if widest in least and rows * pixel_tiles * math.ceil(cout / widest) >= 2 * sms:
        return widest
    return min(least)


@functools.lru_cache(maxsize=1024)
def _plan(device, dtype_name, cin, width, alignment, op):
    itemsize = _kernels.ITEMSIZES[dtype_name]
    vector = next(v for v in (8, 4, 2, 1)
                  if v * itemsize <= 16 and cin % v == 0 and alignment % (v * itemsize) == 0)
    function = _launch.function(device, "block_conv", "block_conv",
                                _kernels.ARITHMETIC_CTYPES[dtype_name], width, vector, op)
    driver, info = _launch.driver, _launch.device_info(device)
    group_bytes = SLOTS * (TILE_PIXELS + width) * PITCH * 4
    max_groups = max(1, min(MAX_K_GROUPS, info.shared_per_block_optin // group_bytes))
    driver.funcSetAttribute(function,
                            driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            max_groups * group_bytes)
    ctas = tuple(_plans.resident_ctas(function, THREADS * groups, groups * group_bytes, device)
                 for groups in range(1, max_groups + 1))
    return BlockConvPlan(function, group_bytes, ctas)


@functools.lru_cache(maxsize=1024)
def _halo_plan(device, dtype_name, cin, width, kernel_size, out_size, alignment, op, staging):
    """The HaloPlan of block_conv_halo for this convolution, or None where block_conv streams it:
    1x1 kernels, no channels, vectors narrower than 16 bytes, slots past the shared memory, or
    (under "auto") other than float32."""
    itemsize = _kernels.ITEMSIZES[dtype_name]
    vector = 16 // itemsize
    if (staging == "streamed" or kernel_size == (1, 1) or cin == 0 or cin % vector
            or alignment % 16):
        return None
    driver, info = _launch.driver, _launch.device_info(device)
    limit = info.shared_per_block_optin
    chunk = halo_chunk(itemsize, cin, kernel_size, out_size, width, limit)
    if chunk is None or staging == "auto" and dtype_name != "float32":
        return None
    chunks = math.ceil(cin / chunk)
    # By group count: shared bytes, or 0 where they do not fit (groups that take two chunks
    # need two slots each, so 3 groups on 3 chunks may fit where 2 do not).
    shared = [halo_layout(itemsize, cin, kernel_size, out_size, width, chunk, groups)[1]
              for groups in range(1, min(MAX_K_GROUPS, chunks) + 1)]
    shared = tuple(b if b <= limit else 0 for b in shared)
    function = _launch.function(device, "block_conv", "block_conv_halo",
                                _kernels.ARITHMETIC_CTYPES[dtype_name], width, op)
    driver.funcSetAttribute(function, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            limit)
    ctas = tuple(bytes_ and _plans.resident_ctas(function, THREADS * groups, bytes_, device)
                 for groups, bytes_ in enumerate(shared, 1))
    return HaloPlan(function, chunk, chunks, shared, ctas, info.sms)


@functools.lru_cache(maxsize=4096)
def _tile_channels(device, cout, rows, pixel_tiles):
    return tile_channels(cout, rows, pixel_tiles, _launch.device_info(device).sms)


def k_groups(tiles, stages, ctas):
    """Warp groups to split each tile's reduction over: enough that `tiles` tiles fill the GPU
    (ctas: the plan's CTAs by group count), no more than the reduction has stages."""
    groups = 1
    while groups < min(len(ctas), stages) and tiles * groups < ctas[0] // 2:
        groups += 1
    return groups


def _halo_groups(plan, tiles, cin):
    """Warp groups of a block_conv_halo launch (_halo_plan's `plan`) of `tiles` tiles, or 0
    where "auto" streams it instead. The chunks are split until the tiles' groups give each SM
    four (halo CTAs with their large slots are often one an SM, where the streamed kernel's are
    four); then the group count nearest that whose slots fit, the larger of two."""
    wanted = k_groups(tiles, plan.chunks, (8 * plan.sms,) * len(plan.shared))
    groups = min((g for g, bytes_ in enumerate(plan.shared, 1) if bytes_),
                 key=lambda g: (abs(g - wanted), -g))
    if (STAGING == "auto" and groups < HALO_AUTO_GROUPS
            and not plan.chunk == cin <= HALO_AUTO_CHANNELS):
        return 0
    return groups


def launch_block_conv(device, stream, dtype_name, src, dst, weight, indices, counts, rows,
                      n_batch, cin, cout, kernel_size, out_size, src_side, dst_side, *, bias=0,
                      scale=0, shift=0, relu_out=False, zero_outside=False, op="Assign"):
    """One block_conv launch on raw addresses (arguments already checked).

    src: the source side's tensor with cin channels; dst: the destination's with cout channels
    (sides from image_side / stack_side); weight [cout, KH, KW, cin] of dtype_name (OHWI, the
    memory order of a channels_last torch weight); bias [cout], scale and shift [cin] float32 or
    0; indices [rows, 3] and counts [1] int32 (the block list). Each listed block's out_size
    output pixels are computed from the source block at the same position plus the kernel's
    taps, and written or added (`op`) at the destination block."""
    (oh, ow), (kh, kw) = out_size, kernel_size
    if rows == 0 or cout == 0 or oh * ow == 0:
        return
    alignment = _checks.alignment(src, weight)
    width, tiles, halo, groups = _tiling(device, dtype_name, cin, cout, rows, kernel_size,
                                         out_size, alignment, op, prologue=bool(scale))
    # BLOCK_CONV_ARGS's fields up to `paired`, in order; then k_groups, the steps, halo_chunk.
    arguments = (src, dst, weight, bias, scale, shift, indices, counts, rows, n_batch, cin, cout,
                 kh, kw, oh, ow, *src_side, *dst_side, bool(relu_out), bool(zero_outside),
                 _paired(dtype_name, cout, dst))
    if groups:
        _launch.launch(device, stream, halo.function, (min(tiles, halo.ctas[groups - 1]), 1, 1),
                       (THREADS * groups, 1, 1), halo.shared[groups - 1], BLOCK_CONV_ARGS,
                       (*arguments, groups, 0, 0, 0, halo.chunk), dependent=True)
        return
    plan = _plan(device, dtype_name, cin, width, alignment, op)
    groups, steps = _streamed_groups(dtype_name, cin, kernel_size, tiles, plan.ctas)
    _launch.launch(device, stream, plan.function, (min(tiles, plan.ctas[groups - 1]), 1, 1),
                   (THREADS * groups, 1, 1), groups * plan.group_bytes, BLOCK_CONV_ARGS,
                   (*arguments, groups, *steps, 0), dependent=True)


def _tiling(device, dtype_name, cin, cout, rows, kernel_size, out_size, alignment, op,
            prologue=False):
    """(tile width, tiles, HaloPlan, warp groups) of a launch: the halo's plan and groups where
    block_conv_halo takes it, else None and 0 (block_conv streams it; always with a
    prologue)."""
    pixel_tiles = math.ceil(out_size[0] * out_size[1] / TILE_PIXELS)
    width = _tile_channels(device, cout, rows, pixel_tiles)
    tiles = _tile_count(rows, out_size, cout, width)
    halo = None if prologue else _halo_plan(device, dtype_name, cin, width, kernel_size,
                                            out_size, alignment, op, STAGING)
    return width, tiles, halo, (halo and _halo_groups(halo, tiles, cin)) or 0


def _tile_count(rows, out_size, cout, width):
    tiles = rows * math.ceil(out_size[0] * out_size[1] / TILE_PIXELS) * math.ceil(cout / width)
    if tiles >= 2**31:  # the kernels count tiles in int
        raise ValueError(f"active_block_indices has too many rows: {rows}")
    return tiles


def _paired(dtype_name, cout, dst):
    """Whether the epilogue writes two channels as one access."""
    return cout % 2 == 0 and _checks.alignment(dst) % (2 * _kernels.ITEMSIZES[dtype_name]) == 0


def _streamed_groups(dtype_name, cin, kernel_size, tiles, ctas):
    """Warp groups of a streamed launch, and each group's step from one of its stages to the
    next: (taps down, taps across, channels)."""
    stage = TILE_WORDS * 4 // _kernels.ITEMSIZES[dtype_name]  # reduction elements a stage
    groups = k_groups(tiles, math.ceil(kernel_size[0] * kernel_size[1] * cin / stage), ctas)
    step_taps, step_channels = divmod(groups * stage, cin) if cin else (0, 0)
    return groups, (*divmod(step_taps, kernel_size[1]), step_channels)


# Whether a unit's 3x3 and last 1x1 run as one launch (block_conv_pair) where they can.
PAIR = True


def pair_width(bottleneck, channels, dtype_name, alignment):
    """(BN, BN2) of block_conv_pair for a unit's 3x3 (bottleneck channels, 16-byte vectors) and
    last 1x1 (bottleneck -> channels), or None where it does not apply: a 3x3 tile must hold
    every bottleneck channel, and each weight row of the 1x1 whole 16-byte copies. BN2: the
    widest of the widths that pad channels least (a CTA takes the 1x1's tiles in turn)."""
    itemsize = _kernels.ITEMSIZES[dtype_name]
    if (bottleneck == 0 or bottleneck > max(TILE_CHANNELS) or bottleneck * itemsize % 16
            or alignment % 16):
        return None
    padded = {bn: math.ceil(channels / bn) * bn for bn in TILE_CHANNELS}
    return (min(bn for bn in TILE_CHANNELS if bn >= bottleneck),
            max(bn for bn in TILE_CHANNELS if padded[bn] == min(padded.values())))


@functools.lru_cache(maxsize=1024)
def _pair_plan(device, dtype_name, bn, bn2):
    """block_conv_pair's function, and by group count (1, 2, ...) its shared bytes and the CTAs
    the GPU holds."""
    itemsize = _kernels.ITEMSIZES[dtype_name]
    function = _launch.function(device, "block_conv", "block_conv_pair",
                                _kernels.ARITHMETIC_CTYPES[dtype_name], bn, bn2)
    driver, info = _launch.driver, _launch.device_info(device)
    limit = info.shared_per_block_optin
    pitch2 = bn * itemsize // 4 + 4
    shared = tuple(max(groups * SLOTS * (TILE_PIXELS + bn) * PITCH,
                       (TILE_PIXELS + groups * bn2) * pitch2) * 4
                   for groups in range(1, MAX_K_GROUPS + 1))
    shared = tuple(b for b in shared if b <= limit)
    driver.funcSetAttribute(function, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            shared[-1])
    ctas = tuple(_plans.resident_ctas(function, THREADS * groups, bytes_, device)
                 for groups, bytes_ in enumerate(shared, 1))
    return function, shared, ctas


def launch_conv(device, stream, dtype_name, x, y, weight, bias, indices, counts, rows, x_shape,
                y_shape, kernel_size, block_params):
    """A stride-1 convolution of x [N, H, W, cin] on the listed blocks into y [N, H', W', cout]
    (block_params from calc_block_params, stride_one; weight OHWI, bias float32 or 0)."""
    n, height, width, cin = x_shape
    launch_block_conv(device, stream, dtype_name, x, y, weight, indices, counts, rows, n, cin,
                      y_shape[3], kernel_size, block_params.bsize_out,
                      image_side(height, width, block_params.boffset, block_params.bstrides),
                      image_side(y_shape[1], y_shape[2], (0, 0), block_params.bsize_out),
                      bias=bias)


def launch_res_unit(device, stream, dtype_name, x, y, weights, indices, counts, rows, x_shape,
                    bottleneck, block_params, stacks):
    """SBNet's bottleneck unit on the listed blocks, added into y (x itself, or a copy of it):
    1x1 (bn1 and ReLU on load, bias and ReLU, zero outside the image) into stacks[0]
    [rows, bh, bw, K], 3x3 (bias, ReLU) into stacks[1] [rows, bh - 2, bw - 2, K], 1x1 added
    into y; the 3x3 and the last 1x1 as one block_conv_pair launch (stacks[1] unused) where
    PAIR and pair_width allow it and the 3x3 streams. weights: addresses of (scale, shift, w1,
    b1, w2, b2, w3), convolutions OHWI in dtype_name, the rest float32. block_params:
    calc_block_params_res_block's, stride 1."""
    n, height, width, channels = x_shape
    scale, shift, w1, b1, w2, b2, w3 = weights
    (bh, bw), (oh, ow) = block_params.bsize, block_params.bsize_out
    first, middle = stacks
    image_in = image_side(height, width, block_params.boffset, block_params.bstrides)
    common = (device, stream, dtype_name)
    launch_block_conv(*common, x, first, w1, indices, counts, rows, n, channels, bottleneck,
                      (1, 1), (bh, bw), image_in, stack_side(bh, bw), bias=b1, scale=scale,
                      shift=shift, relu_out=True, zero_outside=True)
    image_out = image_side(height, width, (0, 0), block_params.bsize_out)
    widths = PAIR and pair_width(bottleneck, channels, dtype_name,
                                 _checks.alignment(first, w2, w3))
    # The pair where the 3x3 streams (block_conv_halo would take it as launch_block_conv plans).
    if widths and not _tiling(device, dtype_name, bottleneck, bottleneck, rows, (3, 3), (oh, ow),
                              _checks.alignment(first, w2), "Assign")[3]:
        bn, bn2 = widths
        function, shared, ctas = _pair_plan(device, dtype_name, bn, bn2)
        tiles = _tile_count(rows, (oh, ow), bottleneck, bn)
        groups, steps = _streamed_groups(dtype_name, bottleneck, (3, 3), tiles, ctas)
        # BLOCK_CONV_PAIR_ARGS in order: the 3x3's BlockConvArgs, then the 1x1's fields.
        _launch.launch(device, stream, function, (min(tiles, ctas[groups - 1]), 1, 1),
                       (THREADS * groups, 1, 1), shared[groups - 1], BLOCK_CONV_PAIR_ARGS,
                       (first, middle, w2, b2, 0, 0, indices, counts, rows, n, bottleneck,
                        bottleneck, 3, 3, oh, ow, *stack_side(bh, bw), *stack_side(oh, ow), True,
                        False, False, groups, *steps, 0, y, w3, channels, *image_out,
                        _paired(dtype_name, channels, y)), dependent=True)
        return
    launch_block_conv(*common, first, middle, w2, indices, counts, rows, n, bottleneck,
                      bottleneck, (3, 3), (oh, ow), stack_side(bh, bw), stack_side(oh, ow),
                      bias=b2, relu_out=True)
    launch_block_conv(*common, middle, y, w3, indices, counts, rows, n, bottleneck, channels,
                      (1, 1), (oh, ow), stack_side(oh, ow), image_out, op="Add")
