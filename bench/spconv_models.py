"""Sparse backbones of published LiDAR detectors and segmenters, written from their papers'
and repositories' descriptions, on any spconv-2.x-like namespace `ns` (spconv.pytorch, or
torch_bridge.submanifold): the workloads of bench.submanifold_cpu and the models
tests/submanifold/test_spconv_port.py builds with both libraries.

- voxel_backbone_8x: SECOND's / OpenPCDet's VoxelBackBone8x (submanifold blocks, three
  stride-2 convolutions, a (3, 1, 1) stride-(2, 1, 1) output convolution).
- voxel_res_backbone_8x: its residual variant (VoxelResBackBone8x: basic blocks of two
  submanifold convolutions and an identity shortcut).
- unet_v2: PartA2's UNetV2: that encoder, then a decoder of lateral blocks, concatenation,
  channel reduction and SparseInverseConv3d back to the input sites.
- voxelnext: VoxelNeXt's backbone: six stages, the last two strided stages' sites scaled back
  to the fourth's and concatenated (replace_feature with more rows than sites), merged over
  height to a 2-D tensor, then SparseConv2d / SubMConv2d heads.
- sparse_encoder, sparse_unet: mmdetection3d's SparseEncoder and SparseUNet, their layers
  made by name through a registry (as mmdetection3d's build_conv_layer).
- spunet: Pointcept's SpUNet (v1m1): a 5^3 stem, stride-2 kernel-2 downsampling, residual
  blocks (a projection shortcut where the channels change), SparseInverseConv3d upsampling
  and skip concatenation.
"""

import functools

import torch

BN = functools.partial(torch.nn.BatchNorm1d, eps=1e-3, momentum=0.01)


def _block(ns, cin, cout, kernel, indice_key, stride=1, padding=0, kind="subm"):
    """conv (no bias), BatchNorm, ReLU: OpenPCDet's post_act_block."""
    if kind == "subm":
        conv = ns.SubMConv3d(cin, cout, kernel, bias=False, indice_key=indice_key)
    elif kind == "spconv":
        conv = ns.SparseConv3d(cin, cout, kernel, stride=stride, padding=padding, bias=False,
                               indice_key=indice_key)
    else:
        conv = ns.SparseInverseConv3d(cin, cout, kernel, indice_key=indice_key, bias=False)
    return ns.SparseSequential(conv, BN(cout), torch.nn.ReLU())


@functools.cache
def _blocks(ns):
    """The residual blocks on `ns`: they subclass ns.SparseModule, as the published code does,
    so that SparseSequential hands them the tensor whole."""

    class BasicBlock(ns.SparseModule):
        """Two 3^3 submanifold convolutions with BatchNorm and an identity shortcut (OpenPCDet's
        SparseBasicBlock); with cin != cout, a 1^3 projection shortcut (Pointcept's)."""

        def __init__(self, cin, cout, indice_key, bias=False):
            super().__init__()
            self.proj = (torch.nn.Identity() if cin == cout else ns.SparseSequential(
                ns.SubMConv3d(cin, cout, 1, bias=False), BN(cout)))
            self.conv1 = ns.SubMConv3d(cin, cout, 3, padding=1, bias=bias,
                                       indice_key=indice_key)
            self.bn1 = BN(cout)
            self.conv2 = ns.SubMConv3d(cout, cout, 3, padding=1, bias=bias,
                                       indice_key=indice_key)
            self.bn2 = BN(cout)

        def forward(self, x):
            out = self.conv1(x)
            out = out.replace_feature(torch.relu(self.bn1(out.features)))
            out = self.conv2(out)
            out = out.replace_feature(self.bn2(out.features) + self.proj(x).features)
            return out.replace_feature(torch.relu(out.features))

    return BasicBlock


def BasicBlock(ns, channels, indice_key, cout=None):
    return _blocks(ns)(channels, channels if cout is None else cout, indice_key)


def _stage(ns, cin, cout, key, padding, res, blocks=2):
    """A stride-2 convolution, then `blocks` submanifold blocks (or residual blocks)."""
    layers = [_block(ns, cin, cout, 3, f"spconv{key}", 2, padding, "spconv")]
    layers += ([BasicBlock(ns, cout, f"res{key}") for _ in range(blocks)] if res else
               [_block(ns, cout, cout, 3, f"subm{key}") for _ in range(blocks)])
    return ns.SparseSequential(*layers)


