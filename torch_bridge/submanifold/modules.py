"""spconv's containers and feature-wise modules (spconv.pytorch.modules), ToDense and RemoveGrid.
"""

import torch

from .core import SparseConvTensor


class SparseModule(torch.nn.Module):
    """Base of the modules that take a SparseConvTensor whole (SparseSequential passes it).
    name: spconv's, kept for code that reads it."""

    def __init__(self, name=None):
        super().__init__()
        self.name = name
        self._sparse_unique_name = ""


class _OnFeatures:
    """forward(features) of the torch module this mixes into, on a SparseConvTensor's features
    (a new tensor, same sites), or forward(x) on a dense tensor."""

    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


class SparseBatchNorm(_OnFeatures, torch.nn.BatchNorm1d):
    """BatchNorm1d over a SparseConvTensor's features (or a dense tensor)."""


class SparseSyncBatchNorm(_OnFeatures, torch.nn.SyncBatchNorm):
    """SyncBatchNorm over a SparseConvTensor's features (or a dense tensor)."""


class SparseReLU(_OnFeatures, torch.nn.ReLU):
    """ReLU of a SparseConvTensor's features (or a dense tensor)."""


class SparseIdentity(_OnFeatures, torch.nn.Identity):
    """The input, as it is (a SparseConvTensor's features pass through a new tensor)."""


def is_spconv_module(module):
    """Whether SparseSequential hands `module` the SparseConvTensor whole (else its features)."""
    return isinstance(module, (SparseModule, SparseBatchNorm, SparseReLU))


class SparseSequential(SparseModule, torch.nn.Sequential):
    """spconv's SparseSequential: modules given in order, as an OrderedDict, or by keyword.
    is_spconv_module's modules (SparseModules, SparseSequential included) take the
    SparseConvTensor (or the list a ConcatTable made); other modules (BatchNorm1d, ReLU, ...)
    take its features, and the tensor keeps its sites; a tensor of no sites skips them (as
    spconv: BatchNorm cannot train on no rows)."""

    def __init__(self, *args, **kwargs):
        torch.nn.Sequential.__init__(self, *args)
        self.name, self._sparse_unique_name = None, ""
        for name, module in kwargs.items():
            if name in self._modules:
                raise ValueError(f"module name {name!r} is given twice")
            self.add_module(name, module)

    def add(self, module, name=None):
        """Appends module under `name` (default: its position)."""
        name = str(len(self._modules)) if name is None else name
        if name in self._modules:
            raise KeyError(f"module name {name!r} exists")
        self.add_module(name, module)

    def forward(self, input):
        for module in self:
            if is_spconv_module(module):
                input = module(input)
            elif isinstance(input, SparseConvTensor):
                if input.indices.shape[0]:
                    input = input.replace_feature(module(input.features))
            else:
                input = module(input)
        return input


def assign_name_for_sparse_modules(module):
    """Sets each SparseModule's _sparse_unique_name to its name in `module`."""
    for name, child in module.named_modules():
        if isinstance(child, SparseModule):
            child._sparse_unique_name = name


class ToDense(SparseModule):
    """SparseConvTensor -> dense [B, C, *spatial] (spconv's ToDense)."""

    def forward(self, x):
        return x.dense()


class RemoveGrid(SparseModule):
    """Drops the tensor's grid (spconv's RemoveGrid: grid = None); returns the tensor."""

    def forward(self, x):
        x.grid = None
        return x
