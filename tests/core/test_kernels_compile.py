"""Every kernel instantiation the library can ask for compiles with NVRTC for sm_90 (and one of
each kernel and type arguments for sm_80), with the options CuPy's RawModule uses and NVRTC's
fast-compile mode: needs CuPy and NVRTC, no GPU.

CI sets SBNET_REQUIRE_NVRTC=1 so that a missing compiler fails instead of skipping.
"""

import os
import re

import pytest

from sbnet_cupy.core import kernels as _kernels

pytestmark = pytest.mark.version_free


def _nvrtc_program_class_and_version():
    try:
        from cupy.cuda import compiler
        return compiler._NVRTCProgram, compiler._get_nvrtc_version()
    except Exception as error:  # no CuPy, or no NVRTC library
        if os.environ.get("SBNET_REQUIRE_NVRTC") == "1":
            raise
        pytest.skip(f"CuPy with NVRTC is not available: {error}")


# The options CuPy's RawModule adds to ours (cupy/cuda/compiler.py, CuPy 14.2).
CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")

# NVRTC 13 can trade the generated code's speed for compile time (about 4x less here). The
# check is about what compiles: the front end, template instantiation and ptxas's resource
# limits run all the same, and the GPU tests compile with the library's own options.
FAST_COMPILE = ("-Ofc=max",)


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


def compile_with_nvrtc(source, filename, names, arch, fast=True):
    """(cubin, {name expression: lowered name}) of `names` in `source` for sm_`arch`."""
    program_class, nvrtc_version = _nvrtc_program_class_and_version()
    speed = FAST_COMPILE if fast and nvrtc_version >= (13, 0) else ()
    program = program_class(source, filename, (), (), name_expressions=names, method="cubin")
    return program.compile(_kernels.COMPILE_OPTIONS + CUPY_OPTIONS + speed + (f"-arch=sm_{arch}",))


# Every instantiation for sm_90; for sm_80, one per kernel and type arguments (the compile check
# is CI's longest test, and the architectures differ only by type).
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("op", sorted(_kernels.all_instantiations()))
def test_every_instantiation_compiles(op, arch):
    names = _kernels.all_instantiations()[op]
    if arch == "80":
        names = one_per_kernel_and_types(names)
    cubin, mapping = compile_with_nvrtc(_kernels.kernel_source(op), f"{op}.cu", names, arch)
    assert len(cubin) > 0
    assert sorted(mapping) == sorted(names)


def test_every_kernel_file_has_its_instantiations():
    """The compile check covers every kernel file under kernels/: the ops whose tables live in their
    own modules registered them when sbnet_cupy was imported."""
    files = {path.stem for path in _kernels._source_dir().glob("**/*.cu")}
    assert set(_kernels.all_instantiations()) == files