class VoxelBackBone8x(torch.nn.Module):
    """Returns the output tensor and the four stages' tensors."""

    def __init__(self, ns, input_channels, res=False):
        super().__init__()
        c = (16, 32, 64, 128) if res else (16, 32, 64, 64)
        self.conv_input = _block(ns, input_channels, 16, 3, "subm1")
        self.conv1 = ns.SparseSequential(BasicBlock(ns, 16, "res1") if res else
                                         _block(ns, 16, 16, 3, "subm1"))
        self.conv2 = _stage(ns, 16, c[1], 2, 1, res)
        self.conv3 = _stage(ns, c[1], c[2], 3, 1, res)
        self.conv4 = _stage(ns, c[2], c[3], 4, (0, 1, 1), res)
        self.conv_out = ns.SparseSequential(
            ns.SparseConv3d(c[3], 128, (3, 1, 1), stride=(2, 1, 1), padding=0, bias=False,
                            indice_key="spconv_down2"), BN(128), torch.nn.ReLU())

    def forward(self, x):
        x = self.conv_input(x)
        stages = [self.conv1(x)]
        for conv in (self.conv2, self.conv3, self.conv4):
            stages.append(conv(stages[-1]))
        return self.conv_out(stages[-1]), stages


def voxel_backbone_8x(ns, input_channels=4):
    return VoxelBackBone8x(ns, input_channels)


def voxel_res_backbone_8x(ns, input_channels=4):
    return VoxelBackBone8x(ns, input_channels, res=True)


def _decode(stage, x, lateral):
    """One decoder step of PartA2's UNetV2 (and mmdetection3d's SparseUNet, built on it): the
    lateral branch concatenated to x, merged, plus the concatenated channels summed in pairs
    (the channel reduction), then up."""
    t = stage.lateral(lateral)
    both = x.replace_feature(torch.cat([x.features, t.features], 1))
    merged = stage.merge(both)
    reduced = both.features.view(both.features.shape[0], -1, 2).sum(2)
    return stage.up(merged.replace_feature(merged.features + reduced))


class UNetV2(torch.nn.Module):
    """VoxelBackBone8x's encoder and a decoder back to the input sites; returns [N, 16]."""

    def __init__(self, ns, input_channels=4):
        super().__init__()
        self.encoder = VoxelBackBone8x(ns, input_channels)
        self.decoders = torch.nn.ModuleList()
        # (channels in, channels out, lateral key, inverse key) from the deepest stage up.
        for cin, cout, key, inverse in ((64, 64, "subm4", "spconv4"),
                                        (64, 32, "subm3", "spconv3"),
                                        (32, 16, "subm2", "spconv2"),
                                        (16, 16, "subm1", None)):
            stage = torch.nn.Module()
            stage.lateral = BasicBlock(ns, cin, key)
            stage.merge = _block(ns, 2 * cin, cin, 3, key)
            stage.up = (_block(ns, cin, cout, 3, inverse, kind="inverse") if inverse else
                        _block(ns, cin, cout, 3, key))
            self.decoders.append(stage)

    def forward(self, x):
        _, stages = self.encoder(x)
        x = stages[-1]
        for stage, lateral in zip(self.decoders, stages[::-1]):
            x = _decode(stage, x, lateral)
        return x


def unet_v2(ns, input_channels=4):
    return UNetV2(ns, input_channels)


