"""The convolution's kernels (kernels/submanifold/submanifold.cu): the gemm algorithm's gather, the
fused convolution (with the split sum after it where its taps are split over CTAs) and the neighbour
masks that Rulebook.fused_order sorts rows by (the weight's gradient: grad_kernels).

Each launch is one function of a backend (sbnet_cupy/core/backend.py: CUPY, torch_bridge's
TORCH) and its arrays, which the CuPy entry points and the torch ops both call; the launches are
KernelPlans (sbnet_cupy/core/plan.py) cached per shapes, dtype, device and options; the fused
convolution's per layer, without its number of sites, which sizes its grid and split per call.
"""

import functools
from collections import namedtuple

from ..core import checks as _checks, kernels as _kernels, launch as _launch
from ..core import plan as _plan, records as _records
from .cuda_rulebook import RULE_KERNELS, THREADS, grid
from .validation import MAX_DIMS

_FUSED_SITES, _FUSED_THREADS = 64, 128  # output sites a CTA; its threads
_TALL_SITES, _TALL_SLOTS = 128, 2  # output sites a CTA of tall tiles (fused_tall); their slots
_TALL_CTAS_PER_SM = 2  # tall tiles where the sites make at least this many of them an SM
_TALL_WIDE = 128  # output channels of a tall 128-wide tile (fused_tall_wide)
# A tall 128-wide CTA's time over a 64-wide one's (twice the MMAs, each neighbour row read once
# for 128 channels: 1.4-1.6x measured at 128 channels, less at 256; bench/README).
_TALL_WIDE_COST = 1.5
FUSED_TILES = (16, 32, 64, 96, 128)  # output channels a CTA (fused_config)
MAX_STAGE = 128  # the fused kernel's widest stage, bytes of a row (fused_config)
_FUSED_SLOT_BYTES = 37888  # static shared memory for stages (FUSED_SLOT_BYTES, submanifold.cu)
_ROW_PADDING = 16  # bytes after each staged row (mma_pitch, common.cuh: 4 words)


def _fused_shared(stage, tile, slots, sites=_FUSED_SITES):
    """Dynamic shared memory (bytes) of the fused kernel's `slots` stages of `sites` sites and
    `tile` channels, rows of `stage` bytes and their padding."""
    return slots * (sites + tile) * (stage + _ROW_PADDING)


def _static_slots(stage, tile):
    """Stages of `stage` bytes a row in tiles of _FUSED_SITES sites and `tile` channels that
    fit in the fused kernel's static shared memory."""
    return _FUSED_SLOT_BYTES // _fused_shared(stage, tile, 1)


# The (vector, stage, tile, slots) the fused kernel is built for: every stage a row can take
# with every tile where two slots or more fit in static shared memory (slots 0), and 128-byte
# stages of 96- and 128-wide tiles in two slots of dynamic shared memory.
FUSED_CONFIGS = (tuple((vector, stage, tile, 0) for vector in (False, True)
                       for stage in ((32, 64, 128) if vector else (32, 64)) for tile in FUSED_TILES
                       if _static_slots(stage, tile) >= 2)
                 + ((True, 128, 96, 2), (True, 128, 128, 2)))
_FUSED_CTAS_PER_SM = 2  # taps are split over CTAs until the grid has this many an SM
SORT_ROWS = True  # the fused kernel takes output rows sorted by neighbour mask (fused_sorts)
_SORT_WORK = 1 << 29  # n_out x cin x cout from which it does
_SORT_EVERY = False  # every layer sorts, whatever its work and tiles (tests)
_FUSED_DTYPES = ("float16", "bfloat16", "float32")


def gather_rows(backend, features, neighbors):
    """[N_out, K * C] of features [N_in, C] (a backend's array): row o is features[neighbors[k,
    o]] for k = 0..K-1 side by side, zeros where the int32 map neighbors [K, N_out] is -1."""
    taps, n_out = neighbors.shape
    features = backend.contiguous(features)
    channels = features.shape[1]
    out = backend.empty((n_out, taps * channels), features)
    row_bytes = channels * _kernels.ITEMSIZES[backend.dtype_name(features)]
    if n_out * taps == 0 or row_bytes == 0:
        return out
    device = backend.device(features)
    src, dst = backend.pointer(features), backend.pointer(out)
    word = _kernels.widest_access(row_bytes, _checks.alignment(src, dst))
    words = row_bytes // word
    _gather_plan(device, word).launch(backend.stream(device), src, dst,
                                      backend.pointer(neighbors), n_out, taps, words,
                                      grid=grid(n_out * taps * words))
    return out


