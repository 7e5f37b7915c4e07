"""bench.conv_time's choice of kernels (CPU: the profiler's kernel times faked): the fused
convolution's instantiations, split sums and weight's gradient, the rulebook kernels, or all,
each summed apart from the rest of the call's kernels; several rows in one process."""

import pytest

pytest.importorskip("torch")
conv_time = pytest.importorskip("bench.conv_time")

# One profiled call's kernels as torch's profiler names them, ms.
PROFILE = {"void submanifold_fused<half_t, true, 128, 64, 0, 64>(FusedArgs)": 0.25,
           "void split_sum<float>(SplitSumArgs)": 0.01,
           "void submanifold_grad_weight<half_t, 64, 32>(GradWeightArgs)": 0.125,
           "void query_subm<3>(RuleArgs)": 0.04, "void emit_sites<3>(RuleArgs)": 0.02,
           "void at::native::batch_norm_kernel<float>(...)": 0.5,
           "": 0.002}  # a graph replay has one kernel the profiler leaves unnamed


@pytest.fixture
def faked(monkeypatch):
    """conv_time on faked detector calls: no GPU, no model; every call profiles PROFILE."""
    detectors = conv_time.detectors
    monkeypatch.setattr(conv_time, "require_gpu", lambda module: None)
    monkeypatch.setattr(detectors, "inputs", lambda *args: (None, _Features(), None))
    built = []
    monkeypatch.setattr(detectors, "build", lambda *args: built.append(args[2]))
    monkeypatch.setattr(detectors, "prepare", lambda *args: (lambda: None, None))
    monkeypatch.setattr(detectors, "kernel_ms", lambda call: dict(PROFILE))
    return built


class _Features:
    shape = (10, 5)


@pytest.mark.parametrize("kernels, want", [
    ("fused", {"submanifold_fused<half_t,true,128,64,0,64>": 250.0, "split_sum<float>": 10.0,
               "submanifold_grad_weight<half_t,64,32>": 125.0}),
    ("rulebook", {"query_subm<3>": 40.0, "emit_sites<3>": 20.0}),
    ("all", {"submanifold_fused<half_t,true,128,64,0,64>": 250.0, "split_sum<float>": 10.0,
             "submanifold_grad_weight<half_t,64,32>": 125.0, "query_subm<3>": 40.0,
             "emit_sites<3>": 20.0, "at::native::batch_norm_kernel<float>": 500.0,
             "(unnamed)": 2.0})])
def test_kernels_are_summed_by_class(faked, capsys, kernels, want):
    conv_time.main(["eval-fp16", "--kernels", kernels, "--calls", "3"])
    lines = capsys.readouterr().out.splitlines()
    got = {line.split()[5]: float(line.split()[6]) for line in lines if line.startswith("KERNEL")}
    assert got == want
    total = [line.split() for line in lines if line.startswith("TOTAL")]
    assert len(total) == 1
    assert total[0][1:5] == ["eval-fp16", "VoxelResBackBone8x", "waymo", "2"]
    assert float(total[0][5]) == pytest.approx(sum(want.values()), abs=0.1)
    assert float(total[0][6]) == pytest.approx(1e3 * sum(PROFILE.values()), abs=0.1)


def test_rows_run_in_one_process(faked, capsys):
    """Rows given as MODE:MODEL:SCALE:BATCH, or as a MODE with the options' model, scale and
    batch, each print their own lines, in order."""
    conv_time.main(["eval-fp16:MinkUNet:semkitti:4", "train-amp", "--model", "UNetV2",
                    "--scale", "kitti", "--batch", "1", "--calls", "1"])
    totals = [line.split()[1:5] for line in capsys.readouterr().out.splitlines()
              if line.startswith("TOTAL")]
    assert totals == [["eval-fp16", "MinkUNet", "semkitti", "4"],
                      ["train-amp", "UNetV2", "kitti", "1"]]
    assert faked == ["MinkUNet", "UNetV2"]


@pytest.mark.parametrize("row, message", [
    ("eval-fp17", "mode must be one of"), ("eval-fp16:Nope:waymo:1", "model must be one of"),
    ("eval-fp16:MinkUNet:semkitti", "a row is MODE or MODE:MODEL:SCALE:BATCH"),
    ("eval-fp16:MinkUNet:semkitti:two", "batch must be a positive integer")])
def test_a_bad_row_is_refused_before_any_work(faked, capsys, row, message):
    with pytest.raises(SystemExit):
        conv_time.main([row])
    assert message in capsys.readouterr().err
    assert faked == []
