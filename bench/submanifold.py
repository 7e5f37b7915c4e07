"""Submanifold sparse convolution (torch_bridge.submanifold) against spconv 2.3.8,
spconv-triton, dense cuDNN and SBNet's block path, measured in the same run.

    python -m bench.submanifold [--quick] [--out bench/results] [--repeats N] [--workloads 1 2]
        [--triton none|some|all] [--triton-warmup PROCESSES] [--stages conv-2 ...]
        [--precisions tf32 fp16]

"ours" is torch_bridge.submanifold with algo "gemm" (gather + cuBLAS), "ours-fused" with algo
"fused" (one gather + tensor-core kernel).

Workload 1: SBNet's T2 bottleneck unit (bench.res_blocks, the four stages) on road-like masks
at 90% sparsity, batch 1, tf32 and fp16: dense cuDNN and SBNet's block path (reduce_mask in the
timed region; res_blocks.run_blocks, eager and graphed) beside the same unit with a 3x3
submanifold convolution (res_blocks._SubmanifoldBottleneck): ours, spconv 2.3.8 and
spconv-triton, dense in and dense out (the site list and rulebook built every call), and ours
on the sites alone with the rulebook cached (eager and graphed); "torch ops alone" is that call
less its submanifold convolution (site list, gathers, BN, 1x1 maps, scatter: torch's ops, the
same for every implementation), the floor under all of them.

Workload 2: a SECOND-style 3D middle encoder (SubM 4 -> 16, SubM 16, SparseConv s2 -> 32,
SubM 32 x2, SparseConv s2 -> 64, SubM 64 x2, SparseConv s2, SubM 64 x2, SparseConv (3, 1, 1)
s(2, 1, 1) -> 128; BatchNorm1d and ReLU after each) on a 41 x 1600 x 1408 grid of voxelised
synthetic LiDAR sweeps (bench.lidar), batch 1 and 4, fp16 and tf32. Passes: "forward" (eval,
rulebooks built in the call), "forward_cached" (ours: rulebooks built beforehand), "graph"
(ours: forward_cached in a CUDA graph), "rulebooks" (building them alone: ours, and spconv's
implicit-GEMM indice pairs through spconv.pytorch.ops, as its forward in eval mode builds them),
"forward_backward" (train mode, rulebooks built in the call).

spconv-triton compiles and autotunes its Triton kernels for every new shape (about two minutes
a stage of workload 1), so by default ("--triton some") it runs on workload 1's conv-5 and
workload 2's batch 1, in TF32 only; "all" runs it everywhere, "none" (and --quick) nowhere.
--triton-warmup P first runs every layer shape of the chosen workloads and precisions through
spconv-triton in P processes at once (its autotuner compiles each candidate kernel one after
another), then deletes the choices those contending processes made, keeping the compiled
kernels: the timed process tunes again, on an idle GPU, in seconds.
--stages and --precisions narrow workload 1 (and --precisions workload 2), so that "all" can be
run a few stages a call.

Every anchor gets our weights (the same state_dict: all use spconv's KRSC layout) and its output
is compared with ours (relative L2 error, sites matched by coordinates); ours is checked against
a dense convolution (workload 1) and against the NumPy backend in float64 on a crop of the
scene (workload 2). Anchors that are not installed are skipped. Times: CUDA events around each
call, median of --repeats after a warm-up; host_ms is the median host time of an eager call.
Writes <out>/submanifold_<device>.csv, .md and .png.
"""

import argparse
import contextlib
import pathlib
import statistics
import sys
import time

import numpy
import torch

import torch_bridge.submanifold as ours
from bench import lidar, masks, res_blocks
from sbnet_cupy.submanifold import conv_output_shape
from bench._common import (RESULTS, allow_tf32, events_ms, graph, require_gpu, results_stem,
                           write_csv)

PRECISIONS = {"tf32": (torch.float32, True), "fp16": (torch.float16, False)}
TOLERANCE = {"tf32": 2e-2, "fp16": 2e-2, "float64": 1e-9}  # relative L2 error
SPARSITY = 0.9


