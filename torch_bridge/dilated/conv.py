"""Dilated convolution on NCHW tensors: ``dilated_conv2d`` is ``F.conv2d(..., dilation=...)``
computed either natively or as space_to_batch -> ordinary convolution (cuDNN) ->
batch_to_space (the reshapes of torch_bridge.dilated.reshapes), by the rule of reshape_wins's
tables; DilatedConv2d is the module.
"""

import torch
import torch.nn.functional as F

from sbnet_cupy.core import checks as _checks
from sbnet_cupy.dilated.space_to_batch import dilated_conv_geometry, same_padding

from .._ops import _checked, _traced
from .._weights import prepared
from .reshapes import _batch_to_space, _channels_last, _flat, _space_to_batch, _tensor

METHODS = ("auto", "reshape", "native")
_CONV_CHECKS = {}

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
