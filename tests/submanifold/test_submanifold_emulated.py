"""kernels/submanifold/submanifold.cu run on the CPU through tests/cuda_emulation: the rulebook
kernels (the hash table, the submanifold query, the strided bitmap, its ranks and scatter) against
the NumPy backend, and the fused convolution (with the split sum after it) against the definition.
So CI, which has no GPU, checks what the kernels compute; test_submanifold.py runs them on a GPU."""

import ctypes

import numpy
import pytest

import cuda_emulation
from axes import random_array
from sbnet_cupy import submanifold
from sbnet_cupy.core import launch
from sbnet_cupy.submanifold import conv_kernels, cuda_rulebook, grad_kernels
from test_submanifold import CASES, colliding_keys, random_sites

pytestmark = [pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++"),
              pytest.mark.emulated]


ARGUMENTS = {"submanifold_fused": "FusedArgs", "submanifold_grad_weight": "GradWeightArgs",
             "tap_pair_counts": "PairArgs", "tap_pairs": "PairArgs",
             "split_sum": "SplitSumArgs",
             "submanifold_gather": "GatherArgs", "tap_masks": "MaskArgs",
             "ordered_map": "MaskArgs"}


@pytest.fixture(scope="module")
def kernels(emulation_dir):
    return cuda_emulation.build(
        "submanifold", {name: ARGUMENTS.get(name.split("<")[0], "RuleArgs")
                        for name in submanifold.instantiations()},
        emulation_dir)


# The plans of the launches, which keep the kernels they were made with (emulated ones here).
PLANS = (conv_kernels._fused_plan, conv_kernels._resident, conv_kernels._gather_plan,
         conv_kernels._masks_plan, grad_kernels._grad_weight_plan, grad_kernels._pairs_plans,
         cuda_rulebook._rule_plan)


@pytest.fixture
def launched(monkeypatch, kernels):
    """Launches go to the emulated kernels on a GPU of 2 SMs (few sites then split the taps
    over CTAs), grid-stride loops over 2 CTAs at most (fewer threads to start), and over 2 rows
    of taps along the grid's y (so the rulebook kernels' loop over rows runs too); device
    memory is NumPy's (build_raw's memsets and reads of device ints go to it); the plans made
    for it are dropped after the test."""
    monkeypatch.setattr(cuda_rulebook, "_MAX_BLOCKS", 2)
    monkeypatch.setattr(cuda_rulebook, "_MAX_GRID_Y", 2)
    monkeypatch.setattr(cuda_rulebook, "_device_call", lambda device, fn, *args: fn(*args))
    monkeypatch.setattr(cuda_rulebook, "_memset",
                        lambda address, value, size, stream: ctypes.memset(address, value, size))

    def read_into(host, addresses, stream):
        host[:] = [ctypes.c_int32.from_address(a).value for a in addresses]
        return host

    monkeypatch.setattr(cuda_rulebook, "_read_into", read_into)
    for plans in PLANS:
        plans.cache_clear()
    yield cuda_emulation.install(monkeypatch, kernels, sms=2)
    for plans in PLANS:
        plans.cache_clear()


def _built(coords, shape, batch, kernel, stride, padding, dilation, subm):
    """The emulated kernels' rulebook (build_raw's Built), the coordinates checked."""
    geometry = submanifold.rulebook_geometry(coords, shape, batch, kernel, stride, padding,
                                             dilation, subm)
    return submanifold.build_raw(cuda_emulation.HostMemory(), coords, *geometry, True)


def _rulebooks(coords, shape, batch, kernel, stride, padding, dilation, subm):
    """(the emulated kernels' Built, the NumPy backend's Rulebook) of the same geometry."""
    built = _built(coords, shape, batch, kernel, stride, padding, dilation, subm)
    if subm:
        host = submanifold.submanifold_rulebook(coords, shape, batch, kernel, dilation)
    else:
        host = submanifold.strided_rulebook(coords, shape, batch, kernel, stride, padding,
                                            dilation)
    return built, host


