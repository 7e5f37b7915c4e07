"""Convolution with a pruned kernel against cuDNN's dense convolution: the seed's five sweeps.

    python -m bench.sparse_kernel_conv [--quick] [--out bench/results] [--sweeps ...]
        [--batches ...] [--repeats N] [--replot CSV] [--rescore CSV]

Sweeps (seed 002, at its sizes; batch 1 and 8): kxkx3x64 kernels on 1x256x512x3, k = 3..11;
11x11xCinx3 on 1x256x512xCin; 11x11x3xCout on 1x256x512x3; 11x11x32x64 on 1x256x512x32 over
the ratio of non-zeros; 11x11x3x64 on 1xSxSx3 over S = 64..1024. Every case has 10% non-zero
taps (the ratio sweep aside), SAME padding, stride 1, and runs in two precisions: "tf32"
(float32 data; ours computes in exact float32, cuDNN may use TF32 tensor cores, and its strict
float32 time is reported too) and "fp16" (float16 data, float32 accumulation on both sides).

Per case: our time for every strategy that applies (sbnet_cupy.sparse_kernel_conv2d, CuPy
arrays sharing torch's memory through DLPack; "compiled" up to COMPILED_MAX_TAPS taps), the
rule's choice (choose_strategy), the fastest, and the rule's time over the fastest's (vs_best);
effective TFLOP/s = 2 x non-zero taps x output pixels / time; cuDNN's time (torch,
channels_last, cudnn.benchmark) measured in the same run; the estimated crossover ratio of
non-zeros where cuDNN becomes faster (the rule's strategy at the case's ratio and at half of it,
extrapolated linearly in the non-zeros). Each side runs as a CUDA graph of back-to-back
launches, timed with CUDA events after a warm-up (and after "compiled" has compiled its kernel:
NVRTC, once per mask and dtype, then CuPy's disk cache): the median of --repeats replays. The
masks' kernels are compiled first, in up to 16 processes.
Every result is checked against cuDNN's strict float32 convolution first. The weights of a
sweep point are the same at both batches and sizes. Writes <out>/sparse_kernel_conv_<device>.csv,
.md and .png (--sweeps / --batches: a subset, named by it). --rescore scores a committed run
again with the current rule, without a GPU.
"""

import concurrent.futures
import datetime
import math
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

import numpy

import sbnet_cupy
from sbnet_cupy.core import launch as _launch
from sbnet_cupy import pruned as skc
from bench._common import read_csv, require_gpu, results_parser, results_stem, write_csv
from bench.ops import _graph_ms

SIZE = (256, 512)
PRECISIONS = {"tf32": "float32", "fp16": "float16"}  # the data's dtype
SWEEPS = {
    "kernel": ("k", [dict(k=k, cin=3, cout=64) for k in (3, 5, 7, 9, 11)]),
    "cin": ("Cin", [dict(k=11, cin=c, cout=3) for c in (1, 3, 8, 16, 32, 64)]),
    "cout": ("Cout", [dict(k=11, cin=3, cout=c) for c in (8, 16, 32, 64, 128)]),
    "ratio": ("non-zero ratio", [dict(k=11, cin=32, cout=64, density=d)
                                 for d in (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)]),
    "size": ("S (input SxS)", [dict(k=11, cin=3, cout=64, size=(s, s))
                               for s in (64, 128, 256, 512, 1024)]),
}
QUICK = {"kernel": (3, 11), "cin": (32,), "ratio": (0.1,), "size": (128,)}
SWEEP_KEY = {"kernel": "k", "cin": "cin", "cout": "cout", "ratio": "density", "size": "size"}
DENSITY = 0.1
TOLERANCE = {"tf32": 2e-4, "fp16": 2e-2}  # max error / max |reference|
HEADLINE = dict(sweep="kernel", k=11, batch=1)  # the seed's 11x11x3x64 case: target >= 3x


