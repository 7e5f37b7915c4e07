"""A dense reference of the spconv 2.x API that tests/submanifold/test_spconv_port.py builds its
models with, to check torch_bridge.submanifold where spconv is not installed (CI).

A tensor is dense features [B, C, *S] and a bool mask [B, *S] of its active sites; `features`
lists the active sites' rows in row-major order, which is the order torch_bridge gives when the
input's indices are sorted. Each layer is torch's dense operator, masked:

- submanifold: the convolution of the zero-filled input (padding kernel // 2 * dilation, odd
  kernels), kept at the input's sites;
- strided: the convolution, at the sites it reaches (the convolution of the mask by ones);
- inverse: conv_transpose of the strided layer's output, at the strided layer's input sites;
- a 1x1 layer that keeps the sites multiplies by its weight's memory read as [Cin, Cout], as
  spconv does.
"""

import math

import torch
import torch.nn.functional as F

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class SparseConvTensor:
    def __init__(self, features, indices, spatial_shape, batch_size, dense=None, mask=None,
                 indice_dict=None):
        self.spatial_shape, self.batch_size = list(spatial_shape), batch_size
        self.indice_dict = {} if indice_dict is None else indice_dict
        if dense is None:
            mask = torch.zeros((batch_size, *spatial_shape), dtype=torch.bool)
            mask[tuple(indices.long().t())] = True
            dense = features.new_zeros((batch_size, *spatial_shape, features.shape[1]))
            dense[tuple(indices.long().t())] = features
            dense = dense.movedim(-1, 1)
        self.mask, self.dense_features = mask, dense

    @property
    def features(self):
        return self.dense_features.movedim(1, -1)[self.mask]

    @property
    def indices(self):
        return self.mask.nonzero().int()

    def replace_feature(self, features):
        dense = features.new_zeros((*self.mask.shape, features.shape[1]))
        dense = dense.index_put((self.mask,), features).movedim(-1, 1)
        return SparseConvTensor(None, None, self.spatial_shape, self.batch_size, dense,
                                self.mask, self.indice_dict)

    def dense(self):
        return self.dense_features.contiguous()


class SparseModule(torch.nn.Module):
    def __init__(self, name=None):
        super().__init__()


class SparseSequential(SparseModule, torch.nn.Sequential):
    def __init__(self, *args):
        torch.nn.Sequential.__init__(self, *args)

    def forward(self, x):
        for module in self:
            if isinstance(module, SparseModule):
                x = module(x)
            else:
                x = x.replace_feature(module(x.features))
        return x


class _Conv(SparseModule):
    def __init__(self, ndim, cin, cout, kernel_size, stride=1, padding=0, dilation=1, bias=True,
                 indice_key=None, kind="strided"):
        super().__init__()
        self.ndim, self.kind, self.indice_key = ndim, kind, indice_key
        expand = lambda v: [v] * ndim if isinstance(v, int) else list(v)
        self.kernel_size, self.stride = expand(kernel_size), expand(stride)
        self.padding, self.dilation = expand(padding), expand(dilation)
        self.weight = torch.nn.Parameter(torch.zeros(cout, *self.kernel_size, cin))
        self.bias = torch.nn.Parameter(torch.zeros(cout)) if bias else None

    def forward(self, x):
        w = self.weight.movedim(-1, 1)  # [Cout, Cin, *k]
        conv1x1 = math.prod(self.kernel_size) == 1 and (self.kind == "subm" or (
            self.kind == "strided" and self.stride == [1] * self.ndim
            and self.padding == [0] * self.ndim))
        if conv1x1:
            taps = self.weight.reshape(self.weight.shape[-1], self.weight.shape[0])
            y = x.features @ taps
            return x.replace_feature(y if self.bias is None else y + self.bias)
        if self.kind == "subm":
            padding = [k // 2 * d for k, d in zip(self.kernel_size, self.dilation)]
            y = CONV[self.ndim](x.dense(), w, self.bias, 1, padding, self.dilation)
            mask, shape = x.mask, x.spatial_shape
        elif self.kind == "strided":
            y = CONV[self.ndim](x.dense(), w, self.bias, self.stride, self.padding,
                                self.dilation)
            ones = torch.ones((1, 1, *self.kernel_size), dtype=w.dtype)
            reach = CONV[self.ndim](x.mask[:, None].to(w.dtype), ones, None, self.stride,
                                    self.padding, self.dilation)
            mask, shape = reach[:, 0] > 0, list(y.shape[2:])
            if self.indice_key is not None:
                indice_dict = dict(x.indice_dict)
                indice_dict[self.indice_key] = (x.mask, x.spatial_shape, self)
                return self._masked(y, mask, shape, x.batch_size, indice_dict)
        else:  # inverse: back to the strided layer's input sites
            mask, shape, strided = x.indice_dict[self.indice_key]
            # output_padding: the last sites of the strided layer's input, which torch's
            # output size leaves out.
            base = [(i - 1) * s - 2 * p + d * (k - 1) + 1 for i, s, p, d, k in zip(
                x.spatial_shape, strided.stride, strided.padding, strided.dilation,
                strided.kernel_size)]
            y = CONV_T[self.ndim](x.dense(), self.weight.movedim(-1, 0), self.bias,
                                  strided.stride, strided.padding,
                                  [s - b for s, b in zip(shape, base)], 1, strided.dilation)
        return self._masked(y, mask, shape, x.batch_size, x.indice_dict)

    @staticmethod
    def _masked(y, mask, shape, batch_size, indice_dict):
        return SparseConvTensor(None, None, shape, batch_size, y * mask[:, None].to(y.dtype),
                                mask, indice_dict)


def _make(ndim, kind):
    def init(self, cin, cout, kernel_size, stride=1, padding=0, dilation=1, groups=1,
             bias=True, indice_key=None, **unused):
        _Conv.__init__(self, ndim, cin, cout, kernel_size, stride, padding, dilation, bias,
                       indice_key, kind)

    def init_inverse(self, cin, cout, kernel_size, indice_key, bias=True, **unused):
        _Conv.__init__(self, ndim, cin, cout, kernel_size, bias=bias, indice_key=indice_key,
                       kind="inverse")

    return type("Conv", (_Conv,), {"__init__": init_inverse if kind == "inverse" else init})


for _ndim in (1, 2, 3, 4):
    globals()[f"SubMConv{_ndim}d"] = _make(_ndim, "subm")
    globals()[f"SparseConv{_ndim}d"] = _make(_ndim, "strided")
    globals()[f"SparseInverseConv{_ndim}d"] = _make(_ndim, "inverse")
    globals()[f"SparseConvTranspose{_ndim}d"] = _make(_ndim, "transposed")  # unused here
