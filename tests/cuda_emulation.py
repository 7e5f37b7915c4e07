"""The kernels of kernels/blocks/block_conv.cu and kernels/submanifold/submanifold.cu (and the
other kernel files the tests build) on the CPU: their own source, built by g++ with the CUDA
features they use emulated (tests/cuda_emulation.h), behind the driver calls of
sbnet_cupy.core.launch, so that the host-side planning runs as it is (tile widths, warp groups,
splits, shared memory) and each launch runs the emulated kernel on NumPy arrays. For CI, which
has no GPU: what the kernels compute, on small inputs. kernels/core/common.cuh is built as it
is, less its inline PTX, which the header emulates."""

import ctypes
import fcntl
import hashlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import traceback

import numpy
import pytest

from sbnet_cupy.core import checks as _checks, kernels as _kernels, launch as _launch
from sbnet_cupy.core import records as _records
from sbnet_cupy.core.backend import Backend

HEADER = pathlib.Path(__file__).with_name("cuda_emulation.h")
_AFTER_COMMON = "// ---- after kernels/common.cuh ----\n"  # the header's second part starts here
SHARED_MEMORY_OPTIN = _launch.H100.shared_per_block_optin  # bytes a CTA may opt into


def available():
    return shutil.which("g++") is not None


_LITERALS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'|//.*')


def _without_inline_ptx(text):
    """text without its top-level definitions that hold inline PTX (`asm`), which the header
    emulates. A definition ends at a line, outside braces, that ends with ';' or '}'; a
    preprocessor line (with its continuations) or a blank line stands alone."""
    kept, pending, depth = [], [], 0
    lines = iter(text.split("\n"))

    def flush():
        chunk = "\n".join(pending)
        if not re.search(r"\basm\b", _LITERALS.sub("", chunk)):
            kept.append(chunk)
        pending.clear()

    for line in lines:
        if depth == 0 and (line.lstrip().startswith("#") or not line.strip()):
            flush()
            pending.append(line)
            while pending[-1].endswith("\\"):
                pending.append(next(lines))
            flush()
            continue
        pending.append(line)
        code = _LITERALS.sub("", line).rstrip()
        depth += code.count("{") - code.count("}")
        if depth == 0 and code.endswith((";", "}")):
            flush()
    flush()
    return "\n".join(kept)


def _emulated_source(op, kernels):
    """The header's CUDA features, the argument records (sbnet_cupy/core/records.py, as NVRTC gets
    them), kernels/core/common.cuh and the op's kernel file without their inline PTX (the header's
    emulations of it in between), the kernel's dynamic shared memory the emulated one; then one
    C entry point per kernel (name expression: argument struct)."""
    features, emulations = HEADER.read_text().split(_AFTER_COMMON)
    text = _without_inline_ptx(_kernels.kernel_file(op).read_text())
    text = text.replace(f"extern __shared__ __align__(16) unsigned {op}_smem[];",
                        f"unsigned* {op}_smem = (unsigned*)dynamic_shared;")
    entries = "".join(
        f'extern "C" const char* entry_{i}(const void* args, int gx, int gy, int gz, int block,\n'
        f"                                 int shared) {{\n"
        f"    {struct} a;\n    std::memcpy(&a, args, sizeof a);\n"
        f"    return emu_run(gx, gy, gz, block, shared, [&] {{ {name}(a); }});\n}}\n"
        for i, (name, struct) in enumerate(kernels.items()))
    return "\n".join([features, _records.header(op),
                      _without_inline_ptx(_kernels.common_file().read_text()),
                      emulations, text, entries])


def build(op, kernels, folder):
    """{name expression: C function(args, grid x, y, z, block, shared bytes)} of op's kernel file's
    `kernels` ({name expression: argument struct}), built in `folder`."""
    source = _emulated_source(op, kernels)
    key = hashlib.sha1(source.encode()).hexdigest()[:16]
    library = pathlib.Path(folder) / f"{op}_{key}.so"
    # The folder may be shared by pytest-xdist's workers: the first builds, the others wait.
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            cpp = library.with_suffix(".cpp")
            cpp.write_text(source)
            subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                            "-Wno-unknown-pragmas", "-D_FORTIFY_SOURCE=3",
                            "-D_GLIBCXX_ASSERTIONS", "-o", str(library), str(cpp)], check=True)
    handle = ctypes.CDLL(str(library))
    entries = {name: getattr(handle, f"entry_{i}") for i, name in enumerate(kernels)}
    for entry in entries.values():
        entry.restype = ctypes.c_char_p  # the first fault of the launch, or None
    return entries


class _Runtime:
    cudaDevAttrMaxSharedMemoryPerBlockOptin, cudaDevAttrMultiProcessorCount = 1, 2

    def __init__(self, sms):
        self.sms = sms

    def deviceGetAttribute(self, attribute, device):
        return SHARED_MEMORY_OPTIN if attribute == 1 else self.sms

    def getDevice(self):
        return 0

    def setDevice(self, device):
        pass


