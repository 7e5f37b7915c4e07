"""Submanifold and strided sparse convolution (SparseConvNet; spconv's SubMConv, SparseConv and
SparseInverseConv) on lists of active sites.

A sparse tensor (SparseTensorData) is a list of N active sites: int32 coordinates [N, 1 + D]
(batch index, then D spatial coordinates, D = 1..4) and features [N, C], with the spatial shape
and the batch size. A convolution runs through a Rulebook (kernel map), built once per active
set and kernel geometry and shared by every layer that has them in common:

    neighbors[k, o]   = row of the input site that kernel tap k of output site o reads, or -1
    neighbors_t[k, i] = row of the output site that input site i feeds through tap k, or -1

with the taps k = 0..K-1 in row-major order over kernel_size (the order of the weight's kernel
axes). Per spatial axis, tap k of output coordinate o reads input coordinate

    strided:     i = o * stride - padding + k * dilation
    submanifold: i = o + (k - kernel // 2) * dilation      (stride 1, padding kernel//2 * dilation)

A submanifold convolution's output sites are its input sites; a strided one's are every o in
[0, out) (out = (in + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1) that reads at
least one active site, sorted by (batch, coordinates); an inverse convolution runs a strided
convolution's rulebook backwards (Rulebook.inverse), back to the strided convolution's input
sites.

The weight is spconv 2.x's default layout ("KRSC"): [Cout, *kernel_size, Cin], so spconv
checkpoints load unchanged. The convolution, as NumPy::

    taps = weight.reshape(Cout, K * Cin)                       # [Cout, K*Cin]
    g = x[neighbors.T]                                         # [N_out, K, Cin]
    g[neighbors.T < 0] = 0                                     # absent neighbours read zero
    y = g.reshape(N_out, K * Cin) @ taps.T + bias              # [N_out, Cout]

Its gradients are the same gather and one matrix product each (no atomics, so deterministic):
dx = rulebook_conv(dy, rulebook.inverse(), transposed_weight(weight)) and
dw = (dy.T @ g).reshape(weight.shape).

The CUDA rulebook (kernels/submanifold/submanifold.cu) keeps the coordinates in an open-addressing
hash table (linearised int64 keys, linear probing, at most `capacity` probes, so a full table
reports failure instead of hanging), and looks up both maps of a submanifold convolution in one
kernel. A strided convolution marks every candidate output site in a bitmap of the output grid,
counts the set bits per word (one host sync for the total), writes the sites in bitmap order, which
is sorted order, and writes both maps from its inputs' side: no hash table and no sort. The bitmap
with its word ranks is the table of the output sites, which the next rulebook on them reuses
(torch_bridge's modules pass it on; grids of more than 2**29 sites hash and sort instead). The
rulebook is a dense [K, N_out] map (-1 for absent neighbours) rather than per-tap pair lists:
building it needs no host sync for per-tap sizes, both convolution algorithms index it directly,
and a tile of output sites reads its neighbours of one tap contiguously. The convolution
(rulebook_conv's `algo`) either gathers [N_out, K*Cin] through the map and multiplies once with
cuBLAS ("gemm"), or gathers rows tile by tile into shared memory and multiplies them on tensor
cores with mma.sync in one kernel, skipping the taps that no site of a tile has ("fused"). NumPy
arrays run a vectorised NumPy backend (sorted keys and searchsorted): the reference, and the CPU
path.

The modules: validation (argument checks, rulebook geometry), rulebook (SparseTensorData,
Rulebook and its builders), numpy_rulebook and cuda_rulebook (the two ways of building one),
conv (the convolution and its gradients), conv_kernels and grad_kernels (the convolution's kernels
and the weight gradient's: their plans and launches, one function a launch for every backend's
arrays).
"""

from ..core import kernels as _kernels
from . import conv_kernels, grad_kernels
from .conv import (check_conv, choose_algo, conv_arrays, gather, grad_weight_arrays,
                   inverse_conv, rulebook_conv, rulebook_conv_grad_features,
                   rulebook_conv_grad_weight, sparse_conv, submanifold_conv, transposed_weight)
from .conv_kernels import (FUSED_CONFIGS, FUSED_TILES, MAX_STAGE, fused_config, fused_conv,
                           fused_sorts, fused_splits, fused_tall, fused_tall_wide, gather_rows,
                           tall_tiles, tall_wide_tiles, tap_masks)
from .cuda_rulebook import Built, HashTable, build_raw, hash_table, table_capacity
from .grad_kernels import GRAD_TILES, grad_weight, grad_weight_fits, grad_weight_takes
from .rulebook import (Rulebook, SparseTensorData, from_dense, from_mask, strided_rulebook,
                       submanifold_rulebook, to_dense)
from .validation import (ALGOS, check_algo, check_grid, check_operands, check_weight,
                         conv_output_shape, rulebook_geometry)


def instantiations():
    """Name expressions of every kernel of kernels/submanifold/submanifold.cu that the package
    launches (the compile check builds them)."""
    return conv_kernels.instantiations() + grad_kernels.instantiations()


_kernels.register_instantiations("submanifold", instantiations)

__all__ = [
    "ALGOS", "Built", "FUSED_CONFIGS", "FUSED_TILES", "GRAD_TILES", "HashTable", "MAX_STAGE",
    "Rulebook", "SparseTensorData", "build_raw", "check_algo", "check_conv", "check_grid",
    "check_operands", "check_weight", "choose_algo", "conv_arrays", "conv_output_shape",
    "from_dense", "from_mask", "fused_config", "fused_conv", "fused_sorts", "fused_splits",
    "fused_tall", "fused_tall_wide", "gather", "gather_rows", "grad_weight", "grad_weight_arrays",
    "grad_weight_fits", "grad_weight_takes", "hash_table", "instantiations", "inverse_conv",
    "rulebook_conv", "rulebook_conv_grad_features", "rulebook_conv_grad_weight",
    "rulebook_geometry", "sparse_conv", "strided_rulebook", "submanifold_conv",
    "submanifold_rulebook", "table_capacity", "tall_tiles", "tall_wide_tiles", "tap_masks",
    "to_dense", "transposed_weight",
]
