"""torch_bridge.dilated: the reshapes as torch ops (values, layouts, gradients, compile) and
dilated_conv2d against F.conv2d(dilation=), on the CPU and, where there is one, the GPU."""

import contextlib
import csv
import pathlib
import zlib

import numpy
import pytest

from conftest import require

torch = require("torch")
F = torch.nn.functional

import sbnet_cupy  # noqa: E402
import torch_bridge as tb  # noqa: E402
from torch_bridge.dilated import conv as dilated  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]
# name: (N, C, H, W), block, paddings
RESHAPES = {
    "exact": ((2, 3, 8, 6), 2, ((0, 0), (0, 0))),
    "padded-non-square": ((3, 5, 7, 5), (2, 3), ((1, 0), (2, 2))),
    "rate-5": ((1, 2, 9, 11), 5, ((3, 3), (2, 2))),
}
MOVE_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8,
               torch.int64, torch.complex64]


def _random(shape, dtype, device, generator):
    values = torch.randint(1, 64, shape, generator=generator) * (
        2 * torch.randint(0, 2, shape, generator=generator) - 1)
    return (values / 8 if dtype.is_floating_point or dtype.is_complex else values).to(
        dtype).to(device)


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
@pytest.mark.parametrize("name", RESHAPES)
@pytest.mark.parametrize("device", DEVICES)
def test_reshapes_equal_sbnet_cupy(gen, device, name, dtype, channels_last):
    dims, block, paddings = RESHAPES[name]
    x = _random(dims, dtype, device, gen)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    y = tb.space_to_batch(x, block, paddings)
    bits = x.cpu().view(torch.int16) if dtype == torch.bfloat16 else x.cpu()
    want = sbnet_cupy.space_to_batch(bits.numpy(), block, paddings, data_format="NCHW")
    got = y.cpu().view(torch.int16) if dtype == torch.bfloat16 else y.cpu()
    numpy.testing.assert_array_equal(got.numpy(), want)
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last
                           else torch.contiguous_format)
    back = tb.batch_to_space(y, block, paddings)
    assert back.dtype == dtype and torch.equal(back, x)
    assert back.is_contiguous(memory_format=torch.channels_last if channels_last
                              else torch.contiguous_format)


@pytest.mark.parametrize("name", RESHAPES)
def test_reshape_gradients(gen, name):
    dims, block, paddings = RESHAPES[name]
    x = _random(dims, torch.float64, "cpu", gen).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: tb.space_to_batch(x, block, paddings), (x,))
    y = tb.space_to_batch(x.detach(), block, paddings).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda y: tb.batch_to_space(y, block, paddings), (y,))
    assert torch.autograd.gradgradcheck(lambda x: tb.space_to_batch(x, block, paddings), (x,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", RESHAPES)
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_reshapes_move_channels_last(gen, device, name, dtype):
    """mixed=True: NCHW x, channels_last y, the same values; gradients through both."""
    dims, block, paddings = RESHAPES[name]
    x = _random(dims, dtype, device, gen)
    y = tb.space_to_batch(x, block, paddings, mixed=True)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, tb.space_to_batch(x, block, paddings))
    back = tb.batch_to_space(y, block, paddings, mixed=True)
    assert back.is_contiguous() and torch.equal(back, x)
    # An NCHW y is made channels_last first.
    assert torch.equal(tb.batch_to_space(y.contiguous(), block, paddings, mixed=True), x)
    if dtype == torch.float64 and device == "cpu":
        x.requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda x: tb.space_to_batch(x, block, paddings, mixed=True), (x,))
        y = y.detach().requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda y: tb.batch_to_space(y, block, paddings, mixed=True), (y,))


# (N, C, H, W), K, (KH, KW)
CONVS = [((2, 3, 11, 13), 4, (3, 3)), ((1, 5, 9, 8), 3, (2, 4))]


@pytest.mark.parametrize("padding", [0, 1, (2, 3), "same", "valid"])
@pytest.mark.parametrize("dilation", [1, 2, 3, 4, 5, (2, 3)])
@pytest.mark.parametrize("conv", CONVS)
def test_dilated_conv2d_equals_conv2d(gen, conv, dilation, padding):
    dims, k, kernel = conv
    x = _random(dims, torch.float64, "cpu", gen)
    w = _random((k, dims[1], *kernel), torch.float64, "cpu", gen)
    b = _random((k,), torch.float64, "cpu", gen)
    try:
        want = F.conv2d(x, w, b, padding=padding, dilation=dilation)
    except RuntimeError:  # the dilated kernel is larger than the padded image
        with pytest.raises(ValueError, match="is smaller than the dilated kernel"):
            tb.dilated_conv2d(x, w, b, dilation=dilation, padding=padding)
        return
    for method in ("reshape", "native", "auto"):
        got = tb.dilated_conv2d(x, w, b, dilation=dilation, padding=padding, method=method)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dilation, padding", [(2, 2), (3, (1, 4)), ((2, 3), "same")])
