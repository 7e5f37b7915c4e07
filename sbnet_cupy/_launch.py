"""Kernel launches that cost little host time: every kernel takes its arguments as one struct,
packed here into a per-thread buffer and handed straight to the driver (cuLaunchKernel).

A launch through CuPy's ``Function.__call__`` converts every argument into a CuPy object (a
kernel of 15-19 scalars and arrays cost ~17 us of host time on the H100 machine), and the
bridges used to wrap every tensor in a CuPy array and every stream in a CuPy Stream. Here a call
is one ``Struct.pack_into`` and one driver call on raw pointers, whatever produced them (CuPy
arrays, torch tensors, DLPack capsules). Launch geometry, compiled functions and the structs'
layouts are computed once and cached by the ops.
"""

import struct
import threading

import numpy

from . import _kernels

try:
    from cupy.cuda import driver, runtime
except ImportError:  # the NumPy backend launches nothing
    driver = runtime = None

# The largest argument struct any kernel takes (kernels/common.cuh static_asserts each size).
_ARG_BYTES = 256


def layout(fmt, size):
    """struct.Struct for a kernel's argument struct: native alignment ('@'), as the compiler lays
    out the C++ struct; `size` is the struct's sizeof, which the kernel source asserts too."""
    packed = struct.Struct("@" + fmt)
    if struct.calcsize("@" + fmt + "0P") != size or size > _ARG_BYTES:
        raise AssertionError(f"argument layout {fmt!r} is not {size} bytes")  # a library bug
    return packed


class _ThreadState(threading.local):
    """The argument buffer of this thread (the driver copies it at launch, so one per thread
    serves every call) and the devices whose context this thread has made current."""

    def __init__(self):
        self.arguments = numpy.zeros(_ARG_BYTES // 8, dtype=numpy.uint64)
        self.parameter_list = numpy.array([self.arguments.ctypes.data], dtype=numpy.uint64)
        self.kernel_params = self.parameter_list.ctypes.data
        self.devices = set()


_state = _ThreadState()
_functions = {}  # (device, op, name expression) -> (CUfunction address, cupy Function)


def function(device, op, kernel, *template_args):
    """Address of the compiled ``kernel<template_args>`` of kernels/<op>.cu on `device`
    (compiled on first use, from CuPy's disk cache when it has it)."""
    key = (device, op, kernel, template_args)
    entry = _functions.get(key)
    if entry is None:
        import cupy

        with cupy.cuda.Device(device):
            compiled = _kernels.get_kernel(op, kernel, *template_args).kernel
        entry = _functions[key] = (compiled.ptr, compiled)  # the Function keeps its module loaded
    return entry[0]


def launch(device, stream, kernel, grid, block, shared_mem, arguments, values):
    """Launch `kernel` (an address from function()) on `device` and `stream` (a cudaStream_t
    address), grid and block as 3-tuples, with `values` packed by the Struct `arguments`."""
    state = _state
    arguments.pack_into(state.arguments, 0, *values)
    current = runtime.getDevice()
    if current == device and device in state.devices:
        driver.launchKernel(kernel, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                            shared_mem, stream, state.kernel_params, 0)
        return
    # Another device, or this thread's first launch on it: make its context current.
    runtime.setDevice(device)
    state.devices.add(device)
    try:
        driver.launchKernel(kernel, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                            shared_mem, stream, state.kernel_params, 0)
    finally:
        runtime.setDevice(current)
