"""tf_bridge.dilated: the reshapes and atrous_conv2d against TensorFlow's own ops, with
gradients, eagerly and in tf.function."""

import numpy
import pytest

from conftest import require

tf = require("tensorflow")

import tf_bridge  # noqa: E402
from axes import random_array  # noqa: E402


@pytest.mark.parametrize("block, paddings", [(2, ((0, 1), (1, 2))), ((3, 2), ((2, 0), (0, 1)))])
def test_reshapes_equal_tensorflow_with_gradients(rng, block, paddings):
    x = tf.constant(random_array(rng, (2, 7, 9, 3), numpy.float64))
    bh, bw = (block, block) if isinstance(block, int) else block
    dy = tf.constant(random_array(rng, (2 * bh * bw, (7 + sum(paddings[0])) // bh,
                                        (9 + sum(paddings[1])) // bw, 3), numpy.float64))
    results = []
    for ours in (True, False):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if ours:
                y = tf_bridge.space_to_batch(x, block, paddings)
            else:
                y = tf.space_to_batch(x, [bh, bw], paddings)
            loss = tf.reduce_sum(y * dy)
        results.append((y, tape.gradient(loss, x)))
    for got, want in zip(*results):
        numpy.testing.assert_array_equal(got.numpy(), want.numpy())

    y = results[0][0]
    back = []
    for ours in (True, False):
        with tf.GradientTape() as tape:
            tape.watch(y)
            out = (tf_bridge.batch_to_space(y, block, paddings) if ours
                   else tf.batch_to_space(y, [bh, bw], paddings))
            loss = tf.reduce_sum(out * x)
        back.append((out, tape.gradient(loss, y)))
    numpy.testing.assert_array_equal(back[0][0].numpy(), x.numpy())
    for got, want in zip(*back):
        numpy.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("rate", [1, 2, 3, 4, 5])
def test_atrous_conv2d_equals_tensorflow(rng, rate, padding):
    value = tf.constant(random_array(rng, (2, 13, 11, 3), numpy.float64))
    filters = tf.constant(random_array(rng, (3, 2, 3, 4), numpy.float64))
    results = []
    for function in (tf_bridge.atrous_conv2d, tf.nn.atrous_conv2d):
        with tf.GradientTape() as tape:
            tape.watch([value, filters])
            out = function(value, filters, rate, padding)
            loss = tf.reduce_sum(tf.sin(out))
        results.append((out, *tape.gradient(loss, [value, filters])))
    for got, want in zip(*results):
        numpy.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-10)


def test_atrous_conv2d_in_tf_function(rng):
    value = tf.constant(random_array(rng, (1, 10, 10, 2), numpy.float32))
    filters = tf.constant(random_array(rng, (3, 3, 2, 2), numpy.float32))
    compiled = tf.function(lambda v, f: tf_bridge.atrous_conv2d(v, f, 4, "SAME"))
    want = tf.nn.atrous_conv2d(value, filters, 4, "SAME")
    numpy.testing.assert_allclose(compiled(value, filters).numpy(), want.numpy(), rtol=1e-5,
                                  atol=1e-4)


def test_atrous_conv2d_bad_arguments():
    value, filters = tf.ones((1, 6, 6, 3)), tf.ones((3, 3, 3, 2))
    with pytest.raises(ValueError, match="padding must be 'SAME' or 'VALID'"):
        tf_bridge.atrous_conv2d(value, filters, 2, "FULL")
    with pytest.raises(TypeError, match="w dtype float64 differs from x dtype float32"):
        tf_bridge.atrous_conv2d(value, tf.cast(filters, tf.float64), 2, "SAME")
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        tf_bridge.atrous_conv2d(value, filters, 4, "VALID")
    assert tf_bridge.atrous_conv2d(value, filters, 3, "VALID").shape == (1, 0, 0, 2)
