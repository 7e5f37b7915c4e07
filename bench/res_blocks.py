"""Sparse residual units and 3x3 convolutions against the same units run densely (SBNet's
T1/T2 benchmark) on the paper's stage sizes, and against submanifold sparse convolution.

    python -m bench.res_blocks [--suite topleft blocksize batch fp32 road spconv modes fused
                                fused-capacity fused-dense dependent floor]
                               [--out DIR]

The `modes` suite runs one unit and a stage of 3 units sharing one reduce_mask
(torch_bridge.SparseResStage) the ways a PyTorch user can: eagerly, torch.compile in the default
mode and in mode="reduce-overhead", and CapacityGraphs; with the compile times. Eager runs are
timed first, before anything is compiled. It writes <out>/res_blocks_modes_<device>.csv and .md.

The `floor` suite times where a graph's time goes, T1 and T2 at 90% (top-left mask, the
stage's best block size): reduce_mask, the block convolutions, both, and cuDNN's dense side, each
as a graph of its own (what the other suites time) and per call in a graph of 20 calls back to
back (the kernels' own time plus the gaps between them), beside a one-element add, the floor of
any graph. It writes <out>/res_blocks_floor_<device>.csv.

Dense baseline: the same module run densely with cuDNN, channels_last, cudnn.benchmark, BN
folded into the convolutions, measured in the same run. Sparse: reduce_mask (inside the timed
region) -> one gather -> the unit on the blocks -> one scatter-add in place, with a capacity
bucket (no host sync). Both sides are timed eagerly and as CUDA graphs: CUDA events around each
call, median of --repeats after warm-up. Writes <out>/res_blocks_<device>.csv and a PNG plot.

The modules run method="auto" (the fused block-convolution kernels in inference where they
apply) except in the `fused` suite, which runs each row with method="gemm" (gather, cuDNN,
scatter) and method="fused" side by side: T2 and T1 at 90% on the top-left mask, the road-like
mask, a capacity of exactly the count against twice it and every block active (these two also
alone, as the `fused-capacity` and `fused-dense` suites; blocks of 8 and 16). The `dependent`
suite runs T2 and T1 at 90% (top-left mask, each stage's best block size) with the block
convolutions launched as programmatic dependents (suite "dependent") and plainly (suite
"dependent-off", sbnet_cupy.core.launch.DEPENDENT_LAUNCH off), side by side.
"""

import argparse
import itertools
import pathlib
import sys
import time

import numpy
import torch

import torch_bridge as tb
from bench import masks
from bench._common import (RESULTS, allow_tf32, events_ms, graph, read_csv, require_gpu,
                           results_stem, write_csv)
from sbnet_cupy.core import launch as _launch
from sbnet_cupy.blocks import block_conv

# stage: (H, W, C, bottleneck K). T1 convolves K channels at H x W, T2 is the C/K unit.
STAGES = {"conv-2": (400, 704, 96, 24), "conv-3": (200, 352, 192, 48),
          "conv-4": (100, 176, 256, 64), "conv-5": (50, 88, 384, 96)}
PRECISIONS = {"tf32": (torch.float32, True), "fp32": (torch.float32, False),
              "fp16": (torch.float16, False)}
TOLERANCE = {"tf32": 5e-3, "fp32": 1e-5, "fp16": 1e-2}  # relative L2 error, sparse vs dense


