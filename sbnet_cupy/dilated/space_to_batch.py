"""space_to_batch, batch_to_space: move the sub-lattices of an image into the batch dimension
and back (TensorFlow's ops), and atrous_conv2d, a dilated convolution built on them."""

import functools
import math
import numbers
from collections import namedtuple

import numpy

from ..core import checks as _checks, kernels as _kernels, launch as _launch, records as _records
from ..blocks.sparse_conv import conv2d_valid

DATA_FORMATS = ("NHWC", "NCHW")

# Launch shapes (kernels/space_to_batch.cu). NCHW kernels stage a tile of about _TILE_BYTES in
# shared memory, a row of it at most _ROW_BYTES of padded columns; both kernels cut their work
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


class Reshape(namedtuple("Reshape", ["x_dims", "y_hw", "block", "margins", "data_format",
                                     "batch_format"])):
    """A checked space_to_batch / batch_to_space, in the terms of the image side x.

    x_dims: (N, C, H, W) of x; y_hw: (H', W') of y; block: (BH, BW); margins: ((top, bottom),
    (left, right)), the paddings of space_to_batch or the crops of batch_to_space;
    data_format: "NHWC" or "NCHW", x's layout; batch_format: y's, the same or, with NCHW,
    "NHWC"."""

    __slots__ = ()

    def _shape(self, batch, hw, layout):
        c = self.x_dims[1]
        return (batch, c, *hw) if layout == "NCHW" else (batch, *hw, c)

    @property
    def x_shape(self):
        n, _, h, w = self.x_dims
        return self._shape(n, (h, w), self.data_format)

    @property
    def y_shape(self):
        return self._shape(self.block[0] * self.block[1] * self.x_dims[0], self.y_hw,
                           self.batch_format)


def space_to_batch(x, block, paddings=0, *, data_format="NHWC", batch_format=None, out=None):
    """Move the BH x BW sub-lattices of the zero-padded image into the batch dimension
    (tf.space_to_batch with block_shape=(BH, BW), same layout and order).

    Args:
        x: [N, H, W, C] array (NCHW: [N, C, H, W]), numpy or cupy, any dtype.
        block: BH = BW = block, or (BH, BW); ints >= 1.
        paddings: ((top, bottom), (left, right)) rows and columns of zeros around the image, or
            one int for all four; H + top + bottom must be a multiple of BH, W + left + right
            of BW.
        data_format: "NHWC" or "NCHW" (the batch ordering is the same; NCHW keeps channels
            second on both sides).
        batch_format: the result's layout: None (data_format's), or "NHWC" with data_format
            "NCHW", which moves the channels last in the same pass (for a convolution in
            channels_last; CUDA arrays need elements of 2, 4 or 8 bytes for it).
        out: optional C-contiguous array of the result's shape and dtype to write into.

    Returns:
        [BH*BW*N, H', W', C] (batch_format NCHW: [BH*BW*N, C, H', W']) array of x's dtype, with
        H' = (H + top + bottom) / BH and W' = (W + left + right) / BW::

            padded = zeros([N, H + top + bottom, W + left + right, C])
            padded[:, top:top + H, left:left + W] = x
            out[(i*BW + j)*N + n] = padded[n, i::BH, j::BW]   # i < BH, j < BW, n < N
    """
    xp = _checks.array_module(x=x)
    geometry = _checks.memoized(_CHECKED_S2B, check_space_to_batch,
                                (x, block, paddings, data_format, batch_format),
                                _checks.ARRAY_TYPES)
    with _checks.on_device(x):
        out = _output(xp, x, out, geometry.y_shape)
        if xp is numpy:
            _space_to_batch_numpy(x, geometry, out)
        else:
            launch_space_to_batch(*_cupy_call(x, out), geometry, x.itemsize)
    return out


