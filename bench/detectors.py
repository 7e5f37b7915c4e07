"""The sparse backbones of published LiDAR detectors and a segmentation U-Net, ours
(torch_bridge.submanifold) against spconv 2.3.8 with the same weights, in eval and training.

    python -m bench.detectors [--quick] [--all] [--out DIR] [--repeats N] [--rounds N]
        [--models ...] [--scales kitti waymo semkitti] [--batches 1 2 4]
        [--modes eval-tf32 eval-fp16 eval-tf32-fused eval-fp16-fused eval-tf32-graph
                 eval-fp16-graph train-tf32 train-amp]
        [--profile] [--budget S]
        [--device cuda|cpu] [--suffix NAME]

Models, written here from the published layer lists (each a function of a spconv-like
namespace, so that the same code builds ours and spconv's):
- VoxelBackBone8x (SECOND, PV-RCNN): SubM 16, SubM 16; three stages of a strided conv (s2) and
  two SubM (32, 64, 64 channels; the third stage's stride-2 conv unpadded in z); a (3, 1, 1)
  conv of stride (2, 1, 1) to 128 channels. BatchNorm1d (eps 1e-3, momentum 0.01) and ReLU
  after every conv, no conv bias. Output: 128 channels at stride 8 in x and y.
- VoxelResBackBone8x (CenterPoint, Voxel R-CNN): the same stages with two residual basic blocks
  (two SubM 3x3 with bias, BN, the identity added before the last ReLU, `replace_feature`)
  after each downsampling, 16, 32, 64, 128 channels, then the (3, 1, 1) conv to 128.
- UNetV2 (PartA2): VoxelBackBone8x's encoder (its 128-channel output kept) and a decoder up to
  the input voxels: at each level a residual block on the lateral features, a SubM on the
  concatenation [bottom, lateral] whose output is added to the channel-pair sums of that
  concatenation, and an inverse conv (SparseInverseConv3d on the encoder's indice_key) up a
  level; 16 channels out at the input sites.
- MinkUNet (MinkUNet18-like, SemanticKITTI): a stem of two SubM 3x3 (32), four levels of a
  2x2x2 stride-2 conv and two residual blocks (32, 64, 128, 256 channels; 1x1 SubM + BN
  shortcut where the width changes), four levels up of a 2x2x2 inverse conv, concatenation
  with the skip and two residual blocks (256, 128, 96, 96), a linear classifier to 19 classes
  at the input sites. spconv's users build it with SparseInverseConv3d on the downsampling's
  indice_key (mmdetection3d's spconv MinkUNet does); a transposed conv (SparseConvTranspose3d)
  would make the same sites and, with the kernel equal to the stride, the same values.

Inputs: bench.lidar_scenes (ray-cast scenes, voxels shuffled as voxelisers emit them): the
detectors at KITTI scale (41 x 1600 x 1408 grid, 4 features) and Waymo scale (41 x 1504 x 1504,
5 features), MinkUNet at SemanticKITTI scale (120 x 2000 x 2000, 4 features); batch 1, 2, 4.

Modes (TF32 allowed in torch and in spconv, bench._common.allow_tf32, in every mode):
- eval-tf32: model.eval(), float32 features and weights, torch.no_grad().
- eval-fp16: a float16 copy of the model (model.half(), BatchNorm included) on float16
  features, under torch.no_grad(): how spconv's users run fp16 inference (spconv's own
  examples and OpenPCDet / mmdetection3d deployments convert the model; autocast is the
  training tool).
- eval-tf32-fused, eval-fp16-fused: the same, ours after torch_bridge.submanifold.fuse_bn_relu
  (each BatchNorm and ReLU that follows a conv in a SparseSequential fused into it; those a
  residual block's forward calls stay); spconv has no such call and runs as in eval-*.
- eval-tf32-graph, eval-fp16-graph: the fused model run through
  torch_bridge.submanifold.SparseGraphs (the whole forward, rulebooks included, one CUDA graph
  replay, its outputs copied out; the graph captured in the warm-up); spconv as in eval-*.
- train-tf32: model.train(); one step: forward, loss = the mean square of each output's
  features (summed over outputs), backward, torch.optim.SGD (lr 1e-4, momentum 0.9) step,
  gradients reset to None.
- train-amp: the same step with the forward under torch.autocast(float16) and a
  torch.amp.GradScaler (scale, backward, step, update), as AMP training is written. The
  `*_dtype` columns give the dtype each library's output came out in.

Every model, scale and batch is checked first: spconv's model is built (seeded, BatchNorm
statistics and affine parameters randomised), its state_dict loaded into ours with strict=True,
both run with TF32 off, in float32 on CUDA (float64 on the CPU): outputs (sites matched by
coordinates, bench.submanifold.by_site) within 1e-4 and, after one training-mode backward, all
gradients (one vector) within 1e-2 in float32 (train-mode BatchNorm amplifies rounding; on the
CPU, in float64, both agree to ~1e-13). Each eval mode's output is compared with our float32
reference, TF32 off (`*_err`). Times: CUDA events around each call (bench._common.events_ms),
the libraries timed in turns, --rounds rounds (default 3) of --repeats calls each (the first
after a warm-up), the median of a library's round medians; the rulebooks built in every call as
a detector's forward builds them. With --profile, one more call a library and mode runs under
torch.profiler: the GPU time of every kernel, split into the convolutions' kernels (`*_conv_ms`:
ours submanifold_fused / submanifold_gather / split sums and cuBLAS; spconv's cumm implicit
GEMM), the rulebooks' (`*_rulebook_ms`: our hash-table kernels; spconv's indice generation, hash
tables and sorts) and the rest (BatchNorm, ReLU, concatenation, loss, optimizer; `*_gpu_ms` is
the sum of all); the classes are by kernel name (CLASSES; the 1x1 SubM shortcuts and MinkUNet's
classifier are cuBLAS products in both libraries, counted as convolutions) and the largest
kernels of every profile are listed in the .md, so the classification can be checked.

--quick: each model at its smallest scale (KITTI; MinkUNet at SemanticKITTI), batch 1, 3 repeats
in one round. The default runs every model at its scales, batches 1, 2 and 4, all four modes,
ordered batch by batch, and stops starting new cases once --budget seconds (default 420) have
passed, listing what it left out; --all lifts the budget. --device cpu (implies --quick: crops
of the scenes, the check in float64 against spconv's CPU build, eval and train in float32)
checks the model definitions and the weight copy on a machine without a GPU.

Writes DIR/detectors_<device>.csv, .md and .png (the .png with matplotlib installed).
"""

