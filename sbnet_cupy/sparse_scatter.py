"""sparse_scatter, sparse_scatter_var: put a stack of blocks back into an NHWC tensor."""

import numpy

from . import _blocks, _checks, _kernels


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
             atomic, transpose, in_place, data_dtype=None):
    """sparse_scatter(_var). data_dtype names the data type when the arrays hold its bits under
    another dtype (the bridges pass bfloat16 tensors as int16 arrays: CuPy has no bfloat16)."""
    xp = _checks.array_module(blocks=blocks, bin_counts=bin_counts,
                              active_block_indices=active_block_indices, ybase=ybase)
    ybase = _checks.nhwc("ybase", ybase)
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    add, atomic, transpose = bool(add), bool(atomic), bool(transpose)
    (bh, bw), channels = geometry.bsize, ybase.shape[3]
    expected = (channels, bh, bw) if transpose else (bh, bw, channels)
    if blocks.ndim != 4 or blocks.shape[1:] != expected:
        raise ValueError(f"blocks must have shape [M, {'C, BH, BW' if transpose else 'BH, BW, C'}]"
                         f" = [M, {', '.join(map(str, expected))}], got {blocks.shape}")
    if blocks.dtype != ybase.dtype:
        raise TypeError(f"blocks dtype {blocks.dtype} differs from ybase dtype {ybase.dtype}")
    data_dtype = data_dtype or ybase.dtype.name
    if add and (data_dtype not in _kernels.ARITHMETIC_CTYPES
                or (xp is numpy and data_dtype == "bfloat16")):
        raise TypeError(f"add=True needs a float dtype ({', '.join(_kernels.ARITHMETIC_CTYPES)}; "
                        f"bfloat16 on the GPU only), got {data_dtype}")
    _checks.atomic_for_overlap(geometry, add, atomic)
    if in_place and xp is numpy and not ybase.flags.writeable:
        raise ValueError("ybase must be writeable for sparse_scatter_var")
    with _checks.device_of(ybase):
        indices, counts = _checks.block_list(xp, active_block_indices, bin_counts)
        if blocks.shape[0] != indices.shape[0]:
            raise ValueError(f"blocks has {blocks.shape[0]} rows but active_block_indices has "
                             f"{indices.shape[0]}")
        y = ybase if in_place else ybase.copy(order="C")
        # The kernels need a C-contiguous output: scatter into a copy, then copy back.
        work = y if y.flags.c_contiguous else y.copy(order="C")
        if xp is numpy:
            _scatter_numpy(blocks, counts, indices, work, geometry, add, transpose)
        else:
            _scatter_cupy(blocks, counts, indices, work, geometry, add, atomic, transpose,
                          data_dtype)
        if work is not y:
            y[...] = work
    return y


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


def _scatter_cupy(blocks, counts, indices, y, geometry, add, atomic, transpose, data_dtype):
    import cupy

    (bh, bw), (oh, ow), (sh, sw) = geometry
    n, height, width, channels = y.shape
    rows = indices.shape[0]
    if rows == 0 or y.size == 0 or blocks.size == 0:
        return
    blocks = cupy.ascontiguousarray(blocks)
    op = ("AtomicAdd" if atomic else "Add") if add else "Assign"
    i32 = numpy.int32
    geometry_args = (i32(oh), i32(ow), i32(sh), i32(sw))
    if transpose:
        grid, block, smem, vector, tile_rows, log2_tile_c, pitch = _blocks.transpose_launch(
            rows, bh, bw, channels, y.itemsize, blocks, y)
        element = (_kernels.ARITHMETIC_CTYPES[data_dtype] if add
                   else _kernels.STORAGE_CTYPES[y.itemsize])
        kernel = _kernels.get_kernel("sparse_scatter", "sparse_scatter_transposed", element,
                                     vector, op)
        kernel(grid, block,
               (blocks, y, indices, counts, i32(rows), i32(n), i32(height), i32(width),
                i32(channels), i32(bh), i32(bw), *geometry_args, i32(tile_rows),
                i32(log2_tile_c), i32(pitch)), shared_mem=smem)
        return
    pixel_bytes = channels * y.itemsize
    width_bytes = _kernels.widest_access(pixel_bytes, blocks, y)
    if add:
        word = (f"vec_t<{_kernels.ARITHMETIC_CTYPES[data_dtype]}, "
                f"{width_bytes // y.itemsize}>")
    else:
        word = _kernels.STORAGE_CTYPES[width_bytes]
    words_per_pixel = pixel_bytes // width_bytes
    grid, block = _blocks.row_launch(rows, bh, bw * words_per_pixel)
    kernel = _kernels.get_kernel("sparse_scatter", "sparse_scatter", word, op)
    kernel(grid, block,
           (blocks, y, indices, counts, i32(rows), i32(n), i32(height), i32(width),
            i32(words_per_pixel), i32(bh), i32(bw), *geometry_args))
