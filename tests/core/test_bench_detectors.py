"""bench.detectors' models: the published architectures' shapes (ours alone), and the same
outputs and gradients as spconv's with copied weights where spconv is installed (CPU)."""

import numpy
import pytest
import torch

ours = pytest.importorskip("torch_bridge.submanifold")
detectors = pytest.importorskip("bench.detectors")

SHAPE = [41, 64, 64]  # z, y, x


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: spconv's CPU build needs it (its strided rulebooks race on several),
    and our NumPy backend's BLAS and torch's OpenMP pool, both spinning, slow these small
    models by 10-100x on two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def scene(channels, batch=1, seed=0):
    """LiDAR-like sites on a small grid: a thinned ground plane, a box and a wall, shuffled;
    (indices int32 [V, 4], features float32 [V, channels]): a few hundred voxels a sample."""
    rng = numpy.random.default_rng(seed)
    rows = []
    for b in range(batch):
        y, x = numpy.meshgrid(numpy.arange(SHAPE[1]), numpy.arange(SHAPE[2]), indexing="ij")
        ground = numpy.stack([numpy.full(y.size, 12), y.ravel(), x.ravel()], 1)
        ground = ground[rng.random(len(ground)) < 0.06]
        z, y, x = numpy.meshgrid(numpy.arange(13, 20), numpy.arange(20, 28),
                                 numpy.arange(30, 34), indexing="ij")
        box = numpy.stack([z.ravel(), y.ravel(), x.ravel()], 1)
        box = box[(box[:, 2] == 30) | (box[:, 1] == 20)]  # the faces the sensor sees
        wall = numpy.stack([numpy.repeat(numpy.arange(13, 17), 40), numpy.full(160, 50),
                            numpy.tile(numpy.arange(10, 50), 4)], 1)
        sites = numpy.unique(numpy.concatenate([ground, box, wall]), axis=0)
        sites = sites[rng.permutation(len(sites))]
        rows.append(numpy.concatenate([numpy.full((len(sites), 1), b), sites], 1))
    indices = torch.from_numpy(numpy.concatenate(rows).astype(numpy.int32))
    features = torch.from_numpy(rng.normal(size=(len(indices), channels)).astype(numpy.float32))
    return indices, features


def convs(net):
    kinds = {"subm": 0, "strided": 0, "inverse": 0}
    for m in net.modules():
        if isinstance(m, ours.SparseConvolution):
            kinds["subm" if m.subm else "inverse" if m.inverse else "strided"] += 1
    return kinds


# (model, channels in, conv layers by kind: the published layer lists)
ARCHITECTURES = [
    # conv_input, conv1, 2 x (strided + 2 SubM), strided + 2 SubM, conv_out
    ("VoxelBackBone8x", 4, {"subm": 8, "strided": 4, "inverse": 0}),
    # conv_input, 4 stages of 2 basic blocks (2 SubM each), 3 strided, conv_out
    ("VoxelResBackBone8x", 5, {"subm": 17, "strided": 4, "inverse": 0}),
    # the encoder above, 4 lateral blocks (2 SubM), 4 merge SubM, 3 inverse, conv5
    ("UNetV2", 4, {"subm": 8 + 8 + 4 + 1, "strided": 4, "inverse": 3}),
    # stem 2, 8 blocks down and 8 up (2 SubM each), 7 1x1 shortcuts, 4 strided, 4 inverse
    ("MinkUNet", 4, {"subm": 2 + 32 + 7, "strided": 4, "inverse": 4}),
]