def suites(names):
    """(suite, test, stage, batch, precision, mask, sparsity, bsize, method, capacity) rows to
    run; capacity None is capacity_bucket(count), a number is that multiple of the count."""
    rows = [row + ("auto", None) for row in _auto_suites(names)]
    both = ("gemm", "fused")
    if "fused" in names:
        rows += [("fused", t, s, 1, p, "topleft", 0.9, b, m, None)
                 for t, s, p, b, m in itertools.product(("T2", "T1"), STAGES, ("tf32", "fp16"),
                                                        (8, 16), both)]
        rows += [("fused-road", "T2", s, 1, p, "road", 0.9, 16, m, None)
                 for s, p, m in itertools.product(STAGES, ("tf32", "fp16"), both)]
    if "fused" in names or "fused-capacity" in names:  # capacity 1x / 2x the count
        rows += [("fused-capacity", "T2", s, 1, p, "topleft", 0.9, b, "fused", c)
                 for s, p, b, c in itertools.product(STAGES, ("tf32", "fp16"), (8, 16), (1, 2))]
    if "fused" in names or "fused-dense" in names:  # every block active, best of blocks 8, 16
        rows += [("fused-dense", "T2", s, 1, p, "topleft", 0.0, b, m, None)
                 for s, p, b, m in itertools.product(STAGES, ("tf32", "fp16"), (8, 16), both)]
    if "staging" in names:  # block_conv's two stagings forced, each stage's best block size
        rows += [(st, t, s, 1, p, m, sp, BEST_BLOCK[p][s], "fused", None)
                 for t, s, p, (m, sp), st in itertools.product(
                     ("T2", "T1"), STAGES, ("tf32", "fp16"), (("topleft", 0.9), ("topleft", 0.0)),
                     ("staging-streamed", "staging-halo"))]
    if "dependent" in names:
        rows += [(d, t, s, 1, p, "topleft", 0.9, BEST_BLOCK[p][s], "fused", None)
                 for t, s, p, d in itertools.product(("T2", "T1"), STAGES, ("tf32", "fp16"),
                                                     ("dependent", "dependent-off"))]
    return rows


def _auto_suites(names):
    rows = []
    if "topleft" in names:
        rows += [("topleft", t, s, 1, p, "topleft", sp, 16)
                 for t, s, p, sp in itertools.product(("T2", "T1"), STAGES, ("tf32", "fp16"),
                                                      (0.5, 0.7, 0.9, 0.95, 0.99))]
    if "blocksize" in names:
        rows += [("blocksize", t, s, 1, p, "topleft", sp, b)
                 for t, s, p, sp, b in itertools.product(("T2", "T1"), STAGES, ("tf32", "fp16"),
                                                         (0.5, 0.9), (8, 32))]
    if "batch" in names:
        rows += [("batch", "T2", s, 8, p, "topleft", 0.9, 16)
                 for s, p in itertools.product(STAGES, ("tf32", "fp16"))]
    if "fp32" in names:
        rows += [("fp32", t, s, 1, "fp32", "topleft", 0.9, 16)
                 for t, s in itertools.product(("T2", "T1"), STAGES)]
    if "road" in names:
        rows += [("road", "T2", s, 1, p, "road", sp, 16)
                 for s, p, sp in itertools.product(STAGES, ("tf32", "fp16"), (0.7, 0.8, 0.9))]
    if "spconv" in names:
        rows += [("spconv", "T2", s, 1, "tf32", m, 0.9, 16)
                 for s, m in itertools.product(STAGES, ("topleft", "road"))]
    return rows


def _randomise(module, rng):
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.tensor(rng.uniform(-0.5, 0.5, m.num_features)))
            m.running_var.copy_(torch.tensor(rng.uniform(0.5, 2, m.num_features)))
            m.weight.data.copy_(torch.tensor(rng.uniform(0.5, 1.5, m.num_features)))
            m.bias.data.copy_(torch.tensor(rng.uniform(-0.5, 0.5, m.num_features)))


def _covered(found, shape, bsize):
    covered = torch.zeros(shape, dtype=torch.bool, device="cuda")
    for n, hi, wi in found.active_block_indices.tolist():
        covered[n, hi * bsize:(hi + 1) * bsize, wi * bsize:(wi + 1) * bsize] = True
    return covered


