"""sparse_gather: cut the listed blocks out of an NHWC tensor into a dense stack."""

import numpy

from . import _blocks, _checks, _kernels


def sparse_gather(x, bin_counts, active_block_indices, *, bsize, boffset=(0, 0), bstride=None,
                  transpose=False, out=None, scale=None, shift=None, relu=False):
    """Gather blocks of `x` into a stack.

    Args:
        x: [N, H, W, C] array (numpy or cupy), any dtype.
        bin_counts: int [1], the number of valid rows of active_block_indices.
        active_block_indices: int [M, 3] rows (n, hi, wi), as reduce_mask returns them.
        bsize, boffset, bstride: block geometry, as for reduce_mask (bstride defaults to bsize).
        transpose: return [M, C, BH, BW] instead of [M, BH, BW, C].
        out: optional C-contiguous array of the result's shape and dtype to write into (no
            allocation, so the call can be captured in a CUDA graph).
        scale, shift, relu: fuse an inference BatchNorm (and ReLU) into the gather: in-image
            pixels become x * scale + shift per channel (scale, shift: [C] arrays, float x
            only, transpose=False), clamped at zero with relu=True; out-of-image pixels stay 0.

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
    (bh, bw), channels, transpose = geometry.bsize, x.shape[3], bool(transpose)
    affine = _check_affine(xp, x, scale, shift, relu, transpose)
    with _checks.device_of(x):
        indices, counts = _checks.block_list(xp, active_block_indices, bin_counts)
        shape = ((indices.shape[0], channels, bh, bw) if transpose
                 else (indices.shape[0], bh, bw, channels))
        if out is None:
            out = xp.empty(shape, dtype=x.dtype)
        else:
            _checks.array_module(x=x, out=out)
            if out.shape != shape or out.dtype != x.dtype or not out.flags.c_contiguous:
                raise ValueError(f"out must be a C-contiguous {x.dtype} array of shape {shape}, "
                                 f"got {out.dtype} {out.shape}")
        if affine is not None:
            affine = tuple(xp.ascontiguousarray(a, dtype=_acc_dtype(x)) for a in affine)
        if xp is numpy:
            _gather_numpy(x, counts, indices, geometry, transpose, out, affine, bool(relu))
        else:
            _gather_cupy(x, counts, indices, geometry, transpose, out, affine, bool(relu))
    return out


def _acc_dtype(x):
    return numpy.float64 if x.dtype == numpy.float64 else numpy.float32


def _check_affine(xp, x, scale, shift, relu, transpose):
    """(scale, shift) arrays, or None for a plain gather."""
    if scale is None and shift is None:
        if relu:
            raise ValueError("relu=True needs scale and shift")
        return None
    if scale is None or shift is None:
        raise ValueError("scale and shift go together")
    if transpose:
        raise ValueError("scale and shift need transpose=False")
    if x.dtype.name not in _kernels.ARITHMETIC_CTYPES:
        raise TypeError(f"scale and shift need a float x, got {x.dtype}")
    _checks.array_module(x=x, scale=scale, shift=shift)
    for name, a in (("scale", scale), ("shift", shift)):
        if a.shape != (x.shape[3],):
            raise ValueError(f"{name} must have shape ({x.shape[3]},) (one value a channel), "
                             f"got {a.shape}")
    return scale, shift


def _gather_numpy(x, counts, indices, geometry, transpose, out, affine, relu):
    n_valid = _checks.valid_rows_numpy(indices, counts)
    stack = out.transpose(0, 2, 3, 1) if transpose else out  # [M, BH, BW, C] view
    stack[...] = 0
    n, h, w, inside = _blocks.block_pixels(indices, n_valid, x.shape[:3], geometry)
    values = x[n[inside], h[inside], w[inside]]
    if affine is not None:
        values = values.astype(affine[0].dtype) * affine[0] + affine[1]
        if relu:
            values = numpy.maximum(values, 0)
    valid = stack[:n_valid]
    valid[inside] = values


def _gather_cupy(x, counts, indices, geometry, transpose, out, affine, relu):
    import cupy

    (bh, bw), (oh, ow), (sh, sw) = geometry
    n, height, width, channels = x.shape
    rows = indices.shape[0]
    i32 = numpy.int32
    x = cupy.ascontiguousarray(x)
    if out.size == 0:
        return
    geometry_args = (i32(oh), i32(ow), i32(sh), i32(sw))
    if transpose:
        grid, block, smem, vector, tile_rows, log2_tile_c, pitch = _blocks.transpose_launch(
            rows, bh, bw, channels, x.itemsize, x, out)
        kernel = _kernels.get_kernel("sparse_gather", "sparse_gather_transposed",
                                     _kernels.STORAGE_CTYPES[x.itemsize], vector)
        kernel(grid, block,
               (x, out, indices, counts, i32(rows), i32(n), i32(height), i32(width),
                i32(channels), i32(bh), i32(bw), *geometry_args, i32(tile_rows),
                i32(log2_tile_c), i32(pitch)), shared_mem=smem)
    elif affine is not None:
        width_bytes = _kernels.widest_access(channels * x.itemsize, x, out)
        vector = width_bytes // x.itemsize
        grid, block = _blocks.row_launch(rows, bh, bw * channels // vector)
        kernel = _kernels.get_kernel("sparse_gather", "sparse_gather_affine",
                                     _kernels.ARITHMETIC_CTYPES[x.dtype.name], vector, relu)
        kernel(grid, block,
               (x, out, *affine, indices, counts, i32(rows), i32(n), i32(height), i32(width),
                i32(channels // vector), i32(bh), i32(bw), *geometry_args))
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
