"""point_to_voxel: a point cloud into voxels, as spconv 2.x's PointToVoxel does.

Definition (spconv's CPU build, which ours matches bit for bit): the grid has
round((max - min) / vsize) cells along each axis (float32 arithmetic, halves away from zero);
a point's cell is floor((p - min) / vsize) per axis, in float32 (float64 for float64 points),
from its first ndim columns (x, y, z); points outside the grid (NaN and infinite ones too)
belong to no voxel. Voxels are numbered in the order of their first point; the first
max_num_voxels are kept and the points of later ones dropped. A voxel holds its first
max_num_points_per_voxel points in point order; later ones are dropped but still name it in
point_voxel_id. Coordinates are z, y, x (reversed from the columns), as spconv's.

spconv's own CUDA build numbers voxels and fills them in the order its atomics happen to run
(different from run to run); ours gives the CPU build's results on the GPU too, every run.
"""

import functools
import math
import numbers
from collections import namedtuple

import numpy

from .core import backend as _backend, checks as _checks, kernels as _kernels
from .core import plan as _plans, records as _records
from .submanifold import table_capacity

# Voxel sizes (float32 values), grid minimum and cells along each axis, z first.
VoxelGrid = namedtuple("VoxelGrid", ["vsize", "lower", "shape"])

CTYPES = {"float16": "half_t", "float32": "float", "float64": "double"}
KERNELS = ("p2v_clear", "p2v_insert", "p2v_mark", "p2v_rank", "p2v_assign", "p2v_scatter",
           "p2v_select", "p2v_gather")  # in launch order; each a template on the points' type
_MAX_DIMS = _records.P2V_MAX_DIMS
_THREADS = 256
_RANK_THREADS = 1024  # kernels/point_to_voxel.cu, P2V_RANK_THREADS
_MAX_BLOCKS = 65535 * 16  # grid-stride loops beyond this


_ARGS = _records.P2V_ARGS  # every kernel's argument record


def voxel_grid(vsize_xyz, coors_range_xyz):
    """The checked VoxelGrid of spconv's arguments: vsize_xyz (1 to 4 sizes, x first) and
    coors_range_xyz (the minima, then the maxima)."""
    try:
        vsize = [float(v) for v in vsize_xyz]
        bounds = [float(v) for v in coors_range_xyz]
    except (TypeError, ValueError):
        raise TypeError(f"vsize_xyz and coors_range_xyz must be sequences of numbers, got "
                        f"{vsize_xyz!r} and {coors_range_xyz!r}") from None
    ndim = len(vsize)
    if not 1 <= ndim <= _MAX_DIMS:
        raise ValueError(f"vsize_xyz must have 1 to {_MAX_DIMS} sizes, got {vsize_xyz!r}")
    if len(bounds) != 2 * ndim:
        raise ValueError(f"coors_range_xyz must have {2 * ndim} values (the minima, then the "
                         f"maxima), got {coors_range_xyz!r}")
    vsize = [numpy.float32(v) for v in vsize]
    bounds = [numpy.float32(v) for v in bounds]
    if not all(numpy.isfinite(v) and v > 0 for v in vsize):
        raise ValueError(f"vsize_xyz must be positive and finite, got {vsize_xyz!r}")
    shape = []
    for axis, (size, low, high) in enumerate(zip(vsize, bounds[:ndim], bounds[ndim:])):
        if not (numpy.isfinite(low) and numpy.isfinite(high) and low < high):
            raise ValueError(f"coors_range_xyz must have finite minima below their maxima, "
                             f"got {coors_range_xyz!r} (axis {axis})")
        with numpy.errstate(over="ignore"):
            cells = float((high - low) / size)  # float32, as spconv
        rounded = math.floor(cells) + (cells - math.floor(cells) >= 0.5)  # halves up: cells > 0
        if not 1 <= rounded < 2**31:
            raise ValueError(f"coors_range_xyz and vsize_xyz give {rounded} cells along axis "
                             f"{axis}, which must be 1 to 2**31 - 1")
        shape.append(rounded)
    if math.prod(shape) >= 2**62:
        raise ValueError(f"the grid of {shape} cells is too large (2**62 cells at most)")
    return VoxelGrid(tuple(float(v) for v in vsize[::-1]),
                     tuple(float(v) for v in bounds[:ndim][::-1]), tuple(shape[::-1]))


