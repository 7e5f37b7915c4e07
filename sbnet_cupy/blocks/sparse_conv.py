"""Convolution on blocks and SBNet's sparse residual unit, for CuPy or NumPy arrays with no
framework.

Two methods: "gemm" gathers the blocks into a stack, convolves it as one GEMM (cuBLAS or NumPy)
and scatters the result; "fused" (CuPy, float32 as TF32, float16, bfloat16) convolves straight
from the input into the output through the block list on tensor cores
(sbnet_cupy.blocks.block_conv).
method="auto" takes "fused" where it applies: CuPy arrays of float16 or bfloat16, or float32
when CuPy runs float32 products as TF32 (CUPY_TF32=1), and stride-1 block geometry.

Weights are HWIO ([KH, KW, C_in, C_out], SBNet's and TensorFlow's layout). On CuPy the GEMM runs
in the arrays' dtype: float16 on tensor cores, float32 on TF32 tensor cores when CuPy's
CUPY_TF32=1 is set.
"""

import numpy

from ..core import backend as _backend, checks as _checks
from . import block_conv
from .sparse_gather import sparse_gather
from .sparse_scatter import sparse_scatter, sparse_scatter_var


def _module(a):
    return _checks.array_module(array=a)


def conv2d_valid(blocks, w, bias=None):
    """VALID convolution of [M, H, W, C] by [KH, KW, C, K], as one [M*OH*OW, KH*KW*C] x
    [KH*KW*C, K] matrix product (im2col, the patches copied once). Returns [M, OH, OW, K]."""
    xp = _module(blocks)
    m, height, width, channels = blocks.shape
    kh, kw, _, k = w.shape
    oh, ow = height - kh + 1, width - kw + 1
    blocks = xp.ascontiguousarray(blocks)
    if kh == kw == 1:
        patches = blocks.reshape(-1, channels)
    else:
        s0, s1, s2, s3 = blocks.strides
        windows = xp.lib.stride_tricks.as_strided(
            blocks, (m, oh, ow, kh, kw, channels), (s0, s1, s2, s1, s2, s3))
        patches = windows.reshape(-1, kh * kw * channels)
    out = xp.matmul(patches, w.reshape(kh * kw * channels, k))
    if bias is not None:
        out += bias
    return out.reshape(m, oh, ow, k)


