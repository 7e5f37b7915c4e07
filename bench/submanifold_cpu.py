"""CPU forward of OpenPCDet's sparse backbones (bench/spconv_models.py): torch_bridge.submanifold
against spconv's CPU build, on the same weights, in eval mode without gradients, on a
synthetic KITTI-like sweep (bench/lidar.py: 64 beams, SECOND's 41 x 1600 x 1408 grid).

Each forward builds its rulebooks, as a detector's does. Times: per forward, the median over
--repeats after one warm-up, ours and spconv taking turns, as process CPU time (less sensitive to
other work on a shared machine; on one thread, the forward's time) and as wall time; the ratio
is of CPU times on one thread, of wall times on more. Outputs are checked against spconv's
(same sites, features to float32 rounding). spconv 2.3.8's CPU build gives wrong, varying
strided convolutions with more than one thread, so spconv runs on one thread throughout.
Writes <out>/submanifold_cpu_<cpu>.md.

    python -m bench.submanifold_cpu [--repeats 5] [--sweeps 1] [--threads 1 2]
"""

import argparse
import os
import pathlib
import platform
import re
import statistics
import time

import torch

import torch_bridge.submanifold as ours
from bench import lidar, spconv_models

MODELS = ["voxel_backbone_8x", "voxel_res_backbone_8x", "unet_v2"]


def cpu_name():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def timed(runs, repeats):
    """{label: (median CPU ms, median wall ms, last output)} of each runs[label] = (fn,
    threads), the labels taking turns in every repeat (so that other work on the machine
    weighs on all alike), after a warm-up of each."""
    times = {label: ([], []) for label in runs}
    outputs = {}
    for repeat in range(repeats + 1):
        for label, (fn, threads) in runs.items():
            torch.set_num_threads(threads)
            c, w = time.process_time(), time.perf_counter()
            outputs[label] = fn()
            if repeat:  # the first round warms up
                times[label][0].append((time.process_time() - c) * 1e3)
                times[label][1].append((time.perf_counter() - w) * 1e3)
    return {label: (statistics.median(cpu), statistics.median(wall), outputs[label])
            for label, (cpu, wall) in times.items()}


def by_site(t):
    key = t.indices[:, 0].long()
    for axis, size in enumerate(t.spatial_shape):
        key = key * size + t.indices[:, 1 + axis].long()
    order = torch.argsort(key)
    return t.indices[order], t.features[order]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweeps", type=int, default=1, help="batch size (sweeps)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="torch threads for ours (a row each)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    import spconv.pytorch as spconv

    coords, features = lidar.batch(0, args.sweeps)
    indices, features = torch.from_numpy(coords), torch.from_numpy(features)
    shape = list(lidar.GRID)
    rows = []
    for name in MODELS:
        torch.manual_seed(0)
        theirs = getattr(spconv_models, name)(spconv).eval()
        mine = getattr(spconv_models, name)(ours).eval()
        mine.load_state_dict(theirs.state_dict(), strict=True)
        def forward(ns, net):
            return lambda: net(ns.SparseConvTensor(features, indices, shape, args.sweeps))

        runs = {("ours", t): (forward(ours, mine), t) for t in args.threads}
        runs["spconv"] = (forward(spconv, theirs), 1)
        with torch.no_grad():
            results = timed(runs, args.repeats)
        want = results["spconv"][2]
        wi, wf = by_site(want[0] if isinstance(want, tuple) else want)
        for threads in args.threads:
            got = results[("ours", threads)][2]
            gi, gf = by_site(got[0] if isinstance(got, tuple) else got)
            error = (((gf - wf).abs().max() / wf.abs().max()).item() if torch.equal(gi, wi)
                     else None)
            rows.append(dict(model=name, sites=indices.shape[0], threads=threads,
                             ours_cpu=results[("ours", threads)][0],
                             ours_wall=results[("ours", threads)][1],
                             spconv_cpu=results["spconv"][0], spconv_wall=results["spconv"][1],
                             error=error))
            print(rows[-1], flush=True)
    write(rows, args, cpu_name())


def ratio(row):
    """Ours over spconv: CPU times where ours runs on one thread (the less noisy measure of a
    forward then), wall times where it runs on more (its CPU time is then several threads')."""
    if row["threads"] == 1:
        return row["ours_cpu"] / row["spconv_cpu"]
    return row["ours_wall"] / row["spconv_wall"]


def write(rows, args, cpu):
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", cpu).strip("_")
    version = getattr(__import__("spconv"), "__version__", "?")
    lines = [f"# Sparse backbones on the CPU: torch_bridge.submanifold vs spconv {version}", "",
             f"CPU: {cpu} ({os.cpu_count()} cores); torch {torch.__version__}; spconv on one "
             f"thread; "
             f"{args.sweeps} sweep(s) of bench/lidar.py (seed 0) on SECOND's "
             f"{' x '.join(map(str, lidar.GRID))} grid; eval mode, no gradients, rulebooks "
             f"built in every forward; median of {args.repeats} (taking turns) after a warm-up "
             f"(`python -m bench.submanifold_cpu`). ours / spconv: CPU times where ours runs "
             f"on one thread, wall times where it runs on more. Load average when written: "
             f"{os.getloadavg()[0]:.1f} (other work on the machine inflates both libraries' "
             f"times).", "",
             "| model | input sites | our threads | ours CPU ms | spconv CPU ms | ours wall ms "
             "| spconv wall ms | ours / spconv | max rel. difference |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        error = "sites differ" if r["error"] is None else f"{r['error']:.1e}"
        lines.append(f"| {r['model']} | {r['sites']} | {r['threads']} | {r['ours_cpu']:.1f} | "
                     f"{r['spconv_cpu']:.1f} | {r['ours_wall']:.1f} | {r['spconv_wall']:.1f} | "
                     f"{ratio(r):.2f} | {error} |")
    path = out / f"submanifold_cpu_{slug}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
