"""The style CI keeps: ruff's lint (pyflakes and pycodestyle at one line length, pyproject's
[tool.ruff]) finds nothing in the tree."""

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.version_free


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff is in the test extra")
    root = pathlib.Path(__file__).resolve().parent.parent.parent
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