def anchors():
    """name -> (spconv-like namespace, our algo or None) of ours and the anchors that import."""
    found = {"ours": (ours, "gemm"), "ours-fused": (ours, "fused")}
    for name, module in (("spconv", "spconv.pytorch"), ("spconv-triton", "spconv_triton.pytorch")):
        try:
            found[name] = (__import__(module, fromlist=["SparseConvTensor"]), None)
        except Exception as error:  # not installed, or built for another CUDA
            print(f"{name}: skipped ({type(error).__name__}: {error})", flush=True)
    return found


def with_algo(net, algo):
    """net, its convolutions set to our algorithm `algo` (None: an anchor's net, as it is)."""
    for module in net.modules():
        if algo is not None and isinstance(module, ours.SparseConvolution):
            module.sbnet_algo = algo
    return net


FAILED = []  # (impl, case, error) of every case that failed its check or could not run


@contextlib.contextmanager
def failures(rows, base, name):
    """Record a case that fails (an anchor that cannot run it, or a wrong result) as a row and
    in FAILED, and go on with the next one."""
    try:
        yield
    except Exception as error:
        message = f"{type(error).__name__}: {error}"[:300]
        rows.append(dict(base, impl=name, passes="failed", error=message))
        FAILED.append((name, f"workload {base['workload']} {base['case']} b{base['batch']} "
                             f"{base['precision']}", message))
        print(f"FAILED {name} {FAILED[-1][1]}: {message}", flush=True)


def site_list(mask):
    """The active sites of a mask, int32 [N, 1 + D], stored row-major. torch's nonzero()
    returns them column-major (strides (1, N)), which spconv 2.3.8 reads as if row-major without
    a check: it then finds no neighbours and returns the centre tap alone."""
    return mask.nonzero().int().contiguous()


