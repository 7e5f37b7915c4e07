"""What the benchmarks share: CUDA-event timing, CUDA-graph capture, their command lines and
their CSV files."""

import argparse
import csv
import pathlib
import re
import statistics
import sys

# Where the benchmarks write unless given --out: bench/results in this clone, whatever the
# current directory.
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def results_parser(doc):
    """The command line of a benchmark whose docstring is `doc` (its first line the
    description), with --out: the folder for its results."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="folder for the results (default: bench/results in this clone)")
    return parser


def require_gpu(module, torch=True):
    """Exit with one line instead of a traceback where no CUDA GPU is usable: the benchmarks
    time GPU kernels. `module` names the benchmark in the message; `torch`: it also needs
    PyTorch's CUDA build."""
    why = None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            why = "no CUDA device"
    except ImportError:
        why = "CuPy is not installed: pip install '.[cuda13]' or '.[cuda12]'"
    except Exception as error:  # no driver, or one too old for this CUDA
        why = str(error).split(':')[0] or type(error).__name__
    if why is None and torch:
        import torch as _torch

        if not _torch.cuda.is_available():
            why = f"PyTorch {_torch.__version__} sees no CUDA device"
    if why is not None:
        sys.exit(f"python -m {module} needs a CUDA GPU ({why}); "
                 "bench/README.md has the results of an H100.")


def events_ms(run, repeats, reset=None, warmup=3):
    """Median ms of run() over `repeats` calls after `warmup`, CUDA events around each call (so
    an eager call's host time counts); reset() before each call, outside the timed region."""
    import torch

    times = []
    for i in range(warmup + repeats):
        if reset is not None:
            reset()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def graph(run):
    """run() captured in a CUDA graph, after three calls on a side stream (kernels compile and
    cudnn.benchmark tunes outside the capture), with frozen weights as CapacityGraphs has them
    (torch_bridge.frozen_weights: the fused kernels' weight copies kept outside the graph)."""
    import torch
    from torch_bridge import frozen_weights

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    with frozen_weights() as weights, torch.cuda.graph(captured):
        run()
    captured.weights = weights  # alive as long as the graph
    return captured


def results_stem(out, name, device):
    """out/<name>_<device>, the stem of a benchmark's result files, with the folder made; in
    the device's name every character but letters, digits, '_', '.' and '-' becomes '_'."""
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{name}_{re.sub(r'[^A-Za-z0-9_.-]', '_', device)}"


def write_csv(rows, path, digits=4):
    """Rows (dicts) as CSV, the union of their keys as columns, floats rounded."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: round(v, digits) if isinstance(v, float) else v
                             for k, v in r.items()})


def read_csv(path):
    """The rows write_csv wrote, numbers parsed back, empty cells left out."""
    def value(v):
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
        return v

    with open(path) as f:
        return [{k: value(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def allow_tf32(tf32):
    """torch's TF32 switches, and the anchors' own: spconv 2.3.8 and spconv-triton multiply
    float32 in IEEE fp32 unless their `constants.SPCONV_ALLOW_TF32` is set (read at every call),
    whatever torch's flags say. A TF32 row runs every implementation in TF32."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    for module in ("spconv.constants", "spconv_triton.constants"):
        if module in sys.modules:
            sys.modules[module].SPCONV_ALLOW_TF32 = tf32
