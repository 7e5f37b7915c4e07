"""Argument checks shared by the ops: each raises ValueError/TypeError naming the argument."""

import contextlib
import numbers
from collections import namedtuple

import numpy

try:
    import cupy
except ImportError:  # the NumPy backend needs no GPU stack
    cupy = None

BlockGeometry = namedtuple("BlockGeometry", ["bsize", "boffset", "bstride"])
ARRAY_TYPES = (numpy.ndarray,) if cupy is None else (numpy.ndarray, cupy.ndarray)


def int_pair(name, value, *, minimum=None):
    """Two ints from an int or a length-2 sequence; each at least `minimum` if given."""
    if type(value) is int:  # the common cases first: these checks run on every call
        pair = (value, value)
    elif type(value) in (tuple, list) and len(value) == 2 and all(type(v) is int for v in value):
        pair = tuple(value)
    else:
        pair = _general_int_pair(name, value)
    if minimum is not None and min(pair) < minimum:
        kind = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be two {kind} ints, got {pair}")
    return pair


def _general_int_pair(name, value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value), int(value))
    try:
        pair = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    if len(pair) != 2 or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in pair):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    return (int(pair[0]), int(pair[1]))


def block_geometry(bsize, boffset, bstride):
    """Checked (bsize, boffset, bstride); bstride defaults to bsize."""
    bsize = int_pair("bsize", bsize, minimum=1)
    boffset = int_pair("boffset", boffset)
    bstride = bsize if bstride is None else int_pair("bstride", bstride, minimum=1)
    for name, pair in (("bsize", bsize), ("boffset", boffset), ("bstride", bstride)):
        if max(abs(v) for v in pair) >= 2**31:
            raise ValueError(f"{name} must fit in int32, got {pair}")
    return BlockGeometry(bsize, boffset, bstride)


def atomic_for_overlap(geometry, add, atomic):
    """Checks that adds of overlapping blocks are atomic (plain adds would race)."""
    (bh, bw), _, (sh, sw) = geometry
    if add and not atomic and (sh < bh or sw < bw):
        raise ValueError(f"add=True with overlapping blocks (bstride {geometry.bstride} < "
                         f"bsize {geometry.bsize}) needs atomic=True")


def array_module(**arrays):
    """numpy or cupy, whichever holds all the named arrays (on one device, for cupy)."""
    if cupy is not None:  # the common case first: CuPy arrays on one device
        devices = {a.data.device_id if type(a) is cupy.ndarray else None
                   for a in arrays.values()}
        if len(devices) == 1 and None not in devices:
            return cupy
    kinds = {}
    for name, a in arrays.items():
        if cupy is not None and isinstance(a, cupy.ndarray):
            kinds[name] = "cupy"
        elif isinstance(a, numpy.ndarray):
            kinds[name] = "numpy"
        else:
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, "
                            f"got {type(a).__name__}")
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{n} is a {k} array" for n, k in kinds.items())
        raise TypeError(f"mixed backends: {described}")
    if "cupy" not in kinds.values():
        return numpy
    devices = {name: a.data.device_id for name, a in arrays.items()}
    if len(set(devices.values())) > 1:
        described = ", ".join(f"{n} is on device {d}" for n, d in devices.items())
        raise ValueError(f"arrays on different devices: {described}")
    return cupy


def nhwc(name, a):
    """Checks that `a` is a 4-D NHWC tensor."""
    if a.ndim != 4:
        raise ValueError(f"{name} must be 4-D [N, H, W, C], got shape {tuple(a.shape)}")
    return a


def dtype_name(a):
    """NumPy's name of an array's or a tensor's dtype ('float32', 'bfloat16', ...): the checks
    are shared by NumPy and CuPy arrays and torch tensors."""
    return name_of(a.dtype)


def name_of(dtype):
    """NumPy's name of a NumPy or torch dtype (torch.float32 prints as 'torch.float32'). NumPy's
    are remembered: numpy.dtype.name is computed in Python on every access (slowly), and the ops
    ask for it several times a call. Torch's are not: torch.compile (2.11) cannot trace a
    lookup in a dict with NumPy dtypes among its keys."""
    if not isinstance(dtype, numpy.dtype):
        return str(dtype)[6:]
    try:
        return _NUMPY_NAMES[dtype]
    except KeyError:
        name = _NUMPY_NAMES[dtype] = dtype.name
        return name


_NUMPY_NAMES = {}


def size(shape):
    """Number of elements of a shape (a loop rather than math.prod, which torch.compile's tracer
    does not follow)."""
    elements = 1
    for extent in shape:
        elements *= extent
    return elements


def memoized(cache, check, args, array_types):
    """check(*args), remembered for arguments of the same shapes and dtypes (arrays of
    `array_types`) and values (the rest): a check depends on nothing else, and checking costs
    more host time than the launch. Unhashable arguments (lists) are checked every time."""
    key = tuple((a.shape, a.dtype) if isinstance(a, array_types) else a for a in args)
    try:
        return cache[key]
    except KeyError:
        pass
    except TypeError:
        return check(*args)
    result = check(*args)
    if len(cache) >= 4096:  # a bound, for callers whose shapes never repeat
        cache.clear()
    cache[key] = result
    return result


def check_block_list(active_block_indices, bin_counts):
    """Checks an index list [M, 3] of integers and its count, an integer array of one element."""
    indices, counts = active_block_indices, bin_counts
    if indices.ndim != 2 or indices.shape[1] != 3:
        raise ValueError(f"active_block_indices must be [M, 3], got shape {tuple(indices.shape)}")
    if not dtype_name(indices).startswith(("int", "uint")):
        raise TypeError(f"active_block_indices must be integers, got {dtype_name(indices)}")
    if size(counts.shape) != 1 or not dtype_name(counts).startswith(("int", "uint")):
        raise ValueError(f"bin_counts must be one integer, as an array of shape [1], "
                         f"got shape {tuple(counts.shape)} dtype {dtype_name(counts)}")


def block_list(xp, active_block_indices, bin_counts):
    """int32 [rows, 3] indices and int32 [1] count of a checked list, converted (on the device)
    where needed."""
    indices, counts = active_block_indices, bin_counts
    # Indices past int32 point outside any tensor; clipping keeps them outside.
    if indices.dtype != xp.int32:
        limits = xp.iinfo(xp.int32)
        indices = xp.clip(indices, limits.min, limits.max).astype(xp.int32)
    if counts.dtype != xp.int32:
        counts = xp.clip(counts, 0, xp.iinfo(xp.int32).max).astype(xp.int32)
    if not indices.flags.c_contiguous:
        indices = xp.ascontiguousarray(indices)
    if not counts.flags.c_contiguous or counts.shape != (1,):
        counts = xp.ascontiguousarray(counts).reshape(1)
    return indices, counts


def alignment(*addresses):
    """The largest power of two up to 16 that divides every address: how wide an access may be."""
    low = 16
    for address in addresses:
        low |= address
    return low & -low


def on_device(a):
    """Context that makes a CuPy array's device current for allocations and launches (nothing to
    do, the common case, when it already is)."""
    if cupy is None or not isinstance(a, cupy.ndarray) or (
            a.data.device_id == cupy.cuda.runtime.getDevice()):
        return contextlib.nullcontext()
    return cupy.cuda.Device(a.data.device_id)


def valid_rows_numpy(indices, counts):
    """Rows of the index list that the ops use: the count clamped to [0, rows]."""
    return min(max(int(counts[0]), 0), indices.shape[0])


def grid_dim(name, value, limit=65535):
    if value > limit:
        raise ValueError(f"{name} is too large for one launch ({value} tiles, limit {limit})")
    return value
