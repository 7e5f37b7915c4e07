"""Submanifold, strided and inverse sparse convolution (sbnet_cupy.submanifold) against a plain
loop over the definition, a dense convolution (torch CPU) of the zero-filled input, and the
adjoint identities of its gradients; rulebook hash table on the GPU under collisions."""

import itertools

import numpy
import pytest
from conftest import require, requires_gpu, to_numpy
from axes import random_array

import cuda_emulation
from sbnet_cupy import submanifold as sm
from sbnet_cupy.core import launch as _launch, plan as _plan
from sbnet_cupy.submanifold import conv_kernels, cuda_rulebook, grad_kernels, validation

TOLERANCE = {numpy.float16: 2e-2, numpy.float32: 1e-5, numpy.float64: 1e-12}


def random_sites(rng, batch, shape, n, *, border=True):
    """n distinct random coords [n, 1 + D] in batch x shape, in random order, the grid's
    first and last corners among them when border is set."""
    total = batch * int(numpy.prod(shape))
    inner = rng.permutation(numpy.arange(1, total - 1))
    ends = [0, total - 1] if border else list(rng.choice([0, total - 1], 2, replace=False))
    ids = rng.permutation(numpy.concatenate([ends, inner])[:min(n, total)])
    coords = numpy.stack(numpy.unravel_index(ids, (batch, *shape)), axis=1)
    return coords.astype(numpy.int32).reshape(-1, 1 + len(shape))


def loop_rulebook(coords, shape, kernel, stride, padding, dilation, subm):
    """(output coords, list of (tap, input row, output row)) from the definition, by loops."""
    rows = {tuple(c): r for r, c in enumerate(coords.tolist())}
    taps = list(itertools.product(*(range(k) for k in kernel)))
    if subm:
        padding = tuple(k // 2 * d for k, d in zip(kernel, dilation))
        stride = (1,) * len(shape)
        out_shape = shape
        outputs = [tuple(c) for c in coords.tolist()]
    else:
        out_shape = tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                          for s, k, st, p, d in zip(shape, kernel, stride, padding, dilation))
        found = set()
        for site in rows:
            for tap in taps:
                o = []
                for axis in range(len(shape)):
                    num = site[1 + axis] + padding[axis] - tap[axis] * dilation[axis]
                    if num % stride[axis] or not 0 <= num // stride[axis] < out_shape[axis]:
                        break
                    o.append(num // stride[axis])
                else:
                    found.add((site[0], *o))
        outputs = sorted(found)
    pairs = []
    for o_row, o in enumerate(outputs):
        for k, tap in enumerate(taps):
            i = (o[0], *(o[1 + a] * stride[a] - padding[a] + tap[a] * dilation[a]
                         for a in range(len(shape))))
            if i in rows:
                pairs.append((k, rows[i], o_row))
    return numpy.array(outputs, numpy.int32).reshape(-1, 1 + len(shape)), pairs, out_shape


def loop_conv(x, w, bias, pairs, n_out):
    """y[o] = bias + sum over pairs (k, i, o) of w[:, k, :] @ x[i], in float64."""
    cout, cin = w.shape[0], w.shape[-1]
    taps = w.reshape(cout, -1, cin).astype(numpy.float64)
    y = numpy.zeros((n_out, cout)) + (0 if bias is None else bias.astype(numpy.float64))
    for k, i, o in pairs:
        y[o] += taps[:, k] @ x[i].astype(numpy.float64)
    return y


def close(actual, expected, dtype):
    actual = to_numpy(actual).astype(numpy.float64)
    scale = max(numpy.abs(expected).max(initial=0), 1)
    numpy.testing.assert_allclose(actual, expected, atol=TOLERANCE[dtype] * scale,
                                  rtol=TOLERANCE[dtype])


# (batch, spatial shape, sites, kernel, stride, padding, dilation)
CASES = {
    "2d-3x3": (2, (9, 11), 40, (3, 3), (1, 1), (1, 1), (1, 1)),
    "2d-5x5-stride2": (1, (12, 13), 30, (5, 5), (2, 2), (2, 2), (1, 1)),
    "2d-1x1": (3, (6, 5), 20, (1, 1), (1, 1), (0, 0), (1, 1)),
    "2d-even-2x3-dilated": (2, (10, 9), 35, (2, 3), (2, 1), (0, 1), (2, 1)),
    "3d-3x3x3-stride2": (2, (5, 6, 7), 50, (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)),
    "3d-1x3x3": (1, (4, 7, 6), 30, (1, 3, 3), (1, 2, 2), (0, 1, 1), (1, 1, 1)),
    "3d-z-3x1x1-stride2": (1, (7, 4, 4), 25, (3, 1, 1), (2, 1, 1), (0, 0, 0), (1, 1, 1)),
    "1d-5": (2, (17,), 12, (5,), (3,), (1,), (1,)),
    "4d-3": (1, (3, 4, 3, 4), 20, (3, 3, 3, 3), (2, 2, 2, 2), (1, 1, 1, 1), (1, 1, 1, 1)),
    "one-site": (1, (5, 5), 1, (3, 3), (2, 2), (1, 1), (1, 1)),
    "empty": (2, (4, 6), 0, (3, 3), (2, 2), (1, 1), (1, 1)),
    "full-grid": (1, (4, 5), 20, (3, 3), (1, 1), (1, 1), (1, 1)),
}


def build(xp, rng, case, subm, dtype, cin=3, cout=5, bias=True):
    batch, shape, n, kernel, stride, padding, dilation = CASES[case]
    coords = random_sites(rng, batch, shape, n)
    x = random_array(rng, (coords.shape[0], cin), dtype)
    w = random_array(rng, (cout, *kernel, cin), dtype)
    b = random_array(rng, (cout,), dtype) if bias else None
    arrays = [None if a is None else xp.asarray(a) for a in (coords, x, w, b)]
    if subm:
        rulebook = sm.submanifold_rulebook(arrays[0], shape, batch, kernel, dilation)
    else:
        rulebook = sm.strided_rulebook(arrays[0], shape, batch, kernel, stride, padding,
                                       dilation)
    expected = loop_rulebook(coords, shape, kernel, stride, padding, dilation, subm)
    return (coords, x, w, b), arrays, rulebook, expected


@pytest.mark.parametrize("subm", [True, False], ids=["subm", "strided"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_conv_matches_loops(xp, rng, case, subm):
    (coords, x, w, b), (_, x_d, w_d, b_d), rulebook, (out_coords, pairs, out_shape) = build(
        xp, rng, case, subm, numpy.float64)
    assert rulebook.out_shape == out_shape
    numpy.testing.assert_array_equal(to_numpy(rulebook.out_coords), out_coords)
    # The rulebook's pairs, both ways, are exactly the definition's.
    neighbors, neighbors_t = to_numpy(rulebook.neighbors), to_numpy(rulebook.neighbors_t)
    k, o = numpy.nonzero(neighbors >= 0)
    assert sorted(zip(k.tolist(), neighbors[k, o].tolist(), o.tolist())) == sorted(pairs)
    k, i = numpy.nonzero(neighbors_t >= 0)
    assert sorted(zip(k.tolist(), i.tolist(), neighbors_t[k, i].tolist())) == sorted(pairs)
    y = sm.rulebook_conv(x_d, rulebook, w_d, b_d)
    assert y.shape == (out_coords.shape[0], w.shape[0]) and y.dtype == x.dtype
    close(y, loop_conv(x, w, b, pairs, out_coords.shape[0]), numpy.float64)
    # The inverse convolution runs the same pairs backwards.
    w_inv = xp.asarray(random_array(rng, (2, *w.shape[1:-1], w.shape[0]), numpy.float64))
    x_inv = xp.asarray(random_array(rng, (out_coords.shape[0], w.shape[0]), numpy.float64))
    y_inv = sm.rulebook_conv(x_inv, rulebook.inverse(), w_inv)
    swapped = [(k, o, i) for k, i, o in pairs]
    close(y_inv, loop_conv(to_numpy(x_inv), to_numpy(w_inv), None, swapped, coords.shape[0]),
          numpy.float64)


@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize("case", ["2d-3x3", "3d-3x3x3-stride2"])
def test_dtypes(xp, rng, case, dtype):
    (coords, x, w, b), (_, x_d, w_d, b_d), rulebook, (out_coords, pairs, _) = build(
        xp, rng, case, False, dtype, cin=8, cout=16)
    y = sm.rulebook_conv(x_d, rulebook, w_d, b_d)
    assert y.dtype == dtype
    close(y, loop_conv(x, w, b, pairs, out_coords.shape[0]), dtype)


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32])
@pytest.mark.parametrize("cin, cout", [(4, 8), (6, 10), (16, 64), (24, 72), (32, 24), (40, 130),
                                       (64, 16)])
@pytest.mark.parametrize("subm", [True, False], ids=["subm", "strided"])
def test_fused_matches_loops(rng, subm, cin, cout, dtype):
    """The fused tensor-core kernel: vector loads (cin x itemsize a multiple of 16 bytes:
    several taps a stage, one, or a tap over stages with a last one part filled) and scalar
    loads (not), tiles 16, 32 and 64 channels wide, partial tiles of sites and channels, taps no
    site of a tile has."""
    import cupy

    from conftest import _poison_pool

    _poison_pool()
    case = "3d-3x3x3-stride2" if subm else "2d-5x5-stride2"
    (coords, x, w, b), (_, x_d, w_d, b_d), rulebook, (out_coords, pairs, _) = build(
        cupy, rng, case, subm, dtype, cin=cin, cout=cout)
    big = sm.submanifold_rulebook(cupy.asarray(random_sites(rng, 2, (40, 50, 60), 3000)),
                                  (40, 50, 60), 2, 3)  # scattered: many taps empty per tile
    y = sm.rulebook_conv(x_d, rulebook, w_d, b_d, algo="fused")
    close(y, loop_conv(x, w, b, pairs, out_coords.shape[0]), dtype)
    xb = cupy.asarray(random_array(rng, (3000, cin), dtype))
    wb = cupy.asarray(random_array(rng, (cout, 3, 3, 3, cin), dtype))
    want = sm.rulebook_conv(xb.astype(cupy.float64), big, wb.astype(cupy.float64))
    close(sm.rulebook_conv(xb, big, wb, algo="fused"), want.get(), dtype)
    close(sm.rulebook_conv(xb, big, wb, algo="gemm"), want.get(), dtype)


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32])
@pytest.mark.parametrize("cin, cout", [(4, 8), (8, 16), (16, 64), (24, 72), (32, 24), (40, 136),
                                       (64, 16), (128, 128), (96, 96), (256, 64), (6, 8), (17, 24)])
