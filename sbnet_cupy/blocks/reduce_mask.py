"""reduce_mask: turn a dense mask into the list of active blocks."""

import functools
import math
import numbers
from collections import namedtuple

import numpy

from ..core import backend as _backend, checks as _checks, kernels as _kernels
from ..core import plan as _plans, records as _records

_THREADS = 1024  # 32 warps, one block each; kernels/blocks/reduce_mask.cu assumes this


class ReduceMask(namedtuple("ReduceMask", ["active_block_indices", "bin_counts"])):
    """Result of reduce_mask.

    active_block_indices: int32 [M, 3] rows (n, hi, wi) in raster order; with `capacity=K`,
        [K, 3] whose first bin_counts[0] rows are valid and the rest are -1.
    bin_counts: int32 [1] holding the number of active blocks, on the mask's device.
    """

    __slots__ = ()

    @property
    def overflowed(self):
        """0-d bool array, on the device: more blocks were active than `capacity` rows hold.

        The ops then use the first `capacity` blocks; `bool(result.overflowed)` syncs.
        """
        return self.bin_counts[0] > self.active_block_indices.shape[0]


def reduce_mask(mask, bcount, *, bsize, boffset=(0, 0), bstride=None, tol=0.5, avgpool=False,
                capacity=None, out=None, workspace=None):
    """List the blocks of a mask whose max (or average) is greater than `tol`.

    Args:
        mask: [N, H, W] or [N, H, W, 1] array (numpy or cupy) of bool, uint8, int32, float16,
            float32 or float64.
        bcount: (BCH, BCW), the number of blocks in height and width.
        bsize: (BH, BW) block size. boffset: (OH, OW), may be negative (usually -padding).
        bstride: (SH, SW), defaults to bsize.
        tol: a block is active when its pooled value is strictly greater than tol.
        avgpool: pool by average (the in-range sum over the full block area, as SBNet does)
            instead of max.
        capacity: None, or K to run without any device-to-host copy: the result then has K
            rows and the true count (see ReduceMask.overflowed).
        out: with capacity, optional (active_block_indices, bin_counts) arrays to write into:
            C-contiguous int32 [K, 3] and [1] on the mask's device (or NumPy arrays).
        workspace: CuPy only, optional uint32 array of at least ceil(N * BCH * BCW / 32) + 1
            elements whose first element is 0, for the kernel's ticket counter and flags (it
            leaves the counter at 0). By default one per device and stream is allocated on first
            use; pass one to capture the call in a CUDA graph on a new stream, and never share
            one between calls that may run at the same time.

    Returns:
        ReduceMask(active_block_indices, bin_counts).

    Block (n, hi, wi) covers the mask pixels, out-of-range ones ignored::

        mask[n, OH + SH*hi : OH + SH*hi + BH, OW + SW*wi : OW + SW*wi + BW]

    and the result lists, in raster order (n, then hi, then wi)::

        [(n, hi, wi) for n in range(N) for hi in range(BCH) for wi in range(BCW)
         if pool(block(n, hi, wi)) > tol]
    """
    xp = _checks.array_module(mask=mask)
    bcount, geometry, capacity = _checks.memoized(
        _CHECKED, check_reduce_mask, (mask, bcount, bsize, boffset, bstride, tol, capacity),
        _checks.ARRAY_TYPES)
    if mask.ndim == 4:
        mask = mask[..., 0]
    total = mask.shape[0] * bcount[0] * bcount[1]
    if out is not None:
        if capacity is None:
            raise ValueError("out needs capacity: without it the number of rows is not known "
                             "before the call")
        _check_out(mask, out, capacity)
    n_words = workspace_words(total)
    if workspace is not None:
        _checks.array_module(mask=mask, workspace=workspace)
        if workspace.dtype != numpy.uint32 or workspace.ndim != 1 or workspace.size < n_words:
            raise ValueError(f"workspace must be a 1-D uint32 array of at least {n_words} "
                             f"elements, got {workspace.dtype} {workspace.shape}")
    if xp is numpy:
        result = _reduce_mask_numpy(mask, bcount, geometry, float(tol), bool(avgpool), capacity)
        if out is None:
            return result
        out[0][...], out[1][...] = result
        return ReduceMask(*out)
    return _reduce_mask_cupy(mask, bcount, geometry, float(tol), bool(avgpool), capacity, out,
                             workspace)


