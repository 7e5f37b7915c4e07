"""The rulebooks' NumPy backend (the reference, and the CPU path): sorted int64 keys and
searchsorted stand in for the CUDA hash table; the maps come out tap by tap with the pairs a
CPU caller multiplies through (Rulebook.tap_pairs)."""

import math

import numpy


def checked_keys(coords, shape, batch, name):
    """Linearised int64 keys of checked coords ((b * S0 + c0) * S1 + c1 ...), refusing rows
    outside the grid and duplicates."""
    limits = numpy.array((batch, *shape))
    outside = numpy.any((coords < 0) | (coords >= limits), axis=1)
    if outside.any():
        row = int(numpy.flatnonzero(outside)[0])
        raise ValueError(f"{name} row {row} = {tuple(coords[row].tolist())} is outside "
                         f"batch_size x spatial_shape = {batch} x {shape}")
    keys = linearise(numpy, coords, shape)
    ordered = numpy.sort(keys)
    repeated = numpy.flatnonzero(ordered[1:] == ordered[:-1])
    if repeated.size:
        site = decode(numpy, ordered[repeated[:1]], shape)[0]
        raise ValueError(f"{name} has duplicate rows, e.g. {tuple(site.tolist())}")
    return keys


def linearise(xp, coords, shape):
    keys = coords[:, 0].astype(xp.int64)
    for axis, size in enumerate(shape):
        keys = keys * size + coords[:, 1 + axis]
    return keys


def decode(xp, keys, shape):
    """int32 coords [len(keys), 1 + D] of linearised keys."""
    columns = []
    for size in reversed(shape):
        keys, c = xp.divmod(keys, size)
        columns.append(c)
    columns.append(keys)
    return xp.stack(columns[::-1], axis=1).astype(xp.int32).reshape(-1, 1 + len(shape))


def kernel_offsets(kernel):
    """[K, D] kernel offsets in row-major order (the weight's kernel axes)."""
    return numpy.indices(kernel).reshape(len(kernel), -1).T


class _SortedTable:
    """Sorted keys and their rows: the NumPy backend's stand-in for the hash table."""

    def __init__(self, keys):
        self.order = numpy.argsort(keys, kind="stable").astype(numpy.int32)
        self.sorted = keys[self.order]

    def find(self, keys):
        """Row (int32) of each key, -1 where absent."""
        if self.sorted.size == 0:
            return numpy.full(keys.shape, -1, numpy.int32)
        pos = numpy.searchsorted(self.sorted, keys)
        pos[pos == self.sorted.size] = 0
        rows = self.order[pos]
        rows[self.sorted[pos] != keys] = -1
        return rows


def submanifold_maps(coords, keys, shape, geometry):
    """neighbors, neighbors_t and tap_pairs (see Rulebook) of a submanifold rulebook on coords
    (linearised `keys`). With an odd kernel, tap K-1-k is tap k backwards (offsets -d and d),
    so only the first half of the taps is looked up, the centre reads each site itself, the
    rest is the first half turned around, and neighbors_t is neighbors with the taps
    reversed."""
    kernel, _, padding, dilation = geometry
    valid = _tap_valid(coords, shape, *geometry)
    # A neighbour's key is the site's plus its offset's (valid where it lies inside the grid).
    strides = numpy.cumprod((1,) + shape[:0:-1])[::-1]
    delta = (kernel_offsets(kernel) * numpy.array(dilation) - numpy.array(padding)) @ strides
    table = _SortedTable(keys)
    taps, n = valid.shape
    neighbors = numpy.full(valid.shape, -1, numpy.int32)
    if any(k % 2 == 0 for k in kernel):
        query = keys[None, :] + delta[:, None]
        neighbors[valid] = table.find(query[valid])
        neighbors_t, tap, row = _transposed_map(neighbors, n)
        return neighbors, neighbors_t, _split_pairs(tap, row, neighbors[tap, row], taps)
    half = taps // 2
    first = neighbors[:half]
    if dilation[-1] == 1:
        _find_runs(table, keys, delta, valid, kernel[-1], first)
    else:
        first[valid[:half]] = table.find((keys[None, :] + delta[:half, None])[valid[:half]])
    neighbors[half] = numpy.arange(n)
    flat, tap, row = nonzero_2d(first >= 0)
    read = first.reshape(-1)[flat]
    neighbors.reshape(-1)[(taps - 1 - tap) * n + read] = row
    pairs = _split_pairs(tap, row, read, half)
    pairs = pairs + [None] + [(i, o) for o, i in reversed(pairs)]
    return neighbors, neighbors[::-1].copy(), pairs  # a copy: [1, n] keeps a negative stride


