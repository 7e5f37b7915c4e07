"""What kernel launches that cost little host time need of the driver: every kernel takes its
arguments as one struct, which a KernelPlan (core/plan.py) packs into this thread's buffer
(thread_state) and hands straight to the driver (cuLaunchKernel), after make_current.

A launch through CuPy's ``Function.__call__`` converts every argument into a CuPy object, which
costs more host time than the kernels of a small op take, and the bridges used to wrap every
tensor in a CuPy array and every stream in a CuPy Stream. Here a call is one ``pack_into`` of
the kernel's argument record (sbnet_cupy/core/records.py) and one driver call on raw pointers,
whatever produced them (CuPy arrays, torch tensors, DLPack capsules). Launch geometry and
compiled functions are computed once and cached by the ops, from the device's facts
(device_info), never from one GPU's numbers; function() compiles and keeps the kernels.

A plan made with ``dependent=True`` launches as a programmatic dependent launch
(cuLaunchKernelEx, called through ctypes: CuPy exposes no launch with attributes; see
dependent_launch and launch_config) on GPUs of compute capability 9.0 and later, on streams
other than the legacy default stream: the kernel may be scheduled while the previous kernel on
its stream still runs, and waits for it in the kernel (wait_for_previous_kernel,
kernels/core/common.cuh), so that a chain of short kernels (a bottleneck unit's block convolutions,
the fused submanifold convolution and its split sum) does not pay a full launch gap between
each two. SBNET_DEPENDENT_LAUNCH=0 (or DEPENDENT_LAUNCH = False)
launches them as the others.
"""

import ctypes
import os
import threading
from collections import namedtuple

import numpy

from . import kernels as _kernels

try:
    from cupy.cuda import Device, driver, runtime
except ImportError:  # the NumPy backend launches nothing
    Device = driver = runtime = None

# The largest argument record any kernel takes (tests/core/test_records.py checks each size).
_ARG_BYTES = 256

DEPENDENT_LAUNCH = os.environ.get("SBNET_DEPENDENT_LAUNCH", "1") != "0"
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, then a 64-byte union at offset 8 (here its first int)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


if ctypes.sizeof(_LaunchAttribute) != 72 or ctypes.sizeof(_LaunchConfig) != 56:
    raise AssertionError("CUlaunchConfig layout")  # a library bug


def _driver_launch_ex():
    """cuLaunchKernelEx from the driver library, or None where there is none (no GPU, a driver
    older than CUDA 12, not Linux)."""
    try:
        launch_ex = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_void_p]
    launch_ex.restype = ctypes.c_int
    return launch_ex


class _ThreadState(threading.local):
    """The argument buffer of this thread (the driver copies it at launch, so one per thread
    serves every call) and the devices whose context this thread has made current."""

    def __init__(self):
        self.arguments = numpy.zeros(_ARG_BYTES // 8, dtype=numpy.uint64)
        self.parameter_list = numpy.array([self.arguments.ctypes.data], dtype=numpy.uint64)
        self.kernel_params = self.parameter_list.ctypes.data
        self.devices = set()
        self.attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self.config = _LaunchConfig(attrs=ctypes.pointer(self.attribute), num_attrs=1)
        self.config_ref = ctypes.byref(self.config)


thread_state = _ThreadState()
_functions = {}  # (device, op, name expression) -> (CUfunction address, cupy Function)
_dependent = {}  # device -> cuLaunchKernelEx where it takes dependent launches, else None


def function(device, op, kernel, *template_args):
    """Address of the compiled ``kernel<template_args>`` of kernels/<family>/<op>.cu on `device`
    (compiled on first use, from CuPy's disk cache when it has it)."""
    key = (device, op, kernel, template_args)
    entry = _functions.get(key)
    if entry is None:
        import cupy

        with cupy.cuda.Device(device):
            compiled = _kernels.get_kernel(op, kernel, *template_args).kernel
        entry = _functions[key] = (compiled.ptr, compiled)  # the Function keeps its module loaded
    return entry[0]


DeviceInfo = namedtuple("DeviceInfo", ["sms", "shared_per_block_optin", "shared_per_sm",
                                       "compute_capability"])
DeviceInfo.__doc__ = """The facts of a GPU that the launch plans are made from: its SMs, the
dynamic shared memory a CTA may opt into and an SM holds (bytes), its compute capability
(major, minor). Plans take it from device_info(device); planning without a GPU (tests, the
benchmarks' tables) passes one explicitly, such as H100."""

# An H100 SXM: what the rules measured on it assume, for planning where there is no GPU.
H100 = DeviceInfo(sms=132, shared_per_block_optin=232448, shared_per_sm=233472,
                  compute_capability=(9, 0))

_device_infos = {}  # device -> DeviceInfo


def device_info(device):
    """The DeviceInfo of CUDA device `device` (an ordinal), read from the runtime once."""
    try:
        return _device_infos[device]
    except KeyError:
        def attribute(which):
            return runtime.deviceGetAttribute(which, device)

        capability = int(Device(device).compute_capability)
        info = _device_infos[device] = DeviceInfo(
            attribute(runtime.cudaDevAttrMultiProcessorCount),
            attribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin),
            attribute(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor),
            divmod(capability, 10))
        return info


def make_current(device):
    """Makes `device`'s context current for this thread's launch on it. Returns None where it
    was already (the common case), else the device that was current, which the launch makes
    current again after it."""
    current = runtime.getDevice()
    if current == device and device in thread_state.devices:
        return None
    # Another device, or this thread's first launch on it: make its context current.
    runtime.setDevice(device)
    thread_state.devices.add(device)
    return current


def dependent_launch(device, stream):
    """cuLaunchKernelEx where a launch on `device` and `stream` may be a programmatic dependent
    one, else None: DEPENDENT_LAUNCH off, the legacy default stream (0, which synchronises with
    every other stream: the chains this serves run on explicit streams, such as CUDA graph
    captures and torch's side streams), or a device before compute capability 9.0."""
    if not (DEPENDENT_LAUNCH and stream):
        return None
    try:
        return _dependent[device]
    except KeyError:
        major = device_info(device).compute_capability[0]
        launch_ex = _dependent[device] = _driver_launch_ex() if major >= 9 else None
        return launch_ex


def launch_config(grid, block, shared_mem, stream):
    """This thread's CUlaunchConfig (by reference) of a dependent launch: the programmatic
    stream serialization attribute, and this launch's shape and stream."""
    config = thread_state.config
    config.grid[0], config.grid[1], config.grid[2] = grid
    config.block[0], config.block[1], config.block[2] = block
    config.shared_mem, config.stream = shared_mem, stream
    return thread_state.config_ref
