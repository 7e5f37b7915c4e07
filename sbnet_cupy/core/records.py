"""The kernels' argument records, each written once: the C++ struct and its Python packing come
from the same declaration below.

Every kernel takes its arguments as one struct passed by value, packed on the host into the
launch's argument buffer (sbnet_cupy/core/launch.py). A `Record` is declared here in a small subset
of C (one declaration a line or several, `type name, name[N];` with `//` comments; types: int,
unsigned, i64, float, double, pointers, and records declared before it). From that one text:

- `header(op)` writes the C++ definitions (the text as written, then a static_assert of the
  struct's size and of every field's offset) that _kernels.kernel_source puts in front of
  kernels/core/common.cuh for kernels/<family>/<op>.cu, and that the CPU emulator
  (tests/cuda_emulation.py) builds with g++: both compilers check the layout that Python
  computed, field by field;
- the record packs the values (`pack_into(buffer, offset, *values)`, one struct.Struct call, as
  KernelPlan.launch does), in the order of its leaves: its fields in declaration order, a nested
  record's fields in place, an array's elements in order (`names` lists them);
- `values(**fields)` builds that tuple by name, and `tail(**fields)` the values of a trailing run
  of fields (a plan's constants after the per-call pointers), each checked: a missing or unknown
  field, or a nested record or array of the wrong length, raises. A Python keyword is spelt
  with a trailing underscore (the BlockSide field `in` is `in_`).

Keyword calls of many arguments cost microseconds, so the launches that run per call of an op
(block_conv, the gather and scatter, reduce_mask, split_sum) pass their values by position, in
the record's order, and build their nested records and plan constants by name.

Adding a kernel's record: declare it here as ``NAME = Record("CName", "<op>", \"\"\"<fields>
\"\"\")`` (array sizes as numbers, or a constant of this module in an f-string), use `CName` in
kernels/<family>/<op>.cu (the header defines it in front of common.cuh) and make the kernel's
KernelPlan (core/plan.py) with the record. The NVRTC compile check and the emulated tests
then check it.
"""

import keyword
import re
import struct
import sys

if sys.byteorder != "little":  # the packing is little-endian, as every CUDA host is
    raise ImportError("sbnet_cupy packs kernel arguments for little-endian hosts")

# Scalar C types: struct format character (standard sizes; their alignment is their size).
_SCALARS = {"int": "i", "unsigned": "I", "i64": "q", "float": "f", "double": "d"}
_POINTER = "Q"  # 8 bytes on every 64-bit host CUDA runs on

_RECORDS = []  # every Record, in declaration order (nested records come before their users)