def positive_int(name, value):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not 1 <= value < 2**31:
        raise ValueError(f"{name} must be 1 to 2**31 - 1, got {value}")
    return int(value)


def check_points(points, ndim, num_point_features=None):
    """Checks a point cloud (array or tensor) [N, F] of float16/32/64, F at least ndim (and
    num_point_features if given)."""
    shape = tuple(points.shape)
    if len(shape) != 2 or shape[1] != (num_point_features or shape[1]):
        want = ("[N, F]" if num_point_features is None
                else f"[N, {num_point_features}] (num_point_features)")
        raise ValueError(f"points must be {want}, got shape {shape}")
    if _checks.dtype_name(points) not in CTYPES:
        raise TypeError(f"points must be float16, float32 or float64, got "
                        f"{_checks.dtype_name(points)}")
    if shape[0] >= 2**31:
        raise ValueError(f"points has {shape[0]} rows, more than 2**31 - 1")
    if shape[1] < ndim:
        raise ValueError(f"points need at least {ndim} features (the coordinates), got "
                         f"{shape[1]}")


def point_to_voxel(points, vsize_xyz, coors_range_xyz, max_num_voxels,
                   max_num_points_per_voxel, *, empty_mean=False, voxels=None):
    """Voxels of a point cloud, as spconv's PointToVoxel.generate_voxel_with_id (see the module
    docstring for the definition).

    Args:
        points: [N, F] float16, float32 or float64 array (numpy or cupy), x, y, z... first.
        vsize_xyz, coors_range_xyz: voxel size and grid range, as spconv's (x first).
        max_num_voxels, max_num_points_per_voxel: the caps, positive ints.
        empty_mean: fill a voxel's places past its points with their mean (per feature).
        voxels: optional C-contiguous [max_num_voxels, max_num_points_per_voxel, F] array of
            the points' dtype to fill in place: places past a voxel's points keep their
            values (spconv's clear_voxels=False); the result is its first rows.

    Returns:
        voxels [V, max_num_points_per_voxel, F] of the points' dtype (zero past each voxel's
        points unless empty_mean or `voxels`), coordinates int32 [V, ndim] (z first),
        num_points_per_voxel int32 [V] and point_voxel_id int64 [N] (-1: no voxel).
    """
    xp = _checks.array_module(points=points)
    grid = voxel_grid(vsize_xyz, coors_range_xyz)
    max_voxels = positive_int("max_num_voxels", max_num_voxels)
    max_points = positive_int("max_num_points_per_voxel", max_num_points_per_voxel)
    check_points(points, len(grid.shape))
    features = points.shape[1]
    if voxels is not None:
        _checks.array_module(points=points, voxels=voxels)
        shape = (max_voxels, max_points, features)
        if voxels.shape != shape or voxels.dtype != points.dtype or not voxels.flags.c_contiguous:
            raise ValueError(f"voxels must be a C-contiguous {points.dtype} array of shape "
                             f"{shape}, got {voxels.dtype} {voxels.shape}")
    if xp is numpy:
        return point_to_voxel_numpy(points, grid, max_voxels, max_points, bool(empty_mean),
                                    voxels)
    import cupy

    with _checks.on_device(points):
        points = cupy.ascontiguousarray(points)

        def new_voxels(count):
            return (cupy.zeros((count, max_points, features), points.dtype) if voxels is None
                    else voxels[:count])

        return voxelize(_backend.CUPY, points, grid, max_voxels, max_points, bool(empty_mean),
                        new_voxels)


# --- NumPy ---------------------------------------------------------------------------------

def cell_keys_numpy(points, grid):
    """int64 [N]: each point's cell, linearised z first; -1 outside the grid."""
    keys = numpy.zeros(points.shape[0], numpy.int64)
    inside = numpy.ones(points.shape[0], bool)
    ndim = len(grid.shape)
    wide = points.dtype == numpy.float64
    real = numpy.float64 if wide else numpy.float32
    with numpy.errstate(invalid="ignore", over="ignore"):
        for d, (size, low, cells) in enumerate(zip(grid.vsize, grid.lower, grid.shape)):
            column = points[:, ndim - 1 - d].astype(real, copy=False)
            cell = numpy.floor((column - real(low)) / real(size))
            inside &= (cell >= 0) & (cell < cells)
            keys = keys * cells + numpy.where(inside, cell, 0).astype(numpy.int64)
    keys[~inside] = -1
    return keys