def batch_to_space(y, block, crops=0, *, data_format="NHWC", batch_format=None, out=None):
    """The inverse of space_to_batch: interleave the BH*BW images of each group back into one
    and crop it (tf.batch_to_space with block_shape=(BH, BW), same layout and order).

    Args:
        y: [BH*BW*N, H', W', C] array (NCHW: [BH*BW*N, C, H', W']), numpy or cupy, any dtype.
        block: BH = BW = block, or (BH, BW); ints >= 1.
        crops: ((top, bottom), (left, right)) rows and columns to drop, or one int for all
            four; top + bottom <= BH*H', left + right <= BW*W'.
        data_format: "NHWC" or "NCHW", the result's layout.
        batch_format: y's layout: None (data_format's), or "NHWC" with data_format "NCHW".
        out: optional C-contiguous array of the result's shape and dtype to write into.

    Returns:
        [N, H, W, C] (NCHW: [N, C, H, W]) array of y's dtype, H = BH*H' - top - bottom and
        W = BW*W' - left - right::

            full = empty([N, BH*H', BW*W', C])
            full[n, i::BH, j::BW] = y[(i*BW + j)*N + n]   # i < BH, j < BW, n < N
            out = full[:, top:top + H, left:left + W]
    """
    xp = _checks.array_module(y=y)
    geometry = _checks.memoized(_CHECKED_B2S, check_batch_to_space,
                                (y, block, crops, data_format, batch_format),
                                _checks.ARRAY_TYPES)
    with _checks.on_device(y):
        out = _output(xp, y, out, geometry.x_shape)
        if xp is numpy:
            _batch_to_space_numpy(y, geometry, out)
        else:
            launch_batch_to_space(*_cupy_call(y, out), geometry, y.itemsize)
    return out


def atrous_conv2d(x, w, rate, padding):
    """Dilated ("atrous") stride-1 convolution with tf.nn.atrous_conv2d's semantics, computed as
    space_to_batch -> VALID convolution of the sub-lattices (conv2d_valid) -> batch_to_space.

    Args:
        x: [N, H, W, C] float array, numpy or cupy.
        w: [KH, KW, C, K] array of x's dtype (HWIO).
        rate: RH = RW = rate, or (RH, RW); ints >= 1.
        padding: "SAME" (output H x W, zeros split as TensorFlow does: the extra one at the
            bottom and right) or "VALID" (no padding). Any H and W, multiples of the rate or not.

    Returns:
        [N, OH, OW, K] array: OH = H for SAME, H - (KH - 1)*RH for VALID (likewise OW), with::

            xpad = pad(x, paddings)  # SAME: top = (KH - 1)*RH // 2, left = (KW - 1)*RW // 2
            out[n, h, w, k] = sum(xpad[n, h + RH*a, w + RW*b, c] * w[a, b, c, k]
                                  for a < KH, b < KW, c < C)
    """
    _checks.array_module(x=x, w=w)
    rate, paddings = check_atrous_conv2d(x, w, rate, padding)
    g = dilated_conv_geometry(tuple(x.shape[1:3]), tuple(w.shape[:2]), rate, paddings,
                              conv_padding=False)
    if 0 in g.out_size:
        with _checks.on_device(x):
            return _checks.array_module(x=x).zeros((x.shape[0], *g.out_size, w.shape[3]), x.dtype)
    blocks = space_to_batch(x, rate, g.paddings)
    return batch_to_space(conv2d_valid(blocks, w), rate, g.crops)


