"""sparse_kernel_conv2d: 2-D convolution with a pruned weight, multiplying its non-zero taps only.

A weight is converted once, on its device, by SparseKernel.from_dense; the convolution then
reads the tap lists (the pruning mask stays fixed, so the values alone can be trained). Two
CUDA strategies (kernels/pruned/sparse_kernel_conv.cu), picked per shape by choose_strategy:

- "compiled": the mask compiled into the kernel. A warp computes 32 columns x P rows of output
  for a group of Q output channels from an input tile (with halo) staged in shared memory.
  Per column (input channel, kw) of the group's taps, each thread loads the input rows its
  outputs read into registers once (16-byte loads), and every tap of the column, whatever its
  kh, is P FMAs from registers. The tap's accumulator and window offset must be compile-time
  indices for both to stay in registers, so the code for a mask is generated (program.py) and
  compiled by NVRTC on first use (CuPy keeps the binary in its disk cache); the values stay in
  memory, so training them needs no recompilation. Unit vertical stride, no input dilation,
  float32 arithmetic, at most COMPILED_MAX_TAPS taps.
- "direct": any stride, dilation and input dilation (the gradient of a strided convolution),
  float64 too: P shared-memory loads and P FMAs a tap, read from the tap list at run time.

NumPy arrays run a vectorised NumPy backend (one matrix product per kernel position that has
non-zero taps), the reference and the CPU path.
"""

import numpy

from ..core import backend as _backend, checks as _checks
from . import reference as _reference
from .geometry import check_conv, check_grad, transposed_geometry
from .plans import conv_plan, grad_values_plan
from .weight import check_kernel

# --- the public ops ------------------------------------------------------------------------

def sparse_kernel_conv2d(x, kernel, *, strides=(1, 1), padding="SAME", dilations=(1, 1),
                         bias=None, strategy=None, out=None):
    """Convolve NHWC `x` with a pruned weight, multiplying its non-zero taps only.

    Args:
        x: [N, H, W, Cin] array (numpy or cupy) of the kernel's dtype, on its device.
        kernel: SparseKernel.from_dense(w) of the weight w [KH, KW, Cin, Cout].
        strides, dilations: (SH, SW) and (DH, DW), ints >= 1 (or one int for both).
        padding: "SAME" or "VALID" (TensorFlow's rules), (pad_h, pad_w) for symmetric zero
            padding (PyTorch's), or ((top, bottom), (left, right)).
        bias: optional [Cout] array of x's dtype.
        strategy: None (choose_strategy's rule), "compiled" or "direct" (CuPy only; the
            NumPy backend has one path).
        out: optional C-contiguous [N, OH, OW, Cout] array of x's dtype to write into (no
            allocation, so the call can be captured in a CUDA graph).

    Returns:
        [N, OH, OW, Cout] array of x's dtype: float16 and bfloat16 accumulate in float32, the
        result rounded once; float32 results equal the dense convolution's up to float32
        rounding. With xpad = x zero-padded by (top, left)::

            out[n, oy, ox, co] = bias[co] + sum over kh, kw, ci of
                xpad[n, oy*SH + kh*DH, ox*SW + kw*DW, ci] * w[kh, kw, ci, co]

        where the sum runs over the non-zero taps of w only.
    """
    xp = _checks.array_module(x=x) if bias is None else _checks.array_module(x=x, bias=bias)
    check_kernel(xp, "x", x, kernel)
    call = _checks.memoized(_CHECKED, check_conv, (x, kernel.shape, strides, padding, dilations,
                                                    bias, strategy), _checks.ARRAY_TYPES)
    shape = (x.shape[0], *call.out_hw, kernel.shape[3])
    before = (call.pads[0][0], call.pads[1][0])
    with _checks.on_device(x):
        if out is None:
            out = xp.empty(shape, dtype=x.dtype)
        elif (type(out) is not type(x) or out.shape != shape or out.dtype != x.dtype
              or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous {x.dtype} {xp.__name__} array of "
                             f"shape {shape}, got {type(out).__name__} {out.dtype} {out.shape}")
        if xp is numpy:
            out[...] = _reference.conv(x, kernel, call.strides, call.dilations, call.out_hw,
                                       before, bias)
        else:
            launch_conv(_backend.CUPY, kernel.dtype, x, out, bias, kernel._taps,
                        kernel._launch_values, False, call.strides, call.dilations, before,
                        (1, 1), strategy)
    return out