def run_blocks(test, stage, batch, precision, mask_kind, sparsity, bsize, repeats, rng,
               method="auto", capacity_factor=None):
    height, width, channels, bottleneck = STAGES[stage]
    dtype, tf32 = PRECISIONS[precision]
    allow_tf32(tf32)
    if test == "T2":
        module = tb.SparseResBlockBottleneck(channels, bottleneck, bsize_out=bsize, method=method)
        _randomise(module, rng)
        module.fold_batchnorm()
    else:
        channels = bottleneck
        module = tb.SparseConv2d(channels, channels, bsize_out=bsize, bias=False, method=method)
    module = module.cuda().to(dtype).eval()
    mask_np = (masks.top_left(batch, height, width, sparsity) if mask_kind == "topleft"
               else masks.road(rng, batch, height, width, sparsity))
    mask = torch.tensor(mask_np, device="cuda")
    x0 = torch.randn(batch, height, width, channels, device="cuda", dtype=dtype)
    x, y = x0.clone(), x0.clone()
    found = module.reduce_mask(mask)
    active = int(found.bin_counts[0])
    capacity = (tb.capacity_bucket(active) if capacity_factor is None
                else max(1, capacity_factor * active))
    params = module.block_params(height, width)
    blocks_total = batch * params.bcount[0] * params.bcount[1]

    def sparse():
        found = module.reduce_mask(mask, capacity=capacity)
        if test == "T2":
            module(x, found, inplace=True)
        else:
            module(x, found, base=y, inplace=True)

    def dense():
        return module.dense(x)

    def reset():
        x.copy_(x0)

    with torch.no_grad():
        # Correct first: the sparse result equals the dense one on the active blocks.
        reset()
        want = dense()
        sparse()
        got = x if test == "T2" else y
        covered = _covered(found, (batch, height, width), bsize)
        error = ((got - want)[covered].float().norm() / want[covered].float().norm()).item()
        if not error < TOLERANCE[precision]:
            raise AssertionError(f"sparse differs from dense: relative error {error:.2e}")
        row = dict(test=test, stage=stage, H=height, W=width, C=channels, K=bottleneck,
                   batch=batch, precision=precision, mask=mask_kind, sparsity=sparsity,
                   pixel_density=round(float(mask_np.mean()), 4), bsize=bsize,
                   method=method, fused=module.fused(x),
                   capacity_factor="" if capacity_factor is None else capacity_factor,
                   active_blocks=active, blocks=blocks_total, capacity=capacity,
                   rel_error=f"{error:.1e}")
        row["dense_eager_ms"] = events_ms(dense, repeats, reset)
        row["sparse_eager_ms"] = events_ms(sparse, repeats, reset)
        dense_graph, sparse_graph = graph(dense), graph(sparse)
        row["dense_graph_ms"] = events_ms(dense_graph.replay, repeats, reset)
        row["sparse_graph_ms"] = events_ms(sparse_graph.replay, repeats, reset)
        del dense_graph, sparse_graph
    row["speedup_eager"] = row["dense_eager_ms"] / row["sparse_eager_ms"]
    row["speedup_graph"] = row["dense_graph_ms"] / row["sparse_graph_ms"]
    row["theoretical"] = 1 / max(row["pixel_density"], 1e-9)
    row["theoretical_blocks"] = blocks_total / max(active, 1)
    return row


class _SubmanifoldBottleneck(torch.nn.Module):
    """The same unit with submanifold convolutions on the active pixels (spconv-triton): 1x1
    convolutions are per-pixel linear maps, the 3x3 a SubMConv2d; BN folded."""

    def __init__(self, spconv, channels, bottleneck):
        super().__init__()
        self.bn1 = torch.nn.BatchNorm1d(channels)
        self.linear1 = torch.nn.Linear(channels, bottleneck)
        self.conv2 = spconv.SubMConv2d(bottleneck, bottleneck, 3, indice_key="subm")
        self.linear3 = torch.nn.Linear(bottleneck, channels)

    def forward(self, spconv, features, indices, shape, batch):
        z = torch.relu(self.linear1(torch.relu(self.bn1(features))))
        z = self.conv2(spconv.SparseConvTensor(z, indices, shape, batch)).features
        return features + self.linear3(torch.relu(z))


