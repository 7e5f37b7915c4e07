"""Sparse convolution and SBNet's sparse residual unit as torch modules.

Tensors are NHWC ([N, H, W, C], contiguous). Two methods run the convolutions:
- "gemm": gather the blocks, convolve them with torch's own (cuDNN) convolutions in
  channels_last memory format, scatter the result. Differentiable: the training path.
- "fused": sbnet_cupy's block_conv kernels convolve straight from x into the output through the
  block list on tensor cores (torch_bridge.blocks.block_conv). Inference only (no gradient
  recorded), CUDA, float16, bfloat16, or float32 where cuDNN may use TF32; the unit needs
  fold_batchnorm().
method="auto" (the default) takes "fused" wherever it applies.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import _ops
from .._weights import prepared
from . import block_conv, ops
from sbnet_cupy.core import checks as _checks
from sbnet_cupy import calc_block_params, calc_block_params_res_block


class _BatchNormAffine(nn.Module):
    """An inference BatchNorm as the per-channel affine it is: x * scale + shift (NCHW)."""

    def __init__(self, bn):
        super().__init__()
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("shift", (bn.bias - bn.running_mean * scale).detach().clone())

    def forward(self, z):
        return z * self.scale.view(1, -1, 1, 1) + self.shift.view(1, -1, 1, 1)


def _res_block_params(height, width, bsize_out):
    return calc_block_params_res_block((height, width), bsize_out + 2, [(1, 1), (3, 3), (1, 1)])


# Block geometry depends only on the image size: computed once when eager, not on every forward
# (torch.compile computes it while tracing, and would only warn about the cache).
_cached_conv_params = functools.lru_cache(maxsize=64)(calc_block_params)
_cached_res_block_params = functools.lru_cache(maxsize=64)(_res_block_params)


_METHODS = ("auto", "fused", "gemm")


def _check_method(method):
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    return method


def _use_fused(module, x, parameters, ready=True):
    """Whether module.method sends this call to the fused kernels: CUDA, a dtype they take,
    nothing for autograd to record, and `ready` (the unit's BN folded). method="fused" raises
    where they do not apply."""
    if module.method == "gemm":
        return False
    if not x.is_cuda:
        reason = "CUDA tensors"
    elif not block_conv.fused_dtype(x):
        reason = "float16, bfloat16 or float32 with TF32 allowed"
    elif torch.is_grad_enabled() and (x.requires_grad
                                      or any(p.requires_grad for p in parameters)):
        reason = "no gradient to record (torch.no_grad() or parameters without requires_grad)"
    elif not ready:
        reason = "fold_batchnorm() first"
    else:
        return True
    if module.method == "fused":
        raise ValueError(f"method='fused' needs {reason}")
    return False


def _check_fused(x, bin_counts, active_block_indices, channels):
    _checks.nhwc("x", x)
    _checks.check_block_list(active_block_indices, bin_counts)
    if x.shape[3] != channels:
        raise ValueError(f"x must have {channels} channels, got shape {tuple(x.shape)}")


_FUSED_CHECKS = {}


def _affine_in_acc(x, scale, shift):
    """scale and shift in the arithmetic type of x's gather, on x's device."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return scale.to(x.device, acc), shift.to(x.device, acc)


def _pointwise(z, conv):
    """conv (1x1) of channels-last z as a matrix product: cuDNN would return the weight's
    gradient channels-last, strides that a [K, C, 1, 1] weight's own do not match (DDP then
    warns and copies every such gradient); the product's gradient has the weight's layout."""
    y = F.linear(z.permute(0, 2, 3, 1), conv.weight.flatten(1), conv.bias)
    return y.permute(0, 3, 1, 2)


def _nchw(blocks):
    """[M, H, W, C] -> [M, C, H, W] view (channels_last memory)."""
    return blocks.permute(0, 3, 1, 2)


def _nhwc(blocks):
    return blocks.permute(0, 2, 3, 1)


class SparseConv2d(nn.Module):
    """A k x k, stride-1, SAME convolution computed on the active blocks only.

    forward(x, found) returns `base` (zeros by default) with the convolution written on the
    output blocks of the active blocks: bsize_out x bsize_out output pixels per block.
    method: "auto", "fused" or "gemm" (see the module's docstring).
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, *, bsize_out=16, bias=True,
                 method="auto"):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, bias=bias)  # VALID
        self.bsize_out = bsize_out
        self.method = _check_method(method)

    def block_params(self, height, width):
        k = self.conv.kernel_size[0]
        params = calc_block_params if torch.compiler.is_compiling() else _cached_conv_params
        return params((height, width), self.bsize_out + k - 1, k)

    def reduce_mask(self, mask, *, tol=0.5, capacity=None):
        params = self.block_params(*mask.shape[1:3])
        return ops.reduce_mask(mask, params.bcount, bsize=params.bsize, boffset=params.boffset,
                                bstride=params.bstrides, tol=tol, capacity=capacity)

    def fused(self, x):
        """Whether forward(x, ...) runs the fused kernels (see method)."""
        return _use_fused(self, x, self.parameters())

    def forward(self, x, found, base=None, *, inplace=False):
        params = self.block_params(*x.shape[1:3])
        if self.fused(x):
            _ops._checked(_FUSED_CHECKS, _check_fused, (x, found.bin_counts,
                                                        found.active_block_indices,
                                                        self.conv.in_channels))
            if base is None:
                base = x.new_zeros(x.shape[:3] + (self.conv.out_channels,))
                inplace = True
            elif base.dtype != x.dtype or base.shape[3] != self.conv.out_channels:
                raise ValueError(f"base must be [N, H, W, {self.conv.out_channels}] of x's "
                                 f"dtype, got {tuple(base.shape)} {base.dtype}")
            _ops._same_device(x, found.bin_counts, found.active_block_indices, base, x=x,
                              bin_counts=found.bin_counts,
                              active_block_indices=found.active_block_indices, base=base)
            return block_conv.block_conv2d(_ops._contiguous(x), self.conv.weight, self.conv.bias,
                                           found, base, params, inplace=inplace)
        blocks = ops.sparse_gather(x, found.bin_counts, found.active_block_indices,
                                    bsize=params.bsize, boffset=params.boffset,
                                    bstride=params.bstrides)
        out = _nhwc(self.conv(_nchw(blocks)))
        if base is None:
            base = x.new_zeros(x.shape[:3] + (self.conv.out_channels,))
        scatter = ops.sparse_scatter_var if inplace else ops.sparse_scatter
        return scatter(out, found.bin_counts, found.active_block_indices, base,
                       bsize=params.bsize_out, bstride=params.bsize_out)

    def dense(self, x):
        """The same convolution on the whole NHWC tensor."""
        k = self.conv.kernel_size[0]
        return _nhwc(F.conv2d(_nchw(x), self.conv.weight, self.conv.bias, padding=k // 2))


class SparseResBlockBottleneck(nn.Module):
    """SBNet's pre-activation bottleneck residual unit, y = x + F(x), on the active blocks.

    F is BN-ReLU-1x1 (C -> K), BN-ReLU-3x3 (K -> K), BN-ReLU-1x1 (K -> C). One gather of
    (bsize_out + 2)^2 blocks before the unit, one scatter-add of bsize_out^2 blocks after it.
    Outside the active blocks y equals x. Pixels of a block outside the image are zeroed before
    the 3x3 convolution, as the dense unit's zero padding does, so blocks at the border match it.
    fold_batchnorm() prepares inference: the second and third BN fold into the convolutions
    before them, and the first BN and its ReLU into the gather (not for bfloat16, which the
    unfused path serves). dense() is the same unit run densely, the baseline.
    method: "auto", "fused" or "gemm" (see the module's docstring); "fused" runs the folded unit
    as two or three launches that read x and add into the output through the block list.
    """

    def __init__(self, channels, bottleneck, *, bsize_out=16, method="auto"):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, bottleneck, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(bottleneck)
        self.conv2 = nn.Conv2d(bottleneck, bottleneck, 3, bias=False)  # VALID on blocks
        self.bn3 = nn.BatchNorm2d(bottleneck)
        self.conv3 = nn.Conv2d(bottleneck, channels, 1, bias=False)
        self.bsize_out = bsize_out
        self.method = _check_method(method)
        self._inside = {}

    def block_params(self, height, width):
        params = (_res_block_params if torch.compiler.is_compiling()
                  else _cached_res_block_params)
        return params(height, width, self.bsize_out)

    def reduce_mask(self, mask, *, tol=0.5, capacity=None):
        params = self.block_params(*mask.shape[1:3])
        return ops.reduce_mask(mask, params.bcount, bsize=params.bsize, boffset=params.boffset,
                                bstride=params.bstrides, tol=tol, capacity=capacity)

    def fold_batchnorm(self):
        """Fold bn2 into conv1 and bn3 into conv2, and turn bn1 into the affine that the
        gather applies (eval mode, inference only)."""
        self.eval()
        self.conv1 = torch.nn.utils.fusion.fuse_conv_bn_eval(self.conv1, self.bn2)
        self.conv2 = torch.nn.utils.fusion.fuse_conv_bn_eval(self.conv2, self.bn3)
        self.bn1 = _BatchNormAffine(self.bn1)
        self.bn2, self.bn3 = nn.Identity(), nn.Identity()
        return self

    def _residual(self, z, conv2_padding, inside=None, activated=False):
        if not activated:  # else the gather applied bn1 and its ReLU
            z = F.relu(self.bn1(z))
        z = _pointwise(z, self.conv1)
        z = F.relu(self.bn2(z))
        if inside is not None:
            z = z * inside
        z = F.conv2d(z, self.conv2.weight, self.conv2.bias, padding=conv2_padding)
        return _pointwise(F.relu(self.bn3(z)), self.conv3)

    def _gather_affine(self, x):
        """bn1's scale and shift in the gather's arithmetic type, converted once per parameter
        version when eager (a compiled graph converts them itself, or folds the conversion
        away)."""
        sources = (self.bn1.scale, self.bn1.shift)
        if torch.compiler.is_compiling():
            return _affine_in_acc(x, *sources)
        return prepared(_affine_in_acc, x, sources)

    def inside_image(self, x, found):
        """[M, 1, bh, bw] mask of the block pixels that lie inside the image: a gather of ones,
        kept from call to call when eager (a compiled graph makes its own). The units of a
        stage share it (forward's `inside`)."""
        params = self.block_params(*x.shape[1:3])
        key = (x.shape[:3], x.dtype, x.device)
        if torch.compiler.is_compiling():
            ones = x.new_ones(x.shape[:3] + (1,))
        else:
            if key not in self._inside:
                self._inside = {key: x.new_ones(x.shape[:3] + (1,))}
            ones = self._inside[key]
        return _nchw(ops.sparse_gather(ones, found.bin_counts,
                                        found.active_block_indices, bsize=params.bsize,
                                        boffset=params.boffset, bstride=params.bstrides))

    def _fused_weights(self):
        return (self.bn1.scale, self.bn1.shift, self.conv1.weight, self.conv1.bias,
                self.conv2.weight, self.conv2.bias, self.conv3.weight)

    def fused(self, x):
        """Whether forward(x, ...) runs the fused kernels (see method)."""
        return _use_fused(self, x, self.parameters(), isinstance(self.bn1, _BatchNormAffine))

    def forward(self, x, found, *, inplace=False, inside=None):
        """x: [N, H, W, C]. With inplace=True the result is added into x itself (inference).
        inside: inside_image(x, found), when the caller has it already (the fused method
        needs none)."""
        params = self.block_params(*x.shape[1:3])
        if self.fused(x):
            _ops._checked(_FUSED_CHECKS, _check_fused, (x, found.bin_counts,
                                                        found.active_block_indices,
                                                        self.bn1.scale.shape[0]))
            _ops._same_device(x, found.bin_counts, found.active_block_indices, x=x,
                              bin_counts=found.bin_counts,
                              active_block_indices=found.active_block_indices)
            if inplace and not x.is_contiguous():
                raise ValueError("inplace=True needs a contiguous x")
            return block_conv.res_unit(_ops._contiguous(x), found, self._fused_weights(), params,
                                       inplace=inplace)
        fused = isinstance(self.bn1, _BatchNormAffine) and x.dtype != torch.bfloat16
        affine = {}
        if fused:
            scale, shift = self._gather_affine(x)
            affine = dict(scale=scale, shift=shift, relu=True)
        blocks = ops.sparse_gather(x, found.bin_counts, found.active_block_indices,
                                    bsize=params.bsize, boffset=params.boffset,
                                    bstride=params.bstrides, **affine)
        if inside is None:
            inside = self.inside_image(x, found)
        out = _nhwc(self._residual(_nchw(blocks), 0, inside, activated=fused))
        scatter = ops.sparse_scatter_var if inplace else ops.sparse_scatter
        return scatter(out, found.bin_counts, found.active_block_indices, x,
                       bsize=params.bsize_out, bstride=params.bsize_out, add=True)

    def dense(self, x):
        """The same unit on the whole NHWC tensor."""
        return x + _nhwc(self._residual(_nchw(x), 1))


class SparseResStage(nn.Module):
    """A stage of SBNet's network: `units` SparseResBlockBottleneck units of one size that share
    one block list (SBNet's T2 stages have 3, 6, 6 and 3).

    forward(x, mask, capacity=None) runs one reduce_mask on the mask, then every unit on its
    blocks. With `capacity` nothing synchronises with the host, so the stage runs under CUDA
    graphs, torch.compile(mode="reduce-overhead") included; see capacity_bucket for choosing it.
    """

    def __init__(self, channels, bottleneck, units, *, bsize_out=16, method="auto"):
        super().__init__()
        self.units = nn.ModuleList(SparseResBlockBottleneck(channels, bottleneck,
                                                            bsize_out=bsize_out, method=method)
                                   for _ in range(units))

    def fold_batchnorm(self):
        for unit in self.units:
            unit.fold_batchnorm()
        return self

    def forward(self, x, mask, *, capacity=None, tol=0.5, inplace=False):
        """x: [N, H, W, C]; mask: [N, H, W]. With inplace=True the units add into x itself;
        without, the first unit makes a new tensor and, when no gradient is recorded, the
        others add into it."""
        first = self.units[0]
        found = first.reduce_mask(mask, tol=tol, capacity=capacity)
        inside = None if first.fused(x) else first.inside_image(x, found)
        into_new = not torch.is_grad_enabled()
        for i, unit in enumerate(self.units):
            x = unit(x, found, inplace=inplace or (into_new and i > 0), inside=inside)
        return x

    def dense(self, x):
        """The same units on the whole NHWC tensor."""
        for unit in self.units:
            x = unit.dense(x)
        return x