_CHECKED = {}


def sparse_kernel_conv2d_grad_input(dy, kernel, input_shape, *, strides=(1, 1), padding="SAME",
                                    dilations=(1, 1), strategy=None):
    """Gradient of sparse_kernel_conv2d with respect to x: the transposed convolution.

    Args:
        dy: [N, OH, OW, Cout] gradient of the output, of the kernel's dtype.
        kernel: the SparseKernel of the forward call.
        input_shape: (N, H, W, Cin) of the forward call's x.
        strides, padding, dilations: those of the forward call.
        strategy: as for sparse_kernel_conv2d; "compiled" needs unit strides.

    Returns:
        dx [N, H, W, Cin] of dy's dtype::

            dx[n, oy*SH + kh*DH - top, ox*SW + kw*DW - left, ci] +=
                dy[n, oy, ox, co] * w[kh, kw, ci, co]   (over the non-zero taps)

    On CuPy it is the forward convolution of dy, with SH - 1 (SW - 1) zeros between its rows
    (columns), by the weight flipped in kh and kw with Cin and Cout swapped.
    """
    xp = _checks.array_module(dy=dy)
    check_kernel(xp, "dy", dy, kernel)
    call = check_grad(dy, kernel.shape, input_shape, strides, padding, dilations, strategy)
    before = (call.pads[0][0], call.pads[1][0])
    with _checks.on_device(dy):
        if xp is numpy:
            return _reference.grad_input(dy, kernel, tuple(input_shape), call.strides,
                                         call.dilations, before)
        dx = xp.empty(tuple(input_shape), dtype=dy.dtype)
        strides_t, pads_t, input_dilation = transposed_geometry(kernel.shape, call.strides,
                                                                call.dilations, before)
        launch_conv(_backend.CUPY, kernel.dtype, dy, dx, None, kernel._taps,
                    kernel._launch_values, True, strides_t, call.dilations, pads_t,
                    input_dilation, strategy)
        return dx


def sparse_kernel_conv2d_grad_values(x, dy, kernel, *, strides=(1, 1), padding="SAME",
                                     dilations=(1, 1)):
    """Gradient of sparse_kernel_conv2d with respect to the kernel's non-zero values.

    Args:
        x: the forward call's input [N, H, W, Cin]. dy: [N, OH, OW, Cout], the output gradient.
        kernel, strides, padding, dilations: those of the forward call.

    Returns:
        [nnz] array of x's dtype, in the order of kernel.values (accumulated in float32, or
        float64 for float64)::

            grad[t] = sum over n, oy, ox of dy[n, oy, ox, co_t] *
                      xpad[n, oy*SH + kh_t*DH, ox*SW + kw_t*DW, ci_t]

    On CuPy the sums are added up with atomics: their order, and so float rounding, varies
    from run to run.
    """
    xp = _checks.array_module(x=x, dy=dy)
    check_kernel(xp, "x", x, kernel)
    if dy.dtype != x.dtype:
        raise TypeError(f"dy dtype {dy.dtype} differs from x dtype {x.dtype}")
    _checks.nhwc("x", x)
    call = check_grad(dy, kernel.shape, x.shape, strides, padding, dilations, None)
    before = (call.pads[0][0], call.pads[1][0])
    with _checks.on_device(x):
        if xp is numpy:
            return _reference.grad_values(x, dy, kernel, call.strides, call.dilations, before)
        grad = launch_grad_values(_backend.CUPY, kernel.dtype, x, dy, kernel._taps,
                                  call.strides, call.dilations, before)
    if kernel.dtype == "bfloat16":
        return float32_to_bfloat16_bits(grad).view(x.dtype)
    return grad.astype(x.dtype, copy=False)


