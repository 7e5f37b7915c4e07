"""sparse_gather: cut the listed blocks out of an NHWC tensor into a dense stack."""

import numpy

from . import _blocks, _checks, _kernels


def sparse_gather(x, bin_counts, active_block_indices, *, bsize, boffset=(0, 0), bstride=None,
                  transpose=False):
    """Gather blocks of `x` into a stack.

    Args:
        x: [N, H, W, C] array (numpy or cupy), any dtype.
        bin_counts: int [1], the number of valid rows of active_block_indices.
        active_block_indices: int [M, 3] rows (n, hi, wi), as reduce_mask returns them.
        bsize, boffset, bstride: block geometry, as for reduce_mask (bstride defaults to bsize).
        transpose: return [M, C, BH, BW] instead of [M, BH, BW, C].

    Returns:
        [M, BH, BW, C] (or [M, C, BH, BW]) array of x's dtype. Pixels outside x read as zero;
        rows past bin_counts[0] (capacity mode) are zero, and so are blocks whose n is not in
        [0, N).

    For each valid row m = (n, hi, wi)::

        out[m] = x[n, OH + SH*hi : OH + SH*hi + BH, OW + SW*wi : OW + SW*wi + BW, :]
    """
    xp = _checks.array_module(x=x, bin_counts=bin_counts,
                              active_block_indices=active_block_indices)
    x = _checks.nhwc("x", x)
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    indices, counts = _checks.block_list(xp, active_block_indices, bin_counts)
    if xp is numpy:
        return _gather_numpy(x, counts, indices, geometry, bool(transpose))
    return _gather_cupy(x, counts, indices, geometry, bool(transpose))


def _gather_numpy(x, counts, indices, geometry, transpose):
    bh, bw = geometry.bsize
    n_valid = _checks.valid_rows_numpy(indices, counts)
    out = numpy.zeros((indices.shape[0], bh, bw, x.shape[3]), dtype=x.dtype)
    n, h, w, inside = _blocks.block_pixels(indices, n_valid, x.shape[:3], geometry)
    valid = out[:n_valid]
    valid[inside] = x[n[inside], h[inside], w[inside]]
    return numpy.ascontiguousarray(out.transpose(0, 3, 1, 2)) if transpose else out


def _gather_cupy(x, counts, indices, geometry, transpose):
    import cupy

    (bh, bw), (oh, ow), (sh, sw) = geometry
    n, height, width, channels = x.shape
    rows = indices.shape[0]
    i32 = numpy.int32
    with x.device:
        x = cupy.ascontiguousarray(x)
        shape = (rows, channels, bh, bw) if transpose else (rows, bh, bw, channels)
        out = cupy.empty(shape, dtype=x.dtype)
        if out.size == 0:
            return out
        geometry_args = (i32(oh), i32(ow), i32(sh), i32(sw))
        if transpose:
            grid, block, smem, (tile_rows, log2_tile_c) = _blocks.transpose_launch(
                rows, bh, bw, channels, x.itemsize)
            kernel = _kernels.get_kernel("sparse_gather", "sparse_gather_transposed",
                                         _kernels.STORAGE_CTYPES[x.itemsize],
                                         _kernels.specialised_size(bw))
            kernel(grid, block,
                   (x, out, indices, counts, i32(rows), i32(n), i32(height), i32(width),
                    i32(channels), i32(bh), i32(bw), *geometry_args, i32(tile_rows),
                    i32(log2_tile_c)), shared_mem=smem)
        else:
            pixel_bytes = channels * x.itemsize
            word = _kernels.widest_access(pixel_bytes, x, out)
            words_per_pixel = pixel_bytes // word
            grid, block = _blocks.row_launch(rows, bh, bw * words_per_pixel)
            kernel = _kernels.get_kernel("sparse_gather", "sparse_gather",
                                         _kernels.STORAGE_CTYPES[word])
            kernel(grid, block,
                   (x, out, indices, counts, i32(rows), i32(n), i32(height), i32(width),
                    i32(words_per_pixel), i32(bh), i32(bw), *geometry_args))
    return out
