"""A whole sparse network as CUDA graphs: SparseGraphs runs fn(x) on SparseConvTensors of
varying size with sizes bounded by capacities, so that a replay makes no host sync and costs
microseconds of host time where the eager forward's launches and rulebook syncs cost
milliseconds."""

import math

import torch

from sbnet_cupy.submanifold.cuda_rulebook import site_faults

from ..backend import TORCH
from ..capacity_graphs import capacity_bucket
from .core import SparseConvTensor
from .rulebook import _check_sites, bounded

# Capacity of a strided layer's output: its recorded count scaled to a full input bucket, times
# this, so that other frames of the bucket rarely overflow it.
_MARGIN = 1.03


class _Graph:
    """One capture: the static input (features [capacity, C], indices [capacity, 1 + D] with
    padding rows -1, the number of real rows), the outputs, and `stats`, int64 [2 + outputs]:
    whether the input had bad rows, whether a strided layer overflowed its capacity, and each
    output SparseConvTensor's number of real rows."""

    def __init__(self, features, indices, rows, capacities):
        self.features, self.indices, self.rows = features, indices, rows
        self.capacities = capacities
        self.graph = self.outputs = self.stats = self.constants = None

    def load(self, x):
        n = x.indices.shape[0]
        self.features[:n].copy_(x.features)
        self.indices[:n].copy_(x.indices)
        self.indices[n:].fill_(-1)
        self.rows.fill_(n)

    def padded_input(self, x):
        padded = SparseConvTensor(self.features, self.indices, x.spatial_shape, x.batch_size)
        padded.indices_checked, padded.padded = True, True
        return padded


def _sparse_outputs(outputs):
    """The SparseConvTensors in outputs (a SparseConvTensor, a tensor, or lists, tuples and
    dicts of them), in _mapped's order."""
    found = []
    _mapped(outputs, found.append, lambda t: t)
    return found


def _mapped(outputs, sparse, tensor):
    """outputs with each SparseConvTensor s replaced by sparse(s) and each other tensor t by
    tensor(t), through lists, tuples (named ones too) and dicts in their order."""
    if isinstance(outputs, SparseConvTensor):
        return sparse(outputs)
    if isinstance(outputs, torch.Tensor):
        return tensor(outputs)
    if isinstance(outputs, (list, tuple)):
        items = [_mapped(o, sparse, tensor) for o in outputs]
        return type(outputs)(*items) if hasattr(outputs, "_fields") else type(outputs)(items)
    if isinstance(outputs, dict):
        return {k: _mapped(o, sparse, tensor) for k, o in outputs.items()}
    return outputs


def _copied(outputs):
    """outputs with every tensor copied out of the graph's memory, which the next replay
    overwrites: whole, padding rows included, so that the copies are queued right behind the
    replay, before the host sync that reads the counts; SparseConvTensors with no rulebooks."""
    return _mapped(outputs, lambda s: s._with(s.features.clone(), s.indices.clone(),
                                              s.spatial_shape, {}, True), torch.Tensor.clone)


def _unpadded(outputs, counts):
    """outputs (_copied's) with each SparseConvTensor cut to its real rows (counts, in
    _sparse_outputs' order): views of the copies, rows first."""
    def cut(s):
        count = counts.pop(0)
        out = s._with(s.features[:count], s.indices[:count], s.spatial_shape, {}, True)
        out.padded = False
        return out
    return _mapped(outputs, cut, lambda t: t)