def check_atrous_conv2d(x, w, rate, padding):
    """Checks atrous_conv2d's arguments (arrays or TensorFlow tensors); returns the rate pair
    and the ((top, bottom), (left, right)) padding."""
    _checks.nhwc("x", x)
    if w.ndim != 4 or w.shape[2] != x.shape[3]:
        raise ValueError(f"w must be [KH, KW, C, K] with C = {x.shape[3]} (x's channels), "
                         f"got shape {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"w dtype {w.dtype.name} differs from x dtype {x.dtype.name}")
    rate = _checks.int_pair("rate", rate, minimum=1)
    if padding == "SAME":
        return rate, same_padding(tuple(w.shape[:2]), rate)
    if padding == "VALID":
        return rate, ((0, 0), (0, 0))
    raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")


def same_padding(kernel, rate):
    """((top, bottom), (left, right)) of a stride-1 SAME dilated convolution, as TensorFlow
    splits it (the odd one at the bottom and right)."""
    return tuple((r * (k - 1) // 2, r * (k - 1) - r * (k - 1) // 2) for k, r in zip(kernel, rate))


class DilatedConvGeometry(namedtuple("DilatedConvGeometry",
                                     ["paddings", "conv_padding", "crops", "out_size"])):
    """A stride-1 dilated convolution as space_to_batch(x, rate, paddings) -> ordinary
    convolution padded by conv_padding (PH, PW) zeros on each side -> batch_to_space(rate,
    crops), giving out_size (OH, OW)."""

    __slots__ = ()


@functools.lru_cache(maxsize=256)
def dilated_conv_geometry(size, kernel, rate, padding, *, conv_padding):
    """The DilatedConvGeometry of a stride-1 convolution of an H x W image by a KH x KW kernel
    dilated by rate (RH, RW), with `padding` ((top, bottom), (left, right)) zeros.

    The image is padded so that its size is a multiple of the rate and the sub-lattices hold
    every pixel an output reads; the crops drop the outputs past out_size, and output
    (h, w) lands at (h, w) with no crop at the top or left. With conv_padding=True the ordinary
    convolution pads min(top, bottom) // RH rows on each side itself (cuDNN does that at no
    cost), and the reshapes only the rest. ValueError if the output size would be negative."""
    dims = [_dilated_dim(*args, conv_padding) for args in zip(size, kernel, rate, padding)]
    return DilatedConvGeometry(*(tuple(d[i] for d in dims) for i in range(4)))


def _dilated_dim(size, k, r, pad, conv_padding):
    before, after = pad
    out = size + before + after - r * (k - 1)
    if out < 0:
        raise ValueError(f"the image ({size}) is smaller than the dilated kernel "
                         f"({r * (k - 1) + 1}) with padding {pad}")
    q = min(before, after) // r if conv_padding else 0
    top = before - r * q
    # Output h reads padded rows h - r*q + r*a, sub-lattice row h // r - q + a (a < k).
    reduced = max(-(-(size + top) // r), (out - 1) // r + k - 2 * q)
    crop = r * (reduced + 2 * q - k + 1) - out
    return (top, r * reduced - size - top), q, (0, crop), out


# --- checks and geometry ------------------------------------------------------------------

_CHECKED_S2B, _CHECKED_B2S = {}, {}  # _checks.memoized's, one an op


def margins(name, value):
    """((top, bottom), (left, right)) non-negative ints from an int or a 2x2 nested sequence
    (a NumPy or TensorFlow-style paddings array too)."""
    if type(value) is int:
        pairs = ((value, value), (value, value))
    elif (type(value) in (tuple, list) and len(value) == 2
          and all(type(p) in (tuple, list) and len(p) == 2 and all(type(v) is int for v in p)
                  for p in value)):
        pairs = (tuple(value[0]), tuple(value[1]))
    else:
        pairs = _general_margins(name, value)
    if min(min(p) for p in pairs) < 0:
        raise ValueError(f"{name} must be >= 0, got {pairs}")
    return pairs


def _general_margins(name, value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return ((int(value),) * 2,) * 2
    try:
        array = numpy.asarray(value)
    except Exception:
        array = None
    if array is None or array.shape != (2, 2) or array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int or [[top, bottom], [left, right]] ints, "
                        f"got {value!r}")
    return tuple(tuple(int(v) for v in row) for row in array)


def _data_format(value):
    if value not in DATA_FORMATS:
        raise ValueError(f"data_format must be 'NHWC' or 'NCHW', got {value!r}")
    return value


def _batch_format(value, data_format):
    if value is None or value == data_format:
        return data_format
    if (data_format, value) != ("NCHW", "NHWC"):
        raise ValueError(f"batch_format must be None, data_format ({data_format!r}) or, with "
                         f"'NCHW', 'NHWC', got {value!r}")
    return value


def _dims(name, shape, data_format):
    if len(shape) != 4:
        layout = "[N, H, W, C]" if data_format == "NHWC" else "[N, C, H, W]"
        raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(shape)}")
    n, a, b, c = (int(v) for v in shape)
    return (n, c, a, b) if data_format == "NHWC" else (n, a, b, c)


def check_space_to_batch(x, block, paddings, data_format="NHWC", batch_format=None):
    """Checks space_to_batch's arguments (x an array or a tensor) and returns its Reshape;
    ValueError/TypeError naming the argument otherwise."""
    data_format = _data_format(data_format)
    return space_to_batch_reshape(tuple(x.shape), _checks.int_pair("block", block, minimum=1),
                                  margins("paddings", paddings), data_format,
                                  _batch_format(batch_format, data_format))


@functools.lru_cache(maxsize=256)
def space_to_batch_reshape(x_shape, block, paddings, data_format, batch_format=None):
    """check_space_to_batch on arguments already in their checked form (tuples of ints, a
    checked layout): cached, for the bridges' calls."""
    n, c, h, w = _dims("x", x_shape, data_format)
    (bh, bw), ((top, bottom), (left, right)) = block, paddings
    padded = (h + top + bottom, w + left + right)
    if padded[0] % bh or padded[1] % bw:
        raise ValueError(f"paddings {paddings} make the padded image {padded[0]}x{padded[1]}, "
                         f"not a multiple of block {block}")
    return Reshape((n, c, h, w), (padded[0] // bh, padded[1] // bw), block, paddings,
                   data_format, batch_format or data_format)


def check_batch_to_space(y, block, crops, data_format="NHWC", batch_format=None):
    """Checks batch_to_space's arguments (y an array or a tensor) and returns its Reshape."""
    data_format = _data_format(data_format)
    return batch_to_space_reshape(tuple(y.shape), _checks.int_pair("block", block, minimum=1),
                                  margins("crops", crops), data_format,
                                  _batch_format(batch_format, data_format))


@functools.lru_cache(maxsize=256)
def batch_to_space_reshape(y_shape, block, crops, data_format, batch_format=None):
    """check_batch_to_space on arguments in their checked form: cached, for the bridges."""
    batch_format = batch_format or data_format
    batch, c, hq, wq = _dims("y", y_shape, batch_format)
    (bh, bw), ((top, bottom), (left, right)) = block, crops
    if batch % (bh * bw):
        raise ValueError(f"y's batch {batch} is not a multiple of block {bh}x{bw} = {bh * bw}")
    h, w = bh * hq - top - bottom, bw * wq - left - right
    if h < 0 or w < 0:
        raise ValueError(f"crops {crops} remove more than the {bh * hq}x{bw * wq} image")
    return Reshape((batch // (bh * bw), c, h, w), (hq, wq), block, crops, data_format,
                   batch_format)


def _output(xp, like, out, shape):
    if out is None:
        return xp.empty(shape, dtype=like.dtype)
    _checks.array_module(like=like, out=out)
    if out.shape != shape or out.dtype != like.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {like.dtype} array of shape {shape}, "
                         f"got {out.dtype} {out.shape}")
    return out


# --- NumPy ----------------------------------------------------------------------------------

def _sub_lattice_view(g, a):
    """The padded image side, a [N, H'*BH, W'*BW, C] (NCHW: [N, C, H'*BH, W'*BW]) array, as a
    [BH, BW, N, H', W', C] (NCHW: [BH, BW, N, C, H', W']) view: the layout of y."""
    (n, c, _, _), (hq, wq), (bh, bw) = g.x_dims, g.y_hw, g.block
    if g.data_format == "NHWC":
        return a.reshape(n, hq, bh, wq, bw, c).transpose(2, 4, 0, 1, 3, 5)
    return a.reshape(n, c, hq, bh, wq, bw).transpose(3, 5, 0, 1, 2, 4)


def _inner(g):
    """Index of the image inside the padded image."""
    (_, _, h, w), ((top, _), (left, _)) = g.x_dims, g.margins
    rows, cols = slice(top, top + h), slice(left, left + w)
    if g.data_format == "NHWC":
        return (slice(None), rows, cols)
    return (slice(None), slice(None), rows, cols)


def _padded_shape(g):
    (n, c, _, _), (hq, wq), (bh, bw) = g.x_dims, g.y_hw, g.block
    return (n, hq * bh, wq * bw, c) if g.data_format == "NHWC" else (n, c, hq * bh, wq * bw)


def _space_to_batch_numpy(x, g, out):
    padded = numpy.zeros(_padded_shape(g), dtype=x.dtype)
    padded[_inner(g)] = x
    view = _sub_lattice_view(g, padded)
    if g.batch_format == g.data_format:
        out.reshape(view.shape)[...] = view
    else:  # NCHW x, NHWC y
        out[...] = view.reshape(out.shape[0], *view.shape[3:]).transpose(0, 2, 3, 1)


def _batch_to_space_numpy(y, g, out):
    padded = numpy.empty(_padded_shape(g), dtype=y.dtype)
    view = _sub_lattice_view(g, padded)
    if g.batch_format != g.data_format:  # NHWC y, NCHW x
        y = y.transpose(0, 3, 1, 2)
    view[...] = y.reshape(view.shape)
    out[...] = padded[_inner(g)]


# --- CUDA -----------------------------------------------------------------------------------

def _cupy_call(src, dst):
    """(device, stream, src address, dst address) of a launch on CuPy arrays."""
    import cupy

    src = src if src.flags.c_contiguous else cupy.ascontiguousarray(src)
    return src.data.device_id, cupy.cuda.get_current_stream().ptr, src.data.ptr, dst.data.ptr


def launch_space_to_batch(device, stream, x, y, geometry, itemsize):
    """The CUDA space_to_batch on raw addresses (checked arguments): C-contiguous x and y of
    geometry's shapes (a Reshape from check_space_to_batch), elements of `itemsize` bytes, on
    `device` and `stream` (a cudaStream_t address)."""
    _launch_reshape(device, stream, "space_to_batch", geometry, x, y, itemsize)


def launch_batch_to_space(device, stream, y, x, geometry, itemsize):
    """The CUDA batch_to_space on raw addresses, as launch_space_to_batch (geometry from
    check_batch_to_space)."""
    _launch_reshape(device, stream, "batch_to_space", geometry, x, y, itemsize)


def _launch_reshape(device, stream, op, geometry, x, y, itemsize):
    plan = _plan(device, op, geometry, itemsize, _checks.alignment(x, y))
    if plan is not None:
        function, grid, block, smem, arguments, values = plan
        _launch.launch(device, stream, function, grid, block, smem, arguments, (x, y) + values)


def _divisor(d):
    """(d, mul, shift) such that (n * mul) >> shift == n // d for 0 <= n < 2**31 (d >= 1):
    mul = ceil(2**shift / d) with shift = 31 + ceil(log2(d)), so mul < 2**32 and the error
    n * (mul * d - 2**shift) / 2**shift stays below 1 / d."""
    shift = 31 + (d - 1).bit_length()
    return _records.DIVISOR.values(d=d, mul=-(-(1 << shift) // d), shift=shift)


@functools.lru_cache(maxsize=256)
def _plan(device, op, g, itemsize, align):
    """(kernel address on `device`, grid, CTA, shared-memory bytes, argument struct, values
    after the two pointers) of a launch, None if the output is empty; `align` is the largest
    power of two (<= 16) dividing both pointers."""
    shape = _shape_plan(op, g, itemsize, align)
    if shape is None:
        return None
    kernel, template, *launch = shape
    return (_launch.function(device, "space_to_batch", kernel, *template), *launch)


def _shape_plan(op, g, itemsize, align):
    """_plan's kernel name and template arguments instead of its address (no GPU needed)."""
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
        return _nchw_plan(op, n, c, h, w, hq, wq, bh, bw, top, left, itemsize, align, True)
    if g.data_format == "NHWC" or not nchw_kernel:
        # NCHW with a very wide block, or elements of an odd size or alignment, moves elements
        # as the pixels of an NHWC [N*C, H, W, 1].
        n, words_bytes = (n, c * itemsize) if g.data_format == "NHWC" else (n * c, itemsize)
        return _nhwc_plan(op, n, h, w, hq, wq, bh, bw, top, left, words_bytes, align)
    return _nchw_plan(op, n, c, h, w, hq, wq, bh, bw, top, left, itemsize, align, False)


def _nhwc_plan(op, n, h, w, hq, wq, bh, bw, top, left, pixel_bytes, align):
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
    return (f"{op}_nhwc", (_kernels.STORAGE_CTYPES[word],), (row_ctas, chunks, 1),
            (threads_x, threads_y, 1), 0, _NHWC_ARGS, values)


def _nchw_plan(op, n, c, h, w, hq, wq, bh, bw, top, left, itemsize, align, channels_last):
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
    return (f"{op}_nchw", (_kernels.STORAGE_CTYPES[itemsize], vector, vector_y, channels_last),
            grid, (_THREADS, 1, 1), tile_bands * band_words * 4, _NCHW_ARGS, values)


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
