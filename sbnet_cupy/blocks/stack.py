"""What sparse_gather and sparse_scatter share: block geometry on NumPy, their launch plans and
the launch itself on the GPU.

A gather's or scatter's plan is a KernelPlan (core/plan.py) of its kernel, cached by the op per
shape, dtype and device: its grid's y and z (the grid's x is the stack's rows, which change
from call to call with capacity), block, shared memory, and the StackArgs fields that the plan
fixes (words_per_pixel, tile_rows, log2_tile_c, pitch); a launch passes the rest.
"""

import math

import numpy

from ..core import checks as _checks, plan as _plan, records as _records

# The gather's and scatter's argument record: src, dst, scale, shift, then a BlockList (indices,
# count and ten ints), then the plan's words_per_pixel, tile_rows, log2_tile_c, pitch.
STACK_ARGS = _records.STACK_ARGS

THREADS = 256
_UNROLL = 4  # words per thread per pass, as in the kernels
_TILE_BYTES = 32 * 1024  # shared-memory tile of the transposing kernels: aim
_TILE_LIMIT = 48 * 1024  # and limit (no opt-in needed below it)


def block_pixels(indices, n_valid, image_shape, geometry):
    """Batch index, row and column of every pixel of the first n_valid blocks, each [M, BH, BW],
    and whether the pixel lies inside the image."""
    (bh, bw), (oh, ow), (sh, sw) = geometry
    n_batch, height, width = image_shape
    blocks = indices[:n_valid].astype(numpy.int64)
    n = blocks[:, 0, None, None]
    h = oh + sh * blocks[:, 1, None, None] + numpy.arange(bh)[None, :, None]
    w = ow + sw * blocks[:, 2, None, None] + numpy.arange(bw)[None, None, :]
    inside = (n >= 0) & (n < n_batch) & (h >= 0) & (h < height) & (w >= 0) & (w < width)
    shape = (n_valid, bh, bw)
    return (numpy.broadcast_to(n, shape), numpy.broadcast_to(h, shape),
            numpy.broadcast_to(w, shape), inside)


def row_plan(device, op, kernel, template_args, bh, bw, words_per_pixel):
    """KernelPlan of the row-copy kernel `kernel<template_args>` of kernels/<family>/<op>.cu:
    threadIdx.x over a row's words (about _UNROLL each), threadIdx.y over block rows."""
    row_words = bw * words_per_pixel
    threads_x = min(THREADS, max(32, 32 * math.ceil(row_words / _UNROLL / 32)))
    threads_y = max(1, min(THREADS // threads_x, bh))
    grid_y = _checks.grid_dim("bsize[0]", math.ceil(bh / threads_y))
    return _plan.KernelPlan(device, op, kernel, template_args, (1, grid_y, 1),
                            (threads_x, threads_y, 1), 0, STACK_ARGS,
                            STACK_ARGS.tail(words_per_pixel=words_per_pixel, tile_rows=0,
                                            log2_tile_c=0, pitch=0))


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def transpose_plan(device, op, kernel, element_types, bh, bw, channels, itemsize, alignment):
    """KernelPlan of the transposing kernel `kernel` of kernels/<family>/<op>.cu, whose template
    arguments are (element type, vector width V, *element_types[1:]). V elements (at most 16
    bytes) move as one access; V divides the channels, bh * bw and every tile's pixels, and the
    pointers' alignment. The tile is [tile channels][pitch], pitch a multiple of 8 * V
    (kernels/core/common.cuh, tile_index)."""
    vector = next(v for v in (8, 4, 2, 1)
                  if v * itemsize <= 16 and channels % v == 0 and (bh * bw) % v == 0
                  and alignment % (v * itemsize) == 0)
    step = vector // math.gcd(bw, vector)  # tile rows come in multiples of this

    def tile_bytes(tile_rows, tile_c):
        return tile_c * _round_up(tile_rows * bw, 8 * vector) * itemsize

    tile_c = max(vector, min(1 << max(channels - 1, 0).bit_length(), 128 // itemsize))
    while tile_c > vector and tile_bytes(step, tile_c) > _TILE_LIMIT:
        tile_c //= 2
    if tile_bytes(step, tile_c) > _TILE_LIMIT:
        raise ValueError(f"bsize[1]={bw} is too wide for transpose=True with "
                         f"{itemsize}-byte elements")
    tile_rows = step
    while tile_rows + step <= bh and tile_bytes(tile_rows + step, tile_c) <= _TILE_BYTES:
        tile_rows += step
    # Even tiles: 16 rows as 8 + 8 rather than 14 + 2.
    tiles = math.ceil(bh / tile_rows)
    tile_rows = min(tile_rows, step * math.ceil(bh / tiles / step))
    grid_yz = (_checks.grid_dim("channels", math.ceil(channels / tile_c)),
               _checks.grid_dim("bsize[0]", math.ceil(bh / tile_rows)))
    pitch = _round_up(tile_rows * bw, 8 * vector)
    return _plan.KernelPlan(device, op, kernel, (element_types[0], vector, *element_types[1:]),
                            (1, *grid_yz), (THREADS, 1, 1), tile_c * pitch * itemsize,
                            STACK_ARGS,
                            STACK_ARGS.tail(words_per_pixel=channels, tile_rows=tile_rows,
                                            log2_tile_c=tile_c.bit_length() - 1, pitch=pitch))


def launch(plan, stream, src, dst, scale, shift, indices, counts, rows, image_shape, geometry):
    """Launch a gather or scatter plan on raw addresses: `rows` stack rows of blocks `geometry`
    ((bh, bw), (oh, ow), (sh, sw)) in an image [n, height, width, ...]."""
    (bh, bw), (oh, ow), (sh, sw) = geometry
    n_batch, height, width = image_shape
    if rows >= 2**31:  # checked here, where the count is known under torch.compile too
        raise ValueError(f"active_block_indices has too many rows: {rows}")
    plan.launch(stream, src, dst, scale, shift,  # STACK_ARGS's leading values, in order
                indices, counts, rows, n_batch, height, width, bh, bw, oh, ow, sh, sw,
                grid=(rows, plan.grid[1], plan.grid[2]))
