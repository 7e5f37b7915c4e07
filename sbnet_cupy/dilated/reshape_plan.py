"""The CUDA space_to_batch / batch_to_space: each launch's KernelPlan (core/plan.py: kernel,
grid, tile, the argument record's values) from the reshape's geometry, and the launch on any
backend's arrays (CuPy's, torch's)."""

import functools
import math

import numpy

from ..core import checks as _checks, kernels as _kernels, plan as _plan, records as _records

# Launch shapes (kernels/dilated/space_to_batch.cu). NCHW kernels stage a tile of about _TILE_BYTES
# in shared memory, a row of it at most _ROW_BYTES of padded columns; both kernels cut their work
# small enough to give the GPU at least _MIN_CTAS CTAs when the tensor allows.
_THREADS = 256  # THREADS in the kernel source
_UNROLL = 4  # UNROLL in the kernel source
_TILE_BYTES = 16 * 1024
_ROW_BYTES = 8 * 1024
_MIN_CTAS = 512
_SECTOR = 32  # bytes: the unit of a memory transaction, which a warp's accesses should fill
_BANKS = 32
_INT32_LIMIT = 2**31

# The kernels' argument records (sbnet_cupy/core/records.py): x, y, ints and (d, mul, shift)
# divisors; the plans build all but x and y by name (Record.tail).
_NHWC_ARGS = _records.NHWC_ARGS
_NCHW_ARGS = _records.NCHW_ARGS
_OP = "space_to_batch"  # kernels/dilated/space_to_batch.cu


# --- CUDA -----------------------------------------------------------------------------------

def launch_reshape(backend, op, src, dst, geometry):
    """The CUDA space_to_batch (op "space_to_batch": src is x, dst y) or batch_to_space (src y,
    dst x) on `backend`'s arrays (core.backend.CUPY, or torch_bridge's TORCH), checked: src and
    dst C-contiguous in the layouts that `geometry` (the Reshape of check_space_to_batch or
    check_batch_to_space) gives x and y, or tensors whose memory is laid out so."""
    device = backend.device(src)
    src_address, dst_address = backend.pointer(src), backend.pointer(dst)
    plan = reshape_plan(device, op, geometry, backend.itemsize(src),
                        _checks.alignment(src_address, dst_address))
    if plan is not None:  # None: nothing to move
        x, y = ((src_address, dst_address) if op == "space_to_batch"
                else (dst_address, src_address))
        plan.launch(backend.stream(device), x, y)