class VoxelNeXt(torch.nn.Module):
    """VoxelNeXt's sparse backbone (small channels); returns the 2-D output tensor."""

    def __init__(self, ns, input_channels=4, c=(8, 16, 16, 32, 32, 32)):
        super().__init__()
        self.ns = ns
        self.conv_input = _block(ns, input_channels, c[0], 3, "subm1")
        self.conv1 = ns.SparseSequential(BasicBlock(ns, c[0], "res1"))
        self.stages = torch.nn.ModuleList(
            ns.SparseSequential(_block(ns, c[i - 1], c[i], 3, f"spconv{i + 1}", 2, 1,
                                       "spconv"), BasicBlock(ns, c[i], f"res{i + 1}"))
            for i in range(1, 6))
        self.conv_out = ns.SparseSequential(
            ns.SparseConv2d(c[3], c[3], 3, stride=1, padding=1, bias=False,
                            indice_key="spconv_down2"), BN(c[3]), torch.nn.ReLU())
        self.shared_conv = ns.SparseSequential(
            ns.SubMConv2d(c[3], c[3], 3, stride=1, padding=1, bias=True), BN(c[3]),
            torch.nn.ReLU(True))

    def forward(self, x):
        x = self.conv1(self.conv_input(x))
        stages = [x]
        for stage in self.stages:
            stages.append(stage(stages[-1]))
        x4, x5, x6 = stages[3], stages[4], stages[5]
        # The deeper stages' sites back to the fourth stage's grid, then one tensor of all:
        # more features than sites until the indices follow.
        x5.indices[:, 1:] *= 2
        x6.indices[:, 1:] *= 4
        merged = x4.replace_feature(torch.cat([x4.features, x5.features, x6.features]))
        merged.indices = torch.cat([x4.indices, x5.indices, x6.indices])
        out = self.conv_out(self._bev(merged))
        return self.shared_conv(out)

    def _bev(self, x):
        """Sites merged over height (features summed): a 2-D tensor."""
        sites, inverse = torch.unique(x.indices[:, [0, 2, 3]], dim=0, return_inverse=True)
        features = x.features.new_zeros((sites.shape[0], x.features.shape[1]))
        features = features.index_add(0, inverse, x.features)
        return self.ns.SparseConvTensor(features=features, indices=sites.int(),
                                        spatial_shape=x.spatial_shape[1:],
                                        batch_size=x.batch_size)


def voxelnext(ns, input_channels=4):
    return VoxelNeXt(ns, input_channels)


def spconv2_registry(ns):
    """name -> class of every convolution mmdetection3d's register_spconv2 imports (its
    transposed convolutions included), from `ns`."""
    names = ["SparseConv2d", "SparseConv3d", "SparseConv4d", "SparseConvTranspose2d",
             "SparseConvTranspose3d", "SparseInverseConv2d", "SparseInverseConv3d",
             "SubMConv2d", "SubMConv3d", "SubMConv4d"]
    return {name: getattr(ns, name) for name in names}


def _conv_module(ns, registry, conv_type, cin, cout, kernel, indice_key, stride=1, padding=0):
    """mmdetection3d's make_sparse_convmodule: conv by name (no bias), BatchNorm, ReLU."""
    if conv_type.startswith("SparseInverseConv"):
        conv = registry[conv_type](cin, cout, kernel, indice_key=indice_key, bias=False)
    else:
        conv = registry[conv_type](cin, cout, kernel, stride=stride, padding=padding,
                                   bias=False, indice_key=indice_key)
    return ns.SparseSequential(conv, BN(cout), torch.nn.ReLU(inplace=True))


class SparseEncoder(torch.nn.Module):
    """mmdetection3d's SparseEncoder (SECOND's middle encoder); returns the dense BEV map
    [B, C * D, H, W] and the stages' tensors."""

    def __init__(self, ns, in_channels=4, channels=((16,), (32, 32, 32), (64, 64, 64),
                                                     (64, 64, 64)),
                 paddings=((1,), (1, 1, 1), (1, 1, 1), ((0, 1, 1), 1, 1))):
        super().__init__()
        registry = spconv2_registry(ns)
        self.conv_input = _conv_module(ns, registry, "SubMConv3d", in_channels, 16, 3,
                                       "subm1", padding=1)
        stages, cin = [], 16
        for i, (stage_channels, stage_paddings) in enumerate(zip(channels, paddings)):
            layers = []
            for j, (cout, padding) in enumerate(zip(stage_channels, stage_paddings)):
                if i > 0 and j == 0:
                    layers.append(_conv_module(ns, registry, "SparseConv3d", cin, cout, 3,
                                               f"spconv{i + 1}", 2, padding))
                else:
                    layers.append(_conv_module(ns, registry, "SubMConv3d", cin, cout, 3,
                                               f"subm{i + 1}", padding=padding))
                cin = cout
            stages.append(ns.SparseSequential(*layers))
        self.encoder_layers = ns.SparseSequential(*stages)
        self.conv_out = _conv_module(ns, registry, "SparseConv3d", cin, 128, (3, 1, 1),
                                     "spconv_down2", (2, 1, 1), 0)

    def forward(self, x):
        x = self.conv_input(x)
        stages = []
        for stage in self.encoder_layers:
            x = stage(x)
            stages.append(x)
        dense = self.conv_out(x).dense()
        n, c, d, h, w = dense.shape
        return dense.view(n, c * d, h, w), stages


