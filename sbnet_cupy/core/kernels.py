"""Loads the CUDA sources in kernels/ and compiles the instantiation a call needs.

Every kernel is a C++ template; a call names one instantiation (``op<T, ...>``) and CuPy
compiles it with NVRTC once per device and process (``cupy.memoize``), keeping the binary in
its disk cache so later processes load it without compiling. The tables below are the only
place that says which types and sizes the kernels are instantiated for.
"""

import functools
import pathlib

from . import records as _records

COMPILE_OPTIONS = ("--std=c++17",)

# Block sizes that reduce_mask has a kernel of its own for (its loop over a block's pixels
# unrolls and divides by a constant). Other sizes run the same kernel with the size read at run
# time (template value 0). Gather and scatter copy whole pixel rows and need no such table.
SPECIALISED_BLOCK_SIZES = (8, 10, 16, 18, 32, 34)

# Storage types by byte size, for the kernels that only move bytes.
STORAGE_CTYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
                  8: "unsigned long long", 16: "uint4"}
# Element sizes that space_to_batch moves between an NCHW image and an NHWC batch in one pass
# (the float types that a convolution in channels_last takes).
CHANNELS_LAST_ITEMSIZES = (2, 4, 8)
# Types that the adding kernels do arithmetic in, by dtype name.
ARITHMETIC_CTYPES = {"float16": "half_t", "bfloat16": "bfloat16_t", "float32": "float",
                     "float64": "double"}
# Mask types reduce_mask reads, by dtype name.
MASK_CTYPES = {"bool": "bool", "uint8": "unsigned char", "int32": "int", "float16": "half_t",
               "float32": "float", "float64": "double"}
# Bytes an element, by dtype name (bfloat16 included, which numpy does not name).
ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def specialised_size(size):
    """The template value for a block size: the size itself if it has a kernel, else 0."""
    return size if size in SPECIALISED_BLOCK_SIZES else 0


def name_expression(kernel, *template_args):
    """``kernel<a, b, ...>``, as NVRTC and the profiler see it."""
    args = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in template_args)
    return f"{kernel}<{args}>"


def _source_dir():
    # A wheel ships the sources inside the package; a source checkout keeps them beside it.
    package = pathlib.Path(__file__).parent.parent  # this file is sbnet_cupy/core/kernels.py
    packaged = package / "kernels"
    return packaged if packaged.is_dir() else package.parent / "kernels"


def common_file():
    """kernels/core/common.cuh, the helpers every kernel file is compiled after."""
    return _source_dir() / "core" / "common.cuh"


def kernel_file(op):
    """The kernel file of `op`, <op>.cu in its family's folder of kernels/ (blocks, submanifold,
    pruned, dilated, as the subpackages) or at its top."""
    found = sorted(_source_dir().glob(f"**/{op}.cu"))
    if len(found) != 1:
        raise ValueError(f"op must name one kernel file, got {op!r}: {found}")
    return found[0]


@functools.cache
def kernel_source(op):
    """Source of the kernel file of `op` with kernels/core/common.cuh in front of it, and in front
    of both the argument records of the two (_records.header)."""
    return "\n".join([_records.header(op), common_file().read_text(),
                      kernel_file(op).read_text()])


@functools.cache
def _compiler():
    import cupy

    @cupy.memoize(for_each_device=True)
    def compile_one(op, name):
        module = cupy.RawModule(code=kernel_source(op), options=COMPILE_OPTIONS,
                                name_expressions=(name,))
        return module.get_function(name)

    return compile_one


def get_kernel(op, kernel, *template_args):
    """The compiled ``kernel<template_args>`` of op's kernel file, for the current device."""
    return _compiler()(op, _cached_name_expression(kernel, template_args))