@functools.lru_cache(maxsize=None)
def _gather_plan(device, word):
    return _plan.KernelPlan(device, "submanifold", "submanifold_gather",
                            (_kernels.STORAGE_CTYPES[word],), (1, 1, 1), (THREADS, 1, 1), 0,
                            _records.GATHER_ARGS)


def tap_masks(backend, neighbors):
    """int32 [n]: the neighbour masks of the rows of the int32 map neighbors [taps, n] (a
    backend's array), bit k set where the row has tap k (the first 32 taps)."""
    taps, n = neighbors.shape
    masks = backend.empty((n,), neighbors, "int32")
    if n:
        device = backend.device(neighbors)
        _masks_plan(device, "tap_masks", "int").launch(
            backend.stream(device), backend.pointer(neighbors), backend.pointer(masks), 0, 0, n,
            taps, grid=grid(n))
    return masks


@functools.lru_cache(maxsize=None)
def _masks_plan(device, kernel, ctype):
    """The KernelPlan of a MaskArgs kernel (tap_masks<Mask>, ordered_map<Index>): a grid-stride
    loop over the map's rows."""
    return _plan.KernelPlan(device, "submanifold", kernel, (ctype,), (1, 1, 1), (THREADS, 1, 1),
                            0, _records.MASK_ARGS)


def ordered_map(backend, neighbors, order):
    """Rulebook.fused_order's rows, int32 [1 + taps, n]: row 0 the permutation `order` (int64
    [n]: an argsort of tap_masks), rows 1.. the columns of the int32 map neighbors [taps, n] in
    that order (backend arrays)."""
    taps, n = neighbors.shape
    rows = backend.empty((1 + taps, n), neighbors, "int32")
    if n:
        device = backend.device(neighbors)
        _masks_plan(device, "ordered_map", "long long").launch(
            backend.stream(device), backend.pointer(neighbors), 0, backend.pointer(order),
            backend.pointer(rows), n, taps, grid=grid(n))
    return rows


def fused_sorts(n_out, cin, cout, itemsize):
    """Whether the fused kernel takes the output rows in Rulebook.fused_order's order: where
    SORT_ROWS is on, the layer's work (n_out x cin x cout) is large enough that the taps its
    tiles skip pay for the sort's GPU and host time, and its output channels do not fit one
    channel tile that may be tall (tall_tiles: 64 channels or fewer, the detectors' layers),
    which at such sizes takes unsorted rows in less time than sorted 64-site tiles with the
    sort. Wider layers (128 and 256 channels in 64-wide tiles, 96-wide decoders) sort
    (bench/README's A/B)."""
    if not SORT_ROWS:
        return False
    if _SORT_EVERY:
        return True
    if n_out * cin * cout < _SORT_WORK:
        return False
    tile = fused_config(True, itemsize, cout)[1]
    return tile < cout or not tall_tiles(itemsize, tile)


