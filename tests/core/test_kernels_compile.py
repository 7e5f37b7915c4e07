"""Every kernel instantiation the library can ask for compiles with NVRTC for sm_90 (and one of
each kernel and type arguments for sm_80), with the options CuPy's RawModule uses: needs CuPy
and NVRTC, no GPU.

CI sets SBNET_REQUIRE_NVRTC=1 so that a missing compiler fails instead of skipping.
"""

import os
import re

import pytest

from sbnet_cupy.core import kernels as _kernels

pytestmark = pytest.mark.version_free


def _nvrtc_program_class():
    try:
        from cupy.cuda import compiler
        compiler._get_nvrtc_version()
        return compiler._NVRTCProgram
    except Exception as error:  # no CuPy, or no NVRTC library
        if os.environ.get("SBNET_REQUIRE_NVRTC") == "1":
            raise
        pytest.skip(f"CuPy with NVRTC is not available: {error}")


# The options CuPy's RawModule adds to ours (cupy/cuda/compiler.py, CuPy 14.2).
CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def one_per_kernel_and_types(names):
    """The first of `names` for each kernel and its type arguments (its integer ones left out):
    code differs between sm_80 and sm_90 only where kernels/core/common.cuh tests __CUDA_ARCH__,
    in helpers chosen by type (atomic adds, vectors of them) and in the dependent-launch calls,
    which every kernel makes alike."""
    chosen = {}
    for name in names:
        kernel, _, arguments = name.partition("<")
        types = tuple(a.strip() for a in arguments.rstrip(">").split(",")
                      if not re.fullmatch(r"\s*(-?\d+[uU]?|true|false)\s*", a))
        chosen.setdefault((kernel, types), name)
    return list(chosen.values())


# Every instantiation for sm_90; for sm_80, one per kernel and type arguments (the compile check
# is CI's longest test, and the architectures differ only by type).
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("op", sorted(_kernels.all_instantiations()))
def test_every_instantiation_compiles(op, arch):
    program_class = _nvrtc_program_class()
    names = _kernels.all_instantiations()[op]
    if arch == "80":
        names = one_per_kernel_and_types(names)
    program = program_class(_kernels.kernel_source(op), f"{op}.cu", (), (),
                            name_expressions=names, method="cubin")
    cubin, mapping = program.compile(_kernels.COMPILE_OPTIONS + CUPY_OPTIONS
                                     + (f"-arch=sm_{arch}",))
    assert len(cubin) > 0
    assert sorted(mapping) == sorted(names)


def test_every_kernel_file_has_its_instantiations():
    """The compile check covers every kernel file under kernels/: the ops whose tables live in their
    own modules registered them when sbnet_cupy was imported."""
    files = {path.stem for path in _kernels._source_dir().glob("**/*.cu")}
    assert set(_kernels.all_instantiations()) == files