@pytest.mark.parametrize("subm", [True, False], ids=["subm", "strided"])
def test_grad_weight_matches_loops(rng, subm, cin, cout, dtype):
    """The weight's gradient through grad_weight's kernel on every layer it can take (rows of
    16-byte vectors, rows under 16 bytes padded, 64-column tiles 16, 32 and 64 channels wide and
    part tiles, columns across taps and within one; wider layers by each tap's sites in 128 x
    128 tiles, part filled; the sites of a scattered rulebook split over CTAs; out in float32
    and in the features' dtype), and through rulebook_conv_grad_weight's routes (algo="fused":
    the kernel where grad_weight_takes, the gathered rows and cuBLAS for narrow inputs to wide
    outputs and the layers it cannot take, 6 and 17 channels; algo="gemm"), against the loop
    over the pairs and a float64 product."""
    import cupy

    from conftest import _poison_pool
    from sbnet_cupy.core.backend import CUPY

    _poison_pool()
    name = numpy.dtype(dtype).name
    fits = sm.grad_weight_fits(name, cin, cout, True)
    case = "3d-3x3x3-stride2" if subm else "2d-5x5-stride2"
    (coords, x, w, _), (_, x_d, w_d, _), rulebook, (out_coords, pairs, _) = build(
        cupy, rng, case, subm, dtype, cin=cin, cout=cout, bias=False)
    dy = random_array(rng, (out_coords.shape[0], cout), dtype)
    want = numpy.zeros((cout, int(numpy.prod(w.shape[1:-1])), cin))
    for k, i, o in pairs:
        want[:, k] += numpy.outer(dy[o].astype(numpy.float64), x[i].astype(numpy.float64))
    want = want.reshape(w.shape)
    got = sm.rulebook_conv_grad_weight(x_d, cupy.asarray(dy), rulebook, algo="fused")
    assert got.dtype == dtype and got.shape == w.shape
    close(got, want, dtype)
    if fits:
        for out_dtype in ("float32", name):
            got = sm.grad_weight(CUPY, x_d, cupy.asarray(dy), rulebook.neighbors, out_dtype)
            assert got.dtype == out_dtype
            close(got.reshape(w.shape), want, dtype)
    big = sm.submanifold_rulebook(cupy.asarray(random_sites(rng, 2, (60, 70, 80), 40000)),
                                  (60, 70, 80), 2, 3)
    xb = cupy.asarray(random_array(rng, (40000, cin), dtype))
    dyb = cupy.asarray(random_array(rng, (40000, cout), dtype))
    want = sm.rulebook_conv_grad_weight(xb.astype(cupy.float64), dyb.astype(cupy.float64), big)
    for algo in ("fused", "gemm"):
        close(sm.rulebook_conv_grad_weight(xb, dyb, big, algo=algo), want.get(), dtype)
    if fits:
        got = sm.grad_weight(CUPY, xb, dyb, big.neighbors, "float32")
        close(got.reshape(want.shape), want.get(), dtype)


@requires_gpu
@pytest.mark.parametrize("n_out", [1, 1024, 100_003])
def test_tap_pairs_equal_numpy(rng, n_out):
    """The sites that have each tap, in order (grad_weight's lists for rows of 64 channels and
    more), over one block of sites and many: taps that every site has, none has, and some."""
    import cupy

    from conftest import _poison_pool
    from sbnet_cupy.core.backend import CUPY

    _poison_pool()
    neighbors = rng.integers(0, 50, (5, n_out)).astype(numpy.int32)
    neighbors[rng.random((5, n_out)) < 0.6] = -1
    neighbors[1], neighbors[2] = -1, 7
    pairs, totals, _ = grad_kernels.tap_pairs(CUPY, cupy.asarray(neighbors))
    pairs, totals = pairs.get(), totals.get()
    for k in range(5):
        want = numpy.flatnonzero(neighbors[k] >= 0)
        assert totals[k] == want.size
        numpy.testing.assert_array_equal(pairs[k, :want.size], want)


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32])
@pytest.mark.parametrize("cin", [12, 16])
@pytest.mark.parametrize("shape, kernel, n", [((30, 40), 7, 500), ((12, 14, 16), 5, 900)],
                         ids=["2d-7x7", "3d-5x5x5"])
def test_fused_over_tap_groups(rng, shape, kernel, n, cin, dtype):
    """Kernels of more taps than the fused kernel holds neighbour rows of at once (49 taps, and
    125: three whole groups and a partial one), vector and scalar loads."""
    import cupy

    from conftest import _poison_pool

    _poison_pool()
    rulebook = sm.submanifold_rulebook(cupy.asarray(random_sites(rng, 2, shape, n)), shape, 2,
                                       kernel)
    x = cupy.asarray(random_array(rng, (n, cin), dtype))
    w = cupy.asarray(random_array(rng, (24, *(kernel,) * len(shape), cin), dtype))
    want = sm.rulebook_conv(x.astype(cupy.float64), rulebook, w.astype(cupy.float64))
    close(sm.rulebook_conv(x, rulebook, w, algo="fused"), want.get(), dtype)


