"""torch tensors as a backend of sbnet_cupy's ops (sbnet_cupy/core/backend.py): CUDA tensors
launch on torch's current stream, with memory from torch's caching allocator."""

import torch

from sbnet_cupy.core.backend import Backend

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # what inductor's generated code calls
except AttributeError:  # a build without CUDA, which never launches
    _raw_stream = None


# NumPy's names of torch's dtypes, every one of them (a lookup costs less than str(dtype)): the
# blocks family takes masks of bool and uint8, and moves data of any dtype.
_DTYPE_NAMES = {dtype: str(dtype)[6:] for dtype in vars(torch).values()
                if isinstance(dtype, torch.dtype)}


class _Torch(Backend):
    name, gpu = "torch", True

    def device(self, t):
        return t.get_device()

    def pointer(self, t):
        return 0 if t is None else t.data_ptr()

    def stream(self, device):
        return _raw_stream(device)

    def dtype_name(self, t):
        return _DTYPE_NAMES[t.dtype]

    def host(self, t):
        return t.cpu().numpy()

    def contiguous(self, t):
        return t if t.is_contiguous() else t.contiguous()

    def empty(self, shape, like, dtype=None):
        return like.new_empty(shape, dtype=dtype and getattr(torch, dtype))

    def zeros(self, shape, like, dtype=None):
        return like.new_zeros(shape, dtype=dtype and getattr(torch, dtype))

    def itemsize(self, t):
        return t.element_size()

    def padded(self, t, width):
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # one op, not three

    def float_scratch(self, device, n):
        scratch = torch.empty(n, dtype=torch.float32, device=device)
        return scratch.data_ptr(), scratch


TORCH = _Torch()
