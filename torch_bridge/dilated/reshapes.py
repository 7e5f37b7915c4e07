"""space_to_batch and batch_to_space on NCHW tensors: sbnet_cupy's reshapes as the torch ops
``sbnet::space_to_batch`` and ``sbnet::batch_to_space`` (each the other's gradient), registered
and called as the ops of ``_ops`` are. NCHW tensors run the NCHW kernels; channels_last tensors
stay channels_last and run the NHWC kernels.
"""

import torch

import sbnet_cupy
from sbnet_cupy.dilated.reshape_plan import launch_reshape
from sbnet_cupy.dilated.space_to_batch import (batch_to_space_reshape, check_batch_to_space,
                                               check_space_to_batch, space_to_batch_reshape)

from .._ops import _call, _checked, _contiguous, _numpy, _register
from ..backend import TORCH

def _channels_last(t):
    """Whether t is stored NHWC (and not also NCHW-contiguous, as with C = 1 or H = W = 1)."""
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _layouts(op, src, mixed):
    """(tensor to hand to the kernels, x's data format, y's, memory format of the result)."""
    if mixed:  # x NCHW, y channels_last
        if op == "space_to_batch":
            return _contiguous(src), "NCHW", "NHWC", torch.channels_last
        if not src.is_contiguous(memory_format=torch.channels_last):
            src = src.contiguous(memory_format=torch.channels_last)
        return src, "NCHW", "NHWC", torch.contiguous_format
    if _channels_last(src):
        return src, "NHWC", "NHWC", torch.channels_last
    return _contiguous(src), "NCHW", "NCHW", torch.contiguous_format


def _as_format(t, data_format):
    """The NCHW tensor t as the array layout the kernels see: NHWC is a permuted view."""
    return t.permute(0, 2, 3, 1) if data_format == "NHWC" else t


def _dims(t, data_format):
    """The shape of _as_format(t, data_format), without making the view."""
    n, c, h, w = t.shape
    return (n, h, w, c) if data_format == "NHWC" else (n, c, h, w)


def _pairs(flat):
    return ((flat[0], flat[1]), (flat[2], flat[3]))


def _flat(margins):
    return [margins[0][0], margins[0][1], margins[1][0], margins[1][1]]


def _run(op, src, block, margins, mixed):
    """space_to_batch (op="space_to_batch": src is x) or batch_to_space (src is y) of an NCHW
    tensor: channels_last kept, or with `mixed`, x NCHW and y channels_last."""
    src, x_format, y_format, memory_format = _layouts(op, src, mixed)
    if op == "space_to_batch":
        src_format, out_format, reshape = x_format, y_format, space_to_batch_reshape
    else:
        src_format, out_format, reshape = y_format, x_format, batch_to_space_reshape
    geometry = reshape(_dims(src, src_format), tuple(block), _pairs(margins), x_format, y_format)
    shape = geometry.y_shape if op == "space_to_batch" else geometry.x_shape
    out = torch.empty(shape if out_format == "NCHW" else _nchw(shape), dtype=src.dtype,
                      device=src.device, memory_format=memory_format)
    if not src.is_cuda:
        function = (sbnet_cupy.space_to_batch if op == "space_to_batch"
                    else sbnet_cupy.batch_to_space)
        function(_numpy(_as_format(src, src_format)), tuple(block), _pairs(margins),
                 data_format=x_format, batch_format=y_format,
                 out=_numpy(_as_format(out, out_format)))
    else:  # both laid out in memory as the formats say
        launch_reshape(TORCH, op, src, out, geometry)
    return out


def _nchw(nhwc_shape):
    n, h, w, c = nhwc_shape
    return n, c, h, w


def _fake(t, shape, channels_last):
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=t.dtype, device=t.device, memory_format=memory_format)


# --- the two ops, each the other's gradient -------------------------------------------------

def _space_to_batch_fake(x, block, paddings, mixed):
    (bh, bw), (top, bottom, left, right) = block, paddings
    n, c, h, w = x.shape
    return _fake(x, (bh * bw * n, c, (h + top + bottom) // bh, (w + left + right) // bw),
                 mixed or _channels_last(x))


def _batch_to_space_fake(y, block, crops, mixed):
    (bh, bw), (top, bottom, left, right) = block, crops
    batch, c, hq, wq = y.shape
    return _fake(y, (batch // (bh * bw), c, bh * hq - top - bottom, bw * wq - left - right),
                 not mixed and _channels_last(y))


def _reshape_setup(ctx, inputs, output):
    """Autograd context of space_to_batch and batch_to_space: each one's backward is the other
    with the same block, margins and layouts."""
    _, ctx.block, ctx.margins, ctx.mixed = inputs


def _registered(op, src, margins, fake):
    """Registers sbnet::<op> (its input named `src`, its margins `margins`: paddings or crops)
    and returns the function that runs it on checked arguments (src, block, margins, mixed)."""
    def impl(t, block, margins, mixed):
        return _run(op, t, block, margins, mixed)

    def backward(ctx, grad):
        # Each element of x went to one element of y, and came back from it; the padding came
        # from nowhere, and the cropped elements went nowhere.
        inverse = _batch_to_space if op == "space_to_batch" else _space_to_batch
        return inverse(grad, ctx.block, ctx.margins, ctx.mixed), None, None, None

    registered, autograd = _register(
        f"{op}(Tensor {src}, int[] block, int[] {margins}, bool mixed) -> Tensor", impl, fake,
        _reshape_setup, backward)

    def call(t, block, margins, mixed=False):
        return _call(registered, autograd, impl, (t, block, margins, mixed), (t,), (t,))

    return call


_space_to_batch = _registered("space_to_batch", "x", "paddings", _space_to_batch_fake)
_batch_to_space = _registered("batch_to_space", "y", "crops", _batch_to_space_fake)


def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_space_to_batch(x, block, paddings):
    return check_space_to_batch(_tensor("x", x), block, paddings, "NCHW")


def _check_batch_to_space(y, block, crops):
    return check_batch_to_space(_tensor("y", y), block, crops, "NCHW")


_SPACE_TO_BATCH_CHECKS, _BATCH_TO_SPACE_CHECKS = {}, {}


def space_to_batch(x, block, paddings=0, *, mixed=False):
    """sbnet_cupy.space_to_batch on an NCHW tensor [N, C, H, W] -> [BH*BW*N, C, H', W'];
    differentiable. A channels_last x gives a channels_last result (NHWC kernels); with
    mixed=True, x is taken NCHW and the result is channels_last, the channels moved last in the
    same pass (batch_format="NHWC"; CUDA tensors of 2, 4 or 8-byte elements)."""
    geometry = _checked(_SPACE_TO_BATCH_CHECKS, _check_space_to_batch, (x, block, paddings))
    return _space_to_batch(x, list(geometry.block), _flat(geometry.margins), bool(mixed))


def batch_to_space(y, block, crops=0, *, mixed=False):
    """sbnet_cupy.batch_to_space on an NCHW tensor [BH*BW*N, C, H', W'] -> [N, C, H, W];
    differentiable. A channels_last y gives a channels_last result (NHWC kernels); with
    mixed=True, y is taken channels_last and the result is NCHW (space_to_batch's inverse)."""
    geometry = _checked(_BATCH_TO_SPACE_CHECKS, _check_batch_to_space, (y, block, crops))
    return _batch_to_space(y, list(geometry.block), _flat(geometry.margins), bool(mixed))
