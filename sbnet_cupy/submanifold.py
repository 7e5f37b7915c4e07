"""Submanifold and strided sparse convolution (SparseConvNet; spconv's SubMConv, SparseConv and
SparseInverseConv) on lists of active sites.

A sparse tensor (SparseTensorData) is a list of N active sites: int32 coordinates [N, 1 + D]
(batch index, then D spatial coordinates, D = 1..4) and features [N, C], with the spatial shape
and the batch size. A convolution runs through a Rulebook (kernel map), built once per active
set and kernel geometry and shared by every layer that has them in common:

    neighbors[k, o]   = row of the input site that kernel tap k of output site o reads, or -1
    neighbors_t[k, i] = row of the output site that input site i feeds through tap k, or -1

with the taps k = 0..K-1 in row-major order over kernel_size (the order of the weight's kernel
axes). Per spatial axis, tap k of output coordinate o reads input coordinate

    strided:     i = o * stride - padding + k * dilation
    submanifold: i = o + (k - kernel // 2) * dilation      (stride 1, padding kernel//2 * dilation)

A submanifold convolution's output sites are its input sites; a strided one's are every o in
[0, out) (out = (in + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1) that reads at
least one active site, sorted by (batch, coordinates); an inverse convolution runs a strided
convolution's rulebook backwards (Rulebook.inverse), back to the strided convolution's input
sites.

The weight is spconv 2.x's default layout ("KRSC"): [Cout, *kernel_size, Cin], so spconv
checkpoints load unchanged. The convolution, as NumPy::

    taps = weight.reshape(Cout, K * Cin)                       # [Cout, K*Cin]
    g = x[neighbors.T]                                         # [N_out, K, Cin]
    g[neighbors.T < 0] = 0                                     # absent neighbours read zero
    y = g.reshape(N_out, K * Cin) @ taps.T + bias              # [N_out, Cout]

Its gradients are the same gather and one matrix product each (no atomics, so deterministic):
dx = rulebook_conv(dy, rulebook.inverse(), transposed_weight(weight)) and
dw = (dy.T @ g).reshape(weight.shape).

The CUDA rulebook (kernels/submanifold.cu) keeps the coordinates in an open-addressing hash
table (linearised int64 keys, linear probing, at most `capacity` probes, so a full table reports
failure instead of hanging), and looks up both maps of a submanifold convolution in one pass. A
strided convolution marks every candidate output site in a bitmap of the output grid, counts the
set bits per word (one host sync for the total), writes the sites in bitmap order, which is
sorted order, and writes both maps from its inputs' side: no hash table and no sort. The bitmap
with its word ranks is the table of the output sites, which the next rulebook on them reuses
(torch_bridge's modules pass it on; grids of more than 2**27 sites hash and sort instead). The
rulebook is a dense [K, N_out] map (-1 for absent neighbours) rather than per-tap pair lists:
building it needs no host sync for per-tap sizes, both convolution algorithms index it directly,
and a tile of output sites reads its neighbours of one tap contiguously. The convolution
(rulebook_conv's `algo`) either gathers [N_out, K*Cin] through the map and multiplies once with
cuBLAS ("gemm"), or gathers rows tile by tile into shared memory and multiplies them on tensor
cores with mma.sync in one kernel, skipping the taps that no site of a tile has ("fused"). NumPy
arrays run a vectorised NumPy backend (sorted keys and searchsorted): the reference, and the CPU
path.
"""

import functools
import math
from collections import namedtuple

import numpy

from .core import checks as _checks, kernels as _kernels, launch as _launch, records as _records
from .blocks import block_conv

_MAX_DIMS = _records.SUBM_MAX_DIMS  # spatial axes the kernels' argument records hold
_DTYPES = ("float16", "float32", "float64")
# Flags the insert kernels raise (kernels/submanifold.cu).
_FLAG_DUPLICATE, _FLAG_FULL, _FLAG_OUTSIDE = 1, 2, 4
_THREADS = 256
_MAX_BLOCKS = 65535 * 16  # grid-stride loops beyond this
_RULE_ARGS = _records.RULE_ARGS
_RANK_THREADS, _RANK_WORDS = 256, 1024  # rank_words' CTA and the bitmap words it ranks
# Largest output grid (batch x sites) a strided rulebook finds its output sites in with a bitmap
# (16 MiB of bits and 16 MiB of ranks); larger grids hash and sort the candidates instead.
_BITMAP_MAX_BITS = 1 << 27
_GATHER_ARGS, _MASK_ARGS = _records.GATHER_ARGS, _records.MASK_ARGS
_FUSED_ARGS = _records.FUSED_ARGS
_FUSED_SITES, _FUSED_THREADS = 64, 128  # output sites a CTA; its threads
FUSED_TILES = (16, 32, 64, 128)  # output channels a CTA (fused_config)
# The (vector, stage, tile) the fused kernel is built for: every stage a row can take with
# every tile, but for 128-byte stages of 128-wide tiles (two slots of them would not fit).
FUSED_CONFIGS = tuple((vector, stage, tile) for vector in (False, True)
                      for stage in ((32, 64, 128) if vector else (32, 64)) for tile in FUSED_TILES
                      if stage * tile < 128 * 128)
_FUSED_CTAS_PER_SM = 2  # taps are split over CTAs until the grid has this many an SM
MAX_STAGE = 128  # the fused kernel's widest stage, bytes of a row (fused_config)
SORT_ROWS = True  # the fused kernel takes output rows sorted by neighbour mask (fused_sorts)
_SORT_WORK = 1 << 29  # n_out x cin x cout from which it does
ALGOS = ("gemm", "fused")


SparseTensorData = namedtuple("SparseTensorData",
                              ["features", "coords", "spatial_shape", "batch_size"])
SparseTensorData.__doc__ = """A sparse tensor: features [N, C] of the N active sites at int32
coords [N, 1 + D] (batch index first), in a grid of batch_size x spatial_shape (D ints)."""


class Rulebook:
    """The kernel map of one convolution between two active sets (see the module's docstring).

    Attributes:
        neighbors: int32 [K, N_out], the input row tap k of output site o reads (-1: none).
        neighbors_t: int32 [K, N_in], the output row input site i feeds through tap k (-1).
        in_coords, out_coords: int32 [N_in, 1 + D] and [N_out, 1 + D] (out_coords is
            in_coords for a submanifold rulebook).
        in_shape, out_shape: the spatial shapes (D ints); batch_size.
        kernel_size, stride, padding, dilation: D ints each (padding of a submanifold
            rulebook is kernel // 2 * dilation).
        subm: whether output sites are the input sites.
        inverted: whether this is inverse() of a strided rulebook (outputs are its inputs).
        tap_pairs: the NumPy backend's pairs of `neighbors`, a tap at a time: (output rows,
            input rows) int64 arrays, or None for a tap where each output site reads its own
            row; None elsewhere. A CPU caller multiplies through them (torch_bridge).

    The spatial shapes and the geometry are tuples here and lists in torch_bridge's subclass.
    """

    def __init__(self, neighbors, neighbors_t, in_coords, out_coords, in_shape, out_shape,
                 batch_size, kernel_size, stride, padding, dilation, subm, inverted=False):
        self.neighbors, self.neighbors_t = neighbors, neighbors_t
        self.in_coords, self.out_coords = in_coords, out_coords
        self.in_shape, self.out_shape, self.batch_size = in_shape, out_shape, batch_size
        self.kernel_size, self.stride = kernel_size, stride
        self.padding, self.dilation = padding, dilation
        self.subm, self.inverted = subm, inverted
        # Device tables (_Table) of in_coords and out_coords that a later rulebook on the same
        # sites may reuse; torch_bridge's build_rulebook sets them, sbnet_cupy's keep none.
        self._tables = (None, None)
        self.tap_pairs = None
        # (map, order) of neighbors and of neighbors_t once fused_order computed them.
        self._orders = (None, None)

    @property
    def num_taps(self):
        return math.prod(self.kernel_size)

    def inverse(self):
        """The rulebook of the inverse convolution (of this rulebook's class): outputs and
        inputs swapped, maps and tables included; the same taps."""
        inverse = type(self)(self.neighbors_t, self.neighbors, self.out_coords, self.in_coords,
                             self.out_shape, self.in_shape, self.batch_size, self.kernel_size,
                             self.stride, self.padding, self.dilation, self.subm,
                             not self.inverted)
        inverse._tables = self._tables[::-1]
        inverse._orders = self._orders[::-1]
        return inverse

    def fused_order(self, transposed=False):
        """The fused kernel's order of the output rows of `neighbors` (of `neighbors_t` if
        transposed), int32 on the map's device: the rows sorted by their neighbour masks (the
        taps they have), so that a tile's rows have much the same taps and the kernel skips the
        others. Computed on first use, kept while the map is the same object."""
        neighbors = self.neighbors_t if transposed else self.neighbors
        cached = self._orders[transposed]
        if cached is None or cached[0] is not neighbors:
            cached = (neighbors, self._sorted_rows(neighbors))
            self._orders = ((self._orders[0], cached) if transposed
                            else (cached, self._orders[1]))
        return cached[1]

    @staticmethod
    def _sorted_rows(neighbors):
        """fused_order's rows of a CuPy map: argsort of their tap_masks (stable: rows of one mask
        keep their order, which the rulebooks give sites of one neighbourhood)."""
        import cupy

        taps, n = neighbors.shape
        with cupy.cuda.Device(neighbors.data.device_id):
            masks = cupy.empty(n, cupy.int32)
            launch_tap_masks(neighbors.data.device_id, cupy.cuda.get_current_stream().ptr,
                             neighbors.data.ptr, masks.data.ptr, n, taps)
            return cupy.argsort(masks).astype(cupy.int32)

    def __repr__(self):
        kind = "submanifold" if self.subm else "inverse" if self.inverted else "strided"
        return (f"Rulebook({kind}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, "
                f"sites {self.in_coords.shape[0]} -> {self.out_coords.shape[0]}, "
                f"shape {self.in_shape} -> {self.out_shape})")


