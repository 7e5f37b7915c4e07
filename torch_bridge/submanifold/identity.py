"""spconv's Identity (spconv.pytorch.identity)."""

import torch


class Identity(torch.nn.Module):
    """Returns its input (a SparseConvTensor, a list of them or a tensor) unchanged."""

    def forward(self, input):
        return input

    def input_spatial_size(self, out_size):
        return out_size
