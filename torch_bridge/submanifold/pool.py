"""spconv's pooling modules (spconv.pytorch.pool): SparseMaxPool1d-4d, SparseAvgPool1d-3d and the
global pools, with torch ops through the convolutions' rulebooks (CPU and CUDA alike, no kernel
of their own).

An output site pools the input sites its kernel window reaches; absent neighbours are skipped,
as spconv's GPU algorithms do: the max is over the sites present (spconv's Native algorithm,
which its CPU build runs, starts from zero instead, so there a window of negative features
gives 0), the average divides by their count (spconv's "real point count"). The output sites
and their order are those of the strided convolution of the same geometry (build_rulebook)."""

import torch

from .conv import _check_algo, _ints
from .core import SparseConvTensor
from .modules import SparseModule
from .rulebook import build_rulebook


def _pooled(features, neighbors, mean):
    """[N_out, C]: per output site, the max (or mean) of the rows neighbors [K, N_out] lists
    (-1: absent), a tap at a time (one [N_out, C] gather each, differentiable)."""
    n_in, channels = features.shape
    fill = 0 if mean else float("-inf")
    padded = torch.cat([features, features.new_full((1, channels), fill)])
    rows = torch.where(neighbors < 0, n_in, neighbors).long()
    out = padded.index_select(0, rows[0])
    for k in range(1, rows.shape[0]):
        tap = padded.index_select(0, rows[k])
        out = out + tap if mean else torch.maximum(out, tap)
    if not mean:
        return out
    count = (neighbors >= 0).sum(0).clamp_(min=1)
    return out / count.to(out.dtype)[:, None]


class _Pool(SparseModule):
    """A max (mean=False) or average pool of ndim spatial axes over kernel_size windows: strided
    (stride None: kernel_size) or submanifold (subm=True: the output has the input's sites). An
    indice_key stores the rulebook for an inverse convolution to undo, as spconv's."""

    mean = False

    def __init__(self, ndim, kernel_size=3, stride=1, padding=0, dilation=1, indice_key=None,
                 subm=False, algo=None, record_voxel_count=False, name=None):
        super().__init__(name=name)
        _check_algo(algo)
        self.ndim = ndim
        self.kernel_size = _ints("kernel_size", kernel_size, ndim, 1)
        self.stride = (list(self.kernel_size) if stride is None
                       else _ints("stride", stride, ndim, 1))
        self.padding = _ints("padding", padding, ndim, 0)
        self.dilation = _ints("dilation", dilation, ndim, 1)
        self.indice_key, self.subm, self.algo = indice_key, subm, algo
        self.record_voxel_count = record_voxel_count and not subm
        if self.record_voxel_count:
            self.register_buffer("max_num_voxels_during_training",
                                 torch.zeros(1, dtype=torch.int32))

    def forward(self, input):
        if not isinstance(input, SparseConvTensor):
            raise TypeError(f"input must be a SparseConvTensor, got {type(input).__name__}")
        input.check_rows()
        indice_dict = dict(input.indice_dict)
        if self.indice_key is not None and self.indice_key in indice_dict:
            raise ValueError(f"indice_key {self.indice_key!r} exists in this tensor: a pool "
                             f"stores a new rulebook under its key")
        rulebook = build_rulebook(input.indices, input.spatial_shape, input.batch_size,
                                  self.kernel_size, self.stride, self.padding, self.dilation,
                                  self.subm, check=not input.indices_checked,
                                  reuse=input.indice_dict.values())
        if self.indice_key is not None:
            indice_dict[self.indice_key] = rulebook
        y = _pooled(input.features, rulebook.neighbors, self.mean)
        if self.record_voxel_count:
            self.max_num_voxels_during_training.clamp_(min=rulebook.out_indices.shape[0])
        return input._with(y, rulebook.out_indices, rulebook.out_shape, indice_dict, True)

    def extra_repr(self):
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, subm={self.subm}")


class SparseMaxPool(_Pool):
    """spconv's SparseMaxPool: (ndim, kernel_size=3, stride=1, padding=0, dilation=1,
    indice_key=None, subm=False, algo=None, record_voxel_count=False, name=None)."""


class SparseAvgPool(_Pool):
    """spconv's SparseAvgPool: the mean over the sites present in each window (arguments as
    SparseMaxPool's)."""

    mean = True


class _PoolNd:
    """The signature of spconv's pools of a fixed dimension (_NDIM spatial axes), mixed into
    SparseMaxPool and SparseAvgPool: stride None is kernel_size."""

    _NDIM = None

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, indice_key=None,
                 algo=None, record_voxel_count=False, name=None):
        super().__init__(self._NDIM, kernel_size, stride, padding, dilation,
                         indice_key=indice_key, algo=algo,
                         record_voxel_count=record_voxel_count, name=name)


class SparseMaxPool1d(_PoolNd, SparseMaxPool):
    _NDIM = 1


class SparseMaxPool2d(_PoolNd, SparseMaxPool):
    _NDIM = 2


class SparseMaxPool3d(_PoolNd, SparseMaxPool):
    _NDIM = 3


class SparseMaxPool4d(_PoolNd, SparseMaxPool):
    _NDIM = 4


class SparseAvgPool1d(_PoolNd, SparseAvgPool):
    _NDIM = 1


class SparseAvgPool2d(_PoolNd, SparseAvgPool):
    _NDIM = 2


class SparseAvgPool3d(_PoolNd, SparseAvgPool):
    _NDIM = 3


class _GlobalPool(SparseModule):
    """Per batch item, the max (or mean) of its sites' features: a dense [batch_size, C]
    tensor. An item with no sites gives zeros."""

    mean = False

    def forward(self, input):
        if not isinstance(input, SparseConvTensor):
            raise TypeError(f"input must be a SparseConvTensor, got {type(input).__name__}")
        input.check_rows()
        features = input.features
        batch, slots = input.batch_slots()
        out = features.new_zeros((slots, features.shape[1]))
        return out.scatter_reduce(0, batch[:, None].expand_as(features), features,
                                  "mean" if self.mean else "amax",
                                  include_self=False)[:input.batch_size]


class SparseGlobalMaxPool(_GlobalPool):
    """spconv's SparseGlobalMaxPool: [batch_size, C], each item's channel-wise max."""

    def __init__(self, name=None):
        super().__init__(name=name)


class SparseGlobalAvgPool(_GlobalPool):
    """spconv's SparseGlobalAvgPool: [batch_size, C], each item's channel-wise mean (spconv
    2.3.8's keeps the first channel's alone, [batch_size])."""

    mean = True

    def __init__(self, name=None):
        super().__init__(name=name)
