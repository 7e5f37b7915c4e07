"""Host time of one call of every op: through torch_bridge (no grad, inference_mode, with autograd
recording) and through sbnet_cupy on CuPy arrays, beside torch's own small ops measured in the
same run.

    python -m bench.overhead [--out DIR] [--calls N] [--profile]

Tensors are tiny, so a call's time is the host's: the Python wrapper, the checks, the dispatch
and the launch. Each figure is the median over --rounds rounds of the mean time of --calls calls
in a row (host clock, the GPU keeping up); the results are checked against the NumPy backend
first. --profile prints where the time of each torch_bridge op goes (cProfile, the top
functions by own time). Writes <out>/overhead_<device>.csv and .md.
"""

import argparse
import cProfile
import gc
import io
import pathlib
import pstats
import statistics
import sys
import time

import numpy
import torch

import sbnet_cupy
import torch_bridge as tb
from bench._common import RESULTS, require_gpu

GEOMETRY = dict(bsize=(10, 10), boffset=(-1, -1), bstride=(8, 8))


def _host_us(call, calls, rounds):
    for _ in range(20):  # warm-up: compile kernels, fill caches
        call()
    torch.cuda.synchronize()
    means = []
    gc.disable()  # no collection inside a round
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            means.append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
            gc.collect()
    finally:
        gc.enable()
    return statistics.median(means)


def _inputs():
    """A 1x32x32 mask with a few active 8x8 blocks, 16-channel fp32 tensors: launch cost only."""
    rng = numpy.random.default_rng(0)
    mask = torch.tensor(rng.random((1, 32, 32)) > 0.97, device="cuda")
    x = torch.randn(1, 32, 32, 16, device="cuda")
    found = tb.reduce_mask(mask, (4, 4), capacity=16, **GEOMETRY)
    counts, indices = found.bin_counts, found.active_block_indices
    blocks = tb.sparse_gather(x, counts, indices, **GEOMETRY)
    return mask, x, counts, indices, blocks


def _check(mask, x, counts, indices, blocks):
    """torch_bridge and sbnet_cupy on CuPy agree with the NumPy backend on these inputs."""
    import cupy

    want = sbnet_cupy.reduce_mask(mask.cpu().numpy(), (4, 4), capacity=16, **GEOMETRY)
    got = tb.reduce_mask(mask, (4, 4), capacity=16, **GEOMETRY)
    numpy.testing.assert_array_equal(got.active_block_indices.cpu().numpy(),
                                     want.active_block_indices)
    args = (counts.cpu().numpy(), indices.cpu().numpy())
    stack = sbnet_cupy.sparse_gather(x.cpu().numpy(), *args, **GEOMETRY)
    numpy.testing.assert_array_equal(tb.sparse_gather(x, counts, indices, **GEOMETRY).cpu(),
                                     stack)
    numpy.testing.assert_array_equal(
        cupy.asnumpy(sbnet_cupy.sparse_gather(cupy.asarray(x), cupy.asarray(counts),
                                              cupy.asarray(indices), **GEOMETRY)), stack)
    y = sbnet_cupy.sparse_scatter(stack, *args, x.cpu().numpy(), add=True, atomic=True,
                                  **GEOMETRY)
    got = tb.sparse_scatter(blocks, counts, indices, x, add=True, atomic=True, **GEOMETRY)
    numpy.testing.assert_allclose(got.cpu().numpy(), y, rtol=1e-6)


def torch_calls(mask, x, counts, indices, blocks):
    """name -> (call, tensors whose requires_grad the autograd mode sets)."""
    scale, shift = torch.rand(16, device="cuda"), torch.rand(16, device="cuda")
    y = x.clone()
    weight = torch.randn(16, 16, 3, 3, device="cuda")
    x_nchw = x.permute(0, 3, 1, 2)
    # The modules on the fused block convolutions (inference; their block geometry is GEOMETRY's).
    conv = tb.SparseConv2d(16, 16, bsize_out=8).cuda().eval()
    unit = tb.SparseResBlockBottleneck(16, 8, bsize_out=8).cuda().fold_batchnorm()
    found = sbnet_cupy.ReduceMask(indices, counts)
    return {
        "reduce_mask(capacity)": lambda: tb.reduce_mask(mask, (4, 4), capacity=16, **GEOMETRY),
        "sparse_gather": lambda: tb.sparse_gather(x, counts, indices, **GEOMETRY),
        "sparse_gather(transpose)": lambda: tb.sparse_gather(x, counts, indices, transpose=True,
                                                             **GEOMETRY),
        "sparse_gather(scale, shift, relu)": lambda: tb.sparse_gather(
            x, counts, indices, scale=scale, shift=shift, relu=True, **GEOMETRY),
        "sparse_scatter(add)": lambda: tb.sparse_scatter(blocks, counts, indices, x, add=True,
                                                         atomic=True, **GEOMETRY),
        "sparse_scatter_var(add)": lambda: tb.sparse_scatter_var(
            blocks, counts, indices, y, add=True, atomic=True, **GEOMETRY),
        "SparseConv2d (module, fused)": lambda: conv(x, found),
        "SparseResBlockBottleneck (module, fused)": lambda: unit(x, found),
        "torch: x + x": lambda: x + x,
        "torch: x.clone()": lambda: x.clone(),
        "torch: conv2d 16->16 3x3": lambda: torch.nn.functional.conv2d(x_nchw, weight,
                                                                       padding=1),
    }


