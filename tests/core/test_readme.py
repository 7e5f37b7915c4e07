"""The Python examples of README.md and docs/*.md run as pasted into a plain Python REPL, and
print what they say."""

import code
import contextlib
import importlib.metadata
import io
import pathlib
import re

import pytest

from conftest import require

ROOT = pathlib.Path(__file__).parent.parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [pytest.param(page, example, id=f"{page.stem}-{i}")
            for page in PAGES
            for i, example in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]
# The framework an example needs, by what it imports.
NEEDS = {"torch": "torch", "torch_bridge": "torch", "tensorflow": "tensorflow",
         "tf_bridge": "tensorflow"}


class Repl(code.InteractiveConsole):
    """The interactive interpreter, fed line by line as a paste into `python` is: a complete
    statement runs at once, a blank line ends a block. Errors raise instead of printing."""

    def runcode(self, compiled):
        exec(compiled, self.locals)

    def showsyntaxerror(self, filename=None, **kwargs):
        pasted = "\n".join(self.buffer)
        raise SyntaxError(f"not valid as pasted into the REPL, at:\n{pasted}")


def run_in_repl(example, filename):
    repl = Repl({"__name__": "__console__"}, filename=str(filename))
    for line in example.splitlines():
        repl.push(line)
    repl.push("")  # the end of the paste ends an open block


@pytest.mark.parametrize("page, example", EXAMPLES)
def test_example_runs_in_the_repl_and_prints_what_it_says(page, example):
    imported = set(re.findall(r"^(?:import|from) (\w+)", example, re.M))
    for framework in sorted({NEEDS[m] for m in imported if m in NEEDS}):
        require(framework)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_in_repl(example, page)
    claimed = re.findall(r"^# ([\[(].*)$", example, re.M)
    assert claimed and printed.getvalue().splitlines() == claimed


def test_pages_link_to_files_that_exist():
    """Relative links of README.md and docs/*.md (anchors aside) name files of the checkout."""
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)|^\[\w+\]: ([^#\s]+)",
                                 page.read_text(), re.M):
            target = next(t for t in target if t)
            if not re.match(r"\w+://", target) and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing



def test_ci_runs_the_readme_test_command():
    """.ci/run installs and tests as the README tells a newcomer to."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    install, test = re.search(r"^ +(pip install \S+) && (python -m pytest.*)$", readme,
                              re.M).groups()
    assert install.replace("pip install", "pip install -q --no-cache-dir") in ci
    assert re.search(rf"^ +{re.escape(test)}$", ci, re.M)

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
    # Every kernel source of the checkout, in its family's folder.
    for source in (ROOT / "kernels").rglob("*.cu*"):
        assert "sbnet_cupy/" + source.relative_to(ROOT).as_posix() in names, source
    # Every module of the checkout's packages (subpackages included) is in the wheel.
    for package in ("sbnet_cupy", "torch_bridge", "tf_bridge"):
        for module in (ROOT / package).rglob("*.py"):
            assert module.relative_to(ROOT).as_posix() in names, module
    assert not any(n.startswith("bench/") for n in names), "bench must not be installed"