def cases(quick, sweeps=tuple(SWEEPS), batches=(1, 8)):
    for sweep in sweeps:
        for point in SWEEPS[sweep][1]:
            value = point.get(SWEEP_KEY[sweep])
            if quick and (sweep not in QUICK or (value[0] if sweep == "size" else value)
                          not in QUICK[sweep]):
                continue
            for batch in ((1,) if quick else batches):
                for precision in PRECISIONS:
                    yield dict(sweep=sweep, batch=batch, precision=precision,
                               size=point.get("size", SIZE), k=point["k"], cin=point["cin"],
                               cout=point["cout"], density=point.get("density", DENSITY))


def _pruned_weight(rng, k, cin, cout, density):
    """HWIO float32 weight with exactly round(density * size) random non-zero taps."""
    total = k * k * cin * cout
    w = numpy.zeros(total, numpy.float32)
    keep = rng.choice(total, max(1, round(density * total)), replace=False)
    w[keep] = rng.standard_normal(keep.size) * math.sqrt(2 / (k * k * cin * density))
    return w.reshape(k, k, cin, cout)


def _weight_rng(case):
    """The random generator of a case's weight: one per sweep point, so that both batches and
    every input size (and so their "compiled" kernels) share it."""
    return numpy.random.default_rng([case["k"], case["cin"], case["cout"],
                                     round(case["density"] * 1000)])


def _case_weights(case):
    """The case's pruned float32 weight and its crossover probe's (half the non-zeros)."""
    weights = _weight_rng(case)
    shape = case["k"], case["cin"], case["cout"]
    return (_pruned_weight(weights, *shape, case["density"]),
            _pruned_weight(weights, *shape, case["density"] / 2))


def _compile_case(case):
    """Runs the "compiled" kernels of a case's weight and probe once on a zero image of the
    case's size (batch 1: the kernels' code does not depend on the batch)."""
    import cupy

    dtype = PRECISIONS[case["precision"]]
    x = cupy.zeros((1, *case["size"], case["cin"]), dtype)
    for w in _case_weights(case):
        kernel = sbnet_cupy.SparseKernel.from_dense(cupy.asarray(w).astype(dtype))
        try:
            sbnet_cupy.sparse_kernel_conv2d(x, kernel, strategy="compiled")
        except (TypeError, ValueError):  # "compiled" does not apply
            pass
    cupy.cuda.Device().synchronize()


def precompile(cases, workers):
    """Compiles the "compiled" kernels of `cases` in `workers` processes: NVRTC takes seconds a
    mask, most of a cold run's time one after another; CuPy's disk cache then serves the run."""
    points = {(c["sweep"], c["k"], c["cin"], c["cout"], c["density"], c["size"], c["precision"]):
              c for c in cases}
    context = multiprocessing.get_context("spawn")  # a forked child cannot use CUDA
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        list(pool.map(_compile_case, points.values()))


