"""tf_bridge: forward equals sbnet_cupy, gradients, tf.function, the documented limits."""

import numpy
import pytest

from conftest import require  # noqa: E402

tf = require("tensorflow")

import sbnet_cupy  # noqa: E402
import tf_bridge  # noqa: E402
from axes import random_array  # noqa: E402
import reference  # noqa: E402

# (image H, W), bsize, boffset, bstride, bcount: one geometry without overlap, one with.
DISJOINT = ((9, 11), (4, 3), (-1, -1), (4, 3), (3, 4))
OVERLAPPING = ((9, 11), (4, 5), (-2, -1), (3, 4), (4, 3))


def _inputs(rng, geometry, channels=3):
    (height, width), bsize, boffset, bstride, bcount = geometry
    x = random_array(rng, (2, height, width, channels), numpy.float64)
    mask = rng.random((2, height, width)) > 0.7
    found = sbnet_cupy.reduce_mask(mask, bcount, bsize=bsize, boffset=boffset, bstride=bstride)
    return x, mask, found, dict(bsize=bsize, boffset=boffset, bstride=bstride)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("geometry, add, atomic", [(DISJOINT, False, False),
                                                   (DISJOINT, True, False),
                                                   (OVERLAPPING, True, True)])
def test_forward_equals_sbnet_cupy(rng, geometry, add, atomic, transpose):
    x, mask, found, kw = _inputs(rng, geometry)
    got = tf_bridge.reduce_mask(tf.constant(mask), geometry[4], **kw)
    numpy.testing.assert_array_equal(got.active_block_indices.numpy(), found.active_block_indices)
    numpy.testing.assert_array_equal(got.bin_counts.numpy(), found.bin_counts)
    stack = tf_bridge.sparse_gather(tf.constant(x), got.bin_counts, got.active_block_indices,
                                    transpose=transpose, **kw)
    want = sbnet_cupy.sparse_gather(x, *found[::-1], transpose=transpose, **kw)
    numpy.testing.assert_array_equal(stack.numpy(), want)
    blocks = random_array(rng, want.shape, numpy.float64)
    scatter_kw = dict(add=add, atomic=atomic, transpose=transpose, **kw)
    y = tf_bridge.sparse_scatter(tf.constant(blocks), got.bin_counts, got.active_block_indices,
                                 tf.constant(x), **scatter_kw)
    want = sbnet_cupy.sparse_scatter(blocks, *found[::-1], x, **scatter_kw)
    numpy.testing.assert_array_equal(y.numpy(), want)
    var = tf.Variable(x)
    assert tf_bridge.sparse_scatter_var(tf.constant(blocks), got.bin_counts,
                                        got.active_block_indices, var, **scatter_kw) is var
    numpy.testing.assert_array_equal(var.numpy(), want)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("geometry, op, add, atomic", [
    (DISJOINT, "gather", None, None), (OVERLAPPING, "gather", None, None),
    (DISJOINT, "scatter", False, False), (DISJOINT, "scatter", True, False),
    (OVERLAPPING, "scatter", True, True)])
def test_gradients(rng, geometry, op, add, atomic, transpose):
    """TensorFlow's numerical Jacobians against the registered gradients (each Jacobian costs two
    calls an input element: CI's slowest bridge test). The transposed layouts are checked on
    the overlapping geometry, gather and scatter-add, which reach the same gradient code."""
    if transpose and geometry is DISJOINT:
        pytest.skip("transposed: on the overlapping geometry (CI's time)")
    x, _, found, kw = _inputs(rng, geometry)
    counts, indices = tf.constant(found.bin_counts), tf.constant(found.active_block_indices)
    if op == "gather":
        fn = lambda x: tf_bridge.sparse_gather(x, counts, indices, transpose=transpose,  # noqa
                                               **kw)
        inputs = [tf.constant(x)]
    else:
        shape = sbnet_cupy.sparse_gather(x, *found[::-1], transpose=transpose, **kw).shape
        fn = lambda b, y: tf_bridge.sparse_scatter(b, counts, indices, y, add=add,  # noqa
                                                   atomic=atomic, transpose=transpose, **kw)
        inputs = [tf.constant(random_array(rng, shape, numpy.float64)), tf.constant(x)]
    theoretical, numerical = tf.test.compute_gradient(fn, inputs)
    for t, n in zip(theoretical, numerical):
        assert numpy.abs(t).sum() > 0
        numpy.testing.assert_allclose(t, n, atol=1e-6)