def fused_conv(backend, features, weight, bias, neighbors, order=None, relu=False):
    """The fused convolution of a backend's arrays: features [N_in, cin], weight [cout, *kernel,
    cin] and bias [cout] (or None) of one dtype ("float16", "bfloat16", or "float32" as TF32),
    through the int32 map neighbors [taps, n_out]; returns out [n_out, cout]. order: int32
    [1 + taps, n_out] (Rulebook.fused_order): row 0 a permutation of the output rows in which
    tiles take them, rows 1.. the map's columns in that order (neighbors[:, order[0]]); or None:
    0, 1, ... relu: out = max(0, out), in the kernel's epilogue. Split taps write float32
    partial sums to the backend's scratch, which a second kernel adds up with the bias (and
    takes the ReLU)."""
    taps, n_out = neighbors.shape
    cin, cout = features.shape[1], weight.shape[0]
    features, weight = backend.contiguous(features), backend.contiguous(weight)
    out = backend.empty((n_out, cout), features)
    if n_out == 0 or cout == 0:
        return out
    dtype = backend.dtype_name(features)
    width = padded_width(cin, _kernels.ITEMSIZES[dtype])
    if width != cin:
        features, weight = backend.padded(features, width), backend.padded(weight, width)
        cin = width
    device = backend.device(features)
    x, w = backend.pointer(features), backend.pointer(weight)
    plan = _fused_plan(device, dtype, _checks.alignment(x, w) == 16, cin, cout, taps, bool(relu))
    tall = fused_tall(device, plan, n_out, order is not None)
    wide = tall and fused_tall_wide(plan, n_out, order is not None)
    conv = plan.tall_wide if wide else plan.tall if tall else plan.conv
    # A layer with tall 128-wide tiles has 64-wide ones (fused_config) in pairs.
    channel_tiles = plan.channel_tiles // 2 if wide else plan.channel_tiles
    grid, split_taps = fused_grid(device, n_out, channel_tiles, taps,
                                  _TALL_SITES if tall else _FUSED_SITES)
    stream = backend.stream(device)
    bias = None if bias is None else backend.contiguous(bias)  # kept until the launches
    b = backend.pointer(bias)
    order = None if order is None else backend.contiguous(order)  # kept until the launches
    order_at = backend.pointer(order)
    # The map in the tiles' order: order's rows after the first, or neighbors as they are.
    map_at = order_at + 4 * n_out if order_at else backend.pointer(neighbors)
    splits = grid[2]
    if splits == 1:
        conv.launch(stream, x, w, b, map_at, backend.pointer(out), 0, n_out, cin, cout, taps,
                    split_taps, order_at, int(relu), grid=grid)
        return out
    # Split taps: the kernel writes partial sums (no bias, no out), the split sum the rest;
    # _owner keeps the scratch until both launches are queued.
    partial, _owner = backend.float_scratch(device, splits * n_out * cout)
    conv.launch(stream, x, w, 0, map_at, 0, partial, n_out, cin, cout, taps, split_taps,
                order_at, 0, grid=grid)
    plan.split_sum.launch(stream, partial, b, backend.pointer(out), n_out, cout, cout, splits,
                          grid=_plan.split_sum_grid(n_out, cout))
    return out