import argparse
import copy
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

import numpy
import torch

import torch_bridge.submanifold as ours
from bench import lidar_scenes
from bench._common import RESULTS, allow_tf32, events_ms, require_gpu, results_stem, write_csv
from bench.submanifold import by_site, rel_error

MODES = ("eval-tf32", "eval-fp16", "eval-tf32-fused", "eval-fp16-fused", "eval-tf32-graph",
         "eval-fp16-graph", "train-tf32", "train-amp")
CHECK_TOLERANCE = {  # relative L2, TF32 off: (outputs, gradients) in float32 (CUDA), float64 (CPU)
    "cuda": {"out": 1e-4, "grad": 1e-2}, "cpu": {"out": 1e-9, "grad": 1e-9}}


def _bn(channels):
    return torch.nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01)


def conv_bn_relu(ns, cin, cout, kernel, key, stride=1, padding=0, kind="subm"):
    """A sparse conv (no bias) + BatchNorm1d + ReLU: kind "subm", "spconv" (strided) or
    "inverse" (SparseInverseConv3d undoing the strided conv of indice_key `key`)."""
    if kind == "subm":
        conv = ns.SubMConv3d(cin, cout, kernel, padding=padding, bias=False, indice_key=key)
    elif kind == "spconv":
        conv = ns.SparseConv3d(cin, cout, kernel, stride=stride, padding=padding, bias=False,
                               indice_key=key)
    elif kind == "inverse":
        conv = ns.SparseInverseConv3d(cin, cout, kernel, indice_key=key, bias=False)
    else:
        raise ValueError(kind)
    return ns.SparseSequential(conv, _bn(cout), torch.nn.ReLU())


_BLOCK_CLASSES = {}


def basic_block(ns, cin, cout, key, bias=True):
    """A residual basic block of two 3x3x3 SubM convs (with `bias`), BN after each, ReLU after
    the first and after the sum with the shortcut (the identity, or a 1x1 SubM + BN where the
    width changes), a SparseModule of namespace ns (SparseSequential hands it the tensor)."""
    cls = _BLOCK_CLASSES.get(ns.__name__)
    if cls is None:
        class BasicBlock(ns.SparseModule):
            def __init__(self, cin, cout, key, bias):
                super().__init__()
                self.conv1 = ns.SubMConv3d(cin, cout, 3, padding=1, bias=bias, indice_key=key)
                self.bn1 = _bn(cout)
                self.conv2 = ns.SubMConv3d(cout, cout, 3, padding=1, bias=bias, indice_key=key)
                self.bn2 = _bn(cout)
                self.relu = torch.nn.ReLU()
                self.shortcut = None if cin == cout else ns.SparseSequential(
                    ns.SubMConv3d(cin, cout, 1, bias=False), _bn(cout))

            def forward(self, x):
                y = self.conv1(x)
                y = y.replace_feature(self.relu(self.bn1(y.features)))
                y = self.conv2(y)
                skip = x.features if self.shortcut is None else self.shortcut(x).features
                return y.replace_feature(self.relu(self.bn2(y.features) + skip))

        cls = _BLOCK_CLASSES[ns.__name__] = BasicBlock
    return cls(cin, cout, key, bias)


