"""The differentiable convolution behind torch_bridge.submanifold's modules: the op
sbnet::submanifold_conv (registered as in _ops.py: CPU and CUDA kernels, fake kernels, autograd;
called directly when eager) and rulebook_conv, which checks and routes a call to it.

On CUDA it is a gather through the rulebook and one cuBLAS product (torch.addmm), or the fused
kernel: sbnet_cupy.submanifold's gather_rows and fused_conv on torch tensors (the TORCH
backend); on the CPU, cpu_conv's products a tap at a time. The gradient of the features is the
same op through the transposed map, that of the weight one more product (a tap at a time on the
CPU), so the backward is deterministic.
Under CUDA autocast the op takes float32 weight and bias with float16 or bfloat16 features (see
rulebook_conv): it multiplies with them cast to the features' dtype, and returns their
gradients in float32, the weight's from a product of float16 (bfloat16) operands with float32
output (torch.mm's out_dtype), so that no gradient of a float32 parameter passes through
float16, whose sum over many sites GradScaler's scale overflows.
"""

import collections

import torch

from sbnet_cupy.core import checks as _checks
from sbnet_cupy.submanifold.conv import choose_algo
from sbnet_cupy.submanifold.conv_kernels import fused_conv, fused_sorts, gather_rows
from sbnet_cupy.submanifold.grad_kernels import grad_weight, grad_weight_takes
from sbnet_cupy.submanifold.validation import check_algo, check_operands

from .._ops import _contiguous, _register, _same_device, _traced
from ..backend import TORCH
from .cpu_conv import conv_cpu, grad_weight_cpu
from .rulebook import Rulebook


def _as_features(t, features):
    """t (a weight or bias) in the features' dtype: autocast's float32 parameters (see
    rulebook_conv) are cast here, inside the op, where no gradient is recorded."""
    return t if t is None or t.dtype == features.dtype else t.to(features.dtype)


def _conv_impl(features, weight, bias, neighbors, neighbors_t, order, order_t, algo,
               relu=False):
    weight, bias = _as_features(weight, features), _as_features(bias, features)
    if not features.is_cuda:
        y = conv_cpu(_contiguous(features), _contiguous(weight), bias, neighbors)
        return y.relu_() if relu else y
    # rulebook_conv runs these lines itself where it calls no op (see there).
    if algo == "fused":
        return fused_conv(TORCH, features, weight, bias, neighbors, order, relu)
    y = _product(gather_rows(TORCH, features, neighbors), weight, bias)
    return y.relu_() if relu else y


def _product(rows, weight, bias):
    """The gemm algorithm's product: the gathered rows [n_out, taps * cin] by the weight, plus
    the bias (cuBLAS)."""
    taps = weight.reshape(weight.shape[0], -1)
    return rows @ taps.t() if bias is None else torch.addmm(bias, rows, taps.t())


def _conv_fake(features, weight, bias, neighbors, neighbors_t, order, order_t, algo,
               relu=False):
    return features.new_empty((neighbors.shape[1], weight.shape[0]))


def _conv_setup(ctx, inputs, output):
    features, weight, bias, neighbors, neighbors_t, order, order_t, ctx.algo, *relu = inputs
    relu = relu[0] if relu else False  # the schema's default where a caller leaves it out
    ctx.bias_dtype = None if bias is None else bias.dtype
    # With the ReLU, the output too: the gradient passes where it is positive (None: no ReLU).
    ctx.save_for_backward(features, weight, neighbors, neighbors_t, order, order_t,
                          output if relu else None)


def _conv_backward(ctx, grad):
    features, weight, neighbors, neighbors_t, order, order_t, output = ctx.saved_tensors
    if output is not None:
        grad = grad.masked_fill(output <= 0, 0)
    grad = _contiguous(grad)
    needs = ctx.needs_input_grad
    traced = _traced((grad, features, weight, neighbors, neighbors_t))
    dx = dw = db = None
    if needs[0]:  # the dual op: the transposed map, the transposed weight
        recording = torch.is_grad_enabled() and (grad.requires_grad or weight.requires_grad)
        if traced or recording:  # float32 under autocast: the op casts it, and its gradient
            weight_t = weight.transpose(0, -1).contiguous()  # comes back in float32
        else:  # in the gradient's dtype (autocast's float32 weight cast) in the same copy
            weight_t = weight.transpose(0, -1).to(grad.dtype,
                                                  memory_format=torch.contiguous_format)
        route = _conv_op if traced else _conv_autograd if recording else _conv_impl
        dx = route(grad, weight_t, None, neighbors_t, neighbors, order_t, order, ctx.algo,
                   False)
    if needs[1]:
        # In the weight's dtype: float32 under autocast (see _grad_weight_impl).
        dw = (_grad_weight_op if traced else _grad_weight_impl)(
            features, grad, neighbors, list(weight.shape), weight.dtype, ctx.algo)
    if ctx.bias_dtype is not None and needs[2]:
        db = grad.sum(0, dtype=ctx.bias_dtype)
    return dx, dw, db, None, None, None, None, None, None


