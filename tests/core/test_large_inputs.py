"""Inputs past 2**31 elements on the GPU: a submanifold and a strided convolution of 20M sites x
128 float16 channels (2.6e9 feature elements), a rulebook of more than 2**31 entries (80M
sites, 27 taps), a pruned-kernel and a dilated convolution of more than 2**31 elements. Each
gives correct results at sampled outputs (against a reference computed from the definition
for those outputs alone) or a clear error before launch. They need a GPU of at least 70 GiB
and run one at a time across pytest-xdist workers (a file lock)."""

import fcntl
import os
import tempfile

import pytest

from conftest import require

torch = require("torch")

import torch_bridge as tb  # noqa: E402
import torch_bridge.submanifold as spconv  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.get_device_properties(0).total_memory < 70 * 2**30,
    reason="needs a GPU of at least 70 GiB")

SAMPLES = 2000


@pytest.fixture(autouse=True)
def _alone():
    """One large test at a time on the machine, the GPU's memory returned after it."""
    path = os.path.join(tempfile.gettempdir(), "sbnet_large_inputs.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sites(n, shape, batch, gen):
    """n distinct int32 sites [n, 4] (b, z, y, x) of a batch x shape grid, unsorted, on the GPU."""
    cells = batch * shape[0] * shape[1] * shape[2]
    flat = torch.randperm(cells, device="cuda", generator=gen)[:n]
    z, y, x = shape[0] * shape[1] * shape[2], shape[1] * shape[2], shape[2]
    return torch.stack([flat // z, flat % z // y, flat % y // x, flat % x], 1).int()


def _keys(indices, shape):
    b, z, y, x = indices.long().unbind(1)
    return ((b * shape[0] + z) * shape[1] + y) * shape[2] + x


def _sampled_reference(features, in_indices, out_indices, weight, shape, stride, padding, rows):
    """conv output rows `rows` from the definition: out[o] = sum over taps k of
    W_k x[the input site at o * stride - padding + k], found by a sorted search of the input
    sites' keys (independent of the rulebook)."""
    keys = _keys(in_indices, shape)
    order = torch.argsort(keys)
    sorted_keys = keys[order]
    out = out_indices[rows].long()
    k_z, k_y, k_x = weight.shape[1:4]
    total = torch.zeros(rows.numel(), weight.shape[0], dtype=torch.float64, device="cuda")
    limits = torch.tensor(shape, device="cuda")
    for kz in range(k_z):
        for ky in range(k_y):
            for kx in range(k_x):
                tap = torch.tensor([kz, ky, kx], device="cuda")
                where = out[:, 1:] * torch.tensor(stride, device="cuda") - torch.tensor(
                    padding, device="cuda") + tap
                inside = ((where >= 0) & (where < limits)).all(1)
                key = _keys(torch.cat([out[:, :1], where.clamp(min=0)], 1), shape)
                slot = torch.searchsorted(sorted_keys, key).clamp(max=keys.numel() - 1)
                found = inside & (sorted_keys[slot] == key)
                x = features[order[slot]].double() * found[:, None]
                total += x @ weight[:, kz, ky, kx, :].double().T
    return total


def _check_rows(out, reference, rtol):
    error = (out.double() - reference).norm() / reference.norm()
    assert error < rtol, error.item()


def test_submanifold_and_strided_past_2_31_feature_elements():
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape, channels = [40, 1200, 1200], 128
    indices = _sites(20_000_000, shape, 1, gen)
    features = torch.randn(indices.shape[0], channels, device="cuda", generator=gen,
                           dtype=torch.float16)
    assert features.numel() > 2**31
    weight = torch.randn(channels, 3, 3, 3, channels, device="cuda", generator=gen,
                         dtype=torch.float16) / 60
    rows = torch.randint(0, indices.shape[0], (SAMPLES,), device="cuda", generator=gen)
    with torch.no_grad():
        rulebook = spconv.build_rulebook(indices, shape, 1, 3, subm=True)
        out = spconv.rulebook_conv(features, rulebook, weight, algo="fused")
        _check_rows(out[rows], _sampled_reference(features, indices, indices, weight, shape,
                                                  (1, 1, 1), (1, 1, 1), rows), 2e-3)
        del out, rulebook
        strided = spconv.build_rulebook(indices, shape, 1, 3, stride=2, padding=1)
        out = spconv.rulebook_conv(features, strided, weight, algo="fused")
        rows = rows % out.shape[0]
        _check_rows(out[rows], _sampled_reference(features, indices, strided.out_indices,
                                                  weight, shape, (2, 2, 2), (1, 1, 1), rows),
                    2e-3)


def test_rulebook_past_2_31_entries():
    gen = torch.Generator(device="cuda").manual_seed(1)
    shape = [60, 1600, 1600]
    indices = _sites(80_000_000, shape, 1, gen)
    features = torch.randn(indices.shape[0], 8, device="cuda", generator=gen,
                           dtype=torch.float16)
    weight = torch.randn(16, 3, 3, 3, 8, device="cuda", generator=gen, dtype=torch.float16)
    with torch.no_grad():
        rulebook = spconv.build_rulebook(indices, shape, 1, 3, subm=True)
        assert rulebook.neighbors.numel() > 2**31
        out = spconv.rulebook_conv(features, rulebook, weight)
    rows = torch.cat([torch.arange(SAMPLES // 2, device="cuda"),
                      torch.randint(0, indices.shape[0], (SAMPLES // 2,), device="cuda",
                                    generator=gen),
                      torch.arange(indices.shape[0] - 8, indices.shape[0], device="cuda")])
    _check_rows(out[rows], _sampled_reference(features, indices, indices, weight, shape,
                                              (1, 1, 1), (1, 1, 1), rows), 2e-3)


def _conv2d_at(x, weight, bias, ys, xs, padding, dilation):
    """NCHW conv2d (stride 1) output pixels (all images, all channels) at (ys[i], xs[i])."""
    n, cin = x.shape[:2]
    k_h, k_w = weight.shape[2:]
    total = torch.zeros(n, weight.shape[0], ys.numel(), dtype=torch.float64, device="cuda")
    for kh in range(k_h):
        for kw in range(k_w):
            yy, xx = ys - padding + kh * dilation, xs - padding + kw * dilation
            inside = (yy >= 0) & (yy < x.shape[2]) & (xx >= 0) & (xx < x.shape[3])
            v = x[:, :, yy.clamp(0, x.shape[2] - 1), xx.clamp(0, x.shape[3] - 1)].double()
            total += torch.einsum("ncs,oc->nos", v * inside, weight[:, :, kh, kw].double())
    return total + bias.double()[None, :, None]


def _large_image_check(module, x, weight, bias, padding, dilation):
    gen = torch.Generator(device="cuda").manual_seed(2)
    ys = torch.randint(0, x.shape[2], (SAMPLES,), device="cuda", generator=gen)
    xs = torch.randint(0, x.shape[3], (SAMPLES,), device="cuda", generator=gen)
    ys[:4], xs[:4] = torch.tensor([0, x.shape[2] - 1] * 2), torch.tensor([0, x.shape[3] - 1] * 2)
    with torch.no_grad():
        try:
            out = module(x)
        except ValueError as error:  # a clear refusal, before any launch
            assert "large" in str(error) or "2**31" in str(error), error
            print(f"{type(module).__name__} refused: {error}")  # seen with -s
            return
        got = out[:, :, ys, xs].double()
    want = _conv2d_at(x, weight, bias, ys, xs, padding, dilation)
    error = (got - want).norm() / want.norm()
    assert error < 2e-3, error.item()


def test_pruned_kernel_past_2_31_elements():
    gen = torch.Generator(device="cuda").manual_seed(3)
    dense = torch.randn(16, 16, 3, 3, device="cuda", generator=gen)
    dense[torch.rand(dense.shape, device="cuda", generator=gen) < 0.7] = 0
    bias = torch.randn(16, device="cuda", generator=gen)
    conv = tb.SparseKernelConv2d(dense, bias, padding=1).half()
    x = torch.randn(1, 16, 12000, 12000, device="cuda", generator=gen,
                    dtype=torch.float16).to(memory_format=torch.channels_last)
    assert x.numel() > 2**31
    _large_image_check(conv, x, dense.half(), bias.half(), 1, 1)


def test_dilated_past_2_31_elements():
    gen = torch.Generator(device="cuda").manual_seed(4)
    conv = tb.DilatedConv2d(16, 16, 3, dilation=2, padding=2).to("cuda", torch.float16)
    x = torch.randn(1, 16, 12000, 12000, device="cuda", generator=gen,
                    dtype=torch.float16).to(memory_format=torch.channels_last)
    _large_image_check(conv, x, conv.weight, conv.bias, 2, 2)
