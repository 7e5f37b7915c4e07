"""sparse_scatter, sparse_scatter_var: put a stack of blocks back into an NHWC tensor."""

import functools

import numpy

from . import stack as _blocks
from ..core import backend as _backend, checks as _checks, kernels as _kernels


def sparse_scatter(blocks, bin_counts, active_block_indices, ybase, *, bsize, boffset=(0, 0),
                   bstride=None, add=False, atomic=False, transpose=False):
    """Write (or add) a stack of blocks into a copy of `ybase`.

    Args:
        blocks: [M, BH, BW, C] (or [M, C, BH, BW] with transpose) array, ybase's dtype.
        bin_counts, active_block_indices: the block list, as for sparse_gather; M rows.
        ybase: [N, H, W, C] array; it is not modified.
        bsize, boffset, bstride: block geometry (bstride defaults to bsize).
        add: add the blocks to ybase's values instead of overwriting them (float dtypes).
        atomic: add with atomics. Needed when blocks overlap (bstride < bsize, or an index
            listed twice); the order of the additions, and so float rounding, then varies from
            run to run.
        transpose: blocks are [M, C, BH, BW].

    Returns:
        A new [N, H, W, C] array: ybase with, for each valid row m = (n, hi, wi)::

            y[n, OH + SH*hi : OH + SH*hi + BH, OW + SW*wi : OW + SW*wi + BW, :] = blocks[m]
            # or += blocks[m] with add=True

        Pixels outside y and rows past bin_counts[0] write nothing. Where blocks overlap
        without add, which block's value lands is unspecified.
    """
    return _scatter(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride,
                    add, atomic, transpose, in_place=False)


def sparse_scatter_var(blocks, bin_counts, active_block_indices, ybase, *, bsize,
                       boffset=(0, 0), bstride=None, add=False, atomic=False, transpose=False):
    """sparse_scatter that writes into `ybase` itself and returns it (no copy of ybase).

    The arguments and the result are those of sparse_scatter.
    """
    return _scatter(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride,
                    add, atomic, transpose, in_place=True)


def _scatter(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride, add,
             atomic, transpose, in_place):
    xp = _checks.array_module(blocks=blocks, bin_counts=bin_counts,
                              active_block_indices=active_block_indices, ybase=ybase)
    geometry = _checks.memoized(_CHECKED, check_scatter,
                                (blocks, bin_counts, active_block_indices, ybase, bsize, boffset,
                                 bstride, add, atomic, transpose, xp is not numpy),
                                _checks.ARRAY_TYPES)
    add, atomic, transpose = bool(add), bool(atomic), bool(transpose)
    if in_place and xp is numpy and not ybase.flags.writeable:
        raise ValueError("ybase must be writeable for sparse_scatter_var")
    with _checks.on_device(ybase):
        indices, counts = _checks.block_list(xp, active_block_indices, bin_counts)
        y = ybase if in_place else _copy(ybase)
        # The kernels need a C-contiguous output: scatter into a copy, then copy back.
        work = y if y.flags.c_contiguous else y.copy(order="C")
        if xp is numpy:
            _scatter_numpy(blocks, counts, indices, work, geometry, add, transpose)
        else:
            launch_scatter(_backend.CUPY, _backend.CUPY.contiguous(blocks), work, indices,
                           counts, geometry, add, atomic, transpose)
        if work is not y:
            y[...] = work
    return y


_CHECKED = {}


