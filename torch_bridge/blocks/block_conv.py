"""The fused block convolutions (sbnet_cupy.blocks.block_conv) as torch ops, for inference on CUDA:
what SparseConv2d and SparseResBlockBottleneck run when no gradient is recorded.

Each op exists out of place (a new tensor) and in place (``_``, into its last tensor argument),
with fake kernels, so torch.compile and torch.export see one op per launch group. They record
no gradient: the modules train through gather, cuDNN and scatter.

The ops take the modules' parameters as they are (weights [K, C, KH, KW] in any float dtype)
and prepare the kernels' copies themselves (OHWI in x's dtype, float32 bias and affine), once
per parameter version: eager calls and torch.compile's graphs alike then launch nothing but the
kernels (``_weights``, which says how CUDA graphs see the copies).
"""

import torch

from sbnet_cupy import BlockParams
from sbnet_cupy.blocks.block_conv import launch_conv, launch_res_unit

from .. import _ops
from .._weights import prepared
from ..backend import TORCH


def fused_dtype(x):
    """Whether the fused kernels take x's dtype on this call: float16 and bfloat16, and float32
    when cuDNN may use TF32 (torch.backends.cudnn.allow_tf32, on by default), as the
    convolutions they replace do."""
    dtype = x.dtype
    return dtype in (torch.float16, torch.bfloat16) or (
        dtype == torch.float32 and torch.backends.cudnn.allow_tf32)


def _params(bsize, boffset, bstride, bsize_out):
    return BlockParams(tuple(bsize), tuple(bsize_out), tuple(boffset), None, tuple(bstride))


# --- the kernels' copies of the weights ------------------------------------------------------

def _ohwi(weight, x):
    """A convolution's weight [K, C, KH, KW] as the kernels read it: [K, KH, KW, C] in x's
    dtype."""
    return weight.detach().to(x.device, x.dtype).permute(0, 2, 3, 1).contiguous()


def _float32(t, x):
    return None if t is None else t.detach().to(x.device, torch.float32)


def _conv_weights(x, weight, bias):
    return _ohwi(weight, x), _float32(bias, x)


def _unit_weights(x, scale, shift, w1, b1, w2, b2, w3):
    return (_float32(scale, x), _float32(shift, x), _ohwi(w1, x), _float32(b1, x), _ohwi(w2, x),
            _float32(b2, x), _ohwi(w3, x))


# --- one convolution: SparseConv2d ----------------------------------------------------------

def _cuda_only(y):
    if not y.is_cuda:
        raise ValueError("the fused block convolutions run on CUDA tensors only")


def _conv_into(x, weight, bias, bin_counts, active_block_indices, y, bsize, boffset, bstride,
               bsize_out):
    _cuda_only(y)
    counts, indices = _ops._block_list(bin_counts, active_block_indices)
    x = _ops._contiguous(x)
    weight, bias = prepared(_conv_weights, x, (weight, bias))
    launch_conv(TORCH, x, y, weight, bias, indices, counts,
                _params(bsize, boffset, bstride, bsize_out))


def _conv_impl(x, weight, bias, bin_counts, active_block_indices, base, bsize, boffset, bstride,
               bsize_out):
    y = base.clone(memory_format=torch.contiguous_format)
    _conv_into(x, weight, bias, bin_counts, active_block_indices, y, bsize, boffset, bstride,
               bsize_out)
    return y


def _conv_fake(x, weight, bias, bin_counts, active_block_indices, base, bsize, boffset, bstride,
               bsize_out):
    return torch.empty_like(base, memory_format=torch.contiguous_format)


def _in_place_fake(*args):
    return None


_CONV_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor bin_counts, "
                "Tensor active_block_indices, Tensor{} base, int[] bsize, int[] boffset, "
                "int[] bstride, int[] bsize_out) -> {}")
_conv_op, _ = _ops._register("block_conv2d" + _CONV_SCHEMA.format("", "Tensor"), _conv_impl,
                             _conv_fake)
_conv_in_place_op, _ = _ops._register("block_conv2d_" + _CONV_SCHEMA.format("(a!)", "()"),
                                      _conv_into, _in_place_fake)


def block_conv2d(x, weight, bias, found, base, params, *, inplace=False):
    """The stride-1 convolution of x [N, H, W, C] by weight [K, C, KH, KW] and bias [K] (or
    None) on the blocks of `found` (reduce_mask with params), written into a copy of base
    [N, H', W', K] (into base itself with inplace=True). Checked by the caller (SparseConv2d):
    contiguous CUDA tensors x and base of one dtype that fused_dtype accepts."""
    args = (x, weight, bias, found.bin_counts, found.active_block_indices, base, params.bsize,
            params.boffset, params.bstrides, params.bsize_out)
    tensors = (x, weight, found.bin_counts, found.active_block_indices, base)
    if inplace:
        _ops._call(_conv_in_place_op, None, _conv_into, args, tensors)
        return base
    return _ops._call(_conv_op, None, _conv_impl, args, tensors)


# --- the bottleneck unit: SparseResBlockBottleneck -----------------------------------------

def _unit_into(y, bin_counts, active_block_indices, scale, shift, w1, b1, w2, b2, w3, bsize,
               boffset, bstride, bsize_out):
    _cuda_only(y)
    counts, indices = _ops._block_list(bin_counts, active_block_indices)
    weights = prepared(_unit_weights, y, (scale, shift, w1, b1, w2, b2, w3))
    launch_res_unit(TORCH, y, y, weights, indices, counts,
                    _params(bsize, boffset, bstride, bsize_out))


def _unit_impl(x, bin_counts, active_block_indices, scale, shift, w1, b1, w2, b2, w3, bsize,
               boffset, bstride, bsize_out):
    y = x.clone(memory_format=torch.contiguous_format)
    _unit_into(y, bin_counts, active_block_indices, scale, shift, w1, b1, w2, b2, w3, bsize,
               boffset, bstride, bsize_out)
    return y


def _unit_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_UNIT_SCHEMA = ("(Tensor{} x, Tensor bin_counts, Tensor active_block_indices, Tensor scale, "
                "Tensor shift, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor w3, "
                "int[] bsize, int[] boffset, int[] bstride, int[] bsize_out) -> {}")
_unit_op, _ = _ops._register("block_conv_res_unit" + _UNIT_SCHEMA.format("", "Tensor"),
                             _unit_impl, _unit_fake)
_unit_in_place_op, _ = _ops._register("block_conv_res_unit_" + _UNIT_SCHEMA.format("(a!)", "()"),
                                      _unit_into, _in_place_fake)


def res_unit(x, found, weights, params, *, inplace=False):
    """SBNet's bottleneck unit on the blocks of `found`: x + F(x) as a new tensor, or added into
    x with inplace=True. weights: (scale, shift, w1, b1, w2, b2, w3) of the folded unit: bn1's
    affine [C], the convolutions' weights [K, C, 1, 1], [K, K, 3, 3], [C, K, 1, 1] and biases
    [K], in any float dtype. Checked by the caller (SparseResBlockBottleneck)."""
    args = (x, found.bin_counts, found.active_block_indices, *weights, params.bsize,
            params.boffset, params.bstrides, params.bsize_out)
    tensors = (x, found.bin_counts, found.active_block_indices, *weights)
    if inplace:
        _ops._call(_unit_in_place_op, None, _unit_into, args, tensors)
        return x
    return _ops._call(_unit_op, None, _unit_impl, args, tensors)