def generated_function(device, op, source, kernel, *template_args):
    """(address, owner) of ``kernel<template_args>`` compiled on `device` from
    kernels/<family>/<op>.cu (kernel_source) followed by `source`: code generated per call, such
    as a pruned weight's mask as code (sbnet_cupy/pruned/program.py). NVRTC compiles it on first
    use, CuPy's disk cache serves it after; the owner keeps its module loaded, and the caller
    keeps the owner as long as the code's source object lives (so that masks come and go with
    their weights)."""
    import cupy

    name = name_expression(kernel, *template_args)
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=kernel_source(op) + "\n" + source,
                                options=COMPILE_OPTIONS, name_expressions=(name,))
        compiled = module.get_function(name).kernel  # the driver-level function
    return compiled.ptr, (module, compiled)


@functools.lru_cache(maxsize=None)
def _cached_name_expression(kernel, template_args):
    return name_expression(kernel, *template_args)


def widest_access(row_bytes, alignment):
    """Largest access (16, 8, 4, 2 or 1 bytes) that divides row_bytes and the pointers'
    alignment (_checks.alignment)."""
    for width in (16, 8, 4, 2):
        if row_bytes % width == 0 and alignment % width == 0:
            return width
    return 1


_REGISTERED = {}  # op -> its module's instantiations(), for the ops whose tables live there


def register_instantiations(op, instantiations):
    """An op module's `instantiations()` (name expressions of its kernel file), registered at
    its import so that this module need not import the ops that import it."""
    _REGISTERED[op] = instantiations


def all_instantiations():
    """Every name expression the ops can ask for, by op: what the compile check builds (the
    registered ops' once sbnet_cupy, which imports them all, is imported)."""
    sizes = (0,) + SPECIALISED_BLOCK_SIZES
    adds = ("Add", "AtomicAdd")
    reshapes = ("space_to_batch", "batch_to_space")
    storage = [(STORAGE_CTYPES[b], b) for b in (1, 2, 4, 8)]
    arithmetic = [(ctype, ITEMSIZES[name]) for name, ctype in ARITHMETIC_CTYPES.items()]

    def vectors(itemsize, widest):  # element counts of the accesses the kernels may use
        return [v for v in (1, 2, 4, 8, 16) if v * itemsize <= 16 and v <= widest]

    return {
        "reduce_mask": [name_expression("reduce_mask", ctype, avg, s, s)
                        for ctype in MASK_CTYPES.values() for avg in (False, True)
                        for s in sizes],
        "sparse_gather": (
            [name_expression("sparse_gather", word) for word in STORAGE_CTYPES.values()]
            + [name_expression("sparse_gather_transposed", ctype, v)
               for ctype, size in storage for v in vectors(size, 8)]
            + [name_expression("sparse_gather_affine", ctype, v, relu)
               for ctype, size in arithmetic for v in vectors(size, 16)
               for relu in (False, True)]),
        "space_to_batch": (
            [name_expression(f"{op}_nhwc", word)
             for op in reshapes for word in STORAGE_CTYPES.values()]
            + [name_expression(f"{op}_nchw", ctype, v, vy, channels_last) for op in reshapes
               for size, ctype in STORAGE_CTYPES.items()
               for v in vectors(size, 16) for vy in vectors(size, 16)
               for channels_last in (False, True)
               if not channels_last or (v == vy and size in CHANNELS_LAST_ITEMSIZES)]),
        "sparse_scatter": (
            [name_expression("sparse_scatter", word, "Assign")
             for word in STORAGE_CTYPES.values()]
            + [name_expression("sparse_scatter", f"vec_t<{ctype}, {v}>", op)
               for ctype, size in arithmetic for v in vectors(size, 16) for op in adds]
            + [name_expression("sparse_scatter_transposed", ctype, v, "Assign")
               for ctype, size in storage for v in vectors(size, 8)]
            + [name_expression("sparse_scatter_transposed", ctype, v, op)
               for ctype, size in arithmetic for v in vectors(size, 8) for op in adds]),
        **{op: instantiations() for op, instantiations in _REGISTERED.items()},
    }