class _Backbone(torch.nn.Module):
    """A model of sparse modules whose forward returns a list of SparseConvTensors (the outputs
    compared and put into the loss)."""


class VoxelBackBone8x(_Backbone):
    def __init__(self, ns, cin, residual=False):
        super().__init__()
        widths = (16, 32, 64, 128) if residual else (16, 32, 64, 64)
        self.conv_input = conv_bn_relu(ns, cin, 16, 3, "subm1", padding=1)
        if residual:  # VoxelResBackBone8x
            def stage(i, cin, cout, padding):
                down = [] if i == 1 else [conv_bn_relu(ns, cin, cout, 3, f"spconv{i}", 2,
                                                       padding, "spconv")]
                return ns.SparseSequential(*down, basic_block(ns, cout, cout, f"res{i}"),
                                           basic_block(ns, cout, cout, f"res{i}"))
        else:
            def stage(i, cin, cout, padding):
                if i == 1:
                    return ns.SparseSequential(conv_bn_relu(ns, 16, 16, 3, "subm1", padding=1))
                return ns.SparseSequential(
                    conv_bn_relu(ns, cin, cout, 3, f"spconv{i}", 2, padding, "spconv"),
                    conv_bn_relu(ns, cout, cout, 3, f"subm{i}", padding=1),
                    conv_bn_relu(ns, cout, cout, 3, f"subm{i}", padding=1))
        self.conv1 = stage(1, 16, widths[0], 1)
        self.conv2 = stage(2, widths[0], widths[1], 1)
        self.conv3 = stage(3, widths[1], widths[2], 1)
        self.conv4 = stage(4, widths[2], widths[3], (0, 1, 1))
        self.conv_out = conv_bn_relu(ns, widths[3], 128, (3, 1, 1), "spconv_down2", (2, 1, 1),
                                     0, "spconv")

    def forward(self, x):
        x = self.conv4(self.conv3(self.conv2(self.conv1(self.conv_input(x)))))
        return [self.conv_out(x)]


def voxel_backbone_8x(ns, cin):
    """SECOND's VoxelBackBone8x (OpenPCDet's layer list)."""
    return VoxelBackBone8x(ns, cin)


def voxel_res_backbone_8x(ns, cin):
    """CenterPoint's VoxelResBackBone8x (OpenPCDet's layer list)."""
    return VoxelBackBone8x(ns, cin, residual=True)


class UNetV2(_Backbone):
    """PartA2's UNetV2: VoxelBackBone8x's encoder, its 128-channel output, and a decoder to
    16 channels at the input sites."""

    def __init__(self, ns, cin):
        super().__init__()
        encoder = VoxelBackBone8x(ns, cin)
        for name in ("conv_input", "conv1", "conv2", "conv3", "conv4", "conv_out"):
            setattr(self, name, getattr(encoder, name))
        # level: lateral block, merge conv, the conv up a level
        self.conv_up_t4 = basic_block(ns, 64, 64, "subm4")
        self.conv_up_m4 = conv_bn_relu(ns, 128, 64, 3, "subm4", padding=1)
        self.inv_conv4 = conv_bn_relu(ns, 64, 64, 3, "spconv4", kind="inverse")
        self.conv_up_t3 = basic_block(ns, 64, 64, "subm3")
        self.conv_up_m3 = conv_bn_relu(ns, 128, 64, 3, "subm3", padding=1)
        self.inv_conv3 = conv_bn_relu(ns, 64, 32, 3, "spconv3", kind="inverse")
        self.conv_up_t2 = basic_block(ns, 32, 32, "subm2")
        self.conv_up_m2 = conv_bn_relu(ns, 64, 32, 3, "subm2", padding=1)
        self.inv_conv2 = conv_bn_relu(ns, 32, 16, 3, "spconv2", kind="inverse")
        self.conv_up_t1 = basic_block(ns, 16, 16, "subm1")
        self.conv_up_m1 = conv_bn_relu(ns, 32, 16, 3, "subm1", padding=1)
        self.conv5 = conv_bn_relu(ns, 16, 16, 3, "subm1", padding=1)

    @staticmethod
    def _up(lateral, bottom, block, merge, up):
        lateral = block(lateral)
        both = lateral.replace_feature(torch.cat([bottom.features, lateral.features], 1))
        merged = merge(both)
        rows, width = merged.features.shape
        pairs = both.features.view(rows, width, -1).sum(dim=2)  # channel pairs summed
        return up(merged.replace_feature(merged.features + pairs))

    def forward(self, x):
        x1 = self.conv1(self.conv_input(x))
        x2 = self.conv2(x1)
        x3 = self.conv3(x2)
        x4 = self.conv4(x3)
        encoded = self.conv_out(x4)
        up = self._up(x4, x4, self.conv_up_t4, self.conv_up_m4, self.inv_conv4)
        up = self._up(x3, up, self.conv_up_t3, self.conv_up_m3, self.inv_conv3)
        up = self._up(x2, up, self.conv_up_t2, self.conv_up_m2, self.inv_conv2)
        up = self._up(x1, up, self.conv_up_t1, self.conv_up_m1, self.conv5)
        return [encoded, up]


