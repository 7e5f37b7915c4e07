"""SparseKernelConv2d: a pruned nn.Conv2d that multiplies its non-zero weights only, and the
sbnet::sparse_kernel_conv2d ops behind it (registered through torch_bridge/_ops.py: CPU and
CUDA kernels, fake kernels, autograd; called directly when eager).

The weight travels as two tensors: `values` [nnz], the non-zero weights (what trains), and
`positions` [nnz], their flat indices in the dense HWIO weight [KH, KW, Cin, Cout] in
sbnet_cupy.SparseKernel's canonical order (output channel, input channel, kh, kw: the C order of
nn.Conv2d's weight [Cout, Cin, KH, KW]). The index arrays the kernels read are built from
`positions` once per version of that tensor and kept while it lives (torch_bridge._derived).
"""

import functools

import numpy
import torch

import sbnet_cupy
from sbnet_cupy import pruned as _core
from sbnet_cupy.core import checks as _checks

from .._derived import derived
from .._ops import _call, _checked, _contiguous, _numpy, _register, _same_device
from ..backend import TORCH


def _taps(positions, kernel_shape):
    """The sbnet_cupy taps (index arrays) of `positions` for kernel_shape, on its device: built
    on first use and kept while positions stays the same tensor with the same version (_derived:
    an in-place change of it rebuilds them)."""
    return derived(_build_taps, (positions,), (tuple(kernel_shape),))


def _build_taps(positions, kernel_shape):
    if not positions.is_cuda:
        return _core.Taps.from_positions(numpy, kernel_shape, positions.detach().numpy())
    import cupy

    torch.cuda.current_stream(positions.device).synchronize()  # positions is written
    with cupy.cuda.Device(positions.get_device()):
        taps = _core.Taps.from_positions(cupy, kernel_shape, cupy.asarray(positions))
        cupy.cuda.get_current_stream().synchronize()  # built before torch's stream reads it
    return taps


def _order_index(positions, kernel_shape, transposed, layout):
    """torch's view of the order (a CuPy array) of _taps(positions, kernel_shape)'s launches with
    this layout, of this weight or the transposed convolution's."""
    order = _taps(positions, kernel_shape).arrays(transposed, layout)[2]
    return torch.as_tensor(order, device=positions.device)


def _in_order(values, positions, kernel_shape, transposed, layout, order):
    """values[order] (launch_conv's values_in): order is a CuPy array of the taps of positions
    (or None, the canonical order), read through its torch view, kept as the taps are."""
    if order is None:
        return _contiguous(values)
    index = derived(_order_index, (positions,), (tuple(kernel_shape), transposed, layout))
    return values.index_select(0, index)


def _host_kernel(positions, kernel_shape, values):
    """sbnet_cupy.SparseKernel of CPU tensors, for the NumPy backend."""
    return sbnet_cupy.SparseKernel(_taps(positions, kernel_shape), _numpy(_contiguous(values)),
                                   _checks.dtype_name(values))


def _padding(pads):
    return ((pads[0], pads[1]), (pads[2], pads[3]))


def _out_hw(in_hw, kernel_shape, strides, pads, dilations):
    """Output size (plain arithmetic, which fake tensors' symbolic sizes follow)."""
    return tuple((size + pads[2 * axis] + pads[2 * axis + 1] - (kernel_shape[axis] - 1)
                  * dilations[axis] - 1) // strides[axis] + 1 for axis, size in enumerate(in_hw))


# --- the forward --------------------------------------------------------------------------

def _conv_impl(x, values, positions, bias, kernel_shape, strides, pads, dilations, strategy):
    x = _contiguous(x)
    n, height, width, _ = x.shape
    out_hw = _out_hw((height, width), kernel_shape, strides, pads, dilations)
    out = x.new_empty((n, *out_hw, kernel_shape[3]))
    if not x.is_cuda:
        sbnet_cupy.sparse_kernel_conv2d(
            _numpy(x), _host_kernel(positions, kernel_shape, values), strides=tuple(strides),
            padding=_padding(pads), dilations=tuple(dilations),
            bias=None if bias is None else _numpy(_contiguous(bias)), out=_numpy(out))
        return out
    _core.launch_conv(TORCH, _checks.dtype_name(x), x, out, bias, _taps(positions, kernel_shape),
                      functools.partial(_in_order, values, positions, kernel_shape), False,
                      tuple(strides), tuple(dilations), (pads[0], pads[2]), (1, 1),
                      strategy or None)
    return out


def _conv_fake(x, values, positions, bias, kernel_shape, strides, pads, dilations, strategy):
    out_hw = _out_hw(x.shape[1:3], kernel_shape, strides, pads, dilations)
    return x.new_empty((x.shape[0], *out_hw, kernel_shape[3]))


def _conv_setup(ctx, inputs, output):
    x, values, positions, bias, *ctx.geometry, _ = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, values, positions)


