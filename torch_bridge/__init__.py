"""sbnet_cupy's ops on PyTorch tensors, with gradients.

The ops are torch.library ops (namespace ``sbnet``) with fake kernels and autograd, so they run
eagerly (where a call that needs no gradient skips the dispatcher: see ``_ops``), under
``torch.compile(fullgraph=True)`` and ``torch.export``, and inside CUDA graph capture (with
``capacity``: no host sync). CUDA tensors run sbnet_cupy's kernels on the tensor's device and
torch's current stream; CPU tensors run its NumPy backend. Arguments are those of sbnet_cupy.
"""

from sbnet_cupy import BlockParams, ReduceMask, calc_block_params, calc_block_params_res_block

from ._ops import reduce_mask, sparse_gather, sparse_scatter, sparse_scatter_var
from .capacity_graphs import CapacityGraphs, capacity_bucket
from .sparse_res_block import SparseConv2d, SparseResBlockBottleneck, SparseResStage

__all__ = [
    "BlockParams",
    "CapacityGraphs",
    "ReduceMask",
    "SparseConv2d",
    "SparseResBlockBottleneck",
    "SparseResStage",
    "calc_block_params",
    "calc_block_params_res_block",
    "capacity_bucket",
    "reduce_mask",
    "sparse_gather",
    "sparse_scatter",
    "sparse_scatter_var",
]
