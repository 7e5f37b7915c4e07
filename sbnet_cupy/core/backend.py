"""The array libraries an op runs on, behind one interface, so that each op's launch code is
written once for CuPy arrays and torch tensors alike (and tf_bridge, which hands CuPy arrays
over through DLPack).

A backend answers what the launch code needs of an array library: an array's device and
address and element size, the current stream, a contiguous array, new arrays (empty or
zeroed) and float32 scratch. ``NUMPY`` is the host: ops given it run their NumPy reference
instead of launching. ``CUPY`` launches on CuPy's current stream with memory from CuPy's pool;
torch_bridge's ``TORCH`` on torch's current stream with memory from torch's caching allocator.
``backend_of(a)`` picks NUMPY or CUPY for an array; torch_bridge passes TORCH (or NUMPY, with
NumPy views of CPU tensors).
"""

import numpy

from . import checks as _checks

try:
    import cupy
except ImportError:  # NumPy alone
    cupy = None


class Backend:
    """What an op's launch code asks of an array library (see the module's docstring).
    `gpu`: whether its arrays live on a CUDA device (else ops run their NumPy reference)."""

    name = None
    gpu = False

    def device(self, a):
        """The CUDA ordinal of `a`'s device."""
        raise NotImplementedError

    def pointer(self, a):
        """The device address of `a`, 0 for None."""
        raise NotImplementedError

    def stream(self, device):
        """The current stream of `device` (a cudaStream_t address)."""
        raise NotImplementedError

    def dtype_name(self, a):
        """NumPy's name of `a`'s dtype ("float16", "bfloat16", ...), as the kernel tables key
        them."""
        return _checks.dtype_name(a)

    def host(self, a):
        """A NumPy copy of `a` (to name a bad row in an error message)."""
        raise NotImplementedError

    def contiguous(self, a):
        """`a`, or a C-contiguous copy of it."""
        raise NotImplementedError

    def empty(self, shape, like, dtype=None):
        """A new array of `shape` on `like`'s device, of `like`'s dtype or `dtype` (a dtype
        name)."""
        raise NotImplementedError

    def zeros(self, shape, like, dtype=None):
        """empty's array, zeroed (for kernels that add into their output)."""
        raise NotImplementedError

    def itemsize(self, a):
        """Bytes an element of `a`."""
        return a.itemsize

    def padded(self, a, width):
        """a [..., c] as a new array [..., width]: its c columns, then zeros."""
        out = self.empty(tuple(a.shape[:-1]) + (width,), a)
        out[..., :a.shape[-1]] = a
        out[..., a.shape[-1]:] = 0
        return out

    def float_scratch(self, device, n):
        """n float32 on `device`, usable on its current stream: (address, owner). The owner
        keeps the memory until the launches that use it are queued."""
        raise NotImplementedError

    def __repr__(self):
        return f"<backend {self.name}>"


class _Numpy(Backend):
    name = "numpy"

    def host(self, a):
        return a

    def contiguous(self, a):
        return numpy.ascontiguousarray(a)

    def empty(self, shape, like, dtype=None):
        return numpy.empty(shape, dtype=dtype or like.dtype)

    def zeros(self, shape, like, dtype=None):
        return numpy.zeros(shape, dtype=dtype or like.dtype)


class _Cupy(Backend):
    name, gpu = "cupy", True

    def device(self, a):
        return a.data.device_id

    def pointer(self, a):
        return 0 if a is None else a.data.ptr

    def stream(self, device):
        # CuPy's current stream is per thread, not per device: the ops make the array's device
        # current (checks.on_device) before they ask.
        return cupy.cuda.get_current_stream().ptr

    def host(self, a):
        return a.get()

    def contiguous(self, a):
        return a if a.flags.c_contiguous else cupy.ascontiguousarray(a)

    def empty(self, shape, like, dtype=None):
        return cupy.empty(shape, dtype=dtype or like.dtype)

    def zeros(self, shape, like, dtype=None):
        return cupy.zeros(shape, dtype=dtype or like.dtype)

    def float_scratch(self, device, n):
        scratch = cupy.empty(n, dtype=cupy.float32)
        return scratch.data.ptr, scratch


NUMPY, CUPY = _Numpy(), _Cupy()


def backend_of(a):
    """NUMPY for a NumPy array, CUPY for a CuPy array."""
    return NUMPY if isinstance(a, numpy.ndarray) else CUPY