def sparse_encoder(ns, input_channels=4):
    return SparseEncoder(ns, input_channels)


class SparseUNet(torch.nn.Module):
    """mmdetection3d's SparseUNet (PartA2's), two levels: an encoder of SparseConv3d stages and
    a decoder of lateral basic blocks, merge convolutions, channel reduction and
    SparseInverseConv3d (the last level a submanifold convolution); returns [N, 16]."""

    def __init__(self, ns, in_channels=4):
        super().__init__()
        registry = spconv2_registry(ns)
        make = functools.partial(_conv_module, ns, registry)
        self.conv_input = make("SubMConv3d", in_channels, 16, 3, "subm1", padding=1)
        self.down = ns.SparseSequential(make("SparseConv3d", 16, 32, 3, "spconv2", 2, 1),
                                        make("SubMConv3d", 32, 32, 3, "subm2", padding=1))
        self.up = torch.nn.ModuleList()
        for cin, cout, key, conv_type, up_key in ((32, 16, "subm2", "SparseInverseConv3d",
                                                   "spconv2"),
                                                  (16, 16, "subm1", "SubMConv3d", "subm1")):
            level = torch.nn.Module()
            level.lateral = BasicBlock(ns, cin, key)
            level.merge = make("SubMConv3d", 2 * cin, cin, 3, key, padding=1)
            level.up = make(conv_type, cin, cout, 3, up_key, padding=1)
            self.up.append(level)

    def forward(self, x):
        first = self.conv_input(x)
        x = self.down(first)
        for level, lateral in zip(self.up, (x, first)):
            x = _decode(level, x, lateral)
        return x


def sparse_unet(ns, input_channels=4):
    return SparseUNet(ns, input_channels)


class SpUNet(torch.nn.Module):
    """Pointcept's SpUNet-v1m1 (small: two levels); returns per-site class scores."""

    def __init__(self, ns, in_channels=4, classes=5, channels=(16, 32), base=8):
        super().__init__()
        self.ns = ns
        self.stem = ns.SparseSequential(
            ns.SubMConv3d(in_channels, base, 5, padding=1, bias=False, indice_key="stem"),
            BN(base), torch.nn.ReLU())
        self.down, self.enc, self.up, self.dec = (torch.nn.ModuleList() for _ in range(4))
        cin = base
        for s, cout in enumerate(channels):
            self.down.append(ns.SparseSequential(
                ns.SparseConv3d(cin, cout, 2, stride=2, bias=False,
                                indice_key=f"spconv{s + 1}"), BN(cout), torch.nn.ReLU()))
            self.enc.append(ns.SparseSequential(BasicBlock(ns, cout, f"subm{s + 1}")))
            self.up.append(ns.SparseSequential(
                ns.SparseInverseConv3d(cout, cin, 2, indice_key=f"spconv{s + 1}", bias=False),
                BN(cin), torch.nn.ReLU()))
            self.dec.append(ns.SparseSequential(BasicBlock(ns, 2 * cin, f"subm{s}", cin)))
            cin = cout
        self.final = ns.SubMConv3d(base, classes, 1, padding=1, bias=True)

    def forward(self, features, indices, spatial_shape, batch_size):
        x = self.ns.SparseConvTensor(features=features, indices=indices,
                                     spatial_shape=spatial_shape, batch_size=batch_size)
        x = self.stem(x)
        skips = [x]
        for down, enc in zip(self.down, self.enc):
            x = enc(down(x))
            skips.append(x)
        x = skips.pop()
        for up, dec in zip(reversed(self.up), reversed(self.dec)):
            x = up(x)
            skip = skips.pop()
            x = dec(x.replace_feature(torch.cat([x.features, skip.features], 1)))
        return self.final(x).features


def spunet(ns, input_channels=4):
    return SpUNet(ns, input_channels)
