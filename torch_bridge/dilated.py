"""Dilated convolution through space-to-batch reshapes, on NCHW tensors.

``sbnet::space_to_batch`` and ``sbnet::batch_to_space`` are sbnet_cupy's reshapes as torch ops
(each the other's gradient), registered and called as the ops of ``_ops`` are. NCHW tensors run
the NCHW kernels; channels_last tensors stay channels_last and run the NHWC kernels.
``dilated_conv2d`` is ``F.conv2d(..., dilation=...)`` computed either natively or as
space_to_batch -> ordinary convolution (cuDNN) -> batch_to_space.
"""

import torch
import torch.nn.functional as F

import sbnet_cupy
from sbnet_cupy.core import checks as _checks
from sbnet_cupy.dilated.space_to_batch import (batch_to_space_reshape, check_batch_to_space,
                                       check_space_to_batch, dilated_conv_geometry,
                                       launch_batch_to_space, launch_space_to_batch,
                                       same_padding, space_to_batch_reshape)

from ._ops import _call, _checked, _contiguous, _numpy, _raw_stream, _register, _traced
from ._weights import prepared

METHODS = ("auto", "reshape", "native")


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
        return out
    device = src.get_device()
    launch = launch_space_to_batch if op == "space_to_batch" else launch_batch_to_space
    launch(device, _raw_stream(device), src.data_ptr(), out.data_ptr(), geometry,
           src.element_size())
    return out


def _nchw(nhwc_shape):
    n, h, w, c = nhwc_shape
    return n, c, h, w


def _fake(t, shape, channels_last):
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=t.dtype, device=t.device, memory_format=memory_format)


# --- space_to_batch -------------------------------------------------------------------------

def _space_to_batch_impl(x, block, paddings, mixed):
    return _run("space_to_batch", x, block, paddings, mixed)


