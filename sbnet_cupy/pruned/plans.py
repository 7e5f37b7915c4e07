"""The pruned-kernel convolution's launch plans: the strategy rule (choose_strategy), and per
(strategy, shapes, dtype, device) the kernel's KernelPlan (core/plan.py), from the device's facts
(core.launch.device_info), for the forward and input-gradient convolutions (conv_plan) and the
values' gradient (grad_values_plan). Planning without a GPU passes a DeviceInfo (core.launch.H100).
"""

import functools
import math
from collections import namedtuple

from ..core import (checks as _checks, kernels as _kernels, launch as _launch, plan as _plan,
                    records as _records)

# The tile sizes, in one place. P: output rows a thread; Q: output channels a warp (a group).
# "compiled" keeps P * Q = 64 accumulators a thread and takes the Q of the table for the
# output channels (a wider group shares a column's window among more taps; with few output
# channels, more rows do instead).
_COMPILED_TILES = ((4, 16), (8, 8), (16, 4))  # (Q, P), by the smallest Q >= min(Cout, 16)
_COMPILED_WARPS = 8  # warps a CTA, stacked vertically (__launch_bounds__(256, 2) in the kernel)
# Code size (and NVRTC time, about linear in it) grows with the taps: above this many the rule
# runs "direct" and "compiled" refuses.
COMPILED_MAX_TAPS = 8192
_COMPILED_MAX_EXTENT = 33  # kernel rows (with dilation) a window may span: registers
_DIRECT_P, _DIRECT_Q = 8, 4
_GRAD_P, _GRAD_CO_CHUNK, _GRAD_WARPS = 16, 8, 8
_DIRECT_WARPS = 8  # warps a CTA (64 registers a thread)
_SPLIT_CTAS_PER_SM = 2  # "direct" splits its input channels until the grid has this many an SM
_OP = "sparse_kernel_conv"  # kernels/pruned/sparse_kernel_conv.cu
_SMEM_LIMIT = 48 * 1024  # dynamic shared memory without the opt-in attribute
# "compiled" opts in to more (the kernel attribute): at most this, and no more than keeps
# _COMPILED_CTAS_PER_SM CTAs on an SM of the device: larger chunks of input channels, fewer
# passes over them.
_COMPILED_SMEM_LIMIT = 100 * 1024
_COMPILED_CTAS_PER_SM = 2
_RESERVED_SMEM = 1024  # shared memory the GPU keeps for each CTA (compute capability 8.0 on)
# The kernels' argument records (sbnet_cupy/core/records.py): the plans build the int fields by
# name (Record.tail), and the launches put the pointers in front of them.
_CONV_ARGS = _records.CONV_ARGS
_GRAD_VALUES_ARGS = _records.GRAD_VALUES_ARGS