def host_ms(run, repeats):
    """Median host time of an eager call (no synchronisation inside the timed region)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def rel_error(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def by_site(indices, features, spatial_shape):
    """Features sorted by linearised site: different libraries order output sites differently."""
    key = indices[:, 0].long()
    for axis, size in enumerate(spatial_shape):
        key = key * size + indices[:, 1 + axis].long()
    order = torch.argsort(key)
    return key[order], features[order]


# --- workload 1: T2 units ---------------------------------------------------------------

def dense_unit(unit, x, mask):
    """The submanifold unit computed with a dense conv2d of the zero-filled bottleneck, read at
    the sites (the definition of a submanifold convolution)."""
    f = x[mask]
    z = torch.relu(unit.linear1(torch.relu(unit.bn1(f))))
    dense = z.new_zeros((*mask.shape, z.shape[1]))
    dense[mask] = z
    weight = unit.conv2.weight.permute(0, 3, 1, 2)
    out = torch.nn.functional.conv2d(dense.permute(0, 3, 1, 2), weight, unit.conv2.bias,
                                     padding=1).permute(0, 2, 3, 1)[mask]
    return f + unit.linear3(torch.relu(out))


def workload1(stage, precision, namespaces, repeats, seed):
    height, width, channels, bottleneck = res_blocks.STAGES[stage]
    dtype, tf32 = PRECISIONS[precision]
    rows = []
    sbnet = res_blocks.run_blocks("T2", stage, 1, precision, "road", SPARSITY, 16, repeats,
                                  numpy.random.default_rng(seed))
    allow_tf32(tf32)
    base = dict(workload=1, case=stage, batch=1, precision=precision)
    for name, key in (("dense cuDNN", "dense"), ("SBNet blocks", "sparse")):
        for mode in ("eager", "graph"):
            rows.append(dict(base, impl=name, passes=f"forward_{mode}",
                             gpu_ms=sbnet[f"{key}_{mode}_ms"]))
    mask = torch.tensor(masks.road(numpy.random.default_rng(seed), 1, height, width,
                                   SPARSITY), device="cuda") > 0.5
    x = torch.randn(1, height, width, channels, device="cuda", dtype=dtype)
    torch.manual_seed(seed)
    reference = res_blocks._SubmanifoldBottleneck(ours, channels, bottleneck).cuda().to(dtype)
    reference.eval()
    state = {k: v.clone() for k, v in reference.state_dict().items()}  # training moves BN
    with torch.no_grad():
        want = dense_unit(reference, x, mask)
        for name, (ns, algo) in namespaces.items():
            unit = res_blocks._SubmanifoldBottleneck(ns, channels, bottleneck).cuda().to(dtype)
            with_algo(unit, algo).load_state_dict(state)
            unit.eval()
            y = x.clone()

            def dense_in_out():  # site list, rulebook and unit every call, as SBNet's path
                indices = site_list(mask)
                features = y[indices[:, 0], indices[:, 1], indices[:, 2]]
                out = unit(ns, features, indices, [height, width], 1)
                y[indices[:, 0], indices[:, 1], indices[:, 2]] = out
                return out

            with failures(rows, base, name):
                error = rel_error(dense_in_out(), want)
                note = ""
                if not error < TOLERANCE[precision]:
                    if algo is not None:  # ours must be right; an anchor is timed and flagged
                        raise AssertionError(f"differs from the dense reference by {error:.2e}")
                    note = f"differs from the dense reference by {error:.2e}"
                    print(f"NOTE {name} workload 1 {stage} {precision}: {note}", flush=True)
                rows.append(dict(base, impl=name, passes="forward_eager", sites=int(mask.sum()),
                                 gpu_ms=events_ms(dense_in_out, repeats),
                                 host_ms=host_ms(dense_in_out, repeats), rel_error=error,
                                 error=note))
                if algo is not None:
                    rows += _cached_unit(unit, name, x, mask, base, repeats)
        y = x.clone()

        def torch_ops_alone():  # every implementation's call less its submanifold convolution
            indices = site_list(mask)
            features = y[indices[:, 0], indices[:, 1], indices[:, 2]]
            z = torch.relu(reference.linear1(torch.relu(reference.bn1(features))))
            out = features + reference.linear3(torch.relu(z))
            y[indices[:, 0], indices[:, 1], indices[:, 2]] = out
            return out

        rows.append(dict(base, impl="torch ops alone", passes="forward_eager",
                         sites=int(mask.sum()), gpu_ms=events_ms(torch_ops_alone, repeats),
                         host_ms=host_ms(torch_ops_alone, repeats)))
    return rows, sbnet


def _cached_unit(unit, name, x, mask, base, repeats):
    """Ours on the sites alone, the rulebook built once: eager and graphed."""
    indices = site_list(mask)
    features = x[mask]
    shape = list(mask.shape[1:])
    rulebook = ours.build_rulebook(indices, shape, 1, 3, subm=True)
    cache = {"subm": rulebook}

    def sites():
        z = torch.relu(unit.linear1(torch.relu(unit.bn1(features))))
        z = unit.conv2(ours.SparseConvTensor(z, indices, shape, 1, indice_dict=cache)).features
        return features + unit.linear3(torch.relu(z))

    captured = graph(sites)
    return [dict(base, impl=name, passes="sites_cached_eager", gpu_ms=events_ms(sites, repeats),
                 host_ms=host_ms(sites, repeats)),
            dict(base, impl=name, passes="sites_cached_graph",
                 gpu_ms=events_ms(captured.replay, repeats)),
            dict(base, impl=name, passes="rulebooks",
                 gpu_ms=events_ms(lambda: ours.build_rulebook(indices, shape, 1, 3, subm=True),
                                  repeats))]


# --- workload 2: SECOND's middle encoder ---------------------------------------------------

def encoder(ns):
    """SECOND's sparse middle encoder (VoxelBackBone8x's layers) from a spconv namespace."""
    def block(cin, cout, kernel, key, stride=1, padding=1, subm=True):
        conv = (ns.SubMConv3d(cin, cout, kernel, padding=padding, bias=False, indice_key=key)
                if subm else ns.SparseConv3d(cin, cout, kernel, stride=stride, padding=padding,
                                             bias=False, indice_key=key))
        return ns.SparseSequential(conv, torch.nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01),
                                   torch.nn.ReLU())

    return ns.SparseSequential(
        block(4, 16, 3, "subm1"), block(16, 16, 3, "subm1"),
        block(16, 32, 3, "spconv2", 2, 1, False), block(32, 32, 3, "subm2"),
        block(32, 32, 3, "subm2"),
        block(32, 64, 3, "spconv3", 2, 1, False), block(64, 64, 3, "subm3"),
        block(64, 64, 3, "subm3"),
        block(64, 64, 3, "spconv4", 2, (0, 1, 1), False), block(64, 64, 3, "subm4"),
        block(64, 64, 3, "subm4"),
        block(64, 128, (3, 1, 1), "spconv_down2", (2, 1, 1), 0, False))


def build_rulebooks(net, indices, shape, batch):
    """Every rulebook our encoder needs, by indice_key, in layer order (the input's indices
    checked, the sites the layers make trusted, the tables of earlier rulebooks of the same
    sites reused, as the modules do)."""
    built = {}
    for module in net.modules():
        if isinstance(module, ours.SparseConvolution):
            rulebook = built.get(module.indice_key)
            if rulebook is None:
                rulebook = built[module.indice_key] = ours.build_rulebook(
                    indices, shape, batch, module.kernel_size, module.stride, module.padding,
                    module.dilation, module.subm, check=not built, reuse=built.values())
            indices, shape = rulebook.out_indices, rulebook.out_shape
    return built


def spconv_rulebooks(net, indices, shape, batch):
    """spconv 2.3.8's rulebooks (implicit-GEMM indice pairs, inference) for the layers of our
    encoder `net`, by indice_key, in layer order: what its forward builds."""
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops

    built = {}
    for module in net.modules():
        if isinstance(module, ours.SparseConvolution):
            if module.indice_key not in built:
                out = ops.get_indice_pairs_implicit_gemm(
                    indices, batch, shape, ConvAlgo.MaskImplicitGemm, module.kernel_size,
                    module.stride, module.padding, module.dilation, [0] * len(shape),
                    module.subm, False, False)
                out_shape = shape if module.subm else list(conv_output_shape(
                    shape, module.kernel_size, module.stride, module.padding, module.dilation))
                built[module.indice_key] = (indices if module.subm else out[0], out_shape)
            indices, shape = built[module.indice_key]
    return built


def _randomise_bn(net, seed):
    rng = numpy.random.default_rng(seed)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.copy_(torch.tensor(rng.uniform(-0.2, 0.2, m.num_features)))
            m.running_var.copy_(torch.tensor(rng.uniform(0.5, 2, m.num_features)))


def check_against_numpy(seed):
    """Our encoder on CUDA in float64 equals the NumPy backend's, on a crop of the scene."""
    coords, features = lidar.batch(seed, 1)
    crop = (coords[:, 2] >= 760) & (coords[:, 2] < 840) & (coords[:, 3] < 600)  # ~4k voxels
    indices, features = torch.from_numpy(coords[crop]), torch.from_numpy(features[crop]).double()
    torch.manual_seed(seed)
    net = encoder(ours).double().eval()
    _randomise_bn(net, seed)
    shape = list(lidar.GRID)
    with torch.no_grad():
        want = net(ours.SparseConvTensor(features, indices, shape, 1))
        got = net.cuda()(ours.SparseConvTensor(features.cuda(), indices.cuda(), shape, 1))
    if not torch.equal(got.indices.cpu(), want.indices):
        raise AssertionError("workload 2: CUDA output sites differ from the NumPy backend's")
    error = rel_error(got.features.cpu(), want.features)
    if not error < TOLERANCE["float64"]:
        raise AssertionError(f"workload 2: CUDA differs from the NumPy backend by {error:.2e}")
    return int(crop.sum()), error


