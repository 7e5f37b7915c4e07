"""sparse_gather: cut the listed blocks out of an NHWC tensor into a dense stack."""

import functools

import numpy

from . import stack as _blocks
from ..core import backend as _backend, checks as _checks, kernels as _kernels


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
    geometry = _checks.memoized(_CHECKED, check_gather,
                                (x, bin_counts, active_block_indices, bsize, boffset, bstride,
                                 transpose, scale, shift, relu), _checks.ARRAY_TYPES)
    transpose = bool(transpose)
    shape = stack_shape(active_block_indices.shape[0], geometry.bsize, x.shape[3], transpose)
    with _checks.on_device(x):
        indices, counts = _checks.block_list(xp, active_block_indices, bin_counts)
        if out is None:
            out = xp.empty(shape, dtype=x.dtype)
        else:
            _checks.array_module(x=x, out=out)
            if out.shape != shape or out.dtype != x.dtype or not out.flags.c_contiguous:
                raise ValueError(f"out must be a C-contiguous {x.dtype} array of shape {shape}, "
                                 f"got {out.dtype} {out.shape}")
        affine = None
        if scale is not None:
            _checks.array_module(x=x, scale=scale, shift=shift)
            affine = tuple(xp.ascontiguousarray(a, dtype=affine_dtype(x.dtype.name))
                           for a in (scale, shift))
        if xp is numpy:
            _gather_numpy(x, counts, indices, geometry, transpose, out, affine, bool(relu))
        else:
            launch_gather(_backend.CUPY, _backend.CUPY.contiguous(x), out, indices, counts,
                          *(affine or (None, None)), geometry, transpose, bool(relu))
    return out


_CHECKED = {}


def check_gather(x, bin_counts, active_block_indices, bsize, boffset, bstride, transpose,
                 scale, shift, relu):
    """Checks sparse_gather's arguments (arrays or tensors) and returns the block geometry."""
    _checks.nhwc("x", x)
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    _checks.check_block_list(active_block_indices, bin_counts)
    if scale is None and shift is None:
        if relu:
            raise ValueError("relu=True needs scale and shift")
        return geometry
    if scale is None or shift is None:
        raise ValueError("scale and shift go together")
    if transpose:
        raise ValueError("scale and shift need transpose=False")
    if _checks.dtype_name(x) not in _kernels.ARITHMETIC_CTYPES:
        raise TypeError(f"scale and shift need a float x, got {_checks.dtype_name(x)}")
    for name, a in (("scale", scale), ("shift", shift)):
        if tuple(a.shape) != (x.shape[3],):
            raise ValueError(f"{name} must have shape ({x.shape[3]},) (one value a channel), "
                             f"got {tuple(a.shape)}")
    return geometry


def stack_shape(rows, bsize, channels, transpose):
    return (rows, channels, *bsize) if transpose else (rows, *bsize, channels)


def affine_dtype(dtype_name):
    """The dtype the fused BatchNorm's scale and shift are read in: the kernels' arithmetic."""
    return "float64" if dtype_name == "float64" else "float32"


def launch_gather(backend, x, out, indices, counts, scale, shift, geometry, transpose, relu):
    """The CUDA gather of a backend's arrays (core/backend.py: CUPY, torch_bridge's TORCH),
    checked: C-contiguous x [N, H, W, C] into the stack `out`, int32 indices [rows, 3] and count
    [1]; scale and shift None or [C] in affine_dtype."""
    n, height, width, channels = x.shape
    rows = indices.shape[0]
    if rows == 0 or channels == 0:
        return
    device = backend.device(x)
    src, dst = backend.pointer(x), backend.pointer(out)
    plan = _gather_plan(device, geometry[0], channels, backend.itemsize(x),
                        backend.dtype_name(x), transpose, scale is not None, relu,
                        _checks.alignment(src, dst))
    _blocks.launch(plan, backend.stream(device), src, dst, backend.pointer(scale),
                   backend.pointer(shift), backend.pointer(indices), backend.pointer(counts),
                   rows, (n, height, width), geometry)


@functools.lru_cache(maxsize=1024)
def _gather_plan(device, bsize, channels, itemsize, dtype_name, transpose, affine, relu,
                 alignment):
    (bh, bw), op = bsize, "sparse_gather"
    if transpose:
        return _blocks.transpose_plan(device, op, "sparse_gather_transposed",
                                      (_kernels.STORAGE_CTYPES[itemsize],), bh, bw, channels,
                                      itemsize, alignment)
    if affine:
        vector = _kernels.widest_access(channels * itemsize, alignment) // itemsize
        return _blocks.row_plan(device, op, "sparse_gather_affine",
                                (_kernels.ARITHMETIC_CTYPES[dtype_name], vector,
                                 relu), bh, bw,
                                channels // vector)
    word = _kernels.widest_access(channels * itemsize, alignment)
    return _blocks.row_plan(device, op, "sparse_gather", (_kernels.STORAGE_CTYPES[word],), bh,
                            bw, channels * itemsize // word)


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