def padded_width(cin, itemsize):
    """The channels the fused kernel takes rows of cin channels as: rows narrower than 32 bytes
    that are not whole 16-byte vectors (the 3-5 features of a LiDAR voxel) padded with zeros to
    the next 16 bytes, which the kernel copies with cp.async and packs several taps into a
    k-step of, where it would stage each tap through registers as one k-step of its own; other
    rows as they are."""
    row = cin * itemsize
    return cin if row % 16 == 0 or row >= 32 else -(-row // 16) * 16 // itemsize


def fused_config(vector, itemsize, cout):
    """(stage, tile, slots) of the fused kernel: bytes of a row staged at a time, output
    channels a CTA, and stages in dynamic shared memory (0: those that fit in static memory).
    The tile is the narrowest of 16, 32, 64 and 96 that holds cout, so narrow layers (and the
    96 channels of segmentation U-Nets' decoders) do no MMA work on padding; wider layers take
    tiles of 64 where cout is a multiple of 64, else of 128, which gather each neighbour row
    once where 64-wide tiles would pad as much. Rows of 16-byte vectors are staged MAX_STAGE
    bytes at a time (narrower rows pack several taps into a stage, so every stage is whole
    k-steps of the MMA), but for 96- and 128-wide tiles: through two slots of dynamic shared
    memory (one would fit in static memory), except 16-bit types in 128-wide tiles, 64 bytes at
    a time in static memory; odd rows 16 elements at a time, one k-step of a 16-bit MMA or two
    of TF32, as their loads through registers are the stage's time.
    bench.submanifold_tiles measures every configuration per layer."""
    tile = next((width for width in FUSED_TILES[:-1] if cout <= width), None)
    if tile is None:
        tile = 64 if cout % 64 == 0 else 128
    if not vector:
        return min(MAX_STAGE, 16 * itemsize), tile, 0
    if tile <= 64:
        return MAX_STAGE, tile, 0
    # 128-byte stages of 96- and 128-wide tiles fit only in dynamic shared memory: there they
    # take 0.84-0.95x the time of 64-byte ones in TF32 and in 16-bit 96-wide tiles, the same in
    # 16-bit 128-wide ones.
    return (MAX_STAGE, tile, 2) if itemsize == 4 or tile == 96 else (64, tile, 0)


def tall_tiles(itemsize, tile):
    """Whether a layer of `itemsize`-byte items in channel tiles of `tile` may take tall tiles
    (_TALL_SITES sites, rows of 16-byte vectors staged MAX_STAGE bytes at a time through
    _TALL_SLOTS slots of dynamic shared memory; fused_tall): tiles of 16-64 channels in 16-bit
    types, 32-64 in TF32, where 16-channel tall tiles measured slower than 64-site ones."""
    return tile <= 64 and (itemsize == 2 or tile > 16)


def tall_wide_tiles(itemsize, cout):
    """Whether a layer of `itemsize`-byte items and cout output channels may take tall 128-wide
    tiles (128 sites x 128 channels, four warps of 64 x 64; fused_tall_wide) where it takes tall
    ones: 16-bit types, cout a multiple of 128 (which fused_config gives 64-wide tiles)."""
    return itemsize == 2 and cout % _TALL_WIDE == 0


def _fused_static_shared(sites):
    """Static shared memory of the fused kernel beside dynamic slots, in tiles of `sites` sites:
    the map's rows of a group of taps, the output rows, the active taps (a bound, for the
    opt-in check)."""
    return 32 * sites * 4 + 1024


# A layer's fused convolution, planned once for every number of output sites (which real frames
# change every frame): the kernel's KernelPlan, its CTAs across the output channels, the split
# sum's KernelPlan for calls that split the taps (None for one tap), the kernel's KernelPlan in
# tall tiles (None where the layer never takes them: fused_tall), and in tall 128-wide tiles
# (None where it never takes them: fused_tall_wide). Each call passes the sizes that depend on
# its sites: the grid (fused_grid) and the split sum's rows and splits.
FusedPlan = namedtuple("FusedPlan", ["conv", "channel_tiles", "split_sum", "tall", "tall_wide"])


@functools.lru_cache(maxsize=1024)
def _fused_plan(device, dtype, aligned, cin, cout, taps, relu=False):
    """The FusedPlan of a layer; aligned: whether features and weight start at 16 bytes; relu:
    whether the split sum takes the ReLU (the conv kernel's is each call's)."""
    itemsize = _kernels.ITEMSIZES[dtype]
    vector = aligned and cin * itemsize % 16 == 0
    stage, tile, slots = fused_config(vector, itemsize, cout)
    shared = _fused_shared(stage, tile, slots)
    optin = _launch.device_info(device).shared_per_block_optin
    if shared + _fused_static_shared(_FUSED_SITES) > optin:
        # A GPU with less shared memory a CTA: the widest stage built for static slots.
        stage = max(s for v, s, t, static in FUSED_CONFIGS
                    if (v, t, static) == (vector, tile, 0) and s <= stage)
        slots, shared = 0, 0
    ctype = _kernels.ARITHMETIC_CTYPES[dtype]
    conv = _fused_kernel(device, (ctype, vector, stage, tile) + ((slots,) if slots else ()),
                         shared)
    split_sum = (None if taps == 1 else
                 _plan.split_sum_plan(device, "submanifold", ctype, dependent=True, relu=relu))
    tall = _tall_kernel(device, ctype, tile, optin, vector and tall_tiles(itemsize, tile))
    tall_wide = _tall_kernel(device, ctype, _TALL_WIDE, optin,
                             tall is not None and tall_wide_tiles(itemsize, cout))
    return FusedPlan(conv, _checks.grid_dim("output channels", -(-cout // tile)), split_sum, tall,
                     tall_wide)


def _tall_kernel(device, ctype, tile, optin, takes):
    """The KernelPlan of the fused kernel in tall tiles `tile` channels wide, where the layer
    `takes` them and their shared memory fits a CTA; else None."""
    shared = _fused_shared(MAX_STAGE, tile, _TALL_SLOTS, _TALL_SITES)
    if not takes or shared + _fused_static_shared(_TALL_SITES) > optin:
        return None
    return _fused_kernel(device, (ctype, True, MAX_STAGE, tile, _TALL_SLOTS, _TALL_SITES), shared)


@functools.lru_cache(maxsize=1024)
def _resident(conv):
    """How many CTAs of the fused KernelPlan `conv` its GPU runs at once (the occupancy API)."""
    return _plan.resident_ctas(conv.function, _FUSED_THREADS, conv.shared_mem, conv.device)


def _fused_kernel(device, template_args, shared):
    """The KernelPlan of submanifold_fused<template_args> (a programmatic dependent launch, grid
    per call), opted into `shared` bytes of dynamic shared memory where it takes any."""
    conv = _plan.KernelPlan(device, "submanifold", "submanifold_fused", template_args, (1, 1, 1),
                            (_FUSED_THREADS, 1, 1), shared, _records.FUSED_ARGS, dependent=True)
    if shared:
        _plan.max_dynamic_shared(conv, shared)
    return conv


def fused_tall(device, plan, n_out, sorted_rows):
    """Whether a call of the layer planned as `plan` (a FusedPlan) at n_out output sites takes
    tiles of _TALL_SITES sites: where the plan has them (tall_tiles, rows of 16-byte vectors,
    the shared memory for their slots), the rows are not sorted (sorted rows share fewer taps
    over 64 sites than over 128; but layers with tall 128-wide tiles, the detectors' 128-channel
    levels, measured faster in tall tiles on sorted rows too), and the tall tiles alone give the
    GPU _TALL_CTAS_PER_SM CTAs an SM (fewer leave SMs idle). A weight slice then serves twice the
    sites, and a warp's fragment loads twice the MMAs (bench.conv_time measures the rule)."""
    return (plan.tall is not None and (not sorted_rows or plan.tall_wide is not None)
            and -(-n_out // _TALL_SITES) * plan.channel_tiles
            >= _TALL_CTAS_PER_SM * _launch.device_info(device).sms)


def fused_tall_wide(plan, n_out, sorted_rows):
    """Whether a call that takes tall tiles (fused_tall) takes the plan's tall 128-wide ones
    instead. Half the CTAs, but fewer fit an SM (twice the accumulators). On rows sorted by
    neighbour mask: where the 64-wide tall tiles take more than one round of the CTAs the GPU
    runs at once (measured faster at every such size; where 64-wide ones fit in one round, the
    128-wide grid fills under three quarters of one and measured slower). On unsorted rows:
    where their grid takes fewer rounds by more than their CTAs' extra time (_TALL_WIDE_COST):
    they pay where 64-wide tiles would run a nearly empty last round."""
    if plan.tall_wide is None:
        return False
    tiles = -(-n_out // _TALL_SITES)
    rounds = -(-tiles * plan.channel_tiles // _resident(plan.tall))
    if sorted_rows:
        return rounds > 1
    wide_rounds = -(-tiles * (plan.channel_tiles // 2) // _resident(plan.tall_wide))
    return wide_rounds * _TALL_WIDE_COST < rounds


def fused_grid(device, n_out, channel_tiles, taps, tile_sites=_FUSED_SITES):
    """(grid, split_taps) of the fused kernel at n_out output sites: CTAs of tile_sites sites x
    channel_tiles x splits of the taps, each summing split_taps of them (fused_splits)."""
    sites = _checks.grid_dim("output sites", -(-n_out // tile_sites), 2**31 - 1)
    split_taps = -(-taps // fused_splits(device, sites * channel_tiles, taps))
    return (sites, channel_tiles, -(-taps // split_taps)), split_taps


def fused_splits(device, tiles, taps):
    """How many splits of the taps the fused kernel runs with `tiles` CTAs of sites x channels
    (plan.reduction_splits: at most _FUSED_CTAS_PER_SM CTAs an SM, at most one a tap). Few sites
    make few tiles, and then one CTA's long chain of stages would be the kernel's time."""
    return _plan.reduction_splits(tiles, taps, _launch.device_info(device).sms,
                                  _FUSED_CTAS_PER_SM, round_up=False)


def instantiations():
    """Name expressions of the kernels of kernels/submanifold/submanifold.cu that this module
    launches (the rulebooks', the gather, the fused convolution and its split sum, the masks;
    the package adds grad_kernels' and registers them all for the compile check)."""
    fused = [_kernels.ARITHMETIC_CTYPES[dtype] for dtype in _FUSED_DTYPES]
    return ([_kernels.name_expression(rule, dims) for rule in RULE_KERNELS
             for dims in range(1, MAX_DIMS + 1)]
            + [_kernels.name_expression("submanifold_fused", ctype, vector, stage, tile,
                                        *((slots,) if slots else ()))
               for ctype in fused for vector, stage, tile, slots in FUSED_CONFIGS]
            + [_kernels.name_expression("submanifold_fused", _kernels.ARITHMETIC_CTYPES[dtype],
                                        True, MAX_STAGE, tile, _TALL_SLOTS, _TALL_SITES)
               for dtype in _FUSED_DTYPES for tile in FUSED_TILES
               if tall_tiles(_kernels.ITEMSIZES[dtype], tile)
               or tile == _TALL_WIDE and tall_wide_tiles(_kernels.ITEMSIZES[dtype], tile)]
            + [_kernels.name_expression("split_sum", ctype) for ctype in fused]
            + [_kernels.name_expression("tap_masks", "int"),
               _kernels.name_expression("ordered_map", "long long")]
            + [_kernels.name_expression("submanifold_gather", word)
               for word in _kernels.STORAGE_CTYPES.values()])