def decode_numpy(keys, shape):
    coords = numpy.empty((keys.shape[0], len(shape)), numpy.int32)
    for d in reversed(range(len(shape))):
        coords[:, d] = keys % shape[d]
        keys = keys // shape[d]
    return coords


def point_to_voxel_numpy(points, grid, max_voxels, max_points, empty_mean, voxels=None):
    """point_to_voxel on checked NumPy arguments: one stable sort of the points' cells."""
    n, features = points.shape
    keys = cell_keys_numpy(points, grid)
    inside = numpy.flatnonzero(keys >= 0)
    keys = keys[inside]
    order = _stable_order(keys, math.prod(grid.shape))
    new_cell = numpy.diff(keys[order], prepend=-1) != 0
    starts = numpy.flatnonzero(new_cell)
    cell = numpy.cumsum(new_cell) - 1  # of each sorted point
    first = order[starts]  # each cell's first point (among those inside)
    # Voxels are ranked by their first point: the firsts, marked in point order, counted.
    marked = numpy.zeros(keys.shape[0], bool)
    marked[first] = True
    rank = (numpy.cumsum(marked) - 1)[first]
    count = min(first.shape[0], max_voxels)
    voxel = numpy.empty(keys.shape[0], numpy.int64)
    voxel[order] = rank[cell]
    place = numpy.empty(keys.shape[0], numpy.int64)
    place[order] = numpy.arange(keys.shape[0]) - starts[cell]
    voxel[voxel >= max_voxels] = -1
    point_voxel_id = numpy.full(n, -1, numpy.int64)
    point_voxel_id[inside] = voxel
    take = (voxel >= 0) & (place < max_points)
    out = (numpy.zeros((count, max_points, features), points.dtype) if voxels is None
           else voxels[:count])
    out.reshape(-1, features)[voxel[take] * max_points + place[take]] = points[inside[take]]
    sizes = numpy.diff(starts, append=keys.shape[0])
    num_points = numpy.zeros(count, numpy.int32)
    kept = rank < max_voxels
    num_points[rank[kept]] = numpy.minimum(sizes[kept], max_points)
    coords = numpy.empty(count, numpy.int64)
    coords[rank[kept]] = keys[first[kept]]
    if empty_mean:
        fill_mean_numpy(out, num_points)
    return out, decode_numpy(coords, grid.shape), num_points, point_voxel_id


def _stable_order(keys, cells):
    """The permutation that sorts keys (in [0, cells)) stably: where key and position fit in
    63 bits together, an unstable sort of both (unique, so the same order), which is faster."""
    shift = max(keys.shape[0] - 1, 1).bit_length()
    if (cells - 1) >> (62 - shift):
        return numpy.argsort(keys, kind="stable")
    return numpy.argsort((keys << shift) | numpy.arange(keys.shape[0]))


def fill_mean_numpy(voxels, num_points):
    """Places past each voxel's points get their mean: summed in point order in float32
    (float64 for float64), as the CUDA kernel does."""
    acc = numpy.float64 if voxels.dtype == numpy.float64 else numpy.float32
    total = numpy.zeros((voxels.shape[0], voxels.shape[2]), acc)
    for k in range(voxels.shape[1]):
        held = (k < num_points)[:, None]
        total += numpy.where(held, voxels[:, k].astype(acc), acc(0))
    mean = (total / num_points[:, None].astype(acc)).astype(voxels.dtype)
    for k in range(voxels.shape[1]):
        empty = k >= num_points
        voxels[empty, k] = mean[empty]


# --- CUDA, on raw addresses (CuPy arrays and torch tensors alike) --------------------------

