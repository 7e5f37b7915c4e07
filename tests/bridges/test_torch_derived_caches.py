"""Every copy the torch bridge derives from a module's tensors (weights converted or laid out
for a kernel, bn1's folded affine in the gather's type, a pruned kernel's index arrays) follows
its sources: after load_state_dict (an in-place copy), a module gives what a fresh module
loaded with the same state dict gives."""

import pytest

from conftest import require

torch = require("torch")

import torch_bridge as tb  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA,
                                                                reason="needs CUDA"))]


def _randomise(module, gen):
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float64) + 0.5)


def _changed(state, names):
    """state with the floating tensors whose name contains one of `names` doubled."""
    return {k: v * 2 if v.is_floating_point() and any(n in k for n in names) else v
            for k, v in state.items()}


def _check_follows(make, call, names, gen):
    """make(): a module ready to run; call(module). After one call, loading a changed state
    dict into the module changes its result to a fresh module's."""
    module = make()
    before = call(module)
    state = _changed(module.state_dict(), names)
    module.load_state_dict(state)
    after = call(module)
    fresh = make()
    fresh.load_state_dict(state)
    expected = call(fresh)
    assert not torch.equal(before, expected)  # the change shows in the result
    torch.testing.assert_close(after, expected, rtol=0, atol=0)


def _blocks_input(gen, device, dtype, channels, n=1, size=40):
    x = torch.randn(n, size, size, channels, generator=gen).to(device, dtype)
    mask = torch.zeros(n, size, size)
    mask[:, 5:12, 20:33] = 1
    return x, mask.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["gemm", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("names", [["bn1"], ["conv1", "conv2", "conv3"]])
def test_res_unit_follows_reloaded_weights(device, method, dtype, names):
    if method == "fused" and device == "cpu":
        pytest.skip("the fused kernels run on CUDA")
    gen = torch.Generator().manual_seed(1)
    x, mask = _blocks_input(gen, device, dtype, 16)

    def make():
        unit = tb.SparseResBlockBottleneck(16, 8, bsize_out=8, method=method)
        _randomise(unit, torch.Generator().manual_seed(2))
        return unit.fold_batchnorm().to(device, dtype)

    def call(unit):
        with torch.no_grad():
            return unit(x, unit.reduce_mask(mask)).float().cpu()

    _check_follows(make, call, names, gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["gemm", "fused"])
def test_block_conv_follows_reloaded_weights(device, method):
    if method == "fused" and device == "cpu":
        pytest.skip("the fused kernels run on CUDA")
    gen = torch.Generator().manual_seed(3)
    x, mask = _blocks_input(gen, device, torch.float16, 8)

    def make():
        conv = tb.SparseConv2d(8, 16, 3, bsize_out=8, method=method)
        _randomise(conv, torch.Generator().manual_seed(4))
        return conv.to(device, torch.float16)

    def call(conv):
        with torch.no_grad():
            return conv(x, conv.reduce_mask(mask)).float().cpu()

    _check_follows(make, call, ["conv"], gen)


@pytest.mark.parametrize("device", DEVICES)
def test_pruned_kernel_follows_reloaded_values_and_positions(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 6, 17, 19, generator=gen, dtype=torch.float64).to(device)
    dense = torch.randn(5, 6, 3, 3, generator=gen, dtype=torch.float64)
    dense[torch.rand(dense.shape, generator=gen) < 0.7] = 0

    def make():
        return tb.SparseKernelConv2d(dense, torch.randn(5, generator=gen, dtype=torch.float64),
                                     padding=1).to(device)

    def call(conv):
        with torch.no_grad():
            return conv(x).cpu()

    _check_follows(make, call, ["values"], gen)
    # The mask itself: other positions (the same count) in place of the old ones.
    module = make()
    call(module)
    state = module.state_dict()
    state["positions"] = torch.randperm(5 * 6 * 9, generator=gen)[:module.positions.numel()]
    module.load_state_dict(state)
    fresh = make()
    fresh.load_state_dict(state)
    torch.testing.assert_close(call(module), call(fresh), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_dilated_follows_reloaded_weights(device):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 8, 30, 30, generator=gen).to(device).to(
        memory_format=torch.channels_last)

    def make():
        conv = tb.DilatedConv2d(8, 8, 3, dilation=2, padding=2)
        _randomise(conv, torch.Generator().manual_seed(7))
        return conv.to(device)

    def call(conv):
        with torch.no_grad():
            return conv(x).cpu()

    _check_follows(make, call, ["weight"], gen)
