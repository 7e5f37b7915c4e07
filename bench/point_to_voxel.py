"""Voxelization: torch_bridge's PointToVoxel against spconv 2.3.8's, on the GPU, measured in
the same run.

    python -m bench.point_to_voxel [--out bench/results] [--repeats N]

Point clouds: synthetic LiDAR sweeps (bench.lidar: ray-cast against ground, cars, poles and
walls) of a 64-beam sensor at 1024 and 2048 azimuths and a 128-beam one at 2048, plus an
intensity column. Configurations: SECOND's KITTI voxels (0.05 x 0.05 x 0.1 m, 5 points, 40000
voxels) and PointPillars' pillars (0.16 x 0.16 x 4 m, 32 points, 16000 pillars). Each row is the
median of CUDA-event times of one call (its host sync included: both read the voxel count back)
after warm-up. Before timing, ours on the GPU is checked bit for bit against ours on the CPU
(which matches spconv's CPU build), and spconv's GPU voxels against ours as sets (spconv's CUDA
build numbers voxels in the order its atomics run) where no cap drops voxels.
"""

import argparse
import pathlib

import numpy

from bench import lidar
from bench._common import RESULTS, events_ms, require_gpu, write_csv

CONFIGS = {
    "second-kitti": dict(vsize_xyz=[0.05, 0.05, 0.1], coors_range_xyz=[0, -40, -3, 70.4, 40, 1],
                         max_num_voxels=40000, max_num_points_per_voxel=5),
    "pointpillars": dict(vsize_xyz=[0.16, 0.16, 4], coors_range_xyz=[0, -39.68, -3, 69.12, 39.68,
                                                                        1],
                         max_num_voxels=16000, max_num_points_per_voxel=32),
}
SWEEPS = {"64x1024": (64, 1024), "64x2048": (64, 2048), "128x2048": (128, 2048)}


def cloud(beams, azimuths, seed=0):
    rng = numpy.random.default_rng(seed)
    xyz = lidar.sweep(rng, beams=beams, azimuths=azimuths)
    return numpy.concatenate([xyz, rng.uniform(0, 1, (len(xyz), 1))], 1).astype(numpy.float32)


def check(ours_gpu, ours_cpu, spconv_gpu, pc):
    """Ours on the GPU against ours on the CPU (bits), spconv's GPU voxels against ours (as sets
    of coordinates and counts, where no voxel was dropped); returns 'ok' or what differs."""
    import torch

    mine = ours_gpu.generate_voxel_with_id(pc.cuda())
    reference = ours_cpu.generate_voxel_with_id(pc)
    for name, a, b in zip(("voxels", "coords", "counts", "ids"), mine, reference):
        if not torch.equal(a.cpu(), b):
            return f"ours GPU != ours CPU ({name})"
    if spconv_gpu is None or len(reference[1]) == ours_cpu.max_num_voxels:
        return "ok"
    theirs = spconv_gpu(pc.cuda())
    key = {tuple(c): n for c, n in zip(reference[1].tolist(), reference[2].tolist())}
    if {tuple(c): n for c, n in zip(theirs[1].tolist(), theirs[2].tolist())} != key:
        return "spconv GPU != ours (coordinates or counts)"
    return "ok"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    require_gpu("bench.point_to_voxel")
    import torch

    from torch_bridge.point_to_voxel import PointToVoxel
    try:
        from spconv.pytorch.utils import PointToVoxel as SpconvPointToVoxel
    except ImportError:
        SpconvPointToVoxel = None
    device = torch.cuda.get_device_name()
    rows = []
    for sweep, (beams, azimuths) in SWEEPS.items():
        pc = torch.from_numpy(cloud(beams, azimuths))
        pc_gpu = pc.cuda()
        for config, kwargs in CONFIGS.items():
            kwargs = dict(kwargs, num_point_features=4)
            ours = PointToVoxel(**kwargs, device=torch.device("cuda"))
            theirs = (None if SpconvPointToVoxel is None
                      else SpconvPointToVoxel(**kwargs, device=torch.device("cuda")))
            status = check(ours, PointToVoxel(**kwargs), theirs, pc)
            voxels = len(ours(pc_gpu)[1])
            for name, run in (("ours", ours), ("spconv", theirs)):
                if run is None:
                    continue
                ms = events_ms(lambda: run.generate_voxel_with_id(pc_gpu), args.repeats)
                rows.append(dict(sweep=sweep, points=len(pc), config=config, voxels=voxels,
                                 implementation=name, ms=ms, check=status, device=device))
                print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / f"point_to_voxel_{device.replace(' ', '_')}.csv")


if __name__ == "__main__":
    main()
