"""The CPU convolution of torch_bridge.submanifold's op: one product per tap over the pairs
that tap has (index_select, mm: torch's threaded kernels), which skips the absent neighbours a
dense gather would multiply, and one embedding_bag that sums each output site's products in
spconv's order (see _SumGroup); the products go to a workspace each thread keeps (_workspace).
Small maps gather densely. The weight's gradient is a product a tap at a time."""

import collections
import math
import threading

import numpy
import torch

from sbnet_cupy.submanifold.numpy_rulebook import nonzero_2d

from .._derived import derived, keep

_DENSE_MAX_ENTRIES = 4096  # maps of at most this many entries gather densely (call overhead)
_GROUP_BYTES = 1 << 25  # products of a group of taps the CPU sums at once (_workspace holds them)
_WORKSPACE = threading.local()

# A map's pairs for the CPU: centre, the tap that reads each output site's own row (output o
# from input o, for every o; a submanifold kernel's), or None; and a block for each other tap
# with pairs: its tap k (taps), its pairs' output and input rows (out_rows, in_rows: lists of
# int64 tensors, a block each).
_TapPairs = collections.namedtuple("_TapPairs", ["centre", "taps", "out_rows", "in_rows"])

# The sum of a group of blocks (their indices) is one embedding_bag over their products,
# `sizes` rows each (in block order), after n_out lead rows where lead is set: the centre's
# products in the first group, the sum so far in the others. order lists the rows output by
# output, in tap order (the lead first), offsets where each output's list starts:
# embedding_bag adds each output's rows in that order, spconv's (the centre first, then the
# taps): the same bits.
_SumGroup = collections.namedtuple("_SumGroup", ["blocks", "lead", "sizes", "order",
                                                 "offsets"])


def _cpu_plan(neighbors):
    """How the CPU multiplies through a map int32 [K, N_out]: ("dense", rows int64 [N_out * K],
    the input row each entry reads, -1 for none) for a small map, else ("taps", _TapPairs). A
    tap at a time skips the absent entries that a dense gather would multiply, at the cost of a
    few calls a tap: a small map's cost is the calls. Built from the map's tap pairs (which
    build_rulebook seeds: seed_cpu_plans) on first use and kept while the map tensor, which a
    Rulebook keeps while it is used, stays the same (torch_bridge._derived)."""
    return derived(_build_cpu_plan, (neighbors,))


def _build_cpu_plan(neighbors):
    taps, n_out = neighbors.shape
    if taps * n_out <= _DENSE_MAX_ENTRIES:
        return "dense", neighbors.t().reshape(-1).long()
    return "taps", _tap_plan(derived(_tap_pairs, (neighbors,)))


def _tap_pairs(neighbors):
    """Per tap of the map int32 [K, N_out]: its pairs (out_rows, in_rows) int64 NumPy arrays, or
    None where output site o reads input row o for every o (a submanifold kernel's centre)."""
    neighbors = neighbors.numpy()
    flat, tap, out_rows = nonzero_2d(neighbors >= 0)  # row-major: grouped by tap
    in_rows = neighbors.reshape(-1)[flat].astype(numpy.int64)
    bounds = numpy.cumsum(numpy.bincount(tap, minlength=neighbors.shape[0]))[:-1]
    n_out = neighbors.shape[1]
    return [None if o.size == n_out and numpy.array_equal(o, i) else (o, i)
            for o, i in zip(numpy.split(out_rows, bounds), numpy.split(in_rows, bounds))]


def _tap_plan(pairs):
    """The _TapPairs of per-tap pairs (_tap_pairs')."""
    centre = next((k for k, pair in enumerate(pairs) if pair is None), None)
    taps = [(k, pair) for k, pair in enumerate(pairs) if pair is not None and pair[0].size]
    return _TapPairs(centre, [k for k, _ in taps],
                     *([torch.from_numpy(pair[side]) for _, pair in taps] for side in (0, 1)))


def _sum_groups(neighbors, pairs):
    """The _SumGroups of the "taps" plan of the map `neighbors`, at most `pairs` pairs a group
    (a larger tap alone), kept as the plan is."""
    return derived(_build_sum_groups, (neighbors,), (pairs,))


def _build_sum_groups(neighbors, pairs):
    _, plan = _cpu_plan(neighbors)
    groups, group, size = [], [], 0
    for i, rows in enumerate(plan.out_rows):
        if group and size + rows.shape[0] > pairs:
            groups.append(group)
            group, size = [], 0
        group.append(i)
        size += rows.shape[0]
    if group or plan.centre is not None:
        groups.append(group)
    out_rows = [rows.numpy() for rows in plan.out_rows]
    return [_sum_group(out_rows, neighbors.shape[1], group, g > 0 or plan.centre is not None)
            for g, group in enumerate(groups)]


