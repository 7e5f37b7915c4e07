"""sparse_conv2d and sparse_res_block_bottleneck (GEMM on blocks) against dense counterparts."""

import numpy
import pytest

import sbnet_cupy
from conftest import to_numpy
import reference


def _mask(rng, n, height, width):
    """Two clusters an image, one at the bottom-right border."""
    mask = numpy.zeros((n, height, width), numpy.float32)
    for i in range(n):
        r, c = rng.integers(0, height - 8), rng.integers(0, width - 8)
        mask[i, r:r + 5, c:c + 7] = 1
        mask[i, -3:, -4:] = 1
    return mask


@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_conv2d_same_matches_reference(xp, rng, kernel):
    x = rng.standard_normal((2, 9, 11, 5))
    w = rng.standard_normal((kernel, kernel, 5, 4))
    numpy.testing.assert_allclose(to_numpy(sbnet_cupy.conv2d_same(xp.asarray(x), xp.asarray(w))),
                                  reference.conv2d_same(x, w), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", [(2, 45, 38), (1, 30, 61)])
def test_sparse_conv2d_equals_dense_on_active_blocks(xp, rng, shape):
    x = rng.standard_normal(shape + (6,))
    w = rng.standard_normal((3, 3, 6, 4))
    bias = rng.standard_normal(4)
    params = sbnet_cupy.calc_block_params(shape[1:], (10, 10), (3, 3))
    found = sbnet_cupy.reduce_mask(xp.asarray(_mask(rng, *shape)), params.bcount,
                                   bsize=params.bsize, boffset=params.boffset,
                                   bstride=params.bstrides)
    base = rng.standard_normal(shape + (4,))
    y = to_numpy(sbnet_cupy.sparse_conv2d(xp.asarray(x), xp.asarray(w), found.bin_counts,
                                          found.active_block_indices, params,
                                          bias=xp.asarray(bias), base=xp.asarray(base)))
    covered = reference.covered(to_numpy(found.active_block_indices), len(found[0]), shape, 8)
    assert 0 < covered.mean() < 0.7
    dense = reference.conv2d_same(x, w) + bias
    numpy.testing.assert_allclose(y[covered], dense[covered], rtol=1e-10, atol=1e-10)
    numpy.testing.assert_array_equal(y[~covered], base[~covered])


@pytest.mark.parametrize("dtype", [numpy.float64, numpy.float32])
def test_sparse_res_block_equals_dense_on_active_blocks(xp, rng, dtype):
    shape, channels = (2, 40, 53), 12
    x = rng.standard_normal(shape + (channels,)).astype(dtype)
    weights = sbnet_cupy.random_bottleneck_weights(rng, channels, 4, dtype)
    folded = {k: tuple(xp.asarray(a) for a in v) if isinstance(v, tuple) else xp.asarray(v)
              for k, v in sbnet_cupy.fold_batchnorm(weights).items()}
    params = sbnet_cupy.calc_block_params_res_block(shape[1:], (10, 10),
                                                    [(1, 1), (3, 3), (1, 1)])
    found = sbnet_cupy.reduce_mask(xp.asarray(_mask(rng, *shape)), params.bcount,
                                   bsize=params.bsize, boffset=params.boffset,
                                   bstride=params.bstrides)
    x_d = xp.asarray(x)
    dense = to_numpy(sbnet_cupy.res_block_bottleneck(x_d, folded))
    covered = reference.covered(to_numpy(found.active_block_indices), len(found[0]), shape, 8)
    assert 0 < covered.mean() < 0.7 and covered[:, -1, -1].all()  # border blocks included
    tol = 1e-10 if dtype == numpy.float64 else 2e-5
    for inplace in (False, True):
        y = to_numpy(sbnet_cupy.sparse_res_block_bottleneck(
            x_d.copy(), found.bin_counts, found.active_block_indices, params, folded,
            inplace=inplace))
        numpy.testing.assert_allclose(y[covered], dense[covered], rtol=tol, atol=tol)
        numpy.testing.assert_array_equal(y[~covered], x[~covered])