def choose_strategy(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                    input_dilation, nnz, *, info):
    """The strategy sparse_kernel_conv2d uses when none is given, for conv_plan's arguments on
    a GPU of DeviceInfo `info` (_launch.device_info): "compiled" where it applies, unless it
    takes two passes or more over the input channels with fewer CTAs than the GPU has SMs;
    "direct" elsewhere.

    "compiled" applies with unit vertical stride, no input dilation, float32 arithmetic, at most
    COMPILED_MAX_TAPS taps, a kernel extent (KH - 1) * DH + 1 <= 33 rows and room in shared
    memory for its tile and its values. It stages the input tile a chunk of input channels at a
    time (3-4 channels of 16-64 at 11x11xCinx3; "direct" 3), one group of output channels a CTA.
    On one image with few output channels its CTAs are fewer than the SMs, where "direct" has
    more tiles and splits their input channels over more CTAs; with one pass there is nothing to
    split. Elsewhere "compiled" was the faster in every case of the benchmark, very sparse
    kernels and inputs larger than L2 read in many passes included.

    The measurements behind it: bench/README.md, "The strategies and the rule";
    test_rule_matches_the_benchmark checks it against the committed run.
    """
    extent = (kernel_hw[0] - 1) * dilations[0] + 1
    if (dtype == "float64" or strides[0] != 1 or tuple(input_dilation) != (1, 1)
            or nnz > COMPILED_MAX_TAPS or extent > _COMPILED_MAX_EXTENT):
        return "direct"
    try:
        plan = _compiled_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations,
                              pads, input_dilation, nnz, None, info)
    except ValueError:  # no room in shared memory
        return "direct"
    passes, ctas = -(-cin // plan.layout[4]), math.prod(plan.kernel.grid)
    return "direct" if passes >= 2 and 0 < ctas < info.sms else "compiled"  # 0: empty output


ConvPlan = namedtuple("ConvPlan", ["strategy", "kernel", "layout", "split_sum", "scratch"])
ConvPlan.__doc__ = """The launches of a convolution: the strategy; the kernel's KernelPlan (record
ConvArgs, its int fields the plan's constants; "compiled" is a generated plan: its kernel
belongs to a weight's mask, Taps.compiled_function); the layout (None for "direct", the
program's (P, Q, tile columns, pitch, chunk, DH, DW) for "compiled"); and for "direct" with its
input channels split, the KernelPlan of the split sum (core.plan.split_sum_plan) that adds the
float32 partial sums the kernel writes, [splits, rows, pitch], into the output, and `scratch`,
their count (else None and 0)."""


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


@functools.lru_cache(maxsize=1024)
def conv_plan(strategy, dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
              input_dilation, nnz, device=None, info=None):
    """The ConvPlan of a convolution of an [n, *in_hw, cin] input (with input_dilation - 1
    zeros between its pixels) into [n, *out_hw, cout] by a kernel_hw weight of nnz taps, padded
    by pads (top, left); strategy None applies choose_strategy (and "direct" where the rule's
    "compiled" finds no room in shared memory). The plan is made for the GPU of DeviceInfo
    `info`, by default `device`'s; without a device (planning with no GPU), `info` must be
    given (such as _launch.H100). With a device, a "direct" plan carries the compiled kernels."""
    if info is None:
        if device is None:
            raise ValueError("conv_plan needs a device or a DeviceInfo (info) to plan for")
        info = _launch.device_info(device)
    if strategy is None:
        strategy = choose_strategy(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides,
                                   dilations, pads, input_dilation, nnz, info=info)
    if strategy == "compiled":
        return _compiled_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations,
                              pads, input_dilation, nnz, device, info)
    return _direct_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                        input_dilation, device, info)


