"""spconv's convolution modules (spconv.pytorch.conv): SparseConvolution, the base class that
real code walks with isinstance (OpenPCDet's find_all_spconv_keys), and SubMConv1d-4d,
SparseConv1d-4d, SparseConvTranspose1d-4d and SparseInverseConv1d-4d with spconv 2.x's
signatures.

Parameters are spconv 2.x's: weight [Cout, *kernel_size, Cin] (its "KRSC" layout) and bias
[Cout] or None; with record_voxel_count, a strided or transposed layer also keeps spconv's
buffer max_num_voxels_during_training. Checkpoints of spconv 2.x load with strict=True and give
its outputs: a 1x1 convolution that keeps the sites (kernel volume 1; submanifold, or stride 1
and padding 0) reads its weight's memory as [Cin, Cout], as spconv's does."""

import math

import torch

from sbnet_cupy.submanifold.validation import ints

from .conv_op import rulebook_conv
from .core import ConvAlgo, SparseConvTensor
from .modules import SparseModule
from .rulebook import build_rulebook, transposed_rulebook

_MAX_VOXELS = "max_num_voxels_during_training"  # spconv's buffer name


def _ints(name, value, ndim, minimum):
    return list(ints(name, value, ndim, minimum))


def _check_algo(algo):
    if algo is not None and not isinstance(algo, ConvAlgo):
        raise TypeError(f"algo must be None or a ConvAlgo, got {algo!r}")


