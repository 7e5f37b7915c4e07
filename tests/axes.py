"""Test axes shared by the op tests: geometries, channel counts, dtypes, block lists."""

import numpy

# (image H, W), bsize, boffset, bstride, bcount
GEOMETRIES = {
    "edge-straddling": ((13, 17), (4, 4), (0, 0), (4, 4), (4, 5)),
    "negative-offset-overlap-nonsquare": ((13, 17), (5, 3), (-1, -2), (4, 2), (4, 9)),
    "block-larger-than-image": ((9, 11), (16, 18), (-3, -3), (16, 18), (1, 1)),
    "gaps-between-blocks": ((20, 24), (3, 3), (1, 2), (5, 6), (4, 4)),
    "specialised-8-overlap": ((18, 18), (8, 8), (-1, -1), (6, 6), (3, 3)),
    "sbnet-3x3-halo-18": ((34, 40), (18, 18), (-1, -1), (16, 16), (3, 3)),
}
CHANNELS = (1, 3, 32, 40)
FLOAT_DTYPES = (numpy.float16, numpy.float32, numpy.float64)
MOVE_DTYPES = FLOAT_DTYPES + (numpy.int8, numpy.int64)


def overlapping(geometry):
    (bh, bw), _, (sh, sw) = geometry
    return sh < bh or sw < bw


def random_array(rng, shape, dtype):
    """Random values with no zeros, exact in every dtype (multiples of 1/8 in [-8, 8))."""
    if numpy.dtype(dtype).kind in "iu":
        values = rng.integers(1, 100, size=shape)
    else:
        values = (rng.integers(1, 64, size=shape) * rng.choice([-1, 1], size=shape)) / 8
    return values.astype(dtype)


def block_list(rng, n_batch, bcount, *, n_blocks, out_of_range=True):
    """Random (n, hi, wi) rows, some listed twice and some out of range when asked."""
    rows = numpy.stack([rng.integers(0, n_batch, n_blocks), rng.integers(0, bcount[0], n_blocks),
                        rng.integers(0, bcount[1], n_blocks)], axis=1)
    if out_of_range and n_blocks >= 4:
        rows[0] = (n_batch, 0, 0)  # batch index past N
        rows[1] = (-1, 0, 0)
        rows[2] = (0, bcount[0] + 3, 0)  # entirely below the image
        rows[3] = (0, 0, -5)
    return rows.astype(numpy.int32)


def distinct_block_list(rng, n_batch, bcount, *, n_blocks):
    """Distinct in-range (n, hi, wi) rows, in random order."""
    total = n_batch * bcount[0] * bcount[1]
    ids = rng.choice(total, size=min(n_blocks, total), replace=False)
    n, rest = numpy.divmod(ids, bcount[0] * bcount[1])
    hi, wi = numpy.divmod(rest, bcount[1])
    return numpy.stack([n, hi, wi], axis=1).astype(numpy.int32)