class Record:
    """A kernel's argument struct: `name` in C++, declared for kernels/<family>/<op>.cu (op None:
    for every kernel, as kernels/core/common.cuh's records), `declaration` its fields in C.

    Attributes: size (sizeof), align, fields ((name, ctype or Record, count or None) in order),
    names (the leaves' names: "in.height", "grid[2]"), offsets (their byte offsets), format (the
    struct module's), pack_into(buffer, offset, *values) and pack(*values) (the leaves' values
    in order)."""

    def __init__(self, name, op, declaration):
        self.name, self.op = name, op
        self.declaration = _dedent(declaration)
        self.fields = _parse(self.declaration, name)
        leaves, offset, align = [], 0, 1  # (name, offset, format char)
        self.field_offsets = []
        for field, ctype, count in self.fields:
            size, field_align, inner = _member(ctype)
            offset = -(-offset // field_align) * field_align
            self.field_offsets.append(offset)
            for i in range(count or 1):
                at = offset + i * size
                label = field if count is None else f"{field}[{i}]"
                if isinstance(ctype, Record):
                    leaves += [(f"{label}.{n}", at + o, c)
                               for n, o, c in zip(ctype.names, ctype.offsets, ctype._chars)]
                else:
                    leaves.append((label, at, inner))
            offset += size * (count or 1)
            align = max(align, field_align)
        self.size, self.align = -(-offset // align) * align, align
        self.names = tuple(n for n, _, _ in leaves)
        self.offsets = tuple(o for _, o, _ in leaves)
        self._chars = tuple(c for _, _, c in leaves)
        fmt, at = "<", 0
        for _, leaf_offset, char in leaves:
            fmt += f"{leaf_offset - at}x" * (leaf_offset > at) + char
            at = leaf_offset + struct.calcsize("<" + char)
        fmt += f"{self.size - at}x" * (self.size > at)
        self.format = fmt
        self._struct = struct.Struct(fmt)
        if self._struct.size != self.size:
            raise AssertionError(f"{name}: packing is {self._struct.size} bytes, the struct "
                                 f"{self.size}")  # a bug of this module
        self.pack_into, self.pack = self._struct.pack_into, self._struct.pack
        self._builders = {}
        # values(**fields): the values of every leaf, in order, from the fields by name (nested
        # records as their own values(...) tuples, arrays as sequences of their length).
        self.values = self._builder(0)
        _RECORDS.append(self)

    def __repr__(self):
        return f"Record({self.name!r}, {self.size} bytes)"

    def tail(self, **fields):
        """The values of the leaves of the last fields, from those fields by name: the given
        fields must be every field from one of them to the last."""
        names = [_python_name(f) for f, _, _ in self.fields]
        first = min((names.index(k) for k in fields if k in names), default=len(names))
        return self._builder(first)(**fields)

    def _builder(self, first):
        builder = self._builders.get(first)
        if builder is None:
            builder = self._builders[first] = _make_builder(self, first)
        return builder

    def cpp(self):
        """The C++ definition, with static_asserts of its size and of its fields' offsets (a
        nested record's own fields are checked with it)."""
        body = "\n".join("    " + line if line else "" for line in self.declaration.split("\n"))
        offsets = [f"__builtin_offsetof({self.name}, {field}) == {offset}"
                   for (field, _, _), offset in zip(self.fields, self.field_offsets)]
        # Every field's offset where the compiler has __builtin_offsetof (g++, which builds the
        # emulated kernels in CI; some NVRTC versions lack it), the size everywhere.
        return (f"struct {self.name} {{\n{body}\n}};\n"
                + f'static_assert(sizeof({self.name}) == {self.size}, '
                  '"sbnet_cupy/core/records.py");\n'
                + "#ifndef __CUDACC_RTC__\n"
                + "".join(f'static_assert({check}, "sbnet_cupy/core/records.py");\n'
                          for check in offsets)
                + "#endif\n")


def header(op):
    """C++ definitions of the records of kernels/<family>/<op>.cu and of kernels/core/common.cuh's,
    in declaration order: what goes in front of common.cuh."""
    parts = ["// The kernels' argument records, generated from sbnet_cupy/core/records.py.",
             "typedef long long i64;"]
    parts += [record.cpp() for record in _RECORDS if record.op in (None, op)]
    return "\n".join(parts) + "\n"


def records(op=None):
    """The records declared for kernels/<family>/<op>.cu (None: every record)."""
    return [r for r in _RECORDS if op is None or r.op == op]


def _dedent(text):
    lines = text.strip("\n").split("\n")
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:].rstrip() for line in lines)


_DECLARATOR = re.compile(r"^([A-Za-z_]\w*)(?:\[(\d+)\])?$")


def _parse(declaration, record_name):
    """(name, ctype or Record, count or None) of each field of a C declaration list."""
    code = re.sub(r"//[^\n]*", "", declaration)
    fields = []
    for statement in code.split(";"):
        statement = " ".join(statement.split())
        if not statement:
            continue
        match = re.match(r"^(.*?[\s*])([A-Za-z_]\w*(?:\[\d+\])?(?:\s*,\s*[A-Za-z_]\w*"
                         r"(?:\[\d+\])?)*)$", statement)
        if match is None:
            raise ValueError(f"{record_name}: cannot read the declaration {statement!r}")
        ctype, names = match.group(1).strip(), match.group(2)
        declarators = [n.strip() for n in names.split(",")]
        if ctype.endswith("*") and len(declarators) > 1:  # C's `int* a, b` makes b an int
            raise ValueError(f"{record_name}: declare pointers one a statement: {statement!r}")
        for declarator in declarators:
            name, count = _DECLARATOR.match(declarator).groups()
            fields.append((name, _resolve(ctype, record_name), int(count) if count else None))
    names = [name for name, _, _ in fields]
    if len(set(names)) != len(names):
        raise ValueError(f"{record_name}: a field is declared twice: {names}")
    return fields


