"""The fused submanifold convolution (kernels/submanifold.cu, submanifold_fused and the split
sum after it) run on the CPU through tests/cuda_emulation, against the definition: so CI, which
has no GPU, checks what the kernel computes; test_submanifold.py runs it on a GPU."""

import numpy
import pytest

import cuda_emulation
from axes import random_array
from sbnet_cupy import submanifold

pytestmark = pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    fused = {name: "FusedArgs" if name.startswith("submanifold_fused") else "SplitSumArgs"
             for name in submanifold.instantiations()
             if name.startswith(("submanifold_fused", "split_sum"))}
    return cuda_emulation.build("submanifold", fused, tmp_path_factory.mktemp("emulated"))


@pytest.fixture
def launched(monkeypatch, kernels):
    """Launches go to the emulated kernels on a GPU of 2 SMs (few sites then split the taps
    over CTAs); the plans made for it are dropped after the test."""
    submanifold._fused_plan.cache_clear()
    yield cuda_emulation.install(monkeypatch, kernels, sms=2)
    submanifold._fused_plan.cache_clear()


def _bits(a, dtype):
    """NumPy storage of a kernel dtype (bfloat16 as the upper 16 bits of float32)."""
    if dtype == "bfloat16":
        return (a.astype(numpy.float32).view(numpy.uint32) >> 16).astype(numpy.uint16)
    return a.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n_in, n_out, cin, cout, taps", [
    (50, 70, 16, 24, 9), (200, 130, 40, 70, 27), (30, 20, 3, 8, 5), (90, 64, 8, 16, 40),
    (10, 1, 64, 64, 1)])
def test_fused_equals_definition(rng, launched, dtype, n_in, n_out, cin, cout, taps):
    """16-byte rows through cp.async and odd ones through registers, part tiles of sites and
    channels, absent neighbours, taps no site has, more taps than a group of 32, bias, and taps
    split over CTAs (their float sums added in order by split_sum) where the sites are few."""
    features = random_array(rng, (n_in, cin), numpy.float32)
    weight = random_array(rng, (cout, taps, cin), numpy.float32)
    bias = random_array(rng, (cout,), numpy.float32)
    neighbors = rng.integers(0, n_in, (taps, n_out)).astype(numpy.int32)
    neighbors[rng.random((taps, n_out)) < 0.4] = -1
    neighbors[taps // 2] = -1  # a tap no site has
    out = numpy.full((n_out, cout), 0xffff if dtype != "float32" else numpy.nan,
                     numpy.uint16 if dtype != "float32" else numpy.float32)
    if dtype == "float16":
        out = out.view(numpy.float16)
    scratch = []

    def float_scratch(n):
        scratch.append(numpy.full(n, numpy.nan, numpy.float32))
        return scratch[-1].ctypes.data, scratch[-1]

    f, w, b = (_bits(a, dtype if dtype != "float32" else numpy.float32)
               for a in (features, weight, bias))
    submanifold.launch_fused(0, 0, f.ctypes.data, w.ctypes.data, b.ctypes.data,
                             neighbors.ctypes.data, out.ctypes.data, n_out, cin, cout, taps,
                             dtype, float_scratch)
    gathered = numpy.where(neighbors[..., None] >= 0, features[neighbors], 0)  # [taps, n_out, cin]
    want = numpy.einsum("kos,cks->oc", gathered.astype(numpy.float64), weight) + bias
    got = (out.astype(numpy.uint32) << 16).view(numpy.float32) if dtype == "bfloat16" else out
    tolerance = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 8e-3}[dtype]
    scale = max(1.0, numpy.abs(want).max())
    numpy.testing.assert_allclose(got.astype(numpy.float64), want, rtol=0,
                                  atol=tolerance * scale)
    assert [name.split("<")[0] for name, *_ in launched] == (
        ["submanifold_fused", "split_sum"] if scratch else ["submanifold_fused"])