def test_dilated_conv2d_gradients(gen, dilation, padding):
    """gradcheck in float64: x, weight and bias through the reshape route."""
    x = _random((2, 3, 7, 8), torch.float64, "cpu", gen).requires_grad_(True)
    w = _random((2, 3, 3, 2), torch.float64, "cpu", gen).requires_grad_(True)
    b = _random((2,), torch.float64, "cpu", gen).requires_grad_(True)

    def route(x, w, b):
        return tb.dilated_conv2d(x, w, b, dilation=dilation, padding=padding, method="reshape")

    assert torch.autograd.gradcheck(route, (x, w, b))
    assert torch.autograd.gradcheck(lambda x: route(x, w.detach(), None), (x,))
    assert torch.autograd.gradcheck(lambda w: route(x.detach(), w, b.detach()), (w,))
    # create_graph: second-order terms through y = space_to_batch(x) included (small operands:
    # gradgradcheck's cost grows with their product).
    small = [t.detach().clone().requires_grad_(True) for t in (x[:1, :2, :5, :6], w[:2, :2], b[:2])]
    assert torch.autograd.gradgradcheck(route, small)


@pytest.mark.parametrize("dilation, padding", [(2, 2), ((3, 2), "same")])
def test_dilated_conv2d_mixed_route(gen, monkeypatch, dilation, padding):
    """The route with its convolution in channels_last (what CUDA tensors of 8k channels take),
    forced on the CPU: values and gradcheck in float64, and under torch.compile."""
    monkeypatch.setattr(dilated, "conv_channels_last", lambda x, weight: True)
    x = _random((2, 8, 9, 10), torch.float64, "cpu", gen).requires_grad_(True)
    w = _random((8, 8, 3, 3), torch.float64, "cpu", gen).requires_grad_(True)
    b = _random((8,), torch.float64, "cpu", gen).requires_grad_(True)

    def route(x, w, b):
        return tb.dilated_conv2d(x, w, b, dilation=dilation, padding=padding, method="reshape")

    out = route(x, w, b)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.conv2d(x, w, b, padding=padding, dilation=dilation),
                               rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(route, (x, w, b))
    small = [t.detach().clone().requires_grad_(True) for t in (x[:1, :2, :6, :7], w[:2, :2], b[:2])]
    assert torch.autograd.gradgradcheck(route, small)
    torch._dynamo.reset()
    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w, b), out, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_conv_channels_last_rule():
    x, w = torch.ones(2, 16, 8, 8), torch.ones(24, 16, 3, 3)
    assert not dilated.conv_channels_last(x, w)  # the CPU

    class Cuda(torch.Tensor):
        is_cuda = True

    cuda = x.as_subclass(Cuda)
    assert dilated.conv_channels_last(cuda, w)
    assert not dilated.conv_channels_last(cuda[:, :12], w)  # 12 channels
    assert not dilated.conv_channels_last(cuda, w[:20])
    assert not dilated.conv_channels_last(cuda.double(), w)
    assert not dilated.conv_channels_last(cuda.to(memory_format=torch.channels_last), w)


def test_dilated_conv2d_channels_last(gen):
    x = _random((2, 4, 10, 9), torch.float64, "cpu", gen).to(memory_format=torch.channels_last)
    w = _random((3, 4, 3, 3), torch.float64, "cpu", gen)
    got = tb.dilated_conv2d(x, w, dilation=3, padding=3, method="reshape")
    torch.testing.assert_close(got, F.conv2d(x, w, padding=3, dilation=3), rtol=1e-12,
                               atol=1e-12)


def test_module_swaps_for_conv2d(gen):
    conv = torch.nn.Conv2d(3, 5, 3, padding=2, dilation=2, dtype=torch.float64)
    module = tb.DilatedConv2d(3, 5, 3, dilation=2, padding=2, method="reshape",
                              dtype=torch.float64)
    module.load_state_dict(conv.state_dict())
    x = _random((2, 3, 9, 10), torch.float64, "cpu", gen)
    torch.testing.assert_close(module(x), conv(x), rtol=1e-12, atol=1e-12)
    assert "method='reshape'" in repr(module)
    with pytest.raises(ValueError, match="method must be one of"):
        tb.DilatedConv2d(3, 5, 3, dilation=2, method="fast")


