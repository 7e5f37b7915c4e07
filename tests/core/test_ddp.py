"""A DistributedDataParallel step (2 GPUs, torchrun, NCCL) of an SBNet bottleneck unit, a
submanifold network, a pruned-kernel and a dilated convolution (tests/ddp_step.py): gradients
equal to one process's on the whole batch, and no warning (DDP warns when a gradient's strides
differ from its parameter's, and then copies it every step)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import require

torch = require("torch")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2
    or not torch.distributed.is_nccl_available(), reason="needs two GPUs and NCCL")


def test_ddp_step_equals_one_process(tmp_path):
    out = tmp_path / "ddp.json"
    step = pathlib.Path(__file__).parent.parent / "ddp_step.py"
    # The workers import the library as this process does, installed or from this checkout.
    root = str(step.parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(step), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == {"sbnet_unit", "submanifold", "pruned_kernel", "dilated"}
    for name, result in results.items():
        assert result["error"] < 1e-5, (name, result)
        assert result["warnings"] == [], (name, result)
