"""point_to_voxel (sbnet_cupy) and PointToVoxel (torch_bridge) against a loop over the points
written from the definition, against spconv's CPU build, and kernels/point_to_voxel.cu on the
CPU (tests/cuda_emulation) and on a GPU."""

import math
import sys

import numpy
import pytest

import cuda_emulation
from conftest import HAS_GPU, requires_gpu, to_numpy
import sbnet_cupy.point_to_voxel  # noqa: F401 (the package's point_to_voxel is the function)

p2v = sys.modules["sbnet_cupy.point_to_voxel"]

VSIZE, RANGE = (0.4, 0.5, 1.0), (0.0, -2.0, -1.0, 8.0, 6.0, 3.0)


def reference(points, vsize_xyz, range_xyz, max_voxels, max_points, empty_mean=False):
    """The definition, one point at a time: a point's cell along each axis is floor((p - min)
    / vsize) in float32 (float64 for float64 points); grid round((max - min) / vsize), halves
    away from zero; voxels in first-appearance order, the first max_voxels kept, each holding
    its first max_points points; coordinates z first."""
    ndim = len(vsize_xyz)
    real = numpy.float64 if points.dtype == numpy.float64 else numpy.float32
    size = [numpy.float32(v) for v in vsize_xyz]
    low = [numpy.float32(v) for v in range_xyz[:ndim]]
    high = [numpy.float32(v) for v in range_xyz[ndim:]]
    shape = [math.floor(float((h - lo) / s) + 0.5) for s, lo, h in zip(size, low, high)]
    voxel_of, members, ids = {}, [], []
    with numpy.errstate(invalid="ignore", over="ignore"):
        for i, point in enumerate(points):
            cell = [numpy.floor((real(point[a]) - real(low[a])) / real(size[a]))
                    for a in range(ndim)]
            if not all(0 <= c < n for c, n in zip(cell, shape)):
                ids.append(-1)
                continue
            key = tuple(int(c) for c in reversed(cell))
            if key not in voxel_of:
                if len(voxel_of) == max_voxels:
                    ids.append(-1)
                    continue
                voxel_of[key] = len(members)
                members.append([])
            ids.append(voxel_of[key])
            if len(members[voxel_of[key]]) < max_points:
                members[voxel_of[key]].append(i)
    voxels = numpy.zeros((len(members), max_points, points.shape[1]), points.dtype)
    acc = numpy.float64 if points.dtype == numpy.float64 else numpy.float32
    for v, held in enumerate(members):
        voxels[v, :len(held)] = points[held]
        if empty_mean:
            total = numpy.zeros(points.shape[1], acc)
            for i in held:
                total = (total + points[i].astype(acc)).astype(acc)
            voxels[v, len(held):] = (total / acc(len(held))).astype(points.dtype)
    coords = numpy.array(list(voxel_of), numpy.int32).reshape(-1, ndim)
    return (voxels, coords, numpy.array([len(m) for m in members], numpy.int32),
            numpy.array(ids, numpy.int64))


def cloud(rng, n, features=4, dtype=numpy.float32, vsize=VSIZE, bounds=RANGE, spread=0.15,
          clusters=8):
    """n points: a third around a few centres (voxels with more points than the caps), the
    rest uniform over the range and 15% beyond it; some exactly on cell boundaries, on the
    range's minima and maxima, and a few NaN and infinite."""
    ndim = len(vsize)
    low, high = numpy.array(bounds[:ndim]), numpy.array(bounds[ndim:])
    width = high - low
    xyz = rng.uniform(low - spread * width, high + spread * width, (n, ndim))
    centres = rng.uniform(low, high, (clusters, ndim))
    dense = n // 3
    xyz[:dense] = centres[rng.integers(0, clusters, dense)] + rng.normal(0, 0.1, (dense, ndim))
    on_boundary = rng.random(n) < 0.1
    cells = numpy.floor((xyz - low) / numpy.array(vsize))
    xyz[on_boundary] = (low + cells * numpy.array(vsize))[on_boundary]
    points = rng.normal(0, 1, (n, features))
    points[:, :ndim] = xyz
    if n >= 8:
        points[0, 0], points[1, :ndim] = low[0], high
        points[2, 1 % ndim], points[3, 0], points[4, ndim - 1] = numpy.nan, numpy.inf, -numpy.inf
    return rng.permutation(points).astype(dtype)