def _group_pairs(cout, itemsize):
    """The most pairs a group of taps sums at once (_GROUP_BYTES of products of cout channels),
    a power of two: few distinct sizes, few kept groupings of a map."""
    pairs = max(1, _GROUP_BYTES // (cout * itemsize))
    return 1 << (pairs.bit_length() - 1)


def _sum_group(out_rows, n_out, blocks, lead):
    """The _SumGroup of `blocks` (block i's output rows: out_rows[i], NumPy): each output's
    list of product rows filled a block at a time, a counting sort (a tap's outputs are
    distinct, so each moves its output's cursor by one; NumPy, whose indexing costs less a call
    than torch's)."""
    sizes = [n_out] * lead + [out_rows[i].size for i in blocks]
    pairs = numpy.concatenate([out_rows[i] for i in blocks] or [numpy.empty(0, numpy.int64)])
    counts = numpy.bincount(pairs, minlength=n_out) + lead
    offsets = numpy.cumsum(counts) - counts
    rows = numpy.arange(sum(sizes))
    order = numpy.empty_like(rows)
    cursor = offsets.copy()
    if lead:
        order[cursor] = rows[:n_out]
        cursor += 1
    at = n_out if lead else 0
    for i in blocks:
        outputs = out_rows[i]
        place = cursor[outputs]
        order[place] = rows[at:at + outputs.size]
        place += 1
        cursor[outputs] = place
        at += outputs.size
    return _SumGroup(blocks, lead, sizes, torch.from_numpy(order), torch.from_numpy(offsets))


def seed_cpu_plans(rulebook, tap_pairs):
    """Seeds _cpu_plan with the pairs of a CPU rulebook's two maps, from the NumPy backend's
    tap_pairs (see sbnet_cupy.submanifold.Rulebook): the maps hold the same pairs, turned
    around. The plans are built when a product first needs them."""
    neighbors, neighbors_t = rulebook.neighbors, rulebook.neighbors_t
    taps, n_out = neighbors.shape
    n_in = neighbors_t.shape[1]
    if tap_pairs is None or taps * min(n_out, n_in) <= _DENSE_MAX_ENTRIES:
        return  # a small map gathers densely (_cpu_plan)
    keep(_tap_pairs, (neighbors,), (), tap_pairs)
    # None (each site reads its own row) comes of submanifold rulebooks only: the same sites
    # both ways, so the turned-around tap is None too.
    keep(_tap_pairs, (neighbors_t,), (), [None if pair is None else pair[::-1]
                                          for pair in tap_pairs])


def _workspace(shapes, dtype):
    """Tensors of `shapes` and dtype, one after the other in a block this thread keeps between
    calls: fresh blocks of megabytes come from the system as new pages, a page fault every
    4 KiB, which cost the CPU convolution as much as its sums."""
    sizes = [math.prod(shape) for shape in shapes]
    block = getattr(_WORKSPACE, "block", None)
    if block is None or block.dtype != dtype or block.numel() < sum(sizes):
        block = _WORKSPACE.block = torch.empty(sum(sizes), dtype=dtype)
    return [part.view(shape) for part, shape in zip(block[:sum(sizes)].split(sizes), shapes)]


def _acc(t):
    """The CPU arithmetic's dtype for t's: float64 stays, the rest computes in float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _gathered_cpu(x, rows, n_out):
    """[n_out, K * C]: x's rows that rows [n_out * K] lists (-1: the zero row appended)."""
    padded = torch.cat([x, x.new_zeros((1, x.shape[1]))])
    return padded[rows].reshape(n_out, -1)


def conv_cpu(features, weight, bias, neighbors):
    """y[o] = bias + sum over taps k of weight[:, k] @ features[neighbors[k, o]]."""
    x, w, n_out = _acc(features), _acc(weight), neighbors.shape[1]
    kind, plan = _cpu_plan(neighbors)
    if kind == "dense":
        g = _gathered_cpu(x, plan, n_out)
        w = w.reshape(w.shape[0], -1).t()
        return (g @ w if bias is None else torch.addmm(_acc(bias), g, w)).to(features.dtype)
    cout = w.shape[0]
    weights = w.reshape(cout, -1, w.shape[-1]).permute(1, 2, 0).unbind()  # K x [Cin, Cout]
    groups = _sum_groups(neighbors, _group_pairs(cout, x.element_size()))
    # A tap's rows are gathered into `scratch`, still in cache for its product.
    products, scratch = _workspace(
        [(max((sum(g.sizes) for g in groups), default=0), cout),
         (max((rows.shape[0] for rows in plan.in_rows), default=0), x.shape[1])], x.dtype)
    y = x.new_zeros((n_out, cout)) if not groups else None  # no pairs at all
    for g, group in enumerate(groups):
        parts = products[:sum(group.sizes)].split(group.sizes)
        if group.lead and g == 0:
            torch.mm(x[:n_out], weights[plan.centre], out=parts[0])
        elif group.lead:
            parts[0].copy_(y)
        for i, part in zip(group.blocks, parts[group.lead:]):
            rows = torch.index_select(x, 0, plan.in_rows[i], out=scratch[:part.shape[0]])
            torch.mm(rows, weights[plan.taps[i]], out=part)
        y = torch.nn.functional.embedding_bag(group.order, products[:sum(group.sizes)],
                                              group.offsets, mode="sum")
    if bias is not None:
        y += _acc(bias)
    return y.to(features.dtype)


def grad_weight_cpu(features, dy, neighbors, weight_shape, out_dtype):
    """dw[:, k] = dy[out_rows].T @ features[in_rows] over tap k's pairs, in out_dtype."""
    x, g = _acc(features), _acc(dy)
    kind, plan = _cpu_plan(neighbors)
    if kind == "dense":
        g_x = _gathered_cpu(x, plan, dy.shape[0])
        return (g.t() @ g_x).reshape(weight_shape).to(out_dtype)
    dw = x.new_zeros((weight_shape[0], math.prod(weight_shape[1:-1]), weight_shape[-1]))
    if plan.centre is not None:
        dw[:, plan.centre] = g.t() @ x[:dy.shape[0]]
    for k, out_rows, in_rows in zip(plan.taps, plan.out_rows, plan.in_rows):
        dw[:, k] = g.index_select(0, out_rows).t() @ x.index_select(0, in_rows)
    return dw.reshape(weight_shape).to(out_dtype)
