"""spconv's tables (spconv.pytorch.tables): modules over a list of SparseConvTensors, as a
ConcatTable makes."""

import torch

from .core import SparseConvTensor
from .functional import sparse_add
from .modules import SparseModule


def _aligned(name, tensors):
    """Checks that `tensors` (two or more SparseConvTensors) share grid, batch and row count;
    returns the first."""
    if len(tensors) < 2 or not all(isinstance(t, SparseConvTensor) for t in tensors):
        raise TypeError(f"{name} takes a list of two or more SparseConvTensors, got "
                        f"{[type(t).__name__ for t in tensors]}")
    first = tensors[0]
    for t in tensors[1:]:
        if (t.spatial_shape != first.spatial_shape or t.batch_size != first.batch_size
                or t.indices.shape[0] != first.indices.shape[0]):
            raise ValueError(f"{name} needs tensors of the same sites (in the same order), got "
                             f"{first!r} and {t!r}")
    return first


class JoinTable(SparseModule):
    """The tensors' features side by side ([N, sum of C]) on the first one's sites: the
    tensors must list the same sites in the same order (a ConcatTable's branches of
    submanifold layers do)."""

    def forward(self, input):
        first = _aligned("JoinTable", input)
        return first.replace_feature(torch.cat([t.features for t in input], 1))

    def input_spatial_size(self, out_size):
        return out_size


class AddTable(SparseModule):
    """The tensors' features added, on the first one's sites (same sites, same order, same
    channels)."""

    def forward(self, input):
        first = _aligned("AddTable", input)
        features = input[0].features
        for t in input[1:]:
            if t.features.shape != features.shape:
                raise ValueError(f"AddTable needs features of one shape, got "
                                 f"{tuple(features.shape)} and {tuple(t.features.shape)}")
            features = features + t.features
        return first.replace_feature(features)

    def input_spatial_size(self, out_size):
        return out_size


class AddTableMisaligned(SparseModule):
    """The sum of tensors of different sites (functional.sparse_add)."""

    def forward(self, input):
        return sparse_add(*input)

    def input_spatial_size(self, out_size):
        return out_size


class ConcatTable(SparseModule):
    """Every branch applied to the input: a list of their outputs."""

    def forward(self, input):
        return [module(input) for module in self._modules.values()]

    def add(self, module):
        self.add_module(str(len(self._modules)), module)
        return self

    def input_spatial_size(self, out_size):
        return self._modules["0"].input_spatial_size(out_size)
