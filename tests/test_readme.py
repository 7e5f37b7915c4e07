"""The README's Python examples run and print what they say."""

import contextlib
import importlib.metadata
import io
import pathlib
import re

import pytest

from conftest import require

README = pathlib.Path(__file__).parent.parent / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
# The framework each example needs, if any.
NEEDS = {"torch_bridge": "torch", "tf_bridge": "tensorflow"}


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs_and_prints_what_it_says(code):
    for bridge, framework in NEEDS.items():
        if f"import {bridge}" in code:
            require(framework)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), {})
    claimed = re.findall(r"^# ([\[(].*)$", code, re.M)
    assert claimed and printed.getvalue().splitlines() == claimed


def test_installed_wheel_ships_the_kernels():
    """When the package is installed from a wheel (as CI does), its kernels folder holds the .cu
    sources. The wheel's RECORD says what was installed (a build's egg-info folder in the
    checkout, which may come first on the path, lists the sources instead)."""
    records = [d.read_text("RECORD") for d in importlib.metadata.distributions()
               if d.metadata["Name"] == "sbnet-cupy" and d.read_text("RECORD")]
    if not records:
        pytest.skip("sbnet-cupy is not installed from a wheel")
    names = {line.split(",")[0] for line in records[0].splitlines()}
    if not any(n.startswith("sbnet_cupy/") for n in names):
        pytest.skip("installed in editable mode: the sources are the checkout's")
    for source in ("common.cuh", "reduce_mask.cu", "space_to_batch.cu", "sparse_gather.cu",
                   "sparse_scatter.cu"):
        assert f"sbnet_cupy/kernels/{source}" in names
