"""sparse_kernel_conv2d: 2-D convolution with a pruned weight, multiplying its non-zero taps only.

A weight is converted once, on its device, by SparseKernel.from_dense; the convolution then
reads the tap lists (the pruning mask stays fixed, so the values alone can be trained). Two
CUDA strategies (kernels/sparse_kernel_conv.cu), picked per shape by choose_strategy:

- "compiled": the mask compiled into the kernel. A warp computes 32 columns x P rows of output
  for a group of Q output channels from an input tile (with halo) staged in shared memory.
  Per column (input channel, kw) of the group's taps, each thread loads the input rows its
  outputs read into registers once (16-byte loads), and every tap of the column, whatever its
  kh, is P FMAs from registers. The tap's accumulator and window offset must be compile-time
  indices for both to stay in registers, so the code for a mask is generated (_program) and
  compiled by NVRTC on first use (CuPy keeps the binary in its disk cache); the values stay in
  memory, so training them needs no recompilation. Unit vertical stride, no input dilation,
  float32 arithmetic, at most COMPILED_MAX_TAPS taps.
- "direct": any stride, dilation and input dilation (the gradient of a strided convolution),
  float64 too: P shared-memory loads and P FMAs a tap, read from the tap list at run time.

NumPy arrays run a vectorised NumPy backend (one matrix product per kernel position that has
non-zero taps), the reference and the CPU path.
"""

import functools
import hashlib
import math
from collections import namedtuple

import numpy

from .core import checks as _checks, kernels as _kernels, launch as _launch, records as _records

STRATEGIES = ("compiled", "direct")

# The tile sizes, in one place. P: output rows a thread; Q: output channels a warp (a group).
# "compiled" keeps P * Q = 64 accumulators a thread and takes the Q of the table for the
# output channels (a wider group shares a column's window among more taps; with few output
# channels, more rows do instead).
_COMPILED_TILES = ((4, 16), (8, 8), (16, 4))  # (Q, P), by the smallest Q >= min(Cout, 16)
_COMPILED_WARPS = 8  # warps a CTA, stacked vertically (__launch_bounds__(256, 2) in the kernel)
# Code size (and NVRTC time, about linear in it) grows with the taps: above this many the rule
# runs "direct" and "compiled" refuses.
COMPILED_MAX_TAPS = 8192
_COMPILED_MAX_EXTENT = 33  # kernel rows (with dilation) a window may span: registers
_DIRECT_P, _DIRECT_Q = 8, 4
_GRAD_P, _GRAD_CO_CHUNK, _GRAD_WARPS = 16, 8, 8
_DIRECT_WARPS = 8  # warps a CTA (64 registers a thread)
_SPLIT_CTAS_PER_SM = 2  # "direct" splits its input channels until the grid has this many an SM
_SMEM_LIMIT = 48 * 1024  # dynamic shared memory without the opt-in attribute
# "compiled" opts in to more (the kernel attribute): at most this, and no more than keeps
# _COMPILED_CTAS_PER_SM CTAs on an SM of the device: larger chunks of input channels, fewer
# passes over them.
_COMPILED_SMEM_LIMIT = 100 * 1024
_COMPILED_CTAS_PER_SM = 2
_RESERVED_SMEM = 1024  # shared memory the GPU keeps for each CTA (compute capability 8.0 on)
# The kernels' argument records (sbnet_cupy/core/records.py): the plans build the int fields by
# name (Record.tail), and the launches put the pointers in front of them.
_CONV_ARGS = _records.CONV_ARGS
_GRAD_VALUES_ARGS = _records.GRAD_VALUES_ARGS
_DTYPES = ("float16", "bfloat16", "float32", "float64")
_MAX_KERNEL_SIDE = 255  # the kernels pack kh and kw in 8 bits and the input channel in 15
_MAX_CIN = 32767