def _resolve(ctype, record_name):
    if ctype.endswith("*"):
        return ctype
    base = ctype.removeprefix("const ").strip()
    if base in _SCALARS:
        return base
    for record in _RECORDS:
        if record.name == base:
            return record
    raise ValueError(f"{record_name}: unknown type {ctype!r} (declare records before their "
                     f"users)")


def _member(ctype):
    """(size, alignment, format character or None for a record) of a field's type."""
    if isinstance(ctype, Record):
        return ctype.size, ctype.align, None
    char = _POINTER if ctype.endswith("*") else _SCALARS[ctype]
    size = struct.calcsize("<" + char)
    return size, size, char


def _python_name(name):
    return name + "_" if keyword.iskeyword(name) else name


def _make_builder(record, first):
    """A function of the fields from field `first` on, by keyword, that returns their leaves'
    values in order (the lengths of nested records and arrays checked)."""
    params, checks, parts = [], [], []
    for name, ctype, count in record.fields[first:]:
        param = _python_name(name)
        params.append(param)
        length = (len(ctype.names) if isinstance(ctype, Record) else 1) * (count or 1)
        if isinstance(ctype, Record) or count is not None:
            checks.append(f"    if len({param}) != {length}:\n"
                          f"        raise ValueError('{record.name}.{name} takes {length} "
                          f"values, got %d' % len({param}))\n")
            parts.append(f"*{param}")
        else:
            parts.append(param)
    function = "values" if first == 0 else f"tail_from_{record.fields[first][0]}"
    source = (f"def {function}(*, {', '.join(params)}):\n" if params else
              f"def {function}():\n")
    source += "".join(checks) + f"    return ({', '.join(parts)}{',' if parts else ''})\n"
    namespace = {}
    exec(compile(source, f"<{record.name} fields>", "exec"), namespace)
    build = namespace[function]
    build.__qualname__ = f"{record.name}.{function}"
    return build


# --- kernels/core/common.cuh ----------------------------------------------------------------

# A list of blocks in an NHWC tensor [n_batch, height, width, ...]: rows (n, hi, wi) of
# `indices`, the first *count of `rows` valid (capacity mode reports the true count, which may
# exceed the rows); block (n, hi, wi) is bh x bw pixels from (off_h + str_h*hi, off_w + str_w*wi).
BLOCK_LIST = Record("BlockList", None, """
    const int* indices;
    const int* count;
    int rows, n_batch, height, width, bh, bw, off_h, off_w, str_h, str_w;
""")

# Arguments of the gather and scatter kernels: `src` is read and `dst` written (x and the stack
# for a gather, the stack and y for a scatter).
STACK_ARGS = Record("StackArgs", None, """
    const void* src;
    void* dst;
    const void* scale;  // sparse_gather_affine: per-channel scale and shift, in the Acc type
    const void* shift;
    BlockList list;
    int words_per_pixel;  // row-copy kernels: words a pixel; transposing kernels: channels
    int tile_rows, log2_tile_c, pitch;  // transposing kernels only (see tile_index)
""")

# split_sum (kernels/core/common.cuh): out [rows, cols] = bias [cols] (or none) + each split's float
# sums, partial [splits, rows, pitch], added in split order.
SPLIT_SUM_ARGS = Record("SplitSumArgs", None, """
    const float* partial;
    const void* bias;
    void* out;
    i64 rows;
    int cols, pitch, splits;
    int relu;              // 1: max(0, sum)
""")

# --- kernels/blocks/block_conv.cu -----------------------------------------------------------

BLOCK_SIDE = Record("BlockSide", "block_conv", """
    int height, width;      // the image's, or the stack's block size
    int off_h, off_w;       // image: block (n, hi, wi) starts at (off_h + str_h * hi, ...)
    int str_h, str_w;
    int stack;              // 1: a stack; block m is (m, 0, 0)
""")

