"""The rulebooks of torch_bridge.submanifold's modules (sbnet_cupy.submanifold's Rulebook with
torch tensors), built outside the differentiable op, once per active set: CUDA tensors build
them with sbnet_cupy's rulebook kernels on torch tensors (the TORCH backend, on torch's current
stream), CPU tensors with its NumPy backend; a transposed convolution's with torch ops
(transposed_rulebook). The convolution through them is conv_op's rulebook_conv."""

import contextlib
import math
import threading

import torch

from sbnet_cupy import submanifold as _core
from sbnet_cupy.submanifold.conv_kernels import ordered_map, tap_masks
from sbnet_cupy.submanifold.cuda_rulebook import build_raw
from sbnet_cupy.submanifold.numpy_rulebook import kernel_offsets
from sbnet_cupy.submanifold.validation import ints, rulebook_geometry

from .._ops import _contiguous
from ..backend import TORCH
from .cpu_conv import seed_cpu_plans



# --- bounded builds (CUDA graphs) ---------------------------------------------------------

class _Bounds:
    """The strided rulebook builds of one run of a network, in call order: with capacities,
    each build i makes room for capacities[i] output rows and makes no host sync, and `counts`
    gets its number of sites on the device (int32 [1] tensors); without (a recording run), each
    counts its sites on the host as usual and `counts` gets the ints."""

    def __init__(self, capacities):
        self.capacities, self.counts = capacities, []

    def capacity(self):
        if self.capacities is None:
            return None
        if len(self.counts) >= len(self.capacities):
            raise ValueError("the network made more strided rulebooks than when its graph was "
                             "recorded: its layers must not depend on the data")
        return self.capacities[len(self.counts)]


_BOUNDED = threading.local()


@contextlib.contextmanager
def bounded(capacities):
    """Inside, this thread's CUDA strided rulebook builds are bounded by `capacities` (a list,
    one a build in call order) or, with None, recorded: yields the _Bounds whose counts they
    append. SparseGraphs runs a network so."""
    bounds = _Bounds(capacities)
    previous = getattr(_BOUNDED, "bounds", None)
    _BOUNDED.bounds = bounds
    try:
        yield bounds
    finally:
        _BOUNDED.bounds = previous


# --- rulebooks ----------------------------------------------------------------------------

class Rulebook(_core.Rulebook):
    """sbnet_cupy.submanifold.Rulebook with torch tensors and spconv's names: neighbors int32
    [K, N_out], neighbors_t int32 [K, N_in], in_indices int32 [N_in, 1 + D] and out_indices
    int32 [N_out, 1 + D] (the core's in_coords and out_coords), in_shape and out_shape (lists
    of D ints), batch_size, kernel_size, stride, padding, dilation (lists of D ints), subm,
    inverted and transposed (a transposed convolution's: see transposed_rulebook). On CUDA it
    carries the device tables of its sites that build_rulebook may reuse; inverse() swaps them
    with the sites."""

    def __init__(self, neighbors, neighbors_t, in_indices, out_indices, in_shape, out_shape,
                 batch_size, kernel_size, stride, padding, dilation, subm, inverted=False,
                 transposed=False):
        """The core's arguments, with the sites under spconv's names (keywords included)."""
        super().__init__(neighbors, neighbors_t, in_indices, out_indices, in_shape, out_shape,
                         batch_size, kernel_size, stride, padding, dilation, subm, inverted)
        self.transposed = transposed

    @staticmethod
    def _mirrored_rows(rows):
        return torch.cat((rows[:1], rows[1:].flip(0)))

    @staticmethod
    def _sorted_rows(neighbors):
        """fused_order of a CUDA map: a stable argsort of its rows' tap_masks, and the map's
        columns in that order."""
        return ordered_map(TORCH, neighbors,
                           torch.argsort(tap_masks(TORCH, neighbors), stable=True))

    @property
    def in_indices(self):
        return self.in_coords

    @property
    def out_indices(self):
        return self.out_coords