class _Driver:
    """The driver calls that the plans make. launchKernel runs the emulated kernel
    `entries[kernel]` on the arguments that the plan packed into its buffer, and appends
    (name expression, grid, threads, shared bytes) to `launched`."""

    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self, entries=None, launched=None):
        self.entries, self.launched = entries, launched

    def funcSetAttribute(self, *args):
        pass

    def occupancyMaxActiveBlocksPerMultiprocessor(self, function, threads, shared):
        return min(2048 // threads, (SHARED_MEMORY_OPTIN + 1024) // (shared + 1024))

    def launchKernel(self, kernel, gx, gy, gz, bx, by, bz, shared, stream, kernel_params, extra):
        self.launched.append((kernel, (gx, gy, gz), bx, shared))
        arguments = ctypes.c_void_p.from_address(kernel_params)  # the buffer's address
        fault = self.entries[kernel](arguments, gx, gy, gz, bx, shared)
        if fault is not None:
            raise AssertionError(f"{kernel}: {fault.decode()}")


def install(monkeypatch, entries, sms):
    """Route the plans' launches (sbnet_cupy.core.plan.KernelPlan.launch, whose driver calls
    sbnet_cupy.core.launch serves) to the emulated kernels `entries` on a GPU of `sms` SMs;
    returns the list that each launch appends (name expression, grid, threads, shared bytes)
    to."""
    launched = []
    monkeypatch.setattr(_launch, "runtime", _Runtime(sms))
    info = _launch.DeviceInfo(sms=sms, shared_per_block_optin=SHARED_MEMORY_OPTIN,
                              shared_per_sm=SHARED_MEMORY_OPTIN + 1024, compute_capability=(9, 0))
    monkeypatch.setattr(_launch, "device_info", lambda device: info)
    monkeypatch.setattr(_launch, "driver", _Driver(entries, launched))
    monkeypatch.setattr(_launch, "function",
                        lambda device, op, kernel, *args: _kernels.name_expression(kernel, *args))
    # Every launch through launchKernel: never the real cuLaunchKernelEx of a GPU's host.
    monkeypatch.setattr(_launch, "DEPENDENT_LAUNCH", False)
    # The emulated device's context is no GPU's: a later real launch makes its own current.
    monkeypatch.setattr(_launch.thread_state, "devices", set())
    return launched


class HostMemory(Backend):
    """The emulated GPU's backend (sbnet_cupy/core/backend.py): NumPy arrays are its memory (on
    device 0, stream 0); bfloat16 travels as uint16. New arrays are poisoned (NaN floats, 0xab
    bytes in integers), so a kernel must write what it reads back; `scratch` lists the float
    scratch handed out."""

    name, gpu = "emulated", True

    def __init__(self):
        self.scratch = []

    def device(self, a):
        return 0

    def pointer(self, a):
        return 0 if a is None else a.ctypes.data

    def stream(self, device):
        return 0

    def dtype_name(self, a):
        return "bfloat16" if a.dtype == numpy.uint16 else _checks.dtype_name(a)

    def host(self, a):
        return a

    def contiguous(self, a):
        return numpy.ascontiguousarray(a)

    def empty(self, shape, like, dtype=None):
        a = numpy.empty(shape, dtype or like.dtype)
        nan = a.dtype.kind == "f" or a.dtype == numpy.uint16  # bfloat16's NaN: 0xffff
        a.reshape(-1).view(numpy.uint8)[:] = 0xff if nan else 0xab
        return a

    def zeros(self, shape, like, dtype=None):
        return numpy.zeros(shape, dtype or like.dtype)

    def float_scratch(self, device, n):
        self.scratch.append(numpy.full(n, numpy.nan, numpy.float32))
        return self.scratch[-1].ctypes.data, self.scratch[-1]


def run_isolated(test):
    """Run `test()` in a forked child: an emulated kernel that faults (a fortified copy out of
    bounds, a failed libstdc++ assertion) aborts that child, and the test fails with the signal
    instead of the interpreter dying. The child's failure comes back as its traceback's text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        status = 0
        try:
            test()
        except pytest.skip.Exception as skip:
            os.write(write_end, str(skip).encode())
            status = 2
        except BaseException:  # a failure or an error goes back as its traceback's text
            os.write(write_end, traceback.format_exc().encode())
            status = 1
        os.close(write_end)
        os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        pytest.fail(f"the emulated kernel killed its process with {name} (its stderr, above, "
                    "says why)", pytrace=False)
    if os.WEXITSTATUS(status) == 2:
        pytest.skip(report)
    if os.WEXITSTATUS(status):
        pytest.fail(report, pytrace=False)