BLOCK_CONV_ARGS = Record("BlockConvArgs", "block_conv", """
    const void* src;
    void* dst;
    const void* weight;     // [cout, kh, kw, cin] (OHWI), in T
    const float* bias;      // [cout] or null
    const float* scale;     // [cin] or null: the prologue's affine and ReLU
    const float* shift;
    const int* indices;     // the block list [rows, 3] and its count (see BlockList)
    const int* count;
    int rows, n_batch, cin, cout, kh, kw, out_h, out_w;
    BlockSide in, out;
    int relu_out, zero_outside;
    int paired;             // cout even and dst aligned: two channels written as one access
    int k_groups;           // warp groups of the CTA that split the reduction (blockDim.x / 128)
    // A group's step from one of its stages to the next, k_groups stages of the reduction, as
    // taps (step_taps_y rows and step_taps_x columns of the kernel) and channels.
    int step_taps_y, step_taps_x, step_channels;
    int halo_chunk;         // block_conv_halo: channels a chunk (a multiple of the MMA's k)
""")

# block_conv_pair: `conv` is the 3x3 (stack to stack), then the 1x1 after it.
BLOCK_CONV_PAIR_ARGS = Record("BlockConvPairArgs", "block_conv", """
    BlockConvArgs conv;
    void* dst2;             // the 1x1's destination (an NHWC image through the block list)
    const void* weight2;    // [cout2, 1, 1, conv.cout] (OHWI), in T
    int cout2;
    BlockSide out2;
    int paired2;            // cout2 even and dst2 aligned: two channels written as one access
""")

# --- kernels/point_to_voxel.cu --------------------------------------------------------------

P2V_MAX_DIMS = 4

P2V_ARGS = Record("P2VArgs", "point_to_voxel", f"""
    const void* points;    // [n, features]
    void* voxels;          // p2v_gather: [voxels, max_points, features]
    i64* table;            // keys [mask + 1] (P2V_EMPTY where free), then int first [mask + 1]
                           // (a key's first point; from p2v_assign on, its voxel or -1) and
                           // int count [mask + 1] (its points)
    int* slot;             // [n]: the point's slot in the table, -1 outside the grid
    unsigned* bits;        // [(n + 127) / 128 * 4]: the points that come first in their voxel
    int* word_rank;        // [(n + 127) / 128 * 4]: first points before each word
    int* total;            // [2]: voxels found; points given a place in a bucket
    i64* voxel;            // keys [cap], then int count [cap] and int start [cap] (of the
                           // voxel's bucket; p2v_scatter moves it to the bucket's end)
    int* bucket;           // [n]: the points of each kept voxel, in any order
    int* selected;         // [cap, max_points]: a voxel's first points, in point order
    int* coords;           // p2v_select: [voxels, ndim], z first
    int* num_points;       // p2v_select: [voxels]
    i64* point_voxel_id;   // [n]: the point's voxel, -1 for none
    i64 mask, n;           // table slots - 1 (a power of two minus one); points
    int features, ndim, max_voxels, max_points, empty_mean, cap;  // cap: min(n, max_voxels)
    int grid[{P2V_MAX_DIMS}];                     // cells along each axis, z first
    double lower[{P2V_MAX_DIMS}], vsize[{P2V_MAX_DIMS}];  // float32 values, z first
""")

# --- kernels/blocks/reduce_mask.cu ----------------------------------------------------------

# tickets: one counter, zero before the launch; the last CTA sets it back to zero. capacity:
# rows of `indices`; rows past the count up to fill_rows are set to -1.
REDUCE_MASK_ARGS = Record("ReduceMaskArgs", "reduce_mask", """
    const void* mask;
    unsigned* words;
    unsigned* tickets;
    int* indices;
    int* count;
    double tol;
    int n_batch, height, width, bh, bw, off_h, off_w, str_h, str_w, bcount_h, bcount_w;
    int capacity, fill_rows;
""")

# --- kernels/dilated/space_to_batch.cu ------------------------------------------------------

