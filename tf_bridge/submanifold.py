"""sbnet_cupy.submanifold on TensorFlow tensors: sparse convolution through a rulebook,
differentiable in the features, the weight and the bias.

Rulebooks are built eagerly from the coordinates' values (build_rulebook, on the host with the
NumPy backend) and kept as sbnet_cupy Rulebooks of NumPy arrays; each call hands their maps to
the op as int32 tensors, which the GPU path copies to the features' device.
"""

import numpy
import tensorflow as tf

from sbnet_cupy.core import checks as _checks
from sbnet_cupy import submanifold as _core

from . import _call


def build_rulebook(coords, spatial_shape, batch_size, kernel_size, stride=1, padding=0,
                   dilation=1, subm=False):
    """sbnet_cupy's Rulebook (NumPy arrays) of a submanifold (subm=True) or strided sparse
    convolution on the sites `coords` (int32 [N, 1 + D] tensor or array, read eagerly)."""
    coords = numpy.ascontiguousarray(coords.numpy() if tf.is_tensor(coords) else coords)
    if subm:
        return _core.submanifold_rulebook(coords, spatial_shape, batch_size, kernel_size,
                                          dilation)
    return _core.strided_rulebook(coords, spatial_shape, batch_size, kernel_size, stride,
                                  padding, dilation)


def _conv(features, neighbors, weight, bias):
    def run(f, n, w, *b):
        return _core.conv_arrays(_checks.array_module(features=f), f, n, w, b[0] if b else None)

    inputs = [features, neighbors, weight] + ([] if bias is None else [bias])
    (y,) = _call(run, inputs, [features.dtype])
    y.set_shape([neighbors.shape[1], weight.shape[0]])
    return y


def _grad_weight(features, dy, neighbors, shape):
    def run(f, d, n):
        return _core.grad_weight_arrays(_checks.array_module(features=f), f, d, n, tuple(shape))

    (dw,) = _call(run, [features, dy, neighbors], [features.dtype])
    dw.set_shape(shape)
    return dw


def rulebook_conv(features, rulebook, weight, bias=None):
    """sbnet_cupy.submanifold.rulebook_conv on tensors: features [N_in, Cin], weight [Cout,
    *kernel_size, Cin] (spconv's layout), bias [Cout] or None -> [N_out, Cout]; differentiable
    in features, weight and bias."""
    features, weight = tf.convert_to_tensor(features), tf.convert_to_tensor(weight)
    bias = None if bias is None else tf.convert_to_tensor(bias)
    _core.check_conv(_Spec(features), rulebook, _Spec(weight), None if bias is None
                     else _Spec(bias))
    neighbors = tf.constant(rulebook.neighbors)
    neighbors_t = tf.constant(rulebook.neighbors_t)
    perm = [weight.shape.rank - 1] + list(range(1, weight.shape.rank - 1)) + [0]

    def grads(dy, f, w):
        dx = _conv(dy, neighbors_t, tf.transpose(w, perm), None)
        return dx, _grad_weight(f, dy, neighbors, list(w.shape))

    if bias is None:
        @tf.custom_gradient
        def forward(f, w):
            return _conv(f, neighbors, w, None), lambda dy: grads(dy, f, w)

        return forward(features, weight)

    @tf.custom_gradient
    def forward_bias(f, w, b):
        return (_conv(f, neighbors, w, b),
                lambda dy: (*grads(dy, f, w), tf.reduce_sum(dy, axis=0)))

    return forward_bias(features, weight, bias)


def submanifold_conv(features, coords, spatial_shape, batch_size, weight, bias=None, *,
                     dilation=1):
    """Submanifold convolution of the sparse tensor (features [N, Cin], coords [N, 1 + D]):
    [N, Cout] at the same sites. The rulebook is built here each call: build it once with
    build_rulebook and call rulebook_conv to share it between layers."""
    rulebook = build_rulebook(coords, spatial_shape, batch_size,
                              tuple(weight.shape[1:-1]), dilation=dilation, subm=True)
    return rulebook_conv(features, rulebook, weight, bias)


class _Spec:
    """What sbnet_cupy's checks read of a tensor: its static shape, rank and NumPy dtype."""

    def __init__(self, t):
        self.shape, self.ndim = tuple(t.shape), t.shape.rank
        self.dtype = numpy.dtype(t.dtype.as_numpy_dtype)
