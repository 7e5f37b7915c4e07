"""The fused submanifold kernel's tile configurations, layer by layer: GPU time of one
convolution for every stage width and tile width on the sites of a LiDAR scene, so that the
rule choosing them (sbnet_cupy.submanifold.conv_kernels.fused_config) is a measured one.

    python -m bench.submanifold_tiles [--scale waymo] [--repeats 5] [--out DIR]

Sites: --batch frames of bench.lidar_scenes at the given scale (shuffled, as voxelisers emit
them) and the same at strides 2, 4 and 8 (coordinates halved, duplicates merged, in key order
as strided rulebooks emit them), as a detector's stages see them; a 3x3x3
submanifold rulebook at each level. Layers: the channel widths detectors and segmentation
U-Nets use at each level. For each layer, dtype (float16; float32 as TF32), stage (bytes of a
row a stage holds: 32, 64, 128), tile width (16, 32, 64, 96, 128 output channels a CTA) and
slots (stages in dynamic shared memory; 0: those that fit in static memory) the kernels are
built for (sbnet_cupy.submanifold.FUSED_CONFIGS): the median over --repeats of CUDA events
around 20 back-to-back calls, divided by 20 (the kernels queue faster than they run, so this is
GPU time). `rule` marks the configuration the library picks.
Writes DIR/submanifold_tiles_<device>.csv.
"""

import argparse
import itertools
import pathlib
import statistics

import numpy

from bench import lidar_scenes
from bench._common import RESULTS, require_gpu, results_stem, write_csv

# (level, cin, cout): VoxelBackBone8x / VoxelResBackBone8x / UNetV2 widths by level, and
# MinkUNet's (32 at the input sites, up to 256).
LAYERS = [(0, 5, 16), (0, 16, 16), (0, 32, 32), (1, 32, 32), (1, 64, 64), (2, 64, 64),
          (2, 128, 128), (3, 64, 64), (3, 128, 128), (3, 256, 256), (0, 96, 96)]
CALLS = 20


def levels(coords, shape):
    """[(coords, shape)] at strides 1, 2, 4 and 8: the input sites in the scene's order (as a
    voxeliser emits them), the others in key order (as strided rulebooks emit them)."""
    out = [(coords, shape)]
    for level in range(1, 4):
        f = 2 ** level
        c = coords.copy()
        c[:, 1:] //= f
        out.append((numpy.unique(c, axis=0).astype(numpy.int32), [-(-s // f) for s in shape]))
    return out


def gpu_ms(run, repeats):
    import cupy

    run()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(CALLS):
            run()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / CALLS)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="waymo", choices=list(lidar_scenes.SCALES))
    parser.add_argument("--batch", type=int, default=2, help="frames")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, nargs="+", help="indices into LAYERS")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "float32"])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    require_gpu("bench.submanifold_tiles", torch=False)
    import cupy

    from sbnet_cupy import submanifold as sm
    from sbnet_cupy.submanifold import conv_kernels

    coords, _ = lidar_scenes.batch(args.scale, 100, args.batch)
    shape = list(lidar_scenes.SCALES[args.scale].grid)
    rulebooks = [sm.submanifold_rulebook(cupy.asarray(c), s, args.batch, 3)
                 for c, s in levels(coords, shape)]
    rng = numpy.random.default_rng(0)
    rule = conv_kernels.fused_config
    rows = []
    layers = [LAYERS[i] for i in args.layers] if args.layers else LAYERS
    try:
        for (level, cin, cout), dtype in itertools.product(layers, args.dtypes):
            rulebook = rulebooks[level]
            n = rulebook.neighbors.shape[1]
            x = cupy.asarray(rng.standard_normal((n, cin)), dtype)
            w = cupy.asarray(rng.standard_normal((cout, 3, 3, 3, cin)) / (27 * cin) ** 0.5, dtype)
            vector = cin * x.itemsize % 16 == 0
            chosen = rule(vector, x.itemsize, cout)
            want = sm.rulebook_conv(x, rulebook, w, algo="fused")
            for stage, tile, slots in [config[1:] for config in sm.FUSED_CONFIGS
                                       if config[0] == vector]:
                conv_kernels.fused_config = (
                    lambda vector, itemsize, cout, config=(stage, tile, slots): config)
                conv_kernels._fused_plan.cache_clear()
                got = sm.rulebook_conv(x, rulebook, w, algo="fused")
                err = float(cupy.abs(got.astype(cupy.float32) - want.astype(cupy.float32)).max())
                ms = gpu_ms(lambda: sm.rulebook_conv(x, rulebook, w, algo="fused"), args.repeats)
                rows.append(dict(dtype=dtype, level=level, sites=n, cin=cin, cout=cout,
                                 stage=stage, tile=tile, slots=slots, ms=round(ms, 4),
                                 diff=err, rule=int((stage, tile, slots) == chosen)))
                print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    finally:
        conv_kernels.fused_config = rule
        conv_kernels._fused_plan.cache_clear()
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    path = f"{results_stem(args.out, 'submanifold_tiles', device)}.csv"
    write_csv(rows, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
