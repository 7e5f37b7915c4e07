"""Masks for the convolution benchmarks."""

import numpy


def top_left(n, height, width, sparsity):
    """SBNet's synthetic mask: a top-left rectangle of the image's aspect ratio holding a
    (1 - sparsity) share of the pixels."""
    mask = numpy.zeros((n, height, width), numpy.float32)
    side = numpy.sqrt(1 - sparsity)
    mask[:, :round(height * side), :round(width * side)] = 1
    return mask


def road(rng, n, height, width, sparsity):
    """A LiDAR-like bird's-eye-view mask: a curving road ahead of the car, the sector the
    sensor sees near it, and clustered objects (cars, poles), with the road's width chosen so
    that a (1 - sparsity) share of the pixels is set. Clustered, not random pixels."""
    rows, cols = numpy.mgrid[0:height, 0:width]
    masks = []
    for _ in range(n):
        curve = width / 2 + rng.uniform(0.05, 0.2) * width * numpy.sin(
            rows / height * rng.uniform(2, 4) + rng.uniform(0, 6))
        sector = numpy.hypot(rows - height, (cols - width / 2) / 2) < 0.18 * height
        objects = numpy.zeros((height, width), bool)
        size = max(2, height // 60)  # objects scale with the image: cars of ~2 x 4 m at 400 px
        for _ in range(rng.integers(10, 25)):
            r, c = rng.integers(0, height), rng.integers(0, width)
            h, w = rng.integers(size, 3 * size), rng.integers(2 * size, 5 * size)
            objects[r:r + h, c:c + w] = True
        low, high = 0.0, width / 2
        for _ in range(30):  # bisect the road's half-width to reach the density
            half = (low + high) / 2
            mask = (numpy.abs(cols - curve) < half) | sector | objects
            low, high = (half, high) if mask.mean() < 1 - sparsity else (low, half)
        masks.append(mask)
    return numpy.stack(masks).astype(numpy.float32)