def run_spconv(stage, precision, mask_kind, sparsity, repeats, rng):
    import spconv_triton.pytorch as spconv

    height, width, channels, bottleneck = STAGES[stage]
    dtype, tf32 = PRECISIONS[precision]
    allow_tf32(tf32)
    unit = _SubmanifoldBottleneck(spconv, channels, bottleneck).cuda().to(dtype).eval()
    mask_np = (masks.top_left(1, height, width, sparsity) if mask_kind == "topleft"
               else masks.road(rng, 1, height, width, sparsity))
    mask = torch.tensor(mask_np, device="cuda") > 0.5
    x = torch.randn(1, height, width, channels, device="cuda", dtype=dtype)

    def submanifold():  # dense in, dense out, as the SBNet path: the site list is built per call
        indices = mask.nonzero().int()
        features = x[indices[:, 0], indices[:, 1], indices[:, 2]]
        out = unit(spconv, features, indices, [height, width], 1)
        x[indices[:, 0], indices[:, 1], indices[:, 2]] = out

    with torch.no_grad():
        ms = events_ms(submanifold, repeats, lambda: None)
    return dict(spconv_eager_ms=ms, active_sites=int(mask.sum()))


# The best block size of each stage at 90% (the blocksize suite, H100): bsize_out by precision.
BEST_BLOCK = {"tf32": {"conv-2": 16, "conv-3": 8, "conv-4": 8, "conv-5": 8},
              "fp16": {"conv-2": 16, "conv-3": 16, "conv-4": 8, "conv-5": 8}}


def _compiled(fn, mode, *args):
    """torch.compile(fn) and its compile time (the first call, with reduce-overhead's graph
    recording on the calls after it)."""
    torch._dynamo.reset()  # each row compiles afresh: no cache limit, no stale guards
    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    torch.cuda.synchronize()
    start = time.perf_counter()
    compiled(*args)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for _ in range(3):
        compiled(*args)
    return compiled, seconds


def run_modes(stage, precision, units, repeats, rng):
    """T2 at 90% (top-left mask), batch 1, the stage's best block size: `units` units sharing
    one reduce_mask, dense and sparse, eager / compiled (default, reduce-overhead) /
    CapacityGraphs. Eager runs are timed before anything is compiled."""
    height, width, channels, bottleneck = STAGES[stage]
    dtype, tf32 = PRECISIONS[precision]
    allow_tf32(tf32)
    bsize = BEST_BLOCK[precision][stage]
    model = tb.SparseResStage(channels, bottleneck, units, bsize_out=bsize)
    _randomise(model, rng)
    model = model.fold_batchnorm().cuda().to(dtype).eval()
    mask = torch.tensor(masks.top_left(1, height, width, 0.9), device="cuda")
    x = torch.randn(1, height, width, channels, device="cuda", dtype=dtype)
    active = int(model.units[0].reduce_mask(mask).bin_counts[0])
    capacity = tb.capacity_bucket(active)

    def sparse(x, mask):
        return model(x, mask, capacity=capacity)

    row = dict(stage=stage, precision=precision, units=units, bsize=bsize, active_blocks=active,
               capacity=capacity)
    covered = _covered(model.units[0].reduce_mask(mask), (1, height, width), bsize)

    def timed(name, run, want):
        got = run()  # correct first: every mode equals dense on the blocks
        error = ((got - want)[covered].float().norm() / want[covered].float().norm()).item()
        if not error < TOLERANCE[precision] * units:
            raise AssertionError(f"{name} differs from dense: relative error {error:.2e}")
        row[f"{name}_ms"] = events_ms(run, repeats, lambda: None)

    with torch.no_grad():
        want = model.dense(x)
        timed("dense_eager", lambda: model.dense(x), want)
        timed("sparse_eager", lambda: sparse(x, mask), want)
        row["dense_graph_ms"] = events_ms(graph(lambda: model.dense(x)).replay, repeats)
        graphs = tb.CapacityGraphs(lambda capacity: model(x, mask, capacity=capacity))
        timed("sparse_capacity_graphs", lambda: graphs(active), want)
        # x and mask are the same buffers at every call, as CapacityGraphs has them: tell
        # reduce-overhead's CUDA graphs so, or they copy them in before every replay.
        torch._dynamo.mark_static_address(x)
        torch._dynamo.mark_static_address(mask)
        for name, mode in (("sparse_compiled", None), ("sparse_reduce_overhead",
                                                       "reduce-overhead")):
            compiled, row[f"{name}_compile_s"] = _compiled(sparse, mode, x, mask)
            timed(name, lambda: compiled(x, mask), want)
    row["eager_speedup"] = row["dense_eager_ms"] / row["sparse_eager_ms"]
    row["reduce_overhead_vs_capacity_graphs"] = (row["sparse_reduce_overhead_ms"]
                                                 / row["sparse_capacity_graphs_ms"])
    row["compiled_vs_eager"] = row["sparse_compiled_ms"] / row["sparse_eager_ms"]
    return row


