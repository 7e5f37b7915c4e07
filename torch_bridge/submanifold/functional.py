"""spconv.pytorch.functional's functions that model code calls: the sum of sparse tensors of
different sites."""

import torch

from .core import SparseConvTensor
from .rulebook import _decode, _linear


def sparse_add(*tens):
    """The sum of SparseConvTensors of one grid, batch size and channel count: features added
    where sites coincide, on the union of their sites. Where one operand already has every
    site of the union, the result keeps its indices, row order and indice_dict (so an inverse
    convolution still finds its rulebook, as in spconv); otherwise the sites are sorted by
    (batch, coordinates) and the result has no rulebooks. Differentiable in the features."""
    if not tens or not all(isinstance(t, SparseConvTensor) for t in tens):
        raise TypeError(f"sparse_add takes SparseConvTensors, got "
                        f"{[type(t).__name__ for t in tens]}")
    first = tens[0]
    for t in tens:
        t.check_rows()
        if (t.spatial_shape != first.spatial_shape or t.batch_size != first.batch_size
                or t.features.shape[1] != first.features.shape[1]):
            raise ValueError(f"sparse_add needs tensors of one grid, batch size and channel "
                             f"count, got {first!r} with {first.features.shape[1]} channels "
                             f"and {t!r} with {t.features.shape[1]}")
    keys = [_linear(t.indices[:, 0].long(), t.indices[:, 1:].long(), first.spatial_shape)
            for t in tens]
    union, rows = torch.unique(torch.cat(keys), return_inverse=True)
    largest = max(range(len(tens)), key=lambda i: tens[i].indices.shape[0])
    keep = tens[largest]
    if keep.indices.shape[0] == union.shape[0]:
        # The largest operand lists the union: put every row at its site's row there.
        offset = sum(t.indices.shape[0] for t in tens[:largest])
        position = rows.new_empty(union.shape[0])
        position[rows[offset:offset + union.shape[0]]] = torch.arange(
            union.shape[0], device=rows.device)
        rows = position[rows]
        indices, indice_dict, checked = keep.indices, keep.indice_dict, keep.indices_checked
    else:
        indices, indice_dict = _decode(union, first.spatial_shape), {}
        checked = all(t.indices_checked for t in tens)
    features = torch.cat([t.features for t in tens])
    out = features.new_zeros((union.shape[0], features.shape[1])).index_add(0, rows, features)
    return first._with(out, indices, first.spatial_shape, indice_dict, checked)


def sparse_add_hash_based(*tens):
    """sparse_add (spconv's hash-based variant: the same sum)."""
    return sparse_add(*tens)