def later_torch_calls(requires_grad=False, device="cuda"):
    """The ops added after SBNet's, on small inputs of their own: dilated convolution's reshapes
    and its reshape route, the pruned-kernel convolution and a submanifold convolution whose
    rulebook is built (the modules). requires_grad: the inputs that carry gradients require
    them."""
    import torch_bridge.submanifold as spconv

    torch.manual_seed(0)  # the modules' initial weights: the same on every device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 32, 32, generator=gen).to(device).requires_grad_(requires_grad)
    y = tb.space_to_batch(x.detach(), 2).requires_grad_(requires_grad)
    weight = torch.randn(16, 16, 3, 3, generator=gen).to(device)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1)
    with torch.no_grad():
        conv.weight.mul_(torch.rand(conv.weight.shape, generator=gen) < 0.1)  # 10% left
    pruned = tb.SparseKernelConv2d.from_conv(conv.to(device))
    # 11x11, 64 -> 16 at 10% on 32x32: "direct" with its input channels split over CTAs (a
    # second launch and a scratch buffer a call).
    wide = torch.nn.Conv2d(64, 16, 11, padding=5)
    with torch.no_grad():
        wide.weight.mul_(torch.rand(wide.weight.shape, generator=gen) < 0.1)
    split = tb.SparseKernelConv2d.from_conv(wide.to(device))
    x64 = torch.randn(1, 64, 32, 32, generator=gen).to(device).requires_grad_(requires_grad)
    sites = (torch.rand(1, 32, 32, generator=gen) < 0.2).nonzero().int().to(device)
    features = torch.randn(len(sites), 16, generator=gen).to(device)
    subm = spconv.SubMConv2d(16, 16, 3, indice_key="subm").to(device)
    with torch.no_grad():  # builds the rulebook, which the tensor then carries
        built = subm(spconv.SparseConvTensor(features, sites, [32, 32], 1))
    sparse = built.replace_feature(features.requires_grad_(requires_grad))
    return {
        "space_to_batch (NCHW, r=2)": lambda: tb.space_to_batch(x, 2),
        "batch_to_space (NCHW, r=2)": lambda: tb.batch_to_space(y, 2),
        "dilated_conv2d (reshape route, r=2)": lambda: tb.dilated_conv2d(
            x, weight, dilation=2, padding=2, method="reshape"),
        "SparseKernelConv2d (module, 3x3 at 10%)": lambda: pruned(x),
        "SparseKernelConv2d (module, 11x11 64->16 at 10%, split channels)": lambda: split(x64),
        "SubMConv2d (module, rulebook built)": lambda: subm(sparse),
    }


def _check_later():
    """later_torch_calls on CUDA agree with the same calls on the CPU (the NumPy backend; TF32
    and the fused kernels' float32 accumulation allowed for)."""
    with torch.no_grad():
        for (name, on_gpu), on_cpu in zip(later_torch_calls().items(),
                                          later_torch_calls(device="cpu").values()):
            got, want = on_gpu(), on_cpu()
            if not isinstance(got, torch.Tensor):  # a SparseConvTensor
                got, want = got.features, want.features
            scale = float(want.abs().max())
            numpy.testing.assert_allclose(got.cpu().numpy(), want.numpy(), rtol=2e-2,
                                          atol=2e-2 * scale, err_msg=name)


def later_cupy_calls():
    """later_torch_calls' ops through sbnet_cupy on CuPy arrays (NHWC, HWIO)."""
    import cupy

    rng = numpy.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((1, 32, 32, 16)), dtype=cupy.float32)
    y = sbnet_cupy.space_to_batch(x, 2)
    w = rng.standard_normal((3, 3, 16, 16)).astype(numpy.float32)
    w[rng.random(w.shape) > 0.1] = 0
    kernel = sbnet_cupy.SparseKernel.from_dense(cupy.asarray(w))
    x64 = cupy.asarray(rng.standard_normal((1, 32, 32, 64)), dtype=cupy.float32)
    w = rng.standard_normal((11, 11, 64, 16)).astype(numpy.float32)
    w[rng.random(w.shape) > 0.1] = 0
    split = sbnet_cupy.SparseKernel.from_dense(cupy.asarray(w))
    sites = numpy.argwhere(rng.random((1, 32, 32)) < 0.2).astype(numpy.int32)
    coords = cupy.asarray(sites)
    features = cupy.asarray(rng.standard_normal((len(sites), 16)), dtype=cupy.float32)
    rulebook = sbnet_cupy.submanifold_rulebook(coords, (32, 32), 1, 3)
    taps = cupy.asarray(rng.standard_normal((16, 3, 3, 16)), dtype=cupy.float32)
    return {
        "space_to_batch (r=2)": lambda: sbnet_cupy.space_to_batch(x, 2),
        "batch_to_space (r=2)": lambda: sbnet_cupy.batch_to_space(y, 2),
        "sparse_kernel_conv2d (3x3 at 10%)": lambda: sbnet_cupy.sparse_kernel_conv2d(x, kernel),
        "sparse_kernel_conv2d (11x11 64->16 at 10%, split channels)": (
            lambda: sbnet_cupy.sparse_kernel_conv2d(x64, split, padding="SAME")),
        "rulebook_conv (submanifold 3x3, rulebook built)": lambda: sbnet_cupy.rulebook_conv(
            features, rulebook, taps),
        "rulebook_conv_grad_weight (submanifold 3x3, grad_weight's kernel)": (
            lambda: sbnet_cupy.submanifold.rulebook_conv_grad_weight(features, features,
                                                                     rulebook, algo="fused")),
    }


