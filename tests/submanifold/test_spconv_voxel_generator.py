"""torch_bridge.submanifold.utils' Point2VoxelCPU1d-4d (spconv.utils' CPU voxel generators):
against the definition (test_point_to_voxel's loop over the points) and against spconv's CPU
build, called as OpenPCDet's data processor and spconv's examples call them; bad arguments."""

import numpy
import pytest

from test_point_to_voxel import RANGE, VSIZE, cloud, reference

pytest.importorskip("torch")
import torch  # noqa: E402

from torch_bridge.submanifold import utils  # noqa: E402

CLASSES = {1: utils.Point2VoxelCPU1d, 2: utils.Point2VoxelCPU2d, 3: utils.Point2VoxelCPU3d,
           4: utils.Point2VoxelCPU4d}

# name: points, features, dtype, vsize_xyz, coors_range_xyz, max_num_voxels, max_points
CASES = {
    "kitti-like": (600, 4, numpy.float32, VSIZE, RANGE, 1000, 5),
    "voxels-capped": (600, 4, numpy.float32, VSIZE, RANGE, 40, 3),
    "points-capped": (400, 5, numpy.float32, (2.0, 2.0, 1.0), RANGE, 1000, 2),
    "float64": (400, 7, numpy.float64, (0.3, 0.7, 0.9), RANGE, 500, 4),
    "1-d": (200, 1, numpy.float32, (0.1,), (-1.0, 1.0), 100, 3),
    "2-d": (300, 3, numpy.float32, (0.25, 0.75), (-1.0, -1.0, 2.0, 1.5), 100, 4),
    "4-d": (300, 4, numpy.float32, (0.5, 0.5, 1.0, 1.0), (0, 0, 0, 0, 2, 2, 3, 2), 100, 2),
    "empty": (0, 4, numpy.float32, VSIZE, RANGE, 10, 5),
}


def _case(rng, name):
    n, features, dtype, vsize, bounds, max_voxels, max_points = CASES[name]
    points = cloud(rng, n, features, dtype, vsize, bounds)  # 15% out of range, NaN, inf
    kwargs = dict(vsize_xyz=list(vsize), coors_range_xyz=list(bounds),
                  num_point_features=features, max_num_voxels=max_voxels,
                  max_num_points_per_voxel=max_points)
    return points, kwargs


def _expected(points, kwargs, empty_mean=False):
    """The definition's voxels (float32, the generators' buffer), coordinates and counts."""
    voxels, coords, num_points, _ = reference(
        points, kwargs["vsize_xyz"], kwargs["coors_range_xyz"], kwargs["max_num_voxels"],
        kwargs["max_num_points_per_voxel"], empty_mean)
    return voxels.astype(numpy.float32), coords, num_points


def _same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        numpy.testing.assert_array_equal(g.view(numpy.uint8), w.view(numpy.uint8))


