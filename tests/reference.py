"""Plain-loop references, written straight from the SBNet README's pseudo-code.

Slow and obvious on purpose: every backend is compared against these.
"""

import numpy


def block_window(geometry, hi, wi):
    """Top-left pixel of block (hi, wi)."""
    (_, _), (oh, ow), (sh, sw) = geometry
    return oh + sh * hi, ow + sw * wi


def reduce_mask(mask, bcount, geometry, tol, avgpool):
    (bh, bw) = geometry[0]
    n_batch, height, width = mask.shape
    active = []
    for n in range(n_batch):
        for hi in range(bcount[0]):
            for wi in range(bcount[1]):
                h0, w0 = block_window(geometry, hi, wi)
                values = [float(mask[n, h, w])
                          for h in range(h0, h0 + bh) for w in range(w0, w0 + bw)
                          if 0 <= h < height and 0 <= w < width]
                if avgpool:
                    pooled = sum(values) / (bh * bw)
                else:
                    pooled = max(values, default=-numpy.inf)
                if pooled > tol:
                    active.append((n, hi, wi))
    return numpy.array(active, dtype=numpy.int32).reshape(-1, 3)


def _pixels(x_shape, geometry, block):
    """(r, c, n, h, w) for the pixels of one block that lie inside the tensor."""
    n_batch, height, width = x_shape[:3]
    (bh, bw) = geometry[0]
    n, hi, wi = (int(v) for v in block)
    h0, w0 = block_window(geometry, hi, wi)
    for r in range(bh):
        for c in range(bw):
            h, w = h0 + r, w0 + c
            if 0 <= n < n_batch and 0 <= h < height and 0 <= w < width:
                yield r, c, n, h, w


def sparse_gather(x, indices, count, geometry, transpose):
    (bh, bw) = geometry[0]
    out = numpy.zeros((len(indices), bh, bw, x.shape[3]), x.dtype)
    for m in range(min(count, len(indices))):
        for r, c, n, h, w in _pixels(x.shape, geometry, indices[m]):
            out[m, r, c, :] = x[n, h, w, :]
    return out.transpose(0, 3, 1, 2) if transpose else out


def sparse_scatter(blocks, indices, count, ybase, geometry, add, transpose):
    y = ybase.copy()
    stack = blocks.transpose(0, 2, 3, 1) if transpose else blocks
    for m in range(min(count, len(indices))):
        for r, c, n, h, w in _pixels(y.shape, geometry, indices[m]):
            if add:
                y[n, h, w, :] += stack[m, r, c, :]
            else:
                y[n, h, w, :] = stack[m, r, c, :]
    return y


def covering_values(blocks, indices, count, y_shape, geometry, transpose):
    """For each pixel, the values that the blocks covering it would write there."""
    stack = blocks.transpose(0, 2, 3, 1) if transpose else blocks
    candidates = {}
    for m in range(min(count, len(indices))):
        for r, c, n, h, w in _pixels(y_shape, geometry, indices[m]):
            candidates.setdefault((n, h, w), []).append(stack[m, r, c, :])
    return candidates


def conv2d_same(x, w):
    """Stride-1 SAME convolution, NHWC by HWIO, by summing shifted products."""
    kh, kw = w.shape[:2]
    padded = numpy.pad(x.astype(numpy.float64),
                       ((0, 0), ((kh - 1) // 2, kh // 2), ((kw - 1) // 2, kw // 2), (0, 0)))
    height, width = x.shape[1:3]
    out = numpy.zeros(x.shape[:3] + (w.shape[3],))
    for i in range(kh):
        for j in range(kw):
            out += padded[:, i:i + height, j:j + width] @ w[i, j].astype(numpy.float64)
    return out


def covered(indices, count, shape, bsize_out):
    """Output pixels of the valid blocks: block (n, hi, wi) owns rows hi*b.. and cols wi*b.."""
    mask = numpy.zeros(shape, bool)
    for n, hi, wi in indices[:count]:
        mask[n, hi * bsize_out:(hi + 1) * bsize_out, wi * bsize_out:(wi + 1) * bsize_out] = True
    return mask


def space_to_batch(x, block, paddings, nchw=False):
    """tf.space_to_batch's definition, one output pixel at a time (NHWC; NCHW by transposing)."""
    x = x.transpose(0, 2, 3, 1) if nchw else x
    (bh, bw), ((top, bottom), (left, right)) = block, paddings
    n_batch, height, width, channels = x.shape
    hq, wq = (height + top + bottom) // bh, (width + left + right) // bw
    out = numpy.zeros((bh * bw * n_batch, hq, wq, channels), x.dtype)
    for i in range(bh):
        for j in range(bw):
            for n in range(n_batch):
                for a in range(hq):
                    for b in range(wq):
                        h, w = a * bh + i - top, b * bw + j - left
                        if 0 <= h < height and 0 <= w < width:
                            out[(i * bw + j) * n_batch + n, a, b, :] = x[n, h, w, :]
    return out.transpose(0, 3, 1, 2) if nchw else out


def batch_to_space(y, block, crops, nchw=False):
    """tf.batch_to_space's definition, one output pixel at a time (NHWC; NCHW by transposing)."""
    y = y.transpose(0, 2, 3, 1) if nchw else y
    (bh, bw), ((top, bottom), (left, right)) = block, crops
    batch, hq, wq, channels = y.shape
    n_batch = batch // (bh * bw)
    height, width = bh * hq - top - bottom, bw * wq - left - right
    out = numpy.zeros((n_batch, height, width, channels), y.dtype)
    for n in range(n_batch):
        for h in range(height):
            for w in range(width):
                hp, wp = h + top, w + left
                out[n, h, w, :] = y[((hp % bh) * bw + wp % bw) * n_batch + n, hp // bh, wp // bw, :]
    return out.transpose(0, 3, 1, 2) if nchw else out


def dilated_conv2d(x, w, rate, paddings):
    """Stride-1 dilated convolution, NHWC by HWIO, zero padding ((top, bottom), (left, right)),
    summed in float64 one output pixel and tap at a time."""
    (rh, rw), ((top, bottom), (left, right)) = rate, paddings
    n_batch, height, width, _ = x.shape
    kh, kw, _, k = w.shape
    oh, ow = height + top + bottom - rh * (kh - 1), width + left + right - rw * (kw - 1)
    x, w = x.astype(numpy.float64), w.astype(numpy.float64)
    out = numpy.zeros((n_batch, oh, ow, k))
    for h in range(oh):
        for v in range(ow):
            for a in range(kh):
                for b in range(kw):
                    hi, wi = h - top + rh * a, v - left + rw * b
                    if 0 <= hi < height and 0 <= wi < width:
                        out[:, h, v, :] += x[:, hi, wi, :] @ w[a, b]
    return out


def zero_inserted_kernel(tf, w, dilations):
    """The TensorFlow tensor w [KH, KW, C, K] with dilation - 1 zero rows (columns) between its
    taps: convolving by it without dilation is the dilated convolution by w. TensorFlow 2.21's
    CPU kernels refuse the gradients of a dilated convolution; built from differentiable ops,
    this gives them through the undilated one."""
    for axis, d in enumerate(dilations):
        if d > 1:
            size = w.shape[axis]
            shape = list(w.shape)
            shape[axis] = size * d
            w = tf.reshape(tf.stack([w] + [tf.zeros_like(w)] * (d - 1), axis=axis + 1), shape)
            w = tf.gather(w, tf.range((size - 1) * d + 1), axis=axis)
    return w
