"""torch_bridge under torch.compile (fullgraph) and torch.export: the modules, and a stage of
units sharing one reduce_mask, compiled for inference and training, equal to eager; no
recompile for a capacity already seen; the eager fast path keeps the argument checks."""

import io

import numpy
import pytest

from conftest import require

torch = require("torch")

import torch_bridge as tb  # noqa: E402
from test_torch_sparse_res_block import _randomise_batchnorm  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# (device, backend, mode): aot_eager traces exactly what inductor gets, cheaply; inductor on the
# CPU compiles C++ (slow), so it runs once, on the stage.
CPU_AOT = ("cpu", "aot_eager", None)
GPU_CASES = [pytest.param(("cuda", "inductor", mode), marks=cuda_only, id=f"cuda-{mode}")
             for mode in ("default", "reduce-overhead")]
DTYPES = {"cpu": [torch.float64],
          "cuda": [torch.float32, torch.float16, torch.bfloat16]}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3,
             torch.bfloat16: 2e-2}
# Gradients, as fractions of their largest element: inductor sums the backward's element-wise
# chain in its own order, and in float32 a few small elements of x's gradient, sums of larger
# terms that cancel, moved by up to 3.7e-5 on the H100.
GRADIENT_TOLERANCE = {**TOLERANCE, torch.float32: 1e-4}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mask(rng, n, height, width, device, pixels=4):
    """`pixels` active pixels an image: at most 4 * pixels blocks, whatever their overlap."""
    mask = numpy.zeros((n, height, width), numpy.float32)
    for image in mask:
        image.flat[rng.choice(height * width, pixels, replace=False)] = 1
    return torch.tensor(mask, device=device)


def _close(got, want, dtype, tolerance=TOLERANCE):
    tol = tolerance[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _compile(fn, backend, mode):
    return torch.compile(fn, fullgraph=True, backend=backend,
                         mode=None if mode in (None, "default") else mode)


def _stage(rng, device, dtype, units=3):
    stage = tb.SparseResStage(16, 8, units, bsize_out=8)
    _randomise_batchnorm(stage, rng)
    return stage.to(device, dtype).eval()


def _run_inference(rng, case, dtype):
    device, backend, mode = case
    stage = _stage(rng, device, dtype).fold_batchnorm()
    x = torch.randn(2, 40, 56, 16, device=device, dtype=dtype)
    mask = _mask(rng, 2, 40, 56, device)
    with torch.no_grad():
        compiled = _compile(lambda x, mask: stage(x, mask, capacity=32), backend, mode)
        for _ in range(3):  # reduce-overhead records its graph on the second or third call
            got = compiled(x, mask).clone()
        _close(got, stage(x, mask, capacity=32), dtype)
        _close(got, stage(x, mask), dtype)  # capacity or not: the same result


def _run_training(rng, case, dtype):
    """Gradients of x and of every weight through a compiled unit equal eager's."""
    device, backend, mode = case
    unit = tb.SparseResBlockBottleneck(16, 8, bsize_out=8)
    _randomise_batchnorm(unit, rng)
    unit = unit.to(device, dtype).eval()
    x0 = torch.randn(1, 30, 34, 16, device=device, dtype=dtype)
    mask = _mask(rng, 1, 30, 34, device)

    def loss(x):
        return unit(x, unit.reduce_mask(mask, capacity=16)).square().sum()

    grads = []
    for fn in (loss, _compile(loss, backend, mode)):
        unit.zero_grad()
        x = x0.clone().requires_grad_(True)
        fn(x).backward()
        grads.append([x.grad] + [p.grad for p in unit.parameters()])
    for got, want in zip(*grads):
        _close(got / want.abs().max(), want / want.abs().max(), dtype, GRADIENT_TOLERANCE)


@pytest.mark.parametrize("case", [CPU_AOT, ("cpu", "inductor", None), *GPU_CASES])
def test_stage_inference(rng, case):
    for dtype in DTYPES[case[0]]:
        _run_inference(rng, case, dtype)


@pytest.mark.parametrize("case", [CPU_AOT, *GPU_CASES])
def test_unit_training(rng, case):
    for dtype in DTYPES[case[0]]:
        _run_training(rng, case, dtype)


@pytest.mark.parametrize("case", [CPU_AOT, *GPU_CASES])
def test_sparse_conv(rng, case):
    device, backend, mode = case
    conv = tb.SparseConv2d(6, 5, bsize_out=8).to(device).double()
    x0 = torch.randn(2, 21, 27, 6, device=device, dtype=torch.float64)
    mask = _mask(rng, 2, 21, 27, device)

    def run(x):
        return conv(x, conv.reduce_mask(mask, capacity=32))

    outputs, grads = [], []
    for fn in (run, _compile(run, backend, mode)):
        x = x0.clone().requires_grad_(True)
        y = fn(x)
        y.square().sum().backward()
        outputs.append(y.detach().clone())
        grads.append(x.grad)
    _close(outputs[1], outputs[0], torch.float64)
    _close(grads[1], grads[0], torch.float64)


def test_no_recompile_for_a_capacity_seen(rng):
    """Capacities are static shapes: a new one may compile (the second makes it dynamic), one
    already seen never does."""
    stage = _stage(rng, "cpu", torch.float64, units=2).fold_batchnorm()
    x = torch.randn(1, 40, 40, 16, dtype=torch.float64)
    mask = _mask(rng, 1, 40, 40, "cpu")
    # A submodule that torch does not import by itself (the test failed where no earlier test
    # of its worker had imported it).
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, mask, capacity: stage(x, mask, capacity=capacity),
                             fullgraph=True, backend=counter)
    with torch.no_grad():
        for capacity in (16, 24):
            _close(compiled(x, mask, capacity), stage(x, mask, capacity=capacity), torch.float64)
        compiled_so_far = counter.frame_count
        assert compiled_so_far <= 2
        for capacity in (16, 24, 16, 40, 24):
            _close(compiled(x, mask, capacity), stage(x, mask, capacity=capacity), torch.float64)
            assert counter.frame_count <= compiled_so_far + (capacity == 40)


