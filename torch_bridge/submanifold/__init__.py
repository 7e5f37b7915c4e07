"""A drop-in for spconv 2.x: ``import torch_bridge.submanifold as spconv`` (in place of
``import spconv.pytorch as spconv``, and of ``import spconv``) runs model code written for
spconv 2.x and loads its checkpoints. docs/porting.md lists the names and what differs.

Layouts are spconv's: indices int32 [N, 1 + D] (batch index first), features [N, C], weights
[Cout, *kernel_size, Cin] (spconv 2.x's "KRSC" layout, its state_dict keys `weight` and `bias`),
``.dense()`` channels first [B, C, *spatial]. The submodules follow spconv.pytorch's paths:
core (SparseConvTensor, ConvAlgo), conv, pool, modules, tables, identity, functional, ops,
utils, and constants (spconv.constants); rulebook holds the rulebooks (build_rulebook,
transposed_rulebook), conv_op the convolution op (rulebook_conv) and cpu_conv its CPU path;
fuse_bn_relu (fuse) fuses an eval model's BatchNorm and ReLU into its convolutions;
SparseGraphs (graphs) runs a whole network's inference as CUDA graphs.
"""

from . import (constants, conv, core, functional, graphs, identity, modules, ops, pool, tables,
               utils)
from .conv import (SparseConv1d, SparseConv2d, SparseConv3d, SparseConv4d,
                   SparseConvolution, SparseConvTranspose1d, SparseConvTranspose2d,
                   SparseConvTranspose3d, SparseConvTranspose4d, SparseInverseConv1d,
                   SparseInverseConv2d, SparseInverseConv3d, SparseInverseConv4d, SubMConv1d,
                   SubMConv2d, SubMConv3d, SubMConv4d)
from .core import ConvAlgo, SparseConvTensor
from .identity import Identity
from .modules import (RemoveGrid, SparseBatchNorm, SparseIdentity, SparseModule, SparseReLU,
                      SparseSequential, SparseSyncBatchNorm, ToDense,
                      assign_name_for_sparse_modules)
from .pool import (SparseAvgPool1d, SparseAvgPool2d, SparseAvgPool3d, SparseGlobalAvgPool,
                   SparseGlobalMaxPool, SparseMaxPool1d, SparseMaxPool2d, SparseMaxPool3d,
                   SparseMaxPool4d)
from .conv_op import rulebook_conv
from .fuse import fuse_bn_relu
from .graphs import SparseGraphs
from .rulebook import Rulebook, build_rulebook, transposed_rulebook
from .tables import AddTable, ConcatTable, JoinTable

# spconv's version, of the API this mirrors: OpenPCDet reads float(__version__[2:]) >= 2.2,
# mmdetection3d __version__ >= '2.0.0'.
__version__ = "2.3.8"
SPCONV_VERSION_NUMBERS = [2, 3, 8]

__all__ = [
    "AddTable",
    "ConcatTable",
    "ConvAlgo",
    "Identity",
    "JoinTable",
    "RemoveGrid",
    "Rulebook",
    "SparseAvgPool1d",
    "SparseAvgPool2d",
    "SparseAvgPool3d",
    "SparseBatchNorm",
    "SparseConv1d",
    "SparseConv2d",
    "SparseConv3d",
    "SparseConv4d",
    "SparseConvTensor",
    "SparseConvTranspose1d",
    "SparseConvTranspose2d",
    "SparseConvTranspose3d",
    "SparseConvTranspose4d",
    "SparseConvolution",
    "SparseGlobalAvgPool",
    "SparseGlobalMaxPool",
    "SparseGraphs",
    "SparseIdentity",
    "SparseInverseConv1d",
    "SparseInverseConv2d",
    "SparseInverseConv3d",
    "SparseInverseConv4d",
    "SparseMaxPool1d",
    "SparseMaxPool2d",
    "SparseMaxPool3d",
    "SparseMaxPool4d",
    "SparseModule",
    "SparseReLU",
    "SparseSequential",
    "SparseSyncBatchNorm",
    "SubMConv1d",
    "SubMConv2d",
    "SubMConv3d",
    "SubMConv4d",
    "ToDense",
    "assign_name_for_sparse_modules",
    "build_rulebook",
    "constants",
    "conv",
    "core",
    "functional",
    "fuse_bn_relu",
    "graphs",
    "identity",
    "modules",
    "ops",
    "pool",
    "rulebook",
    "rulebook_conv",
    "tables",
    "transposed_rulebook",
    "utils",
]
