"""Sparse tensors (SparseTensorData) and their rulebooks (Rulebook): submanifold_rulebook and
strided_rulebook build them with the NumPy backend (numpy_rulebook) for NumPy arrays and the CUDA
kernels (cuda_rulebook) for CuPy arrays; see the package's docstring for the maps."""

import math
from collections import namedtuple

import numpy

from ..core import checks as _checks
from ..core.backend import CUPY
from . import cuda_rulebook as _cuda, numpy_rulebook as _numpy
from .conv_kernels import ordered_map, tap_masks
from .validation import MAX_DIMS, check_grid, rulebook_geometry


SparseTensorData = namedtuple("SparseTensorData",
                              ["features", "coords", "spatial_shape", "batch_size"])
SparseTensorData.__doc__ = """A sparse tensor: features [N, C] of the N active sites at int32
coords [N, 1 + D] (batch index first), in a grid of batch_size x spatial_shape (D ints)."""


class Rulebook:
    """The kernel map of one convolution between two active sets (see the module's docstring).

    Attributes:
        neighbors: int32 [K, N_out], the input row tap k of output site o reads (-1: none).
        neighbors_t: int32 [K, N_in], the output row input site i feeds through tap k (-1).
        in_coords, out_coords: int32 [N_in, 1 + D] and [N_out, 1 + D] (out_coords is
            in_coords for a submanifold rulebook).
        in_shape, out_shape: the spatial shapes (D ints); batch_size.
        kernel_size, stride, padding, dilation: D ints each (padding of a submanifold
            rulebook is kernel // 2 * dilation).
        subm: whether output sites are the input sites.
        inverted: whether this is inverse() of a strided rulebook (outputs are its inputs).
        tap_pairs: the NumPy backend's pairs of `neighbors`, a tap at a time: (output rows,
            input rows) int64 arrays, or None for a tap where each output site reads its own
            row; None elsewhere. A CPU caller multiplies through them (torch_bridge).

    The spatial shapes and the geometry are tuples here and lists in torch_bridge's subclass.
    """

    def __init__(self, neighbors, neighbors_t, in_coords, out_coords, in_shape, out_shape,
                 batch_size, kernel_size, stride, padding, dilation, subm, inverted=False):
        self.neighbors, self.neighbors_t = neighbors, neighbors_t
        self.in_coords, self.out_coords = in_coords, out_coords
        self.in_shape, self.out_shape, self.batch_size = in_shape, out_shape, batch_size
        self.kernel_size, self.stride = kernel_size, stride
        self.padding, self.dilation = padding, dilation
        self.subm, self.inverted = subm, inverted
        # Device tables (_Table) of in_coords and out_coords that a later rulebook on the same
        # sites may reuse; torch_bridge's build_rulebook sets them, sbnet_cupy's keep none.
        self._tables = (None, None)
        # Whether torch_bridge's build_rulebook checked the input sites, so that a build that
        # must check may share this rulebook (its _same_rulebook).
        self._checked = False
        self.tap_pairs = None
        # (map, order) of neighbors and of neighbors_t once fused_order computed them.
        self._orders = (None, None)

    @property
    def num_taps(self):
        return math.prod(self.kernel_size)

    def inverse(self):
        """The rulebook of the inverse convolution (of this rulebook's class): outputs and
        inputs swapped, maps and tables included; the same taps."""
        inverse = type(self)(self.neighbors_t, self.neighbors, self.out_coords, self.in_coords,
                             self.out_shape, self.in_shape, self.batch_size, self.kernel_size,
                             self.stride, self.padding, self.dilation, self.subm,
                             not self.inverted)
        inverse._tables = self._tables[::-1]
        inverse._orders = self._orders[::-1]
        return inverse

    def fused_order(self, transposed=False):
        """The fused kernel's order of the output rows of `neighbors` (of `neighbors_t` if
        transposed), int32 [1 + taps, n] on the map's device: row 0 the rows sorted by their
        neighbour masks (the taps they have), so that a tile's rows have much the same taps and
        the kernel skips the others; rows 1.. the map's columns in that order, which tiles then
        read coalesced. Computed on first use, kept while the map is the same object. Where
        neighbors_t is neighbors with its taps reversed (submanifold, odd kernel), one order is
        the other with its map rows reversed: rows of one mask stay together, with no sort."""
        neighbors = self.neighbors_t if transposed else self.neighbors
        cached, other = self._orders[transposed], self._orders[not transposed]
        if cached is None or cached[0] is not neighbors:
            if self._mirrored() and other is not None and other[0] is (
                    self.neighbors if transposed else self.neighbors_t):
                cached = (neighbors, self._mirrored_rows(other[1]))
            else:
                cached = (neighbors, self._sorted_rows(neighbors))
            self._orders = ((self._orders[0], cached) if transposed
                            else (cached, self._orders[1]))
        return cached[1]

    def _mirrored(self):
        """Whether neighbors_t is neighbors with its taps reversed: a submanifold rulebook of an
        odd kernel, whose tap K-1-k is tap k backwards."""
        return self.subm and all(k % 2 for k in self.kernel_size)

    @staticmethod
    def _mirrored_rows(rows):
        """fused_order's rows with the map's rows (1..) reversed, on the device (no index array
        from the host: a CUDA graph may be capturing)."""
        xp = _checks.array_module(rows=rows)
        return xp.concatenate((rows[:1], rows[:0:-1]))

    @staticmethod
    def _sorted_rows(neighbors):
        """fused_order of a CuPy map: argsort of its rows' tap_masks (stable: rows of one mask
        keep their order, which the rulebooks give sites of one neighbourhood), and the map's
        columns in that order."""
        import cupy

        with cupy.cuda.Device(neighbors.data.device_id):
            return ordered_map(CUPY, neighbors, cupy.argsort(tap_masks(CUPY, neighbors)))

    def __repr__(self):
        kind = "submanifold" if self.subm else "inverse" if self.inverted else "strided"
        return (f"Rulebook({kind}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, "
                f"sites {self.in_coords.shape[0]} -> {self.out_coords.shape[0]}, "
                f"shape {self.in_shape} -> {self.out_shape})")