# --- checks -------------------------------------------------------------------------------

def _ints(name, value, dims, minimum):
    """D ints from an int or a sequence of D ints, each at least `minimum`."""
    if isinstance(value, (int, numpy.integer)) and not isinstance(value, bool):
        values = (int(value),) * dims
    else:
        try:
            values = tuple(value)
        except TypeError:
            raise TypeError(f"{name} must be an int or {dims} ints, got {value!r}") from None
        if len(values) != dims or not all(isinstance(v, (int, numpy.integer))
                                          and not isinstance(v, bool) for v in values):
            raise ValueError(f"{name} must be an int or {dims} ints, got {value!r}")
        values = tuple(int(v) for v in values)
    if min(values) < minimum:
        raise ValueError(f"{name} must be ints >= {minimum}, got {values}")
    return values


def check_grid(coords, spatial_shape, batch_size):
    """Checks coords' shape and dtype, spatial_shape and batch_size; returns (shape, batch).
    The coordinates' values are checked where the rulebook is built."""
    try:
        shape = tuple(spatial_shape)
    except TypeError:
        raise TypeError(
            f"spatial_shape must be a sequence of ints, got {spatial_shape!r}") from None
    if not 1 <= len(shape) <= _MAX_DIMS:
        raise ValueError(f"spatial_shape must have 1 to {_MAX_DIMS} axes, got {shape}")
    shape = _ints("spatial_shape", shape, len(shape), 1)
    batch = _ints("batch_size", batch_size, 1, 1)[0]
    if batch * math.prod(shape) >= 2**62:
        raise ValueError(f"batch_size x spatial_shape must have fewer than 2**62 sites, got "
                         f"{batch} x {shape}")
    if coords.ndim != 2 or coords.shape[1] != 1 + len(shape):
        raise ValueError(f"coords must be [N, {1 + len(shape)}] (batch index, then "
                         f"{len(shape)} coordinates), got shape {tuple(coords.shape)}")
    if _checks.dtype_name(coords) != "int32":
        raise TypeError(f"coords must be int32, got {_checks.dtype_name(coords)}")
    return shape, batch


def _geometry(shape, kernel_size, stride, padding, dilation):
    dims = len(shape)
    kernel = _ints("kernel_size", kernel_size, dims, 1)
    stride = _ints("stride", stride, dims, 1)
    padding = _ints("padding", padding, dims, 0)
    dilation = _ints("dilation", dilation, dims, 1)
    return kernel, stride, padding, dilation


def conv_output_shape(shape, kernel_size, stride, padding, dilation):
    """Spatial shape of a strided convolution's output (as spconv's and torch's conv)."""
    out = tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                for s, k, st, p, d in zip(shape, kernel_size, stride, padding, dilation))
    if min(out) < 1:
        raise ValueError(f"kernel_size {kernel_size} with dilation {dilation} and padding "
                         f"{padding} does not fit spatial_shape {shape}")
    return out


def check_conv(features, rulebook, weight, bias):
    """Checks rulebook_conv's arguments (arrays or tensors)."""
    if not isinstance(rulebook, Rulebook):
        raise TypeError(f"rulebook must be a Rulebook, got {type(rulebook).__name__}")
    check_operands(features, weight, bias, rulebook.kernel_size, rulebook.in_coords.shape[0])


def check_operands(features, weight, bias, kernel_size, n_in):
    """Checks features [n_in, Cin], weight [Cout, *kernel_size, Cin] and bias (None or [Cout])
    of one dtype (arrays or tensors): rulebook_conv's checks that read no rulebook."""
    dtype = _checks.dtype_name(features)
    if features.ndim != 2 or features.shape[0] != n_in:
        raise ValueError(f"features must be [N, C] with N = {n_in} (the rulebook's input "
                         f"sites), got shape {tuple(features.shape)}")
    check_weight(weight, kernel_size, features.shape[1], dtype)
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],)
                             or _checks.dtype_name(bias) != dtype):
        raise ValueError(f"bias must be a {dtype} array of shape ({weight.shape[0]},), got "
                         f"{_checks.dtype_name(bias)} {tuple(bias.shape)}")


def check_algo(algo, dtype):
    """Checks rulebook_conv's algo (not None) for features of dtype (a name)."""
    if algo not in ALGOS or (algo == "fused" and dtype == "float64"):
        raise ValueError(f"algo must be None or one of {ALGOS} ('fused' for float16, bfloat16 "
                         f"or float32), got {algo!r} for {dtype}")


def check_weight(weight, kernel_size, channels, dtype):
    """Checks a weight [Cout, *kernel_size, Cin] of features' dtype."""
    if (weight.ndim != 2 + len(kernel_size) or tuple(weight.shape[1:-1]) != tuple(kernel_size)
            or weight.shape[-1] != channels):
        raise ValueError(f"weight must be [Cout, {', '.join(map(str, kernel_size))}, "
                         f"{channels}] (spconv's layout, Cin = features' channels), got shape "
                         f"{tuple(weight.shape)}")
    if dtype not in _DTYPES and dtype != "bfloat16":
        raise TypeError(f"features must be float16, bfloat16, float32 or float64, got {dtype}")
    if _checks.dtype_name(weight) != dtype:
        raise TypeError(f"weight must have features' dtype {dtype}, got "
                        f"{_checks.dtype_name(weight)}")


# --- sparse tensors -----------------------------------------------------------------------

def from_dense(x):
    """The sparse tensor of the sites of x [B, *spatial, C] (channels last) where some channel
    is non-zero, in row-major order."""
    xp = _checks.array_module(x=x)
    if x.ndim < 3:
        raise ValueError(f"x must be [B, *spatial, C] with 1 to {_MAX_DIMS} spatial axes, got "
                         f"shape {x.shape}")
    with _checks.on_device(x):
        return from_mask(xp.any(x != 0, axis=-1), x)