def _grid(items):
    return (max(1, min(-(-items // _THREADS), _MAX_BLOCKS)), 1, 1)


def _scratch(n, capacity, cap, max_points):
    """Byte offsets of the scratch parts in one allocation (each 16-byte aligned), and its
    size: the hash table, slot, bits, word_rank, total, voxel, bucket, selected."""
    words = -(-n // 128) * 4  # whole uint4s
    sizes = (16 * capacity, 4 * n, 4 * words, 4 * words, 8, 16 * cap, 4 * n,
             4 * cap * max_points)
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // 16) * 16
    return offsets, at


def voxelize(backend, points, grid, max_voxels, max_points, empty_mean, new_voxels):
    """point_to_voxel's CUDA path on a backend's arrays (core/backend.py: CUPY, torch_bridge's
    TORCH), checked: points C-contiguous [n, features]; the kernels run on the backend's
    stream. new_voxels(count): where the [count, max_points, features] voxels go, made once
    their count is known. One host sync, for that count."""
    n, features = points.shape
    ndim = len(grid.shape)
    point_voxel_id = backend.empty((n,), points, "int64")
    if n == 0:
        return (new_voxels(0), backend.empty((0, ndim), points, "int32"),
                backend.empty((0,), points, "int32"), point_voxel_id)
    capacity, cap = table_capacity(n), min(n, max_voxels)
    offsets, size = _scratch(n, capacity, cap, max_points)
    scratch = backend.empty((size // 4,), points, "int32")
    base = backend.pointer(scratch)
    table, slot, bits, word_rank, total, voxel, bucket, selected = (base + o for o in offsets)
    pad = _MAX_DIMS - ndim
    device = backend.device(points)
    stream = backend.stream(device)
    ctype = CTYPES[backend.dtype_name(points)]

    def arguments(voxels=0, coords=0, num_points=0):  # the outputs: 0 until their count is known
        return _ARGS.values(
            points=backend.pointer(points), voxels=voxels, table=table, slot=slot, bits=bits,
            word_rank=word_rank, total=total, voxel=voxel, bucket=bucket, selected=selected,
            coords=coords, num_points=num_points, point_voxel_id=backend.pointer(point_voxel_id),
            mask=capacity - 1, n=n, features=features, ndim=ndim, max_voxels=max_voxels,
            max_points=max_points, empty_mean=int(empty_mean), cap=cap,
            grid=(*grid.shape, *(1,) * pad), lower=(*grid.lower, *(0.0,) * pad),
            vsize=(*grid.vsize, *(1.0,) * pad))

    def launch(kernel, items, values):
        plan = _plan(device, kernel, ctype)
        plan.launch(stream, *values, grid=plan.grid if kernel == "p2v_rank" else _grid(items))

    values = arguments()
    for kernel, items in (("p2v_clear", capacity), ("p2v_insert", n), ("p2v_mark", n),
                          ("p2v_rank", 1), ("p2v_assign", n), ("p2v_scatter", n)):
        launch(kernel, items, values)
    found = backend.host(scratch[offsets[4] // 4:offsets[4] // 4 + 1])
    count = min(int(found[0]), max_voxels)
    voxels = new_voxels(count)
    coords = backend.empty((count, ndim), points, "int32")
    num_points = backend.empty((count,), points, "int32")
    if count:
        values = arguments(backend.pointer(voxels), backend.pointer(coords),
                           backend.pointer(num_points))
        launch("p2v_select", count, values)
        launch("p2v_gather", count * features, values)
    return voxels, coords, num_points, point_voxel_id


@functools.lru_cache(maxsize=None)
def _plan(device, kernel, ctype):
    """The KernelPlan of `kernel`<ctype>: p2v_rank one CTA of _RANK_THREADS, the others
    _THREADS a CTA over a grid that a launch passes (its items)."""
    rank = kernel == "p2v_rank"
    return _plans.KernelPlan(device, "point_to_voxel", kernel, (ctype,), (1, 1, 1),
                             (_RANK_THREADS if rank else _THREADS, 1, 1), 0, _ARGS)


@functools.cache
def instantiations():
    """Every name expression of kernels/point_to_voxel.cu the op can ask for."""
    return [_kernels.name_expression(kernel, ctype) for kernel in KERNELS
            for ctype in CTYPES.values()]


_kernels.register_instantiations("point_to_voxel", instantiations)