def _find_runs(table, keys, delta, valid, run, out):
    """out[t] = the row in `table` of keys + delta[t] where valid[t], -1 elsewhere, for taps
    whose keys come in runs of `run` consecutive integers (the last axis' offsets at dilation
    1): one binary search a run; each next key then lies at the next position or is absent."""
    # After the last key, one that matches none (positions run up to the table's size).
    sorted_keys = numpy.append(table.sorted, numpy.iinfo(numpy.int64).max)
    order = numpy.append(table.order, numpy.int32(-1))
    for start in range(0, out.shape[0], run):
        pos = numpy.searchsorted(table.sorted, keys + delta[start])
        for t in range(start, min(start + run, out.shape[0])):
            hit = sorted_keys[pos] == keys + delta[t]
            out[t] = numpy.where(hit & valid[t], order[pos], -1)
            pos += hit  # an invalid key's match (another row's site) still moves on


def _tap_valid(coords, shape, kernel, stride, padding, dilation):
    """[K, N] bool: whether tap k of output site o reads a site inside the grid (o * stride -
    padding + k * dilation, per axis), broadcast over the taps from [kernel_a, N] per axis."""
    valid = numpy.ones(coords.shape[0], bool)
    for axis, size in enumerate(shape):
        q = (coords[:, 1 + axis] * stride[axis] - padding[axis]
             + numpy.arange(kernel[axis])[:, None] * dilation[axis])
        valid = valid[..., None, :] & (q >= 0) & (q < size)
    return valid.reshape(math.prod(kernel), coords.shape[0])


def _split_pairs(tap, out_rows, in_rows, taps):
    """Pairs (output row, input row) listed tap by tap (tap ascending), as a list of taps'
    (out_rows, in_rows) int64 arrays."""
    bounds = numpy.cumsum(numpy.bincount(tap, minlength=taps))[:-1]
    return list(zip(numpy.split(out_rows.astype(numpy.int64, copy=False), bounds),
                    numpy.split(in_rows.astype(numpy.int64, copy=False), bounds)))


def nonzero_2d(mask):
    """The flat indices, rows and columns of a 2-D mask's True entries (row-major, as
    numpy.nonzero's, which is slower on 2-D masks)."""
    flat = numpy.flatnonzero(mask)
    rows = flat // mask.shape[1]
    return flat, rows, flat - rows * mask.shape[1]


def _strided_targets(coords, shape, kernel, stride, padding, dilation):
    """The pairs of a strided convolution seen from its inputs, tap by tap: (tap, input row,
    int64 key in batch x `shape` of the output site (i + padding - k * dilation) / stride that
    input site i feeds through tap k). Validity and output coordinates are computed an axis at
    a time ([kernel_a, N] each); keys only for the valid pairs."""
    n = coords.shape[0]
    valid = numpy.ones(n, bool)
    outputs = []
    for axis, size in enumerate(shape):
        offsets = numpy.arange(kernel[axis])[:, None] * dilation[axis]
        q, rem = numpy.divmod(coords[:, 1 + axis] + padding[axis] - offsets, stride[axis])
        valid = valid[..., None, :] & (rem == 0) & (q >= 0) & (q < size)
        outputs.append(q)
    _, tap, row = nonzero_2d(valid.reshape(math.prod(kernel), n))
    keys = coords[:, 0].astype(numpy.int64).take(row)
    for q, axis_tap, size in zip(outputs, numpy.unravel_index(tap, kernel), shape):
        keys *= size
        keys += q.reshape(-1).take(axis_tap * n + row)
    return tap, row, keys


def _transposed_map(neighbors, n):
    """The map int32 [K, n] of the same pairs seen from the other side: out[k, neighbors[k, o]]
    = o, -1 elsewhere (a tap joins a site to at most one site across); and the pairs' taps and
    rows o in `neighbors` (numpy.nonzero's, tap by tap)."""
    flat, tap, row = nonzero_2d(neighbors >= 0)
    out = numpy.full((neighbors.shape[0], n), -1, numpy.int32)
    out.reshape(-1)[tap * n + neighbors.reshape(-1)[flat]] = row
    return out, tap, row

def strided_maps(coords, out_shape, geometry):
    """(out_coords, neighbors, neighbors_t, tap_pairs) of a strided rulebook on coords (see
    Rulebook): each input's targets (pairs of tap and input row), their distinct keys the
    output sites; the map from the outputs' side is the same pairs turned around."""
    tap, row, targets = _strided_targets(coords, out_shape, *geometry)
    ordered = numpy.sort(targets)  # sorted runs, one a tap: faster than unique's hash
    first = numpy.ones(ordered.size, bool)  # of each run of equal keys
    first[1:] = ordered[1:] != ordered[:-1]
    out_keys = ordered[first]
    out_rows = numpy.searchsorted(out_keys, targets).astype(numpy.int32)
    taps = math.prod(geometry[0])
    neighbors_t = numpy.full((taps, coords.shape[0]), -1, numpy.int32)
    neighbors_t[tap, row] = out_rows
    neighbors = numpy.full((taps, out_keys.size), -1, numpy.int32)
    neighbors[tap, out_rows] = row
    return (decode(numpy, out_keys, out_shape), neighbors, neighbors_t,
            _split_pairs(tap, out_rows, row, taps))
