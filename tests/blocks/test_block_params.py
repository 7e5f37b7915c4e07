import pytest

from sbnet_cupy import calc_block_params, calc_block_params_res_block


def test_sbnet_worked_example():
    """64x64 input, 18x18 blocks, 3x3 SAME: stride 16, offset -1, 4x4 blocks of 16 out."""
    params = calc_block_params((64, 64), (18, 18), (3, 3), (1, 1), "SAME")
    assert params == ((18, 18), (16, 16), (-1, -1), (4, 4), (16, 16))
    assert params.bstrides == (16, 16) and params.boffset == (-1, -1)


def test_sbnet_argument_forms_port_unchanged():
    ported = calc_block_params([1, 64, 64, 8], [1, 18, 18, 1], [3, 3, 8, 8], [1, 1, 1, 1],
                               "SAME")
    assert ported == calc_block_params((64, 64), (18, 18), (3, 3))


@pytest.mark.parametrize("size, bsize, ksize, strides, padding", [
    (64, 18, 3, 1, "SAME"), (400, 34, 3, 1, "SAME"), (37, 10, 3, 1, "VALID"),
    (50, 19, 3, 2, "SAME"), (10, 18, 3, 1, "SAME"), (88, 14, 5, 1, "SAME"),
    (50, 18, 3, 1, "SAME")])  # SBNet's arithmetic gave 3 blocks here, leaving 2 rows out
def test_blocks_cover_the_dense_output(size, bsize, ksize, strides, padding):
    """The output blocks tile the dense convolution's output exactly, without overlap, and each
    input block is the receptive field of its output block."""
    p = calc_block_params((size, size), (bsize, bsize), (ksize, ksize), (strides, strides),
                          padding)
    out_size = -(-size // strides) if padding == "SAME" else (size - ksize) // strides + 1
    pad_before = -p.boffset[0]
    assert p.bsize_out[0] == (bsize - ksize) // strides + 1
    assert p.bstrides[0] == p.bsize_out[0] * strides
    assert p.bcount[0] * p.bsize_out[0] >= out_size > (p.bcount[0] - 1) * p.bsize_out[0]
    # Output pixel o reads input pixels o*strides - pad_before + [0, ksize): output block b
    # starts at pixel b*bsize_out, so its input block starts at b*bsize_out*strides - pad_before.
    for b in range(p.bcount[0]):
        assert p.boffset[0] + p.bstrides[0] * b == b * p.bsize_out[0] * strides - pad_before
    if padding == "SAME":
        assert pad_before == max((out_size - 1) * strides + ksize - size, 0) // 2


def test_res_block_uses_the_receptive_field():
    res = calc_block_params_res_block((64, 64), (20, 20), [(1, 1), (3, 3), (1, 1)])
    assert res == calc_block_params((64, 64), (20, 20), (3, 3))
    assert calc_block_params_res_block((64, 64), (22, 22), [[3, 3, 4, 4], [3, 3, 4, 4]]) == \
        calc_block_params((64, 64), (22, 22), (5, 5))


@pytest.mark.parametrize("args, error, match", [
    (((64, 64), (18, 18), (3, 3), (2, 2)), ValueError, "must be a non-negative multiple"),
    (((64, 64), (2, 2), (3, 3)), ValueError, "must be a non-negative multiple"),
    (((64, 64), (18, 18), (3, 3), (1, 1), "FULL"), ValueError, "padding must be 'SAME'"),
    (((64, 64), (0, 18), (3, 3)), ValueError, "bsize must be two positive ints"),
])
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        calc_block_params(*args)