def test_compile_fullgraph(gen):
    """torch.compile (aot_eager: what inductor gets) traces the ops: forward and gradients
    equal eager's."""
    torch._dynamo.reset()
    x0 = _random((2, 3, 9, 7), torch.float64, "cpu", gen)
    w0 = _random((4, 3, 3, 3), torch.float64, "cpu", gen)

    def loss(x, w):
        return tb.dilated_conv2d(x, w, dilation=2, padding=1, method="reshape").square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        value = fn(x, w)
        value.backward()
        results.append((value, x.grad, w.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w: tb.space_to_batch([x], 2), TypeError, "x must be a torch.Tensor"),
    (lambda x, w: tb.space_to_batch(x, 3), ValueError, "not a multiple of block"),
    (lambda x, w: tb.batch_to_space(x, 2), ValueError, "y's batch 2 is not a multiple"),
    (lambda x, w: tb.space_to_batch(x[0], 2), ValueError, r"x must be 4-D \[N, C, H, W\]"),
    (lambda x, w: tb.dilated_conv2d(x, w, dilation=0), ValueError,
     "dilation must be two positive ints"),
    (lambda x, w: tb.dilated_conv2d(x, w, dilation=2, method="im2col"), ValueError,
     "method must be one of"),
    (lambda x, w: tb.dilated_conv2d(x, w, dilation=2, padding="full"), ValueError,
     "padding must be an int, a pair of ints, 'valid' or 'same'"),
    (lambda x, w: tb.dilated_conv2d(x, w, dilation=2, padding=-1), ValueError,
     "padding must be two >= 0 ints"),
    (lambda x, w: tb.dilated_conv2d(x, w[:, :2], dilation=2), ValueError,
     r"weight must be \[K, C, KH, KW\] with C = 3"),
    (lambda x, w: tb.dilated_conv2d(x, w, torch.ones(3), dilation=2), ValueError,
     r"bias must have shape \(4,\)"),
    (lambda x, w: tb.dilated_conv2d(x, w, dilation=4), ValueError,
     "is smaller than the dilated kernel"),
])
def test_bad_arguments(call, error, match):
    x, w = torch.ones(2, 3, 8, 6), torch.ones(4, 3, 3, 3)
    with torch.no_grad():
        with pytest.raises(error, match=match):
            call(x, w)
    with pytest.raises(error, match=match):  # the autograd path checks the same way
        call(x.requires_grad_(True), w)


def test_auto_on_cpu_is_native():
    assert dilated.choose_method(torch.ones(1, 512, 8, 8), torch.ones(512, 512, 3, 3),
                                 (4, 4)) == "native"


BENCH_CSV = pathlib.Path(__file__).parents[2] / "bench/results/dilated_NVIDIA_H100_80GB_HBM3.csv"
PRECISION_DTYPES = {"tf32": "float32", "fp16": "float16"}
PASS_GRADS = {"forward": None, "backward_input": "input", "backward_weight": "weight"}


def test_auto_rule_matches_the_benchmark():
    """method="auto" on every row of the committed H100 run, in each timing with its table
    (eager calls, CUDA graphs): within 5% of the faster of reshape and native."""
    with open(BENCH_CSV) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 78
    for row in rows:
        n, c, k, size, rate = (int(row[key]) for key in ("N", "C", "K", "size", "rate"))
        for mode in ("eager", "graph"):
            method = "ours" if dilated.reshape_wins(
                PRECISION_DTYPES[row["precision"]], c, k, rate, n * size * size,
                PASS_GRADS[row["pass_"]], graphed=mode == "graph") else "native"
            times = {route: float(row[f"{route}_{mode}_ms"]) for route in ("ours", "native")}
            assert times[method] <= 1.05 * min(times.values()), (row, mode, method)
            assert row[f"auto_{mode}"] == ("reshape" if method == "ours" else "native"), (
                "the committed run was scored with another rule: python -m bench.dilated "
                "--rescore", row)


