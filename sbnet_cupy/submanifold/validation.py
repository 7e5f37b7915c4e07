"""The submanifold family's argument checks: grids, kernel geometry, features, weights and
algorithms (arrays or tensors alike), and the checked geometry of a rulebook."""

import math

import numpy

from ..core import checks as _checks, records as _records

MAX_DIMS = _records.SUBM_MAX_DIMS  # spatial axes the kernels' argument records hold
DTYPES = ("float16", "float32", "float64")  # sbnet_cupy's (bfloat16: torch_bridge's too)
ALGOS = ("gemm", "fused")


def ints(name, value, dims, minimum):
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
    if not 1 <= len(shape) <= MAX_DIMS:
        raise ValueError(f"spatial_shape must have 1 to {MAX_DIMS} axes, got {shape}")
    shape = ints("spatial_shape", shape, len(shape), 1)
    batch = ints("batch_size", batch_size, 1, 1)[0]
    if batch * math.prod(shape) >= 2**62:
        raise ValueError(f"batch_size x spatial_shape must have fewer than 2**62 sites, got "
                         f"{batch} x {shape}")
    _check_coords(coords, shape)
    return shape, batch


def _check_coords(coords, shape):
    if coords.ndim != 2 or coords.shape[1] != 1 + len(shape):
        raise ValueError(f"coords must be [N, {1 + len(shape)}] (batch index, then "
                         f"{len(shape)} coordinates), got shape {tuple(coords.shape)}")
    if _checks.dtype_name(coords) != "int32":
        raise TypeError(f"coords must be int32, got {_checks.dtype_name(coords)}")


def _geometry(shape, kernel_size, stride, padding, dilation):
    dims = len(shape)
    kernel = ints("kernel_size", kernel_size, dims, 1)
    stride = ints("stride", stride, dims, 1)
    padding = ints("padding", padding, dims, 0)
    dilation = ints("dilation", dilation, dims, 1)
    return kernel, stride, padding, dilation


def conv_output_shape(shape, kernel_size, stride, padding, dilation):
    """Spatial shape of a strided convolution's output (as spconv's and torch's conv)."""
    out = tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                for s, k, st, p, d in zip(shape, kernel_size, stride, padding, dilation))
    if min(out) < 1:
        raise ValueError(f"kernel_size {kernel_size} with dilation {dilation} and padding "
                         f"{padding} does not fit spatial_shape {shape}")
    return out


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
    if dtype not in DTYPES and dtype != "bfloat16":
        raise TypeError(f"features must be float16, bfloat16, float32 or float64, got {dtype}")
    if _checks.dtype_name(weight) != dtype:
        raise TypeError(f"weight must have features' dtype {dtype}, got "
                        f"{_checks.dtype_name(weight)}")


_GEOMETRIES = {}  # rulebook_geometry's results by _exact arguments (every check passed)


def _exact(value):
    """An int, or a list or tuple of ints, as a key that equals only the same ints (a bool, a
    float or a NumPy bool equals an int, and must fail ints' check); None for anything else."""
    if type(value) is int:
        return value
    if type(value) is list or type(value) is tuple:
        key = tuple(value)
        for v in key:
            if type(v) is not int:
                return None
        return key
    return None


def rulebook_geometry(coords, spatial_shape, batch_size, kernel_size, stride, padding,
                      dilation, subm):
    """Checked (shape, batch, (kernel, stride, padding, dilation), out_shape) of a rulebook:
    a submanifold one's stride is 1, padding kernel // 2 * dilation, out_shape None.

    Every layer's rulebook asks again with the same ints, so a result is remembered by them;
    coords are checked every call (arguments remembered passed every other check, so the
    errors are the same)."""
    subm = bool(subm)
    key = (_exact(spatial_shape), _exact(batch_size), _exact(kernel_size), _exact(dilation),
           subm) + (() if subm else (_exact(stride), _exact(padding)))  # submanifold: unused
    result = _GEOMETRIES.get(key)
    if result is not None:
        _check_coords(coords, result[0])
        return result
    result = _rulebook_geometry(coords, spatial_shape, batch_size, kernel_size, stride, padding,
                                dilation, subm)
    if None not in key:
        if len(_GEOMETRIES) >= 4096:  # a bound, for callers whose grids never repeat
            _GEOMETRIES.clear()
        _GEOMETRIES[key] = result
    return result


def _rulebook_geometry(coords, spatial_shape, batch_size, kernel_size, stride, padding,
                       dilation, subm):
    shape, batch = check_grid(coords, spatial_shape, batch_size)
    if subm:
        kernel, _, _, dilation = _geometry(shape, kernel_size, 1, 0, dilation)
        padding = tuple(k // 2 * d for k, d in zip(kernel, dilation))
        return shape, batch, (kernel, (1,) * len(shape), padding, dilation), None
    geometry = _geometry(shape, kernel_size, stride, padding, dilation)
    return shape, batch, geometry, conv_output_shape(shape, *geometry)
