"""Copies of parameters in the layout or dtype a kernel reads, made once per parameter version
and kept while the parameters stay the same tensors: eager calls and compiled graphs then launch
nothing to make them. While a CUDA graph is captured the copies are made inside the graph, so
that its replays follow in-place changes of the parameters, unless the capture runs under
frozen_weights() (as CapacityGraphs' does), which has the graph read the copies made before.
"""

import contextlib
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

# first source -> {prepare: (key, weak refs to the sources, copies)}
_PREPARED = WeakIdKeyDictionary()
_FROZEN = []  # one list per active frozen_weights(): the copies its captures read


@contextlib.contextmanager
def frozen_weights():
    """Inside, a CUDA graph captured through the ops that keep copies of their weights (the fused
    block convolutions, dilated_conv2d's reshape route) reads the copies made before the capture
    (by the warm-up call any capture needs) instead of making them in the graph: a shorter
    graph, which does not follow later in-place changes of the parameters (capture again after
    those). Yields the list of the copies the captures read; keep it as long as the graphs."""
    kept = []
    _FROZEN.append(kept)
    try:
        yield kept
    finally:
        _FROZEN.remove(kept)


def _same_tensors(refs, sources):
    return all((t is None) if r is None else (r() is t) for r, t in zip(refs, sources))


def _outside_torch_pools(t):
    """A copy of t (or None) in memory from CuPy's pool, allocated on torch's current stream so
    that its reuse is ordered with the kernels that read it. Torch's CUDA graph pools then never
    hold a kept copy: cudagraph trees' warm-up puts every torch allocation of its thread in its
    pool, and fails on live ones it did not return."""
    if t is None:
        return None
    import cupy

    device = t.get_device()
    with cupy.cuda.Device(device), cupy.cuda.Stream.from_external(
            torch.cuda.current_stream(device)):
        memory = cupy.empty(t.numel() * t.element_size(), cupy.uint8)
    # t's strides kept: prepare makes dense tensors (contiguous or channels_last).
    return torch.from_dlpack(memory).view(t.dtype).as_strided(t.shape, t.stride()).copy_(t)


def prepared(prepare, x, sources):
    """prepare(x, *sources), kept while the sources stay the same tensors with the same data and
    version and x's device and dtype stay (one entry per first source and prepare; see the
    module's docstring for CUDA graphs). Weak references: the cache keeps neither the
    parameters nor, through them, the modules alive."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and not _FROZEN:
        return prepare(x, *sources)
    key = (prepare, x.device, x.dtype, *((0, 0) if t is None else (t.data_ptr(), t._version)
                                         for t in sources))
    entries = _PREPARED.setdefault(sources[0], {})
    cached = entries.get(prepare)
    if cached is None or cached[0] != key or not _same_tensors(cached[1], sources):
        if capturing:  # nothing made before the capture: make them in the graph
            return prepare(x, *sources)
        refs = tuple(None if t is None else weakref.ref(t) for t in sources)
        copies = prepare(x, *sources)
        if x.is_cuda:
            copies = tuple(_outside_torch_pools(t) for t in copies)
        cached = entries[prepare] = (key, refs, copies)
    if capturing:
        _FROZEN[-1].append(cached[2])
    return cached[2]