def cupy_calls(mask, x, counts, indices, blocks):
    import cupy

    mask, x, counts, indices, blocks = (cupy.asarray(t) for t in (mask, x, counts, indices,
                                                                  blocks))
    y = x.copy()
    rng = numpy.random.default_rng(0)
    w = cupy.asarray(rng.standard_normal((3, 3, 16, 16)), dtype=cupy.float32)
    folded = {k: tuple(cupy.asarray(a) for a in v) if isinstance(v, tuple) else cupy.asarray(v)
              for k, v in sbnet_cupy.fold_batchnorm(
                  sbnet_cupy.random_bottleneck_weights(rng, 16, 8)).items()}
    params = sbnet_cupy.calc_block_params((32, 32), (10, 10), (3, 3))
    return {
        "sparse_conv2d(method=fused)": lambda: sbnet_cupy.sparse_conv2d(
            x, w, counts, indices, params, method="fused"),
        "sparse_res_block_bottleneck(method=fused)": lambda: (
            sbnet_cupy.sparse_res_block_bottleneck(x, counts, indices, params, folded,
                                                   method="fused")),
        "reduce_mask(capacity)": lambda: sbnet_cupy.reduce_mask(mask, (4, 4), capacity=16,
                                                                **GEOMETRY),
        "sparse_gather": lambda: sbnet_cupy.sparse_gather(x, counts, indices, **GEOMETRY),
        "sparse_scatter(add)": lambda: sbnet_cupy.sparse_scatter(
            blocks, counts, indices, x, add=True, atomic=True, **GEOMETRY),
        "sparse_scatter_var(add)": lambda: sbnet_cupy.sparse_scatter_var(
            blocks, counts, indices, y, add=True, atomic=True, **GEOMETRY),
        "cupy: x + x": lambda: x + x,
    }


def profile(call, calls=2000, top=12):
    """The functions where `calls` calls spend their own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="folder for the results (default: bench/results in this clone)")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    require_gpu("bench.overhead")
    inputs = _inputs()
    _check(*inputs)
    _check_later()
    rows = []
    # With autograd recording: the inputs that carry gradients require them.
    mask, x, counts, indices, blocks = inputs
    graded = {**torch_calls(mask, x.detach().requires_grad_(True), counts, indices,
                            blocks.detach().requires_grad_(True)),
              **later_torch_calls(requires_grad=True)}
    for name, call in {**torch_calls(*inputs), **later_torch_calls()}.items():
        row = dict(api="torch_bridge", op=name)
        with torch.no_grad():
            row["no_grad_us"] = _host_us(call, args.calls, args.rounds)
        with torch.inference_mode():
            row["inference_mode_us"] = _host_us(call, args.calls, args.rounds)
        if not name.startswith(("reduce_mask", "sparse_scatter_var")):
            row["autograd_us"] = _host_us(graded[name], args.calls, args.rounds)
        rows.append(row)
    for name, call in {**cupy_calls(*inputs), **later_cupy_calls()}.items():
        rows.append(dict(api="sbnet_cupy (CuPy arrays)", op=name,
                         no_grad_us=_host_us(call, args.calls, args.rounds)))
    if args.profile:
        with torch.no_grad():
            for name, call in torch_calls(*inputs).items():
                if not name.startswith("torch"):
                    print(f"--- {name}, torch_bridge, no grad\n{profile(call)}")
        for name, call in cupy_calls(*inputs).items():
            if not name.startswith("cupy"):
                print(f"--- {name}, sbnet_cupy on CuPy arrays\n{profile(call)}")

    device = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"overhead_{device.replace(' ', '_')}"
    fields = ["api", "op", "no_grad_us", "inference_mode_us", "autograd_us"]
    with open(stem.with_suffix(".csv"), "w") as f:
        f.write(",".join(fields) + "\n")
        for r in rows:
            f.write(",".join(str(round(r[k], 2)) if isinstance(r.get(k), float)
                             else str(r.get(k, "")) for k in fields) + "\n")
    lines = [f"# Host time per call, {device}, torch {torch.__version__}", "",
             "| api | op | no_grad us | inference_mode us | autograd us |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:.1f}" if k in r else "" for k in fields[2:]]
        lines.append(f"| {r['api']} | {r['op']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