def _conv_backward(ctx, grad):
    x, values, positions = ctx.saved_tensors
    kernel_shape, strides, pads, dilations = ctx.geometry
    grad = _contiguous(grad)
    dx = dv = db = None
    if ctx.needs_input_grad[0]:
        dx = _call(_grad_input_op, None, _grad_input_impl,
                   (grad, values, positions, kernel_shape, list(x.shape), strides, pads,
                    dilations), (grad, values, positions))
    if ctx.needs_input_grad[1]:
        dv = _call(_grad_values_op, None, _grad_values_impl,
                   (x, grad, positions, kernel_shape, strides, pads, dilations),
                   (x, grad, positions))
    if ctx.has_bias and ctx.needs_input_grad[3]:
        db = grad.sum((0, 1, 2))
    return dx, dv, None, db, None, None, None, None, None


_conv_op, _conv_autograd = _register(
    "sparse_kernel_conv2d(Tensor x, Tensor values, Tensor positions, Tensor? bias, "
    "int[] kernel_shape, int[] strides, int[] pads, int[] dilations, str strategy) -> Tensor",
    _conv_impl, _conv_fake, _conv_setup, _conv_backward)


# --- the gradients ------------------------------------------------------------------------

def _grad_input_impl(dy, values, positions, kernel_shape, input_shape, strides, pads,
                     dilations):
    dy = _contiguous(dy)
    if not dy.is_cuda:
        dx = sbnet_cupy.sparse_kernel_conv2d_grad_input(
            _numpy(dy), _host_kernel(positions, kernel_shape, values), tuple(input_shape),
            strides=tuple(strides), padding=_padding(pads), dilations=tuple(dilations))
        return torch.from_numpy(dx)
    dx = dy.new_empty(tuple(input_shape))
    strides_t, pads_t, input_dilation = _core.transposed_geometry(
        kernel_shape, tuple(strides), tuple(dilations), (pads[0], pads[2]))
    _core.launch_conv(TORCH, _checks.dtype_name(dy), dy, dx, None, _taps(positions, kernel_shape),
                      functools.partial(_in_order, values, positions, kernel_shape), True,
                      strides_t, tuple(dilations), pads_t, input_dilation)
    return dx


def _grad_input_fake(dy, values, positions, kernel_shape, input_shape, strides, pads,
                     dilations):
    return dy.new_empty(tuple(input_shape))


_grad_input_op, _ = _register(
    "sparse_kernel_conv2d_grad_input(Tensor dy, Tensor values, Tensor positions, "
    "int[] kernel_shape, SymInt[] input_shape, int[] strides, int[] pads, int[] dilations) "
    "-> Tensor",
    _grad_input_impl, _grad_input_fake)


def _grad_values_impl(x, dy, positions, kernel_shape, strides, pads, dilations):
    x, dy = _contiguous(x), _contiguous(dy)
    if not x.is_cuda:
        values = torch.zeros(positions.shape[0], dtype=x.dtype)  # the kernel's dtype only
        grad = sbnet_cupy.sparse_kernel_conv2d_grad_values(
            _numpy(x), _numpy(dy), _host_kernel(positions, kernel_shape, values),
            strides=tuple(strides), padding=_padding(pads), dilations=tuple(dilations))
        return torch.from_numpy(grad)
    if torch.are_deterministic_algorithms_enabled():
        return _grad_values_deterministic(x, dy, positions, kernel_shape, strides, pads,
                                          dilations)
    grad = _core.launch_grad_values(TORCH, _checks.dtype_name(x), x, dy,
                                    _taps(positions, kernel_shape), tuple(strides),
                                    tuple(dilations), (pads[0], pads[2]))
    return grad.to(x.dtype)


