"""The "compiled" strategy's code: a pruned weight's mask written out as a C++ Program struct
(kernels/pruned/sparse_kernel_conv.cu's sparse_kernel_conv_compiled<T, Program> runs it), one per
weight and plan layout, compiled by NVRTC on first use (core.kernels.generated_function; CuPy keeps
the binary in its disk cache). The tap's accumulator and window offset must be compile-time
indices for both to stay in registers; the values stay in memory, so training them needs no
recompilation."""

import hashlib
from collections import namedtuple

import numpy

from ..core import kernels as _kernels, launch as _launch
from .plans import compiled_smem_limit

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
        """C++ source of the Program struct (placed after kernels/pruned/sparse_kernel_conv.cu)."""
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

    def function(self, dtype, device):
        """Address of sparse_kernel_conv_compiled<T, Program> on `device` (compiled on first
        use)."""
        key = (dtype, device)
        entry = self._functions.get(key)
        if entry is None:
            address, owner = _kernels.generated_function(
                device, "sparse_kernel_conv", self.source, "sparse_kernel_conv_compiled",
                _kernels.ARITHMETIC_CTYPES[dtype], self.name)
            driver = _launch.driver
            driver.funcSetAttribute(address, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    compiled_smem_limit(_launch.device_info(device)))
            entry = self._functions[key] = (address, owner)  # the owner keeps it loaded
        return entry[0]


def build_program(co, ci, kh, kw, shape, p, q, cols, pitch, chunk, dil_h, dil_w):
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
