"""The headline rows of every family, ours only, for an A/B between two trees: run it with each
tree's root on PYTHONPATH (from that root), the trees in turns, and compare medians over the
rounds. Public API only, so one copy of this script times any tree. Prints one line a row:
``ROW name value`` (ms: CUDA events around a call, median; host-us: host time of one call).

Rows: the detectors (GPU-bound fp16 eval, the same after fuse_bn_relu and through SparseGraphs
where the tree has them, TF32 training step), SBNet's T2 unit and T1 conv at conv-2 (fp16, in
place), a pruned-kernel conv, a dilated conv (reshape route), and the host time of small calls
(gather, scatter, reduce_mask, a cached SubMConv3d).

    python -m bench.headline
"""

import copy
import statistics
import time

import numpy
import torch

import torch_bridge as tb
import torch_bridge.submanifold as ours
from bench import detectors, masks
from bench._common import allow_tf32, events_ms


def row(name, value):
    print(f"ROW {name} {value:.4f}", flush=True)


def detector_rows(cache):
    for model, scale, batch in (("VoxelResBackBone8x", "waymo", 2), ("MinkUNet", "semkitti", 1),
                                ("VoxelBackBone8x", "kitti", 1)):
        detector(model, scale, batch, cache)
        torch.cuda.empty_cache()  # the model's memory, freed at the return


def detector(model, scale, batch, cache):
    indices, features, shape = detectors.inputs(scale, batch, "cuda", cache)
    net = detectors.MODELS[model][0](ours, features.shape[1]).cuda()
    allow_tf32(True)
    half, features_half = copy.deepcopy(net).half().eval(), features.half()

    def evaluate(mode, fn):
        def call():
            with torch.no_grad():
                fn(ours.SparseConvTensor(features_half, indices, shape, batch))

        row(f"{model}-{scale}-b{batch} {mode}", events_ms(call, 9))

    evaluate("eval-fp16", half)
    if hasattr(ours, "fuse_bn_relu"):  # trees from 59a2f7f on
        fused = ours.fuse_bn_relu(copy.deepcopy(half))
        evaluate("eval-fp16-fused", fused)
        if hasattr(ours, "SparseGraphs"):
            evaluate("eval-fp16-graph", ours.SparseGraphs(fused))
        del fused
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)

    def train():
        outs = net(ours.SparseConvTensor(features, indices, shape, batch))
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        sum((o.features.float() ** 2).mean() for o in outs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    row(f"{model}-{scale}-b{batch} train-tf32", events_ms(train, 7))


def sbnet_rows(rng):
    """T2 unit and T1 conv at conv-2 (400x704, 96 channels, bottleneck 24), fp16, a road mask
    90% sparse."""
    for test in ("T2", "T1"):
        if test == "T2":
            module, channels = tb.SparseResBlockBottleneck(96, 24, bsize_out=16), 96
            module.fold_batchnorm()
        else:
            module, channels = tb.SparseConv2d(24, 24, bsize_out=16, bias=False), 24
        module = module.cuda().half().eval()
        mask = torch.tensor(masks.road(rng, 1, 400, 704, 0.9), device="cuda")
        x = torch.randn(1, 400, 704, channels, device="cuda", dtype=torch.half)
        base = x.clone()
        capacity = tb.capacity_bucket(int(module.reduce_mask(mask).bin_counts[0]))

        def run():
            with torch.no_grad():
                found = module.reduce_mask(mask, capacity=capacity)
                if test == "T2":
                    module(x, found, inplace=True)
                else:
                    module(x, found, base=base, inplace=True)

        row(f"{test}-conv2-fp16 eager", events_ms(run, 30))


def pruned_and_dilated_rows():
    weight = torch.randn(64, 64, 3, 3, device="cuda")
    weight[torch.rand_like(weight) < 0.8] = 0  # 80% pruned
    pruned = tb.SparseKernelConv2d(weight, padding=1).cuda().half()
    x = torch.randn(8, 64, 56, 56, device="cuda", dtype=torch.half)
    x = x.to(memory_format=torch.channels_last)

    def conv():
        with torch.no_grad():
            pruned(x)

    row("pruned-3x3-64-56x56-b8-fp16", events_ms(conv, 30))
    w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.half)
    xd = torch.randn(4, 64, 128, 128, device="cuda", dtype=torch.half)

    def dilated():
        with torch.no_grad():
            tb.dilated_conv2d(xd, w, dilation=4, padding=4, method="reshape")

    row("dilated-reshape-d4-64-128-b4-fp16", events_ms(dilated, 30))


def host_us(call, n=2000):
    """Host time of one call (us): the median of five loops of n calls."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            call()
        times.append((time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def host_rows():
    x = torch.randn(1, 64, 64, 16, device="cuda")
    mask = torch.rand(1, 64, 64, device="cuda") > 0.7
    found = tb.reduce_mask(mask, (8, 8), bsize=(8, 8), capacity=64)
    counts, active = found.bin_counts, found.active_block_indices
    sites = torch.unique(torch.randint(0, 32, (1000, 3), device="cuda"), dim=0).int()
    indices = torch.cat([torch.zeros(len(sites), 1, dtype=torch.int32, device="cuda"), sites], 1)
    tensor = ours.SparseConvTensor(torch.randn(len(sites), 16, device="cuda"), indices,
                                   [32, 32, 32], 1)
    conv = ours.SubMConv3d(16, 16, 3, indice_key="a").cuda()
    with torch.no_grad():
        row("host-us gather", host_us(lambda: tb.sparse_gather(x, counts, active, bsize=(8, 8))))
        blocks = tb.sparse_gather(x, counts, active, bsize=(8, 8))
        row("host-us scatter",
            host_us(lambda: tb.sparse_scatter(blocks, counts, active, x, bsize=(8, 8))))
        row("host-us reduce_mask",
            host_us(lambda: tb.reduce_mask(mask, (8, 8), bsize=(8, 8), capacity=64)))
        out = conv(tensor)
        row("host-us SubMConv3d-cached", host_us(lambda: conv(out), 500))


def main():
    torch.manual_seed(0)
    detector_rows({})
    sbnet_rows(numpy.random.default_rng(0))
    pruned_and_dilated_rows()
    host_rows()


if __name__ == "__main__":
    main()
