"""The pruned-kernel convolution on NumPy arrays: one matrix product per kernel position that
has non-zero taps. The reference of the CUDA kernels and the CPU path."""

import numpy


def acc_dtype(dtype):
    return numpy.float64 if dtype == "float64" else numpy.float32


def _dense_positions(kernel, acc):
    """The dense weight in the accumulation type and the (kh, kw) that have non-zero taps."""
    w = kernel.to_dense().astype(acc)
    k_h, k_w = kernel.shape[:2]
    spots = numpy.unique(kernel.positions // (kernel.shape[2] * kernel.shape[3]))
    return w, [divmod(int(s), k_w) for s in spots]


def _tap_view(a, kh, kw, out_hw, strides, dilations):
    """a[:, kh*DH :: SH, kw*DW :: SW] cut to out_hw: what tap (kh, kw) meets at every output."""
    (oh, ow), (sh, sw), (dh, dw) = out_hw, strides, dilations
    return a[:, kh * dh: kh * dh + (oh - 1) * sh + 1: sh, kw * dw: kw * dw + (ow - 1) * sw + 1: sw]


def _padded(x, acc, out_hw, kernel_hw, strides, dilations, pads):
    """x in the accumulation type, zero-padded to cover every input pixel the outputs read."""
    n, height, width, channels = x.shape
    rows = (out_hw[0] - 1) * strides[0] + (kernel_hw[0] - 1) * dilations[0] + 1
    cols = (out_hw[1] - 1) * strides[1] + (kernel_hw[1] - 1) * dilations[1] + 1
    xpad = numpy.zeros((n, max(rows, pads[0] + height), max(cols, pads[1] + width), channels), acc)
    xpad[:, pads[0]:pads[0] + height, pads[1]:pads[1] + width] = x
    return xpad


def conv(x, kernel, strides, dilations, out_hw, pads, bias):
    acc = acc_dtype(kernel.dtype)
    w, spots = _dense_positions(kernel, acc)
    xpad = _padded(x, acc, out_hw, kernel.shape[:2], strides, dilations, pads)
    y = numpy.zeros((x.shape[0], *out_hw, kernel.shape[3]), acc)
    for kh, kw in spots:
        y += _tap_view(xpad, kh, kw, out_hw, strides, dilations) @ w[kh, kw]
    if bias is not None:
        y += bias.astype(acc)
    return y


def grad_input(dy, kernel, input_shape, strides, dilations, pads):
    acc = acc_dtype(kernel.dtype)
    w, spots = _dense_positions(kernel, acc)
    n, height, width, cin = input_shape
    out_hw = dy.shape[1:3]
    dxpad = _padded(numpy.zeros(input_shape, acc), acc, out_hw, kernel.shape[:2], strides,
                    dilations, pads)
    dy_acc = dy.astype(acc)
    for kh, kw in spots:
        _tap_view(dxpad, kh, kw, out_hw, strides, dilations)[...] += dy_acc @ w[kh, kw].T
    return dxpad[:, pads[0]:pads[0] + height, pads[1]:pads[1] + width].astype(dy.dtype)


def grad_values(x, dy, kernel, strides, dilations, pads):
    acc = acc_dtype(kernel.dtype)
    _, spots = _dense_positions(kernel, acc)
    out_hw = dy.shape[1:3]
    xpad = _padded(x, acc, out_hw, kernel.shape[:2], strides, dilations, pads)
    dy_rows = dy.astype(acc).reshape(-1, dy.shape[3])
    taps = kernel._taps
    spot_of_tap = kernel.positions // (kernel.shape[2] * kernel.shape[3])
    grad = numpy.zeros(kernel.nnz, acc)
    for kh, kw in spots:
        patches = _tap_view(xpad, kh, kw, out_hw, strides, dilations)
        full = patches.reshape(-1, patches.shape[3]).T @ dy_rows  # [Cin, Cout]
        mine = spot_of_tap == kh * kernel.shape[1] + kw
        grad[mine] = full[taps.ci[mine], taps.co[mine]]
    return grad.astype(x.dtype)
