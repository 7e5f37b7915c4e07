"""space_to_batch, batch_to_space: move the sub-lattices of an image into the batch dimension
and back (TensorFlow's ops), and atrous_conv2d, a dilated convolution built on them."""

import functools
import numbers
from collections import namedtuple

import numpy

from ..core import backend as _backend, checks as _checks
from ..blocks.sparse_conv import conv2d_valid
from .reshape_plan import launch_reshape

DATA_FORMATS = ("NHWC", "NCHW")


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
    return _reshape(xp, "space_to_batch", x, geometry, geometry.y_shape, out)


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
    return _reshape(xp, "batch_to_space", y, geometry, geometry.x_shape, out)


def _reshape(xp, op, src, geometry, shape, out):
    """space_to_batch (op "space_to_batch", src x) or batch_to_space (src y) of checked
    arguments into `out` (None: a new array of `shape`)."""
    with _checks.on_device(src):
        out = _output(xp, src, out, shape)
        if xp is numpy:
            numpy_reshape = (_space_to_batch_numpy if op == "space_to_batch"
                             else _batch_to_space_numpy)
            numpy_reshape(src, geometry, out)
        else:
            launch_reshape(_backend.CUPY, op, _backend.CUPY.contiguous(src), out, geometry)
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
    return _reshape_of(space_to_batch_reshape, x, block, "paddings", paddings, data_format,
                       batch_format)


def _reshape_of(reshape, src, block, margins_name, value, data_format, batch_format):
    """reshape (space_to_batch_reshape or batch_to_space_reshape) of the arguments checked and
    put in their checked form; margins_name: "paddings" or "crops", whose value is `value`."""
    data_format = _data_format(data_format)
    return reshape(tuple(src.shape), _checks.int_pair("block", block, minimum=1),
                   margins(margins_name, value), data_format,
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
    return _reshape_of(batch_to_space_reshape, y, block, "crops", crops, data_format,
                       batch_format)


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