@pytest.fixture
def fused_splits(monkeypatch):
    """Sets how many splits of the taps the fused kernel runs (plans made meanwhile are
    dropped afterwards, so no other test sees them)."""
    def force(splits):
        monkeypatch.setattr(conv_kernels, "fused_splits",
                            lambda device, tiles, taps: min(splits, taps))
        conv_kernels._fused_plan.cache_clear()

    yield force
    conv_kernels._fused_plan.cache_clear()


@requires_gpu
@pytest.mark.parametrize("stream", ["default", "side"])
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32])
@pytest.mark.parametrize("splits", [1, 2, 5, 125])
@pytest.mark.parametrize("shape, kernel, n, cin, cout", [
    ((12, 14, 16), 3, 900, 16, 72), ((12, 14, 16), 5, 700, 12, 24), ((300, 400), 3, 9000, 8, 130)],
    ids=["3d-3x3x3", "3d-5x5x5", "2d-3x3-many-sites"])
def test_fused_split_taps(rng, fused_splits, shape, kernel, n, cin, cout, splits, dtype, stream):
    """Taps split over CTAs (partial sums, then their sum with the bias) equal one CTA over all
    taps: splits of one tap and of several, splits crossing tap groups (125 taps in 5), more
    splits asked than taps, partial tiles of sites and channels. On a side stream the launches
    are programmatic dependents (sm_90+): a second layer reads the first's output."""
    import contextlib

    import cupy

    from conftest import _poison_pool

    _poison_pool()
    fused_splits(splits)
    rulebook = sm.submanifold_rulebook(cupy.asarray(random_sites(rng, 2, shape, n)), shape, 2,
                                       kernel)
    x = cupy.asarray(random_array(rng, (n, cin), dtype))
    w = cupy.asarray(random_array(rng, (cout, *(kernel,) * len(shape), cin), dtype))
    w2 = cupy.asarray(random_array(rng, (cin, *(kernel,) * len(shape), cout), dtype))
    b = cupy.asarray(random_array(rng, (cout,), dtype))
    side = cupy.cuda.Stream(non_blocking=True)
    side.wait_event(cupy.cuda.get_current_stream().record())  # the rulebook's kernels are done
    with side if stream == "side" else contextlib.nullcontext():
        y = sm.rulebook_conv(x, rulebook, w, b, algo="fused")
        y2 = sm.rulebook_conv(y, rulebook, w2, algo="fused")
        y_no_bias = sm.rulebook_conv(x, rulebook, w, algo="fused")
    side.synchronize()
    f64 = cupy.float64
    want = sm.rulebook_conv(x.astype(f64), rulebook, w.astype(f64), b.astype(f64))
    close(y, want.get(), dtype)
    close(y_no_bias, (want - b).get(), dtype)
    # The kernels are deterministic: the second layer equals itself run on the settled y.
    settled = sm.rulebook_conv(y, rulebook, w2, algo="fused")
    numpy.testing.assert_array_equal(y2.get(), settled.get())


@pytest.mark.parametrize("cin, itemsize, width", [
    (5, 2, 8), (3, 2, 8), (12, 2, 16), (8, 2, 8), (17, 2, 17), (1, 2, 8),
    (5, 4, 8), (3, 4, 4), (4, 4, 4), (9, 4, 9), (2, 8, 2)])
def test_fused_pads_narrow_rows(cin, itemsize, width):
    """Rows under 32 bytes that are not whole 16-byte vectors go to the fused kernel padded to
    the next 16 bytes; wider ones (staged through registers) and whole ones as they are."""
    assert conv_kernels.padded_width(cin, itemsize) == width


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32])
@pytest.mark.parametrize("cin", [8, 24, 40, 5, 17])
@pytest.mark.parametrize("stage, tile, slots", sorted({config[1:] for config in
                                                       conv_kernels.FUSED_CONFIGS}))
def test_fused_every_configuration(rng, monkeypatch, stage, tile, slots, cin, dtype):
    """Every stage, tile width and slot count the kernels are built for (bench.submanifold_tiles
    times them all), whatever the rule would pick: rows of one, several and a part of a stage,
    odd rows through registers (stages of 32 and 64 bytes), narrow rows padded (5 channels)."""
    import cupy

    from conftest import _poison_pool

    itemsize = numpy.dtype(dtype).itemsize
    vector = conv_kernels.padded_width(cin, itemsize) * itemsize % 16 == 0
    if not vector and stage == 128:
        pytest.skip("odd rows are staged 32 or 64 bytes at a time")
    monkeypatch.setattr(conv_kernels, "fused_config",
                        lambda vector, itemsize, cout: (stage, tile, slots))
    conv_kernels._fused_plan.cache_clear()
    _poison_pool()
    shape = (12, 14, 16)
    rulebook = sm.submanifold_rulebook(cupy.asarray(random_sites(rng, 2, shape, 700)), shape, 2,
                                       3)
    x = cupy.asarray(random_array(rng, (700, cin), dtype))
    w = cupy.asarray(random_array(rng, (40, 3, 3, 3, cin), dtype))
    b = cupy.asarray(random_array(rng, (40,), dtype))
    try:
        y = sm.rulebook_conv(x, rulebook, w, b, algo="fused")
    finally:
        conv_kernels._fused_plan.cache_clear()
    f64 = cupy.float64
    close(y, sm.rulebook_conv(x.astype(f64), rulebook, w.astype(f64), b.astype(f64)).get(), dtype)


@requires_gpu
@pytest.mark.parametrize("dtype", [numpy.float16, numpy.float32])
@pytest.mark.parametrize("cin, cout", [(8, 16), (24, 40), (64, 64), (16, 130)])
@pytest.mark.parametrize("rule", [False, True], ids=["forced", "rule"])
def test_fused_tall_tiles(rng, monkeypatch, dtype, cin, cout, rule):
    """128-site tiles (fused_tall) against float64 on the GPU: forced on a small layer (partial
    tiles of sites and channels, TF32's 16-wide tiles and 128-wide tiles falling back to 64
    sites), and by the rule at 40k sites, where they fill an H100 or H200."""
    if not rule:
        monkeypatch.setattr(conv_kernels, "fused_tall",
                            lambda device, plan, n_out, sorted_rows: plan.tall is not None)
    conv_kernels._fused_plan.cache_clear()
    shape, n = ((12, 14, 16), 700) if not rule else ((40, 64, 64), 40_000)
    _fused_matches_float64(rng, shape, n, cin, cout, dtype)
    try:
        plan = conv_kernels._fused_plan(0, numpy.dtype(dtype).name, True, cin, cout, 27)
    finally:
        conv_kernels._fused_plan.cache_clear()
    itemsize = numpy.dtype(dtype).itemsize
    assert (plan.tall is not None) == conv_kernels.tall_tiles(
        itemsize, conv_kernels.fused_config(True, itemsize, cout)[1])


