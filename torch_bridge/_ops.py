"""The custom ops behind torch_bridge, their fake kernels and their gradients."""

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor

import sbnet_cupy
from sbnet_cupy import _checks
from sbnet_cupy.sparse_scatter import _scatter


@contextlib.contextmanager
def _on_current_stream(device):
    """Make CuPy launch on the tensor's device and on torch's current stream there, so the
    kernels are ordered with torch's work (and captured with it into CUDA graphs)."""
    if device.type != "cuda":
        yield
        return
    import cupy

    with cupy.cuda.Device(device.index):
        with cupy.cuda.Stream.from_external(torch.cuda.current_stream(device)):
            yield


def _array(t):
    """Zero-copy NumPy (CPU) or CuPy (CUDA) view of a contiguous tensor. bfloat16 travels as
    int16: neither NumPy nor CuPy has it.

    CUDA tensors are wrapped by pointer (the CuPy array keeps the tensor alive) rather than
    through DLPack: cupy.from_dlpack costs ~27 us a tensor on the H100 machine against ~2.5 us,
    four tensors an op, and the DLPack stream handshake is not needed on torch's own stream."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.device.type == "cpu":
        return t.detach().numpy()
    import cupy

    if t.dtype not in _CUPY_DTYPES:
        raise TypeError(f"{t.dtype} tensors are not supported")
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t,
                                     t.device.index)
    return cupy.ndarray(tuple(t.shape), _CUPY_DTYPES[t.dtype], cupy.cuda.MemoryPointer(memory, 0))


_CUPY_DTYPES = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
                torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16",
                torch.int32: "int32", torch.int64: "int64", torch.bool: "bool"}


def _data_dtype(t):
    return "bfloat16" if t.dtype == torch.bfloat16 else None


def _stack_shape(rows, bsize, channels, transpose):
    return (rows, channels, *bsize) if transpose else (rows, *bsize, channels)


def _block_list(bin_counts, active_block_indices):
    return (bin_counts.to(torch.int32).contiguous(),
            active_block_indices.to(torch.int32).contiguous())


# --- reduce_mask --------------------------------------------------------------------------

@torch.library.custom_op("sbnet::reduce_mask", mutates_args=())
def _reduce_mask(mask: Tensor, bcount: list[int], bsize: list[int], boffset: list[int],
                 bstride: list[int], tol: float, avgpool: bool,
                 capacity: Optional[int]) -> tuple[Tensor, Tensor]:
    mask = mask.contiguous()
    if mask.dtype == torch.bfloat16:
        mask = mask.float()
    total = mask.shape[0] * bcount[0] * bcount[1]
    rows = total if capacity is None else capacity
    indices = mask.new_empty((rows, 3), dtype=torch.int32)
    counts = mask.new_empty((1,), dtype=torch.int32)
    workspace = None
    if mask.is_cuda:  # a fresh zeroed workspace: safe on any stream and inside graph capture
        workspace = mask.new_zeros((math.ceil(total / 32) + 1,), dtype=torch.int32)
    with _on_current_stream(mask.device):
        sbnet_cupy.reduce_mask(
            _array(mask), bcount, bsize=bsize, boffset=boffset, bstride=bstride, tol=tol,
            avgpool=avgpool, capacity=rows, out=(_array(indices), _array(counts)),
            workspace=None if workspace is None else _array(workspace).view("uint32"))
    if capacity is None:
        indices = indices[:int(counts.item())].clone()
    return indices, counts


@_reduce_mask.register_fake
def _(mask, bcount, bsize, boffset, bstride, tol, avgpool, capacity):
    rows = torch.library.get_ctx().new_dynamic_size() if capacity is None else capacity
    return (mask.new_empty((rows, 3), dtype=torch.int32),
            mask.new_empty((1,), dtype=torch.int32))


def reduce_mask(mask, bcount, *, bsize, boffset=(0, 0), bstride=None, tol=0.5, avgpool=False,
                capacity=None):
    """sbnet_cupy.reduce_mask on a tensor: ReduceMask(active_block_indices, bin_counts) as int32
    tensors on the mask's device. Not differentiable. With `capacity`, no host sync."""
    bsize, boffset, bstride = _checks.block_geometry(bsize, boffset, bstride)
    bcount = _checks.int_pair("bcount", bcount, minimum=0)
    if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
    indices, counts = _reduce_mask(mask, list(bcount), list(bsize), list(boffset),
                                   list(bstride), float(tol), bool(avgpool), capacity)
    return sbnet_cupy.ReduceMask(indices, counts)