def from_mask(mask, x):
    """The sparse tensor of the sites of x [B, *spatial, C] where mask [B, *spatial] (bool) is
    true, in row-major order: features x[mask], coords the mask's true positions."""
    xp = _checks.array_module(mask=mask, x=x)
    if mask.dtype != bool or mask.shape != x.shape[:-1] or not 2 <= mask.ndim <= 1 + _MAX_DIMS:
        raise ValueError(f"mask must be bool [B, *spatial] matching x's {x.shape[:-1]}, got "
                         f"{mask.dtype} {mask.shape}")
    with _checks.on_device(x):
        coords = xp.stack(xp.nonzero(mask), axis=1).astype(xp.int32)
        features = x[mask]
    return SparseTensorData(features, coords, tuple(mask.shape[1:]), mask.shape[0])


def to_dense(t):
    """The dense tensor [B, *spatial, C] (channels last) of a SparseTensorData: its features at
    its sites, zeros elsewhere."""
    features, coords, shape, batch = t
    xp = _checks.array_module(features=features, coords=coords)
    check_grid(coords, shape, batch)
    with _checks.on_device(features):
        out = xp.zeros((batch, *shape, features.shape[1]), dtype=features.dtype)
        out[tuple(coords.T)] = features
    return out


# --- rulebooks ----------------------------------------------------------------------------

def submanifold_rulebook(coords, spatial_shape, batch_size, kernel_size, dilation=1, *,
                         check=True):
    """The rulebook of a submanifold convolution on the active sites `coords`.

    Args:
        coords: int32 [N, 1 + D], distinct rows (batch index, then D coordinates) inside
            batch_size x spatial_shape; numpy or cupy.
        spatial_shape: D ints; batch_size: int.
        kernel_size, dilation: an int or D ints (any size, even ones included: tap k of site
            o reads o + (k - kernel // 2) * dilation).

    Raises ValueError naming coords for duplicate or out-of-range rows (the CUDA path reads
    one flag back from the device for it: one host sync). check=False skips that check and its
    sync, for coordinates known to be distinct and inside the grid (a rulebook's out_coords);
    with rows that are not, the maps are wrong but every index in them is a valid row.
    """
    shape, batch, geometry, _ = rulebook_geometry(coords, spatial_shape, batch_size,
                                                  kernel_size, 1, 0, dilation, True)
    xp = _checks.array_module(coords=coords)
    with _checks.on_device(coords):
        coords = xp.ascontiguousarray(coords)
        if xp is numpy:
            keys = (_keys_numpy(coords, shape, batch, "coords") if check
                    else _linearise(numpy, coords, shape))
            neighbors, neighbors_t, pairs = _submanifold_maps(coords, keys, shape, geometry)
        else:
            built = build_raw(_CUPY, coords.data.device_id, _cupy_stream(), coords,
                              coords.data.ptr, shape, batch, geometry, None, check)
            neighbors, neighbors_t, pairs = built.neighbors, built.neighbors_t, None
    rulebook = Rulebook(neighbors, neighbors_t, coords, coords, shape, shape, batch, *geometry,
                        True)
    rulebook.tap_pairs = pairs
    return rulebook


def strided_rulebook(coords, spatial_shape, batch_size, kernel_size, stride=1, padding=0,
                     dilation=1, *, check=True):
    """The rulebook of a strided (regular) sparse convolution; its output sites are every site
    of the output grid that reads an active input, sorted by (batch, coordinates).

    Args: as submanifold_rulebook's, with stride (>= 1) and padding (>= 0): ints or D ints.
    The CUDA path syncs with the host once, for the number of output sites (the check of the
    coordinates, unless check=False, is read in the same sync). It finds the output sites in a
    bitmap of the output grid, in order, with no sort; a grid of more than 2**27 sites
    (batch included) hashes them instead, sorts them, and syncs once more with check.
    """
    shape, batch, geometry, out_shape = rulebook_geometry(
        coords, spatial_shape, batch_size, kernel_size, stride, padding, dilation, False)
    xp = _checks.array_module(coords=coords)
    with _checks.on_device(coords):
        coords = xp.ascontiguousarray(coords)
        if xp is numpy:
            if check:
                _keys_numpy(coords, shape, batch, "coords")
            # Each input's targets (pairs of tap and input row), their distinct keys the
            # output sites; the map from the outputs' side is the same pairs turned around.
            tap, row, targets = _targets(coords, out_shape, *geometry)
            ordered = numpy.sort(targets)  # sorted runs, one a tap: faster than unique's hash
            first = numpy.ones(ordered.size, bool)  # of each run of equal keys
            first[1:] = ordered[1:] != ordered[:-1]
            out_keys = ordered[first]
            out_coords = _decode(numpy, out_keys, out_shape)
            out_rows = numpy.searchsorted(out_keys, targets).astype(numpy.int32)
            taps = math.prod(geometry[0])
            neighbors_t = numpy.full((taps, coords.shape[0]), -1, numpy.int32)
            neighbors_t[tap, row] = out_rows
            neighbors = numpy.full((taps, out_keys.size), -1, numpy.int32)
            neighbors[tap, out_rows] = row
            pairs = _split_pairs(tap, out_rows, row, taps)
        else:
            built = build_raw(_CUPY, coords.data.device_id, _cupy_stream(), coords,
                              coords.data.ptr, shape, batch, geometry, out_shape, check)
            if built is not None:
                return Rulebook(built.neighbors, built.neighbors_t, coords, built.out_coords,
                                shape, out_shape, batch, *geometry, False)
            table = _table_from_coords(coords, shape, batch, check)
            out_keys = _output_keys_cupy(coords, shape, out_shape, batch, geometry)
            out_coords = _decode_cupy(out_keys, out_shape)
            out_table = _table_from_keys(out_keys)
            neighbors = _query_cupy(table, out_coords, out_shape, shape, batch, geometry, False)
            neighbors_t = _query_cupy(out_table, coords, shape, out_shape, batch, geometry,
                                      True)
            pairs = None
    rulebook = Rulebook(neighbors, neighbors_t, coords, out_coords, shape, out_shape, batch,
                        *geometry, False)
    rulebook.tap_pairs = pairs
    return rulebook


def _keys_numpy(coords, shape, batch, name):
    """Linearised int64 keys of checked coords ((b * S0 + c0) * S1 + c1 ...), refusing rows
    outside the grid and duplicates."""
    limits = numpy.array((batch, *shape))
    outside = numpy.any((coords < 0) | (coords >= limits), axis=1)
    if outside.any():
        row = int(numpy.flatnonzero(outside)[0])
        raise ValueError(f"{name} row {row} = {tuple(coords[row].tolist())} is outside "
                         f"batch_size x spatial_shape = {batch} x {shape}")
    keys = _linearise(numpy, coords, shape)
    ordered = numpy.sort(keys)
    repeated = numpy.flatnonzero(ordered[1:] == ordered[:-1])
    if repeated.size:
        site = _decode(numpy, ordered[repeated[:1]], shape)[0]
        raise ValueError(f"{name} has duplicate rows, e.g. {tuple(site.tolist())}")
    return keys


def _linearise(xp, coords, shape):
    keys = coords[:, 0].astype(xp.int64)
    for axis, size in enumerate(shape):
        keys = keys * size + coords[:, 1 + axis]
    return keys


def _decode(xp, keys, shape):
    """int32 coords [len(keys), 1 + D] of linearised keys."""
    columns = []
    for size in reversed(shape):
        keys, c = xp.divmod(keys, size)
        columns.append(c)
    columns.append(keys)
    return xp.stack(columns[::-1], axis=1).astype(xp.int32).reshape(-1, 1 + len(shape))


def _taps(kernel):
    """[K, D] kernel offsets in row-major order (the weight's kernel axes)."""
    return numpy.indices(kernel).reshape(len(kernel), -1).T


class _NumpyTable:
    """Sorted keys and their rows: the NumPy backend's stand-in for the hash table."""

    def __init__(self, keys):
        self.order = numpy.argsort(keys, kind="stable").astype(numpy.int32)
        self.sorted = keys[self.order]

    def find(self, keys):
        """Row (int32) of each key, -1 where absent."""
        if self.sorted.size == 0:
            return numpy.full(keys.shape, -1, numpy.int32)
        pos = numpy.searchsorted(self.sorted, keys)
        pos[pos == self.sorted.size] = 0
        rows = self.order[pos]
        rows[self.sorted[pos] != keys] = -1
        return rows