def _fused_matches_float64(rng, shape, n, cin, cout, dtype):
    """A 3x3x3 fused convolution of random features, weight and bias of `dtype` on n random
    sites of two frames of `shape`, memory poisoned first, against float64 (the plans made for
    it are dropped after)."""
    import cupy

    from conftest import _poison_pool

    _poison_pool()
    rulebook = sm.submanifold_rulebook(cupy.asarray(random_sites(rng, 2, shape, n)), shape, 2, 3)
    x = cupy.asarray(random_array(rng, (n, cin), numpy.float32).astype(dtype))
    w = cupy.asarray(random_array(rng, (cout, 3, 3, 3, cin), numpy.float32).astype(dtype))
    b = cupy.asarray(random_array(rng, (cout,), numpy.float32).astype(dtype))
    try:
        y = sm.rulebook_conv(x, rulebook, w, b, algo="fused")
    finally:
        conv_kernels._fused_plan.cache_clear()
    f64 = cupy.float64
    close(y, sm.rulebook_conv(x.astype(f64), rulebook, w.astype(f64), b.astype(f64)).get(), dtype)


def masks_of(neighbors):
    """The tap masks of a map's rows (int64, every tap)."""
    bits = numpy.arange(neighbors.shape[0])[:, None]
    return ((neighbors >= 0).astype(numpy.int64) << bits).sum(0)


def assert_runs(values):
    """Equal values of `values` stand together: each one in a single run."""
    starts = values[numpy.flatnonzero(numpy.diff(values)) + 1]
    assert len(numpy.unique(starts)) == len(starts) and values[0] not in starts


def sort_by_masks(neighbors):
    """Rulebook._sorted_rows in NumPy: a stable argsort of the rows' masks, the map's columns."""
    order = numpy.argsort(masks_of(neighbors), kind="stable").astype(numpy.int32)
    return numpy.concatenate([order[None], neighbors[:, order]])


@pytest.mark.parametrize("kernel, first", [(3, False), (3, True), ((3, 1, 5), False),
                                           ((2, 3, 3), False)])
def test_fused_order_of_a_mirrored_map_reverses_the_other(rng, monkeypatch, kernel, first):
    """A submanifold rulebook of an odd kernel sorts once: the other direction's order is the
    sorted one with its map rows reversed (neighbors_t is neighbors with the taps reversed), a
    permutation with the map's columns in its order and each mask in one run, whichever
    direction comes first. An even kernel (no mirror) and a strided rulebook sort each map."""
    sorts = []
    monkeypatch.setattr(sm.Rulebook, "_sorted_rows",
                        staticmethod(lambda neighbors: sorts.append(1) or sort_by_masks(neighbors)))
    shape = (9, 10, 11)
    coords = random_sites(rng, 2, shape, 900)
    odd = all(k % 2 for k in numpy.broadcast_to(kernel, 3))
    for rulebook, mirrored in ((sm.submanifold_rulebook(coords, shape, 2, kernel), odd),
                               (sm.strided_rulebook(coords, shape, 2, 3, 2, 1), False)):
        sorts.clear()
        rows = {t: rulebook.fused_order(t) for t in (first, not first)}
        assert len(sorts) == (1 if mirrored else 2)
        for transposed, got in rows.items():
            neighbors = rulebook.neighbors_t if transposed else rulebook.neighbors
            assert got.dtype == numpy.int32 and got is rulebook.fused_order(transposed)
            order = got[0]
            numpy.testing.assert_array_equal(numpy.sort(order), numpy.arange(neighbors.shape[1]))
            numpy.testing.assert_array_equal(got[1:], neighbors[:, order])
            assert_runs(masks_of(neighbors)[order])
        if mirrored:
            numpy.testing.assert_array_equal(rows[True][0], rows[False][0])


@requires_gpu
def test_fused_order_sorts_rows_by_their_taps(rng, monkeypatch):
    """Rulebook.fused_order: a permutation of the output rows, their tap masks in ascending
    order (a submanifold rulebook's transposed map: its forward order, each mask in one run),
    and the map's columns in that order (int32), computed once for the map it was computed for
    and again for a new one; inverse() swaps the two orders. The convolution in that order
    equals the one without (SORT_ROWS off)."""
    import cupy

    monkeypatch.setattr(conv_kernels, "_SORT_EVERY", True)

    shape = (20, 22, 24)
    coords = cupy.asarray(random_sites(rng, 2, shape, 2000))
    for rulebook in (sm.submanifold_rulebook(coords, shape, 2, 3),
                     sm.strided_rulebook(coords, shape, 2, 3, 2, 1)):
        for transposed in (False, True):
            rows = rulebook.fused_order(transposed)
            neighbors = (rulebook.neighbors_t if transposed else rulebook.neighbors).get()
            assert rows.dtype == cupy.int32 and rows is rulebook.fused_order(transposed)
            assert rows.shape == (28, neighbors.shape[1])
            order = rows[0].get()
            numpy.testing.assert_array_equal(numpy.sort(order), numpy.arange(neighbors.shape[1]))
            numpy.testing.assert_array_equal(rows[1:].get(), neighbors[:, order])
            masks = masks_of(neighbors)[order]
            if transposed and rulebook.subm:
                numpy.testing.assert_array_equal(order, rulebook.fused_order()[0].get())
                assert_runs(masks)
            else:
                assert numpy.all(numpy.diff(masks) >= 0)
        assert rulebook.inverse().fused_order() is rulebook.fused_order(True)
        first = rulebook.fused_order()
        rulebook.neighbors = rulebook.neighbors.copy()
        assert rulebook.fused_order() is not first
        x = cupy.asarray(random_array(rng, (2000, 16), numpy.float16))
        w = cupy.asarray(random_array(rng, (24, 3, 3, 3, 16), numpy.float16))
        ordered = sm.rulebook_conv(x, rulebook, w, algo="fused")
        monkeypatch.setattr(conv_kernels, "SORT_ROWS", False)
        assert not sm.fused_sorts(2000, 16, 24, 2)
        close(ordered, sm.rulebook_conv(x, rulebook, w, algo="fused").get(), numpy.float16)
        monkeypatch.setattr(conv_kernels, "SORT_ROWS", True)