def run_floor(test, stage, precision, repeats, rng):
    """T1 or T2 at 90% (top-left mask), batch 1, the stage's best block size: reduce_mask, the
    convolutions on its blocks, both, and dense, each timed as a graph of its own (graph_us)
    and per call in a graph of 20 calls (chain_us). test "add": a one-element add instead."""
    def times(run, calls):
        def many():
            for _ in range(calls):
                run()
        return events_ms(graph(many).replay, repeats) * 1000 / calls

    if test == "add":
        one = torch.zeros(1, device="cuda")
        return dict(test="add", add_graph_us=times(lambda: one.add_(1), 1),
                    add_chain_us=times(lambda: one.add_(1), 20))
    height, width, channels, bottleneck = STAGES[stage]
    dtype, tf32 = PRECISIONS[precision]
    allow_tf32(tf32)
    bsize = BEST_BLOCK[precision][stage]
    if test == "T2":
        module = tb.SparseResBlockBottleneck(channels, bottleneck, bsize_out=bsize)
        _randomise(module, rng)
        module.fold_batchnorm()
    else:
        channels = bottleneck
        module = tb.SparseConv2d(channels, channels, bsize_out=bsize, bias=False)
    module = module.cuda().to(dtype).eval()
    mask = torch.tensor(masks.top_left(1, height, width, 0.9), device="cuda")
    x = torch.randn(1, height, width, channels, device="cuda", dtype=dtype)
    y = x.clone()
    row = dict(test=test, stage=stage, precision=precision, bsize=bsize)
    with torch.no_grad():
        active = int(module.reduce_mask(mask).bin_counts[0])
        capacity = tb.capacity_bucket(active)
        found = module.reduce_mask(mask, capacity=capacity)
        row.update(active_blocks=active, capacity=capacity)

        def convolve():
            if test == "T2":
                module(x, found, inplace=True)
            else:
                module(x, found, base=y, inplace=True)

        def reduce():
            module.reduce_mask(mask, capacity=capacity)

        for name, run in (("reduce_mask", reduce), ("conv", convolve),
                          ("whole", lambda: (reduce(), convolve())),
                          ("dense", lambda: module.dense(x))):
            row[f"{name}_graph_us"] = times(run, 1)
            row[f"{name}_chain_us"] = times(run, 20)
    return row