@pytest.mark.parametrize("empty_mean", [False, True], ids=["zeros", "mean"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(rng, name, empty_mean):
    """Points out of range (NaN and infinite ones too), voxels of more points than the cap,
    more voxels than the cap, empty clouds; the results' numpy() against the definition."""
    points, kwargs = _case(rng, name)
    generator = CLASSES[len(kwargs["vsize_xyz"])](**kwargs)
    call = generator.point_to_voxel_empty_mean if empty_mean else generator.point_to_voxel
    result = [t.numpy() for t in call(points)]
    expected = _expected(points, kwargs, empty_mean and points.dtype == numpy.float32)
    if empty_mean and points.dtype != numpy.float32:  # means in float32, the definition's in
        held = numpy.arange(result[0].shape[1]) < expected[2][:, None]  # float64: the points
        result[0], expected = result[0][held], (expected[0][held], *expected[1:])
    _same(result, expected)
    assert (result[1].dtype, result[2].dtype) == (numpy.int32, numpy.int32)


def test_results_alias_the_buffers_and_numpy_copies(rng):
    """As spconv's cumm tensors: numpy_view() is the buffer, which the next call overwrites;
    numpy() a copy, which stays (OpenPCDet keeps it); the buffers are the properties."""
    points, kwargs = _case(rng, "kitti-like")
    generator = utils.Point2VoxelCPU3d(**kwargs)
    voxels, coords, num_points = generator.point_to_voxel(points)
    kept, view = coords.numpy(), coords.numpy_view()
    assert numpy.shares_memory(view, generator.indices.numpy_view())
    assert not numpy.shares_memory(kept, view)
    assert voxels.shape == [len(kept), kwargs["max_num_points_per_voxel"], 4]
    assert generator.voxels.shape == [1000, 5, 4] and generator.num_per_voxel.shape == [1000]
    first = _expected(points, kwargs)
    generator.point_to_voxel(points[::-1].copy())
    numpy.testing.assert_array_equal(kept, first[1])
    assert not numpy.array_equal(view, first[1])  # the buffer holds the second cloud's
    numpy.testing.assert_array_equal(numpy.asarray(num_points), generator.num_per_voxel
                                     .numpy()[:len(kept)])


def test_inputs_with_numpy(rng):
    """Point clouds as NumPy arrays (non-contiguous too), torch CPU tensors, HostTensors and
    anything else with numpy(): the same voxels."""
    points, kwargs = _case(rng, "voxels-capped")
    generator = utils.Point2VoxelCPU3d(**kwargs)
    expected = _expected(points, kwargs)
    wide = numpy.concatenate([points, points[:, :2]], axis=1)

    class Tensor:  # a cumm.tensorview.Tensor's numpy(), without cumm
        def numpy(self):
            return points.copy()

    for pc in (points, wide[:, :4], torch.from_numpy(points), utils.HostTensor(points),
               Tensor()):
        _same([t.numpy() for t in generator.point_to_voxel(pc)], expected)


def test_clear_voxels_false_keeps_earlier_values(rng):
    """clear_voxels=False: places past each voxel's points keep what earlier calls left."""
    points, kwargs = _case(rng, "kitti-like")
    generator = utils.Point2VoxelCPU3d(**kwargs)
    generator.point_to_voxel_empty_mean(points)
    before = generator.voxels.numpy()
    other = cloud(rng, 500)
    voxels, _, num_points = (t.numpy() for t in generator.point_to_voxel(other, False))
    want = _expected(other, kwargs)
    held = numpy.arange(voxels.shape[1]) < num_points[:, None]
    numpy.testing.assert_array_equal(voxels[held], want[0][held])
    numpy.testing.assert_array_equal(voxels[~held], before[:len(voxels)][~held])


@pytest.mark.parametrize("empty_mean", [False, True], ids=["zeros", "mean"])
def test_static_fills_the_callers_buffers(rng, empty_mean):
    """point_to_voxel_static(_empty_mean) into NumPy and torch buffers, with each point's voxel
    in points_voxel_id; calc_meta_data's grid."""
    points, kwargs = _case(rng, "voxels-capped")
    cls = utils.Point2VoxelCPU3d
    vsize, grid_size, grid_stride, coors_range = cls.calc_meta_data(
        kwargs["vsize_xyz"], kwargs["coors_range_xyz"])
    assert grid_size == cls(**kwargs).grid_size == [4, 16, 20]
    assert grid_stride == [320, 20, 1] and coors_range == [-1.0, -2.0, 0.0, 3.0, 6.0, 8.0]
    voxels = numpy.full((40, 3, 4), 7.0, numpy.float32)
    indices, num_per_voxel = torch.full((40, 3), -9, dtype=torch.int32), numpy.ones(40, "int32")
    ids = numpy.full(points.shape[0], 5, numpy.int64)
    static = cls.point_to_voxel_empty_mean_static if empty_mean else cls.point_to_voxel_static
    out = static(points, voxels, indices, num_per_voxel, None, ids, vsize, grid_size,
                 grid_stride, coors_range)
    want_voxels, want_coords, want_counts, want_ids = reference(
        points, kwargs["vsize_xyz"], kwargs["coors_range_xyz"], 40, 3, empty_mean)
    _same([t.numpy() for t in out], (want_voxels, want_coords, want_counts))
    numpy.testing.assert_array_equal(ids, want_ids)
    numpy.testing.assert_array_equal(indices.numpy()[:len(want_coords)], want_coords)
    numpy.testing.assert_array_equal(voxels[len(want_voxels):], 0)  # cleared
    static(points[:0], voxels, indices, num_per_voxel, None, ids[:0], vsize, grid_size,
           grid_stride, coors_range, clear_voxels=False)
    assert not num_per_voxel.any() and (voxels[:len(want_voxels)] == want_voxels).all()


# --- spconv's CPU build ---------------------------------------------------------------------

@pytest.fixture
def spconv_utils():
    pytest.importorskip("cumm.tensorview")
    return pytest.importorskip("spconv.utils")


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_spconv(rng, spconv_utils, name):
    """As OpenPCDet's data processor calls it (point_to_voxel(tv.from_numpy(points)), then
    numpy() of each result), several clouds in a row with and without clear_voxels: the same
    bits, and the same buffers after each call."""
    from cumm import tensorview as tv

    points, kwargs = _case(rng, name)
    ndim = len(kwargs["vsize_xyz"])
    theirs = getattr(spconv_utils, f"Point2VoxelCPU{ndim}d")(**kwargs)
    ours = CLASSES[ndim](**kwargs)
    assert ours.grid_size == list(theirs.grid_size)
    assert ours.calc_meta_data(kwargs["vsize_xyz"], kwargs["coors_range_xyz"]) == (
        theirs.calc_meta_data(kwargs["vsize_xyz"], kwargs["coors_range_xyz"]))
    for clear in (True, False, True):
        want = [t.numpy() for t in theirs.point_to_voxel(tv.from_numpy(points), clear)]
        _same([t.numpy() for t in ours.point_to_voxel(tv.from_numpy(points), clear)], want)
        for buffer in ("voxels", "indices", "num_per_voxel"):
            _same([getattr(ours, buffer).numpy()], [getattr(theirs, buffer).numpy()])
        n, features, dtype, vsize, bounds, *_ = CASES[name]
        points = cloud(rng, n, features, dtype, vsize, bounds)


def test_empty_mean_and_static_match_spconv(rng, spconv_utils):
    """point_to_voxel_empty_mean: the points and the first voxel's mean as spconv's (its later
    voxels' sums start from the mean before: a bug); point_to_voxel_static: the same buffers
    and points_voxel_id."""
    from cumm import tensorview as tv

    points, kwargs = _case(rng, "voxels-capped")
    theirs, ours = spconv_utils.Point2VoxelCPU3d(**kwargs), utils.Point2VoxelCPU3d(**kwargs)
    want = [t.numpy() for t in theirs.point_to_voxel_empty_mean(tv.from_numpy(points))]
    got = [t.numpy() for t in ours.point_to_voxel_empty_mean(points)]
    held = numpy.arange(3) < want[2][:, None]
    _same(got[1:], want[1:])
    _same([got[0][held], got[0][0]], [want[0][held], want[0][0]])
    meta = ours.calc_meta_data(kwargs["vsize_xyz"], kwargs["coors_range_xyz"])
    buffers = [numpy.full((40, 3, 4), 3.0, numpy.float32), numpy.zeros((40, 3), numpy.int32),
               numpy.zeros(40, numpy.int32), numpy.full(meta[1], -1, numpy.int32),
               numpy.zeros(len(points), numpy.int64)]
    copies = [b.copy() for b in buffers]
    want = theirs.point_to_voxel_static(tv.from_numpy(points), *map(tv.from_numpy, buffers),
                                        *meta, False)
    got = ours.point_to_voxel_static(points, *copies, *meta, False)
    _same([t.numpy() for t in got], [t.numpy() for t in want])
    _same(copies, buffers)


# --- bad arguments --------------------------------------------------------------------------

GOOD = dict(vsize_xyz=[0.1, 0.1, 0.1], coors_range_xyz=[0, 0, 0, 1, 1, 1],
            num_point_features=4, max_num_voxels=10, max_num_points_per_voxel=5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(vsize_xyz=[0.1, 0.1]), ValueError, "vsize_xyz must have 3 sizes for Point2VoxelCPU3d"),
    (dict(vsize_xyz=[0.1, -0.1, 0.1]), ValueError, "vsize_xyz must be positive"),
    (dict(vsize_xyz=0.1), TypeError, "vsize_xyz and coors_range_xyz must be sequences"),
    (dict(coors_range_xyz=[0, 0, 0, 1, 1]), ValueError, "coors_range_xyz must have 6 values"),
    (dict(coors_range_xyz=[0, 0, 1, 1, 1, 1]), ValueError, "minima below their maxima"),
    (dict(num_point_features=2), ValueError, "num_point_features must be at least 3"),
    (dict(num_point_features=4.0), TypeError, "num_point_features must be an int"),
    (dict(max_num_voxels=0), ValueError, "max_num_voxels must be 1 to"),
    (dict(max_num_points_per_voxel=None), TypeError, "max_num_points_per_voxel must be an int"),
])
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        utils.Point2VoxelCPU3d(**{**GOOD, **kwargs})


