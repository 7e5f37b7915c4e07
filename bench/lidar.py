"""A synthetic LiDAR sweep, voxelised as SECOND's middle encoder takes it (bench.submanifold).

A 64-beam spinning sensor 1.73 m above a ground plane (elevations -24.8 to +2 degrees, as a
Velodyne HDL-64E) is ray-cast in NumPy against the ground and a few dozen axis-aligned boxes:
cars, poles and walls. Hits inside SECOND's KITTI range (x 0..70.4 m, y -40..40 m, z -3..1 m)
fall into 0.05 x 0.05 x 0.1 m voxels: a 41 x 1600 x 1408 (z, y, x) grid.
"""

import numpy

RANGE = ((0.0, 70.4), (-40.0, 40.0), (-3.0, 1.0))  # x, y, z in metres, sensor at the origin
VOXEL = (0.05, 0.05, 0.1)
GRID = (41, 1600, 1408)  # z, y, x: (range / voxel), z rounded up as SECOND's [41, 1600, 1408]
SENSOR_HEIGHT = 1.73


def scene(rng, boxes=40):
    """[boxes, 2, 3] axis-aligned boxes (min corner, max corner) in metres: cars along two
    lanes, poles and walls beside them."""
    out = []
    for _ in range(boxes):
        kind = rng.choice(["car", "car", "pole", "wall"])
        x = rng.uniform(3, 70)
        if kind == "car":
            y = rng.choice([-1, 1]) * rng.uniform(1.5, 12)
            size = (rng.uniform(3.8, 4.8), rng.uniform(1.6, 2.0), rng.uniform(1.4, 1.7))
        elif kind == "pole":
            y = rng.choice([-1, 1]) * rng.uniform(6, 20)
            size = (0.3, 0.3, rng.uniform(3, 6))
        else:
            y = rng.choice([-1, 1]) * rng.uniform(14, 35)
            size = (rng.uniform(5, 25), 0.4, rng.uniform(1, 3))
        low = numpy.array([x - size[0] / 2, y - size[1] / 2, -SENSOR_HEIGHT])
        out.append((low, low + numpy.array(size)))
    return numpy.array(out)


def sweep(rng, beams=64, azimuths=1024, boxes=40, elevations=(-24.8, 2.0),
          height=SENSOR_HEIGHT):
    """Hit points [P, 3] (x, y, z, metres, sensor at the origin) of one rotation against the
    ground (`height` below the sensor) and scene(rng, boxes), or `boxes` itself where it is an
    array [B, 2, 3] of boxes (min, max corners) in the sensor's frame; beams spread evenly over
    `elevations` (degrees)."""
    elevation = numpy.radians(numpy.linspace(*elevations, beams))
    azimuth = numpy.linspace(-numpy.pi, numpy.pi, azimuths, endpoint=False)
    el, az = numpy.meshgrid(elevation, azimuth, indexing="ij")
    directions = numpy.stack([numpy.cos(el) * numpy.cos(az), numpy.cos(el) * numpy.sin(az),
                              numpy.sin(el)], axis=-1).reshape(-1, 3)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        t = numpy.where(directions[:, 2] < 0, -height / directions[:, 2], numpy.inf)
        inverse = 1 / directions  # slab test against every box at once
        for low, high in (scene(rng, boxes) if numpy.ndim(boxes) == 0 else boxes):
            rays = _facing(low, high, beams, azimuths)  # the rays that can reach the box
            t0, t1 = (low - 0) * inverse[rays], (high - 0) * inverse[rays]
            near = numpy.nanmax(numpy.minimum(t0, t1), axis=1)
            far = numpy.nanmin(numpy.maximum(t0, t1), axis=1)
            hit = (near <= far) & (far > 0)
            t[rays] = numpy.where(hit, numpy.minimum(t[rays], numpy.maximum(near, 0)), t[rays])
    t = numpy.where(t < 100, t, numpy.inf)
    hits = directions[numpy.isfinite(t)] * t[numpy.isfinite(t), None]
    hits += rng.normal(0, 0.01, hits.shape)  # range noise
    return hits


def _facing(low, high, beams, azimuths):
    """Indices of sweep()'s rays (beam-major) whose azimuth lies within the angle the box's
    bounding circle (in x, y) spans from the sensor, one azimuth step to spare: the others miss
    it. All rays (a slice) where the sensor is within that circle."""
    centre, radius = (low[:2] + high[:2]) / 2, numpy.linalg.norm(high[:2] - low[:2]) / 2
    distance = numpy.linalg.norm(centre)
    if distance <= radius * 1.01:
        return slice(None)
    step = 2 * numpy.pi / azimuths
    half = numpy.arcsin(radius / distance) + step
    first = numpy.floor((numpy.arctan2(centre[1], centre[0]) - half + numpy.pi) / step)
    columns = numpy.arange(int(first), int(first) + int(numpy.ceil(2 * half / step)) + 2)
    columns = numpy.unique(columns % azimuths)
    return (numpy.arange(beams)[:, None] * azimuths + columns[None, :]).ravel()


def voxelise(points):
    """(coords int32 [V, 3] as (z, y, x), features float32 [V, 4]: mean x, y, z and the
    number of points) of the points inside RANGE, sorted by (z, y, x)."""
    lows = numpy.array([r[0] for r in RANGE])
    index = numpy.floor((points - lows) / numpy.array(VOXEL)).astype(numpy.int64)
    inside = numpy.all((index >= 0) & (index < numpy.array(GRID[::-1])), axis=1)
    index, points = index[inside][:, ::-1], points[inside]  # (z, y, x)
    keys = (index[:, 0] * GRID[1] + index[:, 1]) * GRID[2] + index[:, 2]
    unique, inverse, counts = numpy.unique(keys, return_inverse=True, return_counts=True)
    sums = numpy.zeros((unique.size, 3))
    numpy.add.at(sums, inverse, points)
    coords = numpy.stack([unique // (GRID[1] * GRID[2]), unique // GRID[2] % GRID[1],
                          unique % GRID[2]], axis=1).astype(numpy.int32)
    features = numpy.concatenate([sums / counts[:, None], counts[:, None]], axis=1)
    return coords, features.astype(numpy.float32)


def batch(seed, size, **kwargs):
    """(coords int32 [V, 4] with the batch index first, features [V, 4]) of `size` sweeps of
    different scenes."""
    coords, features = [], []
    for b in range(size):
        c, f = voxelise(sweep(numpy.random.default_rng(seed + b), **kwargs))
        coords.append(numpy.concatenate([numpy.full((len(c), 1), b, numpy.int32), c], axis=1))
        features.append(f)
    return numpy.concatenate(coords), numpy.concatenate(features)
