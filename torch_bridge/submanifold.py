"""spconv-compatible sparse convolution on PyTorch tensors: ``import torch_bridge.submanifold as
spconv`` runs code written for spconv 2.x's SparseConvTensor, SubMConv2d/3d, SparseConv2d/3d,
SparseInverseConv2d/3d and SparseSequential, and loads their checkpoints.

Layouts are spconv's: indices int32 [N, 1 + D] (batch index first), features [N, C], weights
[Cout, *kernel_size, Cin] (spconv 2.x's default "KRSC" layout, its state_dict keys `weight`
and `bias`), ``.dense()`` channels first [B, C, *spatial]. Rulebooks (sbnet_cupy.submanifold)
are built outside the differentiable op, once per active set: a layer with an ``indice_key``
stores its rulebook in the output tensor's ``indice_dict``, later layers with the same key reuse
it (submanifold layers) or run it backwards (inverse convolutions). CUDA tensors build them with
sbnet_cupy's hash-table kernels (through DLPack, on torch's current stream); CPU tensors with its
NumPy backend.

The convolution is the op sbnet::submanifold_conv (registered as in _ops.py: CPU and CUDA
kernels, fake kernels, autograd; called directly when eager): a gather through the rulebook and
one cuBLAS matrix product (torch.addmm); the gradient of the features is the same op through the
transposed map, that of the weight one more product, so the backward is deterministic.
"""

import functools
import math

import numpy
import torch

from sbnet_cupy import _checks
from sbnet_cupy import submanifold as _core

from ._ops import (_call, _checked, _contiguous, _float_scratch, _numpy, _raw_stream, _register,
                   _same_device)

__all__ = [
    "Rulebook",
    "SparseConv1d",
    "SparseConv2d",
    "SparseConv3d",
    "SparseConv4d",
    "SparseConvTensor",
    "SparseConvolution",
    "SparseInverseConv1d",
    "SparseInverseConv2d",
    "SparseInverseConv3d",
    "SparseInverseConv4d",
    "SparseModule",
    "SparseSequential",
    "SubMConv1d",
    "SubMConv2d",
    "SubMConv3d",
    "SubMConv4d",
    "ToDense",
    "build_rulebook",
    "rulebook_conv",
]


# --- the op -------------------------------------------------------------------------------

def _gathered(features, neighbors):
    """[N_out, K * C]: the rows of CUDA features each output site reads (zeros for -1)."""
    taps, n_out = neighbors.shape
    out = features.new_empty((n_out, taps * features.shape[1]))
    device = features.get_device()
    _core.launch_gather(device, _raw_stream(device), features.data_ptr(), out.data_ptr(),
                        neighbors.data_ptr(), n_out, taps,
                        features.shape[1] * features.element_size())
    return out


def _conv_impl(features, weight, bias, neighbors, neighbors_t, algo):
    features, weight = _contiguous(features), _contiguous(weight)
    if not features.is_cuda:
        y = _core.conv_arrays(numpy, _numpy(features), _numpy(neighbors), _numpy(weight),
                              None if bias is None else _numpy(bias))
        return torch.from_numpy(y)
    if algo == "fused":
        taps, n_out = neighbors.shape
        out = features.new_empty((n_out, weight.shape[0]))
        device = features.get_device()
        _core.launch_fused(device, _raw_stream(device), features.data_ptr(), weight.data_ptr(),
                           0 if bias is None else _contiguous(bias).data_ptr(),
                           neighbors.data_ptr(), out.data_ptr(), n_out, features.shape[1],
                           weight.shape[0], taps, _checks.dtype_name(features),
                           functools.partial(_float_scratch, features.device))
        return out
    taps = weight.reshape(weight.shape[0], -1)
    g = _gathered(features, neighbors)
    return g @ taps.t() if bias is None else torch.addmm(bias, g, taps.t())


def _conv_fake(features, weight, bias, neighbors, neighbors_t, algo):
    return features.new_empty((neighbors.shape[1], weight.shape[0]))


def _conv_setup(ctx, inputs, output):
    features, weight, bias, neighbors, neighbors_t, ctx.algo = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(features, weight, neighbors, neighbors_t)


