"""The machinery behind torch_bridge's ops: each registered once with torch.library (schema,
CPU and CUDA kernels, fake kernels, autograd), and called from Python with as little host work
as possible. The ops themselves live with their families (torch_bridge.blocks.ops, ...).

How a call runs (``_route`` picks the route, which the op's wrapper calls, or ``_call`` does;
rulebook_conv and its backward pick it inline, with ``_traced``):
- Eager, nothing to record for autograd (``torch.no_grad()``, ``inference_mode()``, or no input
  that requires grad): the wrapper checks the arguments once, with sbnet_cupy's own checks, and
  calls the implementation directly, without the dispatcher (or, where that would add a frame
  on the way to the kernel, the implementation's lines: rulebook_conv). CUDA tensors launch the
  kernels through sbnet_cupy's launch functions of a backend, with
  torch_bridge.backend.TORCH, on torch's current stream.
- Eager, with a gradient to record: the same implementation inside a ``torch.autograd.Function``
  whose setup and backward are the functions registered as the op's autograd.
- Traced (torch.compile, torch.export, fake tensors, functorch transforms, dispatch modes): the
  wrapper calls ``torch.ops.sbnet.<op>``, which the tracer sees as one op with its fake kernel
  and its autograd.
The ops are defined with ``torch.library.Library.define`` and ``impl`` rather than
``torch.library.custom_op``, whose Python wrapper adds host time to every dispatched call (what
inductor's generated code makes in the default compile mode).
"""

import torch

from sbnet_cupy.core import checks as _checks

_lib = torch.library.Library("sbnet", "DEF")


def _register(schema, impl, fake, setup=None, backward=None):
    """Define sbnet::<op> with its CPU and CUDA kernel, fake kernel and autograd; returns the
    op's overload and, with a backward, the function that runs an eager call recording its
    gradient (see _autograd)."""
    name = schema[:schema.index("(")]
    _lib.define(schema)
    for key in ("CPU", "CUDA"):
        _lib.impl(name, impl, key)
    torch.library.register_fake(f"sbnet::{name}", fake, lib=_lib)
    if backward is None:
        return getattr(torch.ops.sbnet, name).default, None
    torch.library.register_autograd(f"sbnet::{name}", backward, setup_context=setup, lib=_lib)
    return getattr(torch.ops.sbnet, name).default, _autograd(name, impl, setup, backward)


def _autograd(name, impl, setup, backward):
    """An autograd.Function running impl, setup and backward, as its C apply. Function.apply's
    Python wrapper binds the arguments with inspect.signature on every call when the Function
    has a setup_context (more host time than a small op's launch) and unwraps functorch
    wrappers, which calls with functorch transforms active never reach (they go through the
    dispatcher, see _call)."""
    def forward(ctx, *args):
        output = impl(*args)
        setup(ctx, args, output)
        return output

    function = type(name, (torch.autograd.Function,),
                    dict(forward=staticmethod(forward), backward=staticmethod(backward)))
    return super(torch.autograd.Function, function).apply


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


def _traced(tensors):
    """Whether the call must go through the dispatcher: something is tracing or transforming it
    (torch.compile and torch.export set is_compiling; fake and functional tensors are
    subclasses; functorch and dispatch modes keep their own state)."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._len_torch_dispatch_stack() > 0):
        return True
    for t in tensors:  # a loop (and in _route): cheaper than issuperset(map()) or any()
        if type(t) not in _PLAIN:
            return True
    return False


def _route(op, autograd, impl, tensors, differentiable=()):
    """The cheapest route that serves a call of an op on `tensors` (see above): the dispatched
    op, its autograd.Function's apply, or its implementation, for the caller to call."""
    if _traced(tensors):
        return op
    if torch.is_grad_enabled():
        for t in differentiable:
            if t.requires_grad:
                return autograd
    return impl


def _call(op, autograd, impl, args, tensors, differentiable=()):
    """Run an op on checked arguments by the cheapest route that serves the call (_route)."""
    return _route(op, autograd, impl, tensors, differentiable)(*args)


def _checked(cache, check, args):
    """check(*args), remembered per shapes, dtypes and values when eager (see
    _checks.memoized); a traced call checks while it is traced."""
    if torch.compiler.is_compiling():
        return check(*args)
    return _checks.memoized(cache, check, args, torch.Tensor)


def _same_device(first, *others, **tensors):
    """Checks that the tensors (first, *others, named again in `tensors` for the message) are
    on one device."""
    device = first.get_device()
    for t in others:  # a loop: cheaper than all() of a generator, and every op calls this
        if t is not None and t.get_device() != device:
            break
    else:
        return
    devices = {name: t.get_device() for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        described = ", ".join(f"{n} is on {'cpu' if d < 0 else f'cuda:{d}'}"
                              for n, d in devices.items())
        raise ValueError(f"tensors on different devices: {described}")


def _contiguous(t):
    return t if t.is_contiguous() else t.contiguous()


def _numpy(t):
    """Zero-copy NumPy view of a CPU tensor, for the NumPy backend. bfloat16 travels as int16:
    NumPy has no bfloat16."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.detach().numpy()


def _block_list(bin_counts, active_block_indices):
    """int32 count [1] and indices [M, 3], contiguous: what the kernels read."""
    counts, indices = bin_counts, active_block_indices
    if counts.dtype != torch.int32 or not counts.is_contiguous() or counts.ndim != 1:
        counts = counts.to(torch.int32).reshape(1).contiguous()
    if indices.dtype != torch.int32 or not indices.is_contiguous():
        indices = indices.to(torch.int32).contiguous()
    return counts, indices


def _geometry(bsize, boffset, bstride):
    return _checks.BlockGeometry(tuple(bsize), tuple(boffset), tuple(bstride))
