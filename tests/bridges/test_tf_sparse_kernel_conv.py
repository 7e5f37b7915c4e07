"""tf_bridge.sparse_kernel_conv2d: equal to tf.nn.conv2d with the same pruned weight, and so
are its gradients in the input, the non-zero values and the bias; tf.function; training keeps
the mask."""

import numpy
import pytest

from conftest import require  # noqa: E402

tf = require("tensorflow")

import tf_bridge  # noqa: E402
from axes import random_array  # noqa: E402
from reference import zero_inserted_kernel  # noqa: E402


def _pruned(rng, shape, density, dtype=numpy.float32):
    w = random_array(rng, shape, dtype)
    return numpy.where(rng.random(shape) < density, w, 0).astype(dtype)


def _tf_padding(padding):
    if isinstance(padding, str):
        return padding
    return [[0, 0], list(padding[0]), list(padding[1]), [0, 0]]


# TensorFlow's side convolves by the zero-inserted kernel, which its CPU kernels differentiate
# in every dtype and take with strides and dilations together.
@pytest.mark.parametrize("strides, padding, dilations, dtype", [
    ((1, 1), "SAME", (1, 1), numpy.float64), ((2, 2), "VALID", (1, 1), numpy.float64),
    ((2, 1), ((1, 2), (0, 3)), (1, 1), numpy.float64), ((1, 1), "SAME", (1, 1), numpy.float32),
    ((1, 1), "VALID", (2, 3), numpy.float32), ((1, 1), "VALID", (2, 3), numpy.float64),
    ((2, 1), "SAME", (2, 3), numpy.float32)])
def test_forward_and_gradients_equal_tensorflow(rng, strides, padding, dilations, dtype):
    x = tf.constant(random_array(rng, (2, 11, 13, 3), dtype))
    w = _pruned(rng, (5, 3, 3, 4), 0.3, dtype)
    bias = tf.constant(random_array(rng, (4,), dtype))
    kernel = tf_bridge.SparseKernel.from_dense(w)
    dense = tf.Variable(w)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, bias])
        ours = tf_bridge.sparse_kernel_conv2d(x, kernel, padding=padding, bias=bias,
                                              strides=strides, dilations=dilations)
        theirs = tf.nn.conv2d(x, zero_inserted_kernel(tf, dense, dilations),
                              padding=_tf_padding(padding), strides=strides) + bias
        dy = tf.constant(random_array(rng, tuple(theirs.shape), dtype))
        loss_ours, loss_theirs = tf.reduce_sum(ours * dy), tf.reduce_sum(theirs * dy)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == numpy.float32 else dict(rtol=1e-12, atol=1e-12)
    assert ours.shape == theirs.shape
    numpy.testing.assert_allclose(ours.numpy(), theirs.numpy(), **tol)
    dx, dv, db = tape.gradient(loss_ours, [x, kernel.values, bias])
    want_dx, want_dw, want_db = tape.gradient(loss_theirs, [x, dense, bias])
    numpy.testing.assert_allclose(dx.numpy(), want_dx.numpy(), **tol)
    numpy.testing.assert_allclose(dv.numpy(), want_dw.numpy().reshape(-1)[kernel.positions], **tol)
    numpy.testing.assert_allclose(db.numpy(), want_db.numpy(), **tol)


def test_tf_function_and_training_keep_the_mask(rng):
    x = tf.constant(random_array(rng, (1, 9, 10, 2), numpy.float32))
    w = _pruned(rng, (3, 3, 2, 3), 0.4)
    kernel = tf_bridge.SparseKernel(w)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf_bridge.sparse_kernel_conv2d(x, kernel) ** 2)
        grad = tape.gradient(loss, kernel.values)
        kernel.values.assign_sub(0.01 * grad)
        return loss

    before = kernel.to_dense().numpy()
    step()
    after = kernel.to_dense().numpy()
    assert not numpy.array_equal(before, after)
    numpy.testing.assert_array_equal(after == 0, w == 0)  # pruned taps stay pruned


def test_bad_input(rng):
    kernel = tf_bridge.SparseKernel(_pruned(rng, (3, 3, 2, 3), 0.5))
    x = tf.ones((1, 6, 6, 2))
    with pytest.raises(TypeError, match="kernel was converted for float32 but x is float64"):
        tf_bridge.sparse_kernel_conv2d(tf.ones((1, 6, 6, 2), tf.float64), kernel)
    with pytest.raises(ValueError, match="x has 3 channels but kernel expects 2"):
        tf_bridge.sparse_kernel_conv2d(tf.ones((1, 6, 6, 3)), kernel)
    with pytest.raises(ValueError, match="strides must be two positive ints"):
        tf_bridge.sparse_kernel_conv2d(x, kernel, strides=0)
    with pytest.raises(ValueError, match="kernel is larger than the padded input"):
        tf_bridge.sparse_kernel_conv2d(tf.ones((1, 2, 6, 2)), kernel, padding="VALID")
    with pytest.raises(TypeError, match="kernel must be a tf_bridge.SparseKernel"):
        tf_bridge.sparse_kernel_conv2d(x, numpy.ones((3, 3, 2, 3), numpy.float32))
    with pytest.raises(TypeError, match="w must be float16, float32 or float64"):
        tf_bridge.SparseKernel(numpy.ones((3, 3, 2, 3), numpy.int32))