def _submanifold_maps(coords, keys, shape, geometry):
    """neighbors, neighbors_t and tap_pairs (see Rulebook) of a submanifold rulebook on coords
    (linearised `keys`). With an odd kernel, tap K-1-k is tap k backwards (offsets -d and d),
    so only the first half of the taps is looked up, the centre reads each site itself, the
    rest is the first half turned around, and neighbors_t is neighbors with the taps
    reversed."""
    kernel, _, padding, dilation = geometry
    valid = _tap_valid(coords, shape, *geometry)
    # A neighbour's key is the site's plus its offset's (valid where it lies inside the grid).
    strides = numpy.cumprod((1,) + shape[:0:-1])[::-1]
    delta = (_taps(kernel) * numpy.array(dilation) - numpy.array(padding)) @ strides
    table = _NumpyTable(keys)
    taps, n = valid.shape
    neighbors = numpy.full(valid.shape, -1, numpy.int32)
    if any(k % 2 == 0 for k in kernel):
        query = keys[None, :] + delta[:, None]
        neighbors[valid] = table.find(query[valid])
        neighbors_t, tap, row = _transposed_map(neighbors, n)
        return neighbors, neighbors_t, _split_pairs(tap, row, neighbors[tap, row], taps)
    half = taps // 2
    first = neighbors[:half]
    if dilation[-1] == 1:
        _find_runs(table, keys, delta, valid, kernel[-1], first)
    else:
        first[valid[:half]] = table.find((keys[None, :] + delta[:half, None])[valid[:half]])
    neighbors[half] = numpy.arange(n)
    flat, tap, row = _nonzero(first >= 0)
    read = first.reshape(-1)[flat]
    neighbors.reshape(-1)[(taps - 1 - tap) * n + read] = row
    pairs = _split_pairs(tap, row, read, half)
    pairs = pairs + [None] + [(i, o) for o, i in reversed(pairs)]
    return neighbors, numpy.ascontiguousarray(neighbors[::-1]), pairs


def _find_runs(table, keys, delta, valid, run, out):
    """out[t] = the row in `table` of keys + delta[t] where valid[t], -1 elsewhere, for taps
    whose keys come in runs of `run` consecutive integers (the last axis' offsets at dilation
    1): one binary search a run; each next key then lies at the next position or is absent."""
    # After the last key, one that matches none (positions run up to the table's size).
    sorted_keys = numpy.append(table.sorted, numpy.iinfo(numpy.int64).max)
    order = numpy.append(table.order, numpy.int32(-1))
    for start in range(0, out.shape[0], run):
        pos = numpy.searchsorted(table.sorted, keys + delta[start])
        for t in range(start, min(start + run, out.shape[0])):
            hit = sorted_keys[pos] == keys + delta[t]
            out[t] = numpy.where(hit & valid[t], order[pos], -1)
            pos += hit  # an invalid key's match (another row's site) still moves on


def _tap_valid(coords, shape, kernel, stride, padding, dilation):
    """[K, N] bool: whether tap k of output site o reads a site inside the grid (o * stride -
    padding + k * dilation, per axis), broadcast over the taps from [kernel_a, N] per axis."""
    valid = numpy.ones(coords.shape[0], bool)
    for axis, size in enumerate(shape):
        q = (coords[:, 1 + axis] * stride[axis] - padding[axis]
             + numpy.arange(kernel[axis])[:, None] * dilation[axis])
        valid = valid[..., None, :] & (q >= 0) & (q < size)
    return valid.reshape(math.prod(kernel), coords.shape[0])


def _split_pairs(tap, out_rows, in_rows, taps):
    """Pairs (output row, input row) listed tap by tap (tap ascending), as a list of taps'
    (out_rows, in_rows) int64 arrays."""
    bounds = numpy.cumsum(numpy.bincount(tap, minlength=taps))[:-1]
    return list(zip(numpy.split(out_rows.astype(numpy.int64, copy=False), bounds),
                    numpy.split(in_rows.astype(numpy.int64, copy=False), bounds)))


def _nonzero(mask):
    """The flat indices, rows and columns of a 2-D mask's True entries (row-major, as
    numpy.nonzero's, which is slower on 2-D masks)."""
    flat = numpy.flatnonzero(mask)
    rows = flat // mask.shape[1]
    return flat, rows, flat - rows * mask.shape[1]


def _targets(coords, shape, kernel, stride, padding, dilation):
    """The pairs of a strided convolution seen from its inputs, tap by tap: (tap, input row,
    int64 key in batch x `shape` of the output site (i + padding - k * dilation) / stride that
    input site i feeds through tap k). Validity and output coordinates are computed an axis at
    a time ([kernel_a, N] each); keys only for the valid pairs."""
    n = coords.shape[0]
    valid = numpy.ones(n, bool)
    outputs = []
    for axis, size in enumerate(shape):
        offsets = numpy.arange(kernel[axis])[:, None] * dilation[axis]
        q, rem = numpy.divmod(coords[:, 1 + axis] + padding[axis] - offsets, stride[axis])
        valid = valid[..., None, :] & (rem == 0) & (q >= 0) & (q < size)
        outputs.append(q)
    _, tap, row = _nonzero(valid.reshape(math.prod(kernel), n))
    keys = coords[:, 0].astype(numpy.int64).take(row)
    for q, axis_tap, size in zip(outputs, numpy.unravel_index(tap, kernel), shape):
        keys *= size
        keys += q.reshape(-1).take(axis_tap * n + row)
    return tap, row, keys


def _transposed_map(neighbors, n):
    """The map int32 [K, n] of the same pairs seen from the other side: out[k, neighbors[k, o]]
    = o, -1 elsewhere (a tap joins a site to at most one site across); and the pairs' taps and
    rows o in `neighbors` (numpy.nonzero's, tap by tap)."""
    flat, tap, row = _nonzero(neighbors >= 0)
    out = numpy.full((neighbors.shape[0], n), -1, numpy.int32)
    out.reshape(-1)[tap * n + neighbors.reshape(-1)[flat]] = row
    return out, tap, row


# --- CUDA rulebook ------------------------------------------------------------------------

def table_capacity(n):
    """Slots of a hash table for n keys: a power of two, at least 2n (load <= 1/2)."""
    return 1 << max(4, (2 * max(n, 1) - 1).bit_length())


class HashTable:
    """An open-addressing hash table of linearised int64 keys on a CUDA device (CuPy arrays):
    keys [capacity] (-1 marks an empty slot) and vals int32 [capacity], the row each key was
    inserted from. Linear probing from a 64-bit mix of the key; an insert or a lookup probes at
    most `capacity` slots, so a full table fails instead of looping."""

    def __init__(self, keys, vals):
        self.keys, self.vals = keys, vals

    @property
    def capacity(self):
        return int(self.keys.shape[0])


def hash_table(keys, capacity=None):
    """The HashTable of distinct int64 keys [n] (a cupy array): key keys[r] has value r.

    capacity: slots, a power of two (default table_capacity(n)). Raises ValueError if the keys
    do not fit, repeat or are negative (one host sync to read the kernel's flags)."""
    import cupy

    n = int(keys.shape[0])
    capacity = table_capacity(n) if capacity is None else capacity
    if capacity < 1 or capacity & (capacity - 1):
        raise ValueError(f"capacity must be a power of two, got {capacity}")
    table, flags = _new_table(keys.data.device_id, capacity)
    _launch_rule("insert_keys", keys.data.device_id, n, keys=cupy.ascontiguousarray(keys,
                 dtype=cupy.int64), table=table, flags=flags)
    raised = int(flags.get()[0])
    if raised & _FLAG_FULL:
        raise ValueError(f"capacity {capacity} is too small for {n} keys")
    if raised & _FLAG_DUPLICATE:
        raise ValueError("keys has duplicates")
    if raised & _FLAG_OUTSIDE:
        raise ValueError("keys must be >= 0")
    return table