def _divisor(d):
    """(d, mul, shift) such that (n * mul) >> shift == n // d for 0 <= n < 2**31 (d >= 1):
    mul = ceil(2**shift / d) with shift = 31 + ceil(log2(d)), so mul < 2**32 and the error
    n * (mul * d - 2**shift) / 2**shift stays below 1 / d."""
    shift = 31 + (d - 1).bit_length()
    return _records.DIVISOR.values(d=d, mul=-(-(1 << shift) // d), shift=shift)


@functools.lru_cache(maxsize=256)
def reshape_plan(device, op, g, itemsize, align):
    """The KernelPlan of op ("space_to_batch" or "batch_to_space") with Reshape g on `device`
    (None: no GPU, a plan for tests), None if the output is empty: elements of `itemsize` bytes,
    `align` the largest power of two (<= 16) dividing both addresses. A launch passes x and y
    (their addresses), the plan the rest of the record."""
    (n, c, h, w), (hq, wq), (bh, bw) = g.x_dims, g.y_hw, g.block
    (top, _), (left, _) = g.margins
    if n * c * (hq * wq if op == "space_to_batch" else h * w) == 0:
        return None
    nchw_kernel = (bw * itemsize <= _ROW_BYTES and itemsize in _kernels.STORAGE_CTYPES
                   and align >= itemsize)
    if g.batch_format != g.data_format:
        if not nchw_kernel or itemsize not in _kernels.CHANNELS_LAST_ITEMSIZES:
            raise ValueError(f"batch_format {g.batch_format!r} with data_format "
                             f"{g.data_format!r} needs elements of 2, 4 or 8 bytes, aligned, "
                             f"and block_w * itemsize <= {_ROW_BYTES} on the GPU, got block "
                             f"{g.block} and {itemsize}-byte elements aligned to {align}")
        return _nchw_plan(device, op, n, c, h, w, hq, wq, bh, bw, top, left, itemsize, align,
                          True)
    if g.data_format == "NHWC" or not nchw_kernel:
        # NCHW with a very wide block, or elements of an odd size or alignment, moves elements
        # as the pixels of an NHWC [N*C, H, W, 1].
        n, words_bytes = (n, c * itemsize) if g.data_format == "NHWC" else (n * c, itemsize)
        return _nhwc_plan(device, op, n, h, w, hq, wq, bh, bw, top, left, words_bytes, align)
    return _nchw_plan(device, op, n, c, h, w, hq, wq, bh, bw, top, left, itemsize, align, False)


def _nhwc_plan(device, op, n, h, w, hq, wq, bh, bw, top, left, pixel_bytes, align):
    word = _kernels.widest_access(pixel_bytes, align)
    words = pixel_bytes // word
    if op == "space_to_batch":
        rows, row_words = bh * bw * n * hq, wq * words
    else:
        rows, row_words = n * h, w * words
    threads_x = min(_THREADS, max(32, 32 * math.ceil(row_words / _UNROLL / 32)))
    threads_y = _THREADS // threads_x
    row_ctas = math.ceil(rows / threads_y)
    chunks = max(1, min(math.ceil(_MIN_CTAS / row_ctas),
                        math.ceil(row_words / (threads_x * _UNROLL))))
    chunk = math.ceil(row_words / chunks)
    _check_int32(rows=rows, row_words=row_words + chunk, padded_width=bw * wq)
    values = _NHWC_ARGS.tail(n=n, height=h, width=w, out_w=wq, off_h=top, off_w=left,
                             chunk=chunk, words=_divisor(words), block_h=_divisor(bh),
                             block_w=_divisor(bw), out_h=_divisor(hq))
    return _plan.KernelPlan(device, _OP, f"{op}_nhwc", (_kernels.STORAGE_CTYPES[word],),
                            (row_ctas, chunks, 1), (threads_x, threads_y, 1), 0, _NHWC_ARGS,
                            values)


def _nchw_plan(device, op, n, c, h, w, hq, wq, bh, bw, top, left, itemsize, align,
               channels_last):
    """The NCHW kernels' launch; channels_last: y is NHWC (CL in the kernel source)."""
    def row_limit(v):  # channels last, a tile holds a vector of bands at least
        return min(_ROW_BYTES, _TILE_BYTES // v) if channels_last else _ROW_BYTES

    def widest(*multiples_of):  # elements of the widest aligned access dividing them all
        return _kernels.widest_access(math.gcd(*multiples_of) * itemsize, align) // itemsize

    # x's vectors; channels last, y's vectors are bands and take the same width.
    vector = widest(w, left, *((c,) if channels_last else ()))
    while vector * itemsize * bw > row_limit(vector):  # 1 fits: bw * itemsize <= _ROW_BYTES
        vector //= 2
    # Columns of y a tile takes: all of them unless a padded row would pass the limit.
    most = row_limit(vector) // (bw * itemsize) // vector * vector
    column_tiles = math.ceil(wq / most)
    # Tiles after the first start at columns of x that vectors divide.
    tile_cols = wq if column_tiles == 1 else -(-math.ceil(wq / column_tiles) // vector) * vector
    row_vectors = -(-tile_cols * bw // vector)
    words = -(-row_vectors * vector * itemsize // 4)
    row_bytes = 4 * (words + (words - 1) // 32)  # with its pad words
    # Channels last, a tile's bands are channels of one (b, hq), vector of them at least: twice
    # the shared memory, for runs of y (tile_bands channels) that fill sectors.
    budget, least = (2 * _TILE_BYTES, vector) if channels_last else (_TILE_BYTES, 1)
    tile_rows = min(bh, max(1, budget // (least * row_bytes)))
    row_tiles = math.ceil(bh / tile_rows)
    bands = n * c * hq
    tile_bands = max(least, min(budget // (tile_rows * row_bytes), bands,
                                bands * row_tiles * column_tiles // _MIN_CTAS))
    if channels_last:
        tile_bands = max(d for d in range(vector, c + 1, vector)
                         if c % d == 0 and d <= tile_bands or d == vector)
        vector_y, col_vectors = vector, tile_bands // vector
    else:
        if column_tiles == 1:
            # A whole number of sectors in each (i, j)'s run of y, tile_bands * out_w elements.
            per_sector = _SECTOR // math.gcd(_SECTOR, wq * itemsize)
            if tile_bands > per_sector:
                tile_bands -= tile_bands % per_sector
            # y's vectors run along the run, across its rows: they divide the tiles' runs and
            # the sub-lattices (bands * out_w elements).
            vector_y = widest(tile_bands * wq, bands * wq)
        else:  # runs of tile_cols columns of each row: y's vectors stay in a row
            vector_y = widest(tile_cols, wq)
        col_vectors = tile_bands * tile_cols // vector_y
    row_words, band_words = _tile_pitches(words, tile_rows, tile_bands, tile_cols, col_vectors,
                                          row_vectors, bw, vector, vector_y, itemsize,
                                          channels_last)
    _check_int32(bands=bands + 16 * _THREADS, padded_height=hq * bh, padded_width=wq * bw,
                 y_run=tile_bands * tile_cols)
    grid = (math.ceil(bands / tile_bands), _checks.grid_dim("block rows", row_tiles),
            _checks.grid_dim("columns", column_tiles))
    values = _NCHW_ARGS.tail(
        height=h, width=w, out_w=wq, block_h=bh, bands=bands, off_h=top, off_w=left,
        row_words=row_words, band_words=band_words, out_h=_divisor(hq), block_w=_divisor(bw),
        channels=_divisor(c), tile_rows=_divisor(tile_rows), tile_bands=_divisor(tile_bands),
        tile_cols=_divisor(tile_cols), row_vectors=_divisor(row_vectors),
        col_vectors=_divisor(col_vectors))
    return _plan.KernelPlan(device, _OP, f"{op}_nchw",
                            (_kernels.STORAGE_CTYPES[itemsize], vector, vector_y, channels_last),
                            grid, (_THREADS, 1, 1), tile_bands * band_words * 4, _NCHW_ARGS,
                            values)


def _tile_pitches(words, tile_rows, tile_bands, tile_cols, col_vectors, row_vectors, bw, vector,
                  vector_y, itemsize, channels_last):
    """(row_words, band_words) of the NCHW tile: the pitches of its rows and bands in shared
    memory, `words` and their pad words plus the extra pads (up to 1 a row, 31 a band) on which
    the first warps' accesses conflict least on the banks, taken in the orders of the kernel's
    locate_x and locate_y (the first word of each access: the others shift every thread
    alike)."""
    t = numpy.arange(4 * 32)
    v, r = t % col_vectors, t // col_vectors
    if channels_last:  # y's side: bands v * vector + e at tile column o, row ii, column j
        o, ij = r % tile_cols, r // tile_cols
        y_places = [(v * vector + e, (o * bw + ij % bw) * itemsize) for e in range(vector)]
    else:  # y's side: element v * vector_y + e of the run of tile row ii, sub-lattice column j
        ij, flat = r, v * vector_y
        y_places = [((flat + e) // tile_cols, ((flat + e) % tile_cols * bw + ij % bw) * itemsize)
                    for e in range(vector_y)]
    # x's side: vector k of tile row (g, ii); k fastest.
    r = t // row_vectors
    x_places = [(r // tile_rows, t % row_vectors * vector * itemsize)]
    pads = numpy.arange(2)[:, None, None], numpy.arange(32)[None, :, None]
    row_words = words + (words - 1) // 32 + pads[0]
    band_words = tile_rows * row_words + pads[1]
    accesses = [band * band_words + (ij // bw) * row_words + b // 4 + b // 128
                for band, b in y_places]
    accesses += [band * band_words + r % tile_rows * row_words + b // 4 + b // 128
                 for band, b in x_places]
    # Wavefronts of an access: the most distinct words that a warp asks of one bank.
    warps = numpy.stack(numpy.broadcast_arrays(*accesses))
    warps = numpy.sort(warps.reshape(*warps.shape[:-1], -1, 32), axis=-1)
    distinct = numpy.ones(warps.shape, bool)
    distinct[..., 1:] = warps[..., 1:] != warps[..., :-1]
    per_bank = numpy.zeros(warps.shape[:-1] + (_BANKS,), numpy.int64)
    index = numpy.indices(warps.shape[:-1] + (1,), sparse=True)[:-1]
    numpy.add.at(per_bank, (*index, warps % _BANKS), distinct.astype(numpy.int64))
    cost = per_bank.max(axis=-1).sum(axis=(0, 3)).reshape(-1)  # by (row pad, band pad)
    row_pad, band_pad = divmod(int(numpy.argmin(cost)), 32)  # the first cheapest: small pads
    rows = words + (words - 1) // 32 + row_pad
    return rows, tile_rows * rows + band_pad


def _check_int32(**counts):
    for name, value in counts.items():
        if value >= _INT32_LIMIT:
            raise ValueError(f"tensor too large for the reshape kernels ({name} = {value})")
