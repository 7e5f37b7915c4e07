"""The weight's gradient of a submanifold convolution, layer by layer: GPU time of grad_weight's
kernel (the gathered rows kept in shared memory; from 64 channels the sites of each tap alone,
their lists built in the call) against the gathered rows and cuBLAS, on the sites of a LiDAR
scene, so that the rule choosing between them (sbnet_cupy.submanifold.grad_weight_takes) is a
measured one.

    python -m bench.submanifold_grad_weight [--scale waymo] [--batch 2] [--repeats 5] [--out DIR]

Sites and layers: bench.submanifold_tiles' (a 3x3x3 submanifold rulebook at strides 1, 2, 4 and
8 of --batch frames; the widths detectors and segmentation U-Nets use at each level). Dtypes:
float16 with a float32 gradient (AMP's float32 weight) and float32 as TF32, on torch tensors:
the kernel through sbnet_cupy.submanifold.grad_weight, the gemm route through the torch op's
implementation (torch_bridge.submanifold.conv_op), as a training step's backward calls them.
Time: bench.submanifold_tiles' (the median over --repeats of CUDA events around 20
back-to-back calls, divided by 20).
--pairs-ctas N...: also the kernel of each layer it runs by pairs (tap_pairs) with its sites
split for N CTAs an SM (grad_kernels._GRAD_PAIRS_CTAS_PER_SM), a column each, so that the split
rule is a measured one.
Writes DIR/submanifold_grad_weight_<device>.csv.
"""

import argparse
import pathlib

from bench import lidar_scenes
from bench._common import RESULTS, allow_tf32, require_gpu, results_stem, write_csv
from bench.submanifold_tiles import LAYERS, gpu_ms, levels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="waymo", choices=list(lidar_scenes.SCALES))
    parser.add_argument("--batch", type=int, default=2, help="frames")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--pairs-ctas", type=int, nargs="*", default=[],
                        help="CTAs an SM to time the by-pairs layers' splits at")
    args = parser.parse_args(argv)
    require_gpu("bench.submanifold_grad_weight")
    import torch

    import torch_bridge.submanifold as ours
    from sbnet_cupy.submanifold import grad_kernels, grad_weight
    from torch_bridge.backend import TORCH
    from torch_bridge.submanifold.conv_op import _grad_weight_impl

    allow_tf32(True)
    coords, _ = lidar_scenes.batch(args.scale, 100, args.batch)
    shape = list(lidar_scenes.SCALES[args.scale].grid)
    maps = [ours.build_rulebook(torch.from_numpy(c).cuda(), s, args.batch, 3, subm=True).neighbors
            for c, s in levels(coords, shape)]
    generator = torch.Generator("cuda").manual_seed(0)
    rows = []
    for level, cin, cout in LAYERS:
        neighbors = maps[level]
        n = neighbors.shape[1]
        for dtype in (torch.float16, torch.float32):
            x = torch.randn(n, cin, device="cuda", generator=generator).to(dtype)
            dy = torch.randn(n, cout, device="cuda", generator=generator).to(dtype)
            shape_w = [cout, 3, 3, 3, cin]
            want = _grad_weight_impl(x.double(), dy.double(), neighbors, shape_w, torch.float64)
            row = dict(dtype=str(dtype)[6:], level=level, sites=n, cin=cin, cout=cout)
            routes = {
                "kernel": lambda: grad_weight(TORCH, x, dy, neighbors, "float32").reshape(shape_w),
                "gemm": lambda: _grad_weight_impl(x, dy, neighbors, shape_w, torch.float32, "gemm")}
            for route, run in routes.items():
                err = float((run().double() - want).norm() / want.norm())
                row[f"{route}_ms"] = round(gpu_ms(run, args.repeats), 4)
                row[f"{route}_err"] = f"{err:.1e}"
            row["kernel/gemm"] = round(row["kernel_ms"] / row["gemm_ms"], 3)
            if grad_kernels.grad_weight_config(cin, cout)[2]:
                rule = grad_kernels._GRAD_PAIRS_CTAS_PER_SM
                for ctas in args.pairs_ctas:
                    grad_kernels._GRAD_PAIRS_CTAS_PER_SM = ctas
                    row[f"pairs_{ctas}_ms"] = round(gpu_ms(routes["kernel"], args.repeats), 4)
                grad_kernels._GRAD_PAIRS_CTAS_PER_SM = rule
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    path = f"{results_stem(args.out, 'submanifold_grad_weight', torch.cuda.get_device_name())}.csv"
    write_csv(rows, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
