"""fuse_bn_relu: an eval model's BatchNorm1d folded into the sparse convolution before it, and
the ReLU after them taken in the convolution's own call (the fused kernel's epilogue), where a
SparseSequential holds them in that order: two module calls and two passes over the features
fewer a layer, the same outputs up to rounding."""

import torch

from .conv import SparseConvolution
from .modules import SparseReLU, SparseSequential

_RELUS = (torch.nn.ReLU, SparseReLU)


def fuse_bn_relu(model):
    """Fuses, in place, the BatchNorm1d and ReLU modules that follow a sparse convolution in a
    SparseSequential into it, and returns model:

    - a BatchNorm1d (or SparseBatchNorm) right after the convolution, with running statistics,
      is folded into its weight and bias (a bias is added where it has none), computed in
      float32 (float64 for float64 weights) and stored in the weight's dtype;
    - a ReLU (or SparseReLU) right after the convolution, or after that BatchNorm, becomes the
      convolution's `sbnet_relu`;
    - the fused modules leave the sequential (the others keep their names).

    For inference: the BatchNorms fused must be in eval mode (ValueError otherwise), since
    training would update statistics that are no longer there. Modules a forward of its own
    calls (a residual block's bn1 and relu) and BatchNorms without running statistics stay as
    they are. Run it after model.half() or before: either way the fold is computed in float32.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for sequential in [m for m in model.modules() if isinstance(m, SparseSequential)]:
        _fuse_in(sequential)
    return model


def _fuse_in(sequential):
    names = list(sequential._modules)
    fused = []
    for i, name in enumerate(names):
        conv = sequential._modules[name]
        if not isinstance(conv, SparseConvolution) or conv.sbnet_relu:
            continue
        following = [(n, sequential._modules[n]) for n in names[i + 1:i + 3]]
        if following and _foldable(following[0][1], conv):
            _fold(conv, following[0][1])
            fused.append(following.pop(0)[0])
        if following and type(following[0][1]) in _RELUS:
            conv.sbnet_relu = True
            fused.append(following[0][0])
    for name in fused:
        del sequential._modules[name]


def _foldable(bn, conv):
    """Whether bn is a BatchNorm1d of conv's output channels with running statistics (raises
    for one in training mode)."""
    if not isinstance(bn, torch.nn.BatchNorm1d) or bn.num_features != conv.out_channels:
        return False
    if bn.running_mean is None or bn.running_var is None:
        return False
    if bn.training:
        raise ValueError("fuse_bn_relu folds BatchNorm's running statistics: call model.eval() "
                         "first")
    return True


@torch.no_grad()
def _fold(conv, bn):
    """conv's weight and bias with bn applied to its output: w * s and (b - mean) * s + beta,
    s = gamma / sqrt(var + eps), per output channel."""
    weight = conv.weight
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    scale = torch.rsqrt(bn.running_var.to(acc) + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.to(acc)
    shift = -bn.running_mean.to(acc) * scale
    if bn.bias is not None:
        shift = shift + bn.bias.to(acc)
    if conv.bias is not None:
        shift = shift + conv.bias.to(acc) * scale
    scale = scale.to(weight.device)
    if conv.conv1x1:  # multiplies by the weight's memory read as [Cin, Cout] (see forward)
        folded = weight.reshape(conv.in_channels, conv.out_channels).to(acc) * scale
    else:
        folded = weight.to(acc) * scale.reshape(-1, *([1] * (weight.ndim - 1)))
    weight.copy_(folded.reshape(weight.shape).to(weight.dtype))
    if conv.bias is None:
        conv.bias = torch.nn.Parameter(shift.to(weight.device, weight.dtype))
    else:
        conv.bias.copy_(shift.to(conv.bias.dtype))
