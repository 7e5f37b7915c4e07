"""spconv's utilities: spconv.pytorch.utils' PointToVoxel (torch_bridge.point_to_voxel, imported
when first asked for) and gather_features_by_pc_voxel_id, and spconv.utils' CPU voxel generators
Point2VoxelCPU1d-4d on NumPy arrays (sbnet_cupy.point_to_voxel's NumPy backend gives the
definition)."""

import importlib
import math
import numbers

import numpy
import torch

from sbnet_cupy.point_to_voxel import (CTYPES, VoxelGrid, check_points, point_to_voxel_numpy,
                                       positive_int, voxel_grid)


def __getattr__(name):
    if name != "PointToVoxel":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module("torch_bridge.point_to_voxel")
    except ModuleNotFoundError as error:
        if error.name != "torch_bridge.point_to_voxel":
            raise
        raise ImportError("PointToVoxel needs torch_bridge.point_to_voxel, which this "
                          "installation lacks") from error
    return module.PointToVoxel


def gather_features_by_pc_voxel_id(seg_res_features, pc_voxel_id, invalid_value=0):
    """Per point, the features [V, ...] of its voxel (pc_voxel_id [P], -1: none, which gets
    invalid_value): [P, ...] on the features' device."""
    pc_voxel_id = pc_voxel_id.to(seg_res_features.device)
    out = seg_res_features.new_full((pc_voxel_id.shape[0], *seg_res_features.shape[1:]),
                                    invalid_value)
    valid = pc_voxel_id >= 0
    out[valid] = seg_res_features[pc_voxel_id[valid].long()]
    return out


# --- spconv.utils' CPU voxel generators -----------------------------------------------------

class HostTensor:
    """A NumPy array behind the accessors of cumm.tensorview.Tensor that code written for
    spconv's CPU voxel generators calls on their results: numpy() (a copy, safe to keep),
    numpy_view() (the array itself: a view of the generator's buffers, which its next call
    overwrites, as spconv's), shape (a list). numpy.asarray() takes it too."""

    def __init__(self, array):
        self._array = array

    def numpy(self):
        return self._array.copy()

    def numpy_view(self):
        return self._array

    @property
    def shape(self):
        return list(self._array.shape)

    def __array__(self, dtype=None, copy=None):
        return numpy.array(self._array, dtype=dtype, copy=copy)

    def __repr__(self):
        return f"HostTensor({self._array!r})"


