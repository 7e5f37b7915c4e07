"""The rulebooks and the differentiable convolution behind torch_bridge.submanifold's modules.

Rulebooks (sbnet_cupy.submanifold) are built outside the differentiable op, once per active
set: CUDA tensors build them with sbnet_cupy's hash-table kernels (through DLPack, on torch's
current stream), CPU tensors with its NumPy backend; a transposed convolution's with torch ops
(transposed_rulebook). The convolution is the op sbnet::submanifold_conv (registered as in
_ops.py: CPU and CUDA kernels, fake kernels, autograd; called directly when eager). On CUDA it
is a gather through the rulebook and one cuBLAS product (torch.addmm), or the fused kernel; on
the CPU, one product per tap over the pairs that tap has (index_select, mm: torch's threaded
kernels), which skips the absent neighbours a dense gather would multiply, and one
embedding_bag that sums each output site's products in spconv's order (see _SumGroup); the
products go to a workspace each thread keeps (_workspace).
The gradient of the features is the same op through the transposed map, that of the weight one
more product (a tap at a time on the CPU), so the backward is deterministic.
Under CUDA autocast the op takes float32 weight and bias with float16 or bfloat16 features (see
rulebook_conv): it multiplies with them cast to the features' dtype, and returns their
gradients in float32, the weight's from a product of float16 (bfloat16) operands with float32
output (torch.mm's out_dtype), so that no gradient of a float32 parameter passes through
float16, whose sum over many sites GradScaler's scale overflows.
"""

import collections
import functools
import math
import threading

import numpy
import torch

from sbnet_cupy.core import checks as _checks
from sbnet_cupy import submanifold as _core

from .._ops import (_call, _checked, _contiguous, _float_scratch, _raw_stream, _register,
                    _same_device)


# --- the op -------------------------------------------------------------------------------

