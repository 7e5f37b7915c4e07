"""GPU time of the fused submanifold convolution, or of the rulebook kernels, in one call of a
detector backbone, by kernel instantiation: for an A/B of a kernel change between two trees (run
it with each tree's root on PYTHONPATH, the trees in turns). Ours only, public API only. Each
row is a MODE (with --model, --scale, --batch) or MODE:MODEL:SCALE:BATCH; several rows run in
one process. Prints ``KERNEL mode model scale batch name us`` for each instantiation and ``TOTAL
mode model scale batch kernels_us all_us`` (medians over the profiled calls; the fused class is
the fused kernel with its split sums and, in training steps, the weight's gradient kernels; the
rulebook kernels are bench.detectors' rulebook class; --kernels all lists every kernel).

    python -m bench.conv_time eval-fp16 --model VoxelResBackBone8x --scale waymo --batch 2
    python -m bench.conv_time eval-fp16:MinkUNet:semkitti:2 train-amp:UNetV2:kitti:4
    python -m bench.conv_time eval-fp16 --kernels rulebook --model MinkUNet --scale semkitti
"""

import argparse
import collections
import statistics

import torch_bridge.submanifold as ours
from bench import detectors
from bench._common import allow_tf32, require_gpu

MODES = detectors.MODES
KERNELS = {"fused": lambda name: name.startswith(("submanifold_fused", "split_sum",
                                                  "submanifold_grad_weight", "tap_pair")),
           "rulebook": detectors.CLASSES["ours"][0][1].search,
           "all": lambda name: True}


def parse_row(text, model, scale, batch):
    """(mode, model, scale, batch) of a row argument: MODE, or MODE:MODEL:SCALE:BATCH."""
    parts = text.split(":")
    if len(parts) == 1:
        parts = [text, model, scale, batch]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"a row is MODE or MODE:MODEL:SCALE:BATCH, got {text!r}")
    mode, model, scale, batch = parts
    if mode not in MODES:
        raise argparse.ArgumentTypeError(f"mode must be one of {MODES}, got {mode!r}")
    if model not in detectors.MODELS:
        raise argparse.ArgumentTypeError(f"model must be one of {list(detectors.MODELS)}, got "
                                         f"{model!r}")
    if not str(batch).isdigit() or int(batch) == 0:
        raise argparse.ArgumentTypeError(f"batch must be a positive integer, got {batch!r}")
    return mode, model, scale, int(batch)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", help="MODE or MODE:MODEL:SCALE:BATCH")
    parser.add_argument("--kernels", choices=list(KERNELS), default="fused")
    parser.add_argument("--model", choices=list(detectors.MODELS), default="VoxelResBackBone8x")
    parser.add_argument("--scale", default="waymo")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        rows = [parse_row(row, args.model, args.scale, args.batch) for row in args.rows]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    require_gpu("bench.conv_time")
    allow_tf32(True)
    for row in rows:
        time_row(*row, KERNELS[args.kernels], args.calls)


def time_row(mode, model, scale, batch, selected, calls):
    """Prints the KERNEL and TOTAL lines of one row (see the module's docstring)."""
    indices, features, shape = detectors.inputs(scale, batch, "cuda", {})
    net = detectors.build("ours", ours, model, features.shape[1], "cuda")
    call, _ = detectors.prepare(net, "ours", ours, mode, (indices, features, shape, batch), "cuda")
    for _ in range(3):
        call()
    by_kernel, chosen, total = collections.defaultdict(list), [], []
    for _ in range(calls):
        times = {name.split("(")[0].replace("void ", "").replace(" ", "") or "(unnamed)":
                 1e3 * ms for name, ms in detectors.kernel_ms(call).items()}
        mine = {k: v for k, v in times.items() if selected(k)}
        for name, us in mine.items():
            by_kernel[name].append(us)
        chosen.append(sum(mine.values()))
        total.append(sum(times.values()))
    row = f"{mode} {model} {scale} {batch}"
    for name, us in sorted(by_kernel.items()):
        print(f"KERNEL {row} {name} {statistics.median(us):.1f}")
    print(f"TOTAL {row} {statistics.median(chosen):.1f} {statistics.median(total):.1f}",
          flush=True)


if __name__ == "__main__":
    main()
