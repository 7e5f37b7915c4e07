"""Ray-cast LiDAR scenes at three datasets' scales, voxelised on their detectors' grids, for
bench.detectors.

Each scale is a sensor (beams, azimuth steps, elevation span, height above the ground) ray-cast
by bench.lidar.sweep against a ground plane and a street scene all around the sensor (cars in
lanes, pedestrians, poles, walls and building fronts, low clutter), so the density falls off
with range as a real sweep's does; the hits inside the scale's range fall into its voxels:

- "kitti": SECOND / PV-RCNN on KITTI: a 64-beam, 640-step sweep seen in front of the car
  (x 0..70.4 m, y -40..40 m, z -3..1 m), 0.05 x 0.05 x 0.1 m voxels: a 41 x 1600 x 1408 (z, y,
  x) grid, about 13-17k voxels a sample; 4 features.
- "waymo": CenterPoint / PV-RCNN on Waymo: 360 degrees to +-75.2 m, z -2..4 m, 0.1 x 0.1 x 0.15
  m voxels: a 41 x 1504 x 1504 grid; a 64-beam sweep of 2650 azimuth steps merged with the
  short-range sweeps of four sensors at the vehicle's sides (as Waymo's five lidars are), and
  the same 1.5 m further back (the sweep before, merged as multi-sweep detectors do): about
  105-125k voxels a sample; 5 features.
- "semkitti": MinkUNet on SemanticKITTI: a full 360-degree sweep of 64 beams x 3000 steps to
  +-50 m, z -4..2 m, 0.05 m cubic voxels: a 120 x 2000 x 2000 grid, about 80-90k voxels a sample;
  4 features.

Voxels come out in the order a hash-based voxeliser emits them (shuffled within each sample),
not sorted. Features: the mean x, y, z of the voxel's points, then an intensity-like value
(falling with range), and for 5 channels an elongation-like one.
"""

import dataclasses

import numpy

from bench import lidar


@dataclasses.dataclass(frozen=True)
class Scale:
    range: tuple          # ((x0, x1), (y0, y1), (z0, z1)) metres
    voxel: tuple          # x, y, z metres
    grid: tuple           # z, y, x voxels
    channels: int
    beams: int
    azimuths: int
    elevations: tuple     # degrees
    height: float         # sensor above the ground, metres
    extent: float         # the scene's half-width, metres
    objects: int          # boxes in the scene
    ground_z: float       # the ground's z in the dataset's frame
    extra_sensors: tuple = ()  # (x, y, height, beams, azimuths, elevations) merged in
    sweeps: tuple = (0.0,)     # ego x offsets (metres) of the sweeps merged into one frame


SCALES = {
    "kitti": Scale(range=((0.0, 70.4), (-40.0, 40.0), (-3.0, 1.0)), voxel=(0.05, 0.05, 0.1),
                   grid=(41, 1600, 1408), channels=4, beams=64, azimuths=640,
                   elevations=(-24.8, 2.0), height=1.73, extent=80.0, objects=120,
                   ground_z=-1.73),
    "waymo": Scale(range=((-75.2, 75.2), (-75.2, 75.2), (-2.0, 4.0)), voxel=(0.1, 0.1, 0.15),
                   grid=(41, 1504, 1504), channels=5, beams=64, azimuths=2650,
                   elevations=(-17.6, 2.4), height=2.2, extent=80.0, objects=150, ground_z=0.0,
                   sweeps=(0.0, -1.5),
                   extra_sensors=tuple((x, y, 0.9, 200, 600, (-90.0, 30.0)) for x, y in
                                       ((2.0, 0.0), (-2.5, 0.0), (1.5, 1.0), (1.5, -1.0)))),
    "semkitti": Scale(range=((-50.0, 50.0), (-50.0, 50.0), (-4.0, 2.0)), voxel=(0.05, 0.05, 0.05),
                      grid=(120, 2000, 2000), channels=4, beams=64, azimuths=3000,
                      elevations=(-24.8, 2.0), height=1.73, extent=60.0, objects=120,
                      ground_z=-1.73),
}


