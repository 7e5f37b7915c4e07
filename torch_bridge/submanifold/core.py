"""spconv's SparseConvTensor and ConvAlgo (spconv.pytorch.core)."""

import enum
import math

import torch


class ConvAlgo(enum.Enum):
    """spconv's algorithm names, accepted as a module's ``algo`` and otherwise unused: the
    algorithm here is the module's ``sbnet_algo`` (see rulebook_conv)."""

    Native = 0
    MaskImplicitGemm = 1
    MaskSplitImplicitGemm = 2


class SparseConvTensor:
    """spconv's sparse tensor: features [N, C], indices int32 [N, 1 + D] (batch index first),
    spatial_shape (D ints), batch_size, and indice_dict, the rulebooks of the layers that
    produced it, by indice_key.

    grid, voxel_num, benchmark (and benchmark_record), force_algo, permanent_thrust_allocator
    and enable_timer are spconv's arguments, kept (the first four as attributes) for code that
    passes or reads them; no module here uses them. Setting ``indices`` marks them unchecked, so
    the next rulebook checks them again; changing them in place (``x.indices[:, 1:] *= 2``) does
    not, and the rulebooks in indice_dict then no longer describe them: make a new tensor for
    new sites.
    """

    def __init__(self, features, indices, spatial_shape, batch_size, grid=None, voxel_num=None,
                 indice_dict=None, benchmark=False, permanent_thrust_allocator=False,
                 enable_timer=False, force_algo=None):
        if not isinstance(features, torch.Tensor) or not isinstance(indices, torch.Tensor):
            raise TypeError(f"features and indices must be torch tensors, got "
                            f"{type(features).__name__} and {type(indices).__name__}")
        if features.ndim != 2 or indices.ndim != 2 or features.shape[0] != indices.shape[0]:
            raise ValueError(f"features [N, C] and indices [N, 1 + D] must have one row a site, "
                             f"got shapes {tuple(features.shape)} and {tuple(indices.shape)}")
        if indices.dtype != torch.int32:
            raise TypeError(f"indices must be int32, got {indices.dtype}")
        if features.device != indices.device:
            raise ValueError(f"features and indices must be on one device, got features on "
                             f"{features.device} and indices on {indices.device}")
        if indices.shape[1] != 1 + len(spatial_shape):
            raise ValueError(f"indices must be [N, {1 + len(spatial_shape)}] for spatial_shape "
                             f"{list(spatial_shape)}, got {tuple(indices.shape)}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        del permanent_thrust_allocator, enable_timer  # spconv's CUDA allocator and timer
        self._set(features, indices, spatial_shape, batch_size, indice_dict, False)
        self.grid = torch.Tensor() if grid is None else grid
        self.voxel_num = voxel_num
        self.benchmark = benchmark
        self.benchmark_record = {}
        self.force_algo = force_algo

    def _set(self, features, indices, spatial_shape, batch_size, indice_dict, checked):
        self.features = features
        # Row-major once (torch's nonzero() gives column-major sites): every rulebook reads them
        # so, and reuses a table only of this very tensor.
        self._indices = indices.contiguous()
        self.spatial_shape = [int(s) for s in spatial_shape]
        self.batch_size = int(batch_size)
        self.indice_dict = {} if indice_dict is None else indice_dict
        # Whether the indices are known distinct and inside the grid: a convolution's output
        # sites are, so its rulebooks skip the check (and its host sync).
        self.indices_checked = checked
        # Whether rows may be padding (batch index -1, as SparseGraphs' fixed-size tensors
        # have): rulebooks leave them out; dense() and the global pools drop them.
        self.padded = False

    @property
    def indices(self):
        return self._indices

    @indices.setter
    def indices(self, value):
        self._indices = value.contiguous()
        self.indices_checked = False

    @property
    def spatial_size(self):
        return math.prod(self.spatial_shape)

    @classmethod
    def from_dense(cls, x):
        """The sparse tensor of the non-zero sites of x [B, *spatial, C] (channels last, as
        spconv's from_dense), in row-major order."""
        active = (x != 0).any(dim=-1)
        indices = torch.nonzero(active).to(torch.int32)
        return cls(x[active], indices, list(x.shape[1:-1]), x.shape[0])

    def find_indice_pair(self, key):
        return None if key is None else self.indice_dict.get(key)

    def replace_feature(self, feature):
        """A tensor with these sites and rulebooks and new features [M, C']. M may differ from
        the number of sites, as spconv permits (VoxelNeXt sets new indices right after); a layer
        given such a tensor raises ValueError."""
        return self._with(feature, self._indices, self.spatial_shape, self.indice_dict,
                          self.indices_checked)

    def _with(self, features, indices, spatial_shape, indice_dict, checked):
        """A tensor like this one (batch, grid, voxel_num, benchmark) with these fields, rows
        unchecked against the features'."""
        out = object.__new__(SparseConvTensor)
        out._set(features, indices, spatial_shape, self.batch_size, indice_dict, checked)
        out.padded = self.padded
        out.grid, out.voxel_num, out.benchmark = self.grid, self.voxel_num, self.benchmark
        out.benchmark_record, out.force_algo = self.benchmark_record, self.force_algo
        return out

    def shadow_copy(self):
        return self.replace_feature(self.features)

    def select_by_index(self, valid_indices):
        """A tensor of the rows valid_indices selects (indices or a bool mask), with no
        rulebooks (they describe the old sites)."""
        out = self._with(self.features[valid_indices], self._indices[valid_indices],
                         self.spatial_shape, {}, False)
        return out

    def minus(self):
        return self.replace_feature(-self.features)

    def __add__(self, other):
        """Features added (another SparseConvTensor's or a tensor), on this tensor's sites: the
        operands must list the same sites in the same order (spconv's x + y)."""
        if isinstance(other, SparseConvTensor):
            other = other.features
        elif not isinstance(other, torch.Tensor):
            return NotImplemented
        if other.shape != self.features.shape:
            raise ValueError(f"x + y needs features of one shape (the same sites), got "
                             f"{tuple(self.features.shape)} and {tuple(other.shape)}")
        return self.replace_feature(self.features + other)

    __radd__ = __add__

    def check_rows(self):
        """ValueError unless features has one row a site (a layer's input must)."""
        if self.features.ndim != 2 or self.features.shape[0] != self._indices.shape[0]:
            raise ValueError(f"the tensor has {self._indices.shape[0]} sites and features of "
                             f"shape {tuple(self.features.shape)}: set indices to match after "
                             f"replace_feature with another row count")

    def batch_slots(self):
        """(int64 [N] batch index of each row, number of slots): with padding rows, these go to
        one more slot, batch_size, which the caller drops; without, the indices' own."""
        batch = self._indices[:, 0].long()
        if not self.padded:
            return batch, self.batch_size
        return batch.masked_fill(batch < 0, self.batch_size), self.batch_size + 1

    def dense(self, channels_first=True):
        """The dense tensor [B, C, *spatial] (channels last with channels_first=False), zeros
        at inactive sites; differentiable in the features."""
        self.check_rows()
        channels = self.features.shape[1]
        batch, slots = self.batch_slots()
        out = self.features.new_zeros((slots, *self.spatial_shape, channels))
        # A padding row's coordinates (-1) index its slot's last site.
        sites = (batch, *self._indices[:, 1:].long().t())
        out = out.index_put(sites, self.features)[:self.batch_size]
        if not channels_first:
            return out
        return out.permute(0, out.ndim - 1, *range(1, out.ndim - 1)).contiguous()

    def __repr__(self):
        return (f"SparseConvTensor(features={tuple(self.features.shape)}, "
                f"spatial_shape={self.spatial_shape}, batch_size={self.batch_size}, "
                f"indice_keys={sorted(map(str, self.indice_dict))})")
