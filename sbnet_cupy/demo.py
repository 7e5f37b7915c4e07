"""Demo: reduce_mask -> sparse_gather -> work on the blocks -> sparse_scatter, on a synthetic
LiDAR-like bird's-eye-view mask. Checks the result against a dense computation and prints
timings. Runs on the GPU with CuPy when one is there, else on the NumPy backend.

    python -m sbnet_cupy.demo
"""

import sys
import time

import numpy

import sbnet_cupy


def lidar_like_mask(rng, height, width):
    """A bird's-eye view of one LiDAR sweep: a road band ahead of the car, a few clustered
    objects, and returns thinning with distance; about 85-90% of it empty."""
    rows, cols = numpy.mgrid[0:height, 0:width]
    distance = numpy.hypot(rows - height, cols - width / 2) / height  # sensor at bottom centre
    road = numpy.abs(cols - width / 2 - 0.15 * width * numpy.sin(rows / height * 3)) < width / 14
    objects = numpy.zeros((height, width), bool)
    for _ in range(12):
        r, c = rng.integers(0, height), rng.integers(0, width)
        objects |= numpy.hypot(rows - r, cols - c) < rng.integers(8, 30)
    returns = rng.random((height, width)) < 0.5 * numpy.exp(-3 * distance)
    return ((road | objects) & returns | objects).astype(numpy.float32)


def main():
    why = "no CUDA device"
    try:
        import cupy
        on_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except ImportError:
        on_gpu, why = False, "CuPy is not installed"
    except Exception as error:  # no driver, or one too old for CuPy's CUDA (12 or 13)
        on_gpu, why = False, str(error).split(':')[0] or type(error).__name__
    xp = cupy if on_gpu else numpy
    if on_gpu:
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"backend: CuPy on {name}")
    else:
        print(f"backend: NumPy (no usable CUDA GPU: {why}; the same ops run on the CPU)")

    rng = numpy.random.default_rng(0)
    height, width, channels = 400, 704, 64
    mask = lidar_like_mask(rng, height, width)[None]
    x = rng.standard_normal((1, height, width, channels), dtype=numpy.float32)
    # A 3x3 convolution on 18x18 blocks makes 16x16 outputs: SBNet's geometry for it.
    params = sbnet_cupy.calc_block_params((height, width), (18, 18), (3, 3))
    print(f"mask {height}x{width}: {1 - mask.mean():.0%} empty; blocks {params.bsize} "
          f"every {params.bstrides} from {params.boffset}, {params.bcount} of them")

    mask_d, x_d = xp.asarray(mask), xp.asarray(x)
    kernel = xp.asarray(rng.standard_normal((3, 3), dtype=numpy.float32) / 9)

    def sparse_blur(x_d):
        found = sbnet_cupy.reduce_mask(mask_d, params.bcount, bsize=params.bsize,
                                       boffset=params.boffset, bstride=params.bstrides)
        blocks = sbnet_cupy.sparse_gather(x_d, found.bin_counts, found.active_block_indices,
                                          bsize=params.bsize, boffset=params.boffset,
                                          bstride=params.bstrides)
        # The work on the blocks: a depthwise 3x3 VALID filter, 18x18 -> 16x16.
        out = sum(kernel[i, j] * blocks[:, i:i + 16, j:j + 16] for i in range(3) for j in range(3))
        y = sbnet_cupy.sparse_scatter(out, found.bin_counts, found.active_block_indices, x_d,
                                      bsize=params.bsize_out, bstride=params.bsize_out)
        return y, found

    def dense_blur(x_d):
        padded = xp.pad(x_d, ((0, 0), (1, 1), (1, 1), (0, 0)))
        return sum(kernel[i, j] * padded[:, i:i + height, j:j + width]
                   for i in range(3) for j in range(3))

    def timed(fn, repeats=20):
        fn(x_d)
        times = []
        for _ in range(repeats):
            if on_gpu:
                cupy.cuda.Stream.null.synchronize()
            start = time.perf_counter()
            fn(x_d)
            if on_gpu:
                cupy.cuda.Stream.null.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e3

    y, found = sparse_blur(x_d)
    active = int(found.bin_counts[0])
    y, dense = (cupy.asnumpy(a) if on_gpu else a for a in (y, dense_blur(x_d)))
    # Active blocks hold the filtered values; everything else keeps x.
    covered = numpy.zeros((height, width), bool)
    for _, hi, wi in (cupy.asnumpy(a) if on_gpu else a for a in found.active_block_indices):
        covered[hi * 16:hi * 16 + 16, wi * 16:wi * 16 + 16] = True
    ok = (numpy.allclose(y[0][covered], dense[0][covered], rtol=1e-4, atol=1e-5)
          and numpy.array_equal(y[0][~covered], x[0][~covered])
          and covered[mask[0] > 0.5].all())
    print(f"active blocks: {active} of {params.bcount[0] * params.bcount[1]}; "
          f"result {'matches' if ok else 'DOES NOT match'} the dense filter on them")
    print(f"median time: sparse {timed(sparse_blur):.2f} ms, dense {timed(dense_blur):.2f} ms "
          f"(whole pipeline, reduce_mask included, host clock)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
