"""SBNet's ops (reduce_mask, sparse_gather, sparse_scatter) on torch tensors, registered with
torch.library through torch_bridge._ops."""

import torch

import sbnet_cupy
from sbnet_cupy.core import checks as _checks
from sbnet_cupy.blocks.reduce_mask import (check_reduce_mask, launch_reduce_mask,
                                           workspace_words)
from sbnet_cupy.blocks.sparse_gather import affine_dtype, check_gather, launch_gather, stack_shape
from sbnet_cupy.blocks.sparse_scatter import check_scatter, launch_scatter

from .._ops import (_block_list, _call, _checked, _contiguous, _geometry, _numpy, _register,
                    _same_device)
from ..backend import TORCH


# --- reduce_mask ---------------------------------------------------------------------------

def _reduce_mask_impl(mask, bcount, bsize, boffset, bstride, tol, avgpool, capacity):
    if mask.dtype == torch.bfloat16:
        mask = mask.float()
    mask = _contiguous(mask)
    n, height, width = mask.shape[:3]
    total = n * bcount[0] * bcount[1]
    rows = total if capacity is None else capacity
    indices = mask.new_empty((rows, 3), dtype=torch.int32)
    counts = mask.new_empty((1,), dtype=torch.int32)
    geometry = _geometry(bsize, boffset, bstride)
    if not mask.is_cuda:
        sbnet_cupy.reduce_mask(_numpy(mask), bcount, bsize=geometry.bsize,
                               boffset=geometry.boffset, bstride=geometry.bstride, tol=tol,
                               avgpool=avgpool, capacity=rows,
                               out=(_numpy(indices), _numpy(counts)))
    elif total == 0:
        counts.zero_()
        indices.fill_(-1)
    else:
        # Under capture, a workspace of the graph's own, zeroed by a node of the graph at every
        # replay; else the one shared by the launches on this stream.
        workspace = (torch.zeros(workspace_words(total), dtype=torch.int32, device=mask.device)
                     if torch.cuda.is_current_stream_capturing() else None)
        launch_reduce_mask(TORCH, mask, bcount, geometry, tol, avgpool, indices, counts,
                           0 if capacity is None else rows, workspace)
    if capacity is None:
        indices = indices[:int(counts.item())].clone()
    return indices, counts


def _reduce_mask_fake(mask, bcount, bsize, boffset, bstride, tol, avgpool, capacity):
    rows = torch.library.get_ctx().new_dynamic_size() if capacity is None else capacity
    return (mask.new_empty((rows, 3), dtype=torch.int32),
            mask.new_empty((1,), dtype=torch.int32))


_reduce_mask_op, _ = _register(
    "reduce_mask(Tensor mask, int[] bcount, int[] bsize, int[] boffset, int[] bstride, "
    "float tol, bool avgpool, SymInt? capacity) -> (Tensor, Tensor)",
    _reduce_mask_impl, _reduce_mask_fake)


_REDUCE_MASK_CHECKS = {}


def reduce_mask(mask, bcount, *, bsize, boffset=(0, 0), bstride=None, tol=0.5, avgpool=False,
                capacity=None):
    """sbnet_cupy.reduce_mask on a tensor: ReduceMask(active_block_indices, bin_counts) as int32
    tensors on the mask's device. Not differentiable. With `capacity`, no host sync."""
    symbolic = isinstance(capacity, torch.SymInt)  # a capacity torch.compile made dynamic
    bcount, geometry, checked = _checked(
        _REDUCE_MASK_CHECKS, check_reduce_mask,
        (mask, bcount, bsize, boffset, bstride, tol, None if symbolic else capacity))
    args = (mask, bcount, *geometry, float(tol), bool(avgpool),
            capacity if symbolic else checked)
    indices, counts = _call(_reduce_mask_op, None, _reduce_mask_impl, args, (mask,))
    return sbnet_cupy.ReduceMask(indices, counts)


# --- sparse_gather --------------------------------------------------------------------------

def _gather_impl(x, bin_counts, active_block_indices, bsize, boffset, bstride, transpose, scale,
                 shift, relu):
    x = _contiguous(x)
    counts, indices = _block_list(bin_counts, active_block_indices)
    out = x.new_empty(stack_shape(indices.shape[0], bsize, x.shape[3], transpose))
    geometry = _geometry(bsize, boffset, bstride)
    if scale is not None:
        scale, shift = _contiguous(scale), _contiguous(shift)
    if not x.is_cuda:
        affine = {} if scale is None else dict(scale=_numpy(scale), shift=_numpy(shift),
                                               relu=relu)
        sbnet_cupy.sparse_gather(_numpy(x), _numpy(counts), _numpy(indices),
                                 bsize=geometry.bsize, boffset=geometry.boffset,
                                 bstride=geometry.bstride, transpose=transpose, out=_numpy(out),
                                 **affine)
        return out
    launch_gather(TORCH, x, out, indices, counts, scale, shift, geometry, transpose, relu)
    return out


def _gather_fake(x, bin_counts, active_block_indices, bsize, boffset, bstride, transpose, scale,
                 shift, relu):
    return x.new_empty(stack_shape(active_block_indices.shape[0], bsize, x.shape[3], transpose))