def _conv_backward(ctx, grad):
    features, weight, neighbors, neighbors_t = ctx.saved_tensors
    grad = _contiguous(grad)
    dx = dw = db = None
    if ctx.needs_input_grad[0]:  # the dual op: the transposed map, the transposed weight
        weight_t = weight.transpose(0, -1).contiguous()
        dx = _call(_conv_op, _conv_autograd, _conv_impl,
                   (grad, weight_t, None, neighbors_t, neighbors, ctx.algo),
                   (grad, weight_t, neighbors_t, neighbors), (grad, weight_t))
    if ctx.needs_input_grad[1]:
        dw = _call(_grad_weight_op, None, _grad_weight_impl,
                   (features, grad, neighbors, list(weight.shape)), (features, grad, neighbors))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = grad.sum(0)
    return dx, dw, db, None, None, None


_conv_op, _conv_autograd = _register(
    "submanifold_conv(Tensor features, Tensor weight, Tensor? bias, Tensor neighbors, "
    "Tensor neighbors_t, str algo) -> Tensor",
    _conv_impl, _conv_fake, _conv_setup, _conv_backward)


def _grad_weight_impl(features, dy, neighbors, weight_shape):
    features, dy = _contiguous(features), _contiguous(dy)
    if not features.is_cuda:
        return torch.from_numpy(_core.grad_weight_arrays(
            numpy, _numpy(features), _numpy(dy), _numpy(neighbors), tuple(weight_shape)))
    return (dy.t() @ _gathered(features, neighbors)).reshape(weight_shape)


def _grad_weight_fake(features, dy, neighbors, weight_shape):
    return features.new_empty(weight_shape)


_grad_weight_op, _ = _register(
    "submanifold_conv_grad_weight(Tensor features, Tensor dy, Tensor neighbors, "
    "int[] weight_shape) -> Tensor",
    _grad_weight_impl, _grad_weight_fake)


# --- rulebooks ----------------------------------------------------------------------------

class Rulebook(_core.Rulebook):
    """sbnet_cupy.submanifold.Rulebook with torch tensors and spconv's names: neighbors int32
    [K, N_out], neighbors_t int32 [K, N_in], in_indices int32 [N_in, 1 + D] and out_indices
    int32 [N_out, 1 + D] (the core's in_coords and out_coords), in_shape and out_shape (lists
    of D ints), batch_size, kernel_size, stride, padding, dilation (lists of D ints), subm and
    inverted. On CUDA it carries the device tables of its sites that build_rulebook may reuse;
    inverse() swaps them with the sites."""

    def __init__(self, neighbors, neighbors_t, in_indices, out_indices, in_shape, out_shape,
                 batch_size, kernel_size, stride, padding, dilation, subm, inverted=False):
        """The core's arguments, with the sites under spconv's names (keywords included)."""
        super().__init__(neighbors, neighbors_t, in_indices, out_indices, in_shape, out_shape,
                         batch_size, kernel_size, stride, padding, dilation, subm, inverted)

    @property
    def in_indices(self):
        return self.in_coords

    @property
    def out_indices(self):
        return self.out_coords