def workload2(batch, precision, namespaces, repeats, seed, inputs):
    dtype, tf32 = PRECISIONS[precision]
    allow_tf32(tf32)
    coords, features = inputs
    indices = torch.from_numpy(coords).cuda()
    features = torch.from_numpy(features).cuda().to(dtype)
    shape = list(lidar.GRID)
    base = dict(workload=2, case="SECOND encoder", batch=batch, precision=precision,
                sites=int(indices.shape[0]))
    torch.manual_seed(seed)
    reference = encoder(ours).cuda().to(dtype).eval()
    _randomise_bn(reference, seed)
    state = {k: v.clone() for k, v in reference.state_dict().items()}  # training moves BN
    rows, want = [], None
    for name, (ns, algo) in namespaces.items():
        net = reference if name == "ours" else encoder(ns).cuda().to(dtype).eval()
        with_algo(net, algo).load_state_dict(state)

        def forward(net=net, ns=ns):
            return net(ns.SparseConvTensor(features, indices, shape, batch))

        def forward_backward(net=net, ns=ns):
            net(ns.SparseConvTensor(features, indices, shape, batch)).features.float().sum() \
                .backward()

        with failures(rows, base, name):
            with torch.no_grad():
                out = forward()
                key, got = by_site(out.indices, out.features, out.spatial_shape)
                if want is None:
                    want_key, want = key, got
                    error = 0.0
                elif not torch.equal(key, want_key):
                    raise AssertionError(f"output sites differ from ours: {key.shape[0]} "
                                         f"against {want_key.shape[0]}")
                else:
                    error = rel_error(got, want)
                    if not error < TOLERANCE[precision]:
                        raise AssertionError(f"differs from ours by {error:.2e}")
                rows.append(dict(base, impl=name, passes="forward", out_sites=int(key.shape[0]),
                                 gpu_ms=events_ms(forward, repeats),
                                 host_ms=host_ms(forward, repeats), rel_error=error))
            net.train()
            rows.append(dict(base, impl=name, passes="forward_backward",
                             gpu_ms=events_ms(forward_backward, repeats),
                             host_ms=host_ms(forward_backward, repeats)))
            net.eval()
            if algo is not None:
                rows += _cached_encoder(net, name, features, indices, shape, batch, base,
                                        repeats)
    if "spconv" in namespaces:
        with failures(rows, base, "spconv"), torch.no_grad():
            rows.append(dict(base, impl="spconv", passes="rulebooks", gpu_ms=events_ms(
                lambda: spconv_rulebooks(reference, indices, shape, batch), repeats)))
    return rows


