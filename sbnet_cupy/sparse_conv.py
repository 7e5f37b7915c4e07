"""Convolution on gathered blocks (one GEMM through cuBLAS or NumPy), and SBNet's sparse
residual unit, for CuPy or NumPy arrays with no framework.

Weights are HWIO ([KH, KW, C_in, C_out], SBNet's and TensorFlow's layout). On CuPy the GEMM runs
in the arrays' dtype: float16 on tensor cores, float32 on TF32 tensor cores when CuPy's
CUPY_TF32=1 is set.
"""

import numpy

from . import _checks
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


def sparse_conv2d(x, w, bin_counts, active_block_indices, block_params, *, bias=None,
                  base=None):
    """A stride-1 convolution computed on the active blocks only.

    Args:
        x: [N, H, W, C]. w: [KH, KW, C, K]. bias: optional [K].
        bin_counts, active_block_indices: the block list (reduce_mask with block_params).
        block_params: calc_block_params((H, W), bsize, (KH, KW)) for this convolution.
        base: [N, H, W, K] to write the output blocks into (a copy is returned); zeros if None.

    Returns:
        base with the SAME convolution of x written on the output blocks of the active blocks.
    """
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


def sparse_res_block_bottleneck(x, bin_counts, active_block_indices, block_params, folded, *,
                                inplace=False):
    """SBNet's sparse bottleneck unit: x + F(x) on the active blocks, x elsewhere.

    Args:
        x: [N, H, W, C]. folded: fold_batchnorm(weights).
        bin_counts, active_block_indices: the block list (reduce_mask with block_params).
        block_params: calc_block_params_res_block((H, W), bsize, [(1, 1), (3, 3), (1, 1)]).
        inplace: add into x itself (sparse_scatter_var) instead of a copy.

    One gather of bsize blocks, the unit on them (1x1 and 3x3 convolutions as GEMMs), one
    scatter-add of bsize_out blocks. Block pixels outside the image are zeroed before the 3x3
    convolution, as the dense unit's padding does, so blocks at the border match it too."""
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
