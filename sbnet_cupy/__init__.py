"""Block-sparse convolution ops (SBNet) as run-time compiled CuPy kernels, with a NumPy backend.

The backend follows the arrays: CuPy arrays run the CUDA kernels in kernels/, NumPy arrays
run a vectorised NumPy implementation (the reference, and the path on machines with no GPU).
"""

from .blocks.block_params import BlockParams, calc_block_params, calc_block_params_res_block
from .point_to_voxel import point_to_voxel
from .blocks.reduce_mask import ReduceMask, reduce_mask
from .dilated.space_to_batch import atrous_conv2d, batch_to_space, space_to_batch
from .blocks.sparse_conv import (conv2d_same, conv2d_valid, fold_batchnorm,
                                 random_bottleneck_weights, res_block_bottleneck, sparse_conv2d,
                                 sparse_res_block_bottleneck)
from .blocks.sparse_gather import sparse_gather
from .pruned import (SparseKernel, sparse_kernel_conv2d, sparse_kernel_conv2d_grad_input,
                     sparse_kernel_conv2d_grad_values)
from .blocks.sparse_scatter import sparse_scatter, sparse_scatter_var
from . import submanifold
from .submanifold import (Rulebook, SparseTensorData, rulebook_conv, strided_rulebook,
                          submanifold_conv, submanifold_rulebook)

__all__ = [
    "BlockParams",
    "ReduceMask",
    "Rulebook",
    "SparseKernel",
    "SparseTensorData",
    "atrous_conv2d",
    "batch_to_space",
    "calc_block_params",
    "calc_block_params_res_block",
    "conv2d_same",
    "conv2d_valid",
    "fold_batchnorm",
    "point_to_voxel",
    "random_bottleneck_weights",
    "reduce_mask",
    "res_block_bottleneck",
    "rulebook_conv",
    "space_to_batch",
    "sparse_conv2d",
    "sparse_gather",
    "sparse_kernel_conv2d",
    "sparse_kernel_conv2d_grad_input",
    "sparse_kernel_conv2d_grad_values",
    "sparse_res_block_bottleneck",
    "sparse_scatter",
    "sparse_scatter_var",
    "strided_rulebook",
    "submanifold",
    "submanifold_conv",
    "submanifold_rulebook",
]

__version__ = "0.1.0"
