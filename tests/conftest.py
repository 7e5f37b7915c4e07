import importlib
import os
import zlib

import numpy
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


def to_numpy(a):
    return cupy.asnumpy(a) if cupy is not None and isinstance(a, cupy.ndarray) else a


@pytest.fixture
def rng(request):
    # A different seed for every test, reproducible from its name.
    return numpy.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_report_header(config):
    require = os.environ.get("SBNET_REQUIRE_NVRTC")
    return [f"sbnet-cupy: GPU tests {'run' if HAS_GPU else 'skipped (no GPU)'}; "
            f"SBNET_REQUIRE_NVRTC={require}"]


def require(module):
    """pytest.importorskip, except in CI (SBNET_REQUIRE_BRIDGES=1), which must have it."""
    if os.environ.get("SBNET_REQUIRE_BRIDGES") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)