def conv2d_same(x, w, bias=None):
    """The dense counterpart: stride-1 SAME convolution of [N, H, W, C] (zero padding)."""
    xp = _module(x)
    kh, kw = w.shape[:2]
    padded = xp.pad(x, ((0, 0), ((kh - 1) // 2, kh // 2), ((kw - 1) // 2, kw // 2), (0, 0)))
    return conv2d_valid(padded, w, bias)


def _use_fused(method, x, block_params, kernel_size):
    """Whether `method` ("auto", "fused" or "gemm") runs the fused kernels on these arguments."""
    if method not in ("auto", "fused", "gemm"):
        raise ValueError(f"method must be 'auto', 'fused' or 'gemm', got {method!r}")
    if method == "gemm":
        return False
    dtype = _checks.dtype_name(x)
    reason = None
    if _module(x) is numpy:
        reason = "needs CuPy arrays"
    elif dtype not in block_conv.DTYPES:
        reason = f"does not take {dtype}"
    elif not block_conv.stride_one(block_params, kernel_size):
        reason = f"needs stride-1 block_params for kernel {kernel_size}, got {block_params}"
    if method == "fused" and reason is not None:
        raise (TypeError if reason.startswith("does not") else ValueError)(
            f"method='fused' {reason}")
    return reason is None and (method == "fused" or dtype != "float32"
                               or block_conv.tf32_allowed())


def _ohwi(xp, w):
    """HWIO -> [C_out, KH, KW, C_in], the fused kernels' weight layout."""
    return xp.ascontiguousarray(w.transpose(3, 0, 1, 2))


def _float32(xp, a):
    return None if a is None else xp.ascontiguousarray(a, dtype=xp.float32)


def _check_shape(name, a, shape):
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")


def _check_dtype(name, a, x):
    if a.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {a.dtype}")


def _sparse_conv2d_fused(x, w, bin_counts, active_block_indices, block_params, bias, base):
    xp = _module(x)
    _checks.nhwc("x", x)
    _checks.check_block_list(active_block_indices, bin_counts)
    kh, kw, cin, cout = w.shape
    _check_shape("w", w, (kh, kw, x.shape[3], cout))
    _check_dtype("w", w, x)
    if bias is not None:
        _check_shape("bias", bias, (cout,))
    with _checks.on_device(x):
        if base is None:
            y = xp.zeros(x.shape[:3] + (cout,), dtype=x.dtype)
        else:
            _checks.nhwc("base", base)
            _check_shape("base", base, (x.shape[0], *base.shape[1:3], cout))
            _check_dtype("base", base, x)
            y = xp.array(base, order="C")
        x = xp.ascontiguousarray(x)
        weight, bias32 = _ohwi(xp, w), _float32(xp, bias)
        indices, counts = _checks.block_list(xp, active_block_indices, bin_counts)
        block_conv.launch_conv(_backend.CUPY, x, y, weight, bias32, indices, counts,
                               block_params)
    return y


def sparse_conv2d(x, w, bin_counts, active_block_indices, block_params, *, bias=None,
                  base=None, method="auto"):
    """A stride-1 convolution computed on the active blocks only.

    Args:
        x: [N, H, W, C]. w: [KH, KW, C, K]. bias: optional [K].
        bin_counts, active_block_indices: the block list (reduce_mask with block_params).
        block_params: calc_block_params((H, W), bsize, (KH, KW)) for this convolution.
        base: [N, H, W, K] to write the output blocks into (a copy is returned); zeros if None.
        method: "auto", "fused" or "gemm" (see the module's docstring).

    Returns:
        base with the SAME convolution of x written on the output blocks of the active blocks.
    """
    if _use_fused(method, x, block_params, w.shape[:2]):
        return _sparse_conv2d_fused(x, w, bin_counts, active_block_indices, block_params, bias,
                                    base)
    xp = _module(x)
    blocks = sparse_gather(x, bin_counts, active_block_indices, bsize=block_params.bsize,
                           boffset=block_params.boffset, bstride=block_params.bstrides)
    out = conv2d_valid(blocks, w, bias)
    if base is None:
        with _checks.on_device(x):
            base = xp.zeros(x.shape[:3] + (w.shape[3],), dtype=out.dtype)
    return sparse_scatter(out, bin_counts, active_block_indices, base,
                          bsize=block_params.bsize_out, bstride=block_params.bsize_out)


def fold_batchnorm(weights):
    """Inference weights of the bottleneck unit: bn2 folded into conv1 and bn3 into conv2.

    weights: dict of bn1, bn2, bn3 as (scale, shift) per channel (scale = gamma /
    sqrt(var + eps), shift = beta - mean * scale) and conv1 [1, 1, C, K], conv2 [3, 3, K, K],
    conv3 [1, 1, K, C]. Returns a dict of bn1, conv1, bias1, conv2, bias2, conv3."""
    (s2, t2), (s3, t3) = weights["bn2"], weights["bn3"]
    return dict(bn1=weights["bn1"], conv1=weights["conv1"] * s2, bias1=t2,
                conv2=weights["conv2"] * s3, bias2=t3, conv3=weights["conv3"])


def _residual(xp, z, folded, conv2, inside=None):
    scale, shift = folded["bn1"]
    z = xp.maximum(z * scale + shift, 0)
    z = xp.maximum(conv2d_valid(z, folded["conv1"], folded["bias1"]), 0)
    if inside is not None:
        z *= inside  # the dense unit's zero padding of the 3x3 input, at the image border
    z = xp.maximum(conv2(z, folded["conv2"], folded["bias2"]), 0)
    return conv2d_valid(z, folded["conv3"])


def res_block_bottleneck(x, folded):
    """The dense unit: x + F(x) with F = BN-ReLU-1x1, BN-ReLU-3x3 (SAME), BN-ReLU-1x1."""
    return x + _residual(_module(x), x, folded, conv2d_same)


def _sparse_res_block_fused(x, bin_counts, active_block_indices, block_params, folded, inplace):
    xp = _module(x)
    _checks.nhwc("x", x)
    _checks.check_block_list(active_block_indices, bin_counts)
    channels, bottleneck = x.shape[3], folded["conv1"].shape[3]
    for name, shape in (("conv1", (1, 1, channels, bottleneck)),
                        ("conv2", (3, 3, bottleneck, bottleneck)),
                        ("conv3", (1, 1, bottleneck, channels)), ("bias1", (bottleneck,)),
                        ("bias2", (bottleneck,))):
        _check_shape(f"folded[{name!r}]", folded[name], shape)
    for a, part in zip(folded["bn1"], ("scale", "shift")):
        _check_shape(f"folded['bn1'] {part}", a, (channels,))
    for name in ("conv1", "conv2", "conv3"):
        _check_dtype(f"folded[{name!r}]", folded[name], x)
    if inplace and not x.flags.c_contiguous:
        raise ValueError("inplace=True needs a C-contiguous x")
    with _checks.on_device(x):
        y = x if inplace else xp.array(x, order="C")
        indices, counts = _checks.block_list(xp, active_block_indices, bin_counts)
        scale, shift = folded["bn1"]
        weights = (_float32(xp, scale), _float32(xp, shift), _ohwi(xp, folded["conv1"]),
                   _float32(xp, folded["bias1"]), _ohwi(xp, folded["conv2"]),
                   _float32(xp, folded["bias2"]), _ohwi(xp, folded["conv3"]))
        block_conv.launch_res_unit(_backend.CUPY, y, y, weights, indices, counts, block_params)
    return y


def sparse_res_block_bottleneck(x, bin_counts, active_block_indices, block_params, folded, *,
                                inplace=False, method="auto"):
    """SBNet's sparse bottleneck unit: x + F(x) on the active blocks, x elsewhere.

    Args:
        x: [N, H, W, C]. folded: fold_batchnorm(weights).
        bin_counts, active_block_indices: the block list (reduce_mask with block_params).
        block_params: calc_block_params_res_block((H, W), bsize, [(1, 1), (3, 3), (1, 1)]).
        inplace: add into x itself (sparse_scatter_var) instead of a copy.
        method: "auto", "fused" or "gemm" (see the module's docstring).

    One gather of bsize blocks, the unit on them (1x1 and 3x3 convolutions as GEMMs), one
    scatter-add of bsize_out blocks ("gemm"), or three fused launches ("fused"). Block pixels
    outside the image are zeroed before the 3x3 convolution, as the dense unit's padding does,
    so blocks at the border match it too."""
    if _use_fused(method, x, block_params, (3, 3)):
        return _sparse_res_block_fused(x, bin_counts, active_block_indices, block_params, folded,
                                       inplace)
    xp = _module(x)
    geometry = dict(bsize=block_params.bsize, boffset=block_params.boffset,
                    bstride=block_params.bstrides)
    blocks = sparse_gather(x, bin_counts, active_block_indices, **geometry)
    with _checks.on_device(x):
        ones = xp.ones(x.shape[:3] + (1,), dtype=x.dtype)
    inside = sparse_gather(ones, bin_counts, active_block_indices, **geometry)
    out = _residual(xp, blocks, folded, conv2d_valid, inside).astype(x.dtype, copy=False)
    scatter = sparse_scatter_var if inplace else sparse_scatter
    return scatter(out, bin_counts, active_block_indices, x, bsize=block_params.bsize_out,
                   bstride=block_params.bsize_out, add=True)


def random_bottleneck_weights(rng, channels, bottleneck, dtype=numpy.float32):
    """NumPy weights for the unit (for tests, demos and benchmarks): He-initialised convolutions
    and BN affines near identity."""
    def conv(kh, cin, cout):
        return (rng.standard_normal((kh, kh, cin, cout)) * numpy.sqrt(2 / (kh * kh * cin))
                ).astype(dtype)

    def bn(c):
        return (rng.uniform(0.5, 1.5, c).astype(dtype), rng.uniform(-0.5, 0.5, c).astype(dtype))

    return dict(bn1=bn(channels), conv1=conv(1, channels, bottleneck), bn2=bn(bottleneck),
                conv2=conv(3, bottleneck, bottleneck), bn3=bn(bottleneck),
                conv3=conv(1, bottleneck, channels))