def build_rulebook(indices, spatial_shape, batch_size, kernel_size, stride=1, padding=0,
                   dilation=1, subm=False, *, check=True, reuse=()):
    """The Rulebook of a submanifold (subm=True; stride and padding unused) or strided sparse
    convolution on the sites `indices` (int32 [N, 1 + D], CPU or CUDA), on their device. Not
    differentiable. A CUDA build syncs with the host to check the indices (unless check=False:
    see sbnet_cupy.submanifold.submanifold_rulebook) and, if strided, to count its outputs
    (one sync for both).

    reuse: Rulebooks (a SparseConvTensor's indice_dict.values()) whose tables of these very
    indices (the same tensor object, as a layer's output carries them) this build may reuse
    instead of building its own: a submanifold rulebook on a strided one's output sites then
    costs one kernel launch. The modules pass it."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    shape = [int(s) for s in spatial_shape]
    indices = _contiguous(indices)
    if indices.is_cuda:
        shape_t, batch, geometry, out_shape = _core.rulebook_geometry(
            indices, shape, batch_size, kernel_size, stride, padding, dilation, subm)
        device = indices.get_device()
        built = _core.build_raw(_TorchAlloc(indices.device), device, _raw_stream(device),
                                indices, indices.data_ptr(), shape_t, batch, geometry,
                                out_shape, check, _reusable_table(reuse, indices, shape_t,
                                                                  batch, check))
        if built is not None:
            rulebook = Rulebook(built.neighbors, built.neighbors_t, indices,
                                indices if subm else built.out_coords, list(shape_t),
                                list(out_shape or shape_t), batch, *map(list, geometry), subm)
            rulebook._tables = (built.in_table, built.out_table)
            return rulebook
        import cupy  # a strided output grid too large for a bitmap: CuPy's hash and sort

        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(_raw_stream(device)):
            result = _build(cupy.from_dlpack(indices), shape, batch_size, kernel_size, stride,
                            padding, dilation, subm, check)
        convert = torch.from_dlpack
    else:
        result = _build(indices.numpy(), shape, batch_size, kernel_size, stride, padding,
                        dilation, subm, check)
        convert = torch.from_numpy
    out_indices = indices if subm else convert(result.out_coords)
    return Rulebook(convert(result.neighbors), convert(result.neighbors_t), indices, out_indices,
                    list(result.in_shape), list(result.out_shape), result.batch_size,
                    list(result.kernel_size), list(result.stride), list(result.padding),
                    list(result.dilation), subm)


class _TorchAlloc:
    """sbnet_cupy.submanifold.build_raw's device arrays: torch tensors on `device` (its caching
    allocator, on torch's current stream, where the kernels run)."""

    _DTYPES = {"int32": torch.int32, "int64": torch.int64}

    def __init__(self, device):
        self.device = device

    def empty(self, shape, dtype):
        t = torch.empty(shape, dtype=self._DTYPES[dtype], device=self.device)
        return t, t.data_ptr()

    @staticmethod
    def host(t):
        return t.cpu().numpy()


def _reusable_table(reuse, indices, shape, batch, check):
    """A table of `indices` (this tensor object) on grid batch x shape that one of the
    Rulebooks in `reuse` carries, checked if `check`; None if none does."""
    for rulebook in reuse:
        if not isinstance(rulebook, Rulebook):
            continue
        for table, sites in zip(rulebook._tables, (rulebook.in_indices, rulebook.out_indices)):
            if (table is not None and sites is indices and table.shape == shape
                    and table.batch == batch and (table.checked or not check)):
                return table
    return None


def _build(coords, shape, batch_size, kernel_size, stride, padding, dilation, subm, check):
    if subm:
        return _core.submanifold_rulebook(coords, shape, batch_size, kernel_size, dilation,
                                          check=check)
    return _core.strided_rulebook(coords, shape, batch_size, kernel_size, stride, padding,
                                  dilation, check=check)


def _check_conv(features, weight, bias, neighbors, kernel_size, n_in, algo):
    _core.check_operands(features, weight, bias, kernel_size, n_in)
    if not features.is_cuda and features.dtype == torch.bfloat16:
        raise TypeError("bfloat16 needs CUDA tensors (the CPU backend is NumPy's)")
    if neighbors.dtype != torch.int32:
        raise TypeError(f"the rulebook's maps must be int32, got {neighbors.dtype}")
    _core.check_algo(algo, _checks.dtype_name(features))


_CHECKS = {}


def rulebook_conv(features, rulebook, weight, bias=None, *, algo=None):
    """sbnet_cupy.submanifold.rulebook_conv on tensors: features [N_in, Cin] through a Rulebook
    (build_rulebook, or .inverse() of one), weight [Cout, *kernel_size, Cin], bias [Cout] or
    None; returns [N_out, Cout]. Differentiable in features, weight and bias. algo: "gemm"
    (gather, then torch.addmm: TF32 where torch allows it) or "fused" (float32 runs as TF32);
    None: sbnet_cupy.submanifold.choose_algo's (TF32 allowed by
    torch.backends.cuda.matmul.allow_tf32). CPU tensors run the NumPy backend."""
    if not isinstance(rulebook, Rulebook):
        raise TypeError(f"rulebook must be a torch_bridge.submanifold.Rulebook, got "
                        f"{type(rulebook).__name__}")
    neighbors, neighbors_t = rulebook.neighbors, rulebook.neighbors_t
    if algo is None:
        algo = "gemm" if not features.is_cuda else _core.choose_algo(
            _checks.dtype_name(features), torch.backends.cuda.matmul.allow_tf32)
    _checked(_CHECKS, _check_conv, (features, weight, bias, neighbors,
                                    tuple(rulebook.kernel_size), neighbors_t.shape[1], algo))
    _same_device(features, weight, bias, neighbors, features=features, weight=weight, bias=bias,
                 rulebook=neighbors)
    args = (features, weight, bias, neighbors, neighbors_t, algo)
    tensors = (features, weight, neighbors, neighbors_t) + (() if bias is None else (bias,))
    differentiable = (features, weight) + (() if bias is None else (bias,))
    return _call(_conv_op, _conv_autograd, _conv_impl, args, tensors, differentiable)