def test_fused_sorts_layers_wider_than_one_tall_tile(monkeypatch):
    """Rows are sorted where the layer's work reaches _SORT_WORK and its output channels do not
    fit one channel tile that may be tall (wider than 64; 16 wide in TF32 has no tall tiles):
    layers of 64 channels or fewer take their rows unsorted."""
    work = conv_kernels._SORT_WORK
    big = -(-work // (96 * 96))
    assert sm.fused_sorts(big, 96, 96, 2) and sm.fused_sorts(big, 96, 96, 4)
    assert not sm.fused_sorts(big - 1, 96, 96, 2)
    for cin, cout, itemsize in ((64, 128, 2), (128, 128, 2), (128, 128, 4), (96, 256, 2),
                                (256, 256, 4), (64, 16, 4)):  # no tall 16-wide TF32 tiles
        n = -(-work // (cin * cout))
        assert sm.fused_sorts(n, cin, cout, itemsize)
        assert not sm.fused_sorts(n - 1, cin, cout, itemsize)
    for cin, cout, itemsize in ((64, 64, 2), (128, 64, 2), (96, 64, 4), (64, 16, 2),
                                (64, 32, 4)):
        assert not sm.fused_sorts(-(-work // (cin * cout)), cin, cout, itemsize)
    monkeypatch.setattr(conv_kernels, "_SORT_EVERY", True)  # what tests of sorted rows take
    assert sm.fused_sorts(1, 64, 64, 2) and sm.fused_sorts(1, 16, 16, 4)
    monkeypatch.setattr(conv_kernels, "SORT_ROWS", False)
    assert not sm.fused_sorts(big, 96, 96, 2) and not sm.fused_sorts(1, 64, 64, 2)


def test_fused_splits_fill_the_gpu(monkeypatch):
    """Few tiles split their taps up to _FUSED_CTAS_PER_SM CTAs an SM (at most one split a tap;
    plan.reduction_splits' rule rounded down, from the device's SM count); enough tiles run
    unsplit."""
    monkeypatch.setattr(_launch, "device_info", lambda device: _launch.H100)  # 132 SMs
    per_sm = conv_kernels._FUSED_CTAS_PER_SM
    assert sm.fused_splits(0, 22, 9) == 9
    assert sm.fused_splits(0, 22, 125) == per_sm * 132 // 22
    assert sm.fused_splits(0, 100, 27) == 2  # rounded down: 264 / 100
    assert sm.fused_splits(0, 133, 27) == 1
    assert sm.fused_splits(0, 132 * per_sm, 27) == 1
    assert sm.fused_splits(0, 10_000, 27) == 1
    assert sm.fused_splits(0, 1, 1) == 1


@pytest.mark.parametrize("by_pairs, per_sm", [(False, 4), (True, 6)])
def test_grad_weight_splits_fill_the_gpu(monkeypatch, by_pairs, per_sm):
    """The weight's gradient splits its sites in multiples of 256 until its tiles make per_sm
    CTAs an SM (6 by pairs, whose taps leave about half of the CTAs without sites), at most one a
    part of 256 sites; every site in one split, none past n_out."""
    monkeypatch.setattr(_launch, "device_info", lambda device: _launch.H100)  # 132 SMs
    for tiles, n_out in (((27, 1), 100_000), ((54, 2), 30_000), ((8, 1), 700), ((600, 2), 5000),
                         ((27, 1), 1)):
        grid, split_sites = grad_kernels.grad_weight_grid(0, n_out, tiles, by_pairs)
        parts = -(-n_out // 256)
        splits = min(parts, max(1, -(-per_sm * 132 // (tiles[0] * tiles[1]))))
        assert grid[:2] == tiles and split_sites % 256 == 0
        assert split_sites == -(-parts // splits) * 256
        assert grid[2] == -(-n_out // split_sites) and (grid[2] - 1) * split_sites < n_out


# (taps, n_out): the fused kernel's grid (site tiles of 64, or of 128 where they make 264 CTAs or
# more, one channel tile, tap splits) and taps a split, on an H100 (132 SMs: few tiles split
# their taps up to 264 CTAs).
FUSED_GRIDS = {
    (1, 1): ((1, 1, 1), 1), (1, 63): ((1, 1, 1), 1), (1, 64): ((1, 1, 1), 1),
    (1, 65): ((2, 1, 1), 1), (1, 3000): ((47, 1, 1), 1), (1, 200_000): ((1563, 1, 1), 1),
    (9, 1): ((1, 1, 9), 1), (9, 63): ((1, 1, 9), 1), (9, 64): ((1, 1, 9), 1),
    (9, 65): ((2, 1, 9), 1), (9, 3000): ((47, 1, 5), 2), (9, 4224): ((66, 1, 3), 3),
    (9, 200_000): ((1563, 1, 1), 9),
    (27, 1): ((1, 1, 27), 1), (27, 63): ((1, 1, 27), 1), (27, 64): ((1, 1, 27), 1),
    (27, 65): ((2, 1, 27), 1), (27, 3000): ((47, 1, 5), 6), (27, 4224): ((66, 1, 4), 7),
    (27, 33_664): ((526, 1, 1), 27), (27, 33_665): ((264, 1, 1), 27),
    (27, 200_000): ((1563, 1, 1), 27)}


def test_fused_plan_serves_every_number_of_sites(monkeypatch):
    """A layer's KernelPlans are made at its first call, whatever its sites (real frames change
    theirs every frame): later calls at other counts make none, and launch with their own grid,
    split taps, scratch and split sum sizes (fused_splits' and fused_tall's rules on an H100)."""
    monkeypatch.setattr(_launch, "device_info", lambda device: _launch.H100)
    monkeypatch.setattr(_launch, "function", lambda device, op, kernel, *args: kernel)
    monkeypatch.setattr(_plan, "max_dynamic_shared", lambda plan, shared: plan.function)
    made, launches = [], []
    make = _plan.KernelPlan.__init__

    def counted(plan, device, op, kernel, *args, **options):
        made.append(kernel)
        make(plan, device, op, kernel, *args, **options)

    names = []

    def record(plan, stream, *values, grid=None, function=None):
        named = dict(zip(plan.record.names, values + plan.constants))
        launches.append((plan.name.split("<")[0], grid, named))
        names.append(plan.name)

    monkeypatch.setattr(_plan.KernelPlan, "__init__", counted)
    monkeypatch.setattr(_plan.KernelPlan, "launch", record)
    conv_kernels._fused_plan.cache_clear()
    cin, cout = 32, 16
    try:
        for (taps, n_out), (grid, split_taps) in FUSED_GRIDS.items():
            memory, launches[:], names[:] = cuda_emulation.HostMemory(), [], []
            features = numpy.zeros((8, cin), numpy.float16)
            weight = numpy.zeros((cout, taps, cin), numpy.float16)
            neighbors = numpy.zeros((taps, n_out), numpy.int32)
            conv_kernels.fused_conv(memory, features, weight, numpy.zeros(cout, numpy.float16),
                                    neighbors, relu=True)
            (kernel, got_grid, fused), *split_sum = launches
            assert (kernel, got_grid) == ("submanifold_fused", grid), (taps, n_out)
            assert names[0].endswith(", 2, 128>") == (n_out > 33_664)  # tall tiles
            assert (fused["n_out"], fused["split_taps"]) == (n_out, split_taps)
            splits = grid[2]
            assert bool(fused["partial"]) == (splits > 1) == bool(memory.scratch)
            if splits > 1:
                assert memory.scratch[0].size == splits * n_out * cout
                (kernel, got_grid, summed), = split_sum
                assert (kernel, got_grid) == ("split_sum", _plan.split_sum_grid(n_out, cout))
                assert ((summed["rows"], summed["cols"], summed["pitch"], summed["splits"],
                         summed["relu"]) == (n_out, cout, cout, splits, 1))
            else:
                assert not split_sum and fused["relu"] == 1
    finally:
        conv_kernels._fused_plan.cache_clear()
    # Each layer's plans at its first call: the kernel, the split sum (taps > 1), the tall tiles.
    assert made == (["submanifold_fused"] * 2
                    + ["submanifold_fused", "split_sum", "submanifold_fused"] * 2)


def test_fused_tall_rule(monkeypatch):
    """Tall tiles (128 sites) where the plan has them (16-byte rows; 16-64 channels a tile in
    16-bit types, 32-64 in TF32; the shared memory to opt into), the rows are unsorted and they
    alone make _TALL_CTAS_PER_SM CTAs an SM of an H100 (264)."""
    info = _launch.H100
    monkeypatch.setattr(_launch, "device_info", lambda device: info)
    monkeypatch.setattr(_launch, "function", lambda device, op, kernel, *args: kernel)
    monkeypatch.setattr(_plan, "max_dynamic_shared", lambda plan, shared: plan.function)
    conv_kernels._fused_plan.cache_clear()
    try:
        plan = conv_kernels._fused_plan(0, "float16", True, 32, 128, 27)  # two 64-wide tiles
        assert plan.tall.name == "submanifold_fused<half_t, true, 128, 64, 2, 128>"
        assert plan.tall.shared_mem == 2 * (128 + 64) * (128 + 16)
        assert not sm.fused_tall(0, plan, 131 * 128, False)
        assert sm.fused_tall(0, plan, 131 * 128 + 1, False)
        assert sm.fused_tall(0, plan, 200_000, True)  # sorted rows too: it has tall 128-wide
        narrow = conv_kernels._fused_plan(0, "float16", True, 32, 64, 27)
        assert narrow.tall_wide is None and sm.fused_tall(0, narrow, 264 * 128 + 1, False)
        assert not sm.fused_tall(0, narrow, 200_000, True)  # sorted rows: 64-site tiles
        assert conv_kernels._fused_plan(0, "float16", True, 8, 16, 27).tall is not None
        assert conv_kernels._fused_plan(0, "bfloat16", True, 8, 32, 27).tall is not None
        assert conv_kernels._fused_plan(0, "float32", True, 8, 40, 27).tall is not None
        for dtype, aligned, cin, cout in [("float32", True, 8, 16), ("float16", True, 16, 96),
                                          ("float16", False, 16, 64), ("float16", True, 12, 64)]:
            assert conv_kernels._fused_plan(0, dtype, aligned, cin, cout, 27).tall is None
        info = info._replace(shared_per_block_optin=48 * 1024)
        conv_kernels._fused_plan.cache_clear()
        assert conv_kernels._fused_plan(0, "float16", True, 32, 64, 27).tall is None
    finally:
        conv_kernels._fused_plan.cache_clear()


def test_fused_tall_wide_rule(monkeypatch):
    """Tall 128-wide tiles (128 x 128, four warps of 64 x 64) in 16-bit layers whose cout is a
    multiple of 128, taken over tall 64-wide ones where their grid takes fewer rounds of the CTAs
    the GPU runs at once by more than _TALL_WIDE_COST, and on sorted rows wherever the 64-wide
    ones take more than one round: on an H100 running 3 tall and 2 tall 128-wide CTAs an SM (the
    H200's occupancy), 128 channels from 25,345 to 33,792 sites (64-wide tiles two rounds,
    128-wide one), and from 25,345 on sorted rows."""
    monkeypatch.setattr(_launch, "device_info", lambda device: _launch.H100)
    monkeypatch.setattr(_launch, "function", lambda device, op, kernel, *args: kernel)
    monkeypatch.setattr(_plan, "max_dynamic_shared", lambda plan, shared: plan.function)
    monkeypatch.setattr(conv_kernels, "_resident",
                        lambda conv: 132 * (2 if conv.template_args[3] == 128 else 3))
    conv_kernels._fused_plan.cache_clear()
    try:
        plan = conv_kernels._fused_plan(0, "float16", True, 64, 128, 27)
        assert plan.tall_wide.name == "submanifold_fused<half_t, true, 128, 128, 2, 128>"
        assert plan.tall_wide.shared_mem == 2 * (128 + 128) * (128 + 16)
        for n_out, wide in [(25_344, False), (25_345, True), (33_792, True), (33_793, False),
                            (10_000, False), (200_000, False)]:
            assert sm.fused_tall_wide(plan, n_out, False) == wide, n_out
            assert sm.fused_tall_wide(plan, n_out, True) == (n_out > 25_344), n_out
        plan = conv_kernels._fused_plan(0, "bfloat16", True, 32, 256, 27)  # four 64-wide tiles
        assert plan.tall_wide.name == "submanifold_fused<bfloat16_t, true, 128, 128, 2, 128>"
        # 64-wide tiles: 2 rounds from 12,673 sites; 128-wide: 1 round up to 16,896.
        assert [sm.fused_tall_wide(plan, n, False)
                for n in (12_672, 12_673, 16_896, 16_897)] == [False, True, True, False]
        assert [sm.fused_tall_wide(plan, n, True)
                for n in (12_672, 12_673, 16_897, 200_000)] == [False, True, True, True]
        for dtype, aligned, cin, cout in [("float32", True, 32, 128), ("float16", True, 32, 192),
                                          ("float16", True, 32, 64), ("float16", False, 32, 128),
                                          ("float16", True, 12, 128)]:
            plan = conv_kernels._fused_plan(0, dtype, aligned, cin, cout, 27)
            assert plan.tall_wide is None and not sm.fused_tall_wide(plan, 30_000, True)
            assert sm.tall_wide_tiles(numpy.dtype(dtype).itemsize, cout) == (
                dtype == "float16" and cout % 128 == 0)
    finally:
        conv_kernels._fused_plan.cache_clear()


@requires_gpu
@pytest.mark.parametrize("cin, cout", [(64, 128), (24, 256), (128, 128)])
@pytest.mark.parametrize("rule", [False, True], ids=["forced", "rule"])
def test_fused_tall_wide_tiles(rng, monkeypatch, cin, cout, rule):
    """Tall 128-wide tiles against float64 on the GPU (float16; bfloat16 in the emulated
    tests): forced on a small layer (a partial tile of sites, several channel tiles), and at
    sites where the rule takes them on this GPU (the 64-wide tall tiles' grid one round and a
    bit, the 128-wide one round)."""
    conv_kernels._fused_plan.cache_clear()
    if rule:
        plan = conv_kernels._fused_plan(0, "float16", True, cin, cout, 27)
        tiles = conv_kernels._resident(plan.tall) // (cout // 64) + 1
        if tiles > conv_kernels._resident(plan.tall_wide) // (cout // 128):
            pytest.skip("no number of sites where this GPU's occupancy takes them")
        n, shape = tiles * 128, (40, 64, 64)
        assert sm.fused_tall_wide(plan, n, False)
    else:
        monkeypatch.setattr(conv_kernels, "fused_tall",
                            lambda device, plan, n_out, sorted_rows: True)
        monkeypatch.setattr(conv_kernels, "fused_tall_wide",
                            lambda plan, n_out, sorted_rows: True)
        n, shape = 700, (12, 14, 16)
    _fused_matches_float64(rng, shape, n, cin, cout, numpy.float16)


@pytest.mark.parametrize("subm", [True, False], ids=["subm", "strided"])
@pytest.mark.parametrize("case", ["2d-5x5-stride2", "3d-1x3x3", "2d-even-2x3-dilated"])
def test_matches_dense_convolution(xp, rng, case, subm):
    torch = require("torch")
    batch, shape, n, kernel, stride, padding, dilation = CASES[case]
    if subm and any(k % 2 == 0 for k in kernel):
        pytest.skip("torch pads symmetrically: odd kernels only")
    (coords, x, w, b), (coords_d, x_d, w_d, b_d), rulebook, _ = build(
        xp, rng, case, subm, numpy.float64)
    if subm:
        stride, padding = (1,) * len(shape), tuple(k // 2 * d for k, d in zip(kernel, dilation))
    dense = sm.to_dense(sm.SparseTensorData(x, coords, shape, batch))
    conv = {2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[len(shape)]
    moved = list(range(len(shape) + 2))
    channels_first = (0, moved[-1], *moved[1:-1])
    ref = conv(torch.from_numpy(dense).permute(*channels_first),
               torch.from_numpy(numpy.moveaxis(w, -1, 1)), torch.from_numpy(b), stride=stride,
               padding=padding, dilation=dilation)
    ref = ref.permute(0, *moved[2:], 1).numpy()
    out_coords = to_numpy(rulebook.out_coords)
    y = sm.rulebook_conv(x_d, rulebook, w_d, b_d)
    close(y, ref[tuple(out_coords.T)], numpy.float64)
    # And the functional forms on sparse tensors give the same.
    t = sm.SparseTensorData(x_d, coords_d, shape, batch)
    if subm:
        result = sm.submanifold_conv(t, w_d, b_d, dilation=dilation)
    else:
        result = sm.sparse_conv(t, w_d, b_d, stride=stride, padding=padding, dilation=dilation)
    numpy.testing.assert_array_equal(to_numpy(result.coords), out_coords)
    close(result.features, ref[tuple(out_coords.T)], numpy.float64)


@pytest.mark.parametrize("subm", [True, False], ids=["subm", "strided"])
@pytest.mark.parametrize("case", ["2d-even-2x3-dilated", "3d-3x3x3-stride2", "empty"])
def test_gradients_are_adjoint(xp, rng, case, subm):
    """<conv(x), dy> = <x, grad_features(dy)> = <w, grad_weight(x, dy)> (the convolution is
    bilinear in x and w), and grad_weight matches the loop over pairs."""
    (coords, x, w, _), (_, x_d, w_d, _), rulebook, (out_coords, pairs, _) = build(
        xp, rng, case, subm, numpy.float64, bias=False)
    dy = random_array(rng, (out_coords.shape[0], w.shape[0]), numpy.float64)
    y = to_numpy(sm.rulebook_conv(x_d, rulebook, w_d))
    dx = to_numpy(sm.rulebook_conv_grad_features(xp.asarray(dy), rulebook, w_d))
    dw = to_numpy(sm.rulebook_conv_grad_weight(x_d, xp.asarray(dy), rulebook))
    assert dx.shape == x.shape and dw.shape == w.shape
    assert numpy.isclose((y * dy).sum(), (x * dx).sum(), rtol=1e-12, atol=1e-9)
    expected_dw = numpy.zeros((w.shape[0], int(numpy.prod(w.shape[1:-1])), w.shape[-1]))
    for k, i, o in pairs:
        expected_dw[:, k] += numpy.outer(dy[o], x[i])
    close(dw, expected_dw.reshape(w.shape), numpy.float64)


def test_inverse_conv_restores_sites(xp, rng):
    coords = xp.asarray(random_sites(rng, 2, (9, 8, 7), 40))
    x = sm.SparseTensorData(xp.asarray(random_array(rng, (40, 4), numpy.float32)), coords,
                            (9, 8, 7), 2)
    rulebook = sm.strided_rulebook(coords, (9, 8, 7), 2, 3, 2, 1)
    down = sm.sparse_conv(x, xp.asarray(random_array(rng, (6, 3, 3, 3, 4), numpy.float32)),
                          rulebook=rulebook)
    up = sm.inverse_conv(down, xp.asarray(random_array(rng, (4, 3, 3, 3, 6), numpy.float32)),
                         rulebook=rulebook)
    assert up.spatial_shape == (9, 8, 7)
    numpy.testing.assert_array_equal(to_numpy(up.coords), to_numpy(coords))
    with pytest.raises(ValueError, match="rulebook must be the strided rulebook"):
        sm.inverse_conv(up, xp.asarray(random_array(rng, (4, 3, 3, 3, 4), numpy.float32)),
                        rulebook=rulebook.inverse())


def test_dense_round_trip(xp, rng):
    x = random_array(rng, (2, 5, 6, 3), numpy.float32)
    x[rng.random((2, 5, 6)) < 0.6] = 0
    t = sm.from_dense(xp.asarray(x))
    assert t.spatial_shape == (5, 6) and t.batch_size == 2
    numpy.testing.assert_array_equal(to_numpy(sm.to_dense(t)), x)
    mask = numpy.any(x != 0, axis=-1)
    numpy.testing.assert_array_equal(to_numpy(t.coords), numpy.argwhere(mask))


@pytest.mark.parametrize("bad, message", [
    ([[0, 1, 1], [0, 2, 3], [0, 1, 1]], "duplicate rows, e.g. \\(0, 1, 1\\)"),
    ([[0, 1, 1], [0, 4, 0]], "row 1 = \\(0, 4, 0\\) is outside"),
    ([[0, 1, -1]], "row 0 = \\(0, 1, -1\\) is outside"),
    ([[0, 1, 1], [2, 0, 0]], "row 1 = \\(2, 0, 0\\) is outside"),
])
@pytest.mark.parametrize("builder", ["subm", "strided"])
def test_bad_coords_rejected(xp, bad, message, builder):
    coords = xp.asarray(numpy.array(bad, numpy.int32))
    build_rulebook = sm.submanifold_rulebook if builder == "subm" else sm.strided_rulebook
    with pytest.raises(ValueError, match=message):
        build_rulebook(coords, (4, 5), 2, 3)


def test_bad_arguments_rejected(xp, rng):
    coords = xp.asarray(random_sites(rng, 1, (6, 6), 10))
    with pytest.raises(TypeError, match="coords must be int32"):
        sm.submanifold_rulebook(coords.astype(xp.int64), (6, 6), 1, 3)
    with pytest.raises(ValueError, match="coords must be \\[N, 4\\]"):
        sm.submanifold_rulebook(coords, (6, 6, 6), 1, 3)
    with pytest.raises(ValueError, match="kernel_size must be ints >= 1"):
        sm.submanifold_rulebook(coords, (6, 6), 1, (3, 0))
    with pytest.raises(ValueError, match="kernel_size must be an int or 2 ints"):
        sm.submanifold_rulebook(coords, (6, 6), 1, (3, 3, 3))
    with pytest.raises(ValueError, match="batch_size must be ints >= 1"):
        sm.submanifold_rulebook(coords, (6, 6), 0, 3)
    with pytest.raises(ValueError, match="does not fit spatial_shape"):
        sm.strided_rulebook(coords, (6, 6), 1, 9)
    with pytest.raises(ValueError, match="spatial_shape must have 1 to 4 axes"):
        sm.submanifold_rulebook(coords[:, :1], (), 1, 3)
    rulebook = sm.submanifold_rulebook(coords, (6, 6), 1, 3)
    x = xp.asarray(random_array(rng, (10, 4), numpy.float32))
    w = xp.asarray(random_array(rng, (8, 3, 3, 4), numpy.float32))
    with pytest.raises(ValueError, match="weight must be \\[Cout, 3, 3, 4\\]"):
        sm.rulebook_conv(x, rulebook, w[..., :3])
    with pytest.raises(TypeError, match="weight must have features' dtype float32"):
        sm.rulebook_conv(x, rulebook, w.astype(xp.float64))
    with pytest.raises(ValueError, match="features must be \\[N, C\\] with N = 10"):
        sm.rulebook_conv(x[:9], rulebook, w)
    with pytest.raises(ValueError, match="bias must be a float32 array of shape \\(8,\\)"):
        sm.rulebook_conv(x, rulebook, w, w[0, 0, 0])
    with pytest.raises(TypeError, match="rulebook must be a Rulebook"):
        sm.rulebook_conv(x, None, w)
    with pytest.raises(ValueError, match="algo must be None or one of"):
        sm.rulebook_conv(x.astype(xp.float64), rulebook, w.astype(xp.float64), algo="fused")
    with pytest.raises(ValueError, match="algo must be None or one of"):
        sm.rulebook_conv(x, rulebook, w, algo="implicit")


def _raised(call):
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    return None


@pytest.mark.parametrize("subm", [True, False])
def test_remembered_geometry_rejects_what_a_fresh_check_does(rng, monkeypatch, subm):
    """rulebook_geometry remembers the results of good ints: arguments equal to them that are
    not ints (bools, floats, NumPy bools) and bad coords raise as they would unremembered."""
    coords = random_sites(rng, 2, (6, 7), 10)
    good = dict(spatial_shape=[6, 7], batch_size=2, kernel_size=[3, 1], stride=[1, 1],
                padding=[1, 0], dilation=[1, 1])

    def geometry(sites=coords, **changed):
        arguments = {**good, **changed}
        return lambda: validation.rulebook_geometry(sites, *arguments.values(), subm)

    bad = [geometry(kernel_size=[3, True]), geometry(kernel_size=[3.0, 1]),
           geometry(batch_size=2.0), geometry(dilation=1.0), geometry(dilation=True),
           geometry(spatial_shape=[6, numpy.bool_(True)]), geometry(sites=coords[:, :2]),
           geometry(sites=coords.astype(numpy.int64))]
    if not subm:  # a submanifold rulebook reads neither
        bad += [geometry(stride=[1, True]), geometry(padding=1.0)]
    monkeypatch.setattr(validation, "_GEOMETRIES", {})
    fresh = [_raised(call) for call in bad]
    assert None not in fresh
    remembered = geometry()()
    assert len(validation._GEOMETRIES) == 1
    assert [_raised(call) for call in bad] == fresh
    assert geometry()() is remembered


# --- the GPU hash table -------------------------------------------------------------------

def slot_numpy(keys, capacity):
    """The first slot a key probes (splitmix64's finaliser, as in
    kernels/submanifold/submanifold.cu)."""
    with numpy.errstate(over="ignore"):
        x = keys.astype(numpy.uint64)
        x ^= x >> numpy.uint64(30)
        x *= numpy.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> numpy.uint64(27)
        x *= numpy.uint64(0x94D049BB133111EB)
        x ^= x >> numpy.uint64(31)
    return (x & numpy.uint64(capacity - 1)).astype(numpy.int64)


def colliding_keys(rng, n, capacity, limit):
    """n distinct keys in [0, limit) that all start probing at slot 0."""
    found = numpy.empty(0, numpy.int64)
    while found.size < n:
        keys = rng.integers(0, limit, 1 << 20)
        found = numpy.unique(numpy.concatenate([found, keys[slot_numpy(keys, capacity) == 0]]))
    return rng.permutation(found)[:n]


@requires_gpu
def test_adversarial_collisions_give_the_same_rulebook(rng):
    import cupy

    shape, n = (1000, 999, 998), 200
    keys = colliding_keys(rng, n, sm.table_capacity(n), int(numpy.prod(shape)))
    coords = numpy.stack(numpy.unravel_index(keys, (1, *shape)), axis=1).astype(numpy.int32)
    for builder, args in ((sm.submanifold_rulebook, (3,)), (sm.strided_rulebook, (3, 1, 1))):
        host = builder(coords, shape, 1, *args)
        device = builder(cupy.asarray(coords), shape, 1, *args)
        numpy.testing.assert_array_equal(device.neighbors.get(), host.neighbors)
        numpy.testing.assert_array_equal(device.neighbors_t.get(), host.neighbors_t)
        numpy.testing.assert_array_equal(device.out_coords.get(), host.out_coords)


@requires_gpu
@pytest.mark.parametrize("shape, kernel, stride, padding", [
    ((41, 400, 352), 3, 2, (0, 1, 1)), ((41, 400, 352), (3, 1, 1), (2, 1, 1), 0),
    ((800, 704), 5, 3, 2)])
def test_large_rulebooks_equal_numpy(rng, shape, kernel, stride, padding):
    import cupy

    coords = random_sites(rng, 3, shape, 60000)
    for subm in (True, False):
        if subm:
            host = sm.submanifold_rulebook(coords, shape, 3, kernel)
            device = sm.submanifold_rulebook(cupy.asarray(coords), shape, 3, kernel)
        else:
            host = sm.strided_rulebook(coords, shape, 3, kernel, stride, padding)
            device = sm.strided_rulebook(cupy.asarray(coords), shape, 3, kernel, stride,
                                         padding)
        numpy.testing.assert_array_equal(device.out_coords.get(), host.out_coords)
        numpy.testing.assert_array_equal(device.neighbors.get(), host.neighbors)
        numpy.testing.assert_array_equal(device.neighbors_t.get(), host.neighbors_t)


@requires_gpu
@pytest.mark.parametrize("out_shape, fraction", [
    ((1, 31), 0.5), ((64, 512), 0.5), ((33, 1000), 0.5), ((33, 1000), 1.0), ((7, 9), 0.0)],
    ids=["one-partial-word", "one-whole-group", "two-groups", "every-site", "no-site"])
def test_strided_bitmap_ranks_across_words_and_groups(rng, out_shape, fraction):
    """Strided output grids of one partial bitmap word, exactly one rank_words group
    (1024 words) and a partial second group, with every output site or none active."""
    import cupy

    shape = tuple(2 * s for s in out_shape)
    coords = random_sites(rng, 1, shape, int(fraction * numpy.prod(shape)))
    host = sm.strided_rulebook(coords, shape, 1, 3, 2, 1)
    assert host.out_shape == out_shape
    for check in (True, False):
        device = sm.strided_rulebook(cupy.asarray(coords), shape, 1, 3, 2, 1, check=check)
        numpy.testing.assert_array_equal(device.out_coords.get(), host.out_coords)
        numpy.testing.assert_array_equal(device.neighbors.get(), host.neighbors)
        numpy.testing.assert_array_equal(device.neighbors_t.get(), host.neighbors_t)


@requires_gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_strided_hash_and_sort_equals_numpy(rng, monkeypatch, case):
    """The path of output grids too large for a bitmap (forced: no grid fits): the output
    sites hashed, sorted and decoded (decode_keys), every DIMS, equal to NumPy's."""
    import cupy

    monkeypatch.setattr(cuda_rulebook, "_BITMAP_MAX_BITS", 0)
    batch, shape, n, kernel, stride, padding, dilation = CASES[case]
    coords = random_sites(rng, batch, shape, n)
    host = sm.strided_rulebook(coords, shape, batch, kernel, stride, padding, dilation)
    for check in (True, False):
        device = sm.strided_rulebook(cupy.asarray(coords), shape, batch, kernel, stride,
                                     padding, dilation, check=check)
        numpy.testing.assert_array_equal(device.out_coords.get(), host.out_coords)
        numpy.testing.assert_array_equal(device.neighbors.get(), host.neighbors)
        numpy.testing.assert_array_equal(device.neighbors_t.get(), host.neighbors_t)


@requires_gpu
def test_unchecked_bad_coords_stay_in_bounds(rng):
    """check=False trusts the coordinates: bad ones give wrong maps, never rows out of range."""
    import cupy

    coords = random_sites(rng, 2, (9, 10, 11), 300)
    coords[:5] = coords[5:10]  # duplicates
    coords[10:15, 0] = (-1, 2, 7, -5, 2**31 - 1)  # batch indices outside [0, 2)
    coords[15:20, 1:] = (-1, 10, 11)
    coords[20:25, 2] = 2**31 - 1
    coords = cupy.asarray(coords)
    for rulebook in (sm.submanifold_rulebook(coords, (9, 10, 11), 2, 3, check=False),
                     sm.strided_rulebook(coords, (9, 10, 11), 2, 3, 2, 1, check=False)):
        n_in, n_out = rulebook.in_coords.shape[0], rulebook.out_coords.shape[0]
        assert -1 <= int(rulebook.neighbors.min()) and int(rulebook.neighbors.max()) < n_in
        assert -1 <= int(rulebook.neighbors_t.min()) and int(rulebook.neighbors_t.max()) < n_out


@requires_gpu
def test_full_table_fails_cleanly(rng):
    import cupy

    keys = cupy.asarray(rng.choice(1 << 40, size=100, replace=False))
    with pytest.raises(ValueError, match="capacity 64 is too small for 100 keys"):
        sm.hash_table(keys, capacity=64)
    table = sm.hash_table(keys[:64], capacity=64)  # exactly full: every probe path is long
    found = cupy.sort(table.keys)
    numpy.testing.assert_array_equal(found.get(), numpy.sort(keys[:64].get()))
    assert sorted(table.vals.get().tolist()) == list(range(64))
    with pytest.raises(ValueError, match="keys has duplicates"):
        sm.hash_table(cupy.concatenate([keys[:10], keys[:1]]))
    with pytest.raises(ValueError, match="capacity must be a power of two"):
        sm.hash_table(keys, capacity=100)
    with pytest.raises(ValueError, match="keys must be >= 0"):
        sm.hash_table(cupy.asarray([3, -1, 5]))