def unet_v2(ns, cin):
    """PartA2's UNetV2 (OpenPCDet's layer list)."""
    return UNetV2(ns, cin)


class MinkUNet(_Backbone):
    """A MinkUNet18-like segmentation U-Net (SemanticKITTI's MinkUNet widths)."""

    DOWN = (32, 64, 128, 256)
    UP = (256, 128, 96, 96)

    def __init__(self, ns, cin, classes=19, base=32):
        super().__init__()
        self.stem = ns.SparseSequential(conv_bn_relu(ns, cin, base, 3, "subm0", padding=1),
                                        conv_bn_relu(ns, base, base, 3, "subm0", padding=1))
        widths = [base]
        self.down = torch.nn.ModuleList()
        for i, width in enumerate(self.DOWN, 1):
            self.down.append(ns.SparseSequential(
                conv_bn_relu(ns, widths[-1], widths[-1], 2, f"down{i}", 2, 0, "spconv"),
                basic_block(ns, widths[-1], width, f"subm{i}", bias=False),
                basic_block(ns, width, width, f"subm{i}", bias=False)))
            widths.append(width)
        self.up, self.merge = torch.nn.ModuleList(), torch.nn.ModuleList()
        width = widths[-1]
        for i, out in zip(range(4, 0, -1), self.UP):
            self.up.append(conv_bn_relu(ns, width, out, 2, f"down{i}", kind="inverse"))
            skip = widths[i - 1]
            self.merge.append(ns.SparseSequential(
                basic_block(ns, out + skip, out, f"subm{i - 1}", bias=False),
                basic_block(ns, out, out, f"subm{i - 1}", bias=False)))
            width = out
        self.classifier = torch.nn.Linear(width, classes)

    def forward(self, x):
        levels = [self.stem(x)]
        for down in self.down:
            levels.append(down(levels[-1]))
        x = levels[-1]
        for up, merge, skip in zip(self.up, self.merge, levels[-2::-1]):
            x = up(x)
            x = merge(x.replace_feature(torch.cat([x.features, skip.features], 1)))
        return [x.replace_feature(self.classifier(x.features))]


def minkunet(ns, cin):
    """MinkUNet (MinkUNet18-like widths), SemanticKITTI's 19 classes."""
    return MinkUNet(ns, cin)


MODELS = {  # name: (builder, scales, published output: channels, xy stride)
    "VoxelBackBone8x": (voxel_backbone_8x, ("kitti", "waymo")),
    "VoxelResBackBone8x": (voxel_res_backbone_8x, ("kitti", "waymo")),
    "UNetV2": (unet_v2, ("kitti", "waymo")),
    "MinkUNet": (minkunet, ("semkitti",)),
}


# --- libraries, inputs, checks ------------------------------------------------------------

def libraries(device):
    """name -> spconv-like namespace: ours, and spconv where it imports."""
    found = {"ours": ours}
    try:
        import spconv.pytorch as spconv
        import spconv.pytorch.ops as spconv_ops
    except Exception as error:  # not installed, or built for another CUDA
        print(f"spconv: skipped ({type(error).__name__}: {error})", flush=True)
        return found
    if device == "cpu":  # spconv's CPU build: its backward asks for a CUDA stream, and its
        spconv_ops.get_current_stream = lambda: 0  # strided convs' rulebooks race on several
        torch.set_num_threads(1)  # OpenMP threads (outputs off by a few % from call to call)
    found["spconv"] = spconv
    return found


def crop(coords, features, shape, window):
    """The voxels of coords [V, 4] (batch first) inside window ((z0, z1), (y0, y1), (x0, x1)),
    moved to the window's origin, and the window's shape."""
    inside = numpy.ones(len(coords), bool)
    for axis, (low, high) in enumerate(window):
        inside &= (coords[:, 1 + axis] >= low) & (coords[:, 1 + axis] < high)
    lows = numpy.array([0] + [low for low, _ in window], numpy.int32)
    return coords[inside] - lows, features[inside], [high - low for low, high in window]