def _gathered(features, neighbors):
    """[N_out, K * C]: the rows of CUDA features each output site reads (zeros for -1)."""
    taps, n_out = neighbors.shape
    out = features.new_empty((n_out, taps * features.shape[1]))
    device = features.get_device()
    _core.launch_gather(device, _raw_stream(device), features.data_ptr(), out.data_ptr(),
                        neighbors.data_ptr(), n_out, taps,
                        features.shape[1] * features.element_size())
    return out


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
    few calls a tap: a small map's cost is the calls. Built from the pairs build_rulebook seeds
    (_seed_cpu_plans) or from the map, and cached on the map tensor, which a Rulebook keeps
    while it is used."""
    plan = getattr(neighbors, "_sbnet_cpu_plan", None)
    if plan is None:
        taps, n_out = neighbors.shape
        if taps * n_out <= _DENSE_MAX_ENTRIES:
            plan = ("dense", neighbors.t().reshape(-1).long())
        else:
            pairs = getattr(neighbors, "_sbnet_tap_pairs", None)
            plan = ("taps", _tap_plan(_tap_pairs(neighbors) if pairs is None else pairs))
        neighbors._sbnet_cpu_plan = plan
    return plan


def _tap_pairs(neighbors):
    """Per tap of the map int32 [K, N_out]: its pairs (out_rows, in_rows) int64 NumPy arrays, or
    None where output site o reads input row o for every o (a submanifold kernel's centre)."""
    neighbors = neighbors.numpy()
    flat, tap, out_rows = _core._nonzero(neighbors >= 0)  # row-major: grouped by tap
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


def _sum_groups(neighbors, plan, pairs):
    """The _SumGroups of a "taps" plan of the map `neighbors`, at most `pairs` pairs a group
    (a larger tap alone), cached on the map."""
    cache = neighbors.__dict__.setdefault("_sbnet_sum_groups", {})
    if pairs not in cache:
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
        cache[pairs] = [_sum_group(out_rows, neighbors.shape[1], group,
                                   g > 0 or plan.centre is not None)
                        for g, group in enumerate(groups)]
    return cache[pairs]


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


def _seed_cpu_plans(rulebook, tap_pairs):
    """Seeds _cpu_plan with the pairs of a CPU rulebook's two maps, from the NumPy backend's
    tap_pairs (see sbnet_cupy.submanifold.Rulebook): the maps hold the same pairs, turned
    around. The plans are built when a product first needs them."""
    neighbors, neighbors_t = rulebook.neighbors, rulebook.neighbors_t
    taps, n_out = neighbors.shape
    n_in = neighbors_t.shape[1]
    if tap_pairs is None or taps * min(n_out, n_in) <= _DENSE_MAX_ENTRIES:
        return  # a small map gathers densely (_cpu_plan)
    neighbors._sbnet_tap_pairs = tap_pairs
    # None (each site reads its own row) comes of submanifold rulebooks only: the same sites
    # both ways, so the turned-around tap is None too.
    neighbors_t._sbnet_tap_pairs = [None if pair is None else pair[::-1] for pair in tap_pairs]


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


def _conv_cpu(features, weight, bias, neighbors):
    """y[o] = bias + sum over taps k of weight[:, k] @ features[neighbors[k, o]]."""
    x, w, n_out = _acc(features), _acc(weight), neighbors.shape[1]
    kind, plan = _cpu_plan(neighbors)
    if kind == "dense":
        g = _gathered_cpu(x, plan, n_out)
        w = w.reshape(w.shape[0], -1).t()
        return (g @ w if bias is None else torch.addmm(_acc(bias), g, w)).to(features.dtype)
    cout = w.shape[0]
    weights = w.reshape(cout, -1, w.shape[-1]).permute(1, 2, 0).unbind()  # K x [Cin, Cout]
    pairs = max(1, _GROUP_BYTES // (cout * x.element_size()))
    groups = _sum_groups(neighbors, plan, 1 << (pairs.bit_length() - 1))  # few distinct sizes
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


def _grad_weight_cpu(features, dy, neighbors, weight_shape, out_dtype):
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


def _as_features(t, features):
    """t (a weight or bias) in the features' dtype: autocast's float32 parameters (see
    rulebook_conv) are cast here, inside the op, where no gradient is recorded."""
    return t if t is None or t.dtype == features.dtype else t.to(features.dtype)


def _conv_impl(features, weight, bias, neighbors, neighbors_t, order, order_t, algo):
    features = _contiguous(features)
    weight, bias = _contiguous(_as_features(weight, features)), _as_features(bias, features)
    if not features.is_cuda:
        return _conv_cpu(features, weight, bias, neighbors)
    if algo == "fused":
        taps, n_out = neighbors.shape
        out = features.new_empty((n_out, weight.shape[0]))
        device = features.get_device()
        _core.launch_fused(device, _raw_stream(device), features.data_ptr(), weight.data_ptr(),
                           0 if bias is None else _contiguous(bias).data_ptr(),
                           neighbors.data_ptr(), out.data_ptr(), n_out, features.shape[1],
                           weight.shape[0], taps, _checks.dtype_name(features),
                           functools.partial(_float_scratch, features.device),
                           0 if order is None else order.data_ptr())
        return out
    taps = weight.reshape(weight.shape[0], -1)
    g = _gathered(features, neighbors)
    return g @ taps.t() if bias is None else torch.addmm(bias, g, taps.t())


def _conv_fake(features, weight, bias, neighbors, neighbors_t, order, order_t, algo):
    return features.new_empty((neighbors.shape[1], weight.shape[0]))


def _conv_setup(ctx, inputs, output):
    features, weight, bias, neighbors, neighbors_t, order, order_t, ctx.algo = inputs
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.orders = order is not None, order_t is not None
    ctx.save_for_backward(features, weight, neighbors, neighbors_t,
                          *(o for o in (order, order_t) if o is not None))


def _conv_backward(ctx, grad):
    features, weight, neighbors, neighbors_t, *orders = ctx.saved_tensors
    order, order_t = (orders.pop(0) if given else None for given in ctx.orders)
    grad = _contiguous(grad)
    dx = dw = db = None
    if ctx.needs_input_grad[0]:  # the dual op: the transposed map, the transposed weight
        weight_t = weight.transpose(0, -1).contiguous()  # float32 under autocast: op casts it
        dx = _call(_conv_op, _conv_autograd, _conv_impl,
                   (grad, weight_t, None, neighbors_t, neighbors, order_t, order, ctx.algo),
                   (grad, weight_t, neighbors_t, neighbors), (grad, weight_t))
    if ctx.needs_input_grad[1]:
        # In the weight's dtype: float32 under autocast (see _grad_weight_impl).
        dw = _call(_grad_weight_op, None, _grad_weight_impl,
                   (features, grad, neighbors, list(weight.shape), weight.dtype),
                   (features, grad, neighbors))
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        db = grad.sum(0, dtype=ctx.bias_dtype)
    return dx, dw, db, None, None, None, None, None


_conv_op, _conv_autograd = _register(
    "submanifold_conv(Tensor features, Tensor weight, Tensor? bias, Tensor neighbors, "
    "Tensor neighbors_t, Tensor? order, Tensor? order_t, str algo) -> Tensor",
    _conv_impl, _conv_fake, _conv_setup, _conv_backward)


def _grad_weight_impl(features, dy, neighbors, weight_shape, out_dtype):
    """The weight's gradient [*weight_shape] in out_dtype: the features' dtype, or float32 for
    float16 and bfloat16 features (autocast's float32 weight), which cuBLAS then sums and
    writes in float32 (the float16 output of a sum over 100k sites of GradScaler-scaled
    products overflows)."""
    features, dy = _contiguous(features), _contiguous(dy)
    if not features.is_cuda:
        return _grad_weight_cpu(features, dy, neighbors, weight_shape, out_dtype)
    g = _gathered(features, neighbors)
    if out_dtype == dy.dtype:
        dw = dy.t() @ g
    elif out_dtype == torch.float32 and dy.dtype in (torch.float16, torch.bfloat16):
        dw = torch.mm(dy.t(), g, out_dtype=torch.float32)  # torch >= 2.8 on CUDA
    else:
        dw = torch.mm(dy.t().to(out_dtype), g.to(out_dtype))
    return dw.reshape(weight_shape)


def _grad_weight_fake(features, dy, neighbors, weight_shape, out_dtype):
    return features.new_empty(weight_shape, dtype=out_dtype)


_grad_weight_op, _ = _register(
    "submanifold_conv_grad_weight(Tensor features, Tensor dy, Tensor neighbors, "
    "int[] weight_shape, ScalarType out_dtype) -> Tensor",
    _grad_weight_impl, _grad_weight_fake)


# --- rulebooks ----------------------------------------------------------------------------

class Rulebook(_core.Rulebook):
    """sbnet_cupy.submanifold.Rulebook with torch tensors and spconv's names: neighbors int32
    [K, N_out], neighbors_t int32 [K, N_in], in_indices int32 [N_in, 1 + D] and out_indices
    int32 [N_out, 1 + D] (the core's in_coords and out_coords), in_shape and out_shape (lists
    of D ints), batch_size, kernel_size, stride, padding, dilation (lists of D ints), subm,
    inverted and transposed (a transposed convolution's: see transposed_rulebook). On CUDA it
    carries the device tables of its sites that build_rulebook may reuse; inverse() swaps them
    with the sites."""

    def __init__(self, neighbors, neighbors_t, in_indices, out_indices, in_shape, out_shape,
                 batch_size, kernel_size, stride, padding, dilation, subm, inverted=False,
                 transposed=False):
        """The core's arguments, with the sites under spconv's names (keywords included)."""
        super().__init__(neighbors, neighbors_t, in_indices, out_indices, in_shape, out_shape,
                         batch_size, kernel_size, stride, padding, dilation, subm, inverted)
        self.transposed = transposed

    @staticmethod
    def _sorted_rows(neighbors):
        """fused_order's rows of a CUDA map: a stable argsort of their tap_masks."""
        taps, n = neighbors.shape
        masks = torch.empty(n, dtype=torch.int32, device=neighbors.device)
        device = neighbors.get_device()
        _core.launch_tap_masks(device, _raw_stream(device), neighbors.data_ptr(),
                               masks.data_ptr(), n, taps)
        return torch.argsort(masks, stable=True).to(torch.int32)

    @property
    def in_indices(self):
        return self.in_coords

    @property
    def out_indices(self):
        return self.out_coords


def build_rulebook(indices, spatial_shape, batch_size, kernel_size, stride=1, padding=0,
                   dilation=1, subm=False, *, check=True, reuse=()):
    """The Rulebook of a submanifold (subm=True; stride and padding unused) or strided sparse
    convolution on the sites `indices` (int32 [N, 1 + D], CPU or CUDA), on their device. Not
    differentiable. A CUDA build syncs with the host to check the indices (unless check=False:
    see sbnet_cupy.submanifold.submanifold_rulebook) and, if strided, to count its outputs
    (one sync for both).

    reuse: Rulebooks (a SparseConvTensor's indice_dict.values()) whose tables of these very
    indices (the same tensor object, as a layer's output carries them) this build may reuse
    instead of building its own: a submanifold rulebook on a strided one's output sites then
    costs one kernel launch. The modules pass it."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    shape = [int(s) for s in spatial_shape]
    indices = _contiguous(indices)
    if indices.is_cuda:
        shape_t, batch, geometry, out_shape = _core.rulebook_geometry(
            indices, shape, batch_size, kernel_size, stride, padding, dilation, subm)
        device = indices.get_device()
        built = _core.build_raw(_TorchAlloc(indices.device), device, _raw_stream(device),
                                indices, indices.data_ptr(), shape_t, batch, geometry,
                                out_shape, check, _reusable_table(reuse, indices, shape_t,
                                                                  batch, check))
        if built is not None:
            rulebook = Rulebook(built.neighbors, built.neighbors_t, indices,
                                indices if subm else built.out_coords, list(shape_t),
                                list(out_shape or shape_t), batch, *map(list, geometry), subm)
            rulebook._tables = (built.in_table, built.out_table)
            return rulebook
        import cupy  # a strided output grid too large for a bitmap: CuPy's hash and sort

        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(_raw_stream(device)):
            result = _build(cupy.from_dlpack(indices), shape, batch_size, kernel_size, stride,
                            padding, dilation, subm, check)
        convert = torch.from_dlpack
    else:
        result = _build(indices.numpy(), shape, batch_size, kernel_size, stride, padding,
                        dilation, subm, check)
        convert = torch.from_numpy
    out_indices = indices if subm else convert(result.out_coords)
    rulebook = Rulebook(convert(result.neighbors), convert(result.neighbors_t), indices,
                        out_indices, list(result.in_shape), list(result.out_shape),
                        result.batch_size, list(result.kernel_size), list(result.stride),
                        list(result.padding), list(result.dilation), subm)
    if not indices.is_cuda:
        _seed_cpu_plans(rulebook, result.tap_pairs)
    return rulebook


def deconv_output_shape(shape, kernel_size, stride, padding, output_padding):
    """Spatial shape of a transposed convolution's output, spconv's: (in - 1) * stride -
    2 * padding + kernel_size + output_padding (dilation does not enter, as in spconv)."""
    out = [(s - 1) * st - 2 * p + k + op
           for s, k, st, p, op in zip(shape, kernel_size, stride, padding, output_padding)]
    if min(out) < 1:
        raise ValueError(f"kernel_size {list(kernel_size)}, stride {list(stride)}, padding "
                         f"{list(padding)} and output_padding {list(output_padding)} leave no "
                         f"output of spatial_shape {list(shape)}")
    return out


def transposed_rulebook(indices, spatial_shape, batch_size, kernel_size, stride=1, padding=0,
                        dilation=1, output_padding=0, *, check=True):
    """The Rulebook of a transposed sparse convolution (spconv's SparseConvTranspose): input
    site i feeds, through tap k, output o = i * stride - padding + k * dilation wherever o lies
    in deconv_output_shape; the output sites are every such o, sorted by (batch, coordinates).
    Built with torch ops on the indices' device (a CUDA build syncs with the host to count the
    sites, and once more with check). check: ValueError naming indices for duplicate or
    out-of-range rows."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    indices = _contiguous(indices)
    shape, batch, geometry, _ = _core.rulebook_geometry(
        indices, spatial_shape, batch_size, kernel_size, stride, padding, dilation, False)
    kernel, stride, padding, dilation = (list(v) for v in geometry)
    output_padding = _core._ints("output_padding", output_padding, len(shape), 0)
    out_shape = deconv_output_shape(shape, kernel, stride, padding, output_padding)
    if check:
        _check_sites(indices, shape, batch)
    device = indices.device
    taps = torch.from_numpy(_core._taps(kernel)).to(device)  # [K, D], row-major
    sites = indices[:, 1:].long()
    targets = (sites[None] * torch.tensor(stride, device=device)
               - torch.tensor(padding, device=device)
               + taps[:, None] * torch.tensor(dilation, device=device))  # [K, N, D]
    limits = torch.tensor(out_shape, device=device)
    valid = ((targets >= 0) & (targets < limits)).all(-1)
    keys = _linear(indices[:, 0].long().expand(valid.shape)[valid], targets[valid], out_shape)
    out_keys, out_rows = torch.unique(keys, sorted=True, return_inverse=True)
    tap, row = valid.nonzero(as_tuple=True)
    neighbors_t = torch.full(valid.shape, -1, dtype=torch.int32, device=device)
    neighbors_t[valid] = out_rows.int()
    # Each (output, tap) reads at most one input: (o + padding - k * dilation) / stride.
    neighbors = torch.full((valid.shape[0], out_keys.shape[0]), -1, dtype=torch.int32,
                           device=device)
    neighbors[tap, out_rows] = row.int()
    return Rulebook(neighbors, neighbors_t, indices, _decode(out_keys, out_shape), list(shape),
                    out_shape, batch, kernel, stride, padding, dilation, False,
                    transposed=True)


def _linear(batch, coords, shape):
    """int64 keys (b * S0 + c0) * S1 + c1 ... of coords [N, D] in batch x shape."""
    keys = batch
    for axis, size in enumerate(shape):
        keys = keys * size + coords[:, axis]
    return keys


def _decode(keys, shape):
    """int32 sites [N, 1 + D] of _linear's keys."""
    columns = []
    for size in reversed(shape):
        columns.append(keys % size)
        keys = keys // size
    columns.append(keys)
    return torch.stack(columns[::-1], dim=1).int()


def _check_sites(indices, shape, batch):
    """ValueError naming indices for rows outside batch x shape or repeated (a host sync on
    CUDA)."""
    limits = torch.tensor([batch, *shape], device=indices.device)
    outside = ((indices < 0) | (indices >= limits)).any(1)
    if outside.any():
        row = int(outside.nonzero()[0, 0])
        raise ValueError(f"indices row {row} = {tuple(indices[row].tolist())} is outside "
                         f"batch_size x spatial_shape = {batch} x {tuple(shape)}")
    keys = _linear(indices[:, 0].long(), indices[:, 1:].long(), shape)
    ordered = torch.sort(keys).values
    repeated = (ordered[1:] == ordered[:-1]).nonzero()
    if repeated.numel():
        site = _decode(ordered[repeated[0]], shape)[0]
        raise ValueError(f"indices has duplicate rows, e.g. {tuple(site.tolist())}")


class _TorchAlloc:
    """sbnet_cupy.submanifold.build_raw's device arrays: torch tensors on `device` (its caching
    allocator, on torch's current stream, where the kernels run)."""

    _DTYPES = {"int32": torch.int32, "int64": torch.int64}

    def __init__(self, device):
        self.device = device

    def empty(self, shape, dtype):
        t = torch.empty(shape, dtype=self._DTYPES[dtype], device=self.device)
        return t, t.data_ptr()

    @staticmethod
    def host(t):
        return t.cpu().numpy()


def _reusable_table(reuse, indices, shape, batch, check):
    """A table of `indices` (this tensor object) on grid batch x shape that one of the
    Rulebooks in `reuse` carries, checked if `check`; None if none does."""
    for rulebook in reuse:
        if not isinstance(rulebook, Rulebook):
            continue
        for table, sites in zip(rulebook._tables, (rulebook.in_indices, rulebook.out_indices)):
            if (table is not None and sites is indices and table.shape == shape
                    and table.batch == batch and (table.checked or not check)):
                return table
    return None


def _build(coords, shape, batch_size, kernel_size, stride, padding, dilation, subm, check):
    if subm:
        return _core.submanifold_rulebook(coords, shape, batch_size, kernel_size, dilation,
                                          check=check)
    return _core.strided_rulebook(coords, shape, batch_size, kernel_size, stride, padding,
                                  dilation, check=check)


# What check_operands reads of a tensor, for a float32 parameter checked as if cast.
_AsCast = collections.namedtuple("_AsCast", ["shape", "ndim", "dtype"])


def _as_cast(t, dtype):
    """A float32 t as check_operands would see it cast to dtype; t itself otherwise."""
    return t if t is None or t.dtype != torch.float32 else _AsCast(t.shape, t.ndim, dtype)


def _check_conv(features, weight, bias, neighbors, kernel_size, n_in, algo, autocast=False):
    """rulebook_conv's checks; autocast: its CUDA autocast path, where a float32 weight or bias
    goes with float16 or bfloat16 features (the op casts it): checked as if cast."""
    if autocast:
        weight, bias = _as_cast(weight, features.dtype), _as_cast(bias, features.dtype)
    _core.check_operands(features, weight, bias, kernel_size, n_in)
    if neighbors.dtype != torch.int32:
        raise TypeError(f"the rulebook's maps must be int32, got {neighbors.dtype}")
    _core.check_algo(algo, _checks.dtype_name(features))


_CHECKS = {}


def _autocast_param(t, dtype):
    """A weight or bias under CUDA autocast: float32 as it is (the op casts it), other dtypes
    cast to dtype (differentiably)."""
    return t if t is None or t.dtype == torch.float32 else t.to(dtype)


def rulebook_conv(features, rulebook, weight, bias=None, *, algo=None):
    """sbnet_cupy.submanifold.rulebook_conv on tensors: features [N_in, Cin] through a Rulebook
    (build_rulebook, or .inverse() of one), weight [Cout, *kernel_size, Cin], bias [Cout] or
    None; returns [N_out, Cout]. Differentiable in features, weight and bias. algo: "gemm"
    (gather, then torch.addmm: TF32 where torch allows it) or "fused" (float32 runs as TF32);
    None: sbnet_cupy.submanifold.choose_algo's (TF32 allowed by
    torch.backends.cuda.matmul.allow_tf32). CPU tensors multiply a tap at a time with torch's
    ops (float16 and bfloat16 in float32 arithmetic); algo is then unused.
    Under torch.autocast("cuda") the convolution runs in the autocast dtype; a float32 weight
    and bias (AMP's parameters) get float32 gradients that never pass through float16. Outside
    it, weight and bias must have the features' dtype."""
    if not isinstance(rulebook, Rulebook):
        raise TypeError(f"rulebook must be a torch_bridge.submanifold.Rulebook, got "
                        f"{type(rulebook).__name__}")
    neighbors, neighbors_t = rulebook.neighbors, rulebook.neighbors_t
    autocast = features.is_cuda and torch.is_autocast_enabled("cuda")
    if autocast:
        # As autocast runs a matrix product: in its dtype (the features' cast differentiable,
        # so that their gradient comes back in their dtype). A float32 weight and bias go into
        # the op as they are: it multiplies with them cast, and returns their gradients in
        # float32, never through float16 (an AMP step's scaled sums overflow it). Other dtypes
        # are cast here.
        dtype = torch.get_autocast_dtype("cuda")
        features = features.to(dtype)
        weight, bias = _autocast_param(weight, dtype), _autocast_param(bias, dtype)
        autocast = dtype in (torch.float16, torch.bfloat16)
    if algo is None:
        algo = "gemm" if not features.is_cuda else _core.choose_algo(
            _checks.dtype_name(features), torch.backends.cuda.matmul.allow_tf32)
    _checked(_CHECKS, _check_conv, (features, weight, bias, neighbors,
                                    tuple(rulebook.kernel_size), neighbors_t.shape[1], algo,
                                    autocast))
    _same_device(features, weight, bias, neighbors, features=features, weight=weight, bias=bias,
                 rulebook=neighbors)
    order = order_t = None
    if features.is_cuda and algo == "fused" and _core.fused_sorts(
            neighbors.shape[1], features.shape[1], weight.shape[0]):
        order = rulebook.fused_order()  # and the backward's dual op's, on neighbors_t
        if torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad):
            order_t = rulebook.fused_order(transposed=True)
    args = (features, weight, bias, neighbors, neighbors_t, order, order_t, algo)
    tensors = (features, weight, neighbors, neighbors_t) + (() if bias is None else (bias,))
    differentiable = (features, weight) + (() if bias is None else (bias,))
    return _call(_conv_op, _conv_autograd, _conv_impl, args, tensors, differentiable)
