"""spconv 2.x's PointToVoxel (spconv.pytorch.utils) on torch tensors: the same constructor,
calls and results as spconv's CPU build (sbnet_cupy.point_to_voxel gives the definition), on
the CPU through the NumPy backend (zero-copy views) and on CUDA through the kernels of
kernels/point_to_voxel.cu, launched on torch's current stream. Not differentiable (spconv's
is not either)."""

import math

import numpy
import torch

from sbnet_cupy.point_to_voxel import (check_points, point_to_voxel_numpy, positive_int,
                                       voxel_grid, voxelize)

from .backend import TORCH


class PointToVoxel:
    """Voxelizes point clouds [N, num_point_features] (x, y, z... first) on `device`.

    As spconv's, it keeps a voxel buffer [max_num_voxels, max_num_points_per_voxel,
    num_point_features] between calls: clear_voxels=False leaves the places past each voxel's
    points as earlier calls left them. The buffer has the points' dtype (float32 at first; a
    call with float16 or float64 points starts a zeroed one of that dtype).

    Attributes (spconv's, z first): vsize, grid_size, grid_stride, coors_range, and ndim,
    num_point_features, max_num_voxels, max_num_points_per_voxel, device, voxels (the buffer).
    """

    def __init__(self, vsize_xyz, coors_range_xyz, num_point_features, max_num_voxels,
                 max_num_points_per_voxel, device=torch.device("cpu:0")):
        self._grid = voxel_grid(vsize_xyz, coors_range_xyz)
        self.ndim = len(self._grid.shape)
        self.num_point_features = positive_int("num_point_features", num_point_features)
        if self.num_point_features < self.ndim:
            raise ValueError(f"num_point_features must be at least {self.ndim} (the "
                             f"coordinates), got {num_point_features}")
        self.max_num_voxels = positive_int("max_num_voxels", max_num_voxels)
        self.max_num_points_per_voxel = positive_int("max_num_points_per_voxel",
                                                           max_num_points_per_voxel)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # spconv's buffers go to the current device: its docs say to construct after
            # setting it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.vsize = list(self._grid.vsize)
        self.grid_size = list(self._grid.shape)
        self.grid_stride = [math.prod(self.grid_size[d + 1:]) for d in range(self.ndim)]
        bounds = [float(numpy.float32(v)) for v in coors_range_xyz]
        self.coors_range = bounds[:self.ndim][::-1] + bounds[self.ndim:][::-1]
        self.voxels = self._new_buffer(torch.float32)

    def _new_buffer(self, dtype):
        return torch.zeros((self.max_num_voxels, self.max_num_points_per_voxel,
                            self.num_point_features), dtype=dtype, device=self.device)

    def __call__(self, pc, clear_voxels=True, empty_mean=False):
        """(voxels, coordinates, num_points_per_voxel): generate_voxel_with_id without the
        point-to-voxel ids, as spconv's."""
        return self.generate_voxel_with_id(pc, clear_voxels, empty_mean)[:3]

    def generate_voxel_with_id(self, pc, clear_voxels=True, empty_mean=False):
        """Voxels of the point cloud pc [N, num_point_features] (float16, float32 or float64,
        on this PointToVoxel's device).

        Returns voxels [V, max_num_points_per_voxel, num_point_features] of pc's dtype,
        coordinates int32 [V, ndim] (z first), num_points_per_voxel int32 [V] and pc_voxel_id
        int64 [N] (-1: in no voxel); empty_mean fills the places past a voxel's points with
        their mean, clear_voxels zeroes the buffer first."""
        if not isinstance(pc, torch.Tensor):
            raise TypeError(f"pc must be a torch.Tensor, got {type(pc).__name__}")
        if pc.device.type != self.device.type or (pc.is_cuda
                                                  and pc.device.index != self.device.index):
            raise ValueError(f"pc is on {pc.device}, this PointToVoxel on {self.device}")
        check_points(pc, self.ndim, self.num_point_features)
        with torch.no_grad():
            pc = pc.detach().contiguous()
            if self.voxels.dtype != pc.dtype:
                self.voxels = self._new_buffer(pc.dtype)
            elif clear_voxels:
                self.voxels.zero_()
            if pc.is_cuda:
                voxels, coords, num_points, ids = self._cuda(pc, bool(empty_mean))
            else:
                voxels, coords, num_points, ids = (torch.from_numpy(a) for a in
                                                   point_to_voxel_numpy(
                    pc.numpy(), self._grid, self.max_num_voxels,
                    self.max_num_points_per_voxel, bool(empty_mean), self.voxels.numpy()))
            return voxels.clone(), coords, num_points, ids  # voxels: rows of the buffer

    def _cuda(self, pc, empty_mean):
        buffer = self.voxels
        return voxelize(TORCH, pc, self._grid, self.max_num_voxels,
                        self.max_num_points_per_voxel, empty_mean, lambda count: buffer[:count])

    def __repr__(self):
        return (f"PointToVoxel(vsize_xyz={self.vsize[::-1]}, grid_size={self.grid_size[::-1]}, "
                f"num_point_features={self.num_point_features}, "
                f"max_num_voxels={self.max_num_voxels}, "
                f"max_num_points_per_voxel={self.max_num_points_per_voxel}, "
                f"device={self.device})")

