"""Dilated convolution through space-to-batch reshapes, on NCHW tensors: the reshapes as torch
ops (reshapes) and the dilated convolution that runs natively or through them (conv)."""

from .conv import DilatedConv2d, choose_method, conv_channels_last, dilated_conv2d, reshape_wins
from .reshapes import batch_to_space, space_to_batch

__all__ = [
    "DilatedConv2d",
    "batch_to_space",
    "choose_method",
    "conv_channels_last",
    "dilated_conv2d",
    "reshape_wins",
    "space_to_batch",
]