_conv_op, _conv_autograd = _register(
    "submanifold_conv(Tensor features, Tensor weight, Tensor? bias, Tensor neighbors, "
    "Tensor neighbors_t, Tensor? order, Tensor? order_t, str algo, bool relu=False) -> Tensor",
    _conv_impl, _conv_fake, _conv_setup, _conv_backward)


def _grad_weight_impl(features, dy, neighbors, weight_shape, out_dtype, algo="gemm"):
    """The weight's gradient [*weight_shape] in out_dtype: the features' dtype, or float32 for
    float16 and bfloat16 features (autocast's float32 weight), summed and written in float32
    (the float16 output of a sum over 100k sites of GradScaler-scaled products overflows).
    algo as the forward's: "fused" runs grad_weight's kernel where it takes the layer, else
    the gathered rows go through cuBLAS."""
    features, dy = _contiguous(features), _contiguous(dy)
    if not features.is_cuda:
        return grad_weight_cpu(features, dy, neighbors, weight_shape, out_dtype)
    if (algo == "fused" and out_dtype in (features.dtype, torch.float32)
            and grad_weight_takes(TORCH, features, dy)):
        return grad_weight(TORCH, features, dy, neighbors,
                           TORCH.dtype_name(features) if out_dtype == features.dtype
                           else "float32").reshape(weight_shape)
    g = gather_rows(TORCH, features, neighbors)
    if out_dtype == dy.dtype:
        dw = dy.t() @ g
    elif out_dtype == torch.float32 and dy.dtype in (torch.float16, torch.bfloat16):
        dw = torch.mm(dy.t(), g, out_dtype=torch.float32)  # torch >= 2.8 on CUDA
    else:
        dw = torch.mm(dy.t().to(out_dtype), g.to(out_dtype))
    return dw.reshape(weight_shape)


def _grad_weight_fake(features, dy, neighbors, weight_shape, out_dtype, algo="gemm"):
    return features.new_empty(weight_shape, dtype=out_dtype)


_grad_weight_op, _ = _register(
    "submanifold_conv_grad_weight(Tensor features, Tensor dy, Tensor neighbors, "
    "int[] weight_shape, ScalarType out_dtype, str algo=\"gemm\") -> Tensor",
    _grad_weight_impl, _grad_weight_fake)

# What check_operands reads of a tensor, for a float32 parameter checked as if cast.
_AsCast = collections.namedtuple("_AsCast", ["shape", "ndim", "dtype"])


def _as_cast(t, dtype):
    """A float32 t as check_operands would see it cast to dtype; t itself otherwise."""
    return t if t is None or t.dtype != torch.float32 else _AsCast(t.shape, t.ndim, dtype)


def _check_conv(features, weight, bias, neighbors, kernel_size, n_in, algo, autocast=False):
    """rulebook_conv's checks; autocast: its CUDA autocast path, where a float32 weight or bias
    goes with float16 or bfloat16 features (the op casts it): checked as if cast."""
    if autocast:
        weight, bias = _as_cast(weight, features.dtype), _as_cast(bias, features.dtype)
    check_operands(features, weight, bias, kernel_size, n_in)
    if neighbors.dtype != torch.int32:
        raise TypeError(f"the rulebook's maps must be int32, got {neighbors.dtype}")
    check_algo(algo, _checks.dtype_name(features))


_CHECKS = {}


def _checked_conv(features, weight, bias, neighbors, kernel_size, n_in, algo, autocast):
    """_check_conv, remembered (as _ops._checked) by what it reads: a key of these few fields
    costs less than _checked's of any arguments, and every layer's call checks."""
    if torch.compiler.is_compiling():
        return _check_conv(features, weight, bias, neighbors, kernel_size, n_in, algo, autocast)
    key = (features.shape, features.dtype, weight.shape, weight.dtype,
           None if bias is None else (bias.shape, bias.dtype), neighbors.dtype, kernel_size,
           n_in, algo, autocast)
    if key in _CHECKS:
        return
    _check_conv(features, weight, bias, neighbors, kernel_size, n_in, algo, autocast)
    if len(_CHECKS) >= 4096:  # a bound, for callers whose shapes never repeat
        _CHECKS.clear()
    _CHECKS[key] = None


