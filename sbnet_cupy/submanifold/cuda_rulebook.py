"""The rulebooks' CUDA kernels (kernels/submanifold/submanifold.cu): the hash table of the sites and
the strided bitmap, on any backend's arrays (build_raw: CuPy arrays and torch tensors alike), and
the hash-and-sort path of strided output grids too large for a bitmap (CuPy arrays).

Every rulebook kernel takes the one record RuleArgs and reads the fields it needs; its launches
are KernelPlans cached per (device, kernel, DIMS), with the grid of each call's work."""

import functools
import math
from collections import namedtuple

import numpy

from ..core import launch as _launch, plan as _plan, records as _records
from .numpy_rulebook import checked_keys
from .validation import MAX_DIMS

# Flags the insert kernels raise (kernels/submanifold/submanifold.cu).
_FLAG_DUPLICATE, _FLAG_FULL, _FLAG_OUTSIDE = 1, 2, 4
THREADS = 256
_MAX_BLOCKS = 65535 * 16  # grid-stride loops beyond this
_RANK_THREADS, _RANK_WORDS = 256, 1024  # rank_words' CTA and the bitmap words it ranks
# Largest output grid (batch x sites) a strided rulebook finds its output sites in with a bitmap
# (64 MiB of bits and 64 MiB of ranks); larger grids hash and sort the candidates instead. The
# bitmap's passes cost its words, the hash-and-sort path's its candidates (sites x taps), several
# times as much a candidate: SemanticKITTI's grid at stride 2 and batch 4 (240M bits, 2.7M
# candidates) builds faster through the bitmap.
_BITMAP_MAX_BITS = 1 << 29
# A bounded build (capacity given: a CUDA graph's, which the hash-and-sort path's host sync
# cannot join) takes the bitmap up to ranks' int32 range: 256 MiB of bits and of ranks.
_BOUNDED_BITMAP_MAX_BITS = 1 << 31
# The rulebook kernels, each built for DIMS = 1..MAX_DIMS.
RULE_KERNELS = ("clear_table", "insert_coords", "insert_keys", "insert_targets",
                "compact_table", "decode_keys", "query_map", "query_subm", "mark_targets",
                "rank_words", "emit_sites", "scatter_strided", "check_sites")
# Those over every (site, tap) pair: rows of taps along the grid's y (site_tap_grid).
_SITE_TAP_KERNELS = frozenset({"insert_targets", "query_map", "query_subm", "mark_targets",
                               "scatter_strided"})
_MAX_GRID_Y = 65535


def table_capacity(n):
    """Slots of a hash table for n keys: a power of two, at least 2n (load <= 1/2)."""
    return 1 << max(4, (2 * max(n, 1) - 1).bit_length())


