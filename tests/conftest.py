import collections
import importlib
import os
import pathlib
import zlib

# Under pytest-xdist, each worker takes its share of the cores for its thread pools (OpenMP:
# torch, BLAS), read when those libraries load, so set here, before any import: otherwise every
# worker starts a pool of all the cores, and the CPU's float64 gradchecks crawl beside the busy
# workers (three gradgradcheck cases of test_torch_dilated: 12 s alone on 16 cores, unfinished
# after 150 s beside seven other workers).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# cuBLAS is deterministic with this workspace setting only, read when its handle is made; torch's
# deterministic mode (test_determinism) refuses cuBLAS products without it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy  # noqa: E402
import pytest

try:
    import cupy
    HAS_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no CuPy, or no driver / device
    cupy = None
    HAS_GPU = False

requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and CuPy")
BACKENDS = ["numpy", pytest.param("cupy", marks=requires_gpu)]


@pytest.fixture(params=BACKENDS)
def xp(request):
    """The array module of the backend under test."""
    if request.param == "cupy":
        _poison_pool()
        return cupy
    return numpy


def _poison_pool():
    """Fill free device memory of CuPy's pool with 0xFF so that an output element the kernels
    forget to write shows up as NaN or -1 instead of an old or zero value."""
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    junk = cupy.empty(64 << 20, dtype=cupy.uint8)
    junk.fill(255)
    del junk  # back to the pool, to be handed out again by the next allocations


@pytest.fixture(scope="session")
def emulation_dir(tmp_path_factory):
    """The folder tests/cuda_emulation builds its kernel libraries in: one for all of the run's
    pytest-xdist workers (whose own folders share a parent), so that g++ builds each kernel file
    once, not once a worker."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "emulated"
    folder.mkdir(exist_ok=True)
    return folder


def to_numpy(a):
    return cupy.asnumpy(a) if cupy is not None and isinstance(a, cupy.ndarray) else a


@pytest.fixture
def rng(request):
    # A different seed for every test, reproducible from its name: tests/<file>::<test>, without
    # the family's folder, so that the seeds stayed those of the flat tests/ they came from.
    path, sep, rest = request.node.nodeid.partition("::")
    name = "tests/" + pathlib.PurePosixPath(path).name + sep + rest
    return numpy.random.default_rng(zlib.crc32(name.encode()))


def pytest_report_header(config):
    require = os.environ.get("SBNET_REQUIRE_NVRTC")
    return [f"sbnet-cupy: GPU tests {'run' if HAS_GPU else 'skipped (no GPU)'}; "
            f"SBNET_REQUIRE_NVRTC={require}"]


def require(module):
    """pytest.importorskip, except in CI (SBNET_REQUIRE_BRIDGES=1), which must have it."""
    if os.environ.get("SBNET_REQUIRE_BRIDGES") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def pytest_terminal_summary(terminalreporter):
    """The skipped tests as one line per reason, with counts (pyproject's addopts leave out
    pytest's line per skipped test; `-rs` brings it back)."""
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = collections.Counter()
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(
            report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", f"{len(skipped)} skipped")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:6d}  {reason}")


def pytest_configure(config):
    config.addinivalue_line("markers", "emulated: runs a kernel file on the CPU (tests/"
                            "cuda_emulation) in a forked child, so that a fault fails the test")
    config.addinivalue_line("markers", "version_free: the outcome does not depend on the "
                            "versions of NumPy, TensorFlow or torch (NVRTC, g++, or only our "
                            "own index arithmetic: kernels transliterated, launch plans)")


def pytest_collection_modifyitems(config, items):
    # CI's second pass pins the lowest versions pyproject allows; what does not depend on them
    # (the NVRTC compile check, the kernels run on the CPU) ran in its first pass already.
    if os.environ.get("SBNET_SKIP_VERSION_FREE") != "1":
        return
    skip = pytest.mark.skip(reason="independent of the library versions: CI's first pass ran it")
    for item in items:
        if item.get_closest_marker("version_free") or item.get_closest_marker("emulated"):
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("emulated") is None:
        return None
    import cuda_emulation
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    cuda_emulation.run_isolated(lambda: pyfuncitem.obj(**arguments))
    return True