class _ExportedStage(torch.nn.Module):
    def __init__(self, stage, capacity):
        super().__init__()
        self.stage, self.capacity = stage, capacity

    def forward(self, x, mask):
        return self.stage(x, mask, capacity=self.capacity)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_export_round_trip(rng, device):
    # An inference model (no parameter requires grad): on CUDA it runs the fused unit, traced
    # or not, so the program and the model run the same kernels.
    stage = _stage(rng, device, torch.float32).fold_batchnorm().requires_grad_(False)
    model = _ExportedStage(stage, 24)
    x = torch.randn(1, 40, 48, 16, device=device)
    mask = _mask(rng, 1, 40, 48, device)
    program = torch.export.export(model, (x, mask))
    # Our ops, not a decomposition: gather/scatter on the CPU, the fused unit on CUDA.
    op = "sbnet.block_conv_res_unit" if device == "cuda" else "sbnet.sparse_gather"
    assert op in str(program.graph), program.graph
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    with torch.no_grad():
        want = model(x, mask)
        other = torch.randn_like(x)
        _close(loaded.module()(x, mask), want, torch.float32)
        _close(loaded.module()(other, mask), model(other, mask), torch.float32)


@cuda_only
def test_compiled_fused_unit_launches_only_the_ops(rng):
    """The default compile of a fused unit (float32 weights, float16 input: casts and the 3x3
    weight's permute to make) generates no kernel of its own: the op makes the weights' copies,
    once, outside the graph."""
    from torch._inductor.utils import run_and_get_code

    stage = _stage(rng, "cuda", torch.float32, units=1).fold_batchnorm()
    x = torch.randn(1, 40, 48, 16, device="cuda", dtype=torch.float16)
    mask = _mask(rng, 1, 40, 48, "cuda")
    with torch.no_grad():
        compiled = _compile(lambda x, mask: stage(x, mask, capacity=24), "inductor", "default")
        got, codes = run_and_get_code(compiled, x, mask)
        _close(got, stage(x, mask, capacity=24), torch.float16)
    code = "\n".join(codes)
    assert "sbnet.block_conv_res_unit" in code and "@triton.jit" not in code, code


def test_fast_path_keeps_the_checks():
    """Calls that skip the dispatcher still check every argument."""
    x = torch.ones(1, 8, 8, 4)
    counts, indices = torch.ones(1, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32)
    with torch.no_grad():
        with pytest.raises(ValueError, match="bsize must be two positive ints"):
            tb.sparse_gather(x, counts, indices, bsize=(0, 4))
        with pytest.raises(ValueError, match="active_block_indices must be"):
            tb.sparse_gather(x, counts, indices[0], bsize=4)
        with pytest.raises(TypeError, match="active_block_indices must be integers"):
            tb.sparse_gather(x, counts, indices.float(), bsize=4)
        with pytest.raises(ValueError, match="bin_counts must be one integer"):
            tb.sparse_gather(x, torch.ones(2, dtype=torch.int32), indices, bsize=4)
        with pytest.raises(ValueError, match="blocks has 2 rows but active_block_indices has 1"):
            tb.sparse_scatter(torch.ones(2, 4, 4, 4), counts, indices, x, bsize=4)
        with pytest.raises(ValueError, match="capacity must be None or an int"):
            tb.reduce_mask(x[..., 0], (2, 2), bsize=4, capacity=-1)
        with pytest.raises(TypeError, match="mask dtype must be one of"):
            tb.reduce_mask(x[..., 0].to(torch.complex64), (2, 2), bsize=4)
        with pytest.raises(ValueError, match="scale must have shape"):
            tb.sparse_gather(x, counts, indices, bsize=4, scale=torch.ones(3),
                             shift=torch.ones(3))
    with pytest.raises(ValueError, match="sparse_scatter_var is for inference"):
        tb.sparse_scatter_var(torch.ones(1, 4, 4, 4), counts, indices,
                              x.clone().requires_grad_(True), bsize=4)


@cuda_only
def test_fast_path_devices():
    x = torch.ones(1, 8, 8, 4, device="cuda")
    counts = torch.ones(1, dtype=torch.int32)
    indices = torch.zeros(1, 3, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="bin_counts is on cpu"):
        tb.sparse_gather(x, counts, indices, bsize=4)


@cuda_only
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_non_default_device(rng):
    x = torch.randn(1, 16, 16, 8, device="cuda:1")
    mask = _mask(rng, 1, 16, 16, "cuda:1")
    found = tb.reduce_mask(mask, (2, 2), bsize=8, capacity=4)
    stack = tb.sparse_gather(x, found.bin_counts, found.active_block_indices, bsize=8)
    want = tb.sparse_gather(x.cpu(), found.bin_counts.cpu(), found.active_block_indices.cpu(),
                            bsize=8)
    assert stack.device == x.device and torch.equal(stack.cpu(), want)
    numpy.testing.assert_array_equal(found.active_block_indices.cpu().numpy(),
                                     tb.reduce_mask(mask.cpu(), (2, 2), bsize=8, capacity=4)
                                     .active_block_indices.numpy())
