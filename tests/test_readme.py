"""The README's Python example runs and says what the code does."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_example_runs_and_prints_what_it_says():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no python example"
    for code in blocks:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, str(README), "exec"), {})
        claimed = re.findall(r"^# (\[.*)$", code, re.M)
        assert printed.getvalue().splitlines() == claimed


def test_installed_wheel_ships_the_kernels():
    """When the package is installed (as CI does), its kernels folder holds the .cu sources."""
    import importlib.metadata

    try:
        files = importlib.metadata.files("sbnet-cupy")
    except importlib.metadata.PackageNotFoundError:
        import pytest
        pytest.skip("sbnet-cupy is not installed")
    names = {str(f) for f in files or ()}
    if not any(n.startswith("sbnet_cupy/") for n in names):
        import pytest
        pytest.skip("installed in editable mode: the sources are the checkout's")
    for source in ("common.cuh", "reduce_mask.cu", "sparse_gather.cu", "sparse_scatter.cu"):
        assert f"sbnet_cupy/kernels/{source}" in names
