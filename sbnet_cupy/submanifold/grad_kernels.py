"""The weight's gradient of the convolution (kernels/submanifold/submanifold.cu's
submanifold_grad_weight, and the tap_pairs kernels that list each tap's sites for it), on any
backend's arrays, as conv_kernels' launches: KernelPlans cached per layer, grids per call."""

import functools
from collections import namedtuple

from ..core import checks as _checks, kernels as _kernels, launch as _launch
from ..core import plan as _plan, records as _records
from .conv_kernels import _FUSED_DTYPES, padded_width

_GRAD_THREADS = 128  # a CTA of the weight's gradient
# Its tiles, (columns (tap, ci), output channels) a CTA (grad_weight_config): 64 columns by 16,
# 32 or 64 channels over every site; 128 x 128 over the sites of one tap (tap_pairs).
GRAD_TILES = ((64, 16), (64, 32), (64, 64), (128, 128))
_GRAD_NARROW = 64 * 64  # cin x cout up to which tiles take every site
_PAIR_SITES, _PAIR_THREADS = 1024, 256  # sites a CTA of the tap_pairs kernels, its threads
_GRAD_SPLIT_SITES = 256  # a split of the sites is a multiple of this many
_GRAD_CTAS_PER_SM = 4  # sites are split over CTAs until the grid has this many an SM
# By pairs, a tap's CTAs cover the sites that have it, about half of them in LiDAR layers, while
# the splits are cut from all the sites: about half of the CTAs find no work, so the grid aims at
# more (6 measured best on MinkUNet's, UNetV2's and VoxelResBackBone8x's training steps).
_GRAD_PAIRS_CTAS_PER_SM = 6


def grad_weight_fits(dtype, cin, cout, aligned):
    """Whether grad_weight's kernel can take a layer: a fused dtype, rows of dy whole 16-byte
    vectors, rows of the features too once padded (padded_width), arrays 16-byte aligned
    (aligned)."""
    itemsize = _kernels.ITEMSIZES.get(dtype)
    return (dtype in _FUSED_DTYPES and aligned and cout * itemsize % 16 == 0
            and padded_width(cin, itemsize) * itemsize % 16 == 0)


def grad_weight_takes(backend, features, dy):
    """Whether the weight's gradient of features [N_in, cin] and dy [n_out, cout] (a backend's
    arrays) goes through grad_weight's kernel: where it can (grad_weight_fits) and cin x cout is
    at most 64 x 64 or cin at least 64, where it measured faster than writing and reading the
    gathered rows for cuBLAS (bench.submanifold_grad_weight); narrow inputs to wide outputs take
    the gathered rows."""
    cin, cout = features.shape[1], dy.shape[1]
    aligned = _checks.alignment(backend.pointer(features), backend.pointer(dy)) == 16
    return ((cin * cout <= _GRAD_NARROW or cin >= 64)
            and grad_weight_fits(backend.dtype_name(features), cin, cout, aligned))


def grad_weight_config(cin, cout):
    """(columns, channels, by_pairs) of grad_weight's tile for a layer of cin (padded) and cout
    channels: up to 64 x 64 channels, 64 columns across taps by the narrowest of 16, 32 and 64
    channels that holds cout (else 64), over every site; wider layers with cin >= 64, 128 x 128
    over the sites that have each tap (tap_pairs): the rows of a tap's pairs are gathered from
    all over memory, and the wider tile reads each of them fewer times."""
    if cin >= 64 and cin * cout > _GRAD_NARROW:
        return 128, 128, True
    return 64, next((n for m, n in GRAD_TILES if m == 64 and cout <= n), 64), False


def grad_weight(backend, features, dy, neighbors, out_dtype):
    """The weight's gradient of the convolution of features [N_in, cin] through the int32 map
    neighbors [taps, n_out] whose output's gradient is dy [n_out, cout] (a backend's arrays of
    one dtype that grad_weight_fits): dw [cout, taps, cin] in out_dtype ("float32", or the
    features' dtype), dw[co, k, ci] = sum over o of dy[o, co] * features[neighbors[k, o], ci],
    summed in float32 (TF32 products for float32) in a deterministic order. Splits of the sites
    write float32 sums to the backend's scratch, which split_sum adds up. Layers wider than 64 x
    64 channels with cin >= 64 multiply only the sites that have each tap (tap_pairs)."""
    taps, n_out = neighbors.shape
    cin, cout = features.shape[1], dy.shape[1]
    dtype = backend.dtype_name(features)
    width = padded_width(cin, _kernels.ITEMSIZES[dtype])
    if width != cin:
        features = backend.padded(features, width)
    features, dy = backend.contiguous(features), backend.contiguous(dy)
    same = out_dtype == dtype  # (the emulated backend's bfloat16 is no NumPy dtype)
    if n_out == 0 or cout * taps * width == 0:  # a sum of nothing
        return backend.zeros((cout, taps, cin), features, None if same else out_dtype)
    out = backend.empty((cout, taps, width), features, None if same else out_dtype)
    device = backend.device(features)
    plan = _grad_weight_plan(device, dtype, width, cout, taps, out_dtype)
    grid, split_sites = grad_weight_grid(device, n_out, plan.tiles, plan.tiles_per_tap > 0)
    stream = backend.stream(device)
    cols, splits = taps * width, grid[2]
    pairs = totals = None
    if plan.tiles_per_tap:
        pairs, totals, _counts = tap_pairs(backend, neighbors)
    direct = splits == 1 and out_dtype == "float32"
    sums, _owner = ((backend.pointer(out), None) if direct
                    else backend.float_scratch(device, splits * cout * cols))
    plan.conv.launch(stream, backend.pointer(features), backend.pointer(dy),
                     backend.pointer(neighbors), sums, n_out, width, cout, taps, split_sites,
                     backend.pointer(pairs), backend.pointer(totals), plan.tiles_per_tap,
                     grid=grid)
    if not direct:
        plan.split_sum.launch(stream, sums, 0, backend.pointer(out), cout, cols, cols, splits,
                              grid=_plan.split_sum_grid(cout, cols))
    return out if width == cin else out[..., :cin]