# --- spconv's tensor and modules ----------------------------------------------------------

class SparseConvTensor:
    """spconv's sparse tensor: features [N, C], indices int32 [N, 1 + D] (batch index first),
    spatial_shape (D ints), batch_size, and indice_dict, the rulebooks of the layers that
    produced it, by indice_key."""

    def __init__(self, features, indices, spatial_shape, batch_size, grid=None, voxel_num=None,
                 indice_dict=None, benchmark=False):
        """grid, voxel_num and benchmark are accepted for spconv's signature and unused."""
        del grid, voxel_num, benchmark
        if features.ndim != 2 or indices.ndim != 2 or features.shape[0] != indices.shape[0]:
            raise ValueError(f"features [N, C] and indices [N, 1 + D] must have one row a site, "
                             f"got shapes {tuple(features.shape)} and {tuple(indices.shape)}")
        if indices.dtype != torch.int32:
            raise TypeError(f"indices must be int32, got {indices.dtype}")
        if indices.shape[1] != 1 + len(spatial_shape):
            raise ValueError(f"indices must be [N, {1 + len(spatial_shape)}] for spatial_shape "
                             f"{list(spatial_shape)}, got {tuple(indices.shape)}")
        self._features = features
        # Row-major once (torch's nonzero() gives column-major sites): every rulebook reads them
        # so, and reuses a table only of this very tensor.
        self.indices = indices.contiguous()
        self.spatial_shape = [int(s) for s in spatial_shape]
        self.batch_size = int(batch_size)
        self.indice_dict = {} if indice_dict is None else indice_dict
        # Whether the indices are known distinct and inside the grid: a convolution's output
        # sites are, so its rulebooks skip the check (and its host sync).
        self.indices_checked = False

    @property
    def features(self):
        return self._features

    @features.setter
    def features(self, value):
        self._features = value

    @property
    def spatial_size(self):
        return math.prod(self.spatial_shape)

    @classmethod
    def from_dense(cls, x):
        """The sparse tensor of the non-zero sites of x [B, *spatial, C] (channels last, as
        spconv's from_dense)."""
        active = (x != 0).any(dim=-1)
        indices = torch.nonzero(active).to(torch.int32)
        return cls(x[active], indices, list(x.shape[1:-1]), x.shape[0])

    def find_indice_pair(self, key):
        return None if key is None else self.indice_dict.get(key)

    def replace_feature(self, feature):
        """A tensor with these sites and rulebooks and new features [N, C']."""
        return self._with(feature, self.indices, self.spatial_shape, self.indice_dict,
                          self.indices_checked)

    def _with(self, features, indices, spatial_shape, indice_dict, checked):
        out = SparseConvTensor(features, indices, spatial_shape, self.batch_size,
                               indice_dict=indice_dict)
        out.indices_checked = checked
        return out

    def shadow_copy(self):
        return self.replace_feature(self.features)

    def dense(self, channels_first=True):
        """The dense tensor [B, C, *spatial] (channels last with channels_first=False), zeros
        at inactive sites; differentiable in the features."""
        channels = self.features.shape[1]
        out = self.features.new_zeros((self.batch_size, *self.spatial_shape, channels))
        out = out.index_put(tuple(self.indices.long().t()), self.features)
        if not channels_first:
            return out
        return out.permute(0, out.ndim - 1, *range(1, out.ndim - 1)).contiguous()

    def __repr__(self):
        return (f"SparseConvTensor(features={tuple(self.features.shape)}, "
                f"spatial_shape={self.spatial_shape}, batch_size={self.batch_size}, "
                f"indice_keys={sorted(map(str, self.indice_dict))})")