def _new_table(device, capacity):
    """An empty HashTable and its int32 [2] flags and counter (zero): one allocation and one
    launch, which cost less host time than CuPy's full and zeros."""
    import cupy

    memory = cupy.cuda.alloc(capacity * 12 + 8)
    table = HashTable(cupy.ndarray((capacity,), cupy.int64, memory),
                      cupy.ndarray((capacity,), cupy.int32, memory + capacity * 8))
    flags = cupy.ndarray((2,), cupy.int32, memory + capacity * 12)
    _launch_rule("clear_table", device, capacity, table=table, flags=flags)
    return table, flags


def _pad(values):
    return tuple(values) + (1,) * (_MAX_DIMS - len(values))


_NO_GEOMETRY = ((), (), (), ())


def _rule(kernel, device, stream, items, dims, table=None, *, coords=0, keys=0, flags=0,
          counter=0, out_map=0, out_map_t=0, out_keys=0, group=0, n=None, n_out=0, batch=1,
          taps=1, transposed=False, symmetric=False, coords_shape=(), query_shape=(),
          geometry=_NO_GEOMETRY, grid=None, block=_THREADS):
    """One launch of rulebook kernel<dims> of kernels/submanifold.cu on raw addresses, over
    `items` threads' work (n defaults to items); `table`: a _Table, or None."""
    if items == 0:
        return
    function = _launch.function(device, "submanifold", kernel, dims)
    table = table or _NO_TABLE
    _launch.launch(device, stream, function, grid or _grid(items), (block, 1, 1), 0, _RULE_ARGS,
                   (coords, keys, table.keys, table.vals, table.bits, table.ranks, flags, counter,
                    out_map, out_map_t, out_keys, group, table.mask, items if n is None else n,
                    table.words, n_out,
                    batch, taps, int(transposed), int(symmetric), *_pad(coords_shape),
                    *_pad(query_shape), *(v for g in geometry for v in _pad(g))))


def _launch_rule(kernel, device, items, *, coords=None, keys=None, table=None, flags=None,
                 out_map=None, out_keys=None, n=None, batch=1, taps=1, transposed=False,
                 coords_shape=(), query_shape=(), geometry=_NO_GEOMETRY):
    """_rule on CuPy arrays (a HashTable, flags int32 [2]: flags and counter), on CuPy's current
    stream: the hash-and-sort path of strided rulebooks on grids too large for a bitmap."""
    def pointer(a):
        return 0 if a is None else a.data.ptr

    raw_table = None if table is None else _Table(
        table, table.keys.data.ptr, table.vals.data.ptr, 0, 0, table.capacity - 1, 0, (), 1,
        False)
    _rule(kernel, device, _cupy_stream(), items, len(coords_shape) or len(query_shape) or 1,
          raw_table, coords=pointer(coords), keys=pointer(keys), flags=pointer(flags),
          counter=0 if flags is None else flags.data.ptr + 4, out_map=pointer(out_map),
          out_keys=pointer(out_keys), n=n, batch=batch, taps=taps, transposed=transposed,
          coords_shape=coords_shape, query_shape=query_shape, geometry=geometry)


def _cupy_stream():
    import cupy

    return cupy.cuda.get_current_stream().ptr


# --- the CUDA rulebook on raw addresses (CuPy arrays and torch tensors alike) -----------------

class _CupyAlloc:
    """Device arrays for build_raw: CuPy's, on the current device and stream."""

    @staticmethod
    def empty(shape, dtype):
        import cupy

        a = cupy.empty(shape, dtype)
        return a, a.data.ptr

    @staticmethod
    def host(a):
        return a.get()


_CUPY = _CupyAlloc()

# A table of sites on the device, for build_raw: `owner` holds its memory; a hash table (keys,
# vals, mask: capacity - 1) or a bitmap of the grid (bits, ranks, words; see kernels/
# submanifold.cu's RuleArgs); the grid (shape, batch) its keys linearise; whether the sites it
# was built from were checked (distinct and inside the grid).
_Table = namedtuple("_Table", ["owner", "keys", "vals", "bits", "ranks", "mask", "words",
                               "shape", "batch", "checked"])

# build_raw's result: int32 maps [K, N_out] and [K, N_in], out_coords [N_out, 1 + D] (None for
# a submanifold rulebook: its input sites), and the tables of its input and output sites (None
# where it has none), for later rulebooks on the same sites to reuse.
_NO_TABLE = _Table(None, 0, 0, 0, 0, 0, 0, (), 1, False)

Built = namedtuple("Built", ["neighbors", "neighbors_t", "out_coords", "in_table",
                             "out_table"])