def _cached_encoder(net, name, features, indices, shape, batch, base, repeats):
    with torch.no_grad():
        built = build_rulebooks(net, indices, shape, batch)

        def cached():
            return net(ours.SparseConvTensor(features, indices, shape, batch,
                                             indice_dict=dict(built))).features

        captured = graph(cached)
        return [dict(base, impl=name, passes="rulebooks",
                     gpu_ms=events_ms(lambda: build_rulebooks(net, indices, shape, batch),
                                      repeats),
                     host_ms=host_ms(lambda: build_rulebooks(net, indices, shape, batch),
                                     repeats)),
                dict(base, impl=name, passes="forward_cached",
                     gpu_ms=events_ms(cached, repeats), host_ms=host_ms(cached, repeats)),
                dict(base, impl=name, passes="graph", gpu_ms=events_ms(captured.replay,
                                                                         repeats))]


# --- spconv-triton's autotuning, in parallel ----------------------------------------------

def _triton_layers(workloads, precisions):
    """(precision, dims, cin, cout, kernel, stride, padding, subm) of every spconv-triton
    convolution the chosen workloads run: workload 1's 3x3 at each stage's bottleneck width,
    workload 2's encoder layers (what its autotuner keys on: the kernel, the channels, the
    dtype; not the number of sites)."""
    layers = []
    if 1 in workloads:
        layers += [(2, k, k, 3, 1, 1, True) for _, _, _, k in res_blocks.STAGES.values()]
    if 2 in workloads:
        layers += [(3, m.in_channels, m.out_channels, *(tuple(getattr(m, key)) for key in
                                                          ("kernel_size", "stride", "padding")),
                    m.subm)
                   for m in encoder(ours).modules() if isinstance(m, ours.SparseConvolution)]
    return [(p, *layer) for p in precisions for layer in dict.fromkeys(layers)]