# Division by a positive int known at launch, for dividends in [0, 2^31) (divide() in the
# kernel): the host picks mul = ceil(2^shift / d) with shift = 31 + ceil(log2(d))
# (sbnet_cupy/dilated/reshape_plan.py, _divisor).
DIVISOR = Record("divisor", "space_to_batch", """
    int d;
    unsigned mul, shift;
""")

NHWC_ARGS = Record("nhwc_args", "space_to_batch", """
    void* x;
    void* y;
    int n, height, width, out_w;  // x: [n, height, width, words], y: [block_h * block_w * n,
    int off_h, off_w, chunk;      //    out_h, out_w, words]
    divisor words, block_h, block_w, out_h;
""")

NCHW_ARGS = Record("nchw_args", "space_to_batch", """
    void* x;
    void* y;
    int height, width;          // x: [n * channels, height, width]
    int out_w, block_h, bands;  // bands: n * channels * out_h
    int off_h, off_w;
    int row_words, band_words;
    divisor out_h, block_w, channels, tile_rows, tile_bands, tile_cols;
    divisor row_vectors;   // vectors of a padded tile row
    divisor col_vectors;   // vectors of y in a tile's run of one (i, j) (CL: of a tile column's
                           // tile_bands)
""")

# --- kernels/pruned/sparse_kernel_conv.cu ---------------------------------------------------

# The forward kernels' arguments.
CONV_ARGS = Record("ConvArgs", "sparse_kernel_conv", """
    const void* x;        // [n, in_h, in_w, cin] of T
    void* out;            // [n, out_h, out_w, cout] of T
    const void* bias;     // [cout] of T, or null
    const int* ranges;    // direct: taps of (co, ci), [cout * cin + 1]; compiled: null
    const int* taps;      // direct: ci << 16 | kh << 8 | kw; compiled: null
    const void* values;   // [taps] of T, in the kernel's order
    float* partial;       // direct, channels split: [splits, n, out_h, out_w, groups * Q];
                          // else null
    int n, in_h, in_w, cin, out_h, out_w, cout;
    int str_h, str_w, dil_h, dil_w, pad_h, pad_w, idil_h, idil_w;
    int tile_rows, tile_cols, pitch, chunk;  // the staged tile; channels staged at a time
    int warps_y, warps_q, groups;  // groups: of Q output channels
    int split_cin;  // direct: input channels a split (blockIdx.z) sums (cin: one split)
""")

# The arguments of the gradient with respect to the non-zero weights.
GRAD_VALUES_ARGS = Record("GradValuesArgs", "sparse_kernel_conv", """
    const void* x;       // [n, in_h, in_w, cin] of T
    const void* dy;      // [n, out_h, out_w, cout] of T
    const int* ranges;   // taps of (co, ci), [cout * cin + 1]
    const int* taps;     // ci << 16 | kh << 8 | kw
    void* grad;          // [taps] of the accumulation type, added to with atomics
    int n, in_h, in_w, cin, out_h, out_w, cout;
    int str_h, str_w, dil_h, dil_w, pad_h, pad_w;
    int tile_rows, tile_cols, pitch, chunk, co_chunk;
""")


# --- kernels/submanifold/submanifold.cu -----------------------------------------------------

# Spatial axes a rulebook kernel's record holds (kernels/submanifold/submanifold.cu).
SUBM_MAX_DIMS = 4

# Arguments of every rulebook kernel; each reads the fields it needs. A table of sites is either
# the hash table (table_keys, table_vals, mask) or, for a strided convolution's output sites, a
# bitmap of the output grid (bits, ranks, words): key q is present where bit q is set, and its
# row is ranks[q / 32] plus the set bits below it in its word.
RULE_ARGS = Record("RuleArgs", "submanifold", f"""
    const int* coords;    // sites [n, 1 + DIMS]: batch index, then coordinates
    const i64* keys_in;   // insert_keys, decode_keys: keys [n]
    i64* table_keys;      // [mask + 1], SUBM_EMPTY where free
    int* table_vals;      // [mask + 1], the row each key came from
    unsigned* bits;       // [words], or null: the table is the hash table
    int* ranks;           // [words]: per-group ranks (rank_words), then global (emit_sites)
    int* flags;           // [1], OR of the SUBM_* flags
    int* counter;         // compact_table: keys appended; rank_words: groups done
    int* out_map;         // [taps, n] maps; decode_keys, emit_sites: coords [n, 1 + DIMS]
    int* out_map_t;       // query_subm, scatter_strided: the transposed map
    i64* out_keys;        // compact_table: the occupied slots' keys, in no particular order
    int* group;           // rank_words, emit_sites: [groups + 1] set bits before each group
    i64 mask, n, words, n_out;  // capacity - 1 (a power of two minus one); sites; bitmap words;
                                // rows of a bitmap's sites (its lookups find no others)
    int batch, taps, transposed, symmetric;
    int shape[{SUBM_MAX_DIMS}];        // grid of `coords`
    int query_shape[{SUBM_MAX_DIMS}];  // grid of the table's keys
    int kernel[{SUBM_MAX_DIMS}], stride[{SUBM_MAX_DIMS}], padding[{SUBM_MAX_DIMS}];
    int dilation[{SUBM_MAX_DIMS}];
""")