# --- sparse tensors -----------------------------------------------------------------------

def from_dense(x):
    """The sparse tensor of the sites of x [B, *spatial, C] (channels last) where some channel
    is non-zero, in row-major order."""
    xp = _checks.array_module(x=x)
    if x.ndim < 3:
        raise ValueError(f"x must be [B, *spatial, C] with 1 to {MAX_DIMS} spatial axes, got "
                         f"shape {x.shape}")
    with _checks.on_device(x):
        return from_mask(xp.any(x != 0, axis=-1), x)


def from_mask(mask, x):
    """The sparse tensor of the sites of x [B, *spatial, C] where mask [B, *spatial] (bool) is
    true, in row-major order: features x[mask], coords the mask's true positions."""
    xp = _checks.array_module(mask=mask, x=x)
    if mask.dtype != bool or mask.shape != x.shape[:-1] or not 2 <= mask.ndim <= 1 + MAX_DIMS:
        raise ValueError(f"mask must be bool [B, *spatial] matching x's {x.shape[:-1]}, got "
                         f"{mask.dtype} {mask.shape}")
    with _checks.on_device(x):
        coords = xp.stack(xp.nonzero(mask), axis=1).astype(xp.int32)
        features = x[mask]
    return SparseTensorData(features, coords, tuple(mask.shape[1:]), mask.shape[0])


def to_dense(t):
    """The dense tensor [B, *spatial, C] (channels last) of a SparseTensorData: its features at
    its sites, zeros elsewhere."""
    features, coords, shape, batch = t
    xp = _checks.array_module(features=features, coords=coords)
    check_grid(coords, shape, batch)
    with _checks.on_device(features):
        out = xp.zeros((batch, *shape, features.shape[1]), dtype=features.dtype)
        out[tuple(coords.T)] = features
    return out