class SparseModule(torch.nn.Module):
    """Base of the modules that take a SparseConvTensor (SparseSequential passes it whole)."""


def _tuple(name, value, ndim, minimum):
    return list(_core._ints(name, value, ndim, minimum))


class SparseConvolution(SparseModule):
    """spconv's SparseConvolution: submanifold (subm=True), strided, or inverse (inverse=True,
    with the indice_key of the strided convolution to undo). Parameters weight [Cout,
    *kernel_size, Cin] and bias [Cout] (or None), as spconv 2.x stores them."""

    def __init__(self, ndim, in_channels, out_channels, kernel_size=3, stride=1, padding=0,
                 dilation=1, groups=1, bias=True, subm=False, output_padding=0,
                 transposed=False, inverse=False, indice_key=None, algo=None, fp32_accum=None,
                 record_voxel_count=False, act_type=None, act_alpha=0, act_beta=0, name=None,
                 large_kernel_fast_algo=False, device=None, dtype=None):
        """Arguments as spconv's; algo, fp32_accum, record_voxel_count, name and
        large_kernel_fast_algo are accepted and unused (one algorithm, float32 accumulation always). groups must be 1, and
        transposed convolutions and fused activations are not provided."""
        super().__init__()
        del algo, fp32_accum, record_voxel_count, name, output_padding, large_kernel_fast_algo
        if groups != 1:
            raise ValueError(f"groups must be 1, got {groups}")
        if transposed:
            raise NotImplementedError("SparseConvTranspose is not provided: use "
                                      "SparseInverseConv with the strided layer's indice_key")
        if act_type not in (None, 0) or act_alpha or act_beta:
            raise NotImplementedError("fused activations are not provided: add the activation "
                                      "after the layer")
        if inverse and indice_key is None:
            raise ValueError("an inverse convolution needs the indice_key of the strided "
                             "convolution it undoes")
        self.ndim, self.in_channels, self.out_channels = ndim, in_channels, out_channels
        self.kernel_size = _tuple("kernel_size", kernel_size, ndim, 1)
        self.stride = _tuple("stride", stride, ndim, 1)
        self.padding = _tuple("padding", padding, ndim, 0)
        self.dilation = _tuple("dilation", dilation, ndim, 1)
        self.groups, self.subm, self.inverse, self.transposed = groups, subm, inverse, False
        self.indice_key = indice_key
        self.sbnet_algo = None  # rulebook_conv's algo (None: its rule); spconv's algo is unused
        factory = dict(device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(
            torch.empty(out_channels, *self.kernel_size, in_channels, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_channels, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        """Uniform in +-1/sqrt(fan_in), fan_in = Cin x kernel volume (nn.Conv's default)."""
        bound = 1 / math.sqrt(self.in_channels * math.prod(self.kernel_size))
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
                                 f"strided convolution that made this tensor's sites")
            if (cached.kernel_size != self.kernel_size
                    or cached.out_indices.shape[0] != x.indices.shape[0]):
                raise ValueError(f"indice_key {self.indice_key!r}: the strided convolution had "
                                 f"kernel_size {cached.kernel_size} and "
                                 f"{cached.out_indices.shape[0]} output sites; this layer has "
                                 f"{self.kernel_size} and {x.indices.shape[0]}")
            return cached.inverse(), False
        if cached is not None and cached.subm == self.subm and not cached.inverted:
            same = (cached.kernel_size == self.kernel_size and cached.dilation == self.dilation
                    and (self.subm or (cached.stride, cached.padding)
                         == (self.stride, self.padding)))
            if same and cached.in_indices.shape[0] == x.indices.shape[0] and (
                    cached.in_shape == x.spatial_shape):
                return cached, False
            if self.subm:
                raise ValueError(f"indice_key {self.indice_key!r} names a rulebook of another "
                                 f"geometry or another set of sites: {cached!r}")
        rulebook = build_rulebook(x.indices, x.spatial_shape, x.batch_size, self.kernel_size,
                                  self.stride, self.padding, self.dilation, self.subm,
                                  check=not x.indices_checked, reuse=x.indice_dict.values())
        return rulebook, self.indice_key is not None

    def forward(self, x):
        if not isinstance(x, SparseConvTensor):
            raise TypeError(f"input must be a SparseConvTensor, got {type(x).__name__}")
        if x.features.shape[1] != self.in_channels:
            raise ValueError(f"input has {x.features.shape[1]} channels, this layer takes "
                             f"{self.in_channels}")
        indice_dict = dict(x.indice_dict)
        if self.subm and all(k == 1 for k in self.kernel_size):
            # A 1x1 submanifold convolution is a matrix product: no rulebook.
            taps = self.weight.reshape(self.out_channels, self.in_channels)
            y = torch.nn.functional.linear(x.features, taps, self.bias)
            return x._with(y, x.indices, x.spatial_shape, indice_dict, x.indices_checked)
        rulebook, store = self._rulebook(x)
        if store:
            indice_dict[self.indice_key] = rulebook
        y = rulebook_conv(x.features, rulebook, self.weight, self.bias, algo=self.sbnet_algo)
        return x._with(y, rulebook.out_indices, rulebook.out_shape, indice_dict, True)

    def extra_repr(self):
        kind = "subm" if self.subm else "inverse" if self.inverse else "strided"
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"{kind}, indice_key={self.indice_key!r}, bias={self.bias is not None}")


def _module(name, ndim, **fixed):
    """A SparseConvolution subclass of fixed ndim (and subm / inverse), with spconv's
    constructor: (in, out, kernel_size, stride, padding, dilation, groups, bias, indice_key,
    ...) and, for inverse convolutions, (in, out, kernel_size, indice_key, bias, ...)."""
    if fixed.get("inverse"):
        def __init__(self, in_channels, out_channels, kernel_size, indice_key=None, bias=True,
                     **kwargs):
            SparseConvolution.__init__(self, ndim, in_channels, out_channels, kernel_size,
                                       bias=bias, indice_key=indice_key, **fixed, **kwargs)
    else:
        def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, padding=0,
                     dilation=1, groups=1, bias=True, indice_key=None, **kwargs):
            SparseConvolution.__init__(self, ndim, in_channels, out_channels, kernel_size,
                                       stride, padding, dilation, groups, bias,
                                       indice_key=indice_key, **fixed, **kwargs)

    kind = ("submanifold" if fixed.get("subm") else "inverse" if fixed.get("inverse")
            else "strided")
    return type(name, (SparseConvolution,), dict(
        __init__=__init__, __doc__=f"spconv's {name}: a {ndim}-D {kind} sparse convolution."))