def _host_array(name, value):
    """The NumPy array of a point cloud: an array, or anything with numpy() (a
    cumm.tensorview.Tensor, a torch CPU tensor, a HostTensor)."""
    if isinstance(value, numpy.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            raise TypeError(f"{name} must be on the CPU (Point2VoxelCPU; PointToVoxel takes "
                            f"CUDA tensors), got a tensor on {value.device}")
        return value.detach().numpy()
    to_numpy = getattr(value, "numpy_view", None) or getattr(value, "numpy", None)
    if to_numpy is None:
        raise TypeError(f"{name} must be a NumPy array or have .numpy() (a "
                        f"cumm.tensorview.Tensor or a torch CPU tensor), got "
                        f"{type(value).__name__}")
    return numpy.asarray(to_numpy())


def _output_array(name, value, shape, dtypes):
    """A buffer the static calls fill in place: a NumPy array, a torch CPU tensor or a
    cumm.tensorview.Tensor (their NumPy views), C-contiguous, of `shape` (None: any size there)
    and one of `dtypes`."""
    if isinstance(value, numpy.ndarray):
        array = value
    elif isinstance(value, torch.Tensor) and not value.is_cuda:
        array = value.detach().numpy()
    elif hasattr(value, "numpy_view"):
        array = value.numpy_view()
    else:
        raise TypeError(f"{name} must be a NumPy array, a torch CPU tensor or a "
                        f"cumm.tensorview.Tensor (filled in place), got {type(value).__name__}")
    if (array.dtype.name not in dtypes or array.ndim != len(shape) or not array.flags.c_contiguous
            or any(want is not None and got != want for got, want in zip(array.shape, shape))):
        want = " x ".join("?" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must be a C-contiguous {' or '.join(dtypes)} array of shape "
                         f"{want}, got {array.dtype} {array.shape}")
    return array


def _floats(name, value, count):
    try:
        values = [float(numpy.float32(v)) for v in value]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a sequence of {count} numbers, got {value!r}") from None
    if len(values) != count or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be {count} finite numbers, got {value!r}")
    return values


def _voxelize(points, voxels, indices, num_per_voxel, points_voxel_id, grid, clear_voxels,
              empty_mean):
    """Fills the buffers, spconv's way: num_per_voxel zeroed, voxels too if clear_voxels, then
    the first V rows of each written; returns HostTensors of those rows."""
    num_per_voxel[:] = 0
    if clear_voxels:
        voxels[:] = 0
    out, coords, num_points, ids = point_to_voxel_numpy(
        points, grid, voxels.shape[0], voxels.shape[1], empty_mean, voxels)
    count = coords.shape[0]
    indices[:count] = coords
    num_per_voxel[:count] = num_points
    if points_voxel_id is not None:
        points_voxel_id[:] = ids
    return HostTensor(out), HostTensor(indices[:count]), HostTensor(num_per_voxel[:count])


class _Point2VoxelCPU:
    """spconv.utils' Point2VoxelCPU{ndim}d: voxels of point clouds on the CPU, kept in buffers
    between calls, as spconv's (see Point2VoxelCPU3d)."""

    NDIM = None

    def __init__(self, vsize_xyz, coors_range_xyz, num_point_features, max_num_voxels,
                 max_num_points_per_voxel):
        self._grid = self._grid_of(vsize_xyz, coors_range_xyz)
        self._features = positive_int("num_point_features", num_point_features)
        if self._features < self.NDIM:
            raise ValueError(f"num_point_features must be at least {self.NDIM} (the "
                             f"coordinates), got {num_point_features}")
        max_voxels = positive_int("max_num_voxels", max_num_voxels)
        max_points = positive_int("max_num_points_per_voxel", max_num_points_per_voxel)
        self._voxels = numpy.zeros((max_voxels, max_points, self._features), numpy.float32)
        self._indices = numpy.zeros((max_voxels, self.NDIM), numpy.int32)
        self._num_per_voxel = numpy.zeros(max_voxels, numpy.int32)

    @classmethod
    def _grid_of(cls, vsize_xyz, coors_range_xyz):
        count = len(vsize_xyz) if hasattr(vsize_xyz, "__len__") else None
        if count is not None and count != cls.NDIM:
            raise ValueError(f"vsize_xyz must have {cls.NDIM} sizes for {cls.__name__}, got "
                             f"{vsize_xyz!r}")
        return voxel_grid(vsize_xyz, coors_range_xyz)

    @classmethod
    def calc_meta_data(cls, vsize_xyz, coors_range_xyz):
        """(vsize, grid_size, grid_stride, coors_range) of the grid, z first, as spconv's:
        the sizes, the cells along each axis, their row-major strides, the minima then the
        maxima."""
        grid = cls._grid_of(vsize_xyz, coors_range_xyz)
        bounds = _floats("coors_range_xyz", coors_range_xyz, 2 * cls.NDIM)
        strides = [math.prod(grid.shape[d + 1:]) for d in range(cls.NDIM)]
        return (list(grid.vsize), list(grid.shape), strides,
                bounds[:cls.NDIM][::-1] + bounds[cls.NDIM:][::-1])

    @property
    def grid_size(self):
        """Cells along each axis, z first."""
        return list(self._grid.shape)

    @property
    def voxels(self):
        """The voxel buffer: float32 [max_num_voxels, max_num_points_per_voxel,
        num_point_features]."""
        return HostTensor(self._voxels)

    @property
    def indices(self):
        """The coordinate buffer: int32 [max_num_voxels, ndim], z first."""
        return HostTensor(self._indices)

    @property
    def num_per_voxel(self):
        """The point-count buffer: int32 [max_num_voxels]."""
        return HostTensor(self._num_per_voxel)

    def point_to_voxel(self, points, clear_voxels=True):
        """Voxels of the point cloud `points` [N, num_point_features] (a NumPy array or anything
        with .numpy(): cumm.tensorview.Tensor, torch CPU tensor; float32, float64 or float16),
        x, y, z... first.

        Returns (voxels float32 [V, max_num_points_per_voxel, num_point_features], coordinates
        int32 [V, ndim] z first, num_points_per_voxel int32 [V]): HostTensors of the buffers'
        first V rows (numpy() copies them). Places past a voxel's points are zero, or with
        clear_voxels=False what earlier calls left there."""
        return self._call(points, clear_voxels, False)

    def point_to_voxel_empty_mean(self, points, clear_voxels=True):
        """point_to_voxel, with the places past each voxel's points filled with the mean of
        its points (spconv's CPU build starts each sum from the previous voxel's mean; ours
        from zero, as its CUDA build)."""
        return self._call(points, clear_voxels, True)

    def _call(self, points, clear_voxels, empty_mean):
        points = _host_array("points", points)
        check_points(points, self.NDIM, self._features)
        return _voxelize(points, self._voxels, self._indices, self._num_per_voxel, None,
                         self._grid, clear_voxels, empty_mean)

    @classmethod
    def point_to_voxel_static(cls, points, voxels, indices, num_per_voxel, densehashdata,
                              points_voxel_id, vsize, grid_size, grid_stride, coors_range,
                              clear_voxels=True):
        """point_to_voxel into the caller's buffers, which it fills in place (NumPy arrays,
        torch CPU tensors or cumm.tensorview.Tensors): voxels [M, P, F] (M voxels of P
        points at most; float32, float64 or float16), indices int32 [M, ndim],
        num_per_voxel int32 [M] and points_voxel_id int64 [N] (each point's voxel, -1: none).
        vsize, grid_size, grid_stride and coors_range are calc_meta_data's (z first).
        densehashdata, spconv's lookup table (left as it was found), is not used. Returns
        HostTensors of the first V rows of voxels, indices and num_per_voxel."""
        return cls._static(points, voxels, indices, num_per_voxel, densehashdata,
                           points_voxel_id, vsize, grid_size, grid_stride, coors_range,
                           clear_voxels, False)

    @classmethod
    def point_to_voxel_empty_mean_static(cls, points, voxels, indices, num_per_voxel,
                                         densehashdata, points_voxel_id, vsize, grid_size,
                                         grid_stride, coors_range, clear_voxels=True):
        """point_to_voxel_static with point_to_voxel_empty_mean's means."""
        return cls._static(points, voxels, indices, num_per_voxel, densehashdata,
                           points_voxel_id, vsize, grid_size, grid_stride, coors_range,
                           clear_voxels, True)

    @classmethod
    def _static(cls, points, voxels, indices, num_per_voxel, densehashdata, points_voxel_id,
                vsize, grid_size, grid_stride, coors_range, clear_voxels, empty_mean):
        ndim = cls.NDIM
        grid = cls._static_grid(vsize, grid_size, grid_stride, coors_range)
        points = _host_array("points", points)
        check_points(points, ndim)
        voxels = _output_array("voxels", voxels, (None, None, points.shape[1]), tuple(CTYPES))
        count = voxels.shape[0]
        indices = _output_array("indices", indices, (count, ndim), ("int32",))
        num_per_voxel = _output_array("num_per_voxel", num_per_voxel, (count,), ("int32",))
        points_voxel_id = _output_array("points_voxel_id", points_voxel_id,
                                        (points.shape[0],), ("int64",))
        return _voxelize(points, voxels, indices, num_per_voxel, points_voxel_id, grid,
                         clear_voxels, empty_mean)

    @classmethod
    def _static_grid(cls, vsize, grid_size, grid_stride, coors_range):
        """The VoxelGrid of calc_meta_data's lists (checked)."""
        ndim = cls.NDIM
        sizes = _floats("vsize", vsize, ndim)
        if not all(v > 0 for v in sizes):
            raise ValueError(f"vsize must be positive, got {vsize!r}")
        cells = list(grid_size) if hasattr(grid_size, "__len__") else None
        if (cells is None or len(cells) != ndim
                or not all(isinstance(c, numbers.Integral) and 0 < c < 2**31 for c in cells)):
            raise ValueError(f"grid_size must be {ndim} ints from 1 to 2**31 - 1, got "
                             f"{grid_size!r}")
        strides = [math.prod(cells[d + 1:]) for d in range(ndim)]
        if list(grid_stride) != strides:
            raise ValueError(f"grid_stride must be the row-major strides of grid_size, "
                             f"{strides}, got {grid_stride!r}")
        lower = _floats("coors_range", coors_range, 2 * ndim)[:ndim]
        return VoxelGrid(tuple(sizes), tuple(lower), tuple(int(c) for c in cells))

    def __repr__(self):
        return (f"{type(self).__name__}(grid_size={self.grid_size}, "
                f"num_point_features={self._features}, "
                f"max_num_voxels={self._voxels.shape[0]}, "
                f"max_num_points_per_voxel={self._voxels.shape[1]})")


class Point2VoxelCPU1d(_Point2VoxelCPU):
    """spconv.utils.Point2VoxelCPU1d: Point2VoxelCPU3d on one axis (x)."""

    NDIM = 1


class Point2VoxelCPU2d(_Point2VoxelCPU):
    """spconv.utils.Point2VoxelCPU2d: Point2VoxelCPU3d on two axes (x, y)."""

    NDIM = 2


class Point2VoxelCPU3d(_Point2VoxelCPU):
    """spconv.utils.Point2VoxelCPU3d, which OpenPCDet's data processor uses: voxels of point
    clouds on the CPU with spconv's constructor, calls and results (sbnet_cupy.point_to_voxel
    gives the definition; ours matches spconv's CPU build bit for bit).

    Point2VoxelCPU3d(vsize_xyz, coors_range_xyz, num_point_features, max_num_voxels,
    max_num_points_per_voxel): voxel sizes (x first) and the range (minima, then maxima).
    The buffers (voxels float32, indices, num_per_voxel) are kept between calls, as
    spconv's; point_to_voxel returns HostTensors of their first rows (call numpy() to keep
    them past the next call, as with spconv's cumm tensors)."""

    NDIM = 3


class Point2VoxelCPU4d(_Point2VoxelCPU):
    """spconv.utils.Point2VoxelCPU4d: Point2VoxelCPU3d on four axes."""

    NDIM = 4