class SparseConvolution(SparseModule):
    """A sparse convolution of ndim spatial axes: submanifold (subm=True: output sites are the
    input sites), strided (the default), transposed (transposed=True) or inverse (inverse=True,
    with the indice_key of the strided or transposed convolution to undo).

    A layer with an indice_key stores its rulebook in the output's indice_dict; later layers
    with the same key reuse it (submanifold, strided and transposed layers of the same
    geometry on the same sites) or run it backwards (inverse layers). algo (a ConvAlgo),
    fp32_accum, name and large_kernel_fast_algo are kept for spconv's signature and unused (set
    sbnet_algo to choose rulebook_conv's algorithm; products accumulate in float32). groups
    must be 1 and act_type None, as spconv's CPU build requires. sbnet_relu (set by
    fuse_bn_relu): max(0, .) of the convolution's output in its call, before add_input."""

    def __init__(self, ndim, in_channels, out_channels, kernel_size=3, stride=1, padding=0,
                 dilation=1, groups=1, bias=True, subm=False, output_padding=0,
                 transposed=False, inverse=False, indice_key=None, algo=None, fp32_accum=None,
                 record_voxel_count=False, act_type=None, act_alpha=0, act_beta=0,
                 large_kernel_fast_algo=False, name=None, device=None, dtype=None):
        super().__init__(name=name)
        if groups != 1:
            raise ValueError(f"groups must be 1, got {groups}")
        if act_type not in (None, 0) or act_alpha or act_beta:
            raise NotImplementedError("fused activations are not provided: add the activation "
                                      "after the layer")
        if sum((subm, transposed, inverse)) > 1:
            raise ValueError(f"at most one of subm, transposed and inverse, got subm={subm}, "
                             f"transposed={transposed}, inverse={inverse}")
        if inverse and indice_key is None:
            raise ValueError("an inverse convolution needs the indice_key of the strided or "
                             "transposed convolution it undoes")
        _check_algo(algo)
        self.ndim, self.in_channels, self.out_channels = ndim, in_channels, out_channels
        self.kernel_size = _ints("kernel_size", kernel_size, ndim, 1)
        self.stride = _ints("stride", stride, ndim, 1)
        self.padding = _ints("padding", padding, ndim, 0)
        self.dilation = _ints("dilation", dilation, ndim, 1)
        self.output_padding = _ints("output_padding", output_padding, ndim, 0)
        self.groups, self.subm, self.inverse, self.transposed = groups, subm, inverse, transposed
        self.indice_key, self.algo, self.fp32_accum = indice_key, algo, fp32_accum
        self.large_kernel_fast_algo = large_kernel_fast_algo
        # A 1x1 convolution that keeps the sites is one matrix product (spconv's conv1x1).
        self.conv1x1 = math.prod(self.kernel_size) == 1 and not inverse and (
            subm or (self.stride == [1] * ndim and self.padding == [0] * ndim))
        self.act_type, self.act_alpha, self.act_beta = None, act_alpha, act_beta
        self.sbnet_algo = None  # rulebook_conv's algo (None: its rule)
        self.sbnet_relu = False
        factory = dict(device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(
            torch.empty(out_channels, *self.kernel_size, in_channels, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_channels, **factory))
        else:
            self.register_parameter("bias", None)
        self.record_voxel_count = record_voxel_count and not (subm or inverse)
        if self.record_voxel_count:
            self.register_buffer(_MAX_VOXELS, torch.zeros(1, dtype=torch.int32, device=device))
            self._register_load_state_dict_pre_hook(self._zero_missing_count)
        self.reset_parameters()

    def _zero_missing_count(self, state_dict, prefix, *args):
        """A checkpoint saved without record_voxel_count loads with a zero count (spconv's)."""
        state_dict.setdefault(prefix + _MAX_VOXELS, torch.zeros(1, dtype=torch.int32))

    def get_max_num_voxels(self):
        """The most output sites a forward has made (record_voxel_count), else None."""
        return getattr(self, _MAX_VOXELS) if self.record_voxel_count else None

    def is_inverseable(self):
        return self.indice_key is not None and not self.subm

    def reset_parameters(self):
        """spconv's initialisation: weight kaiming-uniform (a = sqrt(5)) and bias uniform in
        +-1/sqrt(fan_in), fan_in = Cin x kernel volume (nn.Conv's default)."""
        fan_in = self.in_channels * math.prod(self.kernel_size)
        bound = 1 / math.sqrt(fan_in)  # the kaiming bound for a = sqrt(5)
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def _rulebook(self, x):
        """This layer's rulebook on x's sites: cached in x.indice_dict by indice_key, or built
        (and then cached in the output's indice_dict)."""
        cached = x.find_indice_pair(self.indice_key)
        if self.inverse:
            if cached is None or cached.subm or cached.inverted:
                raise ValueError(f"indice_key {self.indice_key!r} must name the rulebook of a "
                                 f"strided or transposed convolution that made this tensor's "
                                 f"sites")
            if (cached.kernel_size != self.kernel_size
                    or cached.out_indices.shape[0] != x.indices.shape[0]):
                raise ValueError(f"indice_key {self.indice_key!r}: the strided convolution had "
                                 f"kernel_size {cached.kernel_size} and "
                                 f"{cached.out_indices.shape[0]} output sites; this layer has "
                                 f"{self.kernel_size} and {x.indices.shape[0]}")
            return cached.inverse(), False
        if (cached is not None and cached.subm == self.subm and not cached.inverted
                and cached.transposed == self.transposed):
            same = (cached.kernel_size == self.kernel_size and cached.dilation == self.dilation
                    and (self.subm or (cached.stride, cached.padding)
                         == (self.stride, self.padding)))
            if same and cached.in_indices.shape[0] == x.indices.shape[0] and (
                    cached.in_shape == x.spatial_shape):
                return cached, False
            if self.subm:
                raise ValueError(f"indice_key {self.indice_key!r} names a rulebook of another "
                                 f"geometry or another set of sites: {cached!r}")
        if self.transposed:
            rulebook = transposed_rulebook(x.indices, x.spatial_shape, x.batch_size,
                                           self.kernel_size, self.stride, self.padding,
                                           self.dilation, self.output_padding,
                                           check=not x.indices_checked)
        else:
            rulebook = build_rulebook(x.indices, x.spatial_shape, x.batch_size,
                                      self.kernel_size, self.stride, self.padding,
                                      self.dilation, self.subm, check=not x.indices_checked,
                                      reuse=x.indice_dict.values())
        return rulebook, self.indice_key is not None

    def forward(self, input, add_input=None):
        """The convolution of a SparseConvTensor; add_input (a SparseConvTensor on the output's
        sites, in its row order) is added to the result, as spconv's."""
        if not isinstance(input, SparseConvTensor):
            raise TypeError(f"input must be a SparseConvTensor, got {type(input).__name__}")
        input.check_rows()
        if input.features.shape[1] != self.in_channels:
            raise ValueError(f"input has {input.features.shape[1]} channels, this layer takes "
                             f"{self.in_channels}")
        indice_dict = dict(input.indice_dict)
        if self.conv1x1:
            # spconv multiplies by the weight's memory read as [Cin, Cout] here (not the
            # [Cout, Cin] its shape says): do the same, so that its checkpoints give its outputs.
            taps = self.weight.reshape(self.in_channels, self.out_channels)
            y = input.features @ taps if self.bias is None else torch.addmm(
                self.bias, input.features, taps)
            y = torch.relu(y) if self.sbnet_relu else y
            out = input._with(y, input.indices, input.spatial_shape, indice_dict,
                              input.indices_checked)
        else:
            rulebook, store = self._rulebook(input)
            if store:
                indice_dict[self.indice_key] = rulebook
            y = rulebook_conv(input.features, rulebook, self.weight, self.bias,
                              algo=self.sbnet_algo, relu=self.sbnet_relu)
            out = input._with(y, rulebook.out_indices, rulebook.out_shape, indice_dict, True)
        if self.record_voxel_count:
            getattr(self, _MAX_VOXELS).clamp_(min=out.indices.shape[0])
        if add_input is not None:
            out = out + add_input
        return out

    def extra_repr(self):
        kind = ("subm" if self.subm else "inverse" if self.inverse else
                "transposed" if self.transposed else "strided")
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"{kind}, indice_key={self.indice_key!r}, bias={self.bias is not None}"
                + (", relu" if self.sbnet_relu else ""))