def choose_strategy(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                    input_dilation, nnz, *, info):
    """The strategy sparse_kernel_conv2d uses when none is given, for conv_plan's arguments on
    a GPU of DeviceInfo `info` (_launch.device_info): "compiled" where it applies, unless it
    takes two passes or more over the input channels with fewer CTAs than the GPU has SMs;
    "direct" elsewhere.

    "compiled" applies with unit vertical stride, no input dilation, float32 arithmetic, at most
    COMPILED_MAX_TAPS taps, a kernel extent (KH - 1) * DH + 1 <= 33 rows and room in shared
    memory for its tile and its values. It stages the input tile a chunk of input channels at a
    time (3-4 channels of 16-64 at 11x11xCinx3; "direct" 3), one group of output channels a CTA.
    On one image with few output channels its CTAs are fewer than the SMs, where "direct" has
    more tiles and splits their input channels over more CTAs; with one pass there is nothing to
    split. Elsewhere "compiled" was the faster in every case of the benchmark, very sparse
    kernels and inputs larger than L2 read in many passes included.

    The measurements behind it: bench/README.md, "The strategies and the rule";
    test_rule_matches_the_benchmark checks it against the committed run.
    """
    extent = (kernel_hw[0] - 1) * dilations[0] + 1
    if (dtype == "float64" or strides[0] != 1 or tuple(input_dilation) != (1, 1)
            or nnz > COMPILED_MAX_TAPS or extent > _COMPILED_MAX_EXTENT):
        return "direct"
    try:
        plan = _compiled_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations,
                              pads, input_dilation, nnz, info)
    except ValueError:  # no room in shared memory
        return "direct"
    passes, ctas = -(-cin // plan.layout[4]), math.prod(plan.grid)
    return "direct" if passes >= 2 and 0 < ctas < info.sms else "compiled"  # 0: empty output


# --- the converted weight -----------------------------------------------------------------

class _Taps:
    """The non-zero taps of a weight [KH, KW, Cin, Cout] in canonical order (output channel,
    input channel, kh, kw): int32 arrays co, ci, kh, kw on the weight's device, the index arrays
    of the "direct" kernels, and the compiled kernels' Programs, built on first use and kept."""

    def __init__(self, xp, shape, co, ci, kh, kw):
        self.xp, self.shape = xp, shape
        _, k_w, cin, cout = shape
        self.co, self.ci, self.kh, self.kw = co, ci, kh, kw
        self.nnz = int(co.shape[0])
        # Flat index of each tap in the dense HWIO weight: the pruning mask.
        self.positions = ((kh.astype(xp.int64) * k_w + kw) * cin + ci) * cout + co
        self.ranges = xp.searchsorted(co.astype(xp.int64) * cin + ci,
                                      xp.arange(cout * cin + 1), side="left").astype(xp.int32)
        self.packed = ((ci << 16) | (kh << 8) | kw).astype(xp.int32)
        self._arrays = {}
        self._programs = {}
        self._transposed = None

    @classmethod
    def from_positions(cls, xp, shape, positions):
        """The taps at flat HWIO indices `positions` (int64, canonical order: as a SparseKernel's
        positions), for the bridges, which keep the mask as a tensor."""
        k_h, k_w, cin, cout = shape
        rest, co = xp.divmod(positions, cout)
        rest, ci = xp.divmod(rest, cin)
        kh, kw = xp.divmod(rest, k_w)
        return cls(xp, tuple(shape), *(a.astype(xp.int32) for a in (co, ci, kh, kw)))

    def arrays(self, transposed, layout):
        """(ranges, taps, order) of a launch of a plan with this layout (ConvPlan.layout), for
        this weight or the transposed convolution's: the "direct" kernel's index arrays, or
        (None, None, order) for "compiled"; tap t of the launch is the canonical tap order[t]
        (order None: the canonical order itself)."""
        key = (transposed, layout)
        arrays = self._arrays.get(key)
        if arrays is None:
            with _checks.on_device(self.co):  # the taps' device, whichever is current
                taps, base = self.transposed() if transposed else (self, None)
                if layout is None:
                    ranges, codes, order = taps.ranges, taps.packed, None
                else:
                    ranges, codes = None, None
                    order = self.xp.asarray(taps.program(layout).order)
                if base is not None:
                    order = base if order is None else base[order]
            arrays = self._arrays[key] = (ranges, codes, order)
        return arrays

    def program(self, layout):
        """The _Program of this weight for a "compiled" plan's layout (built on first use)."""
        program = self._programs.get(layout)
        if program is None:
            host = [a if self.xp is numpy else a.get()
                    for a in (self.co, self.ci, self.kh, self.kw)]
            program = self._programs[layout] = _program(*host, self.shape, *layout)
        return program

    def function(self, transposed, plan, dtype, device):
        """Address of the kernel that runs `plan` (made with `device`) for this weight or the
        transposed convolution's: the plan's, or for "compiled" the weight's own (compiled on
        first use)."""
        if plan.strategy != "compiled":
            return plan.function
        taps = self.transposed()[0] if transposed else self
        return taps.program(plan.layout).function(dtype, device)

    def transposed(self):
        """(_Taps of the transposed convolution's weight, order): w_t[kh, kw, co, ci] =
        w[KH-1-kh, KW-1-kw, ci, co]; its canonical tap t is the canonical tap order[t] here."""
        if self._transposed is None:
            xp = self.xp
            k_h, k_w, cin, cout = self.shape
            with _checks.on_device(self.co):
                kh, kw = k_h - 1 - self.kh, k_w - 1 - self.kw
                key = ((self.ci.astype(xp.int64) * cout + self.co) * k_h + kh) * k_w + kw
                order = xp.argsort(key, kind="stable")
                taps = _Taps(xp, (k_h, k_w, cout, cin), self.ci[order], self.co[order],
                             kh[order], kw[order])
            self._transposed = (taps, order)
        return self._transposed


# --- the compiled kernel's programs -------------------------------------------------------

_Column = namedtuple("_Column", ["offset", "quads", "first", "taps"])
_Column.__doc__ = """A column (input channel, kw) of a group's taps: its window's word offset
from the thread's first window word, the window's 4-word quads that its taps read (quad i:
rows 4i..4i+3), its first tap's index in the group's run of values, and its taps as (q, row)
pairs, q the output channel in the group, row = kh * DH the first window row the tap reads; the
column's taps are values first, first + 1, ... of the run."""


class _Program:
    """A weight's mask as code: the Program struct that sparse_kernel_conv_compiled<T,
    Program> runs, for one layout (P, Q, tile columns, pitch, chunk, DH, DW).

    Attributes:
        groups: per group of Q output channels, (first, count, chunks): its run of values
            [first, first + count) in the launch's order, and its columns by chunk of input
            channels as (ci0, [_Column]) (chunks without taps left out).
        order: int64 [nnz]: the canonical tap of each value of the launch's order.
    """

    def __init__(self, p, q, groups, order):
        self.p, self.q, self.groups, self.order = p, q, groups, order
        self._code = None
        self._functions = {}

    @property
    def name(self):
        """The struct's name: P, Q and a digest of its code (a profiler trace names the mask)."""
        return self._build()[0]

    @property
    def source(self):
        """C++ source of the Program struct (placed after kernels/sparse_kernel_conv.cu)."""
        return self._build()[1]

    def _build(self):
        if self._code is None:
            lines = []
            for g, (first, count, chunks) in enumerate(self.groups):
                if not chunks:
                    continue  # no taps: the outputs are the bias
                lines.append(f"        case {g}:")
                for c, (ci0, columns) in enumerate(chunks):
                    lines.append(f"            f.chunk({ci0});" if c else
                                 f"            f.begin({first}, {count}, {ci0});")
                    lines += [self._column_source(column) for column in columns]
                lines.append("            break;")
            digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]
            name = f"Program_p{self.p}q{self.q}_{digest}"
            accumulators = [f"a{q}_{p}" for q in range(self.q) for p in range(self.p)]
            self._code = (name, "\n".join([
                f"struct {name} {{",
                f"    static constexpr int P = {self.p}, Q = {self.q};",
                "    template <class Frame, typename Acc>",
                "    static __device__ __forceinline__ void run(const Frame& f, int g, "
                "Acc (&acc)[Q][P], const Acc* s) {",
                # Named accumulators, not acc[q][p]: NVRTC takes half the time on them.
                "        Acc " + ", ".join(f"{a} = 0" for a in accumulators) + ";",
                "        switch (g) {", *lines, "        }",
                "        " + " ".join(f"acc[{q}][{p}] = a{q}_{p};" for q in range(self.q)
                                      for p in range(self.p)),
                "    }", "};", ""]))
        return self._code

    def _column_source(self, column):
        """One column: load its window quads (w<i>: rows 4i..4i+3) and its values' quads (v<i>:
        values 4i..4i+3 of the group's run), then P FMAs a tap: a<q>_<p> += v * window[row + p]."""
        v0, v1 = column.first // 4, (column.first + len(column.taps) - 1) // 4 + 1
        loads = ([f"w{i} = ld4(s + {column.offset + 4 * i})" for i in column.quads]
                 + [f"v{i} = ld4(f.vals + {4 * i})" for i in range(v0, v1)])
        fmas = []
        for t, (q, row) in enumerate(column.taps, column.first):
            v = f"v{t // 4}.v[{t % 4}]"
            fmas += [f"a{q}_{p} = fma_acc({v}, w{(row + p) // 4}.v[{(row + p) % 4}], a{q}_{p});"
                     for p in range(self.p)]
        return ("            { const vec_t<Acc, 4> " + ", ".join(loads) + "; " + " ".join(fmas)
                + " }")

    def kernel_name(self, dtype):
        """The name expression of the kernel running this program on `dtype` data."""
        return _kernels.name_expression("sparse_kernel_conv_compiled",
                                        _kernels.ARITHMETIC_CTYPES[dtype], self.name)

    def module_source(self):
        """kernels/sparse_kernel_conv.cu (after common.cuh) followed by the Program."""
        return _kernels.kernel_source("sparse_kernel_conv") + "\n" + self.source

    def function(self, dtype, device):
        """Address of sparse_kernel_conv_compiled<T, Program> on `device` (compiled on first
        use, by NVRTC or from CuPy's disk cache)."""
        key = (dtype, device)
        entry = self._functions.get(key)
        if entry is None:
            import cupy

            name = self.kernel_name(dtype)
            with cupy.cuda.Device(device):
                module = cupy.RawModule(code=self.module_source(), options=_kernels.COMPILE_OPTIONS,
                                        name_expressions=(name,))
                compiled = module.get_function(name).kernel  # the driver-level function
            driver = _launch.driver
            driver.funcSetAttribute(compiled.ptr,
                                    driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    _compiled_smem_limit(_launch.device_info(device)))
            entry = self._functions[key] = (compiled.ptr, module, compiled)  # keeps it loaded
        return entry[0]