# --- rulebooks ----------------------------------------------------------------------------

def submanifold_rulebook(coords, spatial_shape, batch_size, kernel_size, dilation=1, *,
                         check=True):
    """The rulebook of a submanifold convolution on the active sites `coords`.

    Args:
        coords: int32 [N, 1 + D], distinct rows (batch index, then D coordinates) inside
            batch_size x spatial_shape; numpy or cupy.
        spatial_shape: D ints; batch_size: int.
        kernel_size, dilation: an int or D ints (any size, even ones included: tap k of site
            o reads o + (k - kernel // 2) * dilation).

    Raises ValueError naming coords for duplicate or out-of-range rows (the CUDA path reads
    one flag back from the device for it: one host sync). check=False skips that check and its
    sync, for coordinates known to be distinct and inside the grid (a rulebook's out_coords);
    with rows that are not, the maps are wrong but every index in them is a valid row.
    """
    shape, batch, geometry, _ = rulebook_geometry(coords, spatial_shape, batch_size,
                                                  kernel_size, 1, 0, dilation, True)
    xp = _checks.array_module(coords=coords)
    with _checks.on_device(coords):
        coords = xp.ascontiguousarray(coords)
        if xp is numpy:
            keys = (_numpy.checked_keys(coords, shape, batch, "coords") if check
                    else _numpy.linearise(numpy, coords, shape))
            neighbors, neighbors_t, pairs = _numpy.submanifold_maps(coords, keys, shape,
                                                                    geometry)
        else:
            built = _cuda.build_raw(CUPY, coords, shape, batch, geometry, None, check)
            neighbors, neighbors_t, pairs = built.neighbors, built.neighbors_t, None
    rulebook = Rulebook(neighbors, neighbors_t, coords, coords, shape, shape, batch, *geometry,
                        True)
    rulebook.tap_pairs = pairs
    return rulebook


def strided_rulebook(coords, spatial_shape, batch_size, kernel_size, stride=1, padding=0,
                     dilation=1, *, check=True):
    """The rulebook of a strided (regular) sparse convolution; its output sites are every site
    of the output grid that reads an active input, sorted by (batch, coordinates).

    Args: as submanifold_rulebook's, with stride (>= 1) and padding (>= 0): ints or D ints.
    The CUDA path syncs with the host once, for the number of output sites (the check of the
    coordinates, unless check=False, is read in the same sync). It finds the output sites in a
    bitmap of the output grid, in order, with no sort; a grid of more than 2**29 sites
    (batch included) hashes them instead, sorts them, and syncs once more with check.
    """
    shape, batch, geometry, out_shape = rulebook_geometry(
        coords, spatial_shape, batch_size, kernel_size, stride, padding, dilation, False)
    xp = _checks.array_module(coords=coords)
    with _checks.on_device(coords):
        coords = xp.ascontiguousarray(coords)
        if xp is numpy:
            if check:
                _numpy.checked_keys(coords, shape, batch, "coords")
            out_coords, neighbors, neighbors_t, pairs = _numpy.strided_maps(coords, out_shape,
                                                                            geometry)
        else:
            built = _cuda.build_raw(CUPY, coords, shape, batch, geometry, out_shape, check)
            if built is not None:
                return Rulebook(built.neighbors, built.neighbors_t, coords, built.out_coords,
                                shape, out_shape, batch, *geometry, False)
            out_coords, neighbors, neighbors_t = _cuda.strided_hash_sort(
                coords, shape, out_shape, batch, geometry, check)
            pairs = None
    rulebook = Rulebook(neighbors, neighbors_t, coords, out_coords, shape, out_shape, batch,
                        *geometry, False)
    rulebook.tap_pairs = pairs
    return rulebook