def test_tf_function_round_trip(rng):
    x, mask, found, kw = _inputs(rng, DISJOINT, channels=4)

    @tf.function
    def step(mask, x):
        got = tf_bridge.reduce_mask(mask, DISJOINT[4], **kw)
        with tf.GradientTape() as tape:
            tape.watch(x)
            stack = tf_bridge.sparse_gather(x, got.bin_counts, got.active_block_indices, **kw)
            y = tf_bridge.sparse_scatter(stack * 3, got.bin_counts, got.active_block_indices, x,
                                         **kw)
            loss = tf.reduce_sum(y)
        return y, tape.gradient(loss, x)

    y, dx = step(tf.constant(mask), tf.constant(x))
    stack = sbnet_cupy.sparse_gather(x, *found[::-1], **kw)
    want = sbnet_cupy.sparse_scatter(stack * 3, *found[::-1], x, **kw)
    numpy.testing.assert_array_equal(y.numpy(), want)
    covered = want != x
    assert covered.any()
    numpy.testing.assert_array_equal(dx.numpy()[covered], 3)
    numpy.testing.assert_array_equal(dx.numpy()[~covered], 1)


def test_capacity_shape_is_static():
    got = tf_bridge.reduce_mask(tf.ones([1, 8, 8]), (2, 2), bsize=4, capacity=6)
    assert got.active_block_indices.shape == (6, 3)
    assert int(got.bin_counts[0]) == 4 and not bool(got.overflowed)


def test_xla_is_refused_with_a_clear_error():
    @tf.function(jit_compile=True)
    def compiled(x):
        return tf_bridge.sparse_gather(x, tf.constant([1]), tf.constant([[0, 0, 0]]), bsize=2)

    with pytest.raises(Exception, match="EagerPyFunc|PyFunc"):
        compiled(tf.ones([1, 4, 4, 2]))


def test_bad_arguments():
    x = tf.ones([1, 8, 8, 4])
    with pytest.raises(ValueError, match="bsize must be two positive ints"):
        tf_bridge.sparse_gather(x, [1], [[0, 0, 0]], bsize=(0, 4))
    with pytest.raises(ValueError, match="x must be 4-D"):
        tf_bridge.sparse_gather(x[0], [1], [[0, 0, 0]], bsize=4)
    with pytest.raises(TypeError, match="blocks dtype float64 differs"):
        tf_bridge.sparse_scatter(tf.ones([1, 4, 4, 4], tf.float64), [1], [[0, 0, 0]], x, bsize=4)
    with pytest.raises(ValueError, match=r"blocks must have shape \[1, 4, 4, 4\]"):
        tf_bridge.sparse_scatter(tf.ones([1, 4, 4, 3]), [1], [[0, 0, 0]], x, bsize=4)
    with pytest.raises(ValueError, match="needs atomic=True"):
        tf_bridge.sparse_scatter(tf.ones([1, 4, 4, 4]), [1], [[0, 0, 0]], x, bsize=4, bstride=2,
                                 add=True)
    with pytest.raises(TypeError, match="ybase must be a tf.Variable"):
        tf_bridge.sparse_scatter_var(tf.ones([1, 4, 4, 4]), [1], [[0, 0, 0]], x, bsize=4)


def test_sparse_res_block_equals_dense_on_active_blocks(rng):
    shape, channels = (2, 37, 45), 8
    x = rng.standard_normal(shape + (channels,))
    weights = sbnet_cupy.random_bottleneck_weights(rng, channels, 4, numpy.float64)
    weights = {k: tuple(tf.constant(a) for a in v) if isinstance(v, tuple) else tf.constant(v)
               for k, v in weights.items()}
    params = sbnet_cupy.calc_block_params_res_block(shape[1:], (10, 10),
                                                    [(1, 1), (3, 3), (1, 1)])
    mask = numpy.zeros(shape, numpy.float32)
    mask[0, 5:9, 7:20] = mask[1, -2:, -3:] = 1
    found = tf_bridge.reduce_mask(mask, params.bcount, bsize=params.bsize,
                                  boffset=params.boffset, bstride=params.bstrides)
    covered = reference.covered(found.active_block_indices.numpy(), int(found.bin_counts[0]),
                                shape, 8)
    dense = tf_bridge.res_block_bottleneck(tf.constant(x), weights).numpy()
    with tf.GradientTape() as tape:
        x_t = tf.constant(x)
        tape.watch([x_t, weights["conv2"]])
        y = tf_bridge.sparse_res_block_bottleneck(x_t, found, params, weights)
        loss = tf.reduce_sum(y * y)
    numpy.testing.assert_allclose(y.numpy()[covered], dense[covered], rtol=1e-10, atol=1e-10)
    numpy.testing.assert_array_equal(y.numpy()[~covered], x[~covered])
    grads = tape.gradient(loss, [x_t, weights["conv2"]])
    assert all(g is not None and float(tf.reduce_sum(tf.abs(g))) > 0 for g in grads)
    var = tf.Variable(x)
    tf_bridge.sparse_res_block_bottleneck(var, found, params, weights, use_var=True)
    numpy.testing.assert_allclose(var.numpy(), y.numpy(), rtol=1e-12)
