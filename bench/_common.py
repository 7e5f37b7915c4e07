"""What the benchmarks share: CUDA-event timing, CUDA-graph capture, and their CSV files."""

import csv
import statistics


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