def check_scatter(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride, add,
                  atomic, transpose, on_gpu):
    """Checks sparse_scatter's arguments (arrays or tensors) and returns the block geometry."""
    _checks.nhwc("ybase", ybase)
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    (bh, bw), channels = geometry.bsize, ybase.shape[3]
    expected = (channels, bh, bw) if transpose else (bh, bw, channels)
    if blocks.ndim != 4 or tuple(blocks.shape[1:]) != expected:
        raise ValueError(f"blocks must have shape [M, {'C, BH, BW' if transpose else 'BH, BW, C'}]"
                         f" = [M, {', '.join(map(str, expected))}], got {tuple(blocks.shape)}")
    if blocks.dtype != ybase.dtype:
        raise TypeError(f"blocks dtype {blocks.dtype} differs from ybase dtype {ybase.dtype}")
    data_dtype = _checks.dtype_name(ybase)
    if add and (data_dtype not in _kernels.ARITHMETIC_CTYPES
                or (not on_gpu and data_dtype == "bfloat16")):
        raise TypeError(f"add=True needs a float dtype ({', '.join(_kernels.ARITHMETIC_CTYPES)}; "
                        f"bfloat16 on the GPU only), got {data_dtype}")
    _checks.atomic_for_overlap(geometry, add, atomic)
    _checks.check_block_list(active_block_indices, bin_counts)
    if blocks.shape[0] != active_block_indices.shape[0]:
        raise ValueError(f"blocks has {blocks.shape[0]} rows but active_block_indices has "
                         f"{active_block_indices.shape[0]}")
    return geometry


def _copy(a):
    """A C-contiguous copy of `a` (CuPy's own copy costs more host time than the op; a
    contiguous array is one memcpy on the current stream)."""
    if isinstance(a, numpy.ndarray) or not a.flags.c_contiguous:
        return a.copy(order="C")
    import cupy

    copy = cupy.empty_like(a)
    copy.data.copy_from_device_async(a.data, a.nbytes)
    return copy


def launch_scatter(backend, blocks, y, indices, counts, geometry, add, atomic, transpose):
    """The CUDA scatter of a backend's arrays (core/backend.py: CUPY, torch_bridge's TORCH),
    checked: the C-contiguous stack `blocks` into C-contiguous y [N, H, W, C], in place; int32
    indices [rows, 3] and count [1]."""
    n, height, width, channels = y.shape
    rows = indices.shape[0]
    if rows == 0 or n * height * width * channels == 0:
        return
    device = backend.device(y)
    src, dst = backend.pointer(blocks), backend.pointer(y)
    op = ("AtomicAdd" if atomic else "Add") if add else "Assign"
    plan = _scatter_plan(device, geometry[0], channels, backend.itemsize(y),
                         backend.dtype_name(y), op, transpose, _checks.alignment(src, dst))
    _blocks.launch(plan, backend.stream(device), src, dst, 0, 0, backend.pointer(indices),
                   backend.pointer(counts), rows, (n, height, width), geometry)


@functools.lru_cache(maxsize=1024)
def _scatter_plan(device, bsize, channels, itemsize, dtype_name, op, transpose, alignment):
    (bh, bw), adds = bsize, op != "Assign"
    if transpose:
        element = (_kernels.ARITHMETIC_CTYPES[dtype_name] if adds
                   else _kernels.STORAGE_CTYPES[itemsize])
        return _blocks.transpose_plan(device, "sparse_scatter", "sparse_scatter_transposed",
                                      (element, op), bh, bw, channels, itemsize, alignment)
    pixel_bytes = channels * itemsize
    width_bytes = _kernels.widest_access(pixel_bytes, alignment)
    if adds:
        word = f"vec_t<{_kernels.ARITHMETIC_CTYPES[dtype_name]}, {width_bytes // itemsize}>"
    else:
        word = _kernels.STORAGE_CTYPES[width_bytes]
    return _blocks.row_plan(device, "sparse_scatter", "sparse_scatter", (word, op), bh, bw,
                            pixel_bytes // width_bytes)


def _scatter_numpy(blocks, counts, indices, y, geometry, add, transpose):
    n_valid = _checks.valid_rows_numpy(indices, counts)
    stack = blocks.transpose(0, 2, 3, 1) if transpose else blocks
    n, h, w, inside = _blocks.block_pixels(indices, n_valid, y.shape[:3], geometry)
    values = stack[:n_valid][inside]
    where = (n[inside], h[inside], w[inside])
    if add:
        numpy.add.at(y, where, values)  # unbuffered: a pixel listed twice gets both
    else:
        y[where] = values