# submanifold_gather: the gemm algorithm's gathered rows.
GATHER_ARGS = Record("GatherArgs", "submanifold", """
    const void* src;  // features [N_in, words] (Word units)
    void* dst;        // [n_out, taps, words]
    const int* map;   // [taps, n_out]: row of src, or -1 for zeros
    i64 n_out;
    int taps, words;
""")

# tap_masks: the neighbour masks that Rulebook.fused_order sorts rows by; ordered_map: its rows.
MASK_ARGS = Record("MaskArgs", "submanifold", """
    const int* map;     // [taps, n]: a rulebook's map, -1 for absent neighbours
    void* masks;        // [n] of Mask: bit k set where row r has tap k, for the Mask's first taps
    const void* order;  // ordered_map: [n] of Index, a permutation of the map's rows
    int* rows;          // ordered_map: [1 + taps, n], order, then the map's columns in its order
    i64 n;
    int taps;
""")

# submanifold_fused: the fused convolution.
FUSED_ARGS = Record("FusedArgs", "submanifold", """
    const void* features;  // [N_in, cin]
    const void* weight;    // [cout, taps, cin]
    const void* bias;      // [cout], or null
    const int* map;        // [taps, n_out]: the input row tap k of the output at position o
                           // (o itself, or order[o]) reads, or -1
    void* out;             // [n_out, cout]
    float* partial;        // [splits, n_out, cout] for split taps (then out, bias unused), or null
    i64 n_out;
    int cin, cout, taps;
    int split_taps;        // taps a split (blockIdx.z) sums
    const int* order;      // [n_out]: the output rows in the order tiles take them (rows of
                           // like neighbour masks together, tap_masks), or null: 0, 1, ...
    int relu;              // 1: out = max(0, sum + bias) (unused with partial)
""")

# submanifold_grad_weight: the weight's gradient, gathered rows and matrix product in one kernel.
GRAD_WEIGHT_ARGS = Record("GradWeightArgs", "submanifold", """
    const void* features;  // [N_in, cin]
    const void* dy;        // [n_out, cout]: the output's gradient
    const int* map;        // [taps, n_out]: the input row tap k of the output at position o
                           // (o itself, or order[o]) reads, or -1
    float* out;            // [splits, cout, taps * cin]: split z's sums at z * cout * taps * cin
    i64 n_out;
    int cin, cout, taps;
    int split_sites;       // output sites (or a tap's pairs) a split (blockIdx.z) sums
    const int* pairs;      // [taps, n_out]: the sites that have each tap (tap_pairs), or null
                           // (every site; tiles across taps)
    const int* totals;     // [taps]: how many sites each tap has, with pairs
    int tiles_per_tap;     // with pairs: column tiles a tap (ceil(cin / 64))
""")

# tap_pair_counts, tap_pairs: the sites that have each tap of a map, in order.
PAIR_ARGS = Record("PairArgs", "submanifold", """
    const int* map;  // [taps, n_out]
    int* counts;     // [taps, blocks]: sites of each block of sites that have the tap
    int* pairs;      // [taps, n_out]: those sites, in order (past totals[k]: not written)
    int* totals;     // [taps]
    i64 n_out;
    int blocks;
""")
