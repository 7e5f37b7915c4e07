"""Dilated 3x3 convolution through space-to-batch reshapes against the native dilation (the
seed's benchmark, on a modern GPU), and the reshape kernels against the copy bandwidth.

    python -m bench.dilated [--quick] [--out DIR] [--modes eager graph] [--repeats N]
                            [--rounds N] [--conv-layout auto|nchw] [--rescore CSV]
                            [--fit CSV]

Three routes per configuration, in the same run: "ours" = torch_bridge.dilated_conv2d
(method="reshape": space_to_batch -> cuDNN convolution -> batch_to_space on this library's
kernels, the convolution in channels_last where conv_channels_last says so, unless
--conv-layout nchw); "torch" = the same route built from torch's own ops (F.pad,
pixel_unshuffle and a permute before, a permute and pixel_shuffle after: the route of the
issue's anchors); "native" = F.conv2d(dilation=r). Three passes: forward (no grad), backward wrt
the input alone, backward wrt the weights alone (each from a forward recorded once). TF32
(float32, TF32 allowed) and fp16, NCHW tensors, cudnn.benchmark on. Every route is checked
against the native one before it is timed. Timing: CUDA events around each call (mode
"eager", what a Python caller sees, host time included) or around the replay of a CUDA graph
of the call ("graph": GPU time), median of --repeats after warm-up; the tables take the
median of --rounds such times, measured over all configurations in turn. "auto" is what
method="auto" picks (torch_bridge.dilated.reshape_wins, its table for the timing's kind: eager or
captured), scored with the times measured here; --rescore scores a committed run again, and
--fit prints the tables that fit a run (RESHAPE_WINS_EAGER and RESHAPE_WINS_GRAPHED).
"conv" times the route's convolution alone (on the space_to_batch of x, in the route's layout,
by the weight the route hands it): no reshape can take the route below it, so torch ops / conv
is the most that any reshape route could gain over torch's ("ceiling" in the tables).

The reshape kernels alone run in CUDA graphs, a launch on its own buffers each (so the L2
cache does not hold the data between launches), against a 1 GiB device-to-device copy measured
in the same run (read + write bytes) and against a copy of the same bytes timed as they are,
beside torch's ops for the same reshape, in three layouts:
NCHW, NHWC (channels_last tensors) and NCHW>NHWC (NCHW x, channels_last y: mixed=True).

Writes <out>/dilated_<device>.csv (routes), dilated_reshapes_<device>.csv (kernels),
dilated_<device>.md and dilated_<device>.png.
"""

import datetime
import itertools
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import torch_bridge as tb
from sbnet_cupy.dilated.space_to_batch import dilated_conv_geometry
from bench._common import (events_ms, graph, read_csv, require_gpu, results_parser, results_stem,
                           write_csv)
from torch_bridge.dilated import conv as dilated

# (N, C_in, K, H = W, rate): the seed's runs (batch 128, 3 -> 128, scale 2), wider layers at
# scales 2, 4, 8, and a DeepLab ASPP branch (2048 -> 256 channels at rate 12, 64 not a multiple).
CONFIGS = ([(128, 3, 128, size, 2) for size in (64, 32, 16)]
           + [(n, c, c, 64, r) for n, c in ((64, 64), (16, 256), (8, 512)) for r in (2, 4, 8)]
           + [(1, 2048, 256, 64, 12)])
QUICK_CONFIGS = [(128, 3, 128, 64, 2), (16, 256, 256, 64, 8), (1, 2048, 256, 64, 12)]
PRECISIONS = {"tf32": torch.float32, "fp16": torch.float16}
PASSES = ("forward", "backward_input", "backward_weight")
DTYPE_NAMES = {"tf32": "float32", "fp16": "float16"}  # what reshape_wins calls each precision
ROUTES = ("ours", "torch", "native")
TIMED = ROUTES + ("conv",)  # and the route's convolution alone
TOLERANCE = {"tf32": 1e-2, "fp16": 2e-2}  # largest error / largest value, against native
# (N, C, H = W, rate) of the reshape kernels alone, each in both precisions and layouts.
RESHAPES = [(n, c, 64, r) for n, c, r in ((128, 3, 2), (128, 128, 2), (64, 64, 2), (64, 64, 8),
                                          (16, 256, 4), (8, 512, 8), (1, 2048, 12))]
