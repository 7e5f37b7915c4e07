"""The convolution through a rulebook (rulebook_conv, its gradients) and on sparse tensors
(submanifold_conv, sparse_conv, inverse_conv): NumPy's reference, or on CUDA a gather and one
cuBLAS product ("gemm") or the fused kernel ("fused", conv_kernels)."""

import numpy

from ..blocks import block_conv
from ..core import checks as _checks
from ..core.backend import CUPY
from .conv_kernels import fused_conv, fused_sorts, gather_rows
from .grad_kernels import grad_weight, grad_weight_takes
from .rulebook import Rulebook, SparseTensorData, strided_rulebook, submanifold_rulebook
from .validation import DTYPES, check_algo, check_operands


def check_conv(features, rulebook, weight, bias):
    """Checks rulebook_conv's arguments (arrays or tensors)."""
    if not isinstance(rulebook, Rulebook):
        raise TypeError(f"rulebook must be a Rulebook, got {type(rulebook).__name__}")
    check_operands(features, weight, bias, rulebook.kernel_size, rulebook.in_coords.shape[0])


def rulebook_conv(features, rulebook, weight, bias=None, *, algo=None):
    """Sparse convolution through a rulebook (see sbnet_cupy.submanifold's docstring for the
    formula).

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
    if dtype not in DTYPES:
        raise TypeError("bfloat16 runs through torch_bridge.submanifold (CUDA tensors)")
    if algo is None:
        algo = "gemm" if xp is numpy else choose_algo(dtype, block_conv.tf32_allowed())
    check_algo(algo, dtype)
    with _checks.on_device(features):
        fused = xp is not numpy and algo == "fused"
        order = (rulebook.fused_order() if fused and fused_sorts(
            rulebook.neighbors.shape[1], features.shape[1], weight.shape[0],
            features.dtype.itemsize) else None)
        return conv_arrays(xp, features, rulebook.neighbors, weight, bias, algo, order)


def choose_algo(dtype, tf32):
    """The algorithm rulebook_conv uses when none is given: "fused" for float16 and bfloat16, and
    for float32 where the caller's framework lets products run as TF32 (`tf32`); "gemm"
    otherwise (exact float32, float64). bench.submanifold measures both on SECOND's encoder
    (fused ahead, eagerly and graphed); on layers of a few thousand sites (SBNet's road masks)
    graphed gemm is ahead (bench/README.md)."""
    return "fused" if dtype in ("float16", "bfloat16") or (dtype == "float32" and tf32) else "gemm"


def conv_arrays(xp, features, neighbors, weight, bias, algo="gemm", order=None):
    """rulebook_conv on checked arrays of module xp, through the map `neighbors` alone (and the
    fused kernel's order of its rows, Rulebook.fused_order, or None)."""
    if xp is not numpy and algo == "fused":
        return fused_conv(CUPY, features, weight, bias, neighbors, order)
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


def rulebook_conv_grad_weight(features, dy, rulebook, *, algo=None):
    """Gradient of rulebook_conv with respect to the weight, [Cout, *kernel_size, Cin]:
    dy.T @ gather(features, rulebook.neighbors), deterministic. algo as rulebook_conv's: on
    CUDA, "fused" runs grad_weight's kernel (float32 as TF32), which never writes the gathered
    rows, where it takes the layer (grad_weight_takes); "gemm" (or a layer it does not take)
    the gather and one cuBLAS product."""
    xp = _checks.array_module(features=features, dy=dy, neighbors=rulebook.neighbors)
    n_out = rulebook.out_coords.shape[0]
    if dy.ndim != 2 or dy.shape[0] != n_out or dy.dtype != features.dtype:
        raise ValueError(f"dy must be a {features.dtype} array [{n_out}, Cout], got "
                         f"{dy.dtype} {dy.shape}")
    if features.ndim != 2 or features.shape[0] != rulebook.in_coords.shape[0]:
        raise ValueError(f"features must be [{rulebook.in_coords.shape[0]}, Cin], got "
                         f"{features.shape}")
    shape = (dy.shape[1], *rulebook.kernel_size, features.shape[1])
    dtype = _checks.dtype_name(features)
    if algo is None:
        algo = "gemm" if xp is numpy else choose_algo(dtype, block_conv.tf32_allowed())
    check_algo(algo, dtype)
    with _checks.on_device(features):
        return grad_weight_arrays(xp, features, dy, rulebook.neighbors, shape, algo)


def grad_weight_arrays(xp, features, dy, neighbors, shape, algo="gemm"):
    """rulebook_conv_grad_weight on checked arrays of module xp: the weight's `shape`."""
    if xp is numpy:
        g = gather(features, neighbors)
        acc = _acc_dtype(features.dtype)
        return (dy.astype(acc).T @ g.astype(acc)).astype(features.dtype).reshape(shape)
    if algo == "fused" and grad_weight_takes(CUPY, features, dy):
        return grad_weight(CUPY, features, dy, neighbors, CUPY.dtype_name(features)).reshape(shape)
    return (dy.T @ gather(features, neighbors)).reshape(shape)


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
    return gather_rows(CUPY, features, neighbors)


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
