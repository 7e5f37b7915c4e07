"""sbnet_cupy's ops on PyTorch tensors, with gradients.

The ops are torch.library ops (namespace ``sbnet``) with fake kernels and autograd, so they run
eagerly (where a call that needs no gradient skips the dispatcher: see ``_ops``), under
``torch.compile(fullgraph=True)`` and ``torch.export``, and inside CUDA graph capture (with
``capacity``: no host sync). CUDA tensors run sbnet_cupy's kernels on the tensor's device and
torch's current stream; CPU tensors run its NumPy backend. Arguments are those of sbnet_cupy.
"""

from sbnet_cupy import BlockParams, ReduceMask, calc_block_params, calc_block_params_res_block

from ._weights import frozen_weights
from .blocks.ops import reduce_mask, sparse_gather, sparse_scatter, sparse_scatter_var
from .blocks.sparse_res_block import SparseConv2d, SparseResBlockBottleneck, SparseResStage
from .capacity_graphs import CapacityGraphs, capacity_bucket
from .dilated import DilatedConv2d, batch_to_space, dilated_conv2d, space_to_batch
from .pruned.sparse_kernel_conv import SparseKernelConv2d, sparse_kernel_conv2d

__all__ = [
    "BlockParams",
    "CapacityGraphs",
    "DilatedConv2d",
    "ReduceMask",
    "SparseConv2d",
    "SparseKernelConv2d",
    "SparseResBlockBottleneck",
    "SparseResStage",
    "batch_to_space",
    "calc_block_params",
    "calc_block_params_res_block",
    "capacity_bucket",
    "dilated_conv2d",
    "frozen_weights",
    "reduce_mask",
    "space_to_batch",
    "sparse_gather",
    "sparse_kernel_conv2d",
    "sparse_scatter",
    "sparse_scatter_var",
]