def rulebook_geometry(coords, spatial_shape, batch_size, kernel_size, stride, padding,
                      dilation, subm):
    """Checked (shape, batch, (kernel, stride, padding, dilation), out_shape) of a rulebook:
    a submanifold one's stride is 1, padding kernel // 2 * dilation, out_shape None."""
    shape, batch = check_grid(coords, spatial_shape, batch_size)
    if subm:
        kernel, _, _, dilation = _geometry(shape, kernel_size, 1, 0, dilation)
        padding = tuple(k // 2 * d for k, d in zip(kernel, dilation))
        return shape, batch, (kernel, (1,) * len(shape), padding, dilation), None
    geometry = _geometry(shape, kernel_size, stride, padding, dilation)
    return shape, batch, geometry, conv_output_shape(shape, *geometry)


def build_raw(alloc, device, stream, coords, coords_ptr, shape, batch, geometry, out_shape,
              check, table=None):
    """The CUDA rulebook of C-contiguous int32 coords [n, 1 + D] at coords_ptr (on `device`,
    kernels on `stream`), with rulebook_geometry's checked arguments: submanifold where
    out_shape is None, else strided. `alloc` makes the device arrays (_CUPY, or the torch
    bridge's): empty(shape, dtype) -> (array, address) and host(array) -> numpy, the latter
    only to name a bad row. `table`: a _Table of these coords to reuse (its grid `shape` for a
    submanifold rulebook; ignored by a strided one, which needs none unless it checks).

    Returns a Built, or None for a strided rulebook whose output grid has more than
    _BITMAP_MAX_BITS sites (the caller takes the hash-and-sort path). Host work: a submanifold
    rulebook is 1 launch and 2 allocations with a table to reuse, 3 launches and 3 allocations
    without, plus one sync with check; a strided one is 4 launches, 2 memsets, 4 allocations
    and one sync (for its number of output sites; the check's flags are read in it), plus 2
    launches and an allocation with check and no checked table to reuse.
    """
    n = int(coords.shape[0])
    dims, taps = len(shape), math.prod(geometry[0])
    if table is not None and (table.shape, table.batch) != (shape, batch):
        raise AssertionError("a table of another grid")  # a library bug
    if out_shape is not None and batch * math.prod(out_shape) > _BITMAP_MAX_BITS:
        return None
    flags = 0  # address of the flags to read back, where coords are inserted and checked
    if (table is None and out_shape is None) or (check and not (table and table.checked)):
        table, flags = _build_table(alloc, device, stream, coords_ptr, n, shape, batch, check)
        flags = flags if check else 0
    if out_shape is None:
        neighbors, neighbors_ptr = alloc.empty((taps, n), "int32")
        neighbors_t, neighbors_t_ptr = alloc.empty((taps, n), "int32")
        _rule("query_subm", device, stream, n * taps, dims, table, coords=coords_ptr,
              out_map=neighbors_ptr, out_map_t=neighbors_t_ptr, n=n, batch=batch, taps=taps,
              symmetric=all(k % 2 for k in geometry[0]), coords_shape=shape, query_shape=shape,
              geometry=geometry)
        if flags:
            _raise_flags(_read_ints(device, stream, (flags,))[0], alloc, coords, shape, batch)
        return Built(neighbors, neighbors_t, None, table, table)
    words = -(-batch * math.prod(out_shape) // 32)
    groups = -(-words // _RANK_WORDS)
    # One workspace: bits [words], the rank CTAs' counter [1], ranks [words], group [groups + 1].
    owner, bits = alloc.empty((2 * words + groups + 2,), "int32")
    counter, ranks = bits + 4 * words, bits + 4 * words + 4
    group = ranks + 4 * words
    _device_call(device, _memset, bits, 0, 4 * (words + 1), stream)
    out_table = _Table(owner, 0, 0, bits, ranks, 0, words, out_shape, batch, True)
    common = dict(coords=coords_ptr, n=n, batch=batch, taps=taps, transposed=True,
                  coords_shape=shape, query_shape=out_shape, geometry=geometry)
    _rule("mark_targets", device, stream, n * taps, dims, out_table, **common)
    _rule("rank_words", device, stream, words, dims, out_table, counter=counter, group=group,
          grid=(groups, 1, 1), block=_RANK_THREADS)
    count, *raised = _read_ints(device, stream, (group + 4 * groups,) + ((flags,) if flags
                                                                          else ()))
    if raised:
        _raise_flags(raised[0], alloc, coords, shape, batch)
    out_coords, out_coords_ptr = alloc.empty((count, 1 + dims), "int32")
    neighbors, neighbors_ptr = alloc.empty((taps, count), "int32")
    neighbors_t, neighbors_t_ptr = alloc.empty((taps, n), "int32")
    _rule("emit_sites", device, stream, words, dims, out_table, out_map=out_coords_ptr,
          group=group, query_shape=out_shape)
    if count:
        _device_call(device, _memset, neighbors_ptr, 0xFF, 4 * taps * count, stream)
    _rule("scatter_strided", device, stream, n * taps, dims, out_table, out_map=neighbors_ptr,
          out_map_t=neighbors_t_ptr, n_out=count, **common)
    return Built(neighbors, neighbors_t, out_coords, table, out_table)


def _build_table(alloc, device, stream, coords_ptr, n, shape, batch, checked):
    """(_Table, address of its flags) of n coords: one allocation (keys, vals, flags and
    counter), a clear and an insert; the flags are not read here."""
    capacity = table_capacity(n)
    owner, keys = alloc.empty((3 * capacity + 2,), "int32")
    vals = keys + 8 * capacity
    flags = vals + 4 * capacity
    table = _Table(owner, keys, vals, 0, 0, capacity - 1, 0, shape, batch, checked)
    _rule("clear_table", device, stream, capacity, 1, table, flags=flags, counter=flags + 4)
    _rule("insert_coords", device, stream, n, len(shape), table, coords=coords_ptr,
          flags=flags, batch=batch, coords_shape=shape)
    return table, flags


def _raise_flags(raised, alloc, coords, shape, batch):
    """Raises for the flags an insert of coords raised: ValueError naming the first bad row."""
    if raised & (_FLAG_OUTSIDE | _FLAG_DUPLICATE):
        _keys_numpy(alloc.host(coords), shape, batch, "coords")
    if raised:
        raise AssertionError(f"hash table insert failed (flags {raised})")  # a library bug


def _memset(address, value, size, stream):
    from cupy.cuda import runtime

    runtime.memsetAsync(address, value, size, stream)


def _read_ints(device, stream, addresses):
    """The int32 at each device address, after the stream's work so far: one host sync."""
    host = numpy.empty(len(addresses), numpy.int32)
    return _device_call(device, _read_into, host, addresses, stream).tolist()


def _read_into(host, addresses, stream):
    from cupy.cuda import runtime

    for i, address in enumerate(addresses):
        runtime.memcpyAsync(host.ctypes.data + 4 * i, address, 4, runtime.memcpyDeviceToHost,
                            stream)
    runtime.streamSynchronize(stream)
    return host


def _device_call(device, fn, *args):
    """fn(*args) with `device` current (runtime calls on its memory and streams)."""
    from cupy.cuda import runtime

    current = runtime.getDevice()
    if current == device:
        return fn(*args)
    runtime.setDevice(device)
    try:
        return fn(*args)
    finally:
        runtime.setDevice(current)


def _grid(items):
    return (max(1, min(-(-items // _THREADS), _MAX_BLOCKS)), 1, 1)


def _table_from_coords(coords, shape, batch, check):
    """HashTable of coords; with check, rows outside the grid or repeated raise ValueError
    (without, they are left out or inserted once)."""
    n = int(coords.shape[0])
    table, flags = _new_table(coords.data.device_id, table_capacity(n))
    _launch_rule("insert_coords", coords.data.device_id, n, coords=coords, table=table,
                 flags=flags, batch=batch, coords_shape=shape)
    if not check:
        return table
    raised = int(flags[0].get())  # the one host sync of a submanifold rulebook
    if raised & (_FLAG_OUTSIDE | _FLAG_DUPLICATE):
        _keys_numpy(coords.get(), shape, batch, "coords")  # raises, naming the first bad row
    if raised:
        raise AssertionError(f"hash table insert failed (flags {raised})")  # a library bug
    return table


def _table_from_keys(keys):
    """HashTable of distinct keys, without reading its flags back (no sync)."""
    table, flags = _new_table(keys.data.device_id, table_capacity(int(keys.shape[0])))
    _launch_rule("insert_keys", keys.data.device_id, int(keys.shape[0]), keys=keys,
                 table=table, flags=flags)
    return table


def _output_keys_cupy(coords, shape, out_shape, batch, geometry):
    """Sorted keys of a strided convolution's output sites: every (input, tap) target hashed
    into a table, the table compacted, the keys sorted (one host sync, for their number)."""
    import cupy

    n, taps = int(coords.shape[0]), math.prod(geometry[0])
    bound = min(n * taps, batch * math.prod(out_shape))
    device = coords.data.device_id
    table, flags = _new_table(device, table_capacity(bound))
    _launch_rule("insert_targets", device, n * taps, coords=coords, table=table, flags=flags,
                 n=n, batch=batch, taps=taps, transposed=True, coords_shape=shape,
                 query_shape=out_shape, geometry=geometry)
    out_keys = cupy.empty(table.capacity, dtype=cupy.int64)
    _launch_rule("compact_table", device, table.capacity, table=table, flags=flags,
                 out_keys=out_keys)
    raised, count = (int(v) for v in flags.get())
    if raised:
        raise AssertionError(f"hash table insert failed (flags {raised})")  # a library bug
    return cupy.sort(out_keys[:count])


def _decode_cupy(keys, shape):
    """_decode on the device, in one launch."""
    import cupy

    n = int(keys.shape[0])
    coords = cupy.empty((n, 1 + len(shape)), dtype=cupy.int32)
    _launch_rule("decode_keys", keys.data.device_id, n, keys=keys, out_map=coords,
                 query_shape=shape)
    return coords


def _query_cupy(table, sites, sites_shape, query_shape, batch, geometry, transposed):
    """int32 [K, N] map (see Rulebook) through the HashTable of the sites of query_shape."""
    import cupy

    n, taps = int(sites.shape[0]), math.prod(geometry[0])
    out_map = cupy.empty((taps, n), dtype=cupy.int32)
    _launch_rule("query_map", sites.data.device_id, n * taps, coords=sites, table=table,
                 out_map=out_map, n=n, batch=batch, taps=taps, transposed=transposed,
                 coords_shape=sites_shape, query_shape=query_shape, geometry=geometry)
    return out_map


# --- the convolution ----------------------------------------------------------------------

def rulebook_conv(features, rulebook, weight, bias=None, *, algo=None):
    """Sparse convolution through a rulebook (see the module's docstring for the formula).

    Args:
        features: [N_in, Cin] float16, float32 or float64 (numpy or cupy, the rulebook's).
        rulebook: a Rulebook (submanifold_rulebook, strided_rulebook, or .inverse() of one).
        weight: [Cout, *kernel_size, Cin] of features' dtype (spconv's KRSC layout).
        bias: None or [Cout].
        algo: the CUDA path's algorithm (None: choose_algo's): "gemm", the gather into
            [N_out, K * Cin] and one cuBLAS product; "fused", one kernel that gathers rows into
            shared memory and multiplies on tensor cores (float16, bfloat16, and float32 as
            TF32), skipping the taps that no site of a 64-site tile has (with few tiles, the
            taps split over CTAs and a second kernel adds their sums). NumPy ignores it.

    Returns:
        [N_out, Cout] features of rulebook.out_coords, features' dtype (float32 arithmetic for
        float16). Deterministic: no atomics.
    """
    check_conv(features, rulebook, weight, bias)
    xp = _checks.array_module(features=features, neighbors=rulebook.neighbors, weight=weight)
    dtype = _checks.dtype_name(features)
    if dtype not in _DTYPES:
        raise TypeError("bfloat16 runs through torch_bridge.submanifold (CUDA tensors)")
    if algo is None:
        algo = "gemm" if xp is numpy else choose_algo(dtype, block_conv.tf32_allowed())
    check_algo(algo, dtype)
    with _checks.on_device(features):
        fused = xp is not numpy and algo == "fused"
        order = (rulebook.fused_order() if fused and fused_sorts(
            rulebook.neighbors.shape[1], features.shape[1], weight.shape[0]) else None)
        return conv_arrays(xp, features, rulebook.neighbors, weight, bias, algo, order)


def choose_algo(dtype, tf32):
    """The algorithm rulebook_conv uses when none is given: "fused" for float16 and bfloat16, and
    for float32 where the caller's framework lets products run as TF32 (`tf32`); "gemm"
    otherwise (exact float32, float64). Measured on an H100 (bench.submanifold, SECOND's encoder,
    batch 1 and 4): "fused" took 6.3-8.5 ms a forward against 8.5-10.1 ms for "gemm" and
    1.4-2.2 ms against 1.9-3.5 ms with cached rulebooks, eagerly; graphed, 0.52-0.88 against
    0.52-0.99 ms at batch 1 and 1.08-1.85 against 1.60-2.92 ms at batch 4. (On layers of a few
    thousand sites, e.g. SBNet's road masks, graphed gemm is ahead: bench/README.md.)"""
    return "fused" if dtype in ("float16", "bfloat16") or (dtype == "float32" and tf32) else "gemm"


def conv_arrays(xp, features, neighbors, weight, bias, algo="gemm", order=None):
    """rulebook_conv on checked arrays of module xp, through the map `neighbors` alone (and the
    fused kernel's order of its rows, Rulebook.fused_order, or None)."""
    if xp is not numpy and algo == "fused":
        features, weight = xp.ascontiguousarray(features), xp.ascontiguousarray(weight)
        out = xp.empty((neighbors.shape[1], weight.shape[0]), dtype=features.dtype)
        launch_fused(features.data.device_id, xp.cuda.get_current_stream().ptr,
                     features.data.ptr, weight.data.ptr, 0 if bias is None else
                     xp.ascontiguousarray(bias).data.ptr, neighbors.data.ptr, out.data.ptr,
                     neighbors.shape[1], features.shape[1], weight.shape[0], neighbors.shape[0],
                     features.dtype.name, _launch.cupy_float_scratch,
                     0 if order is None else order.data.ptr)
        return out
    g = gather(features, neighbors)
    cout = weight.shape[0]
    if xp is numpy:
        acc = _acc_dtype(features.dtype)
        y = g.astype(acc) @ weight.reshape(cout, -1).astype(acc).T
        if bias is not None:
            y += bias.astype(acc)
        return y.astype(features.dtype)
    y = g @ xp.ascontiguousarray(weight).reshape(cout, -1).T
    if bias is not None:
        y += bias
    return y


def rulebook_conv_grad_features(dy, rulebook, weight):
    """Gradient of rulebook_conv with respect to features: the same convolution of dy [N_out,
    Cout] through rulebook.inverse() with transposed_weight(weight)."""
    return rulebook_conv(dy, rulebook.inverse(), transposed_weight(weight))


def rulebook_conv_grad_weight(features, dy, rulebook):
    """Gradient of rulebook_conv with respect to the weight, [Cout, *kernel_size, Cin]:
    dy.T @ gather(features, rulebook.neighbors), one matrix product (deterministic)."""
    xp = _checks.array_module(features=features, dy=dy, neighbors=rulebook.neighbors)
    n_out = rulebook.out_coords.shape[0]
    if dy.ndim != 2 or dy.shape[0] != n_out or dy.dtype != features.dtype:
        raise ValueError(f"dy must be a {features.dtype} array [{n_out}, Cout], got "
                         f"{dy.dtype} {dy.shape}")
    if features.ndim != 2 or features.shape[0] != rulebook.in_coords.shape[0]:
        raise ValueError(f"features must be [{rulebook.in_coords.shape[0]}, Cin], got "
                         f"{features.shape}")
    shape = (dy.shape[1], *rulebook.kernel_size, features.shape[1])
    with _checks.on_device(features):
        return grad_weight_arrays(xp, features, dy, rulebook.neighbors, shape)


def grad_weight_arrays(xp, features, dy, neighbors, shape):
    """rulebook_conv_grad_weight on checked arrays of module xp: the weight's `shape`."""
    g = gather(features, neighbors)
    if xp is numpy:
        acc = _acc_dtype(features.dtype)
        return (dy.astype(acc).T @ g.astype(acc)).astype(features.dtype).reshape(shape)
    return (dy.T @ g).reshape(shape)


def transposed_weight(weight):
    """w_t[ci, *k, co] = w[co, *k, ci]: the weight of the features' gradient."""
    xp = _checks.array_module(weight=weight)
    return xp.ascontiguousarray(xp.swapaxes(weight, 0, -1))


def _acc_dtype(dtype):
    return numpy.float64 if dtype == numpy.float64 else numpy.float32


def gather(features, neighbors):
    """[N_out, K * C]: row o is features[neighbors[k, o]] for k = 0..K-1 side by side, zeros
    where neighbors is -1 (features [N_in, C], neighbors int32 [K, N_out])."""
    xp = _checks.array_module(features=features, neighbors=neighbors)
    taps, n_out = neighbors.shape
    channels = features.shape[1]
    if xp is numpy:
        padded = numpy.concatenate([features, numpy.zeros((1, channels), features.dtype)])
        rows = numpy.where(neighbors.T < 0, features.shape[0], neighbors.T)
        return padded[rows].reshape(n_out, taps * channels)
    features = xp.ascontiguousarray(features)
    out = xp.empty((n_out, taps * channels), dtype=features.dtype)
    launch_gather(features.data.device_id, xp.cuda.get_current_stream().ptr,
                  features.data.ptr, out.data.ptr, neighbors.data.ptr, n_out, taps,
                  channels * features.itemsize)
    return out


def launch_gather(device, stream, features, out, neighbors, n_out, taps, row_bytes):
    """gather() on raw addresses: C-contiguous features [N_in, C] into out [n_out, taps * C],
    rows of row_bytes bytes, through int32 neighbors [taps, n_out]."""
    total = n_out * taps
    if total == 0 or row_bytes == 0:
        return
    word = _kernels.widest_access(row_bytes, _checks.alignment(features, out))
    function = _launch.function(device, "submanifold", "submanifold_gather",
                                _kernels.STORAGE_CTYPES[word])
    words = row_bytes // word
    _launch.launch(device, stream, function, _grid(total * words), (_THREADS, 1, 1), 0,
                   _GATHER_ARGS, (features, out, neighbors, n_out, taps, words))


def fused_sorts(n_out, cin, cout):
    """Whether the fused kernel takes the output rows in Rulebook.fused_order's order: where
    SORT_ROWS is on and the layer's work (n_out x cin x cout) is large enough that the taps
    its tiles skip pay for the sort's GPU and host time (wide layers at many sites: segmentation
    U-Nets'; bench.detectors' A/B of SORT_ROWS)."""
    return SORT_ROWS and n_out * cin * cout >= _SORT_WORK


def launch_tap_masks(device, stream, neighbors, masks, n, taps):
    """tap_masks on raw addresses: int32 masks [n] of the rows of int32 neighbors [taps, n],
    bit k set where the row has tap k (the first 32 taps)."""
    if n == 0:
        return
    function = _launch.function(device, "submanifold", "tap_masks", "int")
    _launch.launch(device, stream, function, _grid(n), (_THREADS, 1, 1), 0, _MASK_ARGS,
                   (neighbors, masks, n, taps))


def launch_fused(device, stream, features, weight, bias, neighbors, out, n_out, cin, cout,
                 taps, dtype, float_scratch, order=0):
    """The fused convolution on raw addresses: C-contiguous features [N_in, cin], weight
    [cout, taps, cin], bias [cout] (0: none), int32 neighbors [taps, n_out], into out
    [n_out, cout]; dtype "float16", "bfloat16" or "float32" (TF32). float_scratch(n): the
    address and owner of n float32 on this device, usable on this stream (CuPy or torch), for
    the partial sums of split taps. order: int32 [n_out], a permutation of the output rows in
    which tiles take them (Rulebook.fused_order), or 0: 0, 1, ..."""
    if n_out == 0 or cout == 0:
        return
    itemsize = _kernels.ITEMSIZES[dtype]
    vector = cin * itemsize % 16 == 0 and _checks.alignment(features, weight) == 16
    stage, tile = fused_config(vector, itemsize, cout)
    function, grid, split_taps, split_sum = _fused_plan(device, dtype, vector, stage, tile,
                                                        n_out, cout, taps)
    splits = grid[2]
    # Split taps: the kernel writes partial sums (no bias, no out), the split sum the rest.
    partial, _owner = (0, None) if splits == 1 else float_scratch(splits * n_out * cout)
    _launch.launch(device, stream, function, grid, (_FUSED_THREADS, 1, 1), 0, _FUSED_ARGS,
                   (features, weight, 0 if partial else bias, neighbors, 0 if partial else out,
                    partial, n_out, cin, cout, taps, split_taps, order), dependent=True)
    if partial:  # _owner keeps the scratch until both launches are queued
        _launch.launch_split_sum(device, stream, split_sum, partial, bias, out, n_out, cout,
                                 cout, splits, dependent=True)


def fused_config(vector, itemsize, cout):
    """(stage, tile) of the fused kernel: bytes of a row staged at a time, and output channels
    a CTA. The tile is the narrowest of 16, 32 and 64 that holds cout, so narrow layers do no
    MMA work on padding; wider layers take tiles of 64 where cout is a multiple of 64, else of
    128, which gather each neighbour row once where 64-wide tiles would pad as much. Rows of
    16-byte vectors are staged MAX_STAGE bytes at a time (narrower rows pack several taps into
    a stage, so every stage is whole k-steps of the MMA), 64 in 128-wide tiles (whose slots of
    128 would not fit twice); odd rows 16 elements at a time, one k-step of a 16-bit MMA or two
    of TF32, as their loads through registers are the stage's time. bench.submanifold_tiles
    measures every pair per layer."""
    tile = next((width for width in FUSED_TILES if cout <= width), FUSED_TILES[-1])
    if tile == 128 and cout % 64 == 0:
        tile = 64
    if not vector:
        return min(MAX_STAGE, 16 * itemsize), tile
    return (MAX_STAGE if tile < 128 else min(MAX_STAGE, 64)), tile


@functools.lru_cache(maxsize=1024)
def _fused_plan(device, dtype, vector, stage, tile, n_out, cout, taps):
    """The kernel, its grid (sites, channels, tap splits), the taps a split sums and, for split
    taps, the kernel that adds the splits (else None)."""
    ctype = _kernels.ARITHMETIC_CTYPES[dtype]
    function = _launch.function(device, "submanifold", "submanifold_fused", ctype, vector, stage,
                                tile)
    tiles = (_checks.grid_dim("output sites", -(-n_out // _FUSED_SITES), 2**31 - 1),
             _checks.grid_dim("output channels", -(-cout // tile)))
    split_taps = -(-taps // fused_splits(device, tiles[0] * tiles[1], taps))
    splits = -(-taps // split_taps)
    split_sum = (_launch.function(device, "submanifold", "split_sum", ctype)
                 if splits > 1 else None)
    return function, (*tiles, splits), split_taps, split_sum


def fused_splits(device, tiles, taps):
    """How many splits of the taps the fused kernel runs with `tiles` CTAs of sites x channels:
    enough for _FUSED_CTAS_PER_SM CTAs an SM, at most one a tap. Few sites make few tiles, and
    then one CTA's long chain of stages would be the kernel's time."""
    return max(1, min(taps, _FUSED_CTAS_PER_SM * _launch.multiprocessors(device) // tiles))


def instantiations():
    """Name expressions of every kernel this op can ask for (the compile check builds them)."""
    rules = ["clear_table", "insert_coords", "insert_keys", "insert_targets", "compact_table",
             "decode_keys", "query_map", "query_subm", "mark_targets", "rank_words",
             "emit_sites", "scatter_strided"]
    fused = [_kernels.ARITHMETIC_CTYPES[dtype] for dtype in ("float16", "bfloat16", "float32")]
    return ([_kernels.name_expression(rule, dims) for rule in rules
             for dims in range(1, _MAX_DIMS + 1)]
            + [_kernels.name_expression("submanifold_fused", ctype, vector, stage, tile)
               for ctype in fused for vector, stage, tile in FUSED_CONFIGS]
            + [_kernels.name_expression("split_sum", ctype) for ctype in fused]
            + [_kernels.name_expression("tap_masks", "int")]
            + [_kernels.name_expression("submanifold_gather", word)
               for word in _kernels.STORAGE_CTYPES.values()])


_kernels.register_instantiations("submanifold", instantiations)


# --- on sparse tensors --------------------------------------------------------------------

def _check_tensor(name, x):
    if not isinstance(x, SparseTensorData):
        raise TypeError(f"{name} must be a SparseTensorData, got {type(x).__name__}")


def submanifold_conv(x, weight, bias=None, *, dilation=1, rulebook=None):
    """Submanifold convolution of a SparseTensorData: the output has x's sites.

    weight: [Cout, *kernel_size, Cin] (spconv's layout; its kernel axes give kernel_size).
    rulebook: a submanifold rulebook of x's sites to reuse (default: built here).
    """
    _check_tensor("x", x)
    if rulebook is None:
        rulebook = submanifold_rulebook(x.coords, x.spatial_shape, x.batch_size,
                                        tuple(weight.shape[1:-1]), dilation)
    elif not rulebook.subm:
        raise ValueError(f"rulebook must be a submanifold rulebook, got {rulebook!r}")
    y = rulebook_conv(x.features, rulebook, weight, bias)
    return SparseTensorData(y, rulebook.out_coords, rulebook.out_shape, rulebook.batch_size)


def sparse_conv(x, weight, bias=None, *, stride=1, padding=0, dilation=1, rulebook=None):
    """Strided sparse convolution of a SparseTensorData (output sites: see strided_rulebook).
    rulebook: a strided rulebook of x's sites to reuse (default: built here)."""
    _check_tensor("x", x)
    if rulebook is None:
        rulebook = strided_rulebook(x.coords, x.spatial_shape, x.batch_size,
                                    tuple(weight.shape[1:-1]), stride, padding, dilation)
    elif rulebook.subm or rulebook.inverted:
        raise ValueError(f"rulebook must be a strided rulebook, got {rulebook!r}")
    y = rulebook_conv(x.features, rulebook, weight, bias)
    return SparseTensorData(y, rulebook.out_coords, rulebook.out_shape, rulebook.batch_size)


def inverse_conv(x, weight, bias=None, *, rulebook):
    """Inverse of a strided sparse convolution: x holds the output sites of the strided
    `rulebook`; the result holds its input sites (spconv's SparseInverseConv). weight:
    [Cout, *kernel_size, Cin], tap k connecting the same sites as in the strided convolution."""
    _check_tensor("x", x)
    if not isinstance(rulebook, Rulebook) or rulebook.subm or rulebook.inverted:
        raise ValueError(f"rulebook must be the strided rulebook that made x, got {rulebook!r}")
    inverse = rulebook.inverse()
    y = rulebook_conv(x.features, inverse, weight, bias)
    return SparseTensorData(y, inverse.out_coords, inverse.out_shape, inverse.batch_size)
