"""tf_bridge.submanifold against sbnet_cupy's NumPy backend, with gradients (eager and in
tf.function)."""

import numpy
import pytest
from conftest import require
from axes import random_array
from test_submanifold import random_sites

tf = require("tensorflow")

import tf_bridge  # noqa: E402
from sbnet_cupy import submanifold as sm  # noqa: E402
from tf_bridge import submanifold as tf_sm  # noqa: E402


@pytest.mark.parametrize("subm", [True, False])
def test_rulebook_conv_and_gradients(rng, subm):
    coords = random_sites(rng, 2, (6, 7, 5), 30)
    rulebook = tf_sm.build_rulebook(coords, (6, 7, 5), 2, 3, 2, 1, subm=subm)
    n_out = rulebook.out_coords.shape[0]
    x, w, b, dy = (random_array(rng, shape, numpy.float64) for shape in
                   ((30, 3), (4, 3, 3, 3, 3), (4,), (n_out, 4)))
    tensors = [tf.constant(a) for a in (x, w, b)]

    @tf.function
    def traced(x, w, b):
        return tf_sm.rulebook_conv(x, rulebook, w, b)

    for run in (lambda *t: tf_sm.rulebook_conv(t[0], rulebook, *t[1:]), traced):
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            y = run(*tensors)
            loss = tf.reduce_sum(y * dy)
        dx, dw, db = tape.gradient(loss, tensors)
        numpy.testing.assert_allclose(y.numpy(), sm.rulebook_conv(x, rulebook, w, b))
        numpy.testing.assert_allclose(dx.numpy(), sm.rulebook_conv_grad_features(dy, rulebook, w))
        numpy.testing.assert_allclose(dw.numpy(), sm.rulebook_conv_grad_weight(x, dy, rulebook))
        numpy.testing.assert_allclose(db.numpy(), dy.sum(0))


def test_submanifold_conv(rng):
    coords = random_sites(rng, 1, (8, 9), 20)
    x, w = random_array(rng, (20, 2), numpy.float32), random_array(rng, (3, 3, 3, 2),
                                                                  numpy.float32)
    y = tf_bridge.submanifold_conv(tf.constant(x), tf.constant(coords), (8, 9), 1,
                                   tf.constant(w))
    expected = sm.submanifold_conv(sm.SparseTensorData(x, coords, (8, 9), 1), w).features
    numpy.testing.assert_allclose(y.numpy(), expected, rtol=1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        tf_bridge.submanifold_conv(tf.constant(x), tf.constant(coords), (8, 9), 1,
                                   tf.constant(w[..., :1]))