def _triton_layer(layer):
    """One layer through spconv-triton, forward in eval mode and forward + backward in train
    mode, on a LiDAR sweep's sites (3D) or a road mask's (2D); what went wrong, or None."""
    try:
        _run_triton_layer(layer)
    except Exception as error:  # reported; the timed run then tunes that layer itself
        return f"{layer}: {type(error).__name__}: {error}"[:300]
    return None


def _run_triton_layer(layer):
    import spconv_triton.pytorch as spt

    precision, dims, cin, cout, kernel, stride, padding, subm = layer
    dtype, tf32 = PRECISIONS[precision]
    allow_tf32(tf32)
    if dims == 3:
        coords, _ = lidar.batch(100, 1)
        indices, shape = torch.from_numpy(coords).cuda(), list(lidar.GRID)
        conv = (spt.SubMConv3d(cin, cout, kernel, padding=padding, bias=False) if subm else
                spt.SparseConv3d(cin, cout, kernel, stride=stride, padding=padding, bias=False))
    else:
        height, width, _, _ = res_blocks.STAGES["conv-3"]
        mask = torch.tensor(masks.road(numpy.random.default_rng(0), 1, height, width, SPARSITY),
                            device="cuda") > 0.5
        indices, shape = site_list(mask), [height, width]
        conv = spt.SubMConv2d(cin, cout, kernel, bias=False)
    conv = conv.cuda().to(dtype)
    features = torch.randn(indices.shape[0], cin, device="cuda", dtype=dtype,
                           requires_grad=True)
    with torch.no_grad():
        conv.eval()(spt.SparseConvTensor(features, indices, shape, 1))
    conv.train()(spt.SparseConvTensor(features, indices, shape, 1)).features.float().sum() \
        .backward()
    torch.cuda.synchronize()


def warm_triton(processes, workloads, precisions):
    """Compile spconv-triton's kernels for every layer the run will time, `processes` layers at
    a time in worker processes, then delete the autotune results they left in Triton's cache
    (chosen while the workers shared the GPU) and keep the compiled kernels."""
    import concurrent.futures
    import multiprocessing
    import os

    layers = _triton_layers(workloads, precisions)
    with concurrent.futures.ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for failed in filter(None, pool.map(_triton_layer, layers)):
            print(f"spconv-triton warm-up failed: {failed}", flush=True)
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME", os.path.expanduser("~")), ".triton", "cache")
    tuned = list(pathlib.Path(cache).rglob("*.autotune.json"))
    for path in tuned:
        path.unlink()
    return len(layers), len(tuned)


# --- report ------------------------------------------------------------------------------

