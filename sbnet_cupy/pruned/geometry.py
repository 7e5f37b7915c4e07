"""The pruned-kernel convolution's geometry and argument checks, shared by sbnet_cupy's ops and
the bridges (arrays, tensors, or TensorFlow's static shapes)."""

from collections import namedtuple

from ..core import checks as _checks

STRATEGIES = ("compiled", "direct")  # of the CUDA kernels (plans.py)


def _padding(padding):
    """"SAME", "VALID" or ((top, bottom), (left, right)), from the forms sparse_kernel_conv2d
    takes."""
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"padding must be 'SAME', 'VALID' or explicit pads, got {padding!r}")
        return padding.upper()
    try:
        pads = tuple(padding)
        if all(type(p) is int for p in pads) and len(pads) == 2:
            pads = ((pads[0], pads[0]), (pads[1], pads[1]))
        pads = tuple(tuple(_checks.int_pair("padding", p, minimum=0)) for p in pads)
    except (TypeError, ValueError):
        raise ValueError(f"padding must be 'SAME', 'VALID', (pad_h, pad_w) or ((top, bottom), "
                         f"(left, right)) of ints >= 0, got {padding!r}") from None
    if len(pads) != 2:
        raise ValueError(f"padding must be 'SAME', 'VALID', (pad_h, pad_w) or ((top, bottom), "
                         f"(left, right)) of ints >= 0, got {padding!r}")
    return pads


def conv_geometry(in_hw, kernel_hw, strides, padding, dilations):
    """((out_h, out_w), ((top, bottom), (left, right))) of a convolution, TensorFlow's rules:
    SAME gives ceil(in / stride) outputs with the padding split evenly (the extra row at the
    bottom), VALID ceil((in - (k - 1) * dilation) / stride), explicit pads what they say."""
    out, pads = [], []
    for axis in range(2):
        size, k, s, d = in_hw[axis], kernel_hw[axis], strides[axis], dilations[axis]
        extent = (k - 1) * d + 1
        if padding == "SAME":
            o = -(-size // s)
            total = max((o - 1) * s + extent - size, 0)
            before, after = total // 2, total - total // 2
        else:
            before, after = (0, 0) if padding == "VALID" else padding[axis]
            padded = size + before + after
            if padded < extent:
                raise ValueError(f"kernel is larger than the padded input: its extent "
                                 f"{extent} (size {k}, dilation {d}) exceeds {padded} "
                                 f"(input {size}, padding {before} + {after}) on axis {axis}")
            o = (padded - extent) // s + 1
        out.append(o)
        pads.append((before, after))
    return tuple(out), tuple(pads)


ConvCall = namedtuple("ConvCall", ["strides", "dilations", "out_hw", "pads"])
ConvCall.__doc__ = """Checked geometry of a call: strides and dilations as int pairs, the output
size and the explicit padding ((top, bottom), (left, right))."""


def check_conv(x, kernel_shape, strides, padding, dilations, bias, strategy):
    """Checks a convolution's arguments (arrays or tensors; kernel_shape [KH, KW, Cin, Cout])
    and returns its ConvCall. Shared by sparse_kernel_conv2d and the bridges."""
    _checks.nhwc("x", x)
    k_h, k_w, cin, cout = kernel_shape
    if x.shape[3] != cin:
        raise ValueError(f"x has {x.shape[3]} channels but kernel expects {cin} "
                         f"(kernel shape {tuple(kernel_shape)})")
    strides = _checks.int_pair("strides", strides, minimum=1)
    dilations = _checks.int_pair("dilations", dilations, minimum=1)
    out_hw, pads = conv_geometry(tuple(x.shape[1:3]), (k_h, k_w), strides, _padding(padding),
                                 dilations)
    if bias is not None and (tuple(bias.shape) != (cout,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be a {_checks.dtype_name(x)} array of shape ({cout},), "
                         f"got {_checks.dtype_name(bias)} {tuple(bias.shape)}")
    _check_strategy(strategy)
    return ConvCall(strides, dilations, out_hw, pads)


def _check_strategy(strategy):
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be None or one of {STRATEGIES}, got {strategy!r}")


def check_grad(dy, kernel_shape, input_shape, strides, padding, dilations, strategy):
    """Checks the arguments of a gradient (arrays or tensors): dy is the output gradient of a
    convolution of an input of input_shape (N, H, W, Cin); returns its ConvCall."""
    _checks.nhwc("dy", dy)
    try:
        shape = tuple(int(s) for s in input_shape)
    except TypeError:
        raise TypeError(f"input_shape must be (N, H, W, Cin), got {input_shape!r}") from None
    if (len(shape) != 4 or shape[0] != dy.shape[0] or shape[3] != kernel_shape[2]
            or min(shape) < 0):
        raise ValueError(f"input_shape must be (N, H, W, Cin) = ({dy.shape[0]}, H, W, "
                         f"{kernel_shape[2]}), got {input_shape!r}")
    strides = _checks.int_pair("strides", strides, minimum=1)
    dilations = _checks.int_pair("dilations", dilations, minimum=1)
    out_hw, pads = conv_geometry(shape[1:3], tuple(kernel_shape[:2]), strides,
                                 _padding(padding), dilations)
    expected = (shape[0], *out_hw, kernel_shape[3])
    if tuple(dy.shape) != expected:
        raise ValueError(f"dy must have the forward output's shape {expected}, "
                         f"got {tuple(dy.shape)}")
    _check_strategy(strategy)
    return ConvCall(strides, dilations, out_hw, pads)


def transposed_geometry(kernel_shape, strides, dilations, pads):
    """(strides, pads, input dilation) of the forward convolution that computes the input
    gradient: dx[iy] = sum over kh' of D[iy + kh' * DH - pad'] * w[KH-1-kh'], where D is dy
    with SH - 1 zeros between its rows (and likewise for the columns) and pad' = (KH-1) * DH -
    pad_top."""
    pads_t = tuple((k - 1) * d - p for k, d, p in zip(kernel_shape[:2], dilations, pads))
    return (1, 1), pads_t, tuple(strides)