SubMConv1d = _module("SubMConv1d", 1, subm=True)
SubMConv2d = _module("SubMConv2d", 2, subm=True)
SubMConv3d = _module("SubMConv3d", 3, subm=True)
SubMConv4d = _module("SubMConv4d", 4, subm=True)
SparseConv1d = _module("SparseConv1d", 1)
SparseConv2d = _module("SparseConv2d", 2)
SparseConv3d = _module("SparseConv3d", 3)
SparseConv4d = _module("SparseConv4d", 4)
SparseInverseConv1d = _module("SparseInverseConv1d", 1, inverse=True)
SparseInverseConv2d = _module("SparseInverseConv2d", 2, inverse=True)
SparseInverseConv3d = _module("SparseInverseConv3d", 3, inverse=True)
SparseInverseConv4d = _module("SparseInverseConv4d", 4, inverse=True)


class SparseSequential(SparseModule, torch.nn.Sequential):
    """spconv's SparseSequential: SparseModules (SparseSequential included) take the
    SparseConvTensor; other modules (BatchNorm1d, ReLU, ...) take its features, and the tensor
    keeps its sites."""

    def forward(self, x):
        for module in self:
            if isinstance(module, SparseModule):
                x = module(x)
            elif isinstance(x, SparseConvTensor):
                x = x.replace_feature(module(x.features))
            else:
                x = module(x)
        return x


class ToDense(SparseModule):
    """SparseConvTensor -> dense [B, C, *spatial] (spconv's ToDense)."""

    def forward(self, x):
        return x.dense()