class SparseGraphs:
    """Runs fn(x), a sparse network's inference on a CUDA SparseConvTensor x, as one CUDA graph
    per bucket of x's number of sites, captured on first use.

    A bucket's graph runs on tensors of a fixed number of rows, its capacity (the smallest of
    minimum * ratio**i that holds x's sites): x's sites, then padding rows (batch index -1),
    which every rulebook leaves out. Each strided convolution's output gets a capacity too,
    from a recording run of the first input of the bucket, so that no rulebook counts its
    sites on the host. A call copies x into the graph's input, replays it, and reads back in
    one host sync whether x's indices were valid (see check), whether a strided layer had more
    sites than its capacity (then the bucket is recorded and captured again on this input, and
    replayed), and how many sites each output has. It returns fn's outputs (SparseConvTensors,
    tensors, and lists, tuples and dicts of them) copied out of the graph: each
    SparseConvTensor with its sites alone (its first rows, views of a copy of the padded
    tensor, which is queued before the sync) and no rulebooks, tensors as fn made them.

    fn must run the same layers whatever the input (no branches on the data), make no host
    sync of its own, and build its rulebooks from x's sites (submanifold, strided and inverse
    convolutions and pools; a transposed convolution's rulebook raises ValueError). Rows may
    be padding inside fn: x.dense(), the global pools and the layers drop them; code of fn's
    own that reads indices must too. Modules must be in eval mode (an nn.Module fn in
    training mode raises ValueError); it runs without autograd. The graphs read the
    parameters' memory: in-place changes (load_state_dict) reach them; after replacing a
    parameter tensor, make a new SparseGraphs. Under torch.autocast, each autocast state has
    its graphs. check: whether a call raises ValueError for indices outside the grid or
    repeated (a hash table's insert in the graph); without, such rows give undefined outputs,
    as in spconv.
    """

    def __init__(self, fn, *, ratio=1.0625, minimum=1024, check=True):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not (isinstance(ratio, (int, float)) and ratio > 1):
            raise ValueError(f"ratio must be a number > 1, got {ratio!r}")
        if not (isinstance(minimum, int) and minimum >= 8):
            raise ValueError(f"minimum must be an int >= 8, got {minimum!r}")
        self.fn, self.ratio, self.minimum, self.check = fn, ratio, minimum, bool(check)
        self.graphs = {}
        self.pool = None  # one memory pool for every bucket's graph: they replay in turn

    def __call__(self, x):
        if not isinstance(x, SparseConvTensor):
            raise TypeError(f"x must be a SparseConvTensor, got {type(x).__name__}")
        if not x.features.is_cuda:
            raise ValueError(f"x must be on a CUDA device, got {x.features.device}")
        if isinstance(self.fn, torch.nn.Module) and self.fn.training:
            raise ValueError("SparseGraphs runs inference: call fn.eval() first")
        x.check_rows()
        capacity = capacity_bucket(x.indices.shape[0], self.ratio, self.minimum)
        autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
        key = (capacity, x.features.dtype, x.features.shape[1], tuple(x.spatial_shape),
               x.batch_size, x.features.device, autocast)
        with torch.no_grad(), torch.cuda.device(x.features.device):
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self._capture(x, capacity, None)
            copies, (bad, overflowed, *counts) = self._replay(graph, x)
            if bad:
                _check_sites(x.indices, x.spatial_shape, x.batch_size)  # names the row
                raise AssertionError("the graph's check and _check_sites disagree")
            if overflowed:
                graph = self.graphs[key] = self._capture(x, capacity, graph.capacities)
                copies, (bad, overflowed, *counts) = self._replay(graph, x)
                if overflowed:
                    raise AssertionError("a recorded capacity overflowed")  # a library bug
            return _unpadded(copies, counts)

    @staticmethod
    def _replay(graph, x):
        """(the outputs' copies, the stats) of a replay on x: the copies are queued before the
        stats' host sync, so that the GPU runs them while the host waits."""
        graph.load(x)
        graph.graph.replay()
        copies = _copied(graph.outputs)
        return copies, graph.stats.tolist()

    def _capture(self, x, capacity, previous):
        """The _Graph of x's bucket: a recording run on x padded to `capacity`, the capacities
        of its strided layers (at least `previous`), a warm-up run with them (kernels compiled,
        libraries' plans made), then the capture."""
        device = x.features.device
        graph = _Graph(x.features.new_empty((capacity, x.features.shape[1])),
                       x.indices.new_empty((capacity, x.indices.shape[1])),
                       torch.zeros((), dtype=torch.int64, device=device), None)
        graph.load(x)
        padded = graph.padded_input(x)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            with bounded(None) as recorded:
                self.fn(padded)
            scale = capacity / max(1, x.indices.shape[0])
            capacities = [capacity_bucket(max(count, math.ceil(count * scale * _MARGIN)),
                                          self.ratio, 8) for count in recorded.counts]
            if previous is not None:
                capacities = [max(a, b) for a, b in zip(capacities, previous)]
            graph.capacities = capacities
            with bounded(capacities):
                self.fn(padded)
            if self.check:  # its kernels loaded before the capture, as fn's are
                site_faults(TORCH, graph.indices, tuple(padded.spatial_shape), padded.batch_size)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # The stats' constants, copied from the host before the capture (which cannot), and
        # kept with the graph, whose replays read their memory.
        graph.constants = capacities_t = torch.tensor(capacities, dtype=torch.int32,
                                                      device=device)
        graph.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph.graph, pool=self.pool), bounded(capacities) as bounds:
            main = torch.cuda.current_stream(device)
            beside = torch.cuda.Stream(device)
            beside.wait_stream(main)
            with torch.cuda.stream(beside):
                bad = self._bad(graph, padded)
            graph.outputs = self.fn(padded)
            main.wait_stream(beside)
            graph.stats = self._stats(graph, bad, bounds.counts, capacities_t)
        return graph

    def _bad(self, graph, padded):
        """Whether the input's rows are bad, computed in the graph on a stream of its own (the
        network does not wait for it): a hash table's insert of the rows, its flags, and its
        count of rows of -1 alone, which must be the padding rows load wrote (a real row of
        -1 is outside). Zero without check."""
        if not self.check:
            return graph.rows.new_zeros(())
        faults = site_faults(TORCH, graph.indices, tuple(padded.spatial_shape),
                             padded.batch_size)
        padding = graph.indices.shape[0] - graph.rows
        return (faults[0] != 0) | (faults[1].long() != padding)

    def _stats(self, graph, bad, counts, capacities):
        """_Graph.stats, computed in the graph: bad (_bad's), counts, the strided layers'
        numbers of sites, and capacities their capacities (int32)."""
        zero = graph.rows.new_zeros(())
        overflowed = (torch.cat(counts) > capacities).any() if counts else zero
        sparse = [(o.indices[:, 0] >= 0).sum() for o in _sparse_outputs(graph.outputs)]
        return torch.stack([bad.long(), overflowed.long(), *(s.long() for s in sparse)])
