"""One data-parallel training step of each family's module, as torchrun runs it
(tests/core/test_ddp.py starts it): every rank takes its share of a batch,
DistributedDataParallel averages the gradients over NCCL, and rank 0 compares them with one
process's gradients on the whole batch.
Writes {module: {"error": max relative error, "warnings": [...]}} as JSON to argv[1]."""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch_bridge as tb
import torch_bridge.submanifold as spconv

BATCH = 4  # samples in the whole batch: BATCH // world size a rank


class _Submanifold(torch.nn.Module):
    """SubMConv3d -> BatchNorm1d -> ReLU -> SparseConv3d (stride 2) -> SubMConv3d, features out."""

    def __init__(self):
        super().__init__()
        self.net = spconv.SparseSequential(
            spconv.SubMConv3d(4, 16, 3, bias=False, indice_key="subm1"),
            torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
            spconv.SparseConv3d(16, 32, 3, stride=2, padding=1, bias=False),
            spconv.SubMConv3d(32, 32, 3, bias=True, indice_key="subm2"))

    def forward(self, features, indices, batch_size):
        x = spconv.SparseConvTensor(features, indices, (12, 20, 24), batch_size)
        return self.net(x).features


def _sites(gen, samples):
    """features [N, 4] and int32 indices [N, 4] of `samples` samples of 300 distinct sites."""
    rows = []
    for b in range(samples):
        flat = torch.randperm(12 * 20 * 24, generator=gen)[:300]
        z, y, x = flat // 480, flat // 24 % 20, flat % 24
        rows.append(torch.stack([torch.full_like(z, b), z, y, x], 1))
    indices = torch.cat(rows).int()
    return torch.randn(indices.shape[0], 4, generator=gen), indices


def _cases(gen):
    """name -> (module, the whole batch's inputs, a function (inputs, rank, ranks) -> a rank's
    inputs, loss of the module's output)."""
    mask = torch.zeros(BATCH, 48, 48)
    mask[:, 5:20, 9:30] = 1
    x_blocks = torch.randn(BATCH, 48, 48, 16, generator=gen)

    def unit_forward(module, x, mask):
        found = getattr(module, "module", module).reduce_mask(mask)  # DDP wraps the unit
        return module(x, found)

    def split_images(inputs, rank, ranks):
        share = BATCH // ranks
        return tuple(t[rank * share:(rank + 1) * share] for t in inputs)

    def split_sites(inputs, rank, ranks):
        features, indices, _ = inputs
        share = BATCH // ranks
        keep = (indices[:, 0] >= rank * share) & (indices[:, 0] < (rank + 1) * share)
        local = indices[keep].clone()
        local[:, 0] -= rank * share
        return features[keep], local, share

    dense = torch.randn(8, 6, 3, 3, generator=gen)
    dense[torch.rand(dense.shape, generator=gen) < 0.6] = 0
    sites = _sites(gen, BATCH)
    return {
        "sbnet_unit": (tb.SparseResBlockBottleneck(16, 8, bsize_out=8, method="gemm"),
                       (x_blocks, mask), split_images, unit_forward),
        "submanifold": (_Submanifold(), (*sites, BATCH), split_sites,
                        lambda m, *a: m(*a)),
        "pruned_kernel": (tb.SparseKernelConv2d(dense, torch.randn(8, generator=gen),
                                                padding=1),
                          (torch.randn(BATCH, 6, 20, 22, generator=gen),), split_images,
                          lambda m, x: m(x)),
        "dilated": (tb.DilatedConv2d(6, 8, 3, dilation=2, padding=2),
                    (torch.randn(BATCH, 6, 30, 30, generator=gen).to(
                        memory_format=torch.channels_last),), split_images,
                    lambda m, x: m(x)),
    }


def _to(inputs, device):
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)


def main(out):
    # float32 products, so that the split and the whole batch differ by summation order only
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.cuda.is_available()  # else gloo on the CPU: a check of this script itself
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    results = {}
    for name, (module, inputs, split, forward) in _cases(torch.Generator().manual_seed(0)).items():
        module = module.to(device).eval()  # BatchNorm on running statistics: no batch coupling
        reference = None
        if rank == 0:  # one process, the whole batch; the ranks' losses are summed by the mean
            module.zero_grad()
            (forward(module, *_to(inputs, device)).square().sum() / ranks).backward()
            reference = {n: p.grad.clone() for n, p in module.named_parameters()}
            module.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
            forward(ddp, *_to(split(inputs, rank, ranks), device)).square().sum().backward()
        if rank == 0:
            error = max(((p.grad - reference[n]).norm() / reference[n].norm()).item()
                        for n, p in module.named_parameters())
            results[name] = {"error": error, "warnings": [str(w.message) for w in caught]}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