def street(rng, objects, extent):
    """[objects, 2, 3] boxes (min, max corners; z from the ground up) all around the origin:
    cars in lanes along x, pedestrians and poles on the pavements, walls and building fronts
    further out, low clutter (bushes, kerbs) anywhere."""
    out = []
    for _ in range(objects):
        kind = rng.choice(["car"] * 4 + ["pedestrian", "pole", "wall", "building", "clutter"])
        x = rng.uniform(-extent, extent)
        side = rng.choice([-1, 1])
        if kind == "car":
            y = side * rng.uniform(1.8, 12)
            size = (rng.uniform(3.8, 4.8), rng.uniform(1.6, 2.0), rng.uniform(1.4, 1.7))
        elif kind == "pedestrian":
            y = side * rng.uniform(6, 16)
            size = (0.5, 0.5, rng.uniform(1.5, 1.9))
        elif kind == "pole":
            y = side * rng.uniform(6, 20)
            size = (0.3, 0.3, rng.uniform(3, 6))
        elif kind == "wall":
            y = side * rng.uniform(14, 35)
            size = (rng.uniform(5, 25), 0.4, rng.uniform(1, 3))
        elif kind == "building":
            y = side * rng.uniform(18, 45)
            size = (rng.uniform(8, 30), rng.uniform(6, 15), rng.uniform(4, 12))
        else:
            y = rng.uniform(-extent, extent)
            size = (rng.uniform(0.5, 3), rng.uniform(0.5, 3), rng.uniform(0.2, 1.2))
        if x * x + y * y < 9:  # not on top of the sensor
            continue
        low = numpy.array([x - size[0] / 2, y - size[1] / 2, 0.0])
        out.append((low, low + numpy.array(size)))
    return numpy.array(out)


def points(rng, scale):
    """Hit points [P, 3] of one frame in the dataset's frame (its ground at z = ground_z: the
    origin is the top sensor for KITTI and SemanticKITTI, the vehicle on the ground for Waymo),
    and each point's range from its sensor [P]."""
    s = SCALES[scale] if isinstance(scale, str) else scale
    boxes = street(rng, s.objects, s.extent)  # z from the ground up
    sensors = [(0.0, 0.0, s.height, s.beams, s.azimuths, s.elevations)] + list(s.extra_sensors)
    hits, ranges = [], []
    for x, y, height, beams, azimuths, elevations in [
            (x + ego, y, *rest) for ego in s.sweeps for x, y, *rest in sensors]:
        offset = numpy.array([x, y, height])  # the sensor above the ground
        p = lidar.sweep(rng, beams, azimuths, boxes - offset, elevations, height)
        ranges.append(numpy.linalg.norm(p, axis=1))
        hits.append(p + offset + [0.0, 0.0, s.ground_z])
    return numpy.concatenate(hits), numpy.concatenate(ranges)


def voxelise(rng, pts, ranges, scale):
    """(coords int32 [V, 3] as (z, y, x), features float32 [V, channels]) of the points inside
    the scale's range, in an arbitrary (shuffled) order as hash-based voxelisers emit them."""
    s = SCALES[scale] if isinstance(scale, str) else scale
    lows = numpy.array([r[0] for r in s.range])
    index = numpy.floor((pts - lows) / numpy.array(s.voxel)).astype(numpy.int64)
    inside = numpy.all((index >= 0) & (index < numpy.array(s.grid[::-1])), axis=1)
    index, pts, ranges = index[inside][:, ::-1], pts[inside], ranges[inside]
    keys = (index[:, 0] * s.grid[1] + index[:, 1]) * s.grid[2] + index[:, 2]
    unique, inverse, counts = numpy.unique(keys, return_inverse=True, return_counts=True)
    intensity = numpy.clip(rng.normal(0.6, 0.15, len(pts)) * numpy.exp(-ranges / 60), 0, 1)
    extra = [intensity] + ([rng.uniform(0, 0.2, len(pts))] if s.channels > 4 else [])
    values = numpy.concatenate([pts, numpy.stack(extra, axis=1)], axis=1)
    sums = numpy.zeros((unique.size, values.shape[1]))
    numpy.add.at(sums, inverse, values)
    coords = numpy.stack([unique // (s.grid[1] * s.grid[2]), unique // s.grid[2] % s.grid[1],
                          unique % s.grid[2]], axis=1).astype(numpy.int32)
    features = (sums / counts[:, None]).astype(numpy.float32)
    order = rng.permutation(len(coords))
    return coords[order], features[order]


def sample(scale, seed):
    """One frame's (coords [V, 3], features [V, channels]) at `scale`."""
    rng = numpy.random.default_rng(seed)
    return voxelise(rng, *points(rng, scale), scale)


def batch(scale, seed, size, samples=None):
    """(coords int32 [V, 4], batch index first, features float32 [V, channels]) of `size`
    frames of different scenes (seeds seed, seed + 1, ...), each frame's rows together (as a
    detector's collate concatenates them), each shuffled. `samples`: a dict caching frames by
    (scale, seed)."""
    coords, features = [], []
    for b in range(size):
        key = (scale, seed + b)
        if samples is None or key not in samples:
            frame = sample(scale, seed + b)
            if samples is None:
                c, f = frame
            else:
                samples[key] = frame
        c, f = samples[key] if samples is not None else (c, f)
        coords.append(numpy.concatenate([numpy.full((len(c), 1), b, numpy.int32), c], axis=1))
        features.append(f)
    return numpy.concatenate(coords), numpy.concatenate(features)