def compiled_smem_limit(info):
    """Dynamic shared memory a "compiled" CTA may take on a GPU of DeviceInfo `info`."""
    return min(_COMPILED_SMEM_LIMIT, info.shared_per_block_optin,
               info.shared_per_sm // _COMPILED_CTAS_PER_SM - _RESERVED_SMEM)


def _compiled_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                   input_dilation, nnz, device, info):
    (k_h, k_w), (sh, sw), (dh, dw) = kernel_hw, strides, dilations
    if sh != 1 or tuple(input_dilation) != (1, 1):
        raise ValueError(f"strategy 'compiled' needs unit vertical strides (and, for the input "
                         f"gradient, unit strides), got strides {strides}")
    if dtype == "float64":
        raise TypeError("strategy 'compiled' computes in float32: float64 runs 'direct'")
    if nnz > COMPILED_MAX_TAPS:
        raise ValueError(f"strategy 'compiled' takes kernels of at most {COMPILED_MAX_TAPS} "
                         f"non-zero taps, got {nnz}")
    limit = compiled_smem_limit(info)
    q, p = next((t for t in _COMPILED_TILES if t[0] >= min(cout, 16)), _COMPILED_TILES[-1])
    groups = -(-cout // q)
    warps_y = max(1, min(_COMPILED_WARPS, -(-out_hw[0] // p)))
    window = _round_up(p + (k_h - 1) * dh, 4)  # rows of the quads a thread may load
    cols = 31 * sw + (k_w - 1) * dw + 1
    # Room for the largest run of values a group can have, after the tile.
    value_bytes = 4 * _round_up(max(min(nnz, q * k_h * k_w * cin), 1), 4)
    while True:
        rows = (warps_y - 1) * p + window
        pitch = _round_up(rows, 4)
        pitch += 4 if pitch % 8 == 0 else 0  # 4 (mod 8) words: 8 lanes' loads cover the banks
        channel_bytes = cols * pitch * 4
        if channel_bytes + value_bytes <= limit or warps_y == 1:
            break
        warps_y = 1
    chunk = min(cin, max(limit - value_bytes, 0) // channel_bytes) if cin else 1
    if chunk == 0:
        raise ValueError(f"strategy 'compiled' needs an input tile and values larger than the "
                         f"GPU kernels' shared memory ({channel_bytes} bytes a channel, "
                         f"{value_bytes} of values) with a {k_h}x{k_w} kernel, dilations "
                         f"{dilations}")
    grid = (groups * -(-out_hw[1] // 32), _checks.grid_dim("out_h", -(-out_hw[0] // (warps_y * p))),
            _checks.grid_dim("x (batch)", n))
    ints = _CONV_ARGS.tail(
        n=n, in_h=in_hw[0], in_w=in_hw[1], cin=cin, out_h=out_hw[0], out_w=out_hw[1], cout=cout,
        str_h=sh, str_w=sw, dil_h=dh, dil_w=dw, pad_h=pads[0], pad_w=pads[1], idil_h=1,
        idil_w=1, tile_rows=rows, tile_cols=cols, pitch=pitch, chunk=chunk, warps_y=warps_y,
        warps_q=1, groups=groups, split_cin=max(cin, 1))
    # The outputs pass through the same room on their way out (store_output_staged).
    output_bytes = warps_y * 32 * q * _kernels.ITEMSIZES[dtype]
    smem = max(chunk * channel_bytes + value_bytes, output_bytes)
    kernel = _plan.KernelPlan(device, _OP, "sparse_kernel_conv_compiled",
                              (_kernels.ARITHMETIC_CTYPES[dtype],), grid, (32 * warps_y, 1, 1),
                              smem, _CONV_ARGS, ints, generated=True)
    return ConvPlan("compiled", kernel, (p, q, cols, pitch, chunk, dh, dw), None, 0)


def _direct_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                 input_dilation, device, info):
    acc_size = 8 if dtype == "float64" else 4
    (k_h, k_w), (sh, sw), (dh, dw) = kernel_hw, strides, dilations
    p, q = _DIRECT_P, _DIRECT_Q
    groups = -(-cout // q)
    warps_q = max(1, min(groups, _DIRECT_WARPS))
    warps_y = max(1, min(_DIRECT_WARPS // warps_q, -(-out_hw[0] // p)))
    cols = 31 * sw + (k_w - 1) * dw + 1
    while True:
        rows = (warps_y * p - 1) * sh + (k_h - 1) * dh + 1
        pitch = rows | 1  # odd: lanes a column apart hit different banks
        channel_bytes = cols * pitch * acc_size
        if channel_bytes <= _SMEM_LIMIT or warps_y == 1:
            break
        warps_y = 1
    chunk = min(cin, _SMEM_LIMIT // channel_bytes) if cin else 1
    if chunk == 0:
        raise ValueError(f"dilations {dilations} with a {k_h}x{k_w} kernel need an input tile "
                         f"larger than the GPU kernels' shared memory ({channel_bytes} bytes "
                         f"a channel)")
    tiles = (-(-out_hw[1] // 32), -(-out_hw[0] // (warps_y * p)), n * -(-groups // warps_q))
    split_cin = _split_cin(dtype, math.prod(tiles), cin, chunk, info.sms)
    splits = -(-cin // split_cin)
    grid = (tiles[0], _checks.grid_dim("out_h", tiles[1]),
            _checks.grid_dim("x (batch x channel groups)", tiles[2] * splits))
    ints = _CONV_ARGS.tail(
        n=n, in_h=in_hw[0], in_w=in_hw[1], cin=cin, out_h=out_hw[0], out_w=out_hw[1], cout=cout,
        str_h=sh, str_w=sw, dil_h=dh, dil_w=dw, pad_h=pads[0], pad_w=pads[1],
        idil_h=input_dilation[0], idil_w=input_dilation[1], tile_rows=rows, tile_cols=cols,
        pitch=pitch, chunk=chunk, warps_y=warps_y, warps_q=warps_q, groups=groups,
        split_cin=split_cin)
    ctype = _kernels.ARITHMETIC_CTYPES[dtype]
    kernel = _plan.KernelPlan(device, _OP, "sparse_kernel_conv_direct", (ctype, p, q), grid,
                              (32 * warps_y * warps_q, 1, 1), chunk * channel_bytes, _CONV_ARGS,
                              ints)
    if splits == 1:
        return ConvPlan("direct", kernel, None, None, 0)
    # A split's sums: each pixel's output channels padded to whole groups (16-byte stores).
    rows = n * out_hw[0] * out_hw[1]
    split_sum = _plan.split_sum_plan(device, _OP, ctype, rows, cout, groups * q, splits)
    return ConvPlan("direct", kernel, None, split_sum, splits * rows * groups * q)


def _split_cin(dtype, tiles, cin, chunk, sms):
    """The input channels a split of "direct" sums: all of them (one split) where its tiles
    give the GPU of `sms` SMs a CTA an SM (or there is one chunk of them, or float64); else whole
    chunks, as few as make _SPLIT_CTAS_PER_SM CTAs an SM (core.plan.reduction_splits). One image
    with few output channels has fewer tiles than SMs and a long chain of chunks in each."""
    passes = -(-cin // chunk)
    splits = (1 if dtype == "float64" or tiles >= sms
              else _plan.reduction_splits(tiles, passes, sms, _SPLIT_CTAS_PER_SM))
    return max(cin, 1) if splits == 1 else chunk * -(-passes // splits)


def instantiations():
    """Name expressions of every kernel the plans can ask for, but the compiled kernel: its
    Program is generated per mask (tests/pruned/test_sparse_kernel_conv.py compiles some)."""
    names = []
    for ctype in _kernels.ARITHMETIC_CTYPES.values():
        names.append(_kernels.name_expression("sparse_kernel_conv_direct", ctype, _DIRECT_P,
                                              _DIRECT_Q))
        if ctype != "double":
            names.append(_kernels.name_expression("split_sum", ctype))
        names.append(_kernels.name_expression("sparse_kernel_conv_grad_values", ctype, _GRAD_P))
    return names


_kernels.register_instantiations(_OP, instantiations)


@functools.lru_cache(maxsize=1024)
def grad_values_plan(dtype, n, in_hw, cin, out_hw, cout, kernel_hw, strides, dilations, pads,
                     device=None):
    """The KernelPlan of the gradient with respect to the values (see conv_plan)."""
    acc_size = 8 if dtype == "float64" else 4
    (k_h, k_w), (sh, sw), (dh, dw) = kernel_hw, strides, dilations
    p = _GRAD_P
    rows = (p - 1) * sh + (k_h - 1) * dh + 1
    pitch, cols = rows | 1, 31 * sw + (k_w - 1) * dw + 1
    channel_bytes = cols * pitch * acc_size
    co_chunk = max(1, min(cout, _GRAD_CO_CHUNK))
    while True:  # fewer output channels a pass where one input channel's tile is large
        dy_bytes = co_chunk * p * 32 * acc_size
        chunk = min(cin, max(_SMEM_LIMIT - dy_bytes, 0) // channel_bytes) if cin else 1
        if chunk or co_chunk == 1:
            break
        co_chunk //= 2
    if chunk == 0:
        raise ValueError(f"dilations {dilations} with a {k_h}x{k_w} kernel need an input tile "
                         f"larger than the GPU kernels' shared memory ({channel_bytes} bytes "
                         f"a channel)")
    grid = (-(-out_hw[1] // 32), _checks.grid_dim("out_h", -(-out_hw[0] // p)),
            _checks.grid_dim("x (batch x channel groups)", n * -(-cout // co_chunk)))
    ints = _GRAD_VALUES_ARGS.tail(
        n=n, in_h=in_hw[0], in_w=in_hw[1], cin=cin, out_h=out_hw[0], out_w=out_hw[1], cout=cout,
        str_h=sh, str_w=sw, dil_h=dh, dil_w=dw, pad_h=pads[0], pad_w=pads[1], tile_rows=rows,
        tile_cols=cols, pitch=pitch, chunk=chunk, co_chunk=co_chunk)
    return _plan.KernelPlan(device, _OP, "sparse_kernel_conv_grad_values",
                            (_kernels.ARITHMETIC_CTYPES[dtype], p), grid, (32 * _GRAD_WARPS, 1, 1),
                            dy_bytes + chunk * channel_bytes, _GRAD_VALUES_ARGS, ints)