def _autocast_param(t, dtype):
    """A weight or bias under CUDA autocast: float32 as it is (the op casts it), other dtypes
    cast to dtype (differentiably)."""
    return t if t is None or t.dtype == torch.float32 else t.to(dtype)


def rulebook_conv(features, rulebook, weight, bias=None, *, algo=None, relu=False):
    """sbnet_cupy.submanifold.rulebook_conv on tensors: features [N_in, Cin] through a Rulebook
    (build_rulebook, or .inverse() of one), weight [Cout, *kernel_size, Cin], bias [Cout] or
    None; returns [N_out, Cout]. Differentiable in features, weight and bias. algo: "gemm"
    (gather, then torch.addmm: TF32 where torch allows it) or "fused" (float32 runs as TF32);
    None: sbnet_cupy.submanifold.choose_algo's (TF32 allowed by
    torch.backends.cuda.matmul.allow_tf32). CPU tensors multiply a tap at a time with torch's
    ops (float16 and bfloat16 in float32 arithmetic); algo is then unused.
    relu: max(0, out) in the same call (the fused kernel's epilogue; an eval model's ReLU after
    a convolution, fuse_bn_relu). Under torch.autocast("cuda") the convolution runs in the
    autocast dtype; a float32 weight
    and bias (AMP's parameters) get float32 gradients that never pass through float16. Outside
    it, weight and bias must have the features' dtype."""
    if not isinstance(rulebook, Rulebook):
        raise TypeError(f"rulebook must be a torch_bridge.submanifold.Rulebook, got "
                        f"{type(rulebook).__name__}")
    neighbors, neighbors_t = rulebook.neighbors, rulebook.neighbors_t
    cuda = features.is_cuda
    autocast = cuda and torch.is_autocast_enabled("cuda")
    if autocast:
        # As autocast runs a matrix product: in its dtype (the features' cast differentiable,
        # so that their gradient comes back in their dtype). A float32 weight and bias go into
        # the op as they are: it multiplies with them cast, and returns their gradients in
        # float32, never through float16 (an AMP step's scaled sums overflow it). Other dtypes
        # are cast here.
        dtype = torch.get_autocast_dtype("cuda")
        features = features.to(dtype)
        weight, bias = _autocast_param(weight, dtype), _autocast_param(bias, dtype)
        autocast = dtype in (torch.float16, torch.bfloat16)
    if algo is None and not cuda:
        algo = "gemm"
    elif algo is None:
        # torch's TF32 switch matters to float32 alone, and costs microseconds to read.
        name = _checks.dtype_name(features)
        algo = choose_algo(name, name == "float32" and torch.backends.cuda.matmul.allow_tf32)
    _checked_conv(features, weight, bias, neighbors, tuple(rulebook.kernel_size),
                  neighbors_t.shape[1], algo, autocast)
    _same_device(features, weight, bias, neighbors, features=features, weight=weight, bias=bias,
                 rulebook=neighbors)
    order = order_t = None
    if cuda and algo == "fused" and fused_sorts(
            neighbors.shape[1], features.shape[1], weight.shape[0], features.element_size()):
        order = rulebook.fused_order()  # and the backward's dual op's, on neighbors_t
        if torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad):
            order_t = rulebook.fused_order(transposed=True)
    args = (features, weight, bias, neighbors, neighbors_t, order, order_t, algo, bool(relu))
    if _traced((features, weight, neighbors, neighbors_t) if bias is None else
               (features, weight, neighbors, neighbors_t, bias)):
        return _conv_op(*args)
    if torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad or (
            bias is not None and bias.requires_grad)):
        return _conv_autograd(*args)
    if not cuda:
        return _conv_impl(*args)
    # Eager on CUDA with nothing to record: _conv_impl's CUDA lines run here, so that a module's
    # call reaches the driver in four frames (forward, this, the launch function,
    # KernelPlan.launch: issue 35); traced and recording calls keep the op boundary.
    weight, bias = _as_features(weight, features), _as_features(bias, features)
    if algo == "fused":
        return fused_conv(TORCH, features, weight, bias, neighbors, order, relu)
    y = _product(gather_rows(TORCH, features, neighbors), weight, bias)
    return y.relu_() if relu else y