def test_bad_points_and_buffers():
    generator = utils.Point2VoxelCPU3d(**GOOD)
    with pytest.raises(ValueError, match=r"points must be \[N, 4\] \(num_point_features\)"):
        generator.point_to_voxel(numpy.zeros((3, 5), numpy.float32))
    with pytest.raises(TypeError, match="points must be float16, float32 or float64"):
        generator.point_to_voxel(numpy.zeros((3, 4), numpy.int32))
    with pytest.raises(TypeError, match="points must be a NumPy array or have .numpy()"):
        generator.point_to_voxel([[0.0] * 4])
    points = numpy.zeros((3, 4), numpy.float32)
    meta = generator.calc_meta_data(GOOD["vsize_xyz"], GOOD["coors_range_xyz"])
    buffers = dict(voxels=numpy.zeros((10, 5, 4), numpy.float32),
                   indices=numpy.zeros((10, 3), numpy.int32),
                   num_per_voxel=numpy.zeros(10, numpy.int32), densehashdata=None,
                   points_voxel_id=numpy.zeros(3, numpy.int64))
    for name, bad, match in [
            ("voxels", numpy.zeros((10, 5, 3), numpy.float32), r"voxels must be a C-contiguous "
             r"float16 or float32 or float64 array of shape \? x \? x 4"),
            ("voxels", numpy.zeros((10, 4, 5), numpy.float32).transpose(0, 2, 1),
             "voxels must be a C-contiguous"),
            ("indices", numpy.zeros((10, 3), numpy.int64), "indices must be .* int32 .* 10 x 3"),
            ("num_per_voxel", numpy.zeros(9, numpy.int32), "num_per_voxel must be .* of shape 10"),
            ("points_voxel_id", numpy.zeros(4, numpy.int64), "points_voxel_id must .* shape 3"),
            ("indices", [[0, 0, 0]] * 10, "indices must be a NumPy array, a torch CPU tensor")]:
        with pytest.raises((ValueError, TypeError), match=match):
            generator.point_to_voxel_static(points, **{**buffers, name: bad}, vsize=meta[0],
                                            grid_size=meta[1], grid_stride=meta[2],
                                            coors_range=meta[3])
    for index, bad, match in [(0, [0.1, 0.1], "vsize must be 3 finite numbers"),
                              (0, [0.1, 0.0, 0.1], "vsize must be positive"),
                              (1, [10, 10], "grid_size must be 3 ints"),
                              (2, [1, 10, 100], r"grid_stride must be .* \[100, 10, 1\]"),
                              (3, [0, 0, 0, 1, 1, "a"], "coors_range must be a sequence")]:
        args = list(meta)
        args[index] = bad
        with pytest.raises((ValueError, TypeError), match=match):
            generator.point_to_voxel_static(points, *buffers.values(), *args)
