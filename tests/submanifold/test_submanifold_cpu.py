"""The CPU convolution of torch_bridge.submanifold (rulebook._conv_cpu): products a tap at a
time, summed by embedding_bag in groups of taps, against the sum in spconv's order (the centre
first, then the taps, one index_add a tap) bit for bit, with one group and with many."""

import numpy
import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

import torch_bridge.submanifold as ours  # noqa: E402
from torch_bridge.submanifold import cpu_conv as module  # noqa: E402


def sites(rng, n=400, shape=(10, 12, 11), batch=2):
    """n distinct random sites in each batch."""
    rows = []
    for b in range(batch):
        flat = rng.choice(numpy.prod(shape), n, replace=False)
        rows.append(numpy.concatenate([numpy.full((n, 1), b),
                                       numpy.stack(numpy.unravel_index(flat, shape), 1)], 1))
    return torch.from_numpy(numpy.concatenate(rows).astype(numpy.int32)), list(shape), batch


def spconv_order(x, weight, bias, neighbors):
    """y = bias + sum over taps, one tap at a time (the centre, a tap reading each site's own
    row, first), through index_add: spconv's CPU order."""
    taps = weight.reshape(weight.shape[0], -1, weight.shape[-1])
    rows = [(k, (n >= 0).nonzero()[:, 0], n[n >= 0].long()) for k, n in enumerate(neighbors)]
    own = [k for k, o, i in rows if o.numel() == x.shape[0] and torch.equal(o, i)]
    y = x.new_zeros((neighbors.shape[1], weight.shape[0]))
    for k, out_rows, in_rows in sorted(rows, key=lambda r: r[0] not in own[:1]):
        y.index_add_(0, out_rows, x[in_rows] @ taps[:, k].t())
    return y if bias is None else y + bias


@pytest.mark.parametrize("kind", ["subm", "strided", "inverse"])
@pytest.mark.parametrize("group_bytes", [module._GROUP_BYTES, 1], ids=["one-group", "a-tap-each"])
def test_products_summed_in_spconvs_order(rng, monkeypatch, kind, group_bytes):
    """Forward against the sum in spconv's order, bit for bit (float32, with a bias); the lead
    rows of later groups carry the sum so far. A tap a group is the most groups there are."""
    monkeypatch.setattr(module, "_GROUP_BYTES", group_bytes)
    indices, shape, batch = sites(rng)
    rulebook = ours.build_rulebook(indices, shape, batch, 3, 2, 1, 1, kind == "subm")
    if kind == "inverse":
        rulebook = rulebook.inverse()
    n_in = rulebook.in_indices.shape[0]
    x = torch.from_numpy(rng.standard_normal((n_in, 5), dtype=numpy.float32))
    weight = torch.from_numpy(rng.standard_normal((6, 3, 3, 3, 5), dtype=numpy.float32))
    bias = torch.from_numpy(rng.standard_normal(6, dtype=numpy.float32))
    assert module._cpu_plan(rulebook.neighbors)[0] == "taps"
    y = ours.rulebook_conv(x, rulebook, weight, bias)
    groups = module._sum_groups(rulebook.neighbors, module._group_pairs(6, 4))
    blocks = module._cpu_plan(rulebook.neighbors)[1].taps
    assert len(groups) == (1 if group_bytes > 1 else len(blocks)) and len(blocks) >= 20
    assert torch.equal(y, spconv_order(x, weight, bias, rulebook.neighbors))


def test_groups_and_gradients(rng, monkeypatch):
    """Many groups give one group's bits, forward and backward (float64 gradients against the
    dense gather's)."""
    indices, shape, batch = sites(rng)
    x = torch.from_numpy(rng.standard_normal((indices.shape[0], 4)))
    weight = torch.from_numpy(rng.standard_normal((3, 3, 3, 3, 4)))
    results = []
    for group_bytes, dense in ((module._GROUP_BYTES, False), (1, False), (1, True)):
        monkeypatch.setattr(module, "_GROUP_BYTES", group_bytes)
        monkeypatch.setattr(module, "_DENSE_MAX_ENTRIES", 10**9 if dense else 4096)
        built = ours.build_rulebook(indices, shape, batch, 3, 1, 1, 1, True)
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = ours.rulebook_conv(xs, built, ws)
        y.square().sum().backward()
        results.append((y.detach(), xs.grad, ws.grad))
        if not dense:  # the centre leads the first group, the sum so far the others
            groups = module._sum_groups(built.neighbors, module._group_pairs(3, 8))
            assert all(g.lead for g in groups) and len(groups) == (1 if group_bytes > 1 else 26)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    for a, b in zip(results[1], results[2]):
        torch.testing.assert_close(a, b)


def test_outputs_without_pairs(rng):
    """An inverse convolution whose outputs (the strided layer's inputs) read no pairs: zeros,
    in every row that has none (kernel 1, stride 2: odd sites feed no output)."""
    indices, shape, batch = sites(rng, n=600)
    rulebook = ours.build_rulebook(indices, shape, batch, 1, 2, 0, 1, False).inverse()
    x = torch.from_numpy(rng.standard_normal((rulebook.in_indices.shape[0], 3),
                                             dtype=numpy.float32))
    weight = torch.from_numpy(rng.standard_normal((2, 1, 1, 1, 3), dtype=numpy.float32))
    y = ours.rulebook_conv(x, rulebook, weight)
    even = (indices[:, 1:] % 2 == 0).all(1)
    assert y.shape == (indices.shape[0], 2) and (y[~even] == 0).all() and (y[even] != 0).all()
    assert torch.equal(y, spconv_order(x, weight, None, rulebook.neighbors))
    odd = indices[~even]
    empty = ours.build_rulebook(odd, shape, batch, 1, 2, 0, 1, False)
    assert empty.out_indices.shape[0] == 0
    back = ours.rulebook_conv(torch.zeros((0, 3)), empty.inverse(), weight)
    assert back.shape == (odd.shape[0], 2) and not back.any()


def test_plans_follow_their_map(rng):
    """A map's plan and groups are kept while it stays the same tensor and version: a new
    rulebook (maybe at a freed map's address) and a map changed in place get their own, and
    the sums in spconv's order."""
    weight = torch.from_numpy(rng.standard_normal((4, 3, 3, 3, 5), dtype=numpy.float32))
    for _ in range(2):  # the second rulebook's maps may land where the first one's were
        indices, shape, batch = sites(rng)
        rulebook = ours.build_rulebook(indices, shape, batch, 3, 1, 1, 1, True)
        x = torch.from_numpy(rng.standard_normal((indices.shape[0], 5), dtype=numpy.float32))
        y = ours.rulebook_conv(x, rulebook, weight)
        assert torch.equal(y, spconv_order(x, weight, None, rulebook.neighbors))
    neighbors = rulebook.neighbors
    plan = module._cpu_plan(neighbors)
    groups = module._sum_groups(neighbors, module._group_pairs(4, 4))
    assert module._cpu_plan(neighbors) is plan
    assert module._sum_groups(neighbors, module._group_pairs(4, 4)) is groups
    other = ours.build_rulebook(sites(rng)[0], shape, batch, 3, 1, 1, 1, True).neighbors
    neighbors.copy_(other)  # the same shape: other sites, in place
    assert module._cpu_plan(neighbors) is not plan
    y = module.conv_cpu(x, weight, None, neighbors)
    assert torch.equal(y, spconv_order(x, weight, None, neighbors))