def _assert_same(built, host, subm):
    numpy.testing.assert_array_equal(built.neighbors, host.neighbors)
    numpy.testing.assert_array_equal(built.neighbors_t, host.neighbors_t)
    if not subm:
        numpy.testing.assert_array_equal(built.out_coords, host.out_coords)


@pytest.mark.parametrize("subm", [True, False], ids=["subm", "strided"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rulebook_equals_numpy(rng, launched, case, subm):
    """Submanifold and strided rulebooks, 1-D to 4-D, even and dilated kernels, one site, no
    site, a full grid: the hash table's insert and query, and the strided bitmap's marks, ranks
    and scatter."""
    batch, shape, n, kernel, stride, padding, dilation = CASES[case]
    coords = random_sites(rng, batch, shape, n)
    _assert_same(*_rulebooks(coords, shape, batch, kernel, stride, padding, dilation, subm),
                 subm)


def test_adversarial_collisions(rng, launched):
    """200 keys that all start probing at the same slot of the hash table (a submanifold
    rulebook: a strided one on this grid takes the hash-and-sort path, CuPy's sort). They fill
    the table's first 200 slots: the test's slot_numpy is the kernels' slot."""
    shape, n = (1000, 999, 998), 200
    capacity = submanifold.table_capacity(n)
    keys = colliding_keys(rng, n, capacity, int(numpy.prod(shape)))
    coords = numpy.stack(numpy.unravel_index(keys, (1, *shape)), axis=1).astype(numpy.int32)
    built, host = _rulebooks(coords, shape, 1, 3, 1, 1, 1, True)
    _assert_same(built, host, True)
    table_keys = built.in_table.owner[:2 * capacity].view(numpy.int64)
    numpy.testing.assert_array_equal(numpy.flatnonzero(table_keys != -1), numpy.arange(n))


@pytest.mark.parametrize("out_shape, fraction", [((1, 31), 0.5), ((33, 1000), 0.3)],
                         ids=["one-partial-word", "two-groups"])
def test_strided_bitmap_ranks_across_words_and_groups(rng, launched, out_shape, fraction):
    """A strided output grid of one partial bitmap word, and one of two rank_words groups
    (1024 words each, the last CTA adding up the groups)."""
    shape = tuple(2 * s for s in out_shape)
    coords = random_sites(rng, 1, shape, int(fraction * numpy.prod(out_shape)))
    _assert_same(*_rulebooks(coords, shape, 1, 3, 2, 1, 1, False), False)


def _padded(coords, rows):
    """coords followed by padding rows (every field -1, as torch_bridge's SparseGraphs pads)
    up to `rows`."""
    padding = numpy.full((rows - coords.shape[0], coords.shape[1]), -1, numpy.int32)
    return numpy.concatenate([coords, padding])


@pytest.mark.parametrize("room", [1.4, 1.0, 0.6], ids=["spare", "exact", "overflow"])
def test_bounded_strided_build_with_padding_rows(rng, launched, room):
    """build_raw with a capacity (no host read of the count) on coords with padding rows:
    the sites and maps of the unbounded build on the real rows, padding rows and spare output
    rows without neighbours, the count on the device; with less room than sites, the sites
    past the capacity left out of both maps and of later lookups in the output's bitmap."""
    batch, shape, geometry = 2, (9, 11, 7), (3, 2, 1, 1)
    coords = random_sites(rng, batch, shape, 120)
    host = submanifold.strided_rulebook(coords, shape, batch, *geometry)
    count = host.out_coords.shape[0]
    capacity = int(room * count)
    padded = _padded(coords, 150)
    args = submanifold.rulebook_geometry(padded, shape, batch, geometry[0], *geometry[1:],
                                         False)
    built = submanifold.build_raw(cuda_emulation.HostMemory(), padded, *args, False,
                                  capacity=capacity)
    assert built.count.tolist() == [count]
    kept = min(count, capacity)
    numpy.testing.assert_array_equal(built.out_coords[:kept], host.out_coords[:kept])
    assert (built.out_coords[kept:] == -1).all()
    numpy.testing.assert_array_equal(built.neighbors[:, :kept], host.neighbors[:, :kept])
    assert (built.neighbors[:, kept:] == -1).all()
    want_t = numpy.where(host.neighbors_t < kept, host.neighbors_t, -1)
    numpy.testing.assert_array_equal(built.neighbors_t[:, :120], want_t)
    assert (built.neighbors_t[:, 120:] == -1).all()
    # A submanifold rulebook on the output sites through their bitmap: rows past the capacity
    # are never found.
    subm_args = submanifold.rulebook_geometry(built.out_coords, args[3], batch, 3, 1, 0, 1,
                                              True)
    subm = submanifold.build_raw(cuda_emulation.HostMemory(), built.out_coords, *subm_args,
                                 False, built.out_table)
    want = submanifold.submanifold_rulebook(host.out_coords[:kept], args[3], batch, 3, 1)
    numpy.testing.assert_array_equal(subm.neighbors[:, :kept], want.neighbors)
    assert (subm.neighbors[:, kept:] == -1).all()


def test_padding_rows_left_out_of_a_submanifold_build(rng, launched):
    """Padding rows (batch index -1) of an unchecked submanifold build: no neighbours, and no
    real row's neighbour."""
    coords = random_sites(rng, 2, (6, 7, 5), 60)
    host = submanifold.submanifold_rulebook(coords, (6, 7, 5), 2, 3, 1)
    args = submanifold.rulebook_geometry(coords, (6, 7, 5), 2, 3, 1, 0, 1, True)
    built = submanifold.build_raw(cuda_emulation.HostMemory(), _padded(coords, 75), *args,
                                  False)
    numpy.testing.assert_array_equal(built.neighbors[:, :60], host.neighbors)
    numpy.testing.assert_array_equal(built.neighbors_t[:, :60], host.neighbors_t)
    assert (built.neighbors[:, 60:] == -1).all() and (built.neighbors_t[:, 60:] == -1).all()


@pytest.mark.parametrize("shape", [(6, 7, 5), (40,), (5, 4, 3, 6)], ids=["3d", "1d", "4d"])
@pytest.mark.parametrize("padding", [0, 1, 37, 300])
def test_site_faults_count_padding_and_flag_the_rest(rng, launched, padding, shape):
    """cuda_rulebook.site_faults (SparseGraphs' in-graph check): no flags and the padding rows
    counted for distinct sites inside the grid; a repeated site, a site outside the grid (each
    axis, each side, and the batch) and a real row of -1 (counted with the padding) found."""
    coords = random_sites(rng, 3, shape, 100)
    n = coords.shape[0]

    def faults(rows):
        got = cuda_rulebook.site_faults(cuda_emulation.HostMemory(), _padded(rows, len(rows)
                                                                             + padding),
                                        shape, 3)
        return int(got[0]), int(got[1])

    assert faults(coords) == (0, padding)
    assert faults(coords[:0]) == (0, padding)
    repeated = coords.copy()
    repeated[n - 1] = repeated[n // 2]
    assert faults(repeated) == (cuda_rulebook._FLAG_DUPLICATE, padding)
    for axis, value in [(0, 3), (0, -1), *((1 + d, shape[d]) for d in range(len(shape))),
                        *((1 + d, -1 - d) for d in range(len(shape)))]:
        outside = coords.copy()
        outside[n // 3, axis] = value
        assert faults(outside) == (cuda_rulebook._FLAG_OUTSIDE, padding), (axis, value)
    minus_one = coords.copy()
    minus_one[7] = -1
    assert faults(minus_one) == (0, padding + 1)


@pytest.mark.parametrize("bad, message", [
    ([[0, 1, 1], [0, 2, 3], [0, 1, 1]], "duplicate rows, e.g. \\(0, 1, 1\\)"),
    ([[0, 1, 1], [0, 4, 0]], "row 1 = \\(0, 4, 0\\) is outside"),
    ([[0, 1, 1], [2, 0, 0]], "row 1 = \\(2, 0, 0\\) is outside")])
@pytest.mark.parametrize("subm", [True, False], ids=["subm", "strided"])
def test_bad_coords_rejected(launched, bad, message, subm):
    """The insert kernel's flags: duplicates and sites outside the grid, raised by the host
    as a ValueError naming the row."""
    coords = numpy.array(bad, numpy.int32)
    with pytest.raises(ValueError, match=message):
        _built(coords, (4, 5), 2, 3, 2, 1, 1, subm)


def _bits(a, dtype):
    """NumPy storage of a kernel dtype (bfloat16 as the upper 16 bits of float32)."""
    if dtype == "bfloat16":
        return (a.astype(numpy.float32).view(numpy.uint32) >> 16).astype(numpy.uint16)
    return a.astype(dtype)


_TOLERANCE = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 8e-3}


def _random_layer(rng, n_in, n_out, cin, cout, taps, absent):
    """A layer's float32 features [n_in, cin], weight [cout, taps, cin] and bias [cout] (random,
    never zeros) and its int32 map [taps, n_out], each neighbour absent (-1) with probability
    `absent`."""
    features = random_array(rng, (n_in, cin), numpy.float32)
    weight = random_array(rng, (cout, taps, cin), numpy.float32)
    bias = random_array(rng, (cout,), numpy.float32)
    neighbors = rng.integers(0, n_in, (taps, n_out)).astype(numpy.int32)
    neighbors[rng.random((taps, n_out)) < absent] = -1
    return features, weight, bias, neighbors


def _gathered(features, neighbors):
    """features[neighbors[k, o]] at [k, o], zeros where the neighbour is absent, in float64."""
    return numpy.where(neighbors[..., None] >= 0, features[neighbors], 0).astype(numpy.float64)


def _definition(features, weight, bias, neighbors):
    """The convolution from its definition, in float64: out[o, c] = bias[c] + the sum over taps
    k and channels s of weight[c, k, s] * features[neighbors[k, o], s] (bias None: no bias)."""
    want = numpy.einsum("kos,cks->oc", _gathered(features, neighbors), weight)
    return want if bias is None else want + bias


def _assert_matches(out, want, dtype):
    """A kernel's out (dtype's storage: _bits) equals want within dtype's tolerance, relative to
    want's largest magnitude (at least 1)."""
    got = (out.astype(numpy.uint32) << 16).view(numpy.float32) if dtype == "bfloat16" else out
    numpy.testing.assert_allclose(got.astype(numpy.float64), want, rtol=0,
                                  atol=_TOLERANCE[dtype] * max(1.0, numpy.abs(want).max()))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n_in, n_out, cin, cout, taps", [
    (50, 70, 16, 24, 9), (200, 130, 40, 70, 27), (30, 20, 3, 8, 5), (30, 20, 17, 8, 5),
    (90, 64, 8, 16, 40), (10, 1, 64, 64, 1), (120, 150, 24, 32, 27), (80, 100, 32, 16, 27),
    (70, 90, 16, 13, 9)])
def test_fused_equals_definition(rng, launched, dtype, n_in, n_out, cin, cout, taps):
    """16-byte rows through cp.async and odd ones through registers (rows under 32 bytes padded
    to 16-byte ones: conv_kernels.padded_width), several taps a stage
    (rows narrower than a stage, a whole number of them or not), tiles 16, 32 and 64 channels
    wide, part tiles of sites and channels, absent neighbours, taps no site has, more taps than
    a group of 32, bias, and taps split over CTAs (their float sums added in order by
    split_sum) where the sites are few."""
    features, weight, bias, neighbors = _random_layer(rng, n_in, n_out, cin, cout, taps, 0.4)
    neighbors[taps // 2] = -1  # a tap no site has
    f, w, b = (_bits(a, dtype) for a in (features, weight, bias))
    memory = cuda_emulation.HostMemory()
    out = submanifold.fused_conv(memory, f, w, b, neighbors)
    _assert_matches(out, _definition(features, weight, bias, neighbors), dtype)
    assert [name.split("<")[0] for name, *_ in launched] == (
        ["submanifold_fused", "split_sum"] if memory.scratch else ["submanifold_fused"])


# The largest layers (wide tiles by the sites each tap has) in one dtype each, for CI's time:
# the smaller ones take the same paths in every dtype.
_GRAD_LAYERS = [
    (50, 70, 16, 24, 9), (200, 300, 40, 64, 27), (30, 20, 3, 8, 5), (90, 600, 8, 16, 27),
    (10, 1, 64, 72, 1), (120, 150, 24, 32, 27), (300, 1100, 64, 16, 3), (90, 900, 4, 16, 27)]


@pytest.mark.parametrize("n_in, n_out, cin, cout, taps, dtype", [
    (*layer, dtype) for layer in _GRAD_LAYERS for dtype in ("float32", "float16", "bfloat16")]
    + [(150, 1500, 96, 96, 2, "float16"), (60, 700, 136, 136, 2, "float32")])
def test_grad_weight_equals_definition(rng, launched, dtype, n_in, n_out, cin, cout, taps):
    """dw[co, k, ci] = sum over o of dy[o, co] * features[map[k, o], ci]: tiles 16, 32 and 64
    channels wide (and part tiles), tiles of the columns across taps (rows narrower than a tile,
    a whole number of them or not) and within one, rows under 16 bytes padded (3 channels),
    absent neighbours and a tap no site has, part stages and chunks (a chunk's sites: the fewer
    taps a tile has, the more), sites split over CTAs (the emulated GPU's 2 SMs: their float sums
    added by split_sum) and several chunks in one CTA (8 and 16 taps a tile); layers wider than
    64 x 64 channels by the sites each tap has (tap_pairs) in 128 x 128 tiles (64 x 72, 96 x 96
    part filled, 136 x 136 in two tiles a tap and two of channels); out in float32 and in the
    features' dtype."""
    features = random_array(rng, (n_in, cin), numpy.float32)
    dy = random_array(rng, (n_out, cout), numpy.float32)
    neighbors = rng.integers(0, n_in, (taps, n_out)).astype(numpy.int32)
    neighbors[rng.random((taps, n_out)) < 0.4] = -1
    neighbors[taps // 2] = -1  # a tap no site has
    f, g = (_bits(a, dtype) for a in (features, dy))
    want = numpy.einsum("oc,kos->cks", dy.astype(numpy.float64), _gathered(features, neighbors))
    assert submanifold.grad_weight_fits(dtype, cin, cout, True)
    # The route: the kernel up to 64 x 64 channels or from 64 input channels.
    assert submanifold.grad_weight_takes(cuda_emulation.HostMemory(), f, g) == (
        cin * cout <= 64 * 64 or cin >= 64)
    for out_dtype in ("float32", dtype):
        memory = cuda_emulation.HostMemory()
        out = submanifold.grad_weight(memory, f, g, neighbors, out_dtype)
        assert out.shape == (cout, taps, cin)
        _assert_matches(out, want, out_dtype)


@pytest.mark.parametrize("n_out", [1, 1024, 2500])
def test_tap_pairs_equal_numpy(rng, launched, n_out):
    """Each tap's sites in order, over one block of sites and several (a part one): taps that
    every site has, none has, and some."""
    neighbors = rng.integers(0, 50, (4, n_out)).astype(numpy.int32)
    neighbors[rng.random((4, n_out)) < 0.6] = -1
    neighbors[1] = -1
    neighbors[2] = 7
    pairs, totals, _ = grad_kernels.tap_pairs(cuda_emulation.HostMemory(), neighbors)
    for k in range(4):
        want = numpy.flatnonzero(neighbors[k] >= 0)
        assert totals[k] == want.size
        numpy.testing.assert_array_equal(pairs[k, :want.size], want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_grad_weight_of_no_sites_is_zero(launched, dtype):
    memory = cuda_emulation.HostMemory()
    out = submanifold.grad_weight(memory, numpy.ones((4, 16), dtype), numpy.ones((0, 8), dtype),
                                  numpy.zeros((27, 0), numpy.int32), "float32")
    assert out.shape == (8, 27, 16) and not out.any()
    assert launched == []


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("n_out, split", [(70, True), (300, False)])
@pytest.mark.parametrize("cout", [24, 13])
def test_fused_relu_equals_definition(rng, launched, dtype, n_out, split, cout):
    """relu=True: max(0, sum + bias) written by the kernel's epilogue, or by the split sum where
    the taps are split over CTAs (few sites); about half the outputs are negative before it.
    Even cout: column pairs stored as one vector; odd: one at a time."""
    features, weight, bias, neighbors = _random_layer(rng, 60, n_out, 16, cout, 9, 0.4)
    f, w, b = (a.astype(dtype) for a in (features, weight, bias))
    memory = cuda_emulation.HostMemory()
    out = submanifold.fused_conv(memory, f, w, b, neighbors, relu=True)
    want = _definition(features, weight, bias, neighbors)
    assert 0.3 < (want < 0).mean() < 0.7
    _assert_matches(out, numpy.maximum(want, 0), dtype)
    assert bool(memory.scratch) == split


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fused_layer_at_changing_sites_equals_definition(rng, launched, dtype):
    """One layer's plan serves every number of output sites (real frames change theirs every
    frame): 300 sites (unsplit), 70 (taps in 2 splits), 20 (in 3 splits of 3 taps: 4 asked on
    the 2 SMs), 300 again, one after another with the ReLU, each equal to the definition on its
    own grid."""
    _, weight, bias, _ = _random_layer(rng, 60, 0, 16, 24, 9, 0.4)
    w, b = weight.astype(dtype), bias.astype(dtype)
    grids = []
    for n_out in (300, 70, 20, 300):
        features, _, _, neighbors = _random_layer(rng, 60, n_out, 16, 24, 9, 0.4)
        out = submanifold.fused_conv(cuda_emulation.HostMemory(), features.astype(dtype), w, b,
                                     neighbors, relu=True)
        _assert_matches(out, numpy.maximum(_definition(features, weight, bias, neighbors), 0),
                        dtype)
        grids.append([grid for name, grid, *_ in launched if name.startswith("submanifold_")])
        launched.clear()
    assert grids == [[(5, 1, 1)], [(2, 1, 2)], [(1, 1, 3)], [(5, 1, 1)]]


@pytest.mark.parametrize("taps", [27, 40])
def test_tap_masks_equal_numpy(rng, launched, taps):
    """Bit k of row r's mask: the row has tap k, for the first 32 taps (bit 31 included)."""
    n = 300
    neighbors = rng.integers(0, 50, (taps, n)).astype(numpy.int32)
    neighbors[rng.random((taps, n)) < 0.6] = -1
    masks = submanifold.tap_masks(cuda_emulation.HostMemory(), neighbors)
    bits = (neighbors[:32] >= 0).astype(numpy.uint64) << numpy.arange(min(taps, 32),
                                                                       dtype=numpy.uint64)[:, None]
    numpy.testing.assert_array_equal(masks.view(numpy.uint32), bits.sum(0).astype(numpy.uint32))


@pytest.mark.parametrize("n", [0, 1, 700])
def test_ordered_map_equals_numpy(rng, launched, n):
    """Row 0 the permutation, rows 1.. the map's columns in its order, over a grid-stride loop
    of several rounds (700 rows, 2 CTAs); absent neighbours (-1) copied as they are."""
    taps = 27
    neighbors = rng.integers(0, 5000, (taps, n)).astype(numpy.int32)
    neighbors[rng.random((taps, n)) < 0.5] = -1
    order = rng.permutation(n).astype(numpy.int64)
    rows = conv_kernels.ordered_map(cuda_emulation.HostMemory(), neighbors, order)
    assert rows.dtype == numpy.int32 and rows.shape == (1 + taps, n)
    numpy.testing.assert_array_equal(rows, numpy.concatenate([order[None], neighbors[:, order]]))


def _random_order(rng, neighbors):
    """A random order of the map's output rows in Rulebook.fused_order's layout: int32 [1 + taps,
    n_out], the permutation, then the map's columns in it."""
    permutation = rng.permutation(neighbors.shape[1]).astype(numpy.int32)
    return numpy.concatenate([permutation[None], neighbors[:, permutation]])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("n_out, cin, cout", [(150, 16, 24), (70, 40, 130)])
def test_fused_in_an_order_equals_definition(rng, launched, dtype, n_out, cin, cout):
    """Tiles that take the output rows in a given order (Rulebook.fused_order's permutation,
    the map's columns in that order beside it) write each row where it belongs: split taps,
    bias and part tiles too."""
    features, weight, bias, neighbors = _random_layer(rng, 90, n_out, cin, cout, 9, 0.6)
    order = _random_order(rng, neighbors)
    f, w, b = (a.astype(dtype) for a in (features, weight, bias))
    out = submanifold.fused_conv(cuda_emulation.HostMemory(), f, w, b, neighbors, order)
    _assert_matches(out, _definition(features, weight, bias, neighbors), dtype)


@pytest.mark.parametrize("cin", [8, 24, 20])
@pytest.mark.parametrize("stage, tile, slots", sorted({config[1:] for config in
                                                       conv_kernels.FUSED_CONFIGS}))
def test_fused_every_configuration(rng, launched, monkeypatch, stage, tile, slots, cin):
    """Every stage, tile width and slot count the kernels are built for, whatever the rule would
    pick (float16: rows of one, several and a part of a 32-byte stage; odd rows through
    registers)."""
    if cin % 8 and stage == 128:
        pytest.skip("odd rows are staged 32 or 64 bytes at a time")
    monkeypatch.setattr(conv_kernels, "fused_config",
                        lambda vector, itemsize, cout: (stage, tile, slots))
    features, weight, _, neighbors = _random_layer(rng, 60, 70, cin, 40, 9, 0.5)
    features, weight = features.astype(numpy.float16), weight.astype(numpy.float16)
    out = submanifold.fused_conv(cuda_emulation.HostMemory(), features, weight, None, neighbors)
    _assert_matches(out, _definition(features, weight, None, neighbors), "float16")


@pytest.mark.parametrize("dtype, cin, cout, split", [
    ("float16", 8, 16, 1), ("float16", 24, 40, 4), ("float16", 16, 64, 1), ("float16", 32, 130, 1),
    ("float32", 8, 16, 1), ("float32", 24, 40, 1), ("float32", 16, 64, 4), ("float32", 8, 40, 4)])
def test_fused_tall_tiles(rng, launched, monkeypatch, dtype, cin, cout, split):
    """Tiles of 128 sites compute the definition wherever the plan has them (fused_tall forced):
    rows of one and several 16-byte vectors a stage, partial tiles of sites and channels, bias,
    absent neighbours; with the taps split over CTAs too (the rule takes tall tiles only where
    they fill the GPU unsplit; the kernel does not care). Layers without tall tiles (TF32 tiles of
    16 channels, 128-wide tiles) keep 64-site tiles."""
    monkeypatch.setattr(conv_kernels, "fused_tall",
                        lambda device, plan, n_out, sorted_rows: plan.tall is not None)
    monkeypatch.setattr(conv_kernels, "fused_splits", lambda device, tiles, taps: split)
    n_out = 300
    features, weight, bias, neighbors = _random_layer(rng, 150, n_out, cin, cout, 9, 0.6)
    out = submanifold.fused_conv(cuda_emulation.HostMemory(), features.astype(dtype),
                                 weight.astype(dtype), bias.astype(dtype), neighbors)
    tile = conv_kernels.fused_config(True, numpy.dtype(dtype).itemsize, cout)[1]
    tall = conv_kernels.tall_tiles(numpy.dtype(dtype).itemsize, tile)
    assert launched[0][0].endswith(", 2, 128>") == tall
    assert launched[0][1][0] == -(-n_out // (128 if tall else 64))
    _assert_matches(out, _definition(features, weight, bias, neighbors), dtype)


@pytest.mark.parametrize("dtype, cin, cout, split, ordered", [
    ("float16", 32, 128, 1, False), ("float16", 24, 256, 3, False), ("bfloat16", 8, 128, 1, False),
    ("float16", 32, 256, 1, True)])
def test_fused_tall_wide_tiles(rng, launched, monkeypatch, dtype, cin, cout, split, ordered):
    """Tall 128-wide tiles (128 sites x 128 channels, four warps of 64 x 64) compute the
    definition wherever the plan has them (fused_tall and fused_tall_wide forced): a partial
    last tile of sites, several channel tiles, split taps, bias, absent neighbours, output rows
    taken in a permuted order."""
    monkeypatch.setattr(conv_kernels, "fused_tall", lambda device, plan, n_out, sorted_rows: True)
    monkeypatch.setattr(conv_kernels, "fused_tall_wide", lambda plan, n_out, sorted_rows: True)
    monkeypatch.setattr(conv_kernels, "fused_splits", lambda device, tiles, taps: split)
    n_out, taps = 200, 9
    features, weight, bias, neighbors = _random_layer(rng, 150, n_out, cin, cout, taps, 0.6)
    order = _random_order(rng, neighbors) if ordered else None
    out = submanifold.fused_conv(cuda_emulation.HostMemory(), _bits(features, dtype),
                                 _bits(weight, dtype), _bits(bias, dtype), neighbors, order)
    ctype = {"float16": "half_t", "bfloat16": "bfloat16_t"}[dtype]
    assert launched[0][0] == f"submanifold_fused<{ctype}, true, 128, 128, 2, 128>"
    assert launched[0][1] == (-(-n_out // 128), cout // 128, -(-taps // -(-taps // split)))
    _assert_matches(out, _definition(features, weight, bias, neighbors), dtype)


@pytest.mark.parametrize("dtype, optin, cout, config, shared", [
    ("float32", cuda_emulation.SHARED_MEMORY_OPTIN, 96, (128, 96, 2), 2 * 160 * 144),
    ("float32", cuda_emulation.SHARED_MEMORY_OPTIN, 112, (128, 128, 2), 2 * 192 * 144),
    ("float32", 48 * 1024, 96, (64, 96), 0),
    ("float16", cuda_emulation.SHARED_MEMORY_OPTIN, 96, (128, 96, 2), 2 * 160 * 144),
    ("float16", cuda_emulation.SHARED_MEMORY_OPTIN, 112, (64, 128), 0)],
    ids=["tf32-dynamic-96", "tf32-dynamic-128", "tf32-static", "float16-dynamic-96",
         "float16-static-128"])
def test_wide_tiles_take_the_shared_memory_the_gpu_allows(rng, launched, monkeypatch, dtype,
                                                          optin, cout, config, shared):
    """96-wide tiles (96 output channels) in every dtype and 128-wide ones (112) in TF32 stage
    128 bytes a row through two slots of dynamic shared memory where a CTA may opt into them,
    and 64 bytes in static memory where it may not (a GPU of 48 KiB a CTA); 16-bit types'
    128-wide tiles stage 64 bytes in static memory. Each computes the definition."""
    info = launch.device_info(0)._replace(shared_per_block_optin=optin)
    monkeypatch.setattr(launch, "device_info", lambda device: info)
    conv_kernels._fused_plan.cache_clear()
    cin, taps = 16, 27
    features, weight, _, neighbors = _random_layer(rng, 50, 70, cin, cout, taps, 0.5)
    out = submanifold.fused_conv(cuda_emulation.HostMemory(), features.astype(dtype),
                                 weight.astype(dtype), None, neighbors)
    plan = conv_kernels._fused_plan(0, dtype, True, cin, cout, taps).conv
    assert plan.template_args[2:] == config and plan.shared_mem == shared
    assert launched[0][0] == plan.name and launched[0][-1] == shared
    _assert_matches(out, _definition(features, weight, None, neighbors), dtype)


@pytest.mark.parametrize("dtype, channels", [(numpy.float32, 5), (numpy.float16, 3),
                                             (numpy.float16, 16), (numpy.float64, 7)])
def test_gather_equals_numpy(rng, launched, dtype, channels):
    """The gemm algorithm's gather: row o of the output is the taps' neighbour rows side by
    side, zeros for absent ones; 16-, 8-, 4- and 2-byte words as the rows allow."""
    features = random_array(rng, (40, channels), dtype)
    neighbors = rng.integers(-1, 40, (9, 33)).astype(numpy.int32)
    out = submanifold.gather_rows(cuda_emulation.HostMemory(), features, neighbors)
    numpy.testing.assert_array_equal(out, submanifold.gather(features, neighbors))
