"""Pruned-kernel convolution: a 2-D convolution that multiplies a pruned weight's non-zero taps
only (sparse_kernel_conv: the ops and their launches; weight: SparseKernel and its taps; plans:
the strategies' launch plans; program: the "compiled" strategy's generated code; geometry: the
checks; reference: the NumPy backend)."""

from .geometry import (STRATEGIES, ConvCall, check_conv, check_grad, conv_geometry,
                       transposed_geometry)
from .plans import COMPILED_MAX_TAPS, ConvPlan, choose_strategy, conv_plan, grad_values_plan
from .sparse_kernel_conv import (float32_to_bfloat16_bits, launch_conv, launch_grad_values,
                                 sparse_kernel_conv2d, sparse_kernel_conv2d_grad_input,
                                 sparse_kernel_conv2d_grad_values)
from .weight import SparseKernel, Taps

__all__ = [
    "COMPILED_MAX_TAPS",
    "ConvCall",
    "ConvPlan",
    "STRATEGIES",
    "SparseKernel",
    "Taps",
    "check_conv",
    "check_grad",
    "choose_strategy",
    "conv_geometry",
    "conv_plan",
    "float32_to_bfloat16_bits",
    "grad_values_plan",
    "launch_conv",
    "launch_grad_values",
    "sparse_kernel_conv2d",
    "sparse_kernel_conv2d_grad_input",
    "sparse_kernel_conv2d_grad_values",
    "transposed_geometry",
]
