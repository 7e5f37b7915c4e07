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

# A kernel's launches by warp-group count g: plans[g - 1] the KernelPlan of g groups (block,
# shared memory, and BlockConvArgs's fields from k_groups on), ctas[g - 1] the CTAs of it that
# the GPU holds at once (as many entries as the shared memory allows groups); stages: the
# reduction's 32-word stages.
BlockConvPlan = namedtuple("BlockConvPlan", ["plans", "ctas", "stages"])
# block_conv_halo's: channels a chunk and chunks; by group count (1, 2, ...) the KernelPlan
# (None where its shared bytes do not fit), the shared bytes (0 where they do not fit) and the
# CTAs the GPU holds; the GPU's SMs.
HaloPlan = namedtuple("HaloPlan", ["plans", "chunk", "chunks", "shared", "ctas", "sms"])
# block_conv_pair's: by group count, the KernelPlan (a launch passes its whole record: the 3x3's
# plan fields come before the 1x1's) and the CTAs the GPU holds; the 3x3's stages, and by group
# count its BlockConvArgs fields from k_groups on.
PairPlan = namedtuple("PairPlan", ["plans", "ctas", "stages", "conv_tails"])


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
def _plan(device, dtype_name, cin, width, alignment, op, kernel_size):
    """The BlockConvPlan of block_conv (the streamed stages) for this convolution."""
    itemsize = _kernels.ITEMSIZES[dtype_name]
    vector = next(v for v in (8, 4, 2, 1)
                  if v * itemsize <= 16 and cin % v == 0 and alignment % (v * itemsize) == 0)
    group_bytes = SLOTS * (TILE_PIXELS + width) * PITCH * 4
    max_groups = max(1, min(MAX_K_GROUPS,
                            _launch.device_info(device).shared_per_block_optin // group_bytes))
    plans = tuple(_plans.KernelPlan(device, "block_conv", "block_conv",
                                    (_kernels.ARITHMETIC_CTYPES[dtype_name], width, vector, op),
                                    (1, 1, 1), (THREADS * groups, 1, 1), groups * group_bytes,
                                    BLOCK_CONV_ARGS,
                                    _streamed_tail(dtype_name, cin, kernel_size, groups),
                                    dependent=True)
                  for groups in range(1, max_groups + 1))
    function = _plans.max_dynamic_shared(plans[-1], max_groups * group_bytes)
    ctas = tuple(_plans.resident_ctas(function, THREADS * groups, groups * group_bytes, device)
                 for groups in range(1, max_groups + 1))
    return BlockConvPlan(plans, ctas, _stages(dtype_name, cin, kernel_size))


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
    info = _launch.device_info(device)
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
    ctype = _kernels.ARITHMETIC_CTYPES[dtype_name]
    plans = tuple(bytes_ and _plans.KernelPlan(
        device, "block_conv", "block_conv_halo", (ctype, width, op), (1, 1, 1),
        (THREADS * groups, 1, 1), bytes_, BLOCK_CONV_ARGS,
        BLOCK_CONV_ARGS.tail(k_groups=groups, step_taps_y=0, step_taps_x=0, step_channels=0,
                             halo_chunk=chunk), dependent=True) or None
        for groups, bytes_ in enumerate(shared, 1))
    function = _plans.max_dynamic_shared(next(p for p in plans if p), limit)
    ctas = tuple(bytes_ and _plans.resident_ctas(function, THREADS * groups, bytes_, device)
                 for groups, bytes_ in enumerate(shared, 1))
    return HaloPlan(plans, chunk, chunks, shared, ctas, info.sms)


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
    if groups:
        plan, ctas = halo.plans[groups - 1], halo.ctas[groups - 1]
    else:
        streamed = _plan(device, dtype_name, cin, width, alignment, op, kernel_size)
        groups = k_groups(tiles, streamed.stages, streamed.ctas)
        plan, ctas = streamed.plans[groups - 1], streamed.ctas[groups - 1]
    # BLOCK_CONV_ARGS's fields up to `paired`, in order (the plan's from k_groups on).
    plan.launch(stream, src, dst, weight, bias, scale, shift, indices, counts, rows, n_batch, cin,
                cout, kh, kw, oh, ow, *src_side, *dst_side, bool(relu_out), bool(zero_outside),
                _paired(dtype_name, cout, dst), grid=(min(tiles, ctas), 1, 1))


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


def _stages(dtype_name, cin, kernel_size):
    """The 32-word stages of a streamed launch's reduction (its taps and channels)."""
    stage = TILE_WORDS * 4 // _kernels.ITEMSIZES[dtype_name]  # reduction elements a stage
    return math.ceil(kernel_size[0] * kernel_size[1] * cin / stage)


def _streamed_tail(dtype_name, cin, kernel_size, groups):
    """BLOCK_CONV_ARGS's fields from k_groups on of a streamed launch of `groups` warp groups:
    each group's step from one of its stages to the next (taps down, taps across, channels)."""
    stage = TILE_WORDS * 4 // _kernels.ITEMSIZES[dtype_name]
    step_taps, step_channels = divmod(groups * stage, cin) if cin else (0, 0)
    step_taps_y, step_taps_x = divmod(step_taps, kernel_size[1])
    return BLOCK_CONV_ARGS.tail(k_groups=groups, step_taps_y=step_taps_y,
                                step_taps_x=step_taps_x, step_channels=step_channels,
                                halo_chunk=0)


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
def _pair_plan(device, dtype_name, bn, bn2, bottleneck):
    """The PairPlan of block_conv_pair for a unit of `bottleneck` channels."""
    itemsize = _kernels.ITEMSIZES[dtype_name]
    limit = _launch.device_info(device).shared_per_block_optin
    pitch2 = bn * itemsize // 4 + 4
    shared = tuple(max(groups * SLOTS * (TILE_PIXELS + bn) * PITCH,
                       (TILE_PIXELS + groups * bn2) * pitch2) * 4
                   for groups in range(1, MAX_K_GROUPS + 1))
    shared = tuple(b for b in shared if b <= limit)
    plans = tuple(_plans.KernelPlan(device, "block_conv", "block_conv_pair",
                                    (_kernels.ARITHMETIC_CTYPES[dtype_name], bn, bn2), (1, 1, 1),
                                    (THREADS * groups, 1, 1), bytes_, BLOCK_CONV_PAIR_ARGS,
                                    dependent=True)
                  for groups, bytes_ in enumerate(shared, 1))
    function = _plans.max_dynamic_shared(plans[-1], shared[-1])
    ctas = tuple(_plans.resident_ctas(function, THREADS * groups, bytes_, device)
                 for groups, bytes_ in enumerate(shared, 1))
    return PairPlan(plans, ctas, _stages(dtype_name, bottleneck, (3, 3)),
                    tuple(_streamed_tail(dtype_name, bottleneck, (3, 3), groups)
                          for groups in range(1, len(shared) + 1)))


def launch_conv(backend, x, y, weight, bias, indices, counts, block_params):
    """A stride-1 convolution of a backend's arrays (core/backend.py: CUPY, torch_bridge's
    TORCH), checked and C-contiguous: x [N, H, W, cin] on the listed blocks (int32 indices
    [rows, 3] and counts [1]) into y [N, H', W', cout]; weight [cout, KH, KW, cin] (OHWI) in
    x's dtype, bias float32 [cout] or None; block_params from calc_block_params, stride_one."""
    n, height, width, cin = x.shape
    device = backend.device(x)
    launch_block_conv(device, backend.stream(device), backend.dtype_name(x), backend.pointer(x),
                      backend.pointer(y), backend.pointer(weight), backend.pointer(indices),
                      backend.pointer(counts), indices.shape[0], n, cin, y.shape[3],
                      tuple(weight.shape[1:3]), block_params.bsize_out,
                      image_side(height, width, block_params.boffset, block_params.bstrides),
                      image_side(y.shape[1], y.shape[2], (0, 0), block_params.bsize_out),
                      bias=backend.pointer(bias))


def launch_res_unit(backend, x, y, weights, indices, counts, block_params):
    """SBNet's bottleneck unit on the listed blocks of a backend's arrays (as launch_conv's),
    added into y (x itself, or a C-contiguous copy of it): 1x1 (bn1 and ReLU on load, bias and
    ReLU, zero outside the image) into a stack [rows, bh, bw, K], 3x3 (bias, ReLU) into a stack
    [rows, bh - 2, bw - 2, K], 1x1 added into y; the 3x3 and the last 1x1 as one block_conv_pair
    launch (no second stack) where PAIR and pair_width allow it and the 3x3 streams. weights:
    (scale, shift, w1, b1, w2, b2, w3), convolutions OHWI in x's dtype, the rest float32.
    block_params: calc_block_params_res_block's, stride 1."""
    n, height, width, channels = x.shape
    rows, bottleneck = indices.shape[0], weights[2].shape[0]
    (bh, bw), (oh, ow) = block_params.bsize, block_params.bsize_out
    device = backend.device(x)
    stream, dtype_name = backend.stream(device), backend.dtype_name(x)
    scale, shift, w1, b1, w2, b2, w3 = (backend.pointer(w) for w in weights)
    x, y, indices, counts = (backend.pointer(a) for a in (x, y, indices, counts))
    # The stacks live until the launches are queued: the allocators reuse memory in stream order.
    first_stack = backend.empty((rows, bh, bw, bottleneck), weights[2])
    first = backend.pointer(first_stack)
    common = (device, stream, dtype_name)
    launch_block_conv(*common, x, first, w1, indices, counts, rows, n, channels, bottleneck,
                      (1, 1), (bh, bw), image_side(height, width, block_params.boffset,
                                                   block_params.bstrides),
                      stack_side(bh, bw), bias=b1, scale=scale, shift=shift, relu_out=True,
                      zero_outside=True)
    image_out = image_side(height, width, (0, 0), block_params.bsize_out)
    widths = PAIR and pair_width(bottleneck, channels, dtype_name,
                                 _checks.alignment(first, w2, w3))
    # The pair where the 3x3 streams (block_conv_halo would take it as launch_block_conv plans).
    if widths and not _tiling(device, dtype_name, bottleneck, bottleneck, rows, (3, 3), (oh, ow),
                              _checks.alignment(first, w2), "Assign")[3]:
        pair = _pair_plan(device, dtype_name, *widths, bottleneck)
        tiles = _tile_count(rows, (oh, ow), bottleneck, widths[0])
        groups = k_groups(tiles, pair.stages, pair.ctas)
        # BLOCK_CONV_PAIR_ARGS in order: the 3x3's BlockConvArgs (its plan's tail for `groups`
        # groups), then the 1x1's fields.
        pair.plans[groups - 1].launch(
            stream, first, 0, w2, b2, 0, 0, indices, counts, rows, n, bottleneck, bottleneck, 3,
            3, oh, ow, *stack_side(bh, bw), *stack_side(oh, ow), True, False, False,
            *pair.conv_tails[groups - 1], y, w3, channels, *image_out,
            _paired(dtype_name, channels, y), grid=(min(tiles, pair.ctas[groups - 1]), 1, 1))
        return
    middle_stack = backend.empty((rows, oh, ow, bottleneck), weights[2])
    middle = backend.pointer(middle_stack)
    launch_block_conv(*common, first, middle, w2, indices, counts, rows, n, bottleneck,
                      bottleneck, (3, 3), (oh, ow), stack_side(bh, bw), stack_side(oh, ow),
                      bias=b2, relu_out=True)
    launch_block_conv(*common, middle, y, w3, indices, counts, rows, n, bottleneck, channels,
                      (1, 1), (oh, ow), stack_side(oh, ow), image_out, op="Add")
