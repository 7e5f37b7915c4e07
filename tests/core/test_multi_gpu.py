"""Every family on a GPU that is not the current one, and arguments on two GPUs: the result is
computed on the tensors' device (equal to the CPU's), a module moved to another GPU follows it
(its cached copies of weights and index arrays included), and arguments split over two devices
raise an error that names both. Needs two GPUs."""

import numpy
import pytest

from conftest import HAS_GPU, require

torch = require("torch")

import sbnet_cupy  # noqa: E402
import torch_bridge as tb  # noqa: E402
import torch_bridge.submanifold as spconv  # noqa: E402

pytestmark = pytest.mark.skipif(
    not HAS_GPU or not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two GPUs")

DEVICE_ERROR = r"(cuda:0.*cuda:1|cuda:1.*cuda:0|device 0.*device 1|device 1.*device 0)"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _random(module, seed):
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=_gen(seed), dtype=torch.float64) + 0.5)
    return module


def _blocks(seed, channels, n=1, size=40):
    x = torch.randn(n, size, size, channels, generator=_gen(seed))
    mask = torch.zeros(n, size, size)
    mask[:, 5:12, 20:33] = 1
    return x, mask


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = spconv.SparseSequential(
            spconv.SubMConv3d(4, 16, 3, indice_key="a"), torch.nn.ReLU(),
            spconv.SparseConv3d(16, 8, 3, stride=2, padding=1))

    def forward(self, features, indices):
        return self.net(spconv.SparseConvTensor(features, indices, (9, 10, 11), 2)).features


def _sites(seed):
    gen = _gen(seed)
    flat = torch.randperm(2 * 9 * 10 * 11, generator=gen)[:300]
    indices = torch.stack([flat // 990, flat // 110 % 9, flat // 11 % 10, flat % 11], 1).int()
    return torch.randn(300, 4, generator=gen), indices


def _families():
    """name -> (a module on the CPU in float32, its inputs, a call(module, *inputs) -> output)."""
    x, mask = _blocks(0, 16)

    def blocks_call(module, x, mask):
        with torch.no_grad():
            return module(x, module.reduce_mask(mask))

    dense = torch.randn(8, 6, 3, 3, generator=_gen(1))
    dense[torch.rand(dense.shape, generator=_gen(2)) < 0.6] = 0
    plain = lambda module, *inputs: module(*inputs).detach()  # noqa: E731
    return {
        "res_unit_fused": (_random(tb.SparseResBlockBottleneck(16, 8, bsize_out=8),
                                   3).fold_batchnorm(), (x, mask), blocks_call),
        "res_unit_gemm": (_random(tb.SparseResBlockBottleneck(16, 8, bsize_out=8,
                                                              method="gemm"), 3).eval(),
                          (x, mask), blocks_call),
        "block_conv": (_random(tb.SparseConv2d(16, 8, 3, bsize_out=8), 4), (x, mask),
                       blocks_call),
        "submanifold": (_random(_Net(), 5), _sites(6), plain),
        "pruned_kernel": (tb.SparseKernelConv2d(dense, torch.randn(8, generator=_gen(7)),
                                                padding=1),
                          (torch.randn(2, 6, 15, 17, generator=_gen(8)),), plain),
        "dilated": (_random(tb.DilatedConv2d(6, 8, 3, dilation=2, padding=2), 9),
                    (torch.randn(2, 6, 30, 30, generator=_gen(10)).to(
                        memory_format=torch.channels_last),), plain),
    }


def _on(inputs, device):
    return tuple(t.to(device) for t in inputs)


@pytest.fixture(autouse=True)
def _float32_products():
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.parametrize("name", list(_families()))
def test_module_runs_on_its_tensors_device_and_follows_a_move(name):
    module, inputs, call = _families()[name]
    expected = call(module, *inputs)
    torch.cuda.set_device(0)
    on_first = call(module.to("cuda:0"), *_on(inputs, "cuda:0"))
    on_second = call(module.to("cuda:1"), *_on(inputs, "cuda:1"))  # device 0 is current
    assert on_first.device == torch.device("cuda:0") and on_second.device == torch.device("cuda:1")
    torch.testing.assert_close(on_first.cpu(), expected, rtol=1e-2, atol=1e-2)  # TF32 kernels
    torch.testing.assert_close(on_second.cpu(), on_first.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(_families()))
def test_module_and_input_on_different_devices(name):
    """Either an error that says so, or the result on the input's device."""
    module, inputs, call = _families()[name]
    expected = call(module, *inputs)
    module = module.to("cuda:0")
    try:
        out = call(module, *_on(inputs, "cuda:1"))
    except (ValueError, RuntimeError) as error:
        assert "device" in str(error).lower(), error
        return
    assert out.device == torch.device("cuda:1")
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-2, atol=1e-2)


def test_ops_name_both_devices():
    x = torch.randn(1, 16, 16, 4, device="cuda:0")
    found = tb.reduce_mask(torch.ones(1, 16, 16, device="cuda:1"), (2, 2), bsize=8)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        tb.sparse_gather(x, found.bin_counts, found.active_block_indices, bsize=8)
    values = torch.randn(10, device="cuda:1")
    positions = torch.randperm(3 * 3 * 4 * 5, device="cuda:0")[:10]
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        tb.sparse_kernel_conv2d(x, values, positions, [3, 3, 4, 5])
    features, indices = _sites(11)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        spconv.SparseConvTensor(features.to("cuda:0"), indices.to("cuda:1"), (9, 10, 11), 2)


def test_cupy_ops_name_both_devices():
    import cupy

    with cupy.cuda.Device(1):
        counts = cupy.ones(1, cupy.int32)
        indices = cupy.zeros((1, 3), cupy.int32)
    x = cupy.ones((1, 16, 16, 4), cupy.float32)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        sbnet_cupy.sparse_gather(x, counts, indices, bsize=8)
    coords = numpy.array([[0, 1, 1], [0, 2, 3]], numpy.int32)
    with cupy.cuda.Device(1):
        rulebook = sbnet_cupy.submanifold_rulebook(cupy.asarray(coords), (5, 5), 1, 3)
    features = cupy.ones((2, 4), cupy.float32)
    weight = cupy.ones((8, 3, 3, 4), cupy.float32)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        sbnet_cupy.rulebook_conv(features, rulebook, weight)