# The quick run's: one large rate-2 case, rate 8 (fp16 NCHW was the slowest) and the DeepLab
# case (64 px padded to 72, 6-pixel sub-lattices).
QUICK_RESHAPES = [(128, 128, 64, 2), (64, 64, 64, 8), (1, 2048, 64, 12)]


# --- the routes -----------------------------------------------------------------------------

def _torch_route(x, w, r, g):
    """space_to_batch -> conv -> batch_to_space from torch's ops (square rate r)."""
    (top, bottom), (left, right) = g.paddings
    if top or bottom or left or right:
        x = F.pad(x, (left, right, top, bottom))
    y = _unshuffle(x, r)
    z = F.conv2d(y, w, padding=g.conv_padding)
    out = _shuffle(z, r)
    (_, crop_h), (_, crop_w) = g.crops
    return out[:, :, :out.shape[2] - crop_h, :out.shape[3] - crop_w]


def _unshuffle(x, r):
    n, c, h, w = x.shape
    y = F.pixel_unshuffle(x, r).view(n, c, r, r, h // r, w // r)
    return y.permute(2, 3, 0, 1, 4, 5).reshape(r * r * n, c, h // r, w // r)


def _shuffle(z, r):
    batch, k, h, w = z.shape
    n = batch // (r * r)
    z = z.view(r, r, n, k, h, w).permute(2, 3, 0, 1, 4, 5).reshape(n, k * r * r, h, w)
    return F.pixel_shuffle(z, r)


def _route(name, r):
    if name == "native":
        return lambda x, w: F.conv2d(x, w, padding=r, dilation=r)
    if name == "ours":
        return lambda x, w: tb.dilated_conv2d(x, w, dilation=r, padding=r, method="reshape")

    def torch_ops(x, w):
        g = dilated_conv_geometry(tuple(x.shape[2:]), tuple(w.shape[2:]), (r, r),
                                  ((r, r), (r, r)), conv_padding=True)
        return _torch_route(x, w, r, g)

    return torch_ops


# --- timing ---------------------------------------------------------------------------------

def _conv_alone(x, w, gy, r):
    """(call, y, gz): the reshape route's convolution as `route` takes (y, w), on y =
    space_to_batch(x) as the route makes it, and a gradient gz of its output (gy's values)."""
    g = dilated_conv_geometry(tuple(x.shape[2:]), tuple(w.shape[2:]), (r, r), ((r, r), (r, r)),
                              conv_padding=True)
    mixed = dilated.conv_channels_last(x, w)
    with torch.no_grad():
        y = tb.space_to_batch(x, (r, r), g.paddings, mixed=mixed)
        gz = tb.space_to_batch(gy, (r, r), g.crops, mixed=mixed)

    def conv(y, w):
        return F.conv2d(y, dilated._conv_weight(w, y), padding=g.conv_padding)

    return conv, y, gz


def _time(make_call, mode, repeats):
    """Median ms of the call that make_call() returns (after recording what it needs)."""
    if mode == "eager":
        return events_ms(make_call(), repeats)
    # Graph mode: the forward is recorded on the capture stream, where autograd then runs the
    # backward (it follows the forward's stream), so the capture holds the backward alone.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call = make_call()
        for _ in range(3):  # cudnn.benchmark tunes outside the capture
            call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    ms = events_ms(graph.replay, repeats)
    del graph
    return ms


def _pass_call(route, pass_name, x, w, gy):
    """make_call for one pass of `route`: the backward passes record the forward first, with
    only the input or only the weights requiring grad."""
    def make_call():
        if pass_name == "forward":
            def forward():
                with torch.no_grad():
                    route(x, w)
            return forward
        xg = x.detach().requires_grad_(pass_name == "backward_input")
        wg = w.detach().requires_grad_(pass_name == "backward_weight")
        out = route(xg, wg)
        wrt = xg if pass_name == "backward_input" else wg
        return lambda: torch.autograd.grad(out, wrt, gy, retain_graph=True)

    return make_call


PASS_GRADS = {"forward": None, "backward_input": "input", "backward_weight": "weight"}


def score_auto(row, mode):
    """What method="auto" picks for a row's configuration and pass, timed in `mode` ("graph":
    as captured in a CUDA graph), and its time against the faster of reshape and native:
    row[auto_<mode>] and row[auto_<mode>_vs_best]."""
    precision = DTYPE_NAMES[row["precision"]]
    wins = dilated.reshape_wins(precision, row["C"], row["K"], row["rate"],
                                row["N"] * row["size"] ** 2, PASS_GRADS[row["pass_"]],
                                graphed=mode == "graph")
    row[f"auto_{mode}"] = "reshape" if wins else "native"
    picked = row[f"{'ours' if wins else 'native'}_{mode}_ms"]
    row[f"auto_{mode}_vs_best"] = picked / min(row[f"ours_{mode}_ms"], row[f"native_{mode}_ms"])


def _check(routes, x, w, gy, precision):
    """Forward and both gradients of every route against the native one."""
    results = {}
    for name, route in routes.items():
        xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        out = route(xg, wg)
        results[name] = (out.detach(), *torch.autograd.grad(out, (xg, wg), gy))
    for name, values in results.items():
        for what, got, want in zip(("output", "grad x", "grad w"), values, results["native"]):
            error = (got.float() - want.float()).abs().max() / want.float().abs().max()
            if not error <= TOLERANCE[precision]:
                raise AssertionError(f"{name} route, {what}: error {float(error):.2e} of the "
                                     f"largest value")


def run_config(config, precision, modes, repeats):
    n, c, k, size, r = config
    dtype = PRECISIONS[precision]
    x = torch.randn(n, c, size, size, device="cuda", dtype=dtype)
    w = (torch.randn(k, c, 3, 3, device="cuda") / math.sqrt(9 * c)).to(dtype)
    gy = torch.randn(n, k, size, size, device="cuda", dtype=dtype)
    routes = {name: _route(name, r) for name in ROUTES}
    _check(routes, x, w, gy, precision)
    conv, y, gz = _conv_alone(x, w, gy, r)
    rows = []
    for pass_name in PASSES:
        row = dict(N=n, C=c, K=k, size=size, rate=r, precision=precision, pass_=pass_name)
        for mode in modes:
            for name, route in routes.items():
                row[f"{name}_{mode}_ms"] = _time(_pass_call(route, pass_name, x, w, gy), mode,
                                                 repeats)
            row[f"conv_{mode}_ms"] = _time(_pass_call(conv, pass_name, y, w, gz), mode, repeats)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def median_of_rounds(rounds, modes):
    """One row per pass from the rows of every round: each route's median time, then the
    speed-ups and method="auto"'s score from those."""
    rows = []
    for samples in zip(*rounds):
        row = dict(samples[0])
        for mode in modes:
            for name in TIMED:
                key = f"{name}_{mode}_ms"
                row[key] = statistics.median(sample[key] for sample in samples)
            score_auto(row, mode)
            row[f"ours_vs_torch_{mode}"] = row[f"torch_{mode}_ms"] / row[f"ours_{mode}_ms"]
            row[f"ours_vs_native_{mode}"] = row[f"native_{mode}_ms"] / row[f"ours_{mode}_ms"]
            row[f"ceiling_vs_torch_{mode}"] = row[f"torch_{mode}_ms"] / row[f"conv_{mode}_ms"]
        rows.append(row)
    return rows


# --- the reshape kernels alone --------------------------------------------------------------

def copy_bandwidth(repeats):
    """GB/s of a 1 GiB device-to-device copy with CuPy (as bench.ops measures it)."""
    import cupy

    from bench.ops import copy_bandwidth as cupy_copy_bandwidth

    return cupy_copy_bandwidth(cupy, repeats)


def _graph_per_launch_ms(launches, repeats):
    def run():
        for launch in launches:
            launch()

    return events_ms(graph(run).replay, repeats) / len(launches)


# Layouts of the reshapes alone: x's and y's memory formats, and whether the kernels move the
# channels (NCHW x, channels_last y: what the route's convolution in channels_last takes).
LAYOUTS = {"NCHW": (torch.contiguous_format, torch.contiguous_format, False),
           "NHWC": (torch.channels_last, torch.channels_last, False),
           "NCHW>NHWC": (torch.contiguous_format, torch.channels_last, True)}


def run_reshape(case, dtype_name, layout, copy_gbs, repeats):
    n, c, size, r = case
    dtype = PRECISIONS[dtype_name]
    x_format, y_format, mixed = LAYOUTS[layout]
    g = dilated_conv_geometry((size, size), (3, 3), (r, r), ((r, r), (r, r)), conv_padding=True)
    x = torch.randn(n, c, size, size, device="cuda", dtype=dtype).to(memory_format=x_format)
    y = tb.space_to_batch(x, r, g.paddings, mixed=mixed)
    if not (y.is_contiguous(memory_format=y_format)
            and torch.equal(y, _torch_space_to_batch(x, r, g))
            and torch.equal(tb.batch_to_space(y, r, g.paddings, mixed=mixed), x)):
        raise AssertionError(f"reshape of {tuple(x.shape)} at rate {r} differs from torch's")
    moved = x.nbytes + y.nbytes
    sets = max(1, min(16, math.ceil(200e6 / moved)))  # > 200 MB a graph: more than L2 holds
    xs = [x.clone(memory_format=x_format) for _ in range(sets)]
    ys = [y.clone(memory_format=y_format) for _ in range(sets)]
    # torch's ops give the layout that their permutes give, but mixed: then the one asked for.
    torch_y, torch_x = (y_format, x_format) if mixed else (None, None)
    cases = {
        ("space_to_batch", "ours"):
            [lambda x=x: tb.space_to_batch(x, r, g.paddings, mixed=mixed) for x in xs],
        ("space_to_batch", "torch"):
            [lambda x=x: _torch_space_to_batch(x, r, g, torch_y) for x in xs],
        ("batch_to_space", "ours"):
            [lambda y=y: tb.batch_to_space(y, r, g.paddings, mixed=mixed) for y in ys],
        ("batch_to_space", "torch"):
            [lambda y=y: _torch_batch_to_space(y, r, g, torch_x) for y in ys],
    }
    # A device-to-device copy of the same bytes, timed the same way: what the per-launch costs
    # that a 1 GiB copy spreads thin (the launch, the first and last waves) leave at this size.
    sources = [torch.empty(moved // 2, dtype=torch.uint8, device="cuda") for _ in range(sets)]
    targets = [torch.empty_like(source) for source in sources]
    copy_ms = _graph_per_launch_ms([lambda s=s, t=t: t.copy_(s)
                                    for s, t in zip(sources, targets)], repeats)
    rows = []
    with torch.no_grad():
        for (op, impl), launches in cases.items():
            ms = _graph_per_launch_ms(launches, repeats)
            gbs = moved / ms / 1e6
            rows.append(dict(op=op, impl=impl, N=n, C=c, size=size, rate=r, dtype=dtype_name,
                             layout=layout, MB=moved / 1e6, us=ms * 1e3, GBs=gbs,
                             of_copy=gbs / copy_gbs, same_size_copy_us=copy_ms * 1e3,
                             of_same_size_copy=copy_ms / ms))
    del xs, ys, sources, targets
    torch.cuda.empty_cache()
    return rows


def _torch_space_to_batch(x, r, g, memory_format=None):
    (top, bottom), (left, right) = g.paddings
    padded = F.pad(x, (left, right, top, bottom)) if top + bottom + left + right else x
    y = _unshuffle(padded, r)
    return y if memory_format is None else y.contiguous(memory_format=memory_format)


def _torch_batch_to_space(y, r, g, memory_format=None):
    (top, bottom), (left, right) = g.paddings
    out = _shuffle(y, r)
    out = out[:, :, top:out.shape[2] - bottom, left:out.shape[3] - right]
    return out if memory_format is None else out.contiguous(memory_format=memory_format)


# --- results --------------------------------------------------------------------------------

def _label(row):
    return f"{row['N']}x{row['C']}->{row['K']} {row['size']}px r{row['rate']}"


def run_stamp(command):
    """When and with what a run was measured, for write_markdown."""
    return (f"{datetime.date.today()}, `{command}`, torch {torch.__version__}, cuDNN "
            f"{torch.backends.cudnn.version()}")


def write_markdown(path, device, stamp, copy_gbs, rows, reshape_rows, modes):
    lines = [f"# Dilated 3x3 convolution through reshapes on {device}", "",
             f"{stamp}. Median ms; speed-up = other route's time / ours. Copy bandwidth (1 GiB, "
             f"read + write): **{copy_gbs:.0f} GB/s**.", ""]
    for mode in modes:
        lines += [f"## Routes, {mode}", "",
                  "| config | precision | pass | native | ours | torch ops | conv alone | "
                  "ours vs torch | ceiling vs torch | ours vs native | auto (vs best) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ceiling = r.get(f"ceiling_vs_torch_{mode}")  # runs before it have no conv column
            lines.append(
                f"| {_label(r)} | {r['precision']} | {r['pass_']} | {r[f'native_{mode}_ms']:.3f} | "
                f"{r[f'ours_{mode}_ms']:.3f} | {r[f'torch_{mode}_ms']:.3f} | "
                + (f"{r[f'conv_{mode}_ms']:.3f} | " if ceiling else "| ")
                + f"{r[f'ours_vs_torch_{mode}']:.2f}x | "
                + (f"{ceiling:.2f}x | " if ceiling else "| ")
                + f"{r[f'ours_vs_native_{mode}']:.2f}x | "
                f"{r[f'auto_{mode}']} ({r[f'auto_{mode}_vs_best']:.2f}) |")
        worst_torch = min(r[f"ours_vs_torch_{mode}"] for r in rows)
        capped = [r for r in rows if r.get(f"ceiling_vs_torch_{mode}", math.inf) < 1.5]
        worst_auto = max(r[f"auto_{mode}_vs_best"] for r in rows)
        wins = [r for r in rows if r[f"ours_vs_native_{mode}"] > 1]
        lines += ["", f"Targets ({mode}): ours vs torch ops >= 1.5x everywhere: lowest "
                  f"**{worst_torch:.2f}x**; auto within 5% of the faster route: worst "
                  f"**{worst_auto:.2f}**. The reshape route beats the native dilation in "
                  f"{len(wins)} of {len(rows)} cases"
                  + (": " + "; ".join(f"{_label(r)} {r['precision']} {r['pass_']} "
                                      f"{r[f'ours_vs_native_{mode}']:.2f}x" for r in wins)
                     if wins else "") + ".", ""]
        if capped:
            lines += [f"In {len(capped)} of {len(rows)} cases the convolution alone leaves "
                      f"less than 1.5x over torch's route to any reshape route (ceiling < "
                      f"1.5x): " + "; ".join(f"{_label(r)} {r['precision']} {r['pass_']} "
                                             f"{r[f'ceiling_vs_torch_{mode}']:.2f}x"
                                             for r in capped) + ".", ""]
    lines += ["## The reshape kernels alone (CUDA graphs)", "",
              "| op | impl | shape | rate | dtype | layout | MB moved | us | GB/s | of copy | "
              "copy of the same bytes, us | of it |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reshape_rows:
        lines.append(f"| {r['op']} | {r['impl']} | {r['N']}x{r['C']}x{r['size']}x{r['size']} | "
                     f"{r['rate']} | {r['dtype']} | {r['layout']} | {r['MB']:.1f} | "
                     f"{r['us']:.1f} | {r['GBs']:.0f} | {r['of_copy']:.0%} | "
                     f"{r['same_size_copy_us']:.1f} | {r['of_same_size_copy']:.0%} |")
    ours = [r for r in reshape_rows if r["impl"] == "ours" and r["MB"] >= 16]
    if ours:
        lines += ["", f"Target: >= 85% of the copy (1 GiB) at >= 16 MB moved: "
                  f"{sum(r['of_copy'] >= 0.85 for r in ours)} of {len(ours)} cases; lowest "
                  f"**{min(r['of_copy'] for r in ours):.0%}**, median "
                  f"{statistics.median(r['of_copy'] for r in ours):.0%}. Against a copy of the "
                  f"same bytes timed the same way: >= 85% in "
                  f"{sum(r['of_same_size_copy'] >= 0.85 for r in ours)} of {len(ours)}; lowest "
                  f"{min(r['of_same_size_copy'] for r in ours):.0%}, median "
                  f"{statistics.median(r['of_same_size_copy'] for r in ours):.0%}."]
    path.write_text("\n".join(lines) + "\n")


def plot(rows, reshape_rows, modes, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(7 * (len(modes) + 1), 6))
    labels = list(dict.fromkeys(_label(r) for r in rows))
    markers = {"forward": "o", "backward_input": "s", "backward_weight": "^"}
    colors = {"tf32": "tab:blue", "fp16": "tab:orange"}
    for ax, mode in zip(axes, modes):
        for r in rows:
            at = labels.index(_label(r)) + (0.15 if r["precision"] == "fp16" else -0.15)
            ax.plot(at, r[f"ours_vs_native_{mode}"], markers[r["pass_"]],
                    color=colors[r["precision"]])
            ax.plot(at, r[f"native_{mode}_ms"] / r[f"torch_{mode}_ms"], markers[r["pass_"]],
                    color=colors[r["precision"]], fillstyle="none")
        ax.axhline(1, color="black", lw=0.5)
        ax.set_yscale("log")
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("speed-up over the native dilation (same run)")
        ax.set_title(f"{mode}: filled = reshape route on our kernels, open = on torch's ops\n"
                     "o forward, s backward wrt input, ^ backward wrt weights; "
                     "blue TF32, orange fp16", fontsize=8)
    ax = axes[-1]
    for (impl, layout), style in {("ours", "NCHW"): "o", ("ours", "NHWC"): "s",
                                  ("ours", "NCHW>NHWC"): "^", ("torch", "NCHW"): "x",
                                  ("torch", "NHWC"): "+", ("torch", "NCHW>NHWC"): "1"}.items():
        pts = [(r["MB"], r["of_copy"]) for r in reshape_rows
               if r["impl"] == impl and r["layout"] == layout]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{impl} {layout}")
    ax.axhline(0.85, color="gray", ls=":", label="target 85%")
    ax.set_xscale("log")
    ax.set_xlabel("MB moved (read + write)")
    ax.set_ylabel("fraction of the copy bandwidth")
    ax.set_title("space_to_batch and batch_to_space alone", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    parser = results_parser(__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="three configurations and reshapes (the slowest kinds), few repeats")
    parser.add_argument("--modes", nargs="+", default=["eager", "graph"],
                        choices=["eager", "graph"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every route is measured, over all configurations in turn; "
                        "the tables take the median (--quick: 1)")
    parser.add_argument("--conv-layout", choices=["auto", "nchw"], default="auto",
                        help="the reshape route's convolution: channels_last where "
                        "torch_bridge.dilated.conv.conv_channels_last says so, or always NCHW")
    parser.add_argument("--fit", type=pathlib.Path,
                        help="only print the reshape_wins tables that fit this CSV of routes")
    parser.add_argument("--rescore", type=pathlib.Path,
                        help="only score method='auto' again, with the current rule, in this "
                        "CSV of routes (the times as measured) and rewrite it with its .md and "
                        ".png")
    args = parser.parse_args(argv)
    if args.fit:
        rows = read_csv(args.fit)
        for mode, name in (("graph", "RESHAPE_WINS_GRAPHED"), ("eager", "RESHAPE_WINS_EAGER")):
            table = fit_rule(rows, mode)
            print(f"{name} = {{" + "".join(f"\n    {k!r}: {v!r}," for k, v in table.items())
                  + "\n}")
        return 0
    if args.rescore:
        return rescore(args.rescore)
    require_gpu("bench.dilated")
    dilated.CONV_CHANNELS_LAST = args.conv_layout == "auto"
    configs, reshapes = (QUICK_CONFIGS, QUICK_RESHAPES) if args.quick else (CONFIGS, RESHAPES)
    repeats = min(args.repeats, 5) if args.quick else args.repeats
    if args.quick:
        args.rounds = 1
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.cuda.get_device_name()
    stem = results_stem(args.out, "dilated", device)
    reshapes_csv = f"{results_stem(args.out, 'dilated_reshapes', device)}.csv"
    started = time.time()
    copy_gbs = copy_bandwidth(repeats)
    print(f"{device}: copy {copy_gbs:.0f} GB/s", flush=True)

    reshape_rows = []
    for case in reshapes:
        for dtype_name in PRECISIONS:
            for layout in LAYOUTS:
                reshape_rows += run_reshape(case, dtype_name, layout, copy_gbs, repeats)
                for r in reshape_rows[-4:]:
                    print(f"[{time.time() - started:4.0f}s] {r['op']:>14} {r['impl']:5} "
                          f"{r['N']}x{r['C']}x{r['size']}^2 r{r['rate']} {r['dtype']} "
                          f"{r['layout']}: {r['MB']:7.1f} MB {r['us']:8.1f} us "
                          f"{r['GBs']:6.0f} GB/s {r['of_copy']:5.0%}", flush=True)
        write_csv(reshape_rows, reshapes_csv)

    # Rounds over every configuration, each time's median across rounds: eager calls are
    # host-bound, and the host's speed drifts over a run by more than the routes differ.
    cases = [(config, precision) for config in configs for precision in PRECISIONS]
    rounds = [[] for _ in range(args.rounds)]
    for round_, samples in enumerate(rounds):
        for config, precision in cases:
            samples += run_config(config, precision, args.modes, repeats)
            for r in samples[-len(PASSES):]:
                times = "  ".join(f"{m}: native {r[f'native_{m}_ms']:.3f} ours "
                                  f"{r[f'ours_{m}_ms']:.3f} torch {r[f'torch_{m}_ms']:.3f} "
                                  f"conv {r[f'conv_{m}_ms']:.3f}" for m in args.modes)
                print(f"[{time.time() - started:4.0f}s] round {round_ + 1} {_label(r)} "
                      f"{precision} {r['pass_']:>15}: {times} ms", flush=True)
        rows = median_of_rounds(rounds[:round_ + 1], args.modes)
        write_csv(rows, f"{stem}.csv")  # after every round
    command = "python -m bench.dilated " + " ".join(argv if argv is not None else sys.argv[1:])
    write_markdown(pathlib.Path(f"{stem}.md"), device, run_stamp(command), copy_gbs, rows,
                   reshape_rows, args.modes)
    plot(rows, reshape_rows, args.modes, f"{stem}.png")
    print(f"done in {time.time() - started:.0f}s", flush=True)
    return 0


def fit_rule(rows, mode, tolerance=1.05, most=3):
    """The table for reshape_wins that fits the rows of a run in one timing: per dtype and
    gradients recorded, the fewest (C, K, rate, N*H*W) lower bounds (at most `most`, each a
    measured case's, with or without its N*H*W) under which the reshape route is taken, such
    that every case runs within `tolerance` of the faster of reshape and native; among those,
    the least worst case. "both" fits the sum of the two backward passes. Where no set fits,
    the one whose worst case is best, and a warning."""
    cases = {}  # (dtype, grads) -> [((C, K, rate, N*H*W), ours ms, native ms)]
    for r in rows:
        dtype = DTYPE_NAMES[r["precision"]]
        key = (r["C"], r["K"], r["rate"], r["N"] * r["size"] ** 2)
        times = (r[f"ours_{mode}_ms"], r[f"native_{mode}_ms"])
        cases.setdefault((dtype, PASS_GRADS[r["pass_"]]), []).append((key, *times))
    for dtype in ("float32", "float16"):
        by_key = {}
        for grads in ("input", "weight"):
            for key, ours, native in cases.get((dtype, grads), ()):
                total = by_key.get(key, (0, 0))
                by_key[key] = (total[0] + ours, total[1] + native)
        cases[(dtype, "both")] = [(key, *times) for key, times in by_key.items()]
    table = {}
    for group, measured in sorted(cases.items(), key=str):
        candidates = sorted({bound for key, ours, native in measured if ours < native
                             for bound in (key, (*key[:3], 0))})

        def rank(bounds):
            """(missed, worst case if missed, size, worst case, total time): the sets that fit
            first, the fewest bounds among them; else the best worst case."""
            picked = [ours if any(all(v >= b for v, b in zip(key, bound)) for bound in bounds)
                      else native for key, ours, native in measured]
            worst = max(p / min(o, n) for p, (_, o, n) in zip(picked, measured))
            missed = worst > tolerance
            return missed, worst if missed else 0, len(bounds), worst, sum(picked)

        subsets = (s for size in range(most + 1)
                   for s in itertools.combinations(candidates, size))
        best = min(subsets, key=rank)
        missed, _, _, worst, _ = rank(best)
        if missed:
            print(f"warning: {group} {mode}: no table within {tolerance}, worst {worst:.3f}")
        if best:
            table[group] = best
    return table


def rescore(path):
    """score_auto on every row of a committed run (e.g. after the rule was refitted to it), its
    tables and plot written again; the copy bandwidth is recovered from the reshape rows."""
    rows = read_csv(path)
    reshape_rows = read_csv(path.with_name(path.name.replace("dilated_", "dilated_reshapes_")))
    modes = [m for m in ("eager", "graph") if f"ours_{m}_ms" in rows[0]]
    for row in rows:
        for mode in modes:
            score_auto(row, mode)
    copy_gbs = statistics.median(r["GBs"] / r["of_copy"] for r in reshape_rows)
    device = path.stem.removeprefix("dilated_").replace("_", " ")
    # How the run was measured, without an earlier rescore's clause (replaced, not stacked).
    measured = path.with_suffix(".md").read_text().splitlines()[2].split(". Median ms")[0]
    measured = measured.split("; auto scored again on ")[0]
    write_csv(rows, path)
    write_markdown(path.with_suffix(".md"), device, f"{measured}; auto scored again on "
                   f"{datetime.date.today()} by `python -m bench.dilated --rescore {path}`",
                   copy_gbs, rows, reshape_rows, modes)
    plot(rows, reshape_rows, modes, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