_CHECKED = {}


def check_reduce_mask(mask, bcount, bsize, boffset, bstride, tol, capacity):
    """Checks reduce_mask's arguments (an array or a tensor); returns bcount, the block geometry
    and the capacity as ints."""
    if mask.ndim not in (3, 4) or (mask.ndim == 4 and mask.shape[3] != 1):
        raise ValueError(f"mask must be [N, H, W] or [N, H, W, 1], got shape {tuple(mask.shape)}")
    if _checks.dtype_name(mask) not in _kernels.MASK_CTYPES:
        raise TypeError(f"mask dtype must be one of {sorted(_kernels.MASK_CTYPES)}, "
                        f"got {_checks.dtype_name(mask)}")
    bcount = _checks.int_pair("bcount", bcount, minimum=0)
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    if not isinstance(tol, (int, float, numpy.number)) or isinstance(tol, bool):
        raise TypeError(f"tol must be a number, got {tol!r}")
    if capacity is not None:
        if (not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool)
                or capacity < 0):
            raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
        capacity = int(capacity)
    total = mask.shape[0] * bcount[0] * bcount[1]
    if total >= 2**31 or (capacity or 0) >= 2**31:
        raise ValueError(f"too many blocks for int32 indices: {total} (capacity {capacity})")
    return bcount, geometry, capacity


def workspace_words(total):
    """uint32 words of the kernel's workspace for `total` blocks: the ticket counter, then a
    flag word for every 32 blocks."""
    return 1 + math.ceil(total / 32)


def _check_out(mask, out, capacity):
    try:
        indices, counts = out
    except (TypeError, ValueError):
        raise TypeError("out must be a pair (active_block_indices, bin_counts)") from None
    _checks.array_module(mask=mask, active_block_indices=indices, bin_counts=counts)
    for name, a, shape in (("active_block_indices", indices, (capacity, 3)),
                           ("bin_counts", counts, (1,))):
        if a.shape != shape or a.dtype != numpy.int32 or not a.flags.c_contiguous:
            raise ValueError(f"out {name} must be a C-contiguous int32 array of shape {shape}, "
                             f"got {a.dtype} {a.shape}")


def _with_capacity(xp, active, capacity):
    """Fit the active rows into a capacity-sized list: the first rows, then -1."""
    count = xp.asarray([active.shape[0]], dtype=xp.int32)
    if capacity is None:
        return ReduceMask(active, count)
    indices = xp.full((capacity, 3), -1, dtype=xp.int32)
    kept = min(capacity, active.shape[0])
    indices[:kept] = active[:kept]
    return ReduceMask(indices, count)


def _reduce_mask_numpy(mask, bcount, geometry, tol, avgpool, capacity):
    (bh, bw), (oh, ow), (sh, sw) = geometry
    n, height, width = mask.shape
    acc = numpy.float64 if mask.dtype == numpy.float64 else numpy.float32
    rows = oh + sh * numpy.arange(bcount[0])[:, None] + numpy.arange(bh)  # [BCH, BH]
    cols = ow + sw * numpy.arange(bcount[1])[:, None] + numpy.arange(bw)  # [BCW, BW]
    inside = (((rows >= 0) & (rows < height))[:, :, None, None]
              & ((cols >= 0) & (cols < width))[None, None])  # [BCH, BH, BCW, BW]
    if mask.size == 0 or not inside.any():
        active = numpy.zeros((0, 3), numpy.int32)
        return _with_capacity(numpy, active, capacity)
    values = mask[:, rows.clip(0, height - 1)[:, :, None, None],
                  cols.clip(0, width - 1)[None, None]].astype(acc)  # [N, BCH, BH, BCW, BW]
    if avgpool:
        pooled = numpy.where(inside, values, acc(0)).sum(axis=(2, 4)) / acc(bh * bw)
    else:
        pooled = numpy.where(inside, values, acc(-numpy.inf)).max(axis=(2, 4))
    active = numpy.argwhere(pooled > acc(tol)).astype(numpy.int32)  # raster order
    return _with_capacity(numpy, active, capacity)