def _torch_graph_ms(torch, fn, launches, repeats):
    """Median time of one call of fn, from a CUDA graph of `launches` calls back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # cudnn.benchmark picks its algorithm on the first call
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times) / launches


def _launches(ms):
    """Launches a graph: enough for ~2 ms a replay, at most 20."""
    return max(1, min(20, round(2 / max(ms, 1e-3))))


def run_case(torch, cupy, case, repeats):
    height, width = case["size"]
    n, k, cin, cout = case["batch"], case["k"], case["cin"], case["cout"]
    dtype = getattr(torch, PRECISIONS[case["precision"]])
    x = torch.randn(n, cin, height, width, device="cuda").to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    x_nhwc = cupy.from_dlpack(x.permute(0, 2, 3, 1))  # the same memory, NHWC
    w_host, probe_host = _case_weights(case)
    w = torch.tensor(w_host, device="cuda").to(dtype)
    w_dense = w.permute(3, 2, 0, 1).contiguous(memory_format=torch.channels_last)
    kernel = sbnet_cupy.SparseKernel.from_dense(cupy.from_dlpack(w))
    out = cupy.empty((n, height, width, cout), x_nhwc.dtype)

    torch.backends.cudnn.allow_tf32 = False
    reference = torch.nn.functional.conv2d(x.float(), w_dense.float(), padding="same")
    reference = reference.permute(0, 2, 3, 1)
    scale = float(reference.abs().max())
    pixels = n * height * width
    plan = lambda kernel, strategy=None: skc.conv_plan(
        strategy, kernel.dtype, n, (height, width), cin, (height, width), cout, (k, k), (1, 1),
        (1, 1), (k // 2, k // 2), (1, 1), kernel.nnz, x_nhwc.data.device_id)
    row = dict(case, size=f"{height}x{width}", nnz=kernel.nnz)
    measured = []
    for strategy in skc.STRATEGIES:
        try:
            plan(kernel, strategy)
        except (TypeError, ValueError):  # does not apply ("compiled" above its taps)
            continue
        measured.append(strategy)
        call = lambda: sbnet_cupy.sparse_kernel_conv2d(x_nhwc, kernel, out=out, strategy=strategy)
        call()
        error = float((torch.from_dlpack(out).float() - reference).abs().max()) / scale
        if not error <= TOLERANCE[case["precision"]]:
            raise AssertionError(f"{strategy} is off by {error:.2e} (relative) on {row}")
        start = time.perf_counter()
        call()
        cupy.cuda.get_current_stream().synchronize()
        ms = _graph_ms(cupy, [call] * _launches(1e3 * (time.perf_counter() - start)), repeats)
        row[f"{strategy}_ms"] = ms
    row["best"] = min(measured, key=lambda s: row[f"{s}_ms"])
    row["best_ms"] = row[f"{row['best']}_ms"]

    conv = lambda: torch.nn.functional.conv2d(x, w_dense, padding="same")
    for name, tf32 in (("cudnn_ms", True), ("cudnn_fp32_ms", False)):
        if name == "cudnn_fp32_ms" and case["precision"] != "tf32":
            continue
        torch.backends.cudnn.allow_tf32 = tf32
        start = time.perf_counter()
        conv()
        torch.cuda.synchronize()
        row[name] = _torch_graph_ms(torch, conv, _launches(1e3 * (time.perf_counter() - start)),
                                    repeats)
    torch.backends.cudnn.allow_tf32 = True
    row["cudnn_tflops"] = 2 * k * k * cin * cout * pixels / row["cudnn_ms"] / 1e9
    score(row)

    # Crossover: our time is about linear in the non-zero taps; probe half of them with the
    # same strategy (a "compiled" probe costs a compilation, a denser one more).
    probe = sbnet_cupy.SparseKernel.from_dense(cupy.asarray(probe_host).astype(x_nhwc.dtype))
    call = lambda: sbnet_cupy.sparse_kernel_conv2d(x_nhwc, probe, out=out,
                                                   strategy=row["strategy"])
    call()
    probe_ms = _graph_ms(cupy, [call] * _launches(row["ours_ms"] * 4), repeats)
    d0, d1 = kernel.density, probe.density
    slope = (probe_ms - row["ours_ms"]) / (d1 - d0)
    row["crossover"] = (d0 + (row["cudnn_ms"] - row["ours_ms"]) / slope if slope > 0
                        else float("nan"))
    return row


def score(row):
    """Set a row's strategy to the rule's (choose_strategy on the row's case) and the columns
    that follow from that strategy's time as measured: ours_ms, tflops, speedup (over
    cudnn_ms) and vs_best = ours_ms / best_ms."""
    height, width = (int(side) for side in row["size"].split("x"))
    n, k = row["batch"], row["k"]
    row["strategy"] = skc.choose_strategy(
        PRECISIONS[row["precision"]], n, (height, width), row["cin"], (height, width),
        row["cout"], (k, k), (1, 1), (1, 1), (k // 2, k // 2), (1, 1), row["nnz"],
        info=_launch.H100)  # the committed runs' GPU
    row["ours_ms"] = row[f"{row['strategy']}_ms"]
    row["tflops"] = 2 * row["nnz"] * n * height * width / row["ours_ms"] / 1e9
    row["speedup"] = row["cudnn_ms"] / row["ours_ms"]
    row["vs_best"] = row["ours_ms"] / row["best_ms"]


def _rule_summary(rows):
    """How the rule did, over the cases where more than one strategy was timed."""
    both = [r for r in rows if all(f"{s}_ms" in r for s in skc.STRATEGIES)]
    if not both:
        return []
    worst = max(both, key=lambda r: r["vs_best"])
    total = sum(r["ours_ms"] for r in both) / sum(r["best_ms"] for r in both)
    return [f"- The rule's strategy (choose_strategy) was the faster in "
            f"{sum(r['strategy'] == r['best'] for r in both)} of the {len(both)} cases where "
            f"both ran; worst {worst['vs_best']:.3f}x the faster ({worst['k']}x{worst['k']}x"
            f"{worst['cin']}x{worst['cout']} on {worst['batch']}x{worst['size']}, "
            f"{worst['precision']}); their total time {total:.4f}x the faster choices'"]


def _row_text(r):
    return (f"{r['sweep']:>6} n={r['batch']} {r['precision']:>4} {r['size']:>9} k={r['k']:<2} "
            f"{r['cin']:>2}->{r['cout']:<3} d={r['density']:<5} ours {r['ours_ms']:.4f} ms "
            f"({r['strategy']}; best {r['best']} {r['best_ms']:.4f}) {r['tflops']:6.1f} TFLOP/s"
            f" | cuDNN {r['cudnn_ms']:.4f} ms: {r['speedup']:.2f}x, crossover "
            f"{r['crossover']:.2f}")


def write_markdown(rows, path, device, stamp):
    """The tables; `stamp`: when and by which command the rows were made."""
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = [f"# Pruned-kernel convolution against cuDNN on {device}", "",
             f"{stamp}. Times in ms (CUDA graphs, median); speed-up = cuDNN / ours (rule's "
             f"strategy); vs_best = ours / the faster strategy; crossover: estimated ratio of "
             f"non-zeros above which cuDNN is faster (probed with the rule's strategy of the "
             f"run).", "", *_rule_summary(rows)]
    for row in rows:
        if all(row.get(k) == v for k, v in HEADLINE.items()) and row["size"] == "256x512":
            lines.append(f"- Headline, 11x11x3x64 on 1x256x512x3 at 10%, {row['precision']}: "
                         f"ours {row['ours_ms']:.4f} ms, cuDNN {row['cudnn_ms']:.4f} ms: "
                         f"**{row['speedup']:.2f}x** (target >= 3x)")
    columns = ["batch", "precision", "size", "k", "cin", "cout", "density", "nnz", "strategy",
               "ours_ms", "tflops", "best", "best_ms", "vs_best",
               *(f"{s}_ms" for s in skc.STRATEGIES),
               "cudnn_ms", "cudnn_fp32_ms", "speedup", "crossover"]
    for sweep, (label, _) in SWEEPS.items():
        chosen = [r for r in rows if r["sweep"] == sweep]
        if not chosen:
            continue
        lines += ["", f"## {sweep} sweep ({label})", "", "| " + " | ".join(columns) + " |",
                  "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in chosen]
    path.write_text("\n".join(lines) + "\n")


def plot(rows, path):
    """A panel per sweep and batch: time against the swept value, ours (rule) and cuDNN, TF32
    and fp16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [s for s in SWEEPS if any(r["sweep"] == s for r in rows)]
    batches = sorted({r["batch"] for r in rows})
    fig, grid = plt.subplots(len(batches), len(sweeps), squeeze=False,
                             figsize=(4.2 * len(sweeps), 3.6 * len(batches)))
    for axes, batch in zip(grid, batches):
        for ax, sweep in zip(axes, sweeps):
            key = SWEEP_KEY[sweep]
            for precision, color in (("tf32", "tab:blue"), ("fp16", "tab:orange")):
                chosen = [r for r in rows if (r["sweep"], r["batch"], r["precision"]) ==
                          (sweep, batch, precision)]
                if not chosen:
                    continue
                xs = [int(str(r[key]).split("x")[0]) if key == "size" else r[key] for r in chosen]
                ax.plot(xs, [r["ours_ms"] for r in chosen], "o-", color=color,
                        label=f"ours {precision}")
                ax.plot(xs, [r["cudnn_ms"] for r in chosen], "s--", color=color,
                        label=f"cuDNN {precision}")
            ax.set_yscale("log")
            if sweep in ("size", "ratio"):
                ax.set_xscale("log")
            ax.set_title(f"{sweep}, batch {batch}")
            ax.set_xlabel(SWEEPS[sweep][0])
            ax.legend(fontsize=6)
        axes[0].set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    parser = results_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="a few cases, batch 1 (< 2 min)")
    parser.add_argument("--sweeps", nargs="+", choices=list(SWEEPS), default=list(SWEEPS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--replot", type=pathlib.Path, help="only redraw the plot of this CSV")
    parser.add_argument("--rescore", type=pathlib.Path,
                        help="only score the rule again, the current one, in this CSV (the "
                        "times as measured) and rewrite it with its .md and .png")
    args = parser.parse_args(argv)
    if args.replot:
        plot(read_csv(args.replot), args.replot.with_suffix(".png"))
        return 0
    if args.rescore:
        return rescore(args.rescore)
    require_gpu("bench.sparse_kernel_conv")
    import cupy
    import torch

    torch.backends.cudnn.benchmark = True
    device = torch.cuda.get_device_name()
    suffix = "_quick" if args.quick else "".join(
        f"_{s}" for s in args.sweeps if args.sweeps != list(SWEEPS)) + "".join(
        f"_n{b}" for b in args.batches if args.batches != [1, 8])
    name = results_stem(args.out, f"sparse_kernel_conv{suffix}", device).name
    command = "python -m bench.sparse_kernel_conv " + " ".join(
        argv if argv is not None else sys.argv[1:])
    started = time.time()
    try:  # only a head start: the run compiles what is missing itself
        precompile(list(cases(args.quick, args.sweeps, args.batches)), min(16, os.cpu_count()))
        print(f"compiled the masks' kernels in {time.time() - started:.0f} s", flush=True)
    except Exception as error:
        print(f"compiling ahead failed, the run compiles as it goes: {error!r}", flush=True)
    rows, started = [], time.time()
    for case in cases(args.quick, args.sweeps, args.batches):
        rows.append(run_case(torch, cupy, case, args.repeats))
        cupy.get_default_memory_pool().free_all_blocks()  # the case's tensors are gone
        torch.cuda.empty_cache()
        print(_row_text(rows[-1]), f"[{time.time() - started:.0f} s]", flush=True)
        # After every row: a timeout keeps the rows done.
        write_csv(rows, args.out / f"{name}.csv", digits=5)
    write_markdown(rows, args.out / f"{name}.md", device,
                   f"{datetime.date.today()}, `{command}`")
    plot(rows, args.out / f"{name}.png")
    return 0


def rescore(path):
    """score() on every row of a committed run (e.g. after the rule changed), its tables and
    plot written again. A row whose strategy changes loses its crossover, probed with the
    strategy of the run; the others keep the values computed from the unrounded times."""
    rows = read_csv(path)
    for row in rows:
        as_run = dict(row)
        score(row)
        if row["strategy"] == as_run["strategy"]:
            row.update(tflops=as_run["tflops"], speedup=as_run["speedup"])
        else:
            row.pop("crossover", None)
    title, _, stamp = path.with_suffix(".md").read_text().splitlines()[:3]
    measured = stamp.split(". Times in ms")[0].split("; strategies scored again")[0]
    write_csv(rows, path, digits=5)
    write_markdown(rows, path.with_suffix(".md"), title.split(" on ", 1)[1],
                   f"{measured}; strategies scored again on {datetime.date.today()} by "
                   f"`python -m bench.sparse_kernel_conv --rescore {path}`")
    plot(rows, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