# --- sparse_gather --------------------------------------------------------------------------

@torch.library.custom_op("sbnet::sparse_gather", mutates_args=())
def _gather(x: Tensor, bin_counts: Tensor, active_block_indices: Tensor, bsize: list[int],
            boffset: list[int], bstride: list[int], transpose: bool, scale: Optional[Tensor],
            shift: Optional[Tensor], relu: bool) -> Tensor:
    x = x.contiguous()
    counts, indices = _block_list(bin_counts, active_block_indices)
    out = x.new_empty(_stack_shape(indices.shape[0], bsize, x.shape[3], transpose))
    affine = {} if scale is None else dict(scale=_array(scale.contiguous()),
                                           shift=_array(shift.contiguous()), relu=relu)
    with _on_current_stream(x.device):
        sbnet_cupy.sparse_gather(_array(x), _array(counts), _array(indices), bsize=bsize,
                                 boffset=boffset, bstride=bstride, transpose=transpose,
                                 out=_array(out), **affine)
    return out


@_gather.register_fake
def _(x, bin_counts, active_block_indices, bsize, boffset, bstride, transpose, scale, shift,
      relu):
    return x.new_empty(_stack_shape(active_block_indices.shape[0], bsize, x.shape[3],
                                    transpose))


def _gather_setup(ctx, inputs, output):
    x, bin_counts, active_block_indices, *ctx.geometry, scale, shift, ctx.relu = inputs
    if any(t is not None and t.requires_grad for t in (scale, shift)):
        raise ValueError("scale and shift of sparse_gather get no gradient: fold BatchNorm "
                         "into the gather for inference only")
    ctx.x_shape = x.shape
    ctx.save_for_backward(bin_counts, active_block_indices, scale,
                          output if ctx.relu else None)


def _gather_backward(ctx, grad):
    # Each block pixel came from one pixel of x: add the gradient back there. Overlapping
    # blocks read some pixels twice, so the adds are atomic.
    bin_counts, active_block_indices, scale, output = ctx.saved_tensors
    bsize, boffset, bstride, transpose = ctx.geometry
    if scale is not None:  # through the fused affine and ReLU (transpose is off here)
        grad = grad * scale.to(grad.dtype)
        if output is not None:
            grad = grad * (output > 0)
    dx = _scatter_op(grad.contiguous(), bin_counts, active_block_indices,
                     grad.new_zeros(ctx.x_shape), bsize, boffset, bstride, True, True, transpose)
    return dx, None, None, None, None, None, None, None, None, None


_gather.register_autograd(_gather_backward, setup_context=_gather_setup)


def sparse_gather(x, bin_counts, active_block_indices, *, bsize, boffset=(0, 0), bstride=None,
                  transpose=False, scale=None, shift=None, relu=False):
    """sbnet_cupy.sparse_gather on tensors; differentiable in x. scale, shift and relu fuse an
    inference BatchNorm (and ReLU) into the gather, as in sbnet_cupy (no gradient for them)."""
    _checks.nhwc("x", x)
    bsize, boffset, bstride = _checks.block_geometry(bsize, boffset, bstride)
    if scale is not None and shift is not None:  # the kernels compute in float (double)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        scale, shift = scale.to(acc), shift.to(acc)
    return _gather(x, bin_counts, active_block_indices, list(bsize), list(boffset),
                   list(bstride), bool(transpose), scale, shift, bool(relu))


# --- sparse_scatter -------------------------------------------------------------------------

def _scatter_into(blocks, bin_counts, active_block_indices, y, bsize, boffset, bstride, add,
                  atomic, transpose):
    """Scatter into the contiguous tensor y, in place."""
    counts, indices = _block_list(bin_counts, active_block_indices)
    with _on_current_stream(y.device):
        _scatter(_array(blocks.contiguous()), _array(counts), _array(indices), _array(y), bsize,
                 boffset, bstride, add, atomic, transpose, in_place=True,
                 data_dtype=_data_dtype(y))


