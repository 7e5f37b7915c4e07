"""spconv.pytorch.ops' helpers that model code calls: output shapes, and ConvAlgo."""

from sbnet_cupy import submanifold as _core

from .core import ConvAlgo
from .rulebook import deconv_output_shape

__all__ = ["ConvAlgo", "get_conv_output_size", "get_deconv_output_size"]


def get_conv_output_size(input_size, kernel_size, stride, padding, dilation):
    """Spatial shape (a list) of a strided convolution's output: (in + 2 * padding - dilation *
    (kernel - 1) - 1) // stride + 1 per axis."""
    return list(_core.conv_output_shape(input_size, kernel_size, stride, padding, dilation))


def get_deconv_output_size(input_size, kernel_size, stride, padding, dilation,
                           output_padding):
    """Spatial shape (a list) of a transposed convolution's output: (in - 1) * stride -
    2 * padding + kernel + output_padding per axis (dilation unused, as spconv's)."""
    del dilation
    return deconv_output_shape(input_size, kernel_size, stride, padding, output_padding)