def _modes_table(rows, device):
    lines = [f"# T2 units at 90% (top-left mask), batch 1, by how they run: {device}, "
             f"torch {torch.__version__}", "",
             "ms per call (CUDA events around each call, so host time counts), reduce_mask "
             "included; dense eager / graphed beside.", "",
             "| stage | precision | units | block | dense eager | dense graphed | sparse eager "
             "| compiled | reduce-overhead | CapacityGraphs | eager speed-up | compiled / eager "
             "| reduce-overhead / CapacityGraphs | compile s (default / reduce-overhead) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {r['precision']} | {r['units']} | {r['bsize']} | "
            f"{r['dense_eager_ms']:.3f} | {r['dense_graph_ms']:.3f} | {r['sparse_eager_ms']:.3f}"
            f" | {r['sparse_compiled_ms']:.3f} | {r['sparse_reduce_overhead_ms']:.3f} | "
            f"{r['sparse_capacity_graphs_ms']:.3f} | {r['eager_speedup']:.2f}x | "
            f"{r['compiled_vs_eager']:.2f} | {r['reduce_overhead_vs_capacity_graphs']:.2f} | "
            f"{r['sparse_compiled_compile_s']:.0f} / {r['sparse_reduce_overhead_compile_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    """Speed-up over dense against sparsity: a row of panels per suite, one panel per stage,
    one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites_run = list(dict.fromkeys(r["suite"] for r in rows))
    fig, grid = plt.subplots(len(suites_run), len(STAGES), squeeze=False, sharey=True,
                             figsize=(4.5 * len(STAGES), 4 * len(suites_run)))
    for axes, suite in zip(grid, suites_run):
        _plot_suite(axes, [r for r in rows if r["suite"] == suite], suite)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _plot_suite(axes, rows, suite):
    for ax, stage in zip(axes, STAGES):
        at_stage = [r for r in rows if r["stage"] == stage]
        def series_of(r):
            return (r["suite"], r["test"], r["precision"], r["mask"], r["bsize"],
                    r.get("method", "auto"), r.get("capacity_factor", ""))

        for key in sorted({series_of(r) for r in at_stage}):
            pts = sorted((r["sparsity"], r["speedup_graph"], r["speedup_eager"])
                         for r in at_stage if series_of(r) == key)
            s, graph, eager = zip(*pts)
            label = f"{key[1]} {key[2]} {key[3]} b{key[4]} {key[5]}"
            line, = ax.plot(s, graph, "o-", label=f"{label} graphed")
            ax.plot(s, eager, "x:", color=line.get_color(), label=f"{label} eager")
        spconv = sorted((r["sparsity"], r["dense_graph_ms"] / r["spconv_eager_ms"], r["mask"])
                        for r in at_stage if "spconv_eager_ms" in r)
        for sparsity, speedup, mask in spconv:
            ax.plot(sparsity, speedup, "k*", markersize=10)
            ax.annotate(f"spconv {mask}", (sparsity, speedup), fontsize=7)
        theory = sorted({(r["sparsity"], r["theoretical"]) for r in at_stage})
        if theory:
            ax.plot(*zip(*theory), ":", color="gray", label="1 / density")
        ax.axhline(1, color="black", lw=0.5)
        ax.set_yscale("log")
        ax.set_title(f"{suite}: {stage}")
        ax.set_xlabel("sparsity")
        ax.legend(fontsize=5)
    axes[0].set_ylabel("speed-up over dense (same run)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", nargs="+", default=["topleft", "blocksize", "batch", "fp32",
                                                       "road", "spconv"])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="folder for the results (default: bench/results in this clone)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--stages", nargs="+", default=list(STAGES))
    parser.add_argument("--replot", type=pathlib.Path, help="only redraw the plot of this CSV")
    args = parser.parse_args(argv)
    if args.replot:
        plot(read_csv(args.replot), args.replot.with_suffix(".png"))
        return 0
    require_gpu("bench.res_blocks")
    torch.backends.cudnn.benchmark = True
    device = torch.cuda.get_device_name()
    if "modes" in args.suite:
        rows, started = [], time.time()
        for stage, precision, units in itertools.product(args.stages, ("tf32", "fp16"), (1, 3)):
            rows.append(run_modes(stage, precision, units, args.repeats,
                                  numpy.random.default_rng(len(rows))))
            r = rows[-1]
            print(f"[{time.time() - started:5.0f}s] modes {stage} {precision} x{units}: dense "
                  f"{r['dense_eager_ms']:.3f} ms, sparse eager {r['sparse_eager_ms']:.3f} / "
                  f"compiled {r['sparse_compiled_ms']:.3f} / reduce-overhead "
                  f"{r['sparse_reduce_overhead_ms']:.3f} / CapacityGraphs "
                  f"{r['sparse_capacity_graphs_ms']:.3f} ms", flush=True)
            stem = results_stem(args.out, "res_blocks_modes", device)
            write_csv(rows, f"{stem}.csv")
            pathlib.Path(f"{stem}.md").write_text(_modes_table(rows, device))
        args.suite = [s for s in args.suite if s != "modes"]
        if not args.suite:
            return 0
    if "floor" in args.suite:
        rows = [run_floor("add", None, None, args.repeats, None)]
        for test, stage, precision in itertools.product(("T1", "T2"), args.stages,
                                                        ("tf32", "fp16")):
            rows.append(run_floor(test, stage, precision, args.repeats,
                                  numpy.random.default_rng(len(rows))))
            print("floor", {k: round(v, 2) if isinstance(v, float) else v
                            for k, v in rows[-1].items()}, flush=True)
            write_csv(rows, f"{results_stem(args.out, 'res_blocks_floor', device)}.csv")
        args.suite = [s for s in args.suite if s != "floor"]
        if not args.suite:
            return 0
    todo = [r for r in suites(args.suite) if r[2] in args.stages]
    rows, started = [], time.time()
    name = results_stem(args.out, "res_blocks_" + "_".join(args.suite), device).name
    dependent = _launch.DEPENDENT_LAUNCH
    staging = block_conv.STAGING
    for i, (suite, test, stage, batch, precision, mask_kind, sparsity, bsize, method,
            capacity) in enumerate(todo):
        rng = numpy.random.default_rng(i)
        _launch.DEPENDENT_LAUNCH = dependent and suite != "dependent-off"
        block_conv.STAGING = suite.split("-")[1] if suite.startswith("staging-") else staging
        row = run_blocks(test, stage, batch, precision, mask_kind, sparsity, bsize,
                         args.repeats, rng, method, capacity)
        if suite == "spconv":
            row.update(run_spconv(stage, precision, mask_kind, sparsity, args.repeats,
                                  numpy.random.default_rng(i)))  # the same road mask
            row["speedup_vs_spconv_eager"] = row["spconv_eager_ms"] / row["sparse_eager_ms"]
            row["speedup_vs_spconv_graph"] = row["spconv_eager_ms"] / row["sparse_graph_ms"]
        rows.append({"suite": suite, **row})
        print(f"[{i + 1}/{len(todo)} {time.time() - started:5.0f}s] {suite:9} {test} {stage} "
              f"b{batch} {precision} {mask_kind} s={sparsity} bs={bsize} {method} "
              f"cap={row['capacity']}: "
              f"dense {row['dense_eager_ms']:.3f}/{row['dense_graph_ms']:.3f} ms, "
              f"sparse {row['sparse_eager_ms']:.3f}/{row['sparse_graph_ms']:.3f} ms "
              f"(eager/graph), x{row['speedup_eager']:.2f}/x{row['speedup_graph']:.2f}, "
              f"theory x{row['theoretical']:.1f}"
              + (f", spconv {row['spconv_eager_ms']:.3f} ms" if suite == "spconv" else ""),
              flush=True)
        write_csv(rows, args.out / f"{name}.csv")  # after every row: a cut-off run keeps them
        torch.cuda.empty_cache()
    plot(rows, args.out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
