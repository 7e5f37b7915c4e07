"""The one cache of what the torch bridge derives from tensors: weight copies in a kernel's
layout (_weights.prepared), a pruned kernel's index arrays and their torch views, the CPU
submanifold convolution's plans of a map. Each entry is found by what it is (`what`, the function
that makes it), an extra hashable key (a kernel shape, a group size, x's device and dtype) and
its source tensors, and holds while each source is the same tensor object with the same memory
(data_ptr), version and device:

- an in-place change of a source bumps its version, `.data =` (nn.Module.to) moves its memory:
  either makes the next lookup miss, and the value is made again;
- a new tensor, even one at a freed tensor's address and with its values, is a new entry;
- the cache holds its sources by weak reference: a first source's entries go when it does, and
  the cache keeps neither the tensors nor, through them, the modules alive (a value must not
  refer to its sources: copy what it needs of them);
- inference tensors count no versions (torch's inference_mode): their in-place changes, made
  under inference_mode only, are not seen.

Values are anything but None (tensors, tuples of them, sbnet_cupy objects, lists); the cache
neither copies them nor knows of CUDA graphs: a lookup while a graph is captured returns the
value made before (see _weights for the weight copies' rules under capture).
"""

import functools
import weakref

# id(first source) -> (weak ref to it, {(what, key): (first's stamp, ((weak ref, stamp) of each
#                                                    other source), value)})
_SLOTS = {}


def _stamp(t):
    """What of a source, besides its identity, an entry depends on: its memory, version (None
    for an inference tensor, which counts none) and device."""
    if t is None:
        return None
    try:
        version = t._version
    except RuntimeError:  # an inference tensor
        version = None
    return t.data_ptr(), version, t.device


def _unchanged(t, stamp):
    """Whether t still has the memory, version and device of stamp (_stamp's)."""
    try:  # no tuple made, and no exception raised for an inference tensor: a hit costs little
        return (t.data_ptr() == stamp[0] and (stamp[1] is None or t._version == stamp[1])
                and t.device == stamp[2])
    except RuntimeError:  # made an inference tensor since (`.data =` under inference_mode)
        return False


def _forget(slots, slot_id, ref):
    """The weak reference's callback: the first source is going, and its entries with it."""
    slot = slots.get(slot_id)
    if slot is not None and slot[0] is ref:
        slots.pop(slot_id, None)


def lookup(what, sources, key=()):
    """The value kept for (what, key) of `sources` (a tuple of tensors, the first one not None,
    the others may be), or None: none kept, or kept for other tensors, memory or versions."""
    first = sources[0]
    slot = _SLOTS.get(id(first))
    if slot is None or slot[0]() is not first:
        return None
    entry = slot[1].get((what, key))
    if entry is None or not _unchanged(first, entry[0]):
        return None
    if not entry[1]:  # the first source alone, as most are
        return entry[2] if len(sources) == 1 else None
    if len(entry[1]) != len(sources) - 1:
        return None
    for (ref, stamp), t in zip(entry[1], sources[1:]):
        if t is None:
            if ref is not None:
                return None
        elif ref is None or ref() is not t or not _unchanged(t, stamp):
            return None
    return entry[2]


def keep(what, sources, key, value):
    """Keeps value for (what, key) of `sources` (see lookup), in place of any value kept for
    them before, and drops the values of the first source's older versions; returns it. Also
    how a builder that has a value at hand (build_rulebook's tap pairs) seeds an entry that
    would otherwise be made from the tensors."""
    first = sources[0]
    slot = _SLOTS.get(id(first))
    if slot is None or slot[0]() is not first:
        ref = weakref.ref(first, functools.partial(_forget, _SLOTS, id(first)))
        slot = _SLOTS[id(first)] = (ref, {})
    stamp, entries = _stamp(first), slot[1]
    for k, entry in list(entries.items()):  # a copy: another thread may keep one meanwhile
        if not _unchanged(first, entry[0]):  # an older version's: never found again
            entries.pop(k, None)
    others = tuple((None if t is None else weakref.ref(t), _stamp(t)) for t in sources[1:])
    entries[what, key] = (stamp, others, value)
    return value


def derived(make, sources, key=()):
    """make(*sources, *key), kept for these sources and key (see lookup) and made again when
    they change."""
    value = lookup(make, sources, key)
    if value is None:
        value = keep(make, sources, key, make(*sources, *key))
    return value