def build_rulebook(indices, spatial_shape, batch_size, kernel_size, stride=1, padding=0,
                   dilation=1, subm=False, *, check=True, reuse=()):
    """The Rulebook of a submanifold (subm=True; stride and padding unused) or strided sparse
    convolution on the sites `indices` (int32 [N, 1 + D], CPU or CUDA), on their device. Not
    differentiable. A CUDA build syncs with the host to check the indices (unless check=False:
    see sbnet_cupy.submanifold.submanifold_rulebook) and, if strided, to count its outputs
    (one sync for both).

    reuse: Rulebooks (a SparseConvTensor's indice_dict.values()) whose tables of these very
    indices (the same tensor object, as a layer's output carries them) this build may reuse
    instead of building its own: a submanifold rulebook on a strided one's output sites then
    costs one kernel launch. A Rulebook in reuse of these very indices and of this geometry
    is returned as it is (one checked, where this build would check): layers of different
    indice_keys on the same sites (CenterPoint's conv_input and first residual blocks) then
    share one rulebook, as they would share its maps. The modules pass it."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    shape = [int(s) for s in spatial_shape]
    indices = _contiguous(indices)
    shape_t, batch, geometry, out_shape = rulebook_geometry(
        indices, shape, batch_size, kernel_size, stride, padding, dilation, subm)
    same = _same_rulebook(reuse, indices, shape_t, batch, geometry, subm, check)
    if same is not None:
        return same
    rulebook = _built_rulebook(indices, shape_t, batch, geometry, out_shape, subm, check, reuse)
    rulebook._checked = bool(check)
    return rulebook


def _same_rulebook(reuse, indices, shape, batch, geometry, subm, check):
    """The Rulebook in reuse built by build_rulebook on `indices` (this tensor object) with
    this grid and geometry (rulebook_geometry's) and, if check, a check; None if none is."""
    for rulebook in reuse:
        if (isinstance(rulebook, Rulebook) and rulebook.in_coords is indices
                and rulebook.subm == bool(subm) and not rulebook.inverted
                and not rulebook.transposed and (rulebook._checked or not check)
                and rulebook.batch_size == batch and rulebook.in_shape == list(shape)
                and [rulebook.kernel_size, rulebook.stride, rulebook.padding,
                     rulebook.dilation] == [list(g) for g in geometry]):
            return rulebook
    return None


def _built_rulebook(indices, shape, batch, geometry, out_shape, subm, check, reuse):
    """build_rulebook's new Rulebook, from rulebook_geometry's checked arguments."""
    if indices.is_cuda:
        bounds = None if subm else getattr(_BOUNDED, "bounds", None)
        capacity = None if bounds is None else bounds.capacity()
        built = build_raw(TORCH, indices, shape, batch, geometry, out_shape, check,
                          _reusable_table(reuse, indices, shape, batch, check), capacity,
                          bounds is not None)
        if bounds is not None:
            if built is None:
                raise ValueError(f"a strided rulebook of output grid {batch} x {out_shape} is "
                                 f"built by hashing and sorting, which a CUDA graph cannot "
                                 f"capture")
            bounds.counts.append(built.count if capacity is not None
                                 else built.out_coords.shape[0])
        if built is not None:
            rulebook = Rulebook(built.neighbors, built.neighbors_t, indices,
                                indices if subm else built.out_coords, list(shape),
                                list(out_shape or shape), batch, *map(list, geometry), subm)
            rulebook._tables = (built.in_table, built.out_table)
            return rulebook
        import cupy  # a strided output grid too large for a bitmap: CuPy's hash and sort

        device = indices.get_device()
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(TORCH.stream(device)):
            result = _build(cupy.from_dlpack(indices), shape, batch, *geometry, subm, check)
        convert = torch.from_dlpack
    else:
        result = _build(indices.numpy(), shape, batch, *geometry, subm, check)
        convert = torch.from_numpy
    out_indices = indices if subm else convert(result.out_coords)
    rulebook = Rulebook(convert(result.neighbors), convert(result.neighbors_t), indices,
                        out_indices, list(result.in_shape), list(result.out_shape),
                        result.batch_size, list(result.kernel_size), list(result.stride),
                        list(result.padding), list(result.dilation), subm)
    if not indices.is_cuda:
        seed_cpu_plans(rulebook, result.tap_pairs)
    return rulebook


def deconv_output_shape(shape, kernel_size, stride, padding, output_padding):
    """Spatial shape of a transposed convolution's output, spconv's: (in - 1) * stride -
    2 * padding + kernel_size + output_padding (dilation does not enter, as in spconv)."""
    out = [(s - 1) * st - 2 * p + k + op
           for s, k, st, p, op in zip(shape, kernel_size, stride, padding, output_padding)]
    if min(out) < 1:
        raise ValueError(f"kernel_size {list(kernel_size)}, stride {list(stride)}, padding "
                         f"{list(padding)} and output_padding {list(output_padding)} leave no "
                         f"output of spatial_shape {list(shape)}")
    return out


def transposed_rulebook(indices, spatial_shape, batch_size, kernel_size, stride=1, padding=0,
                        dilation=1, output_padding=0, *, check=True):
    """The Rulebook of a transposed sparse convolution (spconv's SparseConvTranspose): input
    site i feeds, through tap k, output o = i * stride - padding + k * dilation wherever o lies
    in deconv_output_shape; the output sites are every such o, sorted by (batch, coordinates).
    Built with torch ops on the indices' device (a CUDA build syncs with the host to count the
    sites, and once more with check). check: ValueError naming indices for duplicate or
    out-of-range rows."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.is_cuda and getattr(_BOUNDED, "bounds", None) is not None:
        raise ValueError("a transposed convolution's rulebook counts its sites on the host, "
                         "which a CUDA graph cannot capture (SparseInverseConv's can be)")
    indices = _contiguous(indices)
    shape, batch, geometry, _ = rulebook_geometry(
        indices, spatial_shape, batch_size, kernel_size, stride, padding, dilation, False)
    kernel, stride, padding, dilation = (list(v) for v in geometry)
    output_padding = ints("output_padding", output_padding, len(shape), 0)
    out_shape = deconv_output_shape(shape, kernel, stride, padding, output_padding)
    if check:
        _check_sites(indices, shape, batch)
    device = indices.device
    taps = torch.from_numpy(kernel_offsets(kernel)).to(device)  # [K, D], row-major
    sites = indices[:, 1:].long()
    targets = (sites[None] * torch.tensor(stride, device=device)
               - torch.tensor(padding, device=device)
               + taps[:, None] * torch.tensor(dilation, device=device))  # [K, N, D]
    limits = torch.tensor(out_shape, device=device)
    valid = ((targets >= 0) & (targets < limits)).all(-1)
    keys = _linear(indices[:, 0].long().expand(valid.shape)[valid], targets[valid], out_shape)
    out_keys, out_rows = torch.unique(keys, sorted=True, return_inverse=True)
    tap, row = valid.nonzero(as_tuple=True)
    neighbors_t = torch.full(valid.shape, -1, dtype=torch.int32, device=device)
    neighbors_t[valid] = out_rows.int()
    # Each (output, tap) reads at most one input: (o + padding - k * dilation) / stride.
    neighbors = torch.full((valid.shape[0], out_keys.shape[0]), -1, dtype=torch.int32,
                           device=device)
    neighbors[tap, out_rows] = row.int()
    return Rulebook(neighbors, neighbors_t, indices, _decode(out_keys, out_shape), list(shape),
                    out_shape, batch, kernel, stride, padding, dilation, False,
                    transposed=True)


def _linear(batch, coords, shape):
    """Keys (b * S0 + c0) * S1 + c1 ... of coords [N, D] in batch x shape, in their dtype."""
    keys = batch
    for axis, size in enumerate(shape):
        keys = keys * size + coords[:, axis]
    return keys


def _decode(keys, shape):
    """int32 sites [N, 1 + D] of _linear's keys."""
    columns = []
    for size in reversed(shape):
        columns.append(keys % size)
        keys = keys // size
    columns.append(keys)
    return torch.stack(columns[::-1], dim=1).int()


def _site_faults(indices, shape, batch):
    """What _check_sites raises for, on the device: (outside, bool [N]: rows outside the grid;
    ordered: the rows' keys sorted; repeated, bool [N - 1]: where ordered repeats a key). A row
    outside gets a key of its own past the grid's, so that it repeats none. The keys are int32
    where they all fit (half the sort's passes of int64 keys), int64 where not. A row outside
    may wrap around in int32: its key is replaced."""
    limits = torch.tensor([batch, *shape], device=indices.device)
    outside = ((indices < 0) | (indices >= limits)).any(1)
    sites = batch * math.prod(shape)
    indices = indices.long() if sites + indices.shape[0] > 2**31 - 1 else indices.int()
    keys = _linear(indices[:, 0], indices[:, 1:], shape)
    past = sites + torch.arange(keys.shape[0], device=keys.device, dtype=keys.dtype)
    ordered = torch.sort(torch.where(outside, past, keys)).values
    return outside, ordered, ordered[1:] == ordered[:-1]


def _check_sites(indices, shape, batch):
    """ValueError naming indices for rows outside batch x shape or repeated (a host sync on
    CUDA)."""
    outside, ordered, repeated = _site_faults(indices, shape, batch)
    if outside.any():
        row = int(outside.nonzero()[0, 0])
        raise ValueError(f"indices row {row} = {tuple(indices[row].tolist())} is outside "
                         f"batch_size x spatial_shape = {batch} x {tuple(shape)}")
    repeated = repeated.nonzero()
    if repeated.numel():
        site = _decode(ordered[repeated[0]], shape)[0]
        raise ValueError(f"indices has duplicate rows, e.g. {tuple(site.tolist())}")



def _reusable_table(reuse, indices, shape, batch, check):
    """A table of `indices` (this tensor object) on grid batch x shape that one of the
    Rulebooks in `reuse` carries, checked if `check`; None if none does."""
    for rulebook in reuse:
        if not isinstance(rulebook, Rulebook):
            continue
        # The sites first, by identity: most rulebooks of a tensor are on other sites.
        in_table, out_table = rulebook._tables
        for table in (in_table if rulebook.in_coords is indices else None,
                      out_table if rulebook.out_coords is indices else None):
            if (table is not None and table.shape == shape and table.batch == batch
                    and (table.checked or not check)):
                return table
    return None


def _build(coords, shape, batch_size, kernel_size, stride, padding, dilation, subm, check):
    if subm:
        return _core.submanifold_rulebook(coords, shape, batch_size, kernel_size, dilation,
                                          check=check)
    return _core.strided_rulebook(coords, shape, batch_size, kernel_size, stride, padding,
                                  dilation, check=check)

