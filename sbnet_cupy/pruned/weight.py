"""A pruned convolution weight converted once, on its device: SparseKernel (its values in
canonical order) over Taps (its mask: the tap lists, the "direct" kernels' index arrays and the
"compiled" kernels' programs, built on first use and kept)."""

import math

import numpy

from ..core import checks as _checks
from .program import build_program

_DTYPES = ("float16", "bfloat16", "float32", "float64")
_MAX_KERNEL_SIDE = 255  # the kernels pack kh and kw in 8 bits and the input channel in 15
_MAX_CIN = 32767


class Taps:
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
            program = self._programs[layout] = build_program(*host, self.shape, *layout)
        return program

    def compiled_function(self, transposed, layout, dtype, device):
        """Address on `device` of the "compiled" kernel of this weight, or of the transposed
        convolution's, for a plan's layout (compiled on first use)."""
        taps = self.transposed()[0] if transposed else self
        return taps.program(layout).function(dtype, device)

    def transposed(self):
        """(Taps of the transposed convolution's weight, order): w_t[kh, kw, co, ci] =
        w[KH-1-kh, KW-1-kw, ci, co]; its canonical tap t is the canonical tap order[t] here."""
        if self._transposed is None:
            xp = self.xp
            k_h, k_w, cin, cout = self.shape
            with _checks.on_device(self.co):
                kh, kw = k_h - 1 - self.kh, k_w - 1 - self.kw
                key = ((self.ci.astype(xp.int64) * cout + self.co) * k_h + kh) * k_w + kw
                order = xp.argsort(key, kind="stable")
                taps = Taps(xp, (k_h, k_w, cout, cin), self.ci[order], self.co[order],
                             kh[order], kw[order])
            self._transposed = (taps, order)
        return self._transposed


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
            taps = Taps(xp, tuple(int(s) for s in w.shape), co, ci, kh, kw)
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

    def _launch_values(self, transposed, layout, order):
        """The values in the order of a launch's taps, `order` of _taps.arrays(transposed,
        layout) (kept: the values of a SparseKernel do not change)."""
        key = (transposed, layout)
        values = self._ordered.get(key)
        if values is None:
            values = self._ordered[key] = self.values if order is None else self.values[order]
        return values


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


def check_kernel(xp, name, x, kernel):
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
