"""Time the sbnet_cupy ops on the GPU against the device-to-device copy bandwidth.

    python -m bench.ops [--out DIR] [--quick]

Each op runs on a CUDA graph of --calls back-to-back launches (so Python launch overhead stays
out of the kernel numbers), each on its own block list and stack (so that the L2 cache does not
hold the data between launches), timed with CUDA events: warm-up, then the median of --repeats
replays. Effective bandwidth = bytes the op must read and write / time, reported as a fraction
of a large copy's bandwidth measured in the same run. reduce_mask is timed per call, eagerly,
as a user calls it. Results go to <out>/ops_<device>.csv and ops_<device>.md (--out: by
default bench/results in this clone). Needs a CUDA GPU; runs from a clone (bench is not
installed with the package).
"""

import argparse
import csv
import datetime
import itertools
import pathlib
import statistics
import sys

import numpy

import sbnet_cupy
from bench._common import RESULTS, require_gpu, results_stem


def _events_ms(cupy, run, repeats, warmup=3):
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def _graph_ms(cupy, launches, repeats):
    """Median time of one launch, from a CUDA graph of all `launches` back to back."""
    launches[0]()  # compile outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for launch in launches:
            launch()
        graph = stream.end_capture()
        return _events_ms(cupy, lambda: graph.launch(stream), repeats) / len(launches)


def copy_bandwidth(cupy, repeats):
    """GB/s of a 1 GiB device-to-device copy (cudaMemcpyAsync and CuPy's copy kernel, the
    faster of the two), counting bytes read plus bytes written."""
    src = cupy.random.random(1 << 27)  # 1 GiB of float64
    dst = cupy.empty_like(src)
    memcpy = lambda: dst.data.copy_from_device_async(src.data, src.nbytes)
    ms = min(_events_ms(cupy, memcpy, repeats), _events_ms(cupy, lambda: cupy.copyto(dst, src),
                                                           repeats))
    return 2 * src.nbytes / ms / 1e6


def _check(cupy, x, stack, result, indices, bsize, transpose):
    """The gathered blocks are x's slices, and scattering them back rebuilt x there."""
    host_indices = cupy.asnumpy(indices)
    pick = numpy.random.default_rng(0).choice(len(host_indices), size=min(8, len(host_indices)),
                                              replace=False)
    for m in pick:
        n, hi, wi = host_indices[m]
        window = x[n, hi * bsize:(hi + 1) * bsize, wi * bsize:(wi + 1) * bsize]
        got = stack[m].transpose(1, 2, 0) if transpose else stack[m]
        if not (cupy.array_equal(got, window)
                and cupy.array_equal(result[n, hi * bsize:(hi + 1) * bsize,
                                            wi * bsize:(wi + 1) * bsize], window)):
            raise AssertionError(f"wrong result for block {m} = {(n, hi, wi)}")


