"""One CUDA graph per capacity bucket: the sync-free inference path."""

import functools
import math

import torch

from ._weights import frozen_weights


@functools.lru_cache(maxsize=4096)  # on every graphed call's host path: ~100 steps at ratio 1.06
def capacity_bucket(count, ratio=1.125, minimum=8):
    """The capacity to run `count` blocks with: the smallest of minimum * ratio**i (rounded up to
    a multiple of 8) that holds them, so that one CUDA graph per bucket serves every count while
    padding blocks waste at most ~(ratio - 1) of the work."""
    bucket = minimum
    while bucket < count:
        bucket = 8 * math.ceil(bucket * ratio / 8)
    return bucket


class CapacityGraphs:
    """Runs fn(capacity) as one CUDA graph per capacity bucket, captured on first use.

    fn reads and writes only tensors that outlive it (static inputs the caller refills before
    each call, outputs it returns), and passes `capacity` to reduce_mask, so that nothing in it
    synchronises with the host. Calling with the number of active blocks (for example read from
    the previous frame's bin_counts, or known from the mask's source) replays the graph of its
    bucket and returns that graph's outputs, which the next replay of the same bucket
    overwrites. If the count outgrew the bucket, the result's ReduceMask.overflowed says so.
    The graphs are for fixed weights: they read the fused kernels' copies of the weights made
    when they were captured (frozen_weights), so make a new CapacityGraphs after changing
    parameters in place.
    """

    def __init__(self, fn, *, ratio=1.125, minimum=8):
        self.fn, self.ratio, self.minimum = fn, ratio, minimum
        self.graphs = {}  # capacity -> (graph, outputs, the weight copies it reads)

    def __call__(self, count):
        capacity = capacity_bucket(count, self.ratio, self.minimum)
        if capacity not in self.graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compile kernels, pick cuDNN algorithms
                self.fn(capacity)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with frozen_weights() as weights, torch.cuda.graph(graph):
                outputs = self.fn(capacity)
            self.graphs[capacity] = graph, outputs, weights
        graph, outputs, _ = self.graphs[capacity]
        graph.replay()
        return outputs