@pytest.mark.parametrize("model,cin,kinds", ARCHITECTURES, ids=[a[0] for a in ARCHITECTURES])
def test_architecture(model, cin, kinds):
    """Ours alone: the layer counts, the output widths and strides of the published models."""
    indices, features = scene(cin, batch=2)
    net = detectors.build("ours", ours, model, cin, "cpu").eval()
    assert convs(net) == kinds
    with torch.no_grad():
        outs = net(ours.SparseConvTensor(features, indices, SHAPE, 2))
    by_site = detectors.outputs_by_site
    if model in ("VoxelBackBone8x", "VoxelResBackBone8x", "UNetV2"):
        encoded = outs[0]
        # 8x down in y and x; z 41 -> 21 -> 11 -> 5 (unpadded) -> 2 (the (3, 1, 1) conv)
        assert encoded.spatial_shape == [2, SHAPE[1] // 8, SHAPE[2] // 8]
        assert encoded.features.shape[1] == 128
        assert 0 < encoded.features.shape[0] < indices.shape[0]
        assert torch.isfinite(encoded.features).all()
    if model in ("UNetV2", "MinkUNet"):  # per-voxel outputs at the input sites
        seg = outs[-1]
        assert seg.features.shape[1] == (16 if model == "UNetV2" else 19)
        assert seg.spatial_shape == SHAPE
        assert torch.equal(by_site([seg])[0][0],
                           by_site([ours.SparseConvTensor(features, indices, SHAPE, 2)])[0][0])
    if model == "MinkUNet":
        x = ours.SparseConvTensor(features, indices, SHAPE, 2)
        levels = [net.stem(x)]
        for down in net.down:
            levels.append(down(levels[-1]))
        assert [level.features.shape[1] for level in levels] == [32, 32, 64, 128, 256]
        assert levels[-1].spatial_shape == [2, 4, 4]  # 16x down, kernel 2 stride 2


def test_training_step_runs():
    """The benchmark's training step (forward, loss, backward, SGD) runs on a residual model,
    in float32."""
    indices, features = scene(4)
    net = detectors.build("ours", ours, "VoxelResBackBone8x", 4, "cpu")
    step, _ = detectors.prepare(net, "ours", ours, "train-tf32",
                                (indices, features, SHAPE, 1), "cpu")
    step()
    assert step.dtypes == [torch.float32]


@pytest.mark.parametrize("model,cin", [(a[0], a[1]) for a in ARCHITECTURES],
                         ids=[a[0] for a in ARCHITECTURES])
def test_same_as_spconv(model, cin):
    """spconv's model, its state_dict loaded into ours (strict): the same outputs and gradients
    (float64: spconv's CPU build; one thread, as its strided rulebooks race on several)."""
    pytest.importorskip("spconv.pytorch")
    libs = detectors.libraries("cpu")
    indices, features = scene(cin, batch=2)
    spconv_net = detectors.build("spconv", libs["spconv"], model, cin, "cpu")
    state = {k: v.clone() for k, v in spconv_net.state_dict().items()}
    nets = {"ours": detectors.build("ours", ours, model, cin, "cpu", state),
            "spconv": spconv_net}
    _, errors = detectors.check(nets, libs, (indices, features, SHAPE, 2), "cpu")
    assert errors["spconv_check_out"] < 1e-9
    assert errors["spconv_check_grad"] < 1e-9


def test_libraries_are_timed_in_turns(monkeypatch):
    """run_case times the libraries in turns, a round of --repeats calls each, and reports the
    median of each library's round medians; a library failing in a round drops out of the row
    with its error, the other keeps its times (faked timings: no GPU, no model)."""
    calls, rounds = [], {"ours": [3.0, 1.0, 2.0], "spconv": [9.0, 4.0, 5.0], "broken": [7.0]}

    def fake_prepare(net, name, ns, mode, x, device):
        return (lambda: name), None

    def fake_cpu_ms(run, repeats, warmup=0):
        name = run()
        calls.append((name, repeats))
        done = sum(1 for c in calls if c[0] == name) - 1  # its rounds before this one
        if done == len(rounds[name]):
            raise RuntimeError("out of memory")
        return rounds[name][done]

    monkeypatch.setattr(detectors, "inputs", lambda *args, **kwargs: (
        torch.zeros((5, 4)), torch.zeros((5, 4)), SHAPE))
    monkeypatch.setattr(detectors, "build", lambda *args: torch.nn.Identity())
    monkeypatch.setattr(detectors, "check", lambda nets, libs, x, device: (None, {}))
    monkeypatch.setattr(detectors, "prepare", fake_prepare)
    monkeypatch.setattr(detectors, "cpu_ms", fake_cpu_ms)
    args = type("Args", (), dict(device="cpu", rounds=3, repeats=4, warmup=0, profile=False))
    libs = {"ours": ours, "broken": ours, "spconv": ours}
    rows = detectors.run_case("VoxelBackBone8x", "kitti", 1, ["eval-tf32"], libs, args, {}, [])
    assert calls == [("ours", 4), ("broken", 4), ("spconv", 4), ("ours", 4), ("broken", 4),
                     ("spconv", 4), ("ours", 4), ("spconv", 4)]
    assert rows[0]["ours_ms"] == 2.0 and rows[0]["spconv_ms"] == 5.0
    assert rows[0]["speedup"] == 2.5
    assert "broken_ms" not in rows[0] and "out of memory" in rows[0]["broken_error"]
