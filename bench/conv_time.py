"""GPU time of the fused submanifold convolution, or of the rulebook kernels, in one call of a
detector backbone, by kernel instantiation: for an A/B of a kernel change between two trees (run
it with each tree's root on PYTHONPATH, the trees in turns). Ours only, public API only. Prints
``KERNEL mode model name us`` for each instantiation and ``TOTAL mode model kernels_us all_us``
(medians over the profiled calls; split sums count with the fused kernel; the rulebook kernels
are bench.detectors' rulebook class).

    python -m bench.conv_time eval-fp16 --model VoxelResBackBone8x --scale waymo --batch 2
    python -m bench.conv_time eval-fp16 --kernels rulebook --model MinkUNet --scale semkitti
"""

import argparse
import collections
import statistics

import torch_bridge.submanifold as ours
from bench import detectors
from bench._common import allow_tf32, require_gpu

MODES = ("eval-fp16", "eval-tf32", "train-amp")
KERNELS = {"fused": lambda name: name.startswith(("submanifold_fused", "split_sum")),
           "rulebook": detectors.CLASSES["ours"][0][1].search}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--kernels", choices=list(KERNELS), default="fused")
    parser.add_argument("--model", choices=list(detectors.MODELS), default="VoxelResBackBone8x")
    parser.add_argument("--scale", default="waymo")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    require_gpu("bench.conv_time")
    allow_tf32(True)
    indices, features, shape = detectors.inputs(args.scale, args.batch, "cuda", {})
    net = detectors.build("ours", ours, args.model, features.shape[1], "cuda")
    call, _ = detectors.prepare(net, "ours", ours, args.mode,
                                (indices, features, shape, args.batch), "cuda")
    for _ in range(3):
        call()
    selected = KERNELS[args.kernels]
    by_kernel, chosen, total = collections.defaultdict(list), [], []
    for _ in range(args.calls):
        times = {name.split("(")[0].replace("void ", "").replace(" ", ""): 1e3 * ms
                 for name, ms in detectors.kernel_ms(call).items()}
        mine = {k: v for k, v in times.items() if selected(k)}
        for name, us in mine.items():
            by_kernel[name].append(us)
        chosen.append(sum(mine.values()))
        total.append(sum(times.values()))
    for name, us in sorted(by_kernel.items()):
        print(f"KERNEL {args.mode} {args.model} {name} {statistics.median(us):.1f}")
    print(f"TOTAL {args.mode} {args.model} {statistics.median(chosen):.1f} "
          f"{statistics.median(total):.1f}")


if __name__ == "__main__":
    main()