def grid(items):
    """The grid of a grid-stride loop over `items` items, THREADS a CTA."""
    return (max(1, min(-(-items // THREADS), _MAX_BLOCKS)), 1, 1)


def site_tap_grid(n, rows):
    """The grid of a kernel over n sites x `rows` rows of taps (for_each_site_tap: the taps
    along the kernel's last axis are a row, one thread's): sites along x, rows along y, each a
    grid-stride loop past the grid's limits."""
    return (max(1, min(-(-n // THREADS), _MAX_BLOCKS // rows or 1)), min(rows, _MAX_GRID_Y), 1)


class HashTable:
    """An open-addressing hash table of linearised int64 keys on a CUDA device (CuPy arrays):
    keys [capacity] (-1 marks an empty slot) and vals int32 [capacity], the row each key was
    inserted from. Linear probing from a 64-bit mix of the key; an insert or a lookup probes at
    most `capacity` slots, so a full table fails instead of looping."""

    def __init__(self, keys, vals):
        self.keys, self.vals = keys, vals

    @property
    def capacity(self):
        return int(self.keys.shape[0])


# A table of sites on the device, for build_raw: `owner` holds its memory; a hash table (keys, vals,
# mask: capacity - 1) or a bitmap of the grid (bits, ranks, words; see
# kernels/submanifold/submanifold.cu's RuleArgs) with the rows its sites have (a bitmap's
# lookups find no others); the grid (shape, batch) its keys linearise; whether the sites it was
# built from were checked (distinct and inside the grid).
_Table = namedtuple("_Table", ["owner", "keys", "vals", "bits", "ranks", "mask", "words",
                               "rows", "shape", "batch", "checked"])
_NO_TABLE = _Table(None, 0, 0, 0, 0, 0, 0, 0, (), 1, False)

# build_raw's result: int32 maps [K, N_out] and [K, N_in], out_coords [N_out, 1 + D] (None for
# a submanifold rulebook: its input sites), the tables of its input and output sites (None
# where it has none), for later rulebooks on the same sites to reuse, and for a strided one its
# number of output sites on the device (an int32 [1] array; None for a submanifold one).
Built = namedtuple("Built", ["neighbors", "neighbors_t", "out_coords", "in_table",
                             "out_table", "count"])


def _pad(values):
    return tuple(values) + (1,) * (MAX_DIMS - len(values))


@functools.lru_cache(maxsize=1024)
def _shape_fields(coords_shape, query_shape, geometry):
    """RuleArgs' last fields (shape, query_shape, kernel, stride, padding, dilation), each
    padded to MAX_DIMS: the same for every launch of a layer's rulebook, so worked out once."""
    return (*_pad(coords_shape), *_pad(query_shape), *(v for g in geometry for v in _pad(g)))


_NO_GEOMETRY = ((), (), (), ())


@functools.lru_cache(maxsize=None)
def _rule_plan(device, kernel, dims, threads):
    """The KernelPlan of rulebook kernel<dims> on `device`, `threads` a CTA (the grid is each
    call's)."""
    return _plan.KernelPlan(device, "submanifold", kernel, (dims,), (1, 1, 1), (threads, 1, 1),
                            0, _records.RULE_ARGS)


def _rule(kernel, device, stream, items, dims, table=None, *, coords=0, keys=0, flags=0,
          counter=0, out_map=0, out_map_t=0, out_keys=0, group=0, n=None, n_out=None, batch=1,
          taps=1, transposed=False, symmetric=False, coords_shape=(), query_shape=(),
          geometry=_NO_GEOMETRY, groups=None):
    """One launch of rulebook kernel<dims> of kernels/submanifold/submanifold.cu on raw addresses,
    over `items` threads' work (n defaults to items; n x taps for the kernels over site and tap
    pairs); `table`: a _Table, or None. groups: rank_words' CTAs (of _RANK_THREADS), else a
    grid-stride loop of THREADS a CTA. n_out defaults to the table's rows."""
    if items == 0:
        return
    table, n = table or _NO_TABLE, items if n is None else n
    plan = _rule_plan(device, kernel, dims, THREADS if groups is None else _RANK_THREADS)
    if groups is not None:
        launch_grid = (groups, 1, 1)
    elif kernel in _SITE_TAP_KERNELS:
        rows = taps // geometry[0][-1]
        launch_grid = site_tap_grid(n, rows // 2 + 1 if kernel == "query_subm" and symmetric
                                    else rows)
    else:
        launch_grid = grid(items)
    plan.launch(stream, coords, keys, table.keys, table.vals, table.bits, table.ranks, flags,
                counter, out_map, out_map_t, out_keys, group, table.mask,
                n, table.words, table.rows if n_out is None else n_out,
                batch, taps, int(transposed),
                int(symmetric), *_shape_fields(coords_shape, query_shape, geometry),
                grid=launch_grid)


# --- on any backend's arrays ----------------------------------------------------------------

def build_raw(backend, coords, shape, batch, geometry, out_shape, check, table=None,
              capacity=None, bounded=False):
    """The CUDA rulebook of C-contiguous int32 coords [n, 1 + D] (an array of `backend`, whose
    device and current stream the kernels run on), with validation.rulebook_geometry's checked
    arguments: submanifold where out_shape is None, else strided. `table`: a _Table of these
    coords to reuse (its grid `shape` for a submanifold rulebook; ignored by a strided one,
    which needs none unless it checks).

    capacity: for a strided rulebook without check, the output rows to make room for instead of
    counting the output sites on the host: the build then makes no host sync (a CUDA graph can
    capture it). Rows past the sites have coords -1 (outside every grid: later rulebooks leave
    them out) and no neighbours; sites past the capacity are left out, which Built.count above
    capacity tells. bounded: a build of a network that is later captured (its recording run),
    which takes the bitmap as far as a bounded build does.

    Returns a Built, or None for a strided rulebook whose output grid has more than
    _BITMAP_MAX_BITS sites (_BOUNDED_BITMAP_MAX_BITS with a capacity or bounded; the caller
    takes the hash-and-sort path). Host work: a submanifold rulebook is 1 launch and 1
    allocation with a table to reuse, 3 launches and 2 allocations without, a memset more with
    an odd kernel, plus one sync with check; a strided one is 4 launches, 2 memsets, 4
    allocations and one sync (for its number of output sites; the check's flags are read in
    it), plus 2 launches and an allocation with check and no checked table to reuse.
    """
    n = int(coords.shape[0])
    dims, taps = len(shape), math.prod(geometry[0])
    if table is not None and (table.shape, table.batch) != (shape, batch):
        raise AssertionError("a table of another grid")  # a library bug
    limit = _BOUNDED_BITMAP_MAX_BITS if bounded or capacity is not None else _BITMAP_MAX_BITS
    if out_shape is not None and batch * math.prod(out_shape) > limit:
        return None
    device = backend.device(coords)
    stream, coords_ptr = backend.stream(device), backend.pointer(coords)
    empty = functools.partial(_int32_array, backend, coords)
    flags = 0  # address of the flags to read back, where coords are inserted and checked
    if (table is None and out_shape is None) or (check and not (table and table.checked)):
        table, flags = _build_table(empty, device, stream, coords_ptr, n, shape, batch, check)
        flags = flags if check else 0
    if out_shape is None:
        # Both maps in one allocation, neighbors_t right after neighbors: the taps query_subm
        # writes only where it finds a pair (neighbors' past the centre, neighbors_t's before
        # it) are then one range, set to -1 by one memset.
        maps, maps_ptr = empty((2, taps, n))
        neighbors, neighbors_t = maps[0], maps[1]
        neighbors_ptr, neighbors_t_ptr = maps_ptr, maps_ptr + 4 * taps * n
        symmetric = all(k % 2 for k in geometry[0])
        if symmetric and taps > 1:
            _device_call(device, _memset, maps_ptr + 4 * n * (taps // 2 + 1), 255,
                         8 * n * (taps // 2), stream)
        _rule("query_subm", device, stream, n * taps, dims, table, coords=coords_ptr,
              out_map=neighbors_ptr, out_map_t=neighbors_t_ptr, n=n, batch=batch, taps=taps,
              symmetric=symmetric, coords_shape=shape, query_shape=shape, geometry=geometry)
        if flags:
            _raise_flags(_read_ints(device, stream, (flags,))[0], backend, coords, shape, batch)
        return Built(neighbors, neighbors_t, None, table, table, None)
    words = -(-batch * math.prod(out_shape) // 32)
    groups = -(-words // _RANK_WORDS)
    # One workspace: bits [words], the rank CTAs' counter [1], ranks [words], group [groups + 1].
    owner, bits = empty((2 * words + groups + 2,))
    counter, ranks = bits + 4 * words, bits + 4 * words + 4
    group = ranks + 4 * words
    _device_call(device, _memset, bits, 0, 4 * (words + 1), stream)
    out_table = _Table(owner, 0, 0, bits, ranks, 0, words, 0, out_shape, batch, True)
    common = dict(coords=coords_ptr, n=n, batch=batch, taps=taps, transposed=True,
                  coords_shape=shape, query_shape=out_shape, geometry=geometry)
    _rule("mark_targets", device, stream, n * taps, dims, out_table, **common)
    _rule("rank_words", device, stream, words, dims, out_table, counter=counter, group=group,
          groups=groups)
    if capacity is None:
        rows, *raised = _read_ints(device, stream, (group + 4 * groups,) + ((flags,) if flags
                                                                           else ()))
        if raised:
            _raise_flags(raised[0], backend, coords, shape, batch)
    elif flags:
        raise AssertionError("a bounded build cannot check")  # a library bug
    else:
        rows = capacity
    out_table = out_table._replace(rows=rows)
    (out_coords, out_coords_ptr), (neighbors, neighbors_ptr), (neighbors_t, neighbors_t_ptr) = (
        empty((rows, 1 + dims)), empty((taps, rows)), empty((taps, n)))
    if rows and capacity is not None:  # the rows emit_sites leaves: outside every grid
        _device_call(device, _memset, out_coords_ptr, 0xFF, 4 * rows * (1 + dims), stream)
    _rule("emit_sites", device, stream, words, dims, out_table, out_map=out_coords_ptr,
          group=group, query_shape=out_shape)
    if rows:
        _device_call(device, _memset, neighbors_ptr, 0xFF, 4 * taps * rows, stream)
    _rule("scatter_strided", device, stream, n * taps, dims, out_table, out_map=neighbors_ptr,
          out_map_t=neighbors_t_ptr, **common)
    total = 2 * words + 1 + groups  # group[groups] in the workspace: the number of sites
    return Built(neighbors, neighbors_t, out_coords, table, out_table, owner[total:total + 1])


def _int32_array(backend, like, shape):
    """(an int32 array of `shape` on like's device, its address)."""
    a = backend.empty(shape, like, "int32")
    return a, backend.pointer(a)


def _build_table(empty, device, stream, coords_ptr, n, shape, batch, checked,
                 insert="insert_coords"):
    """(_Table, address of its flags and counter) of n coords: one allocation (keys, the rows
    as values, flags and counter), a clear and an insert by kernel `insert`: insert_coords, or
    check_sites, which counts rows of -1 alone and keeps no values (a check looks nothing up);
    the flags are not read here."""
    capacity = table_capacity(n)
    values = insert != "check_sites"
    owner, keys = empty(((2 + values) * capacity + 2,))
    vals = keys + 8 * capacity if values else 0
    flags = keys + (8 + 4 * values) * capacity
    table = _Table(owner, keys, vals, 0, 0, capacity - 1, 0, 0, shape, batch, checked)
    _rule("clear_table", device, stream, capacity, 1, table, flags=flags, counter=flags + 4)
    _rule(insert, device, stream, n, len(shape), table, coords=coords_ptr, flags=flags,
          counter=flags + 4, batch=batch, coords_shape=shape)
    return table, flags


def site_faults(backend, coords, shape, batch):
    """What a check of C-contiguous int32 coords [n, 1 + D] (a backend's array) on grid batch x
    shape finds, with no host sync (a CUDA graph captures it): an int32 array [2] on the device,
    the flags an insert of the rows raises (outside the grid, repeated) and how many rows are
    -1 alone, which raise none (SparseGraphs' padding: the caller compares the count with its
    own). _build_table's work with check_sites (the table is kept until the launches are
    queued: the backend's allocator reuses memory in stream order)."""
    device = backend.device(coords)
    table, _flags = _build_table(functools.partial(_int32_array, backend, coords), device,
                                 backend.stream(device), backend.pointer(coords),
                                 int(coords.shape[0]), shape, batch, True, "check_sites")
    return table.owner[-2:]


def _raise_flags(raised, backend, coords, shape, batch):
    """Raises for the flags an insert of coords raised: ValueError naming the first bad row."""
    if raised & (_FLAG_OUTSIDE | _FLAG_DUPLICATE):
        checked_keys(backend.host(coords), shape, batch, "coords")
    if raised:
        raise AssertionError(f"hash table insert failed (flags {raised})")  # a library bug


# The runtime calls below go through core.launch's CuPy runtime module (None without CuPy): an
# import in the function would cost each call as much as the call.

def _memset(address, value, size, stream):
    _launch.runtime.memsetAsync(address, value, size, stream)


def _read_ints(device, stream, addresses):
    """The int32 at each device address, after the stream's work so far: one host sync."""
    host = numpy.empty(len(addresses), numpy.int32)
    return _device_call(device, _read_into, host, addresses, stream).tolist()


def _read_into(host, addresses, stream):
    runtime, base = _launch.runtime, host.ctypes.data  # ctypes.data costs a microsecond
    for i, address in enumerate(addresses):
        runtime.memcpyAsync(base + 4 * i, address, 4, runtime.memcpyDeviceToHost, stream)
    runtime.streamSynchronize(stream)
    return host


def _device_call(device, fn, *args):
    """fn(*args) with `device` current (runtime calls on its memory and streams)."""
    runtime = _launch.runtime
    current = runtime.getDevice()
    if current == device:
        return fn(*args)
    runtime.setDevice(device)
    try:
        return fn(*args)
    finally:
        runtime.setDevice(current)


# --- the hash-and-sort path (CuPy arrays) -----------------------------------------------------

def hash_table(keys, capacity=None):
    """The HashTable of distinct int64 keys [n] (a cupy array): key keys[r] has value r.

    capacity: slots, a power of two (default table_capacity(n)). Raises ValueError if the keys
    do not fit, repeat or are negative (one host sync to read the kernel's flags)."""
    import cupy

    n = int(keys.shape[0])
    capacity = table_capacity(n) if capacity is None else capacity
    if capacity < 1 or capacity & (capacity - 1):
        raise ValueError(f"capacity must be a power of two, got {capacity}")
    table, flags = _new_table(keys.data.device_id, capacity)
    _launch_rule("insert_keys", keys.data.device_id, n, keys=cupy.ascontiguousarray(keys,
                 dtype=cupy.int64), table=table, flags=flags)
    raised = int(flags.get()[0])
    if raised & _FLAG_FULL:
        raise ValueError(f"capacity {capacity} is too small for {n} keys")
    if raised & _FLAG_DUPLICATE:
        raise ValueError("keys has duplicates")
    if raised & _FLAG_OUTSIDE:
        raise ValueError("keys must be >= 0")
    return table


def strided_hash_sort(coords, shape, out_shape, batch, geometry, check):
    """(out_coords, neighbors, neighbors_t) of a strided rulebook on CuPy coords through hash
    tables and a sort: the path of output grids too large for a bitmap."""
    table = _table_from_coords(coords, shape, batch, check)
    out_keys = _output_keys(coords, shape, out_shape, batch, geometry)
    out_coords = _decode(out_keys, out_shape)
    out_table = _table_from_keys(out_keys)
    neighbors = _query(table, out_coords, out_shape, shape, batch, geometry, False)
    neighbors_t = _query(out_table, coords, shape, out_shape, batch, geometry, True)
    return out_coords, neighbors, neighbors_t


def _new_table(device, capacity):
    """An empty HashTable and its int32 [2] flags and counter (zero): one allocation and one
    launch, which cost less host time than CuPy's full and zeros."""
    import cupy

    memory = cupy.cuda.alloc(capacity * 12 + 8)
    table = HashTable(cupy.ndarray((capacity,), cupy.int64, memory),
                      cupy.ndarray((capacity,), cupy.int32, memory + capacity * 8))
    flags = cupy.ndarray((2,), cupy.int32, memory + capacity * 12)
    _launch_rule("clear_table", device, capacity, table=table, flags=flags)
    return table, flags


def _launch_rule(kernel, device, items, *, coords=None, keys=None, table=None, flags=None,
                 out_map=None, out_keys=None, n=None, batch=1, taps=1, transposed=False,
                 coords_shape=(), query_shape=(), geometry=_NO_GEOMETRY):
    """_rule on CuPy arrays (a HashTable, flags int32 [2]: flags and counter), on CuPy's current
    stream."""
    import cupy

    def pointer(a):
        return 0 if a is None else a.data.ptr

    raw_table = None if table is None else _Table(
        table, table.keys.data.ptr, table.vals.data.ptr, 0, 0, table.capacity - 1, 0, 0, (),
        1, False)
    _rule(kernel, device, cupy.cuda.get_current_stream().ptr, items,
          len(coords_shape) or len(query_shape) or 1, raw_table, coords=pointer(coords),
          keys=pointer(keys), flags=pointer(flags),
          counter=0 if flags is None else flags.data.ptr + 4, out_map=pointer(out_map),
          out_keys=pointer(out_keys), n=n, batch=batch, taps=taps, transposed=transposed,
          coords_shape=coords_shape, query_shape=query_shape, geometry=geometry)


def _table_from_coords(coords, shape, batch, check):
    """HashTable of coords; with check, rows outside the grid or repeated raise ValueError
    (without, they are left out or inserted once)."""
    n = int(coords.shape[0])
    table, flags = _new_table(coords.data.device_id, table_capacity(n))
    _launch_rule("insert_coords", coords.data.device_id, n, coords=coords, table=table,
                 flags=flags, batch=batch, coords_shape=shape)
    if not check:
        return table
    raised = int(flags[0].get())  # the one host sync of a submanifold rulebook
    if raised & (_FLAG_OUTSIDE | _FLAG_DUPLICATE):
        checked_keys(coords.get(), shape, batch, "coords")  # raises, naming the first bad row
    if raised:
        raise AssertionError(f"hash table insert failed (flags {raised})")  # a library bug
    return table


def _table_from_keys(keys):
    """HashTable of distinct keys, without reading its flags back (no sync)."""
    table, flags = _new_table(keys.data.device_id, table_capacity(int(keys.shape[0])))
    _launch_rule("insert_keys", keys.data.device_id, int(keys.shape[0]), keys=keys,
                 table=table, flags=flags)
    return table


def _output_keys(coords, shape, out_shape, batch, geometry):
    """Sorted keys of a strided convolution's output sites: every (input, tap) target hashed
    into a table, the table compacted, the keys sorted (one host sync, for their number)."""
    import cupy

    n, taps = int(coords.shape[0]), math.prod(geometry[0])
    bound = min(n * taps, batch * math.prod(out_shape))
    device = coords.data.device_id
    table, flags = _new_table(device, table_capacity(bound))
    _launch_rule("insert_targets", device, n * taps, coords=coords, table=table, flags=flags,
                 n=n, batch=batch, taps=taps, transposed=True, coords_shape=shape,
                 query_shape=out_shape, geometry=geometry)
    out_keys = cupy.empty(table.capacity, dtype=cupy.int64)
    _launch_rule("compact_table", device, table.capacity, table=table, flags=flags,
                 out_keys=out_keys)
    raised, count = (int(v) for v in flags.get())
    if raised:
        raise AssertionError(f"hash table insert failed (flags {raised})")  # a library bug
    return cupy.sort(out_keys[:count])


def _decode(keys, shape):
    """numpy_rulebook.decode on the device, in one launch."""
    import cupy

    n = int(keys.shape[0])
    coords = cupy.empty((n, 1 + len(shape)), dtype=cupy.int32)
    _launch_rule("decode_keys", keys.data.device_id, n, keys=keys, out_map=coords,
                 query_shape=shape)
    return coords


def _query(table, sites, sites_shape, query_shape, batch, geometry, transposed):
    """int32 [K, N] map (see Rulebook) through the HashTable of the sites of query_shape."""
    import cupy

    n, taps = int(sites.shape[0]), math.prod(geometry[0])
    out_map = cupy.empty((taps, n), dtype=cupy.int32)
    _launch_rule("query_map", sites.data.device_id, n * taps, coords=sites, table=table,
                 out_map=out_map, n=n, batch=batch, taps=taps, transposed=transposed,
                 coords_shape=sites_shape, query_shape=query_shape, geometry=geometry)
    return out_map