def test_choose_method_reads_the_call(monkeypatch):
    """The gradients recorded, the shapes and a CUDA graph capture reach the rule (as on a CUDA
    tensor)."""
    seen = []
    monkeypatch.setattr(dilated, "reshape_wins", lambda *args: seen.append(args) or True)

    class Cuda(torch.Tensor):
        is_cuda = True

    x = torch.ones(8, 512, 6, 5).as_subclass(Cuda)
    w = torch.ones(256, 512, 3, 3, requires_grad=True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert dilated.choose_method(x, w, (8, 12)) == "reshape"
    with torch.no_grad():
        dilated.choose_method(x, w, (8, 12))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        dilated.choose_method(x, w, (8, 12))
        dilated.choose_method(x, w, (8, 12), graphed=False)
    assert seen == [("float32", 512, 256, 8, 8 * 6 * 5, "weight", False),
                    ("float32", 512, 256, 8, 8 * 6 * 5, None, False),
                    ("float32", 512, 256, 8, 8 * 6 * 5, None, True),
                    ("float32", 512, 256, 8, 8 * 6 * 5, None, False)]


# --- GPU --------------------------------------------------------------------------------------

@cuda_only
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dilation", [2, 3, 4])
def test_cuda_routes_agree(gen, dtype, dilation, channels_last):
    """The reshape route on the GPU against the native dilation, forward and both gradients,
    within what the native route's own error against float64 is."""
    x64 = _random((4, 16, 29, 31), torch.float64, "cpu", gen)
    w64 = _random((8, 16, 3, 3), torch.float64, "cpu", gen) / 8
    g64 = _random((4, 8, 29, 31), torch.float64, "cpu", gen)
    exact = _forward_and_grads(x64, w64, g64, dilation, "native")
    results = {}
    for method in ("reshape", "native"):
        x, w, g = (t.to("cuda", dtype) for t in (x64, w64, g64))
        if channels_last:
            x, g = x.to(memory_format=torch.channels_last), g.to(memory_format=torch.channels_last)
        results[method] = [t.double().cpu() for t in _forward_and_grads(x, w, g, dilation, method)]
    for got, native, want in zip(results["reshape"], results["native"], exact):
        scale = want.abs().max()
        assert (got - want).abs().max() <= 4 * max((native - want).abs().max(),
                                                   1e-6 * scale), (got - want).abs().max()


def _forward_and_grads(x, w, g, dilation, method):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = tb.dilated_conv2d(x, w, dilation=dilation, padding=dilation, method=method)
    out.backward(g)
    return out.detach(), x.grad, w.grad


@cuda_only
def test_cuda_graph_capture(gen):
    x = _random((2, 8, 32, 32), torch.float32, "cuda", gen)
    w = _random((8, 8, 3, 3), torch.float32, "cuda", gen) / 8
    with torch.no_grad():
        want = tb.dilated_conv2d(x, w, dilation=2, padding=2, method="reshape")
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            tb.dilated_conv2d(x, w, dilation=2, padding=2, method="reshape")  # warm up
            with torch.cuda.graph(graph, stream=stream):
                out = tb.dilated_conv2d(x, w, dilation=2, padding=2, method="reshape")
        x.copy_(x.flip(0))
        graph.replay()
        torch.testing.assert_close(out, tb.dilated_conv2d(x, w, dilation=2, padding=2,
                                                          method="reshape"))
        assert not torch.equal(out, want)


@cuda_only
@pytest.mark.parametrize("frozen", [False, True])
def test_cuda_weight_copy_follows_the_weight(gen, frozen):
    """Where no gradient of the weight is recorded, the channels_last route convolves by a
    channels_last copy of the weight made once per parameter version: remade after an in-place
    change, never used where the weight's gradient is recorded or y is NCHW; a CUDA graph makes
    it inside the graph (replays follow the weight) unless captured under frozen_weights."""
    x = _random((2, 16, 20, 18), torch.float16, "cuda", gen)
    w = torch.nn.Parameter(_random((8, 16, 3, 3), torch.float16, "cuda", gen) / 8)

    def check(out):
        torch.testing.assert_close(out, F.conv2d(x, w, padding=2, dilation=2), rtol=2e-3,
                                   atol=2e-3)

    y = tb.space_to_batch(x, 2, 2, mixed=True)
    with torch.no_grad():
        copy = dilated._conv_weight(w, y)
        assert copy is not w and copy.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(copy, w) and dilated._conv_weight(w, y) is copy
        check(tb.dilated_conv2d(x, w, dilation=2, padding=2, method="reshape"))
        w.mul_(-2)
        assert torch.equal(dilated._conv_weight(w, y), w)
        check(tb.dilated_conv2d(x, w, dilation=2, padding=2, method="reshape"))
        assert dilated._conv_weight(w, y.contiguous()) is w
        with pytest.raises(RuntimeError):  # torch's own message, as before
            tb.dilated_conv2d(x, w.cpu(), dilation=2, padding=2, method="reshape")
    assert dilated._conv_weight(w, y) is w  # its gradient is recorded
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        context = tb.frozen_weights() if frozen else contextlib.nullcontext([])
        with torch.cuda.stream(stream):
            tb.dilated_conv2d(x, w, dilation=2, padding=2, method="reshape")  # warm up
            with context as kept, torch.cuda.graph(graph, stream=stream):
                out = tb.dilated_conv2d(x, w, dilation=2, padding=2, method="reshape")
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        check(out)
        before = out.clone()
        w.mul_(-1)
        graph.replay()
        if frozen:
            assert kept and torch.equal(out, before)
        else:
            assert not kept
            check(out)