def _host(a):
    """A NumPy array of a NumPy or CuPy array or a torch tensor."""
    return a.cpu().numpy() if hasattr(a, "is_cuda") else to_numpy(a)


def assert_same(result, expected, *, held_only=False):
    voxels, coords, num_points, ids = (_host(a) for a in result)
    ev, ec, en, ei = expected
    numpy.testing.assert_array_equal(coords, ec)
    numpy.testing.assert_array_equal(num_points, en)
    numpy.testing.assert_array_equal(ids, ei)
    assert (voxels.dtype, coords.dtype, num_points.dtype, ids.dtype) == (
        ev.dtype, numpy.int32, numpy.int32, numpy.int64)
    if held_only:  # spconv's CPU empty_mean: only the points agree (see test_matches_spconv)
        held = numpy.arange(voxels.shape[1]) < num_points[:, None]
        voxels, ev = voxels[held], ev[held]
    numpy.testing.assert_array_equal(voxels.view(numpy.uint8), ev.view(numpy.uint8))


# name: points, features, dtype, vsize_xyz, coors_range_xyz, max_num_voxels, max_points
CASES = {
    "kitti-like": (600, 4, numpy.float32, VSIZE, RANGE, 1000, 5),
    "voxels-capped": (600, 4, numpy.float32, VSIZE, RANGE, 40, 3),
    "one-point-a-voxel": (300, 5, numpy.float32, VSIZE, RANGE, 1000, 1),
    "one-voxel": (200, 3, numpy.float32, VSIZE, RANGE, 1, 7),
    "odd-features-float64": (400, 7, numpy.float64, (0.3, 0.7, 0.9), RANGE, 500, 4),
    "float16": (300, 4, numpy.float16, (0.5, 0.5, 0.5), RANGE, 500, 6),
    "2-d": (300, 3, numpy.float32, (0.25, 0.75), (-1.0, -1.0, 2.0, 1.5), 100, 4),
    "1-d": (200, 1, numpy.float32, (0.1,), (-1.0, 1.0), 100, 3),
    "4-d": (300, 4, numpy.float32, (0.5, 0.5, 1.0, 1.0), (0, 0, 0, 0, 2, 2, 3, 2), 100, 2),
    "empty": (0, 4, numpy.float32, VSIZE, RANGE, 10, 5),
}


def _case(rng, name):
    n, features, dtype, vsize, bounds, max_voxels, max_points = CASES[name]
    return cloud(rng, n, features, dtype, vsize, bounds), (vsize, bounds, max_voxels,
                                                           max_points)