def _gather_setup(ctx, inputs, output):
    x, bin_counts, active_block_indices, *ctx.geometry, scale, shift, relu = inputs
    ctx.x_shape = x.shape
    ctx.save_for_backward(bin_counts, active_block_indices, scale, output if relu else None)


def _gather_backward(ctx, grad):
    # Each block pixel came from one pixel of x: add the gradient back there. Overlapping
    # blocks read some pixels twice, so the adds are atomic.
    bin_counts, active_block_indices, scale, output = ctx.saved_tensors
    bsize, boffset, bstride, transpose = ctx.geometry
    if scale is not None:  # through the fused affine and ReLU (transpose is off here)
        grad = grad * scale.to(grad.dtype)
        if output is not None:
            grad = grad * (output > 0)
    dx = _scatter(_contiguous(grad), bin_counts, active_block_indices,
                  grad.new_zeros(ctx.x_shape), bsize, boffset, bstride, True, True, transpose)
    return dx, None, None, None, None, None, None, None, None, None


_gather_op, _gather_autograd = _register(
    "sparse_gather(Tensor x, Tensor bin_counts, Tensor active_block_indices, int[] bsize, "
    "int[] boffset, int[] bstride, bool transpose, Tensor? scale, Tensor? shift, bool relu) "
    "-> Tensor",
    _gather_impl, _gather_fake, _gather_setup, _gather_backward)


def _gather(x, bin_counts, active_block_indices, bsize, boffset, bstride, transpose, scale=None,
            shift=None, relu=False):
    args = (x, bin_counts, active_block_indices, bsize, boffset, bstride, transpose, scale,
            shift, relu)
    tensors = (x, bin_counts, active_block_indices) if scale is None else (
        x, bin_counts, active_block_indices, scale, shift)
    return _call(_gather_op, _gather_autograd, _gather_impl, args, tensors, (x,))


_GATHER_CHECKS = {}


def sparse_gather(x, bin_counts, active_block_indices, *, bsize, boffset=(0, 0), bstride=None,
                  transpose=False, scale=None, shift=None, relu=False):
    """sbnet_cupy.sparse_gather on tensors; differentiable in x. scale, shift and relu fuse an
    inference BatchNorm (and ReLU) into the gather, as in sbnet_cupy (no gradient for them)."""
    geometry = _checked(_GATHER_CHECKS, check_gather,
                        (x, bin_counts, active_block_indices, bsize, boffset, bstride, transpose,
                         scale, shift, relu))
    _same_device(x, bin_counts, active_block_indices, scale, shift, x=x, bin_counts=bin_counts,
                 active_block_indices=active_block_indices, scale=scale, shift=shift)
    if scale is not None:
        if scale.requires_grad or shift.requires_grad:
            raise ValueError("scale and shift of sparse_gather get no gradient: fold BatchNorm "
                             "into the gather for inference only")
        acc = getattr(torch, affine_dtype(_checks.dtype_name(x)))  # the kernels' arithmetic
        scale, shift = scale.to(acc), shift.to(acc)
    return _gather(x, bin_counts, active_block_indices, *geometry, bool(transpose), scale,
                   shift, bool(relu))


# --- sparse_scatter -------------------------------------------------------------------------

def _scatter_into(blocks, bin_counts, active_block_indices, y, bsize, boffset, bstride, add,
                  atomic, transpose):
    """Scatter into the contiguous tensor y, in place."""
    counts, indices = _block_list(bin_counts, active_block_indices)
    blocks = _contiguous(blocks)
    geometry = _geometry(bsize, boffset, bstride)
    if not y.is_cuda:
        sbnet_cupy.sparse_scatter_var(_numpy(blocks), _numpy(counts), _numpy(indices), _numpy(y),
                                      bsize=geometry.bsize, boffset=geometry.boffset,
                                      bstride=geometry.bstride, add=add, atomic=atomic,
                                      transpose=transpose)
        return
    lists = [indices]
    if add and atomic and torch.are_deterministic_algorithms_enabled():
        lists, atomic = _apart(indices, geometry), False
    for rows in lists:
        launch_scatter(TORCH, blocks, y, rows, counts, geometry, add, atomic, transpose)


