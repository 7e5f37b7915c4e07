"""fuse_bn_relu: an eval model's BatchNorm1d folded into the sparse convolution before it, and
the ReLU after them taken in the convolution's own call (the fused kernel's epilogue), where a
SparseSequential holds them in that order: two module calls and two passes over the features
fewer a layer, the same outputs up to rounding. In a residual block (a module whose own forward
calls its convolutions and BatchNorms) each BatchNorm registered right after a convolution is
folded into it too, and checked each call to be given that convolution's output. The
BatchNorms it cannot fold become a per-channel multiply-add (ChannelAffine): one kernel and a
short call, where torch's eval batch_norm launches two and checks much more a call."""

import weakref

import torch

from .conv import SparseConvolution
from .core import SparseConvTensor
from .modules import SparseBatchNorm, SparseReLU, SparseSequential

_RELUS = (torch.nn.ReLU, SparseReLU)


def fuse_bn_relu(model, blocks=True):
    """Fuses, in place, the BatchNorm1d and ReLU modules that follow a sparse convolution in a
    SparseSequential into it, and returns model:

    - a BatchNorm1d (or SparseBatchNorm) right after the convolution, with running statistics,
      is folded into its weight and bias (a bias is added where it has none), computed in
      float32 (float64 for float64 weights) and stored in the weight's dtype;
    - a ReLU (or SparseReLU) right after the convolution, or after that BatchNorm, becomes the
      convolution's `sbnet_relu`;
    - the fused modules leave the sequential (the others keep their names);
    - with `blocks`, in any other module (a residual block whose forward calls conv1, bn1,
      ...), a BatchNorm1d registered right after a convolution is folded into it: the order
      OpenPCDet's, mmdetection3d's and Pointcept's blocks register them in, which mmcv's
      fuse_conv_bn also relies on. It becomes a FoldedBatchNorm, which raises RuntimeError
      where the forward calls it on anything but that convolution's latest output;
    - every other BatchNorm1d (or SparseBatchNorm) with running statistics, wherever it is,
      becomes a ChannelAffine of the same scale and shift (in the BatchNorm's dtype), which its
      callers call as before.

    For inference: the BatchNorms fused must be in eval mode (ValueError otherwise), since
    training would update statistics that are no longer there. Modules a forward of its own
    calls (a residual block's relu) and BatchNorms without running statistics stay as they are.
    Run it after model.half() or before: either way the fold is computed in float32.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(blocks, bool):
        raise TypeError(f"blocks must be a bool, got {type(blocks).__name__}")
    for sequential in [m for m in model.modules() if isinstance(m, SparseSequential)]:
        _fuse_in(sequential)
    if blocks:
        for block in [m for m in model.modules() if not isinstance(m, SparseSequential)]:
            _fold_in_block(block)
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if type(child) in (torch.nn.BatchNorm1d, SparseBatchNorm) and _has_statistics(child):
                parent._modules[name] = ChannelAffine(*_affine(child))
    return model


class ChannelAffine(torch.nn.Module):
    """x * scale + shift per channel (dimension 1), of a tensor [N, C] or [N, C, L] or of a
    SparseConvTensor's features: an eval BatchNorm1d whose statistics are folded in
    (fuse_bn_relu)."""

    def __init__(self, scale, shift):
        super().__init__()
        self.register_buffer("scale", scale)
        self.register_buffer("shift", shift)

    def forward(self, x):
        if isinstance(x, SparseConvTensor):
            return x.replace_feature(self(x.features))
        scale, shift = self.scale, self.shift
        if scale.dtype != x.dtype:  # BatchNorm's output has its input's dtype
            scale, shift = scale.to(x.dtype), shift.to(x.dtype)
        if x.ndim != 2:
            shape = (-1,) + (1,) * (x.ndim - 2)
            scale, shift = scale.reshape(shape), shift.reshape(shape)
        return torch.addcmul(shift, x, scale)

    def extra_repr(self):
        return f"{self.scale.shape[0]}"


class FoldedBatchNorm(torch.nn.Module):
    """A BatchNorm that fuse_bn_relu folded into the convolution registered before it in a
    block: passes its input (features, or a SparseConvTensor) through, after checking that it
    is that convolution's latest output. Any other input means the block's forward does not
    normalise that output with it, so the fold would give wrong results: RuntimeError."""

    def __init__(self, conv_name, conv):
        super().__init__()
        self.conv_name = conv_name
        self._latest = None
        conv.register_forward_hook(self._record)

    def _record(self, conv, inputs, output):
        self._latest = weakref.ref(output.features)

    def forward(self, x):
        features = x.features if isinstance(x, SparseConvTensor) else x
        if self._latest is None or self._latest() is not features:
            raise RuntimeError(
                f"fuse_bn_relu folded this BatchNorm into {self.conv_name}, the convolution "
                f"registered before it, but the forward called it on another tensor; fuse "
                f"this model with fuse_bn_relu(model, blocks=False)")
        return x

    def __getstate__(self):  # the weak reference neither pickles nor belongs to a copy
        state = self.__dict__.copy()
        state["_latest"] = None
        return state

    def extra_repr(self):
        return f"into {self.conv_name}"


def _fold_in_block(block):
    """Folds each BatchNorm registered right after a convolution among block's children into
    that convolution, which leaves a FoldedBatchNorm in the BatchNorm's place."""
    children = list(block._modules.items())
    for (conv_name, conv), (name, bn) in zip(children, children[1:]):
        if isinstance(conv, SparseConvolution) and not conv.sbnet_relu and _foldable(bn, conv):
            _fold(conv, bn)
            block._modules[name] = FoldedBatchNorm(conv_name, conv)


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


def _has_statistics(bn):
    """Whether bn normalises with running statistics (raises for one in training mode)."""
    if bn.running_mean is None or bn.running_var is None:
        return False
    if bn.training:
        raise ValueError("fuse_bn_relu folds BatchNorm's running statistics: call model.eval() "
                         "first")
    return True


def _foldable(bn, conv):
    """Whether bn is a BatchNorm1d of conv's output channels with running statistics."""
    return (isinstance(bn, torch.nn.BatchNorm1d) and bn.num_features == conv.out_channels
            and _has_statistics(bn))


@torch.no_grad()
def _affine(bn, acc=None):
    """(scale, shift) of an eval BatchNorm: gamma / sqrt(var + eps) and beta - mean * scale,
    computed in `acc` (None: float64 for float64 statistics, else float32) and returned in the
    statistics' dtype where acc is None."""
    dtype = bn.running_mean.dtype
    work = acc or (torch.float64 if dtype == torch.float64 else torch.float32)
    scale = torch.rsqrt(bn.running_var.to(work) + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.to(work)
    shift = -bn.running_mean.to(work) * scale
    if bn.bias is not None:
        shift = shift + bn.bias.to(work)
    return (scale, shift) if acc else (scale.to(dtype), shift.to(dtype))


@torch.no_grad()
def _fold(conv, bn):
    """conv's weight and bias with bn applied to its output: w * s and (b - mean) * s + beta,
    s = gamma / sqrt(var + eps), per output channel."""
    weight = conv.weight
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    scale, shift = _affine(bn, acc)
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