def tap_pairs(backend, neighbors):
    """(pairs, totals, counts) of the int32 map neighbors [taps, n_out] (a backend's array, n_out
    > 0): pairs [taps, n_out] whose row k starts with the sites o that have tap k (neighbors[k,
    o] >= 0), in order, and totals [taps] how many; counts is the first pass's scratch, kept until
    the launches are queued."""
    taps, n_out = neighbors.shape
    blocks = -(-n_out // _PAIR_SITES)
    pairs, totals = backend.empty((taps, n_out), neighbors), backend.empty((taps,), neighbors)
    counts = backend.empty((taps, blocks), neighbors)
    device = backend.device(neighbors)
    stream = backend.stream(device)
    args = [backend.pointer(a) for a in (neighbors, counts, pairs, totals)] + [n_out, blocks]
    grid = (_checks.grid_dim("site blocks", blocks, 2**31 - 1), _checks.grid_dim("taps", taps), 1)
    for plan in _pairs_plans(device):
        plan.launch(stream, *args, grid=grid)
    return pairs, totals, counts


@functools.lru_cache(maxsize=None)
def _pairs_plans(device):
    return tuple(_plan.KernelPlan(device, "submanifold", kernel, (_PAIR_THREADS,), (1, 1, 1),
                                  (_PAIR_THREADS, 1, 1), 0, _records.PAIR_ARGS)
                 for kernel in ("tap_pair_counts", "tap_pairs"))


# A layer's weight gradient, planned once for every number of sites: the kernel's KernelPlan, its
# CTAs across dw's columns and output channels, column tiles a tap where it multiplies the sites
# of each tap alone (0: every site, tiles across taps), the split sum's KernelPlan.
GradWeightPlan = namedtuple("GradWeightPlan", ["conv", "tiles", "tiles_per_tap", "split_sum"])


@functools.lru_cache(maxsize=1024)
def _grad_weight_plan(device, dtype, cin, cout, taps, out_dtype):
    """The GradWeightPlan of a layer (cin: the padded width) into out_dtype."""
    columns, channels, by_pairs = grad_weight_config(cin, cout)
    ctype = _kernels.ARITHMETIC_CTYPES[dtype]
    conv = _plan.KernelPlan(device, "submanifold", "submanifold_grad_weight",
                            (ctype, columns, channels), (1, 1, 1), (_GRAD_THREADS, 1, 1), 0,
                            _records.GRAD_WEIGHT_ARGS, dependent=True)
    split_sum = _plan.split_sum_plan(device, "submanifold", _kernels.ARITHMETIC_CTYPES[out_dtype],
                                     dependent=True)
    tiles_per_tap = -(-cin // columns) if by_pairs else 0
    tiles = (_checks.grid_dim("weight columns", taps * tiles_per_tap if by_pairs
                              else -(-taps * cin // columns)),
             _checks.grid_dim("output channels", -(-cout // channels)))
    return GradWeightPlan(conv, tiles, tiles_per_tap, split_sum)


def grad_weight_grid(device, n_out, tiles, by_pairs=False):
    """(grid, split_sites) of the weight's gradient at n_out output sites: its tiles x splits of
    the sites (multiples of _GRAD_SPLIT_SITES), so that the GPU gets about _GRAD_CTAS_PER_SM CTAs
    an SM (_GRAD_PAIRS_CTAS_PER_SM by pairs)."""
    parts = max(1, -(-n_out // _GRAD_SPLIT_SITES))
    splits = _plan.reduction_splits(tiles[0] * tiles[1], parts, _launch.device_info(device).sms,
                                    _GRAD_PAIRS_CTAS_PER_SM if by_pairs else _GRAD_CTAS_PER_SM)
    split_sites = -(-parts // splits) * _GRAD_SPLIT_SITES
    return (*tiles, max(1, -(-n_out // split_sites))), split_sites


def instantiations():
    """Name expressions of the kernels this module launches (the compile check builds them)."""
    return ([_kernels.name_expression("submanifold_grad_weight", _kernels.ARITHMETIC_CTYPES[dtype],
                                      columns, channels)
             for dtype in _FUSED_DTYPES for columns, channels in GRAD_TILES]
            + [_kernels.name_expression(kernel, _PAIR_THREADS)
               for kernel in ("tap_pair_counts", "tap_pairs")])
