"""torch_bridge._derived, the one cache of what the bridge derives from tensors: a hit returns
the value made before; an in-place change, new memory, another tensor (at the same address or
with the same values), another extra key, x dtype or device is another entry; an entry goes with
its first source, and keeps neither it nor a module alive. The pruned convolution follows its
positions changed in place."""

import gc
import weakref

import pytest

from conftest import require

torch = require("torch")

import torch_bridge as tb  # noqa: E402
from torch_bridge import _derived, _weights  # noqa: E402
from torch_bridge.pruned import sparse_kernel_conv as pruned  # noqa: E402


class Made:
    def __init__(self, call, key):
        self.call, self.key = call, key


class Maker:
    """make(*sources, *key): a new Made each call, counted, which holds the key it was given
    (not the sources: a value must not refer to them)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return Made(self.calls, tuple(a for a in args if not isinstance(a, torch.Tensor)))


def test_hit_returns_the_same_value():
    make, t = Maker(), torch.arange(5)
    first = _derived.derived(make, (t,))
    assert _derived.derived(make, (t,)) is first and make.calls == 1
    assert _derived.lookup(make, (t,)) is first
    assert _derived.lookup(Maker(), (t,)) is None  # another `what`


@pytest.mark.parametrize("change", [lambda t: t.add_(0), lambda t: t.copy_(t.clone()),
                                    lambda t: t.__setitem__(0, 0)],
                         ids=["add_", "copy_", "setitem"])
def test_in_place_change_makes_it_again(change):
    make, t = Maker(), torch.arange(5)
    first = _derived.derived(make, (t,))
    change(t)
    second = _derived.derived(make, (t,))
    assert second is not first and make.calls == 2
    assert _derived.derived(make, (t,)) is second


def test_new_memory_makes_it_again():
    """`.data =` (what nn.Module.to does) keeps the tensor object and its version."""
    make, t = Maker(), torch.arange(5.0)
    first = _derived.derived(make, (t,))
    version = t._version
    t.data = t.data.clone()
    assert t._version == version
    assert _derived.derived(make, (t,)) is not first and make.calls == 2


def test_other_tensors_are_other_entries():
    """Another tensor of the same values, and another tensor at the same address with the same
    version counter (a view of the same memory), are entries of their own."""
    make, base = Maker(), torch.arange(6)
    view = base[:]
    first = _derived.derived(make, (view,))
    same_address = base[:]
    assert same_address.data_ptr() == view.data_ptr() and same_address is not view
    assert _derived.derived(make, (same_address,)) is not first
    assert _derived.derived(make, (view.clone(),)) is not first
    assert _derived.derived(make, (view,)) is first and make.calls == 3


def test_extra_key_separates_and_is_passed():
    make, t = Maker(), torch.arange(3)
    one, two = _derived.derived(make, (t,), (1,)), _derived.derived(make, (t,), (1, 2))
    assert one.key == (1,) and two.key == (1, 2)
    assert _derived.derived(make, (t,), (1,)) is one and _derived.derived(make, (t,), (1, 2)) is two


def test_other_sources_by_identity_and_version():
    make, t, u = Maker(), torch.arange(3), torch.arange(4)
    first = _derived.derived(make, (t, u, None))
    assert _derived.derived(make, (t, u, None)) is first
    assert _derived.derived(make, (t, u.clone(), None)) is not first
    assert _derived.derived(make, (t, u, u)) is not first
    keep = _derived.derived(make, (t, u, None))
    u.add_(1)
    assert _derived.derived(make, (t, u, None)) is not keep and make.calls == 5


def test_dropped_with_its_source():
    """The entries of a source go when it is freed; the cache keeps neither it nor its value
    alive (nor the other sources)."""
    make, t, other = Maker(), torch.arange(5), torch.arange(2)
    value = weakref.ref(_derived.derived(make, (t, other)))
    source, other_ref, slot = weakref.ref(t), weakref.ref(other), id(t)
    assert slot in _derived._SLOTS and value() is not None
    del t, other
    gc.collect()
    assert source() is None and other_ref() is None and value() is None
    assert slot not in _derived._SLOTS


def test_inference_tensors():
    """Inference tensors count no versions: kept by identity, memory and device."""
    make = Maker()
    with torch.inference_mode():
        t = torch.arange(4)
    assert t.is_inference()
    first = _derived.derived(make, (t,))
    assert _derived.derived(make, (t,)) is first
    assert _derived.derived(make, (torch.arange(2), t)) is not first  # as another source too


def test_seeded_value_until_a_change():
    make, t = Maker(), torch.arange(4)
    seeded = ["seeded"]
    assert _derived.keep(make, (t,), (), seeded) is seeded
    assert _derived.derived(make, (t,)) is seeded and make.calls == 0
    t.add_(0)
    assert _derived.derived(make, (t,)).call == 1


def test_weight_copies_per_x_dtype_and_device():
    """prepared keeps one entry per x dtype and device, side by side; 'meta' stands in for a
    second device."""
    made = []

    def prepare(x, weight):
        made.append(x.dtype)
        return (weight.to(x.dtype),)

    weight = torch.randn(3)
    xs = [torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(1, device="meta")]
    copies = [_weights.prepared(prepare, x, (weight,)) for x in xs]
    assert len(made) == 3 and len({id(c) for c in copies}) == 3
    assert all(_weights.prepared(prepare, x, (weight,)) is c for x, c in zip(xs, copies))
    assert copies[1][0].dtype == torch.float64 and len(made) == 3


def _reference(conv, x):
    return torch.nn.functional.conv2d(x, conv.dense_weight(), conv.bias, conv.stride,
                                      conv.padding, conv.dilation)


def test_pruned_conv_follows_positions_changed_in_place():
    """The taps of positions are kept, and made again after positions changes in place; the
    module gives the dense convolution of its current mask."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(4, 3, 3, 3, generator=gen, dtype=torch.float64)
    dense[torch.rand(dense.shape, generator=gen) < 0.6] = 0
    conv = tb.SparseKernelConv2d(dense, torch.randn(4, generator=gen, dtype=torch.float64),
                                 padding=1)
    x = torch.randn(2, 3, 9, 11, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(conv(x), _reference(conv, x))
        taps = pruned._taps(conv.positions, conv.kernel_shape)
        assert pruned._taps(conv.positions, conv.kernel_shape) is taps
        conv.positions.add_(0)
        assert pruned._taps(conv.positions, conv.kernel_shape) is not taps
        moved = torch.randperm(dense.numel(), generator=gen)[:conv.positions.numel()]
        conv.positions.copy_(moved.sort().values)
        torch.testing.assert_close(conv(x), _reference(conv, x))


def test_module_not_kept_alive():
    conv = tb.SparseKernelConv2d(torch.ones(2, 2, 3, 3))
    with torch.no_grad():
        conv(torch.ones(1, 2, 5, 5))
    module, taps = weakref.ref(conv), weakref.ref(pruned._taps(conv.positions, conv.kernel_shape))
    del conv
    gc.collect()
    assert module() is None and taps() is None