def _program(co, ci, kh, kw, shape, p, q, cols, pitch, chunk, dil_h, dil_w):
    """The _Program of the taps (host int arrays, canonical order) of a weight of `shape` for a
    "compiled" layout: per group, a column per (ci, kw) in that order, its taps by (kh, co)."""
    groups_count = -(-shape[3] // q)
    group = co // q
    order = numpy.lexsort((co, kh, kw, ci, group))  # the last key sorts first
    group, ci, kw = group[order], ci[order], kw[order]
    q_of, row_of = (co % q)[order], (kh * dil_h)[order]
    new_column = numpy.ones(len(order), bool)
    new_column[1:] = (group[1:] != group[:-1]) | (ci[1:] != ci[:-1]) | (kw[1:] != kw[:-1])
    starts = numpy.flatnonzero(new_column).tolist() + [len(order)]
    bounds = numpy.searchsorted(group, numpy.arange(groups_count + 1)).tolist()
    groups = [(bounds[g], bounds[g + 1] - bounds[g], []) for g in range(groups_count)]
    for a, b in zip(starts[:-1], starts[1:]):
        g, c, w = int(group[a]), int(ci[a]), int(kw[a])
        first, _, chunks = groups[g]
        ci0 = c // chunk * chunk
        if not chunks or chunks[-1][0] != ci0:
            chunks.append((ci0, []))
        rows = row_of[a:b].tolist()
        quads = sorted({i for r in rows for i in range(r // 4, (r + p - 1) // 4 + 1)})
        chunks[-1][1].append(_Column(((c - ci0) * cols + w * dil_w) * pitch, quads, a - first,
                                     list(zip(q_of[a:b].tolist(), rows))))
    return _Program(p, q, groups, order)


class SparseKernel:
    """A pruned convolution weight, converted once for sparse_kernel_conv2d.

    Attributes:
        shape: (KH, KW, Cin, Cout) of the dense weight (HWIO, TensorFlow's layout).
        dtype: name of the data type: "float16", "bfloat16", "float32" or "float64".
        device: the CuPy device id the kernel lives on, or None for NumPy.
        nnz: number of non-zero taps.
        values: [nnz] array of the non-zero weights, in canonical order: by output channel,
            then input channel, kh, kw. bfloat16 values are held as their 16-bit patterns
            (uint16 or int16, as given).
        positions: int64 [nnz], the flat index of each value in the dense weight (the pruning
            mask): ``w.reshape(-1)[positions] == values``.

    Calls with the same kernel reuse the index arrays built for a strategy and dilation on first
    use. ``with_values`` makes a kernel of the same mask with new values (training).
    """

    def __init__(self, taps, values, dtype):
        """Internal: use from_dense or with_values."""
        self._taps, self.values, self.dtype = taps, values, dtype
        self._ordered = {}  # values in the order of a launch's taps, by (transposed, layout)

    @classmethod
    def from_dense(cls, w, *, dtype=None):
        """Convert a pruned weight [KH, KW, Cin, Cout] (numpy or cupy array), on its device.

        Args:
            w: float16, float32 or float64 array; or, with dtype="bfloat16", the 16-bit
                patterns of bfloat16 values as a uint16 or int16 array.
            dtype: None (w's dtype) or "bfloat16".

        Zeros (+0 and -0) are pruned taps; every other value, NaN included, is kept.
        """
        xp = _checks.array_module(w=w)
        if w.ndim != 4:
            raise ValueError(f"w must be 4-D [KH, KW, Cin, Cout], got shape {w.shape}")
        dtype = _data_dtype("w", w, dtype)
        k_h, k_w, cin, _ = w.shape
        if max(k_h, k_w) > _MAX_KERNEL_SIDE or cin > _MAX_CIN:
            raise ValueError(f"w's kernel sides must be at most {_MAX_KERNEL_SIDE} and its input "
                             f"channels at most {_MAX_CIN}, got shape {w.shape}")
        with _checks.on_device(w):
            nonzero = (w & 0x7FFF) != 0 if dtype == "bfloat16" else w != 0
            # C order over [Cout, Cin, KH, KW] is the canonical order.
            co, ci, kh, kw = (a.astype(xp.int32) for a in xp.nonzero(nonzero.transpose(3, 2, 0, 1)))
            taps = _Taps(xp, tuple(int(s) for s in w.shape), co, ci, kh, kw)
            values = xp.ascontiguousarray(w[kh, kw, ci, co])
        return cls(taps, values, dtype)

    @property
    def shape(self):
        return self._taps.shape

    @property
    def nnz(self):
        return self._taps.nnz

    @property
    def positions(self):
        return self._taps.positions

    @property
    def device(self):
        return None if self._taps.xp is numpy else self.values.data.device_id

    @property
    def density(self):
        """Fraction of the dense weight's entries that are non-zero taps."""
        return self.nnz / max(math.prod(self.shape), 1)

    def with_values(self, values):
        """A kernel with this one's mask and the given [nnz] values (canonical order), of the
        same dtype and device; the index arrays are shared, not copied."""
        xp = _checks.array_module(values=values)
        if xp is not self._taps.xp or (xp is not numpy and values.data.device_id != self.device):
            raise ValueError("values must be on the kernel's device")
        if values.shape != (self.nnz,) or values.dtype != self.values.dtype:
            raise ValueError(f"values must be a {self.values.dtype} array of shape ({self.nnz},), "
                             f"got {values.dtype} {values.shape}")
        return SparseKernel(self._taps, xp.ascontiguousarray(values), self.dtype)

    def to_dense(self):
        """The dense weight [KH, KW, Cin, Cout] (zeros at the pruned taps)."""
        xp = self._taps.xp
        with _checks.on_device(self.values):
            w = xp.zeros(math.prod(self.shape), dtype=self.values.dtype)
            w[self.positions] = self.values
        return w.reshape(self.shape)

    def __repr__(self):
        where = "numpy" if self.device is None else f"cuda:{self.device}"
        return (f"SparseKernel(shape={self.shape}, dtype={self.dtype}, nnz={self.nnz}, "
                f"density={self.density:.3g}, device={where})")

    def _launch_arrays(self, transposed, layout):
        """(ranges, taps, values) of a launch (see _Taps.arrays), values in its order."""
        ranges, codes, order = self._taps.arrays(transposed, layout)
        key = (transposed, layout)
        values = self._ordered.get(key)
        if values is None:
            values = self._ordered[key] = self.values if order is None else self.values[order]
        return ranges, codes, values


def _data_dtype(name, a, dtype):
    """The data type name of array `a` (dtype="bfloat16" for 16-bit patterns)."""
    if dtype is None:
        if a.dtype.name not in _DTYPES:
            raise TypeError(f"{name} must be float16, float32 or float64 (bfloat16 as uint16 or "
                            f"int16 with dtype='bfloat16'), got {a.dtype}")
        return a.dtype.name
    if dtype != "bfloat16" or a.dtype.name not in ("uint16", "int16"):
        raise TypeError(f"dtype={dtype!r} needs {name} to hold bfloat16 patterns as uint16 or "
                        f"int16, got {a.dtype}")
    return dtype


# --- geometry -----------------------------------------------------------------------------

def _padding(padding):
    """"SAME", "VALID" or ((top, bottom), (left, right)), from the forms sparse_kernel_conv2d
    takes."""
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"padding must be 'SAME', 'VALID' or explicit pads, got {padding!r}")
        return padding.upper()
    try:
        pads = tuple(padding)
        if all(type(p) is int for p in pads) and len(pads) == 2:
            pads = ((pads[0], pads[0]), (pads[1], pads[1]))
        pads = tuple(tuple(_checks.int_pair("padding", p, minimum=0)) for p in pads)
    except (TypeError, ValueError):
        raise ValueError(f"padding must be 'SAME', 'VALID', (pad_h, pad_w) or ((top, bottom), "
                         f"(left, right)) of ints >= 0, got {padding!r}") from None
    if len(pads) != 2:
        raise ValueError(f"padding must be 'SAME', 'VALID', (pad_h, pad_w) or ((top, bottom), "
                         f"(left, right)) of ints >= 0, got {padding!r}")
    return pads


def conv_geometry(in_hw, kernel_hw, strides, padding, dilations):
    """((out_h, out_w), ((top, bottom), (left, right))) of a convolution, TensorFlow's rules:
    SAME gives ceil(in / stride) outputs with the padding split evenly (the extra row at the
    bottom), VALID ceil((in - (k - 1) * dilation) / stride), explicit pads what they say."""
    out, pads = [], []
    for axis in range(2):
        size, k, s, d = in_hw[axis], kernel_hw[axis], strides[axis], dilations[axis]
        extent = (k - 1) * d + 1
        if padding == "SAME":
            o = -(-size // s)
            total = max((o - 1) * s + extent - size, 0)
            before, after = total // 2, total - total // 2
        else:
            before, after = (0, 0) if padding == "VALID" else padding[axis]
            padded = size + before + after
            if padded < extent:
                raise ValueError(f"kernel is larger than the padded input: its extent "
                                 f"{extent} (size {k}, dilation {d}) exceeds {padded} "
                                 f"(input {size}, padding {before} + {after}) on axis {axis}")
            o = (padded - extent) // s + 1
        out.append(o)
        pads.append((before, after))
    return tuple(out), tuple(pads)


ConvCall = namedtuple("ConvCall", ["strides", "dilations", "out_hw", "pads"])
ConvCall.__doc__ = """Checked geometry of a call: strides and dilations as int pairs, the output
size and the explicit padding ((top, bottom), (left, right))."""


def check_conv(x, kernel_shape, strides, padding, dilations, bias, strategy):
    """Checks a convolution's arguments (arrays or tensors; kernel_shape [KH, KW, Cin, Cout])
    and returns its ConvCall. Shared by sparse_kernel_conv2d and the bridges."""
    _checks.nhwc("x", x)
    k_h, k_w, cin, cout = kernel_shape
    if x.shape[3] != cin:
        raise ValueError(f"x has {x.shape[3]} channels but kernel expects {cin} "
                         f"(kernel shape {tuple(kernel_shape)})")
    strides = _checks.int_pair("strides", strides, minimum=1)
    dilations = _checks.int_pair("dilations", dilations, minimum=1)
    out_hw, pads = conv_geometry(tuple(x.shape[1:3]), (k_h, k_w), strides, _padding(padding),
                                 dilations)
    if bias is not None and (tuple(bias.shape) != (cout,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be a {_checks.dtype_name(x)} array of shape ({cout},), "
                         f"got {_checks.dtype_name(bias)} {tuple(bias.shape)}")
    _check_strategy(strategy)
    return ConvCall(strides, dilations, out_hw, pads)


def _check_strategy(strategy):
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be None or one of {STRATEGIES}, got {strategy!r}")


def _check_kernel(xp, name, x, kernel):
    """Checks that `kernel` is a SparseKernel converted for x's backend, device and dtype."""
    if type(kernel) is not SparseKernel:
        raise TypeError(f"kernel must be a SparseKernel (SparseKernel.from_dense(w)), "
                        f"got {type(kernel).__name__}")
    if kernel._taps.xp is not xp:
        raise TypeError(f"kernel was converted for {kernel._taps.xp.__name__} arrays but {name} "
                        f"is a {xp.__name__} array")
    if xp is not numpy and kernel.device != x.data.device_id:
        raise ValueError(f"kernel was converted on device {kernel.device} but {name} is on "
                         f"device {x.data.device_id}")
    if x.dtype != kernel.values.dtype:
        raise TypeError(f"kernel was converted for {kernel.values.dtype} ({kernel.dtype}) but "
                        f"{name} is {x.dtype}")
    if xp is numpy and kernel.dtype == "bfloat16":
        raise TypeError("bfloat16 needs CuPy arrays (NumPy has no bfloat16 arithmetic)")


def _acc_dtype(dtype):
    return numpy.float64 if dtype == "float64" else numpy.float32


# --- the public ops ------------------------------------------------------------------------

def sparse_kernel_conv2d(x, kernel, *, strides=(1, 1), padding="SAME", dilations=(1, 1),
                         bias=None, strategy=None, out=None):
    """Convolve NHWC `x` with a pruned weight, multiplying its non-zero taps only.

    Args:
        x: [N, H, W, Cin] array (numpy or cupy) of the kernel's dtype, on its device.
        kernel: SparseKernel.from_dense(w) of the weight w [KH, KW, Cin, Cout].
        strides, dilations: (SH, SW) and (DH, DW), ints >= 1 (or one int for both).
        padding: "SAME" or "VALID" (TensorFlow's rules), (pad_h, pad_w) for symmetric zero
            padding (PyTorch's), or ((top, bottom), (left, right)).
        bias: optional [Cout] array of x's dtype.
        strategy: None (choose_strategy's rule), "compiled" or "direct" (CuPy only; the
            NumPy backend has one path).
        out: optional C-contiguous [N, OH, OW, Cout] array of x's dtype to write into (no
            allocation, so the call can be captured in a CUDA graph).

    Returns:
        [N, OH, OW, Cout] array of x's dtype: float16 and bfloat16 accumulate in float32, the
        result rounded once; float32 results equal the dense convolution's up to float32
        rounding. With xpad = x zero-padded by (top, left)::

            out[n, oy, ox, co] = bias[co] + sum over kh, kw, ci of
                xpad[n, oy*SH + kh*DH, ox*SW + kw*DW, ci] * w[kh, kw, ci, co]

        where the sum runs over the non-zero taps of w only.
    """
    xp = _checks.array_module(x=x) if bias is None else _checks.array_module(x=x, bias=bias)
    _check_kernel(xp, "x", x, kernel)
    call = _checks.memoized(_CHECKED, check_conv, (x, kernel.shape, strides, padding, dilations,
                                                    bias, strategy), _checks.ARRAY_TYPES)
    shape = (x.shape[0], *call.out_hw, kernel.shape[3])
    before = (call.pads[0][0], call.pads[1][0])
    with _checks.on_device(x):
        if out is None:
            out = xp.empty(shape, dtype=x.dtype)
        elif (type(out) is not type(x) or out.shape != shape or out.dtype != x.dtype
              or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous {x.dtype} {xp.__name__} array of "
                             f"shape {shape}, got {type(out).__name__} {out.dtype} {out.shape}")
        if xp is numpy:
            out[...] = _forward_numpy(x, kernel, call.strides, call.dilations, call.out_hw,
                                      before, bias)
        else:
            _conv_cupy(x, kernel, False, out, call.strides, call.dilations, before, (1, 1), bias,
                       strategy)
    return out


_CHECKED = {}


def sparse_kernel_conv2d_grad_input(dy, kernel, input_shape, *, strides=(1, 1), padding="SAME",
                                    dilations=(1, 1), strategy=None):
    """Gradient of sparse_kernel_conv2d with respect to x: the transposed convolution.

    Args:
        dy: [N, OH, OW, Cout] gradient of the output, of the kernel's dtype.
        kernel: the SparseKernel of the forward call.
        input_shape: (N, H, W, Cin) of the forward call's x.
        strides, padding, dilations: those of the forward call.
        strategy: as for sparse_kernel_conv2d; "compiled" needs unit strides.

    Returns:
        dx [N, H, W, Cin] of dy's dtype::

            dx[n, oy*SH + kh*DH - top, ox*SW + kw*DW - left, ci] +=
                dy[n, oy, ox, co] * w[kh, kw, ci, co]   (over the non-zero taps)

    On CuPy it is the forward convolution of dy, with SH - 1 (SW - 1) zeros between its rows
    (columns), by the weight flipped in kh and kw with Cin and Cout swapped.
    """
    xp = _checks.array_module(dy=dy)
    _check_kernel(xp, "dy", dy, kernel)
    call = check_grad(dy, kernel.shape, input_shape, strides, padding, dilations, strategy)
    before = (call.pads[0][0], call.pads[1][0])
    with _checks.on_device(dy):
        if xp is numpy:
            return _grad_input_numpy(dy, kernel, tuple(input_shape), call.strides,
                                     call.dilations, before)
        dx = xp.empty(tuple(input_shape), dtype=dy.dtype)
        strides_t, pads_t, input_dilation = transposed_geometry(kernel.shape, call.strides,
                                                                call.dilations, before)
        _conv_cupy(dy, kernel, True, dx, strides_t, call.dilations, pads_t, input_dilation, None,
                   strategy)
        return dx


def sparse_kernel_conv2d_grad_values(x, dy, kernel, *, strides=(1, 1), padding="SAME",
                                     dilations=(1, 1)):
    """Gradient of sparse_kernel_conv2d with respect to the kernel's non-zero values.

    Args:
        x: the forward call's input [N, H, W, Cin]. dy: [N, OH, OW, Cout], the output gradient.
        kernel, strides, padding, dilations: those of the forward call.

    Returns:
        [nnz] array of x's dtype, in the order of kernel.values (accumulated in float32, or
        float64 for float64)::

            grad[t] = sum over n, oy, ox of dy[n, oy, ox, co_t] *
                      xpad[n, oy*SH + kh_t*DH, ox*SW + kw_t*DW, ci_t]

    On CuPy the sums are added up with atomics: their order, and so float rounding, varies
    from run to run.
    """
    xp = _checks.array_module(x=x, dy=dy)
    _check_kernel(xp, "x", x, kernel)
    if dy.dtype != x.dtype:
        raise TypeError(f"dy dtype {dy.dtype} differs from x dtype {x.dtype}")
    _checks.nhwc("x", x)
    call = check_grad(dy, kernel.shape, x.shape, strides, padding, dilations, None)
    before = (call.pads[0][0], call.pads[1][0])
    with _checks.on_device(x):
        if xp is numpy:
            return _grad_values_numpy(x, dy, kernel, call.strides, call.dilations, before)
        return _grad_values_cupy(x, dy, kernel, call.strides, call.dilations, before)


def check_grad(dy, kernel_shape, input_shape, strides, padding, dilations, strategy):
    """Checks the arguments of a gradient (arrays or tensors): dy is the output gradient of a
    convolution of an input of input_shape (N, H, W, Cin); returns its ConvCall."""
    _checks.nhwc("dy", dy)
    try:
        shape = tuple(int(s) for s in input_shape)
    except TypeError:
        raise TypeError(f"input_shape must be (N, H, W, Cin), got {input_shape!r}") from None
    if (len(shape) != 4 or shape[0] != dy.shape[0] or shape[3] != kernel_shape[2]
            or min(shape) < 0):
        raise ValueError(f"input_shape must be (N, H, W, Cin) = ({dy.shape[0]}, H, W, "
                         f"{kernel_shape[2]}), got {input_shape!r}")
    strides = _checks.int_pair("strides", strides, minimum=1)
    dilations = _checks.int_pair("dilations", dilations, minimum=1)
    out_hw, pads = conv_geometry(shape[1:3], tuple(kernel_shape[:2]), strides,
                                 _padding(padding), dilations)
    expected = (shape[0], *out_hw, kernel_shape[3])
    if tuple(dy.shape) != expected:
        raise ValueError(f"dy must have the forward output's shape {expected}, "
                         f"got {tuple(dy.shape)}")
    _check_strategy(strategy)
    return ConvCall(strides, dilations, out_hw, pads)


def transposed_geometry(kernel_shape, strides, dilations, pads):
    """(strides, pads, input dilation) of the forward convolution that computes the input
    gradient: dx[iy] = sum over kh' of D[iy + kh' * DH - pad'] * w[KH-1-kh'], where D is dy
    with SH - 1 zeros between its rows (and likewise for the columns) and pad' = (KH-1) * DH -
    pad_top."""
    pads_t = tuple((k - 1) * d - p for k, d, p in zip(kernel_shape[:2], dilations, pads))
    return (1, 1), pads_t, tuple(strides)


# --- NumPy backend -------------------------------------------------------------------------

def _dense_positions(kernel, acc):
    """The dense weight in the accumulation type and the (kh, kw) that have non-zero taps."""
    w = kernel.to_dense().astype(acc)
    k_h, k_w = kernel.shape[:2]
    spots = numpy.unique(kernel.positions // (kernel.shape[2] * kernel.shape[3]))
    return w, [divmod(int(s), k_w) for s in spots]


def _tap_view(a, kh, kw, out_hw, strides, dilations):
    """a[:, kh*DH :: SH, kw*DW :: SW] cut to out_hw: what tap (kh, kw) meets at every output."""
    (oh, ow), (sh, sw), (dh, dw) = out_hw, strides, dilations
    return a[:, kh * dh: kh * dh + (oh - 1) * sh + 1: sh, kw * dw: kw * dw + (ow - 1) * sw + 1: sw]


def _padded(x, acc, out_hw, kernel_hw, strides, dilations, pads):
    """x in the accumulation type, zero-padded to cover every input pixel the outputs read."""
    n, height, width, channels = x.shape
    rows = (out_hw[0] - 1) * strides[0] + (kernel_hw[0] - 1) * dilations[0] + 1
    cols = (out_hw[1] - 1) * strides[1] + (kernel_hw[1] - 1) * dilations[1] + 1
    xpad = numpy.zeros((n, max(rows, pads[0] + height), max(cols, pads[1] + width), channels), acc)
    xpad[:, pads[0]:pads[0] + height, pads[1]:pads[1] + width] = x
    return xpad


def _forward_numpy(x, kernel, strides, dilations, out_hw, pads, bias):
    acc = _acc_dtype(kernel.dtype)
    w, spots = _dense_positions(kernel, acc)
    xpad = _padded(x, acc, out_hw, kernel.shape[:2], strides, dilations, pads)
    y = numpy.zeros((x.shape[0], *out_hw, kernel.shape[3]), acc)
    for kh, kw in spots:
        y += _tap_view(xpad, kh, kw, out_hw, strides, dilations) @ w[kh, kw]
    if bias is not None:
        y += bias.astype(acc)
    return y


def _grad_input_numpy(dy, kernel, input_shape, strides, dilations, pads):
    acc = _acc_dtype(kernel.dtype)
    w, spots = _dense_positions(kernel, acc)
    n, height, width, cin = input_shape
    out_hw = dy.shape[1:3]
    dxpad = _padded(numpy.zeros(input_shape, acc), acc, out_hw, kernel.shape[:2], strides,
                    dilations, pads)
    dy_acc = dy.astype(acc)
    for kh, kw in spots:
        _tap_view(dxpad, kh, kw, out_hw, strides, dilations)[...] += dy_acc @ w[kh, kw].T
    return dxpad[:, pads[0]:pads[0] + height, pads[1]:pads[1] + width].astype(dy.dtype)


def _grad_values_numpy(x, dy, kernel, strides, dilations, pads):
    acc = _acc_dtype(kernel.dtype)
    _, spots = _dense_positions(kernel, acc)
    out_hw = dy.shape[1:3]
    xpad = _padded(x, acc, out_hw, kernel.shape[:2], strides, dilations, pads)
    dy_rows = dy.astype(acc).reshape(-1, dy.shape[3])
    taps = kernel._taps
    spot_of_tap = kernel.positions // (kernel.shape[2] * kernel.shape[3])
    grad = numpy.zeros(kernel.nnz, acc)
    for kh, kw in spots:
        patches = _tap_view(xpad, kh, kw, out_hw, strides, dilations)
        full = patches.reshape(-1, patches.shape[3]).T @ dy_rows  # [Cin, Cout]
        mine = spot_of_tap == kh * kernel.shape[1] + kw
        grad[mine] = full[taps.ci[mine], taps.co[mine]]
    return grad.astype(x.dtype)


# --- CuPy backend --------------------------------------------------------------------------

ConvPlan = namedtuple("ConvPlan", ["strategy", "function", "kernel", "template", "grid", "block",
                                   "smem", "ints", "layout", "split_sum"])
ConvPlan.__doc__ = """Launch of a forward kernel: the strategy, the compiled function ("direct" in
a plan made with a device; else None: a "compiled" kernel belongs to a weight's mask, see
_Taps.function), the kernel's name and template arguments ("compiled": the dtype's), grid,
block, shared-memory bytes, the int fields of ConvArgs, the layout (None for "direct", the
program's (P, Q, tile columns, pitch, chunk, DH, DW) for "compiled"), and for "direct" with its
input channels split, the launch that adds the float32 partial sums it writes, [splits, rows,
pitch], into the output: (function, rows, cols, pitch, splits) of _launch.launch_split_sum, the
function None without a device (else None)."""


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


@functools.lru_cache(maxsize=1024)
def conv_plan(strategy, dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
              input_dilation, nnz, device=None, info=None):
    """The ConvPlan of a convolution of an [n, *in_hw, cin] input (with input_dilation - 1
    zeros between its pixels) into [n, *out_hw, cout] by a kernel_hw weight of nnz taps, padded
    by pads (top, left); strategy None applies choose_strategy (and "direct" where the rule's
    "compiled" finds no room in shared memory). The plan is made for the GPU of DeviceInfo
    `info`, by default `device`'s; without a device (planning with no GPU), `info` must be
    given (such as _launch.H100). With a device, a "direct" plan carries the compiled kernel."""
    if info is None:
        if device is None:
            raise ValueError("conv_plan needs a device or a DeviceInfo (info) to plan for")
        info = _launch.device_info(device)
    if strategy is None:
        strategy = choose_strategy(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides,
                                   dilations, pads, input_dilation, nnz, info=info)
    if strategy == "compiled":
        return _compiled_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations,
                              pads, input_dilation, nnz, info)
    return _direct_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                        input_dilation, device, info)


def _compiled_smem_limit(info):
    """Dynamic shared memory a "compiled" CTA may take on a GPU of DeviceInfo `info`."""
    return min(_COMPILED_SMEM_LIMIT, info.shared_per_block_optin,
               info.shared_per_sm // _COMPILED_CTAS_PER_SM - _RESERVED_SMEM)


def _compiled_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                   input_dilation, nnz, info):
    (k_h, k_w), (sh, sw), (dh, dw) = kernel_hw, strides, dilations
    if sh != 1 or tuple(input_dilation) != (1, 1):
        raise ValueError(f"strategy 'compiled' needs unit vertical strides (and, for the input "
                         f"gradient, unit strides), got strides {strides}")
    if dtype == "float64":
        raise TypeError("strategy 'compiled' computes in float32: float64 runs 'direct'")
    if nnz > COMPILED_MAX_TAPS:
        raise ValueError(f"strategy 'compiled' takes kernels of at most {COMPILED_MAX_TAPS} "
                         f"non-zero taps, got {nnz}")
    limit = _compiled_smem_limit(info)
    q, p = next((t for t in _COMPILED_TILES if t[0] >= min(cout, 16)), _COMPILED_TILES[-1])
    groups = -(-cout // q)
    warps_y = max(1, min(_COMPILED_WARPS, -(-out_hw[0] // p)))
    window = _round_up(p + (k_h - 1) * dh, 4)  # rows of the quads a thread may load
    cols = 31 * sw + (k_w - 1) * dw + 1
    # Room for the largest run of values a group can have, after the tile.
    value_bytes = 4 * _round_up(max(min(nnz, q * k_h * k_w * cin), 1), 4)
    while True:
        rows = (warps_y - 1) * p + window
        pitch = _round_up(rows, 4)
        pitch += 4 if pitch % 8 == 0 else 0  # 4 (mod 8) words: 8 lanes' loads cover the banks
        channel_bytes = cols * pitch * 4
        if channel_bytes + value_bytes <= limit or warps_y == 1:
            break
        warps_y = 1
    chunk = min(cin, max(limit - value_bytes, 0) // channel_bytes) if cin else 1
    if chunk == 0:
        raise ValueError(f"strategy 'compiled' needs an input tile and values larger than the "
                         f"GPU kernels' shared memory ({channel_bytes} bytes a channel, "
                         f"{value_bytes} of values) with a {k_h}x{k_w} kernel, dilations "
                         f"{dilations}")
    grid = (groups * -(-out_hw[1] // 32), _checks.grid_dim("out_h", -(-out_hw[0] // (warps_y * p))),
            _checks.grid_dim("x (batch)", n))
    ints = _CONV_ARGS.tail(
        n=n, in_h=in_hw[0], in_w=in_hw[1], cin=cin, out_h=out_hw[0], out_w=out_hw[1], cout=cout,
        str_h=sh, str_w=sw, dil_h=dh, dil_w=dw, pad_h=pads[0], pad_w=pads[1], idil_h=1,
        idil_w=1, tile_rows=rows, tile_cols=cols, pitch=pitch, chunk=chunk, warps_y=warps_y,
        warps_q=1, groups=groups, split_cin=max(cin, 1))
    # The outputs pass through the same room on their way out (store_output_staged).
    output_bytes = warps_y * 32 * q * _kernels.ITEMSIZES[dtype]
    smem = max(chunk * channel_bytes + value_bytes, output_bytes)
    return ConvPlan("compiled", None, "sparse_kernel_conv_compiled",
                    (_kernels.ARITHMETIC_CTYPES[dtype],), grid, (32 * warps_y, 1, 1), smem, ints,
                    (p, q, cols, pitch, chunk, dh, dw), None)


def _direct_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                 input_dilation, device, info):
    acc_size = 8 if dtype == "float64" else 4
    (k_h, k_w), (sh, sw), (dh, dw) = kernel_hw, strides, dilations
    p, q = _DIRECT_P, _DIRECT_Q
    groups = -(-cout // q)
    warps_q = max(1, min(groups, _DIRECT_WARPS))
    warps_y = max(1, min(_DIRECT_WARPS // warps_q, -(-out_hw[0] // p)))
    cols = 31 * sw + (k_w - 1) * dw + 1
    while True:
        rows = (warps_y * p - 1) * sh + (k_h - 1) * dh + 1
        pitch = rows | 1  # odd: lanes a column apart hit different banks
        channel_bytes = cols * pitch * acc_size
        if channel_bytes <= _SMEM_LIMIT or warps_y == 1:
            break
        warps_y = 1
    chunk = min(cin, _SMEM_LIMIT // channel_bytes) if cin else 1
    if chunk == 0:
        raise ValueError(f"dilations {dilations} with a {k_h}x{k_w} kernel need an input tile "
                         f"larger than the GPU kernels' shared memory ({channel_bytes} bytes "
                         f"a channel)")
    tiles = (-(-out_hw[1] // 32), -(-out_hw[0] // (warps_y * p)), n * -(-groups // warps_q))
    split_cin = _split_cin(dtype, math.prod(tiles), cin, chunk, info.sms)
    splits = -(-cin // split_cin)
    grid = (tiles[0], _checks.grid_dim("out_h", tiles[1]),
            _checks.grid_dim("x (batch x channel groups)", tiles[2] * splits))
    ints = _CONV_ARGS.tail(
        n=n, in_h=in_hw[0], in_w=in_hw[1], cin=cin, out_h=out_hw[0], out_w=out_hw[1], cout=cout,
        str_h=sh, str_w=sw, dil_h=dh, dil_w=dw, pad_h=pads[0], pad_w=pads[1],
        idil_h=input_dilation[0], idil_w=input_dilation[1], tile_rows=rows, tile_cols=cols,
        pitch=pitch, chunk=chunk, warps_y=warps_y, warps_q=warps_q, groups=groups,
        split_cin=split_cin)
    template = (_kernels.ARITHMETIC_CTYPES[dtype], p, q)
    function = split_function = None
    if device is not None:
        function = _launch.function(device, "sparse_kernel_conv", "sparse_kernel_conv_direct",
                                    *template)
        if splits > 1:
            split_function = _launch.function(device, "sparse_kernel_conv", "split_sum",
                                              template[0])
    # A split's sums: each pixel's output channels padded to whole groups (16-byte stores).
    split_sum = ((split_function, n * out_hw[0] * out_hw[1], cout, groups * q, splits)
                 if splits > 1 else None)
    return ConvPlan("direct", function, "sparse_kernel_conv_direct", template, grid,
                    (32 * warps_y * warps_q, 1, 1), chunk * channel_bytes, ints, None, split_sum)


def _split_cin(dtype, tiles, cin, chunk, sms):
    """The input channels a split of "direct" sums: all of them (one split) where its tiles
    fill the GPU of `sms` SMs (or there is one chunk of them, or float64); else whole chunks, as
    few as make _SPLIT_CTAS_PER_SM CTAs an SM. One image with few output channels has fewer
    tiles than SMs and a long chain of chunks in each."""
    passes = -(-cin // chunk)
    if dtype == "float64" or passes < 2 or not 0 < tiles < sms:
        return max(cin, 1)
    splits = min(passes, -(-_SPLIT_CTAS_PER_SM * sms // tiles))
    return chunk * -(-passes // splits)


def instantiations():
    """Name expressions of every kernel the plans can ask for, but the compiled kernel: its
    Program is generated per mask (tests/pruned/test_sparse_kernel_conv.py compiles some)."""
    names = []
    for ctype in _kernels.ARITHMETIC_CTYPES.values():
        names.append(_kernels.name_expression("sparse_kernel_conv_direct", ctype, _DIRECT_P,
                                              _DIRECT_Q))
        if ctype != "double":
            names.append(_kernels.name_expression("split_sum", ctype))
        names.append(_kernels.name_expression("sparse_kernel_conv_grad_values", ctype, _GRAD_P))
    return names


_kernels.register_instantiations("sparse_kernel_conv", instantiations)


def launch_conv(device, stream, plan, function, x, out, bias, ranges, taps, values,
                float_scratch):
    """Launch a ConvPlan (made with this device) by `function` (_Taps.function) on raw
    addresses: x and out C-contiguous NHWC, bias 0 for none, the index arrays (0 for None) and
    values of _Taps.arrays for plan.layout. float_scratch(n): the address and owner of n
    float32 on this device, usable on this stream (CuPy or torch), for the partial sums of
    split input channels. Nothing to do for an empty output."""
    if plan.grid[0] * plan.grid[1] * plan.grid[2] == 0:
        return
    # Split input channels: the kernel writes partial sums, the split sum adds them and the bias.
    partial, _owner = 0, None
    if plan.split_sum is not None:
        split_function, rows, cols, pitch, splits = plan.split_sum
        partial, _owner = float_scratch(splits * rows * pitch)
    # _CONV_ARGS: its seven pointers in order, then the plan's int fields.
    _launch.launch(device, stream, function, plan.grid, plan.block, plan.smem, _CONV_ARGS,
                   (x, out, bias, ranges, taps, values, partial, *plan.ints))
    if partial:  # _owner keeps the scratch until both launches are queued
        _launch.launch_split_sum(device, stream, split_function, partial, bias, out, rows, cols,
                                 pitch, splits)


def address(a):
    """The device address of CuPy array `a`, 0 for None."""
    return 0 if a is None else a.data.ptr


def _conv_cupy(x, kernel, transposed, out, strides, dilations, pads, input_dilation, bias,
               strategy):
    import cupy

    k_h, k_w, cin, cout = kernel.shape
    if transposed:
        cin, cout = cout, cin
    device = x.data.device_id
    plan = conv_plan(strategy, kernel.dtype, x.shape[0], x.shape[1:3], cin, out.shape[1:3], cout,
                     (k_h, k_w), strides, dilations, pads, input_dilation, kernel.nnz, device)
    ranges, taps, values = kernel._launch_arrays(transposed, plan.layout)
    function = kernel._taps.function(transposed, plan, kernel.dtype, device)
    x = x if x.flags.c_contiguous else cupy.ascontiguousarray(x)
    if bias is not None and not bias.flags.c_contiguous:
        bias = cupy.ascontiguousarray(bias)
    launch_conv(device, cupy.cuda.get_current_stream().ptr, plan, function, x.data.ptr,
                out.data.ptr, address(bias), address(ranges), address(taps), address(values),
                _launch.cupy_float_scratch)


GradValuesPlan = namedtuple("GradValuesPlan", ["function", "template", "grid", "block", "smem",
                                               "ints"])


@functools.lru_cache(maxsize=1024)
def grad_values_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                     device=None):
    """Launch of the gradient with respect to the values (see conv_plan)."""
    acc_size = 8 if dtype == "float64" else 4
    (k_h, k_w), (sh, sw), (dh, dw) = kernel_hw, strides, dilations
    p = _GRAD_P
    rows = (p - 1) * sh + (k_h - 1) * dh + 1
    pitch, cols = rows | 1, 31 * sw + (k_w - 1) * dw + 1
    channel_bytes = cols * pitch * acc_size
    co_chunk = max(1, min(cout, _GRAD_CO_CHUNK))
    while True:  # fewer output channels a pass where one input channel's tile is large
        dy_bytes = co_chunk * p * 32 * acc_size
        chunk = min(cin, max(_SMEM_LIMIT - dy_bytes, 0) // channel_bytes) if cin else 1
        if chunk or co_chunk == 1:
            break
        co_chunk //= 2
    if chunk == 0:
        raise ValueError(f"dilations {dilations} with a {k_h}x{k_w} kernel need an input tile "
                         f"larger than the GPU kernels' shared memory ({channel_bytes} bytes "
                         f"a channel)")
    grid = (-(-out_hw[1] // 32), _checks.grid_dim("out_h", -(-out_hw[0] // p)),
            _checks.grid_dim("x (batch x channel groups)", n * -(-cout // co_chunk)))
    ints = _GRAD_VALUES_ARGS.tail(
        n=n, in_h=in_hw[0], in_w=in_hw[1], cin=cin, out_h=out_hw[0], out_w=out_hw[1], cout=cout,
        str_h=sh, str_w=sw, dil_h=dh, dil_w=dw, pad_h=pads[0], pad_w=pads[1], tile_rows=rows,
        tile_cols=cols, pitch=pitch, chunk=chunk, co_chunk=co_chunk)
    template = (_kernels.ARITHMETIC_CTYPES[dtype], p)
    function = (None if device is None else
                _launch.function(device, "sparse_kernel_conv", "sparse_kernel_conv_grad_values",
                                 *template))
    return GradValuesPlan(function, template, grid, (32 * _GRAD_WARPS, 1, 1),
                          dy_bytes + chunk * channel_bytes, ints)


def launch_grad_values(device, stream, plan, x, dy, ranges, taps, grad):
    """Launch a GradValuesPlan (made with this device) on raw addresses: grad is a zeroed
    float32 (float64 for float64) array of the kernel's nnz, which the kernel adds to; ranges
    and taps those of _Taps.arrays(False, None)."""
    if plan.grid[0] * plan.grid[1] * plan.grid[2] == 0:
        return
    _launch.launch(device, stream, plan.function, plan.grid, plan.block, plan.smem,
                   _GRAD_VALUES_ARGS, (x, dy, ranges, taps, grad, *plan.ints))  # pointers first


def _grad_values_cupy(x, dy, kernel, strides, dilations, pads):
    import cupy

    k_h, k_w, cin, cout = kernel.shape
    device = x.data.device_id
    plan = grad_values_plan(kernel.dtype, x.shape[0], x.shape[1:3], cin, dy.shape[1:3], cout,
                            (k_h, k_w), strides, dilations, pads, device)
    ranges, taps, _ = kernel._launch_arrays(False, None)
    grad = cupy.zeros(kernel.nnz, _acc_dtype(kernel.dtype))
    if kernel.nnz and x.size:
        x = x if x.flags.c_contiguous else cupy.ascontiguousarray(x)
        dy = dy if dy.flags.c_contiguous else cupy.ascontiguousarray(dy)
        launch_grad_values(device, cupy.cuda.get_current_stream().ptr, plan, x.data.ptr,
                           dy.data.ptr, ranges.data.ptr, taps.data.ptr, grad.data.ptr)
    if kernel.dtype == "bfloat16":
        return float32_to_bfloat16_bits(grad).view(x.dtype)
    return grad.astype(x.dtype, copy=False)


def float32_to_bfloat16_bits(a):
    """uint16 patterns of float32 array `a` rounded to bfloat16 (to nearest, ties to even;
    NaN stays NaN)."""
    xp = _checks.array_module(a=a)
    bits = a.astype(xp.float32).view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    nan = xp.isnan(a)
    return xp.where(nan, xp.uint32(0x7FC0), rounded).astype(xp.uint16)