def bench_ops(cupy, args, copy_gbs):
    rows = []
    shape = (args.batch, args.height, args.width)
    configs = itertools.product(args.dtypes, args.channels, args.bsizes, args.active,
                                (False, True))
    for dtype, channels, bsize, active, transpose in configs:
        rng = numpy.random.default_rng(1)
        x = cupy.random.standard_normal(shape + (channels,), dtype=cupy.float32).astype(dtype)
        y = cupy.zeros_like(x)
        bcount = (args.height // bsize, args.width // bsize)
        n_total = args.batch * bcount[0] * bcount[1]
        n_active = max(1, round(active * n_total))
        counts = cupy.asarray([n_active], dtype=cupy.int32)
        kw = dict(bsize=bsize, transpose=transpose)
        # Each launch of a graph takes its own block list and stack, so that the set of graph
        # launches touches more memory than the L2 cache holds.
        sets = []
        for _ in range(args.calls):
            ids = numpy.sort(rng.choice(n_total, n_active, replace=False))
            n, rest = numpy.divmod(ids, bcount[0] * bcount[1])
            indices = cupy.asarray(numpy.stack([n, *numpy.divmod(rest, bcount[1])], 1)
                                   .astype(numpy.int32))
            sets.append((indices, sbnet_cupy.sparse_gather(x, counts, indices, **kw)))
        indices, stack = sets[0]
        sbnet_cupy.sparse_scatter_var(stack, counts, indices, y, **kw)
        _check(cupy, x, stack, y, indices, bsize, transpose)

        block_bytes = stack.nbytes
        gather = sbnet_cupy.sparse_gather
        scatter = sbnet_cupy.sparse_scatter_var
        ops = {
            "gather": ([lambda i=i, s=s: gather(x, counts, i, out=s, **kw) for i, s in sets],
                       2 * block_bytes),
            "scatter": ([lambda i=i, s=s: scatter(s, counts, i, y, **kw) for i, s in sets],
                        2 * block_bytes),
            "scatter_add": ([lambda i=i, s=s: scatter(s, counts, i, y, add=True, **kw)
                             for i, s in sets], 3 * block_bytes),
            "scatter_add_atomic": ([lambda i=i, s=s: scatter(s, counts, i, y, add=True,
                                                             atomic=True, **kw)
                                    for i, s in sets], 3 * block_bytes),
        }
        for op, (launches, nbytes) in ops.items():
            ms = _graph_ms(cupy, launches, args.repeats)
            gbs = nbytes / ms / 1e6
            rows.append(dict(op=op, dtype=numpy.dtype(dtype).name, C=channels, bsize=bsize,
                             active=active, transpose=transpose, blocks=n_active,
                             MB=round(nbytes / 1e6, 2), us=round(ms * 1e3, 2),
                             GBs=round(gbs, 1), of_copy=round(gbs / copy_gbs, 3)))
            print(_row_text(rows[-1]), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def bench_reduce_mask(cupy, args):
    """reduce_mask on a 1x800x1408 LiDAR-sized mask, block 16: eager per-call times."""
    rng = numpy.random.default_rng(2)
    rows = []
    for density in (0.1, 0.5):
        mask = cupy.asarray((rng.random((1, 800, 1408)) < density / 64).astype(numpy.float32))
        for capacity in (None, 4400):
            call = lambda: sbnet_cupy.reduce_mask(mask, (50, 88), bsize=16, capacity=capacity)
            want = sbnet_cupy.reduce_mask(cupy.asnumpy(mask), (50, 88), bsize=16)
            got = call()
            m = int(got.bin_counts[0])
            if not numpy.array_equal(cupy.asnumpy(got.active_block_indices[:m]),
                                     want.active_block_indices):
                raise AssertionError("reduce_mask differs from the NumPy backend")
            ms = _events_ms(cupy, call, args.repeats * 10)
            rows.append(dict(op="reduce_mask", capacity=capacity, blocks=m,
                             us=round(ms * 1e3, 2)))
            print(rows[-1], flush=True)
    return rows


def _row_text(r):
    return (f"{r['op']:>18} {r['dtype']:>7} C={r['C']:<3} b={r['bsize']:<2} "
            f"act={r['active']:<4} T={int(r['transpose'])} {r['us']:>9.2f} us "
            f"{r['GBs']:>7.1f} GB/s {100 * r['of_copy']:5.1f}% of copy")


def write_results(out, device, copy_gbs, op_rows, mask_rows, command):
    stem = results_stem(out, "ops", device)
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(op_rows[0]))
        writer.writeheader()
        writer.writerows(op_rows)
    lines = [f"# sbnet_cupy ops on {device}", "",
             f"{datetime.date.today()}, `{command}`. Copy bandwidth (1 GiB device-to-device, "
             f"read + write): **{copy_gbs:.0f} GB/s**. Full table: `{stem.name}.csv`.", "",
             "## Fraction of copy bandwidth (min / median over C, block size, active fraction)",
             "", "| op | dtype | transpose | C>=32 min | median | max |",
             "|---|---|---|---|---|---|"]
    keys = sorted({(r["op"], r["dtype"], r["transpose"]) for r in op_rows})
    for op, dtype, transpose in keys:
        fr = [r["of_copy"] for r in op_rows if (r["op"], r["dtype"], r["transpose"]) ==
              (op, dtype, transpose) and r["C"] >= 32]
        lines.append(f"| {op} | {dtype} | {transpose} | {min(fr):.0%} | "
                     f"{statistics.median(fr):.0%} | {max(fr):.0%} |")
    lines += ["", "## reduce_mask, 1x800x1408 mask, 16x16 blocks (eager, per call, events)", "",
              "| capacity | active blocks | us |", "|---|---|---|"]
    lines += [f"| {r['capacity']} | {r['blocks']} | {r['us']} |" for r in mask_rows]
    pathlib.Path(f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="folder for the results (default: bench/results in this clone)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--height", type=int, default=400)
    parser.add_argument("--width", type=int, default=704)
    parser.add_argument("--channels", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--bsizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--active", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--calls", type=int, default=10, help="launches per graph")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="a few configurations only")
    args = parser.parse_args(argv)
    if args.quick:
        args.channels, args.bsizes, args.active = [64], [16], [0.1]
    require_gpu("bench.ops", torch=False)
    import cupy

    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    copy_gbs = copy_bandwidth(cupy, args.repeats)
    print(f"{device}: copy {copy_gbs:.0f} GB/s", flush=True)
    op_rows = bench_ops(cupy, args, copy_gbs)
    mask_rows = bench_reduce_mask(cupy, args)
    write_results(args.out, device, copy_gbs, op_rows, mask_rows,
                  "python -m bench.ops " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