def inputs(scale, batch, device, cache, tiny=False):
    """(indices int32 [V, 4], features float32 [V, C], spatial shape) of `batch` frames."""
    coords, features = lidar_scenes.batch(scale, 100, batch, cache)
    shape = list(lidar_scenes.SCALES[scale].grid)
    if tiny:  # a crop of the scene for CPU checks (a few thousand voxels): 120 x 120 voxels
        s = lidar_scenes.SCALES[scale]  # in y and x next to the sensor, every z
        y, x = (round(-s.range[axis][0] / s.voxel[axis]) for axis in (1, 0))
        coords, features, shape = crop(coords, features, shape,
                                       ((0, shape[0]), (y - 60, y + 60), (x, x + 120)))
    return (torch.from_numpy(coords).to(device), torch.from_numpy(features).to(device), shape)


def randomise_bn(net, seed):
    """BatchNorm statistics and affine parameters away from their defaults (running means 0,
    variances 1 would hide a BN applied to the wrong channels)."""
    rng = numpy.random.default_rng(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                n = m.num_features
                for tensor, low, high in ((m.running_mean, -0.2, 0.2), (m.running_var, 0.5, 2),
                                          (m.weight, 0.8, 1.2), (m.bias, -0.1, 0.1)):
                    tensor.copy_(torch.tensor(rng.uniform(low, high, n)))


def evaluating(net, name, device):
    """net in eval mode; spconv's CPU build has no bias in eval mode, so there its convs keep
    training mode (the same arithmetic: a conv has no state that training changes)."""
    net.eval()
    if device == "cpu" and name == "spconv":
        for m in net.modules():
            if hasattr(m, "indice_key") and hasattr(m, "weight"):
                m.train()
    return net


def build(name, ns, model, cin, device, state=None, seed=0):
    torch.manual_seed(seed)
    net = MODELS[model][0](ns, cin).to(device)
    if state is None:
        randomise_bn(net, seed)
    else:
        net.load_state_dict(state, strict=True)
    return net


def tensor(ns, features, indices, shape, batch):
    return ns.SparseConvTensor(features, indices, shape, batch)


def outputs_by_site(outs):
    """[(keys, features)] of a model's outputs, rows sorted by site."""
    return [by_site(o.indices, o.features, o.spatial_shape) for o in outs]


def compare(got, want):
    """Worst relative L2 error over the outputs (sites matched by coordinates); raises where
    the sites differ."""
    worst = 0.0
    for (gk, gf), (wk, wf) in zip(got, want):
        if not torch.equal(gk, wk):
            raise AssertionError(f"output sites differ: {gk.shape[0]} against {wk.shape[0]}")
        worst = max(worst, rel_error(gf, wf))
    return worst


def loss_of(outs):
    return sum(o.features.float().square().mean() for o in outs)


def check(nets, libs, x, device):
    """Each library's eval outputs against ours, and its gradients after one training-mode
    backward (all parameters' gradients as one vector: a conv bias before a training-mode
    BatchNorm has a zero gradient, so its own relative error is noise), with TF32 off: in
    float32 on CUDA, in float64 on the CPU (spconv's CPU build takes float64; in float32 the
    training-mode BatchNorms of the small crops amplify rounding to ~1e-2 in the gradients).
    Returns (ours' float32 eval outputs, the errors by name)."""
    allow_tf32(False)
    indices, features, shape, batch = x
    exact = torch.float64 if device == "cpu" else torch.float32
    reference, grads, errors = None, None, {}
    for name, net in nets.items():
        ns = libs[name]
        f = features.to(exact)
        with torch.no_grad():
            got = outputs_by_site(evaluating(copy.deepcopy(net).to(exact), name, device)(
                tensor(ns, f, indices, shape, batch)))
        trained = copy.deepcopy(net).to(exact).train()
        loss_of(trained(tensor(ns, f, indices, shape, batch))).backward()
        g = torch.cat([p.grad.flatten() for _, p in sorted(trained.named_parameters())])
        if reference is None:
            reference, grads = got, g
            continue
        errors[f"{name}_check_out"] = compare(got, reference)
        errors[f"{name}_check_grad"] = rel_error(g, grads)
    if exact != torch.float32:
        with torch.no_grad():
            name = next(iter(nets))
            reference = outputs_by_site(evaluating(nets[name], name, device)(
                tensor(libs[name], features, indices, shape, batch)))
    return reference, errors


# --- timing and profiles ------------------------------------------------------------------

def cpu_ms(run, repeats, warmup=0):
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        run()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


OURS_RULEBOOK = ("clear_table", "insert_coords", "insert_keys", "insert_targets",
                 "compact_table", "decode_keys", "query_map", "query_subm", "mark_targets",
                 "rank_words", "emit_sites", "scatter_strided")
CLASSES = {  # library: [(class, pattern)], first match wins; the rest is "other"
    "ours": [("rulebook", re.compile("|".join(OURS_RULEBOOK))),
             ("conv", re.compile(r"submanifold_|split_sum|gemm|Gemm|nvjet|cutlass|xmma|gemv|"
                                 r"splitKreduce"))],
    "spconv": [("conv", re.compile(r"cumm::(conv|gemm)|ConvKernel|conv_kernel|gemm_kernel")),
               ("rulebook", re.compile(r"spinds|indice|Indice|hash|Hash|RadixSort|radix_sort|"
                                       r"Onesweep|SegmentedSort|unique|Unique|arange")),
               ("conv", re.compile(r"cumm|gemm|Gemm|GEMM|implicit|cutlass|nvjet|xmma"))],
}


def kernel_ms(run):
    """{kernel name: GPU ms} of one call of run() under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    by_name = {}
    for e in events:
        if e.get("cat") == "kernel" and e.get("ph") == "X":
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + e.get("dur", 0) / 1e3
    return by_name


def kernel_times(run, library):
    """GPU time (ms) by class of one call of run() under torch.profiler, and its ten largest
    kernels [(ms, class, name)]."""
    by_name = kernel_ms(run)
    totals = {"conv": 0.0, "rulebook": 0.0, "other": 0.0}
    named = []
    for name, ms in by_name.items():
        kind = next((k for k, pattern in CLASSES[library] if pattern.search(name)), "other")
        totals[kind] += ms
        named.append((ms, kind, name))
    return totals, sorted(named, reverse=True)[:10]


# --- modes --------------------------------------------------------------------------------

def prepare(net, name, ns, mode, x, device):
    """(the call to time, the call whose output to compare or None) of `net` in `mode`."""
    indices, features, shape, batch = x
    if mode.startswith("eval"):
        model = copy.deepcopy(net)
        f = features
        if mode.startswith("eval-fp16"):
            model, f = model.half(), features.half()
        evaluating(model, name, device)
        if mode.endswith(("-fused", "-graph")) and hasattr(ns, "fuse_bn_relu"):
            ns.fuse_bn_relu(model)
        if mode.endswith("-graph") and hasattr(ns, "SparseGraphs"):
            model = ns.SparseGraphs(model)

        def run():
            with torch.no_grad():
                return model(tensor(ns, f, indices, shape, batch))
        return run, run
    model = copy.deepcopy(net).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    amp = mode == "train-amp"
    scaler = torch.amp.GradScaler(device, enabled=amp)
    dtypes = []

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.float16, enabled=amp):
            outs = model(tensor(ns, features, indices, shape, batch))
        dtypes[:] = [outs[0].features.dtype]
        scaler.scale(loss_of(outs)).backward()
        scaler.step(optimizer)
        scaler.update()
    step.dtypes = dtypes
    return step, None


def _failed(row, name, case, error):
    """One library failing a mode: a row that says so."""
    message = f"{type(error).__name__}: {error}"[:300]
    row[f"{name}_error"] = message
    print(f"FAILED {name} {case}: {message}", flush=True)


def run_case(model, scale, batch, modes, libs, args, cache, kernels_log):
    """The rows of one model, scale and batch: the check, then every mode."""
    device = args.device
    cin = lidar_scenes.SCALES[scale].channels
    indices, features, shape = inputs(scale, batch, device, cache, tiny=args.device == "cpu")
    x = (indices, features, shape, batch)
    first = "spconv" if "spconv" in libs else "ours"
    nets = {first: build(first, libs[first], model, cin, device)}
    state = {k: v.clone() for k, v in nets[first].state_dict().items()}
    for name in libs:
        if name != first:
            nets[name] = build(name, libs[name], model, cin, device, state)
    nets = {name: nets[name] for name in libs}  # ours first
    reference, checks = check(nets, libs, x, device)
    base = dict(model=model, scale=scale, batch=batch, voxels=int(indices.shape[0]), **checks)
    failed = [k for k, v in checks.items()
              if not v < CHECK_TOLERANCE[device][k.rsplit("_", 1)[1]]]
    if failed:
        print(f"CHECK FAILED {model} {scale} b{batch}: "
              + ", ".join(f"{k} {checks[k]:.2e}" for k in failed), flush=True)
        base["check"] = "FAILED: " + ", ".join(failed)
    rows = []
    for mode in modes:
        if device == "cpu" and mode not in ("eval-tf32", "eval-tf32-fused", "train-tf32"):
            continue
        allow_tf32(True)
        row, case = dict(base, mode=mode), f"{model} {scale} b{batch} {mode}"
        runs = {}
        for name, net in nets.items():
            try:
                run, output = prepare(net, name, libs[name], mode, x, device)
                if output is not None:
                    outs = output()
                    row[f"{name}_err"] = compare(outputs_by_site(outs), reference)
                    row[f"{name}_dtype"] = str(outs[0].features.dtype).replace("torch.", "")
                    del outs
                runs[name] = run
                del run, output  # the model and its graphs go with runs, below
            except Exception as error:
                _failed(row, name, case, error)
        # The libraries' calls in turns, so that a slower or faster spell of the host (which
        # eager calls are bound by) falls on both: the median of each library's round medians.
        medians = {name: [] for name in runs}
        for turn in range(args.rounds):
            for name in list(runs):
                try:
                    medians[name].append(
                        cpu_ms(runs[name], args.repeats) if device == "cpu" else
                        events_ms(runs[name], args.repeats,
                                  warmup=args.warmup if turn == 0 else 1))
                except Exception as error:
                    _failed(row, name, case, error)
                    del runs[name]
        for name in runs:
            row[f"{name}_ms"] = statistics.median(medians[name])
            if getattr(runs[name], "dtypes", None):
                row[f"{name}_dtype"] = str(runs[name].dtypes[0]).replace("torch.", "")
            if args.profile and device != "cpu":
                try:
                    totals, top = kernel_times(runs[name], name)
                except Exception as error:
                    _failed(row, name, case, error)
                    continue
                row[f"{name}_conv_ms"] = totals["conv"]
                row[f"{name}_rulebook_ms"] = totals["rulebook"]
                row[f"{name}_gpu_ms"] = sum(totals.values())
                kernels_log.append((f"{case} {name}", top))
        del runs
        if device == "cuda":
            torch.cuda.empty_cache()
        if "ours_ms" in row and "spconv_ms" in row:
            row["speedup"] = row["spconv_ms"] / row["ours_ms"]
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    return rows


# --- report -------------------------------------------------------------------------------

COLUMNS = [("model", "model", None), ("scale", "scale", None), ("batch", "batch", None),
           ("voxels", "voxels", None), ("mode", "mode", None), ("ours ms", "ours_ms", "{:.2f}"),
           ("spconv ms", "spconv_ms", "{:.2f}"), ("speed-up", "speedup", "{:.2f}x"),
           ("ours conv", "ours_conv_ms", "{:.2f}"), ("spconv conv", "spconv_conv_ms", "{:.2f}"),
           ("ours rulebook", "ours_rulebook_ms", "{:.2f}"),
           ("spconv rulebook", "spconv_rulebook_ms", "{:.2f}"),
           ("ours GPU", "ours_gpu_ms", "{:.2f}"), ("spconv GPU", "spconv_gpu_ms", "{:.2f}"),
           ("ours err", "ours_err", "{:.1e}"), ("spconv err", "spconv_err", "{:.1e}"),
           ("dtype ours/spconv", None, None), ("check out/grad", None, None),
           ("note", None, None)]


def table(rows, device, notes, kernels_log):
    lines = [f"# Detector backbones: ours against spconv 2.3.8, {device}, torch "
             f"{torch.__version__}", "", *notes, "",
             "ms: CUDA events around a call (eval: forward with its rulebooks; train: one step), "
             "the median of a round's calls, then of the rounds (the libraries in turns). "
             "speed-up: spconv ms / ours ms. conv / rulebook / GPU: ms of GPU kernel "
             "time in one profiled call (convolution kernels, rulebook kernels, all kernels). "
             "err: relative L2 error of the mode's output against the float32 (TF32 off) "
             "reference. check: ours against spconv in float32, TF32 off: outputs / gradients "
             "(relative L2).", "",
             "| " + " | ".join(c for c, _, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for _, key, fmt in COLUMNS[:-3]:
            v = r.get(key, "")
            cells.append(fmt.format(v) if fmt and isinstance(v, (int, float)) else str(v))
        cells.append(f"{r.get('ours_dtype', '')}/{r.get('spconv_dtype', '')}")
        out, grad = r.get("spconv_check_out"), r.get("spconv_check_grad")
        cells.append("" if out is None else f"{out:.1e}/{grad:.1e}")
        note = "; ".join(str(r[k]) for k in ("check", "ours_error", "spconv_error") if k in r)
        cells.append(note.replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    if kernels_log:
        lines += ["", "## Largest kernels of each profiled call (ms, class, name)", ""]
        for case, top in kernels_log:
            lines.append(f"- {case}: " + "; ".join(
                f"{ms:.2f} {kind} `{name[:90].replace('|', '/')}`" for ms, kind, name in top[:6]))
    return "\n".join(lines) + "\n"


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r["mode"] == m and "speedup" in r for r in rows)]
    if not modes:
        return False
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        chosen = [r for r in rows if r["mode"] == mode and "speedup" in r]
        labels = [f"{r['model']}\n{r['scale']} b{r['batch']}" for r in chosen]
        ax.bar(range(len(chosen)), [r["speedup"] for r in chosen],
               color=[f"C{list(MODELS).index(r['model'])}" for r in chosen])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(chosen)))
        ax.set_xticklabels(labels, fontsize=7, rotation=90)
        ax.set_ylabel("speed-up over spconv 2.3.8 (x)")
        ax.set_title(mode)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="each model at its smallest scale, batch 1, 3 repeats")
    parser.add_argument("--all", action="store_true", help="no time budget")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int,
                        help="rounds of --repeats calls, the libraries in turns (default 3; "
                             "1 with --quick and on the CPU)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--scales", nargs="+", choices=list(lidar_scenes.SCALES))
    parser.add_argument("--batches", nargs="+", type=int)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--profile", action="store_true",
                        help="kernel times by class from one profiled call a library and mode")
    parser.add_argument("--budget", type=float, default=420,
                        help="seconds after which no new case starts (default 420)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--suffix", help="file names detectors_<suffix>_<device>.* (runs split "
                                         "over several calls keep their own files)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        require_gpu("bench.detectors")
    args.repeats = args.repeats or (1 if args.device == "cpu" else 3 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.device == "cpu" or args.quick else 3)
    if args.device == "cpu":  # one thread: spconv's CPU build needs it (see libraries), and
        args.quick, args.warmup = True, 0  # our NumPy backend's BLAS beside torch's OpenMP
        torch.set_num_threads(1)  # pool, both spinning, is 10-100x slower on a few cores
    batches = args.batches or ([1] if args.quick else [1, 2, 4])
    torch.backends.cudnn.benchmark = True
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    name = "_".join(["detectors"] + (["quick"] if args.quick else [])
                    + ([args.suffix] if args.suffix else []))
    stem = results_stem(args.out, name, device)
    started = time.time()
    libs = libraries(args.device)
    notes = [f"Libraries: {', '.join(libs)}" + ("" if "spconv" in libs else
                                                 " (spconv not installed: ours alone)"),
             "Models written from the published layer lists (bench/detectors.py); inputs: "
             "bench.lidar_scenes, voxels shuffled. eval-fp16: model.half(); train-amp: "
             "autocast(float16) + GradScaler; train steps: forward, mean-square loss, backward, "
             "SGD step.",
             f"Timing: {args.rounds} round(s) of {args.repeats} call(s) a library and mode."]
    if args.device == "cpu":
        notes.append("CPU smoke run: crops of the scenes (every z, 120 x 120 voxels in y, x next "
                     "to the sensor); the check in float64, the modes in float32 (spconv's CPU "
                     "build, one thread), one call timed with the host clock.")
    cases = []
    for batch in batches:
        for model in args.models:
            scales = [s for s in MODELS[model][1] if args.scales is None or s in args.scales]
            for scale in scales[:1] if args.quick else scales:
                cases.append((model, scale, batch))
    rows, kernels_log, cache, skipped = [], [], {}, []

    def save():
        write_csv(rows, f"{stem}.csv")
        text = table(rows, device, notes + ([f"Left out by the {args.budget:.0f} s budget: "
                                             + ", ".join(skipped)] if skipped else []),
                     kernels_log)
        pathlib.Path(f"{stem}.md").write_text(text)

    for model, scale, batch in cases:
        if not args.all and time.time() - started > args.budget:
            skipped.append(f"{model} {scale} b{batch}")
            continue
        print(f"[{time.time() - started:5.0f}s] {model} {scale} batch {batch}", flush=True)
        try:
            rows += run_case(model, scale, batch, args.modes, libs, args, cache, kernels_log)
        except Exception as error:
            message = f"{type(error).__name__}: {error}"[:300]
            print(f"FAILED {model} {scale} b{batch}: {message}", flush=True)
            rows.append(dict(model=model, scale=scale, batch=batch, mode="-",
                             check=f"FAILED: {message}"))
        save()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if skipped:
        print("left out by the budget: " + ", ".join(skipped), flush=True)
    if not plot(rows, f"{stem}.png"):
        notes.append("No plot (matplotlib not installed, or no speed-ups to plot).")
    save()
    print(f"[{time.time() - started:5.0f}s] wrote {stem}.csv/.md",
          flush=True)
    return 1 if any("FAILED" in str(r.get("check", "")) or "ours_error" in r
                    for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
