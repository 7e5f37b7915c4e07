"""Copies of parameters in the layout or dtype a kernel reads, made once per parameter version
and kept while the parameters stay the same tensors: eager calls and compiled graphs then launch
nothing to make them. While a CUDA graph is captured the copies are made inside the graph, so
that its replays follow in-place changes of the parameters, unless the capture runs under
frozen_weights() (as CapacityGraphs' does), which has the graph read the copies made before.
"""

import contextlib

import torch

from . import _derived

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
    """prepare(x, *sources), kept in the bridge's cache of derived values (_derived) while the
    sources stay the same tensors with the same memory and version, one entry per x device and
    dtype (see the module's docstring for CUDA graphs). The cache holds the sources by weak
    reference: it keeps neither the parameters nor, through them, the modules alive."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and not _FROZEN:
        return prepare(x, *sources)
    key = (x.device, x.dtype)
    copies = _derived.lookup(prepare, sources, key)
    if copies is None:
        if capturing:  # nothing made before the capture: make them in the graph
            return prepare(x, *sources)
        copies = prepare(x, *sources)
        if x.is_cuda:
            copies = tuple(_outside_torch_pools(t) for t in copies)
        _derived.keep(prepare, sources, key, copies)
    if capturing:
        _FROZEN[-1].append(copies)
    return copies