def table(rows, device, checks):
    lines = [f"# Submanifold sparse convolution: {device}, torch {torch.__version__}", "",
             f"Checks: {checks}", "",
             "ms per call, CUDA events (median); host ms: an eager call's host time.", "",
             "rel. error: workload 1 against the dense reference, workload 2 against ours "
             "(gemm), sites matched by coordinates.", "",
             "| workload | case | batch | precision | impl | pass | sites | GPU ms | host ms | "
             "rel. error | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def cell(key, fmt="{:.3f}"):
            return fmt.format(r[key]) if isinstance(r.get(key), float) else str(r.get(key, ""))

        lines.append(f"| {r['workload']} | {r['case']} | {r['batch']} | {r['precision']} | "
                     f"{r['impl']} | {r['passes']} | {r.get('sites', '')} | {cell('gpu_ms')} | "
                     f"{cell('host_ms')} | {cell('rel_error', '{:.1e}')} | "
                     f"{r.get('error', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(1, "forward_eager"), (2, "forward"), (2, "forward_backward")]
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (workload, passes) in zip(axes[0], groups):
        chosen = [r for r in rows if r["workload"] == workload and r["passes"] == passes
                  and "gpu_ms" in r]
        cases = sorted({(r["case"], r["batch"], r["precision"]) for r in chosen})
        impls = list(dict.fromkeys(r["impl"] for r in chosen))
        for j, impl in enumerate(impls):
            values = [next((r["gpu_ms"] for r in chosen if r["impl"] == impl
                            and (r["case"], r["batch"], r["precision"]) == c), 0) for c in cases]
            ax.bar(numpy.arange(len(cases)) + j / (len(impls) + 1), values,
                   1 / (len(impls) + 1), label=impl)
        ax.set_xticks(numpy.arange(len(cases)) + 0.3)
        ax.set_xticklabels([f"{c[0]}\nb{c[1]} {c[2]}" for c in cases], fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel("ms (CUDA events)")
        ax.set_title(f"workload {workload}: {passes}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one stage, batch 1, few repeats, with the correctness checks")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="folder for the results (default: bench/results in this clone)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--workloads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--triton", choices=["none", "some", "all"], default="some",
                        help="where spconv-triton runs (it autotunes every shape)")
    parser.add_argument("--triton-warmup", type=int, metavar="PROCESSES",
                        help="compile spconv-triton's kernels in this many processes first")
    parser.add_argument("--stages", nargs="+", choices=list(res_blocks.STAGES),
                        help="workload 1's stages (default: all; --quick: conv-4)")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS),
                        help="default: all (--quick: workload 1 in tf32)")
    args = parser.parse_args(argv)
    require_gpu("bench.submanifold")
    repeats = args.repeats or (5 if args.quick else 20)
    torch.backends.cudnn.benchmark = True
    device = torch.cuda.get_device_name()
    stem = results_stem(args.out, "submanifold_quick" if args.quick else "submanifold", device)
    namespaces = anchors()
    triton = "none" if args.quick else args.triton

    def chosen(where):  # the namespaces of one case: spconv-triton only where asked
        return {name: entry for name, entry in namespaces.items()
                if name != "spconv-triton" or triton == "all" or (triton == "some" and where)}
    started = time.time()
    if args.triton_warmup and triton != "none" and "spconv-triton" in namespaces:
        layers, forgotten = warm_triton(args.triton_warmup, args.workloads,
                                        args.precisions or list(PRECISIONS))
        print(f"[{time.time() - started:5.0f}s] spconv-triton: {layers} layer shapes compiled, "
              f"{forgotten} autotune results deleted", flush=True)
    sites, error = check_against_numpy(0)
    checks = (f"encoder on CUDA (float64) vs NumPy backend on a crop of {sites} voxels: "
              f"rel. error {error:.1e}")
    print(f"[{time.time() - started:5.0f}s] {checks}", flush=True)
    rows = []

    def save():
        write_csv(rows, f"{stem}.csv")
        pathlib.Path(f"{stem}.md").write_text(table(rows, device, checks))

    if 1 in args.workloads:
        stages = args.stages or (["conv-4"] if args.quick else list(res_blocks.STAGES))
        for stage in stages:
            i = list(res_blocks.STAGES).index(stage)  # the seed of the stage's mask and weights
            for precision in args.precisions or (["tf32"] if args.quick else list(PRECISIONS)):
                new, _ = workload1(stage, precision,
                                   chosen(stage == "conv-5" and precision == "tf32"), repeats, i)
                rows += new
                print(f"[{time.time() - started:5.0f}s] workload 1 {stage} {precision}: "
                      + ", ".join(f"{r['impl']} {r['passes']} {r.get('gpu_ms', float('nan')):.3f}"
                                  for r in new),
                      flush=True)
                save()
    if 2 in args.workloads:
        for batch in ([1] if args.quick else [1, 4]):
            inputs = lidar.batch(100, batch)
            for precision in args.precisions or PRECISIONS:
                new = workload2(batch, precision, chosen(batch == 1 and precision == "tf32"),
                                repeats, batch, inputs)
                rows += new
                print(f"[{time.time() - started:5.0f}s] workload 2 b{batch} {precision} "
                      f"({new[0]['sites']} voxels): "
                      + ", ".join(f"{r['impl']} {r['passes']} {r.get('gpu_ms', float('nan')):.3f}"
                                  for r in new), flush=True)
                save()
                torch.cuda.empty_cache()
    plot(rows, f"{stem}.png")
    ours_failed = [f for f in FAILED if f[0].startswith("ours")]
    for impl, case, message in FAILED:
        print(f"failed: {impl} {case}: {message}")
    return 1 if ours_failed else 0


if __name__ == "__main__":
    sys.exit(main())