@torch.library.custom_op("sbnet::sparse_scatter", mutates_args=())
def _scatter_op(blocks: Tensor, bin_counts: Tensor, active_block_indices: Tensor, ybase: Tensor,
                bsize: list[int], boffset: list[int], bstride: list[int], add: bool,
                atomic: bool, transpose: bool) -> Tensor:
    y = ybase.clone(memory_format=torch.contiguous_format)
    _scatter_into(blocks, bin_counts, active_block_indices, y, bsize, boffset, bstride, add,
                  atomic, transpose)
    return y


@_scatter_op.register_fake
def _(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride, add, atomic,
      transpose):
    return torch.empty_like(ybase, memory_format=torch.contiguous_format)


def _scatter_setup(ctx, inputs, output):
    blocks, bin_counts, active_block_indices, ybase, *ctx.geometry, ctx.add, _, ctx.transpose = (
        inputs)
    ctx.blocks_shape = blocks.shape
    ctx.save_for_backward(bin_counts, active_block_indices)


def _scatter_backward(ctx, grad):
    bin_counts, active_block_indices = ctx.saved_tensors
    bsize, boffset, bstride = ctx.geometry
    grad = grad.contiguous()
    # Each block element went to one output pixel (pixels outside the output went nowhere):
    # its gradient is the gradient there.
    d_blocks = _gather(grad, bin_counts, active_block_indices, bsize, boffset, bstride,
                       ctx.transpose, None, None, False)
    if ctx.add:
        d_ybase = grad
    else:  # ybase shows through only where no block was written: zero the written pixels
        d_ybase = _scatter_op(grad.new_zeros(ctx.blocks_shape), bin_counts,
                              active_block_indices, grad, bsize, boffset, bstride, False, False,
                              ctx.transpose)
    return d_blocks, None, None, d_ybase, None, None, None, None, None, None


_scatter_op.register_autograd(_scatter_backward, setup_context=_scatter_setup)


@torch.library.custom_op("sbnet::sparse_scatter_", mutates_args=("ybase",))
def _scatter_in_place(blocks: Tensor, bin_counts: Tensor, active_block_indices: Tensor,
                      ybase: Tensor, bsize: list[int], boffset: list[int], bstride: list[int],
                      add: bool, atomic: bool, transpose: bool) -> None:
    y = ybase if ybase.is_contiguous() else ybase.contiguous()
    _scatter_into(blocks, bin_counts, active_block_indices, y, bsize, boffset, bstride, add,
                  atomic, transpose)
    if y is not ybase:
        ybase.copy_(y)


@_scatter_in_place.register_fake
def _(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride, add, atomic,
      transpose):
    return None


def _scatter_args(blocks, ybase, bsize, boffset, bstride, add, atomic, transpose):
    _checks.nhwc("ybase", ybase)
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    if blocks.dtype != ybase.dtype:
        raise TypeError(f"blocks dtype {blocks.dtype} differs from ybase dtype {ybase.dtype}")
    _checks.atomic_for_overlap(geometry, add, atomic)
    bsize, boffset, bstride = geometry
    return list(bsize), list(boffset), list(bstride), bool(add), bool(atomic), bool(transpose)


def sparse_scatter(blocks, bin_counts, active_block_indices, ybase, *, bsize, boffset=(0, 0),
                   bstride=None, add=False, atomic=False, transpose=False):
    """sbnet_cupy.sparse_scatter on tensors: a new tensor; differentiable in blocks and ybase.

    Where blocks overlap without add, which block lands is unspecified and so is the gradient
    of the blocks there."""
    args = _scatter_args(blocks, ybase, bsize, boffset, bstride, add, atomic, transpose)
    return _scatter_op(blocks, bin_counts, active_block_indices, ybase, *args)


def sparse_scatter_var(blocks, bin_counts, active_block_indices, ybase, *, bsize,
                       boffset=(0, 0), bstride=None, add=False, atomic=False, transpose=False):
    """sbnet_cupy.sparse_scatter_var on tensors: writes into ybase and returns it. For
    inference: autograd does not track in-place custom ops, so use sparse_scatter to train."""
    args = _scatter_args(blocks, ybase, bsize, boffset, bstride, add, atomic, transpose)
    _scatter_in_place(blocks, bin_counts, active_block_indices, ybase, *args)
    return ybase