@pytest.mark.parametrize("empty_mean", [False, True], ids=["zeros", "mean"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(xp, rng, name, empty_mean):
    points, args = _case(rng, name)
    result = p2v.point_to_voxel(xp.asarray(points), *args, empty_mean=empty_mean)
    assert_same(result, reference(points, *args, empty_mean=empty_mean))


def test_subnormal_and_signed_zero_coordinates(xp):
    """Coordinates a subnormal float away from the grid's minimum 0: a negative one is outside
    (float32 arithmetic keeps subnormals, which the GPU's -ftz=true would flush), -0 and a
    positive one inside."""
    points = numpy.array([[-1e-40, 0.5], [1e-40, 0.5], [-0.0, 0.5], [-1e-45, 0.5],
                          [0.5, -1e-39]], numpy.float32)
    args = ((1.0, 1.0), (0.0, 0.0, 2.0, 2.0), 10, 4)
    result = p2v.point_to_voxel(xp.asarray(points), *args)
    assert to_numpy(result[3]).tolist() == [-1, 0, 0, -1, -1]
    assert_same(result, reference(points, *args))


def crowded(rng, n=400):
    """n points in 3 voxels (and a few outside): buckets of ~130 points for 16 places."""
    points = rng.uniform(0.01, 0.39, (n, 4)).astype(numpy.float32)
    points[:, 0] += rng.integers(0, 3, n) * 0.4
    points[::50, 2] = 9.0
    return points


def test_crowded_voxels_and_all_outside(xp, rng):
    """Voxels of many more points than places (their first 16 kept, in point order), and a
    cloud wholly outside the range (no voxels)."""
    args = (VSIZE, RANGE, 10, 16)
    points = crowded(rng)
    assert_same(p2v.point_to_voxel(xp.asarray(points), *args, empty_mean=True),
                reference(points, *args, empty_mean=True))
    points[:, 2] = -5.0
    voxels, coords, num_points, ids = p2v.point_to_voxel(xp.asarray(points), *args)
    assert voxels.shape == (0, 16, 4) and coords.shape == (0, 3) and num_points.shape == (0,)
    assert (to_numpy(ids) == -1).all()


def test_voxels_buffer_keeps_places_past_the_points(xp, rng):
    """voxels=: spconv's clear_voxels=False, the buffer's rows filled in place."""
    points, (vsize, bounds, _, max_points) = _case(rng, "kitti-like")
    buffer = numpy.full((200, max_points, 4), 7.0, numpy.float32)
    expected = reference(points, vsize, bounds, 200, max_points)
    device_buffer = xp.asarray(buffer)
    voxels = p2v.point_to_voxel(xp.asarray(points), vsize, bounds, 200, max_points,
                                voxels=device_buffer)[0]
    held = numpy.arange(max_points) < expected[2][:, None]
    want = numpy.where(held[..., None], expected[0], 7.0)
    numpy.testing.assert_array_equal(to_numpy(voxels), want)
    numpy.testing.assert_array_equal(to_numpy(device_buffer)[len(want):], 7.0)


def test_grid_rounds_halves_away_from_zero():
    grid = p2v.voxel_grid((0.4, 1.0, 0.3), (0.0, 0.0, 0.0, 1.0, 2.5, 0.3))
    assert grid.shape == (1, 3, 3)  # z, y, x: 0.3 / 0.3, 2.5 / 1 -> 3, 1 / 0.4 -> 3
    assert grid.vsize == (numpy.float32(0.3), 1.0, numpy.float32(0.4))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(vsize_xyz=(0.1, 0.0, 0.1)), ValueError, "vsize_xyz must be positive"),
    (dict(vsize_xyz=(0.1, 0.1)), ValueError, r"coors_range_xyz must have 4 values"),
    (dict(vsize_xyz=()), ValueError, "vsize_xyz must have 1 to 4 sizes"),
    (dict(vsize_xyz="abc"), TypeError, "must be sequences of numbers"),
    (dict(coors_range_xyz=(0, 0, 0, 1, 0, 1)), ValueError, r"minima below their maxima.*axis 1"),
    (dict(coors_range_xyz=(0, 0, 0, 0.01, 1, 1)), ValueError, "give 0 cells along axis 0"),
    (dict(max_num_voxels=0), ValueError, "max_num_voxels must be 1 to"),
    (dict(max_num_points_per_voxel=2.5), TypeError, "max_num_points_per_voxel must be an int"),
    (dict(points=numpy.zeros((4, 2), numpy.float32)), ValueError,
     "points need at least 3 features"),
    (dict(points=numpy.zeros(4, numpy.float32)), ValueError,
     r"points must be \[N, F\], got shape \(4,\)"),
    (dict(points=numpy.zeros((4, 3), numpy.int32)), TypeError, "points must be float16"),
    (dict(points=[[0.0, 0.0, 0.0]]), TypeError, "points must be a numpy.ndarray or cupy"),
    (dict(voxels=numpy.zeros((2, 5, 3), numpy.float32)), ValueError,
     r"voxels must be a C-contiguous float32 array of shape \(10, 5, 3\)"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(points=numpy.zeros((4, 3), numpy.float32), vsize_xyz=(0.1, 0.1, 0.1),
                coors_range_xyz=(0, 0, 0, 1, 1, 1), max_num_voxels=10,
                max_num_points_per_voxel=5)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        p2v.point_to_voxel(**args)


# --- spconv's CPU build ---------------------------------------------------------------------

@pytest.mark.parametrize("empty_mean", [False, True], ids=["zeros", "mean"])
@pytest.mark.parametrize("name", sorted(set(CASES) - {"float16"}))
def test_matches_spconv(rng, name, empty_mean):
    """Bit for bit, through torch_bridge's PointToVoxel, as its users call it. With empty_mean
    only the points agree: spconv's CPU build starts each voxel's sum from the mean of the
    voxel before (a bug; its CUDA build and ours fill each voxel's own mean)."""
    torch = pytest.importorskip("torch")
    spconv_utils = pytest.importorskip("spconv.pytorch.utils")
    from torch_bridge.point_to_voxel import PointToVoxel

    points, (vsize, bounds, max_voxels, max_points) = _case(rng, name)
    kwargs = dict(vsize_xyz=list(vsize), coors_range_xyz=list(bounds),
                  num_point_features=points.shape[1], max_num_voxels=max_voxels,
                  max_num_points_per_voxel=max_points)
    theirs = spconv_utils.PointToVoxel(**kwargs)
    ours = PointToVoxel(**kwargs)
    for attribute in ("vsize", "grid_size", "grid_stride", "coors_range"):
        assert getattr(ours, attribute) == list(getattr(theirs, attribute)), attribute
    pc = torch.from_numpy(points)
    expected = [t.numpy() for t in theirs.generate_voxel_with_id(pc, empty_mean=empty_mean)]
    result = list(ours.generate_voxel_with_id(pc, empty_mean=empty_mean))
    if points.dtype == numpy.float64:  # float32 voxels from spconv (its buffer's dtype)
        assert result[0].dtype == torch.float64
        result[0] = result[0].float()
    assert_same(result, expected, held_only=empty_mean)


def test_clear_voxels_false_matches_spconv(rng):
    """clear_voxels=False keeps what earlier calls left past each voxel's points, in spconv's
    buffer and ours."""
    torch = pytest.importorskip("torch")
    spconv_utils = pytest.importorskip("spconv.pytorch.utils")
    from torch_bridge.point_to_voxel import PointToVoxel

    kwargs = dict(vsize_xyz=list(VSIZE), coors_range_xyz=list(RANGE), num_point_features=4,
                  max_num_voxels=60, max_num_points_per_voxel=4)
    theirs, ours = spconv_utils.PointToVoxel(**kwargs), PointToVoxel(**kwargs)
    for clear in (False, True, False, False):
        pc = torch.from_numpy(cloud(rng, 300))
        expected = [t.numpy() for t in theirs.generate_voxel_with_id(pc, clear_voxels=clear)]
        assert_same(ours.generate_voxel_with_id(pc, clear_voxels=clear), expected)
        assert_same(ours(pc, clear_voxels=clear) + (expected[3],), expected)


def test_torch_point_to_voxel_checks():
    torch = pytest.importorskip("torch")
    from torch_bridge.point_to_voxel import PointToVoxel

    voxelize = PointToVoxel([0.1] * 3, [0, 0, 0, 1, 1, 1], 4, 10, 5)
    with pytest.raises(ValueError, match=r"points must be \[N, 4\]"):
        voxelize(torch.zeros(3, 5))
    with pytest.raises(TypeError, match="pc must be a torch.Tensor"):
        voxelize(numpy.zeros((3, 4), numpy.float32))
    with pytest.raises(ValueError, match="num_point_features must be at least 3"):
        PointToVoxel([0.1] * 3, [0, 0, 0, 1, 1, 1], 2, 10, 5)
    if HAS_GPU:
        with pytest.raises(ValueError, match="pc is on cuda:0, this PointToVoxel on cpu"):
            voxelize(torch.zeros(3, 4, device="cuda"))


# --- kernels/point_to_voxel.cu on the CPU -----------------------------------------------------

@pytest.fixture(scope="module")
def kernels(emulation_dir):
    if not cuda_emulation.available():
        pytest.skip("needs g++")
    return cuda_emulation.build("point_to_voxel", dict.fromkeys(p2v.instantiations(),
                                                               "P2VArgs"),
                                emulation_dir)


def _emulated(points, args, empty_mean, voxels=None):
    grid = p2v.voxel_grid(args[0], args[1])
    points = numpy.ascontiguousarray(points)

    def new_voxels(count):
        return (numpy.zeros((count, args[3], points.shape[1]), points.dtype) if voxels is None
                else voxels[:count])

    # The backend's arrays are poisoned: the kernels must write or clear what they read.
    return p2v.voxelize(cuda_emulation.HostMemory(), points, grid, args[2], args[3], empty_mean,
                        new_voxels)


@pytest.fixture
def emulated(monkeypatch, kernels):
    """Launches go to the emulated kernels; grid-stride loops over 2 CTAs at most. The plans
    made for them are dropped after the test."""
    monkeypatch.setattr(p2v, "_MAX_BLOCKS", 2)
    p2v._plan.cache_clear()
    cuda_emulation.install(monkeypatch, kernels, sms=2)
    yield
    p2v._plan.cache_clear()


@pytest.mark.emulated
@pytest.mark.parametrize("name", ["kitti-like", "voxels-capped", "odd-features-float64",
                                  "float16", "2-d", "4-d", "empty"])
def test_emulated_kernels_match_reference(rng, emulated, name):
    """The kernels (hash table, first points, ranks, buckets, selection, gather) on the CPU,
    with empty_mean on for the float cases: the same bits as the definition."""
    points, args = _case(rng, name)
    assert_same(_emulated(points, args, name != "kitti-like"),
                reference(points, *args, empty_mean=name != "kitti-like"))


@pytest.mark.emulated
def test_emulated_kernels_long_cloud(rng, emulated):
    """140k points: p2v_rank's threads take more than one uint4 of bits each (1024 threads,
    128 points a uint4), the grid-stride loops many rounds; against the NumPy backend."""
    points = cloud(rng, 140_000, 4, vsize=(0.1, 0.1, 0.2), clusters=50)
    args = ((0.1, 0.1, 0.2), RANGE, 5000, 4)
    assert_same(_emulated(points, args, True),
                p2v.point_to_voxel(points, *args, empty_mean=True))


@pytest.mark.emulated
def test_emulated_kernels_crowded_and_all_outside(rng, emulated):
    args = (VSIZE, RANGE, 10, 16)
    points = crowded(rng)
    assert_same(_emulated(points, args, True), reference(points, *args, empty_mean=True))
    points[:, 2] = -5.0
    assert_same(_emulated(points, args, False), reference(points, *args))


@pytest.mark.emulated
def test_emulated_kernels_subnormals_and_buffer(emulated):
    points = numpy.array([[-1e-40, 0.5], [1e-40, 0.5], [-0.0, 0.5], [-1e-45, 0.5],
                          [0.5, -1e-39], [1.5, 1.5]], numpy.float32)
    args = ((1.0, 1.0), (0.0, 0.0, 2.0, 2.0), 10, 3)
    buffer = numpy.full((10, 3, 2), -5.0, numpy.float32)
    voxels, *rest = _emulated(points, args, False, buffer)
    expected = reference(points, *args)
    assert rest[2].tolist() == [-1, 0, 0, -1, -1, 1]
    assert_same((numpy.where(voxels == -5.0, 0, voxels), *rest), expected)


# --- CUDA -------------------------------------------------------------------------------------

@pytest.mark.parametrize("xp", [pytest.param("cupy", marks=requires_gpu)], indirect=True)
def test_gpu_deterministic_and_large(xp, rng):
    """120k points (a LiDAR sweep's order of magnitude) into 20k voxels at most: the same
    bits run after run, and as the NumPy backend."""
    points = cloud(rng, 120_000, 4, vsize=(0.05, 0.05, 0.1), bounds=RANGE, clusters=200)
    args = ((0.05, 0.05, 0.1), RANGE, 20_000, 5)
    expected = p2v.point_to_voxel(points, *args, empty_mean=True)
    for _ in range(3):
        assert_same(p2v.point_to_voxel(xp.asarray(points), *args, empty_mean=True), expected)


@requires_gpu
@pytest.mark.parametrize("name", ["kitti-like", "voxels-capped", "float16",
                                  "odd-features-float64"])
def test_torch_cuda_matches_cpu(rng, name):
    torch = pytest.importorskip("torch")
    from torch_bridge.point_to_voxel import PointToVoxel

    points, (vsize, bounds, max_voxels, max_points) = _case(rng, name)
    kwargs = dict(vsize_xyz=vsize, coors_range_xyz=bounds, num_point_features=points.shape[1],
                  max_num_voxels=max_voxels, max_num_points_per_voxel=max_points)
    on_cpu, on_gpu = PointToVoxel(**kwargs), PointToVoxel(**kwargs, device="cuda")
    for clear, empty_mean in ((True, True), (False, False), (True, False)):
        pc = torch.from_numpy(points)
        expected = [t.numpy() for t in on_cpu.generate_voxel_with_id(pc, clear, empty_mean)]
        result = on_gpu.generate_voxel_with_id(pc.cuda(), clear, empty_mean)
        assert all(t.is_cuda for t in result)
        assert_same(result, expected)
        points = cloud(rng, points.shape[0], points.shape[1], points.dtype, vsize, bounds)
