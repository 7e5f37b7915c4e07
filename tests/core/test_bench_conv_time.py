"""bench.conv_time's choice of kernels (CPU: the profiler's kernel times faked): the fused
convolution's instantiations and split sums, or the rulebook kernels, each summed apart from the
rest of the call's kernels."""

import pytest

pytest.importorskip("torch")
conv_time = pytest.importorskip("bench.conv_time")

# One profiled call's kernels as torch's profiler names them, ms.
PROFILE = {"void submanifold_fused<half_t, true, 128, 64, 0, 64>(FusedArgs)": 0.25,
           "void split_sum<float>(SplitSumArgs)": 0.01,
           "void query_subm<3>(RuleArgs)": 0.04, "void emit_sites<3>(RuleArgs)": 0.02,
           "void at::native::batch_norm_kernel<float>(...)": 0.5}


@pytest.fixture
def faked(monkeypatch):
    """conv_time on faked detector calls: no GPU, no model; every call profiles PROFILE."""
    detectors = conv_time.detectors
    monkeypatch.setattr(conv_time, "require_gpu", lambda module: None)
    monkeypatch.setattr(detectors, "inputs", lambda *args: (None, _Features(), None))
    monkeypatch.setattr(detectors, "build", lambda *args: None)
    monkeypatch.setattr(detectors, "prepare", lambda *args: (lambda: None, None))
    monkeypatch.setattr(detectors, "kernel_ms", lambda call: dict(PROFILE))


class _Features:
    shape = (10, 5)


@pytest.mark.parametrize("kernels, want", [
    ("fused", {"submanifold_fused<half_t,true,128,64,0,64>": 250.0, "split_sum<float>": 10.0}),
    ("rulebook", {"query_subm<3>": 40.0, "emit_sites<3>": 20.0})])
def test_kernels_are_summed_by_class(faked, capsys, kernels, want):
    conv_time.main(["eval-fp16", "--kernels", kernels, "--calls", "3"])
    lines = capsys.readouterr().out.splitlines()
    got = {line.split()[3]: float(line.split()[4]) for line in lines if line.startswith("KERNEL")}
    assert got == want
    total = [line.split() for line in lines if line.startswith("TOTAL")]
    assert len(total) == 1
    assert float(total[0][3]) == pytest.approx(sum(want.values()), abs=0.1)
    assert float(total[0][4]) == pytest.approx(1e3 * sum(PROFILE.values()), abs=0.1)
