"""torch_bridge.SparseKernelConv2d: equal to the pruned nn.Conv2d it is made from, forward and
backward; gradcheck in float64 for the input, the values and the bias; training keeps the
mask; torch.compile; the GPU kernels against float64 on the CPU."""

import numpy
import pytest

from conftest import require

torch = require("torch")

import torch_bridge as tb  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# (Cin, Cout, kernel, stride, padding, dilation) of nn.Conv2d
CONVS = [
    (3, 8, 11, 1, "same", 1),
    (3, 5, (3, 4), (2, 1), (1, 2), (1, 2)),
    (6, 4, 3, 2, 0, 1),
    (5, 7, (5, 3), 1, "valid", (2, 1)),
    (33, 3, 3, 1, 1, 1),
]


def _pruned_conv(rng, cin, cout, kernel, stride, padding, dilation, density=0.3,
                 dtype=torch.float64, bias=True):
    conv = torch.nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, dilation=dilation,
                           bias=bias).to(dtype)
    with torch.no_grad():
        keep = torch.tensor(rng.random(tuple(conv.weight.shape)) < density)
        conv.weight.mul_(keep)
    return conv


def _x(rng, n, cin, height, width, dtype=torch.float64, device="cpu"):
    values = rng.integers(1, 64, (n, cin, height, width)) * rng.choice([-1, 1], (n, cin, height,
                                                                                width)) / 8
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.mark.parametrize("config", CONVS, ids=str)
def test_equals_conv2d_forward_and_backward(rng, config):
    conv = _pruned_conv(rng, *config)
    module = tb.SparseKernelConv2d.from_conv(conv)
    assert module.values.numel() == int((conv.weight != 0).sum())
    torch.testing.assert_close(module.dense_weight(), conv.weight, rtol=0, atol=0)
    x = _x(rng, 2, config[0], 13, 16).requires_grad_()
    y, want = module(x), conv(x)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn(want.shape, dtype=want.dtype)
    dx, dv, db = torch.autograd.grad(y, [x, module.values, module.bias], dy)
    want_dx, want_dw, want_db = torch.autograd.grad(want, [x, conv.weight, conv.bias], dy)
    torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dv, want_dw[conv.weight != 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(db, want_db, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config", CONVS[1:3], ids=str)
def test_gradcheck(rng, config):
    conv = _pruned_conv(rng, *config)
    module = tb.SparseKernelConv2d.from_conv(conv)
    x = _x(rng, 1, config[0], 7, 8).requires_grad_()
    values = module.values.detach().clone().requires_grad_()
    bias = module.bias.detach().clone().requires_grad_()

    def conv_nhwc(x, values, bias):
        return tb.sparse_kernel_conv2d(x, values, module.positions, module.kernel_shape,
                                       strides=module.stride, padding=module.padding,
                                       dilations=module.dilation, bias=bias)

    assert torch.autograd.gradcheck(conv_nhwc, (x.permute(0, 2, 3, 1), values, bias))


def test_training_keeps_the_mask(rng):
    conv = _pruned_conv(rng, 3, 4, 3, 1, 1, 1, dtype=torch.float32)
    module = tb.SparseKernelConv2d.from_conv(conv)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    x = _x(rng, 2, 3, 8, 9, torch.float32)
    before = module.dense_weight().detach().clone()
    module(x).square().sum().backward()
    optimizer.step()
    after = module.dense_weight().detach()
    assert not torch.equal(before, after)
    assert torch.equal(after == 0, conv.weight == 0)


def test_channels_last_input_and_output(rng):
    conv = _pruned_conv(rng, 4, 6, 3, 1, 1, 1)
    module = tb.SparseKernelConv2d.from_conv(conv)
    x = _x(rng, 2, 4, 9, 10).contiguous(memory_format=torch.channels_last)
    y = module(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, conv(x), rtol=1e-12, atol=1e-12)


def test_torch_compile(rng):
    conv = _pruned_conv(rng, 3, 5, 3, 1, "same", 1)
    module = tb.SparseKernelConv2d.from_conv(conv)
    x = _x(rng, 2, 3, 8, 9).requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    torch.testing.assert_close(y, conv(x), rtol=1e-12, atol=1e-12)
    (dx,) = torch.autograd.grad(y.sum(), [x])
    (want,) = torch.autograd.grad(conv(x).sum(), [x])
    torch.testing.assert_close(dx, want, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_bad_input(rng):
    conv = _pruned_conv(rng, 3, 4, 3, 1, 1, 1)
    module = tb.SparseKernelConv2d.from_conv(conv)
    with pytest.raises(ValueError, match="x has 5 channels but kernel expects 3"):
        module(torch.ones(1, 5, 6, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="values must be a 1-D tensor of x's dtype"):
        module(torch.ones(1, 3, 6, 6, dtype=torch.float32))
    with pytest.raises(ValueError, match="kernel is larger than the padded input"):
        tb.SparseKernelConv2d.from_conv(_pruned_conv(rng, 3, 4, 5, 1, 0, 1))(
            torch.ones(1, 3, 3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="conv.groups must be 1"):
        tb.SparseKernelConv2d.from_conv(torch.nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(ValueError, match="conv.padding_mode must be 'zeros'"):
        tb.SparseKernelConv2d.from_conv(torch.nn.Conv2d(4, 4, 3, padding_mode="reflect"))
    with pytest.raises(ValueError, match="stride must be two positive ints"):
        tb.SparseKernelConv2d(conv.weight, stride=0)
    with pytest.raises(ValueError, match="positions must be an int64 tensor"):
        tb.sparse_kernel_conv2d(torch.ones(1, 6, 6, 3, dtype=torch.float64), module.values,
                                module.positions[:-1], module.kernel_shape)
    with pytest.raises(TypeError, match="bfloat16 needs CUDA tensors"):
        tb.sparse_kernel_conv2d(torch.ones(1, 6, 6, 3, dtype=torch.bfloat16),
                                module.values.bfloat16(), module.positions, module.kernel_shape)


@cuda_only
@pytest.mark.parametrize("strategy", [None, "compiled", "direct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", CONVS, ids=str)
def test_cuda_equals_float64(rng, config, dtype, strategy):
    unit_rows = config[3] in (1, (1, 1)) or (isinstance(config[3], tuple) and config[3][0] == 1)
    if strategy == "compiled" and not unit_rows:
        pytest.skip("the compiled kernel needs unit vertical strides")
    conv = _pruned_conv(rng, *config)
    module = tb.SparseKernelConv2d.from_conv(conv)
    module.strategy = strategy
    gpu = module.to(device="cuda", dtype=dtype)
    x = _x(rng, 2, config[0], 21, 37)
    xg = x.to("cuda", dtype).requires_grad_()
    y = gpu(xg)
    want = conv(x)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    scale = torch.nn.functional.conv2d(x.abs(), conv.weight.abs(), conv.bias.abs(), conv.stride,
                                       conv.padding, conv.dilation).max().detach()
    torch.testing.assert_close(y.double().cpu(), want, rtol=0, atol=float(tol * scale))
    dy = torch.randn(want.shape, dtype=torch.float64)
    dx, dv = torch.autograd.grad(y, [xg, gpu.values], dy.to("cuda", dtype))
    x.requires_grad_()
    want_dx, want_dw = torch.autograd.grad(conv(x), [x, conv.weight], dy)
    torch.testing.assert_close(dx.double().cpu(), want_dx, rtol=10 * tol, atol=10 * tol * 64)
    torch.testing.assert_close(dv.double().cpu(), want_dw[conv.weight != 0], rtol=10 * tol,
                               atol=10 * tol * float(want_dw.abs().max()))


@cuda_only
def test_cuda_graph_capture(rng):
    conv = _pruned_conv(rng, 3, 16, 11, 1, "same", 1, dtype=torch.float32)
    module = tb.SparseKernelConv2d.from_conv(conv).cuda()
    x = _x(rng, 1, 3, 64, 96, torch.float32, "cuda")
    with torch.no_grad():
        want = module(x)  # builds the index arrays outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            module(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = module(x)
        graph.replay()
        torch.cuda.synchronize()
    numpy.testing.assert_array_equal(y.cpu().numpy(), want.cpu().numpy())