# Workspaces of the kernel, one per (device, stream): launches on one stream run in order, and
# the kernel leaves the ticket counter at zero for the next one. Outgrown buffers stay referenced
# (they are small), since a launch still queued on the stream may use them.
_workspaces = {}
_retired = []


def shared_workspace(device, stream, n_words):
    """Address of a workspace of at least n_words for launches on `stream` of `device`."""
    buffer = _workspaces.get((device, stream))
    if buffer is None or buffer.size < n_words:
        import cupy

        with cupy.cuda.Device(device):
            size = max(n_words, 4096, 2 * (0 if buffer is None else buffer.size))
            if buffer is not None:
                _retired.append(buffer)
            buffer = _workspaces[(device, stream)] = cupy.empty(size, dtype=cupy.uint32)
            # Zeroed on the stream that uses it, so the first launch sees the zeros.
            cupy.cuda.runtime.memsetAsync(buffer.data.ptr, 0, 4 * size, stream)
    return buffer.data.ptr


def launch_reduce_mask(backend, mask, bcount, geometry, tol, avgpool, indices, count, fill_rows,
                       workspace=None):
    """The CUDA reduce_mask of a backend's arrays (core/backend.py: CUPY, torch_bridge's TORCH),
    checked: a C-contiguous mask [N, H, W] (or [N, H, W, 1]); int32 indices [rows, 3] and count
    [1]; the first fill_rows rows past the count set to -1. workspace: the caller's (see
    reduce_mask), or None for shared_workspace's."""
    (bh, bw), (oh, ow), (sh, sw) = geometry
    n, height, width = mask.shape[:3]
    n_words = workspace_words(n * bcount[0] * bcount[1])
    device = backend.device(mask)
    stream = backend.stream(device)
    tickets = (shared_workspace(device, stream, n_words) if workspace is None
               else backend.pointer(workspace))
    # ReduceMaskArgs's values in order: a flag word for every 32 blocks after the counter.
    _plan(device, backend.dtype_name(mask), avgpool, bh, bw).launch(
        stream, backend.pointer(mask), tickets + 4, tickets, backend.pointer(indices),
        backend.pointer(count), tol, n, height, width, bh, bw, oh, ow, sh, sw, bcount[0],
        bcount[1], indices.shape[0], fill_rows, grid=(n_words - 1, 1, 1))


@functools.lru_cache(maxsize=256)
def _plan(device, mask_dtype, avgpool, bh, bw):
    size = _kernels.specialised_size(bh) if bh == bw else 0
    return _plans.KernelPlan(device, "reduce_mask", "reduce_mask",
                             (_kernels.MASK_CTYPES[mask_dtype], avgpool, size, size), (1, 1, 1),
                             (_THREADS, 1, 1), 0, _records.REDUCE_MASK_ARGS)


def _reduce_mask_cupy(mask, bcount, geometry, tol, avgpool, capacity, out, workspace):
    import cupy

    n, height, width = mask.shape
    total = n * bcount[0] * bcount[1]
    rows = total if capacity is None else capacity
    with _checks.on_device(mask):
        mask = mask if mask.flags.c_contiguous else cupy.ascontiguousarray(mask)
        if out is not None:
            indices, count = out
        else:
            # One allocation for both outputs: this op is called per frame, so host time counts.
            output = cupy.empty(1 + 3 * rows, dtype=cupy.int32)
            count, indices = output[:1], output[1:].reshape(rows, 3)
        if total == 0:
            count.fill(0)
            indices.fill(-1)
            return ReduceMask(indices, count)
        launch_reduce_mask(_backend.CUPY, mask, bcount, geometry, tol, avgpool, indices, count,
                           0 if capacity is None else rows, workspace)
        if capacity is None:
            indices = indices[:int(count.get()[0])]
    return ReduceMask(indices, count)