def _space_to_batch_fake(x, block, paddings, mixed):
    (bh, bw), (top, bottom, left, right) = block, paddings
    n, c, h, w = x.shape
    return _fake(x, (bh * bw * n, c, (h + top + bottom) // bh, (w + left + right) // bw),
                 mixed or _channels_last(x))


def _reshape_setup(ctx, inputs, output):
    """Autograd context of space_to_batch and batch_to_space: each one's backward is the other
    with the same block, margins and layouts."""
    _, ctx.block, ctx.margins, ctx.mixed = inputs


def _space_to_batch_backward(ctx, grad):
    # Each element of x went to one element of y; the padding came from nowhere.
    return _batch_to_space(grad, ctx.block, ctx.margins, ctx.mixed), None, None, None


_space_to_batch_op, _space_to_batch_autograd = _register(
    "space_to_batch(Tensor x, int[] block, int[] paddings, bool mixed) -> Tensor",
    _space_to_batch_impl, _space_to_batch_fake, _reshape_setup, _space_to_batch_backward)


def _space_to_batch(x, block, paddings, mixed=False):
    args = (x, block, paddings, mixed)
    return _call(_space_to_batch_op, _space_to_batch_autograd, _space_to_batch_impl, args, (x,),
                 (x,))


# --- batch_to_space -------------------------------------------------------------------------

def _batch_to_space_impl(y, block, crops, mixed):
    return _run("batch_to_space", y, block, crops, mixed)


def _batch_to_space_fake(y, block, crops, mixed):
    (bh, bw), (top, bottom, left, right) = block, crops
    batch, c, hq, wq = y.shape
    return _fake(y, (batch // (bh * bw), c, bh * hq - top - bottom, bw * wq - left - right),
                 not mixed and _channels_last(y))


def _batch_to_space_backward(ctx, grad):
    # Each element of x came from one element of y; the cropped ones went nowhere.
    return _space_to_batch(grad, ctx.block, ctx.margins, ctx.mixed), None, None, None


_batch_to_space_op, _batch_to_space_autograd = _register(
    "batch_to_space(Tensor y, int[] block, int[] crops, bool mixed) -> Tensor",
    _batch_to_space_impl, _batch_to_space_fake, _reshape_setup, _batch_to_space_backward)


def _batch_to_space(y, block, crops, mixed=False):
    args = (y, block, crops, mixed)
    return _call(_batch_to_space_op, _batch_to_space_autograd, _batch_to_space_impl, args, (y,),
                 (y,))


def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_space_to_batch(x, block, paddings):
    return check_space_to_batch(_tensor("x", x), block, paddings, "NCHW")


def _check_batch_to_space(y, block, crops):
    return check_batch_to_space(_tensor("y", y), block, crops, "NCHW")


_SPACE_TO_BATCH_CHECKS, _BATCH_TO_SPACE_CHECKS, _CONV_CHECKS = {}, {}, {}


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


# --- dilated convolution --------------------------------------------------------------------

# Where the reshape route was faster than the native dilation on the H100, by precision and the
# gradients that autograd records (bench/results/dilated_NVIDIA_H100_80GB_HBM3.csv: every one of
# its rows, each timing scored with its own table, is within 5% of the faster route):
# conditions (in-channels, out-channels, rate, N*H*W), each a lower bound; "both" sums the two
# gradients' times. Two tables, because the two timings disagree: inside a CUDA graph (GPU time)
# the sub-lattices' plain convolution beats cuDNN's dilated one by more than the two reshapes
# cost from 64 channels up in fp16, and for the weight gradient in TF32; called eagerly, the
# route's extra launches and autograd nodes cost host time that only weight gradients from 256
# channels and TF32 forwards of 256 channels at rates from 4 earned back on that run's host (how
# much shows through eagerly depends on the host's speed: bench/README.md). The seed's 3 -> 128
# channels never win. `python -m bench.dilated --fit <csv>` prints the tables that fit a run.
RESHAPE_WINS_GRAPHED = {
    ("float32", None): ((256, 256, 2, 0),),
    ("float32", "input"): ((2048, 256, 12, 0),),
    ("float32", "weight"): ((64, 64, 2, 0),),
    ("float32", "both"): ((64, 64, 2, 0),),
    ("float16", None): ((64, 64, 2, 0),),
    ("float16", "input"): ((64, 64, 2, 0),),
    ("float16", "weight"): ((64, 64, 2, 0),),
    ("float16", "both"): ((64, 64, 2, 0),),
}
RESHAPE_WINS_EAGER = {
    ("float32", None): ((256, 256, 4, 65536),),
    ("float32", "weight"): ((256, 256, 2, 65536), (512, 512, 2, 0)),
    ("float32", "both"): ((512, 512, 2, 0),),
    ("float16", "weight"): ((512, 512, 8, 0),),
}


def reshape_wins(dtype, in_channels, out_channels, rate, pixels, grads, graphed):
    """Whether the tables above pick the reshape route: dtype a name ("float32", ...), rate the
    smaller of the two, pixels N*H*W, grads None (no autograd), "input", "weight" or "both";
    graphed: the call is captured in a CUDA graph (RESHAPE_WINS_GRAPHED) or not
    (RESHAPE_WINS_EAGER)."""
    table = RESHAPE_WINS_GRAPHED if graphed else RESHAPE_WINS_EAGER
    return any(in_channels >= c and out_channels >= k and rate >= r and pixels >= p
               for c, k, r, p in table.get((dtype, grads), ()))


def choose_method(x, weight, dilation, *, graphed=None):
    """The route that "auto" takes for F.conv2d(x, weight, dilation=dilation) on this call:
    "reshape" or "native", by reshape_wins (CPU tensors: native). graphed: None for whether the
    current stream is capturing a CUDA graph (CapacityGraphs, torch.cuda.graph); a call that
    torch.compile traces takes the eager table, since its mode is not known while tracing."""
    if not x.is_cuda:
        return "native"
    if graphed is None:
        graphed = (not torch.compiler.is_compiling()
                   and torch.cuda.is_current_stream_capturing())
    grads = None
    if torch.is_grad_enabled():
        grads = {(True, True): "both", (True, False): "input", (False, True): "weight",
                 (False, False): None}[(x.requires_grad, weight.requires_grad)]
    n, c, h, w = x.shape
    pixels = n * h * w
    wins = reshape_wins(_checks.dtype_name(x), c, weight.shape[0], min(dilation),
                        pixels, grads, graphed)
    return "reshape" if wins else "native"


# Whether the reshape route may run its convolution in channels_last for NCHW tensors
# (conv_channels_last); bench.dilated --conv-layout nchw turns it off to compare.
CONV_CHANNELS_LAST = True
_CHANNELS_LAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def conv_channels_last(x, weight):
    """Whether the reshape route runs its convolution in channels_last for this NCHW x: on CUDA,
    for the float types of cuDNN's tensor-core convolutions and channels (C and K) in multiples
    of 8, which its NHWC kernels take as they are. The reshapes then move the channels last and
    back in their own passes (mixed=True), where cuDNN would transpose NCHW tensors in passes of
    its own. A channels_last x stays channels_last throughout anyway."""
    return (CONV_CHANNELS_LAST and x.is_cuda and x.dtype in _CHANNELS_LAST_DTYPES
            and not _channels_last(x) and x.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0)


def _conv_padding(padding, kernel, dilation):
    """((top, bottom), (left, right)) of F.conv2d's padding: an int, a pair, "valid" or "same"
    (an odd total padding puts the extra zero at the bottom and right, as torch does)."""
    if padding == "valid":
        return ((0, 0), (0, 0))
    if padding == "same":
        return same_padding(kernel, dilation)
    if isinstance(padding, str):
        raise ValueError(f"padding must be an int, a pair of ints, 'valid' or 'same', "
                         f"got {padding!r}")
    ph, pw = _checks.int_pair("padding", padding, minimum=0)
    return ((ph, ph), (pw, pw))


def _check_conv(x, weight, bias, dilation, padding, method):
    """(dilation pair, ((top, bottom), (left, right)) padding) of checked arguments."""
    for name, t in (("x", x), ("weight", weight)):
        if _tensor(name, t).ndim != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [K, C, KH, KW] with C = {x.shape[1]} (x's channels), "
                         f"got shape {tuple(weight.shape)}")
    if bias is not None and tuple(_tensor("bias", bias).shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    dilation = _checks.int_pair("dilation", dilation, minimum=1)
    kernel = tuple(weight.shape[2:])
    paddings = _conv_padding(padding, kernel, dilation)
    for size, k, d, (before, after) in zip(x.shape[2:], kernel, dilation, paddings):
        if size + before + after - d * (k - 1) < 1:
            raise ValueError(f"x ({tuple(x.shape[2:])}) padded by {paddings} is smaller than "
                             f"the dilated kernel {kernel} x dilation {dilation}")
    return dilation, paddings


def dilated_conv2d(x, weight, bias=None, *, dilation, padding=0, method="auto"):
    """F.conv2d(x, weight, bias, padding=padding, dilation=dilation) (stride 1, one group),
    differentiable in x, weight and bias.

    Args:
        x: [N, C, H, W] tensor (channels_last kept). weight: [K, C, KH, KW]. bias: None or [K].
        dilation: int or (DH, DW) >= 1.
        padding: int or (PH, PW) zeros on each side, or "valid" or "same".
        method: "native" calls F.conv2d with dilation=; "reshape" computes::

                y = space_to_batch(x, dilation, paddings)   # the sub-lattices as a batch
                z = F.conv2d(y, weight, bias, padding=q)    # no dilation: cuDNN's fast paths
                out = batch_to_space(z, dilation, crops)

            (y and z channels_last where conv_channels_last says so)

            where paddings make H and W multiples of the dilation and the convolution's own
            padding q takes whole multiples of it (DilatedConvGeometry); "auto" picks one of
            the two by choose_method.

    Returns:
        [N, K, OH, OW] with OH = H + top + bottom - DH*(KH - 1), as F.conv2d.
    """
    dilation, paddings = _checked(_CONV_CHECKS, _check_conv,
                                  (x, weight, bias, dilation, padding, method))
    if method == "auto":
        method = choose_method(x, weight, dilation)
    if method == "native":
        conv_padding = padding if isinstance(padding, str) else tuple(p for p, _ in paddings)
        return F.conv2d(x, weight, bias, padding=conv_padding, dilation=dilation)
    # Under torch.compile the geometry is worked out while tracing, without the cache.
    geometry = (dilated_conv_geometry.__wrapped__ if torch.compiler.is_compiling()
                else dilated_conv_geometry)
    g = geometry(tuple(x.shape[2:]), tuple(weight.shape[2:]), dilation, paddings,
                 conv_padding=True)
    block, mixed = list(dilation), conv_channels_last(x, weight)
    y = _space_to_batch(x, block, _flat(g.paddings), mixed)
    z = F.conv2d(y, _conv_weight(weight, y), bias, padding=g.conv_padding)
    return _batch_to_space(z, block, _flat(g.crops), mixed)


def _channels_last_copy(y, weight):
    return (weight.detach().contiguous(memory_format=torch.channels_last),)


def _conv_weight(weight, y):
    """weight as the route's convolution of y takes it. cuDNN convolves a channels_last y by a
    channels_last weight, and converts an NCHW one on every call (a kernel, and host time of its
    own); where no gradient of the weight is recorded and nothing traces the
    call, a copy made once per parameter version (_weights.prepared) saves both."""
    if (_traced((y, weight)) or not y.is_cuda or not _channels_last(y)
            or weight.device != y.device  # F.conv2d says what is wrong
            or weight.is_contiguous(memory_format=torch.channels_last)
            or (weight.requires_grad and torch.is_grad_enabled())):
        return weight
    return prepared(_channels_last_copy, y, (weight,))[0]


class DilatedConv2d(torch.nn.Conv2d):
    """torch.nn.Conv2d with stride 1 and one group whose forward is dilated_conv2d (same
    parameters and state dict, so a model swaps one for the other).

    Args: in_channels, out_channels, kernel_size, dilation, padding (int, pair, "valid" or
    "same"), bias, method ("auto", "reshape" or "native"), device, dtype."""

    def __init__(self, in_channels, out_channels, kernel_size, dilation, padding=0, bias=True,
                 method="auto", device=None, dtype=None):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        super().__init__(in_channels, out_channels, kernel_size, padding=padding,
                         dilation=dilation, bias=bias, device=device, dtype=dtype)
        self.method = method

    def forward(self, x):
        return dilated_conv2d(x, self.weight, self.bias, dilation=self.dilation,
                              padding=self.padding, method=self.method)

    def extra_repr(self):
        return super().extra_repr() + f", method={self.method!r}"