def _apart(indices, geometry):
    """The block list as lists, in a fixed order, whose blocks do not overlap one another (a
    block of another list has batch index -1 there: it writes nothing). Adding each list without
    atomics sums every pixel in the same order on every run (torch's deterministic mode)."""
    (bh, bw), (sh, sw) = geometry.bsize, geometry.bstride
    per_h, per_w = -(-bh // sh), -(-bw // sw)  # blocks i and i + per apart do not overlap
    if per_h * per_w == 1:
        return [indices]
    row_class, col_class = indices[:, 1] % per_h, indices[:, 2] % per_w
    return [torch.where(((row_class == a) & (col_class == b))[:, None], indices, -1)
            for a in range(per_h) for b in range(per_w)]


def _scatter_impl(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride, add,
                  atomic, transpose):
    y = ybase.clone(memory_format=torch.contiguous_format)
    _scatter_into(blocks, bin_counts, active_block_indices, y, bsize, boffset, bstride, add,
                  atomic, transpose)
    return y


def _scatter_fake(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride, add,
                  atomic, transpose):
    return torch.empty_like(ybase, memory_format=torch.contiguous_format)


def _scatter_setup(ctx, inputs, output):
    blocks, bin_counts, active_block_indices, ybase, *ctx.geometry, ctx.add, _, ctx.transpose = (
        inputs)
    ctx.blocks_shape = blocks.shape
    ctx.save_for_backward(bin_counts, active_block_indices)


def _scatter_backward(ctx, grad):
    bin_counts, active_block_indices = ctx.saved_tensors
    bsize, boffset, bstride = ctx.geometry
    grad = _contiguous(grad)
    # Each block element went to one output pixel (pixels outside the output went nowhere):
    # its gradient is the gradient there.
    d_blocks = _gather(grad, bin_counts, active_block_indices, bsize, boffset, bstride,
                       ctx.transpose)
    if ctx.add:
        d_ybase = grad
    else:  # ybase shows through only where no block was written: zero the written pixels
        d_ybase = _scatter(grad.new_zeros(ctx.blocks_shape), bin_counts, active_block_indices,
                           grad, bsize, boffset, bstride, False, False, ctx.transpose)
    return d_blocks, None, None, d_ybase, None, None, None, None, None, None


_scatter_op, _scatter_autograd = _register(
    "sparse_scatter(Tensor blocks, Tensor bin_counts, Tensor active_block_indices, "
    "Tensor ybase, int[] bsize, int[] boffset, int[] bstride, bool add, bool atomic, "
    "bool transpose) -> Tensor",
    _scatter_impl, _scatter_fake, _scatter_setup, _scatter_backward)


def _scatter(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride, add,
             atomic, transpose):
    args = (blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride, add,
            atomic, transpose)
    return _call(_scatter_op, _scatter_autograd, _scatter_impl, args,
                 (blocks, bin_counts, active_block_indices, ybase), (blocks, ybase))


def _scatter_in_place_impl(blocks, bin_counts, active_block_indices, ybase, bsize, boffset,
                           bstride, add, atomic, transpose):
    y = _contiguous(ybase)
    _scatter_into(blocks, bin_counts, active_block_indices, y, bsize, boffset, bstride, add,
                  atomic, transpose)
    if y is not ybase:
        ybase.copy_(y)


def _scatter_in_place_fake(blocks, bin_counts, active_block_indices, ybase, bsize, boffset,
                           bstride, add, atomic, transpose):
    return None


_scatter_in_place_op, _ = _register(
    "sparse_scatter_(Tensor blocks, Tensor bin_counts, Tensor active_block_indices, "
    "Tensor(a!) ybase, int[] bsize, int[] boffset, int[] bstride, bool add, bool atomic, "
    "bool transpose) -> ()",
    _scatter_in_place_impl, _scatter_in_place_fake)


_SCATTER_CHECKS = {}


def _checked_scatter(blocks, bin_counts, active_block_indices, ybase, bsize, boffset, bstride,
                     add, atomic, transpose):
    geometry = _checked(_SCATTER_CHECKS, check_scatter,
                        (blocks, bin_counts, active_block_indices, ybase, bsize, boffset,
                         bstride, add, atomic, transpose, ybase.is_cuda))
    _same_device(ybase, blocks, bin_counts, active_block_indices, blocks=blocks,
                 bin_counts=bin_counts, active_block_indices=active_block_indices, ybase=ybase)
    return (blocks, bin_counts, active_block_indices, ybase, *geometry, bool(add), bool(atomic),
            bool(transpose))


def sparse_scatter(blocks, bin_counts, active_block_indices, ybase, *, bsize, boffset=(0, 0),
                   bstride=None, add=False, atomic=False, transpose=False):
    """sbnet_cupy.sparse_scatter on tensors: a new tensor; differentiable in blocks and ybase.

    Where blocks overlap without add, which block lands is unspecified and so is the gradient
    of the blocks there."""
    return _scatter(*_checked_scatter(blocks, bin_counts, active_block_indices, ybase, bsize,
                                      boffset, bstride, add, atomic, transpose))


def sparse_scatter_var(blocks, bin_counts, active_block_indices, ybase, *, bsize,
                       boffset=(0, 0), bstride=None, add=False, atomic=False, transpose=False):
    """sbnet_cupy.sparse_scatter_var on tensors: writes into ybase and returns it. For
    inference: autograd does not record it, so use sparse_scatter to train."""
    args = _checked_scatter(blocks, bin_counts, active_block_indices, ybase, bsize, boffset,
                            bstride, add, atomic, transpose)
    if torch.is_grad_enabled() and (blocks.requires_grad or ybase.requires_grad):
        raise ValueError("sparse_scatter_var is for inference (autograd does not record it): "
                         "use sparse_scatter when blocks or ybase require grad")
    _call(_scatter_in_place_op, None, _scatter_in_place_impl, args,
          (blocks, bin_counts, active_block_indices, ybase))
    return ybase