# --- the launches, for CuPy arrays and torch tensors alike --------------------------------

def launch_conv(backend, dtype, x, out, bias, taps, values_in, transposed, strides, dilations,
                pads, input_dilation, strategy=None):
    """The CUDA convolution of x into out on `backend`'s arrays (core.backend.CUPY, or
    torch_bridge's TORCH): x [N, H, W, Cin] and out [N, OH, OW, Cout] (C-contiguous) of `dtype`
    (a name: "bfloat16" for CuPy's 16-bit patterns too), bias [Cout] or None, by the weight
    whose mask is `taps` (a Taps on x's device) or, `transposed`, by the transposed convolution's
    weight (the input gradient: Cin and Cout swapped, see transposed_geometry). values_in(
    transposed, layout, order) gives the weight's values in the order of a launch's taps (order:
    of taps.arrays). pads: (top, left); strategy: None for choose_strategy's rule. Shared by
    sparse_kernel_conv2d, its input gradient and torch_bridge's ops."""
    k_h, k_w, cin, cout = taps.shape
    if transposed:
        cin, cout = cout, cin
    device = backend.device(x)
    plan = conv_plan(strategy, dtype, x.shape[0], tuple(x.shape[1:3]), cin, tuple(out.shape[1:3]),
                     cout, (k_h, k_w), strides, dilations, pads, input_dilation, taps.nnz, device)
    kernel = plan.kernel
    if 0 in kernel.grid:  # an empty output
        return
    ranges, codes, order = taps.arrays(transposed, plan.layout)
    values = values_in(transposed, plan.layout, order)
    function = (None if plan.layout is None
                else taps.compiled_function(transposed, plan.layout, dtype, device))
    x = backend.contiguous(x)
    bias = None if bias is None else backend.contiguous(bias)
    pointer, stream = backend.pointer, backend.stream(device)
    # ConvArgs' pointers in order; the taps are CuPy arrays whatever the backend.
    pointers = (pointer(x), pointer(out), pointer(bias), _cupy_pointer(ranges),
                _cupy_pointer(codes), pointer(values))
    if plan.split_sum is None:
        kernel.launch(stream, *pointers, 0, function=function)
        return
    # Split input channels: the kernel writes partial sums, the split sum adds them and the bias.
    partial, _owner = backend.float_scratch(device, plan.scratch)  # kept until both are queued
    kernel.launch(stream, *pointers, partial, function=function)
    plan.split_sum.launch(stream, partial, pointers[2], pointers[1])


def launch_grad_values(backend, dtype, x, dy, taps, strides, dilations, pads):
    """The CUDA gradient of a weight's values (mask `taps`) on `backend`'s arrays, as
    launch_conv: a new [nnz] array of float32 (float64 for float64) sums, which the kernel adds
    to with atomics."""
    k_h, k_w, cin, cout = taps.shape
    device = backend.device(x)
    plan = grad_values_plan(dtype, x.shape[0], tuple(x.shape[1:3]), cin, tuple(dy.shape[1:3]),
                            cout, (k_h, k_w), strides, dilations, pads, device)
    grad = backend.zeros(taps.nnz, x, "float64" if dtype == "float64" else "float32")
    if taps.nnz and 0 not in x.shape and 0 not in plan.grid:
        ranges, codes, _ = taps.arrays(False, None)
        x, dy = backend.contiguous(x), backend.contiguous(dy)
        plan.launch(backend.stream(device), backend.pointer(x), backend.pointer(dy),
                    _cupy_pointer(ranges), _cupy_pointer(codes), backend.pointer(grad))
    return grad


_cupy_pointer = _backend.CUPY.pointer


def float32_to_bfloat16_bits(a):
    """uint16 patterns of float32 array `a` rounded to bfloat16 (to nearest, ties to even;
    NaN stays NaN)."""
    xp = _checks.array_module(a=a)
    bits = a.astype(xp.float32).view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    nan = xp.isnan(a)
    return xp.where(nan, xp.uint32(0x7FC0), rounded).astype(xp.uint16)
