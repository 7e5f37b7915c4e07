"""Block geometry for a convolution run on gathered blocks, with SBNet's arithmetic."""

import math
from collections import namedtuple

from ..core import checks as _checks

BlockParams = namedtuple("BlockParams", ["bsize", "bsize_out", "boffset", "bcount", "bstrides"])


def _spatial(name, value, length4_slice):
    """(H, W) from a pair, or from SBNet's 4-element form ([N, H, W, C] sizes, [1, BH, BW, 1]
    blocks, [1, SH, SW, 1] strides, [KH, KW, Cin, Cout] kernels)."""
    if not isinstance(value, int) and hasattr(value, "__len__") and len(value) == 4:
        value = tuple(value)[length4_slice]
    return _checks.int_pair(name, value, minimum=1)


def calc_block_params(in_size, bsize, ksize, strides=(1, 1), padding="SAME"):
    """Block parameters for one convolution on gathered blocks.

    Args:
        in_size: (H, W) of the convolution input, or SBNet's [N, H, W, C].
        bsize: (BH, BW) input block size, or SBNet's [1, BH, BW, 1].
        ksize: (KH, KW) kernel size, or SBNet's [KH, KW, Cin, Cout].
        strides: (SH, SW) convolution strides, or SBNet's [1, SH, SW, 1].
        padding: 'SAME' or 'VALID', the padding of the dense convolution this replaces.

    Returns:
        BlockParams(bsize, bsize_out, boffset, bcount, bstrides): the geometry to gather input
        blocks with (bsize, boffset, bstrides, bcount for reduce_mask), and the output block
        size after a VALID convolution of each block (to scatter with, stride bsize_out).

    The blocks always cover the whole output: bcount = ceil(output size / bsize_out). (SBNet's
    padding arithmetic could leave the last rows out: a 50-pixel side with 18-pixel blocks and
    a 3x3 kernel got 3 blocks, 48 output pixels.)

    Example: a 64x64 input, 18x18 blocks and a 3x3 SAME convolution give blocks every 16
    pixels starting at -1, 4x4 of them, each 16x16 after the convolution::

        >>> p = calc_block_params((64, 64), (18, 18), (3, 3))
        >>> p.bsize, p.bsize_out, p.boffset, p.bcount, p.bstrides
        ((18, 18), (16, 16), (-1, -1), (4, 4), (16, 16))
    """
    in_hw = _spatial("in_size", in_size, slice(1, 3))
    bsize = _spatial("bsize", bsize, slice(1, 3))
    ksize = _spatial("ksize", ksize, slice(0, 2))
    strides = _spatial("strides", strides, slice(1, 3))
    if padding not in ("SAME", "VALID"):
        raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")
    boffset, bcount, bstrides, bsize_out = [], [], [], []
    for axis in range(2):
        size, block, kernel, stride = in_hw[axis], bsize[axis], ksize[axis], strides[axis]
        if block < kernel or (block - kernel) % stride:
            raise ValueError(f"bsize[{axis}] - ksize[{axis}] must be a non-negative multiple of "
                             f"strides[{axis}], got bsize {bsize}, ksize {ksize}, "
                             f"strides {strides}")
        bstride = block - kernel + stride  # output blocks tile the output without overlap
        if padding == "SAME":
            out = math.ceil(size / stride)
            before = max((out - 1) * stride + kernel - size, 0) // 2
        else:
            out = max(0, (size - kernel) // stride + 1)
            before = 0
        out_block = (block - kernel) // stride + 1
        boffset.append(-before)
        bcount.append(math.ceil(out / out_block))  # enough blocks to cover the whole output
        bstrides.append(bstride)
        bsize_out.append(out_block)
    return BlockParams(bsize=bsize, bsize_out=tuple(bsize_out), boffset=tuple(boffset),
                       bcount=tuple(bcount), bstrides=tuple(bstrides))


def calc_block_params_res_block(in_size, bsize, ksize_list, strides=(1, 1), padding="SAME"):
    """calc_block_params for a chain of convolutions (a residual unit): the kernel is the
    chain's receptive field, 1 + sum(k - 1) per axis. ksize_list: (KH, KW) pairs, or SBNet's
    [KH, KW, Cin, Cout] lists; strides applies to the first convolution."""
    sizes = [_spatial(f"ksize_list[{i}]", k, slice(0, 2)) for i, k in enumerate(ksize_list)]
    if not sizes:
        raise ValueError("ksize_list must hold at least one kernel size")
    field = tuple(1 + sum(k[axis] - 1 for k in sizes) for axis in range(2))
    return calc_block_params(in_size, bsize, field, strides, padding)