# spconv's classes, one a dimension and kind, each over its kind's base (which has spconv's
# signature of that kind).

class _StridedNd(SparseConvolution):
    """spconv's signature of its strided and transposed convolutions of _NDIM axes."""

    _NDIM, _TRANSPOSED = None, False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, indice_key=None, algo=None, fp32_accum=None,
                 record_voxel_count=False, large_kernel_fast_algo=False, name=None):
        super().__init__(self._NDIM, in_channels, out_channels, kernel_size, stride, padding,
                         dilation, groups, bias, transposed=self._TRANSPOSED,
                         indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         record_voxel_count=record_voxel_count,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class _InverseNd(SparseConvolution):
    """spconv's signature of its inverse convolutions of _NDIM axes: the indice_key of the
    strided convolution to undo comes fourth."""

    _NDIM = None

    def __init__(self, in_channels, out_channels, kernel_size, indice_key, bias=True, algo=None,
                 fp32_accum=None, large_kernel_fast_algo=False, name=None):
        super().__init__(self._NDIM, in_channels, out_channels, kernel_size, bias=bias,
                         inverse=True, indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class _SubMNd(SparseConvolution):
    """spconv's signature of its submanifold convolutions of _NDIM axes (stride and padding
    taken and unused)."""

    _NDIM = None

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, indice_key=None, algo=None, fp32_accum=None,
                 large_kernel_fast_algo=False, name=None):
        super().__init__(self._NDIM, in_channels, out_channels, kernel_size, stride, padding,
                         dilation, groups, bias, True, indice_key=indice_key, algo=algo,
                         fp32_accum=fp32_accum, large_kernel_fast_algo=large_kernel_fast_algo,
                         name=name)


class SparseConv1d(_StridedNd):
    """A 1-D strided sparse convolution."""

    _NDIM = 1


class SparseConv2d(_StridedNd):
    """A 2-D strided sparse convolution."""

    _NDIM = 2


class SparseConv3d(_StridedNd):
    """A 3-D strided sparse convolution."""

    _NDIM = 3


class SparseConv4d(_StridedNd):
    """A 4-D strided sparse convolution."""

    _NDIM = 4


class SparseConvTranspose1d(_StridedNd):
    """A 1-D transposed sparse convolution (see transposed_rulebook)."""

    _NDIM, _TRANSPOSED = 1, True


class SparseConvTranspose2d(_StridedNd):
    """A 2-D transposed sparse convolution (see transposed_rulebook)."""

    _NDIM, _TRANSPOSED = 2, True


class SparseConvTranspose3d(_StridedNd):
    """A 3-D transposed sparse convolution (see transposed_rulebook)."""

    _NDIM, _TRANSPOSED = 3, True


class SparseConvTranspose4d(_StridedNd):
    """A 4-D transposed sparse convolution (see transposed_rulebook)."""

    _NDIM, _TRANSPOSED = 4, True


class SparseInverseConv1d(_InverseNd):
    """The 1-D inverse of the strided convolution named by indice_key: back to its inputs."""

    _NDIM = 1


class SparseInverseConv2d(_InverseNd):
    """The 2-D inverse of the strided convolution named by indice_key: back to its inputs."""

    _NDIM = 2


class SparseInverseConv3d(_InverseNd):
    """The 3-D inverse of the strided convolution named by indice_key: back to its inputs."""

    _NDIM = 3


class SparseInverseConv4d(_InverseNd):
    """The 4-D inverse of the strided convolution named by indice_key: back to its inputs."""

    _NDIM = 4


class SubMConv1d(_SubMNd):
    """A 1-D submanifold convolution: the output has the input's sites."""

    _NDIM = 1


class SubMConv2d(_SubMNd):
    """A 2-D submanifold convolution: the output has the input's sites."""

    _NDIM = 2


class SubMConv3d(_SubMNd):
    """A 3-D submanifold convolution: the output has the input's sites."""

    _NDIM = 3


class SubMConv4d(_SubMNd):
    """A 4-D submanifold convolution: the output has the input's sites."""

    _NDIM = 4
