"""sbnet_cupy.sparse_kernel_conv2d on TensorFlow tensors: convolution with a pruned weight,
differentiable in the input, the weight's non-zero values and the bias (the mask stays fixed)."""

import math
from collections import namedtuple

import numpy
import tensorflow as tf

import sbnet_cupy
from sbnet_cupy import pruned as _core

from . import _call


class SparseKernel:
    """A pruned weight [KH, KW, Cin, Cout] (HWIO) for sparse_kernel_conv2d: its mask, fixed, and
    its non-zero values, a tf.Variable (in sbnet_cupy.SparseKernel's canonical order).

    Attributes:
        shape: (KH, KW, Cin, Cout). nnz: number of non-zero taps.
        positions: NumPy int64 [nnz], flat indices of the values in the dense weight.
        values: tf.Variable [nnz], trainable unless made with trainable=False.
    """

    def __init__(self, w, *, trainable=True, name="sparse_kernel"):
        """Convert a dense pruned weight (tensor or array of float16, float32 or float64);
        zeros are the pruned taps."""
        w = tf.convert_to_tensor(w)
        if w.dtype not in (tf.float16, tf.float32, tf.float64):
            raise TypeError(f"w must be float16, float32 or float64, got {w.dtype.name}")
        self._host = sbnet_cupy.SparseKernel.from_dense(w.numpy())
        self._gpu = {}  # CuPy device id -> the converted kernel there (index arrays only)
        self.shape, self.nnz = self._host.shape, self._host.nnz
        self.positions = self._host.positions
        self.values = tf.Variable(self._host.values, trainable=trainable, name=name)

    @classmethod
    def from_dense(cls, w, *, trainable=True, name="sparse_kernel"):
        """SparseKernel(w, ...), named as sbnet_cupy's."""
        return cls(w, trainable=trainable, name=name)

    def to_dense(self):
        """The dense weight [KH, KW, Cin, Cout] as a tensor (zeros at the pruned taps)."""
        flat = tf.scatter_nd(self.positions[:, None], tf.convert_to_tensor(self.values),
                             [math.prod(self.shape)])
        return tf.reshape(flat, self.shape)

    def _kernel(self, values):
        """sbnet_cupy's kernel with these values (a NumPy or CuPy array), on their device."""
        if isinstance(values, numpy.ndarray):
            return self._host.with_values(values)
        device = values.device.id
        kernel = self._gpu.get(device)
        if kernel is None:
            import cupy

            with cupy.cuda.Device(device):
                kernel = sbnet_cupy.SparseKernel.from_dense(cupy.asarray(self._host.to_dense()))
            self._gpu[device] = kernel
        return kernel.with_values(values)


_Spec = namedtuple("_Spec", ["shape", "dtype", "ndim"])


def _spec(t):
    """What sbnet_cupy's checks read of a tensor: its static shape and NumPy dtype."""
    return _Spec(tuple(t.shape), numpy.dtype(t.dtype.as_numpy_dtype), t.shape.rank)


def sparse_kernel_conv2d(x, kernel, *, strides=(1, 1), padding="SAME", dilations=(1, 1),
                         bias=None):
    """sbnet_cupy.sparse_kernel_conv2d on an NHWC tensor with a tf_bridge.SparseKernel;
    differentiable in x, kernel.values and bias. x's height, width and channels must be static.

    padding: "SAME", "VALID" (tf.nn.conv2d's), (pad_h, pad_w) or ((top, bottom), (left, right)).
    """
    if not isinstance(kernel, SparseKernel):
        raise TypeError(f"kernel must be a tf_bridge.SparseKernel, got {type(kernel).__name__}")
    x = tf.convert_to_tensor(x)
    values = tf.convert_to_tensor(kernel.values)  # a read of the variable: its gradient flows
    if x.dtype != values.dtype:
        raise TypeError(f"kernel was converted for {values.dtype.name} but x is {x.dtype.name}")
    extra = [] if bias is None else [tf.convert_to_tensor(bias)]
    call = _core.check_conv(_spec(x), kernel.shape, strides, padding, dilations,
                            _spec(extra[0]) if extra else None, None)
    geometry = dict(strides=call.strides, padding=call.pads, dilations=call.dilations)
    x_shape = tuple(x.shape)

    def forward(x_array, values_array, *bias_array):
        return sbnet_cupy.sparse_kernel_conv2d(x_array, kernel._kernel(values_array),
                                               bias=bias_array[0] if bias_array else None,
                                               **geometry)

    def grad_input(dy_array, values_array):
        return sbnet_cupy.sparse_kernel_conv2d_grad_input(
            dy_array, kernel._kernel(values_array), (dy_array.shape[0], *x_shape[1:]),
            **geometry)

    def grad_values(x_array, dy_array, values_array):
        return sbnet_cupy.sparse_kernel_conv2d_grad_values(
            x_array, dy_array, kernel._kernel(values_array), **geometry)

    @tf.custom_gradient
    def conv(x, values, *bias):
        def grad(dy):
            (dx,) = _call(grad_input, [dy, values], [x.dtype])
            dx.set_shape(x.shape)
            (dv,) = _call(grad_values, [x, dy, values], [values.dtype])
            dv.set_shape(values.shape)
            return [dx, dv] + [tf.reduce_sum(dy, [0, 1, 2])] * len(bias)

        (y,) = _call(forward, [x, values, *bias], [x.dtype])
        y.set_shape([x_shape[0], *call.out_hw, kernel.shape[3]])
        return y, grad

    return conv(x, values, *extra)