def _grad_values_deterministic(x, dy, positions, kernel_shape, strides, pads, dilations):
    """The values' gradient as the dense weight's (cuDNN's deterministic algorithms, under
    torch's deterministic mode) at the positions: the kernel adds each CTA's sums with atomics,
    in an order that changes from run to run."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_nchw = torch.nn.functional.pad(x.permute(0, 3, 1, 2).to(acc),
                                     (pads[2], pads[3], pads[0], pads[1]))
    k_h, k_w, cin, cout = kernel_shape
    dense = torch.nn.grad.conv2d_weight(x_nchw, (cout, cin, k_h, k_w),
                                        dy.permute(0, 3, 1, 2).to(acc), stride=tuple(strides),
                                        dilation=tuple(dilations))
    return dense.permute(2, 3, 1, 0).reshape(-1)[positions].to(x.dtype)


def _grad_values_fake(x, dy, positions, kernel_shape, strides, pads, dilations):
    return x.new_empty(positions.shape)


_grad_values_op, _ = _register(
    "sparse_kernel_conv2d_grad_values(Tensor x, Tensor dy, Tensor positions, int[] kernel_shape, "
    "int[] strides, int[] pads, int[] dilations) -> Tensor",
    _grad_values_impl, _grad_values_fake)


# --- the public functions -----------------------------------------------------------------

def check_sparse_kernel_conv(x, values, positions, kernel_shape, strides, padding, dilations,
                             bias, strategy, on_gpu):
    """Checks sparse_kernel_conv2d's tensors and returns (strides, pads [top, bottom, left,
    right], dilations) as lists."""
    if len(kernel_shape) != 4 or min(kernel_shape) < 1:
        raise ValueError(f"kernel_shape must be [KH, KW, Cin, Cout] of positive ints, "
                         f"got {kernel_shape}")
    if values.ndim != 1 or values.dtype != x.dtype:
        raise TypeError(f"values must be a 1-D tensor of x's dtype {x.dtype}, got "
                        f"{values.dtype} of shape {tuple(values.shape)}")
    call = _core.check_conv(x, tuple(kernel_shape), strides, padding, dilations, bias, strategy)
    if positions.dtype != torch.int64 or tuple(positions.shape) != tuple(values.shape):
        raise ValueError(f"positions must be an int64 tensor of values' shape "
                         f"{tuple(values.shape)}, got {positions.dtype} {tuple(positions.shape)}")
    if not on_gpu and x.dtype == torch.bfloat16:
        raise TypeError("bfloat16 needs CUDA tensors (the CPU backend is NumPy's)")
    (top, bottom), (left, right) = call.pads
    return list(call.strides), [top, bottom, left, right], list(call.dilations)


_CHECKS = {}


def sparse_kernel_conv2d(x, values, positions, kernel_shape, *, strides=(1, 1), padding="SAME",
                         dilations=(1, 1), bias=None, strategy=None):
    """sbnet_cupy.sparse_kernel_conv2d on an NHWC tensor x [N, H, W, Cin]; the weight is its
    non-zero `values` and their `positions` (see the module's docstring) in a dense weight of
    kernel_shape [KH, KW, Cin, Cout]. Differentiable in x, values and bias; the backward picks
    its own strategies."""
    kernel_shape = [int(k) for k in kernel_shape]
    strides, pads, dilations = _checked(
        _CHECKS, check_sparse_kernel_conv,
        (x, values, positions, tuple(kernel_shape), strides, padding, dilations, bias, strategy,
         x.is_cuda))
    _same_device(x, values, positions, bias, x=x, values=values, positions=positions, bias=bias)
    args = (x, values, positions, bias, kernel_shape, strides, pads, dilations, strategy or "")
    tensors = (x, values, positions) if bias is None else (x, values, positions, bias)
    differentiable = (x, values) if bias is None else (x, values, bias)
    return _call(_conv_op, _conv_autograd, _conv_impl, args, tensors, differentiable)


class SparseKernelConv2d(torch.nn.Module):
    """A pruned convolution that stores and multiplies its non-zero weights only; NCHW in and
    out, as nn.Conv2d (computed channels-last: a channels_last input is read without a copy,
    and the output is channels_last).

    Parameters: `values` [nnz], the non-zero weights, and `bias` [Cout] (or None). Buffer:
    `positions` [nnz] (int64), which fixes the pruning mask: training changes the values only.
    """

    def __init__(self, weight, bias=None, *, stride=1, padding=0, dilation=1, strategy=None):
        """weight: a pruned [Cout, Cin, KH, KW] tensor (nn.Conv2d's layout); zeros are pruned.
        stride, padding, dilation: as nn.Conv2d's (padding: an int, a pair, 'same' or 'valid').
        strategy: as sbnet_cupy.sparse_kernel_conv2d's (None: its rule)."""
        super().__init__()
        weight = weight.detach()
        if weight.ndim != 4:
            raise ValueError(f"weight must be [Cout, Cin, KH, KW], got {tuple(weight.shape)}")
        self.out_channels, self.in_channels, k_h, k_w = weight.shape
        self.kernel_size = (k_h, k_w)
        self.stride = _checks.int_pair("stride", stride, minimum=1)
        self.dilation = _checks.int_pair("dilation", dilation, minimum=1)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"padding must be an int, a pair, 'same' or 'valid', "
                                 f"got {padding!r}")
            if padding == "same" and self.stride != (1, 1):
                raise ValueError("padding='same' needs stride 1, as nn.Conv2d's")
            self.padding = padding.upper()  # TensorFlow's SAME, at stride 1, is PyTorch's same
        else:
            self.padding = _checks.int_pair("padding", padding, minimum=0)
        self.strategy = strategy
        co, ci, kh, kw = torch.nonzero(weight, as_tuple=True)  # C order: the canonical order
        self.values = torch.nn.Parameter(weight[co, ci, kh, kw].clone())
        positions = ((kh * k_w + kw) * self.in_channels + ci) * self.out_channels + co
        self.register_buffer("positions", positions.to(torch.int64))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone())

    @classmethod
    def from_conv(cls, conv, *, strategy=None):
        """The SparseKernelConv2d of a pruned nn.Conv2d (same device and dtype; weights copied)."""
        if not isinstance(conv, torch.nn.Conv2d):
            raise TypeError(f"conv must be a torch.nn.Conv2d, got {type(conv).__name__}")
        if conv.groups != 1:
            raise ValueError(f"conv.groups must be 1, got {conv.groups}")
        if conv.padding_mode != "zeros":
            raise ValueError(f"conv.padding_mode must be 'zeros', got {conv.padding_mode!r}")
        return cls(conv.weight, conv.bias, stride=conv.stride, padding=conv.padding,
                   dilation=conv.dilation, strategy=strategy)

    @property
    def kernel_shape(self):
        """[KH, KW, Cin, Cout]: the dense weight's HWIO shape."""
        return [*self.kernel_size, self.in_channels, self.out_channels]

    def dense_weight(self):
        """The dense [Cout, Cin, KH, KW] weight (zeros at the pruned taps), differentiable in
        the values."""
        k_h, k_w, cin, cout = self.kernel_shape
        flat = self.values.new_zeros(k_h * k_w * cin * cout).index_put(
            (self.positions,), self.values)
        return flat.reshape(k_h, k_w, cin, cout).permute(3, 2, 0, 1)

    def forward(self, x):
        y = sparse_kernel_conv2d(x.permute(0, 2, 3, 1), self.values, self.positions,
                                 self.kernel_shape, strides=self.stride, padding=self.padding,
                                 dilations=self.dilation, bias=self.bias,
                                 strategy=self.strategy)
        return y.permute(0, 3, 1, 2)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"nnz={self.values.numel()}, bias={self.bias is not None}")
