"""Dilated convolution through space-to-batch reshapes on TensorFlow tensors (NHWC): the
reshapes run sbnet_cupy's kernels (NumPy on the CPU) inside py_function, each the other's
gradient; the convolution between them is tf.nn.conv2d. Shapes must be static."""

import tensorflow as tf

import sbnet_cupy
from sbnet_cupy.dilated.space_to_batch import (check_atrous_conv2d, check_batch_to_space,
                                               check_space_to_batch, dilated_conv_geometry)

from . import _call


def _reshape(op, t, block, margins):
    """sbnet_cupy's op ("space_to_batch" or "batch_to_space") of tensor t, differentiable: its
    gradient is the other op (each element of the result came from one element of t)."""
    t = tf.convert_to_tensor(t)
    forward = op == "space_to_batch"
    geometry = (check_space_to_batch if forward else check_batch_to_space)(t, block, margins)
    function = sbnet_cupy.space_to_batch if forward else sbnet_cupy.batch_to_space

    @tf.custom_gradient
    def reshape(t):
        def grad(dy):
            return _reshape("batch_to_space" if forward else "space_to_batch", dy,
                            geometry.block, geometry.margins)

        def run(array):
            return function(array, geometry.block, geometry.margins)

        (out,) = _call(run, [t], [t.dtype])
        out.set_shape(geometry.y_shape if forward else geometry.x_shape)
        return out, grad

    return reshape(t)


def space_to_batch(x, block, paddings=0):
    """sbnet_cupy.space_to_batch on an NHWC tensor (tf.space_to_batch's result);
    differentiable."""
    return _reshape("space_to_batch", x, block, paddings)


def batch_to_space(y, block, crops=0):
    """sbnet_cupy.batch_to_space on an NHWC tensor (tf.batch_to_space's result);
    differentiable."""
    return _reshape("batch_to_space", y, block, crops)


def atrous_conv2d(value, filters, rate, padding):
    """tf.nn.atrous_conv2d(value, filters, rate, padding) as space_to_batch -> tf.nn.conv2d ->
    batch_to_space, any size; differentiable in value and filters. The convolution pads whole
    multiples of the rate itself (sbnet_cupy.dilated.space_to_batch.dilated_conv_geometry)."""
    value, filters = tf.convert_to_tensor(value), tf.convert_to_tensor(filters)
    rate, paddings = check_atrous_conv2d(value, filters, rate, padding)
    g = dilated_conv_geometry(tuple(value.shape[1:3]), tuple(filters.shape[:2]), rate, paddings,
                              conv_padding=True)
    if 0 in g.out_size:
        return tf.zeros((value.shape[0], *g.out_size, filters.shape[3]), value.dtype)
    (ph, pw) = g.conv_padding
    blocks = space_to_batch(value, rate, g.paddings)
    out = tf.nn.conv2d(blocks, filters, 1, [[0, 0], [ph, ph], [pw, pw], [0, 0]])
    return batch_to_space(out, rate, g.crops)
