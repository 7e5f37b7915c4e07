"""Launch plans: each kernel launch of an op, worked out once per (shapes, dtype, device,
options) and kept by the op (functools.lru_cache on its plan function), then run per call with
only the call's own values (addresses, counts).

A KernelPlan owns the compiled kernel, its name (as NVRTC and the profiler see it), the launch
shape, and the kernel's argument record (core/records.py) with the plan's constant fields
already built by name, so that a call packs its per-call values in front of them and launches.
The rules that size grids from the device's facts (core/launch.device_info) are here too, one
of each: how many CTAs of a kernel a GPU holds at once, and how many ways to split a reduction
so that few tiles still fill it.
"""

from . import kernels as _kernels
from . import launch as _launch
from . import records as _records


class KernelPlan:
    """One kernel launch planned for one device.

    Attributes: device, function (the compiled kernel's address, None where there is no
    device: plans made for tables and tests; or for a `generated` kernel, whose code is made per
    call, such as a pruned weight's mask: each launch passes its own function),
    name (``kernel<args>``), template_args, grid and block (3-tuples;
    a call may pass another grid, for counts that change per call), shared_mem (dynamic bytes),
    record (the kernel's argument Record), constants (the values of the record's last fields,
    fixed by the plan: record.tail(**fields)), dependent (launched as a programmatic dependent
    launch where the GPU takes it; see core/launch.py)."""

    __slots__ = ("device", "function", "name", "template_args", "grid", "block", "shared_mem",
                 "record", "constants", "dependent")

    def __init__(self, device, op, kernel, template_args, grid, block, shared_mem, record,
                 constants=(), dependent=False, generated=False):
        self.device = device
        self.function = (None if device is None or generated
                         else _launch.function(device, op, kernel, *template_args))
        self.name = _kernels.name_expression(kernel, *template_args)
        self.template_args = tuple(template_args)
        self.grid, self.block, self.shared_mem = tuple(grid), tuple(block), shared_mem
        self.record, self.constants, self.dependent = record, tuple(constants), dependent

    def launch(self, stream, *values, grid=None, function=None):
        """Launch on `stream` with the record's leading leaves `values` (in its order), then
        the plan's constants; `function`: a generated plan's kernel (see the attributes). The
        driver is called from here, so that a module's call reaches it in few frames."""
        state = _launch.thread_state
        self.record.pack_into(state.arguments, 0, *values, *self.constants)
        function, grid = function or self.function, grid or self.grid
        restore = _launch.make_current(self.device)
        try:
            launch_ex = self.dependent and _launch.dependent_launch(self.device, stream)
            if launch_ex:
                status = launch_ex(_launch.launch_config(grid, self.block, self.shared_mem,
                                                         stream),
                                   function, state.kernel_params, None)
                if status:
                    raise _launch.driver.CUDADriverError(status)
            else:
                _launch.driver.launchKernel(function, *grid, *self.block, self.shared_mem,
                                            stream, state.kernel_params, 0)
        finally:
            if restore is not None:
                _launch.runtime.setDevice(restore)

    def __repr__(self):
        return (f"KernelPlan({self.name}, grid={self.grid}, block={self.block}, "
                f"shared_mem={self.shared_mem})")


def max_dynamic_shared(plan, shared_mem):
    """Lets plan's kernel take up to shared_mem bytes of dynamic shared memory (past 48 KiB a
    kernel must opt in); returns plan's function."""
    driver = _launch.driver
    driver.funcSetAttribute(plan.function, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            shared_mem)
    return plan.function


def resident_ctas(function, threads, shared_mem, device):
    """How many CTAs of `function` (threads each, shared_mem dynamic bytes) `device` runs at
    once: its SMs times the occupancy (at least one a SM)."""
    per_sm = _launch.driver.occupancyMaxActiveBlocksPerMultiprocessor(function, threads,
                                                                      shared_mem)
    return _launch.device_info(device).sms * max(1, per_sm)


def reduction_splits(tiles, parts, sms, ctas_per_sm=2, round_up=True):
    """Into how many splits to cut a reduction of `parts` parts (taps, channel chunks) whose
    output has `tiles` tiles, so that a GPU of `sms` SMs gets about ctas_per_sm CTAs an SM: one
    where the tiles alone fill it, at most one a part. round_up: at least that many CTAs (else
    at most, so a grid that fills the GPU once is not split: what the fused submanifold
    kernel's measurements chose)."""
    target = ctas_per_sm * sms
    if parts < 2 or not 0 < tiles < target:
        return 1
    splits = -(-target // tiles) if round_up else target // tiles
    return max(1, min(parts, splits))


_SPLIT_SUM_THREADS, _SPLIT_SUM_BLOCKS = 256, 2048  # blocks enough to fill a GPU


def split_sum_plan(device, op, ctype, rows=None, cols=None, pitch=None, splits=None,
                   dependent=False, relu=False):
    """The KernelPlan of split_sum<ctype> (kernels/core/common.cuh, compiled with
    kernels/<family>/<op>.cu) after a kernel whose reduction was cut in `splits`: out [rows, cols] =
    bias [cols] + the float sums partial [splits, rows, pitch], in split order (then max(0, .)
    where relu). A call passes (partial, bias, out) addresses; the sizes are the plan's
    constants, or, left None, each call's (a reduction whose rows change per call): it passes
    them after the addresses, in the record's order (rows, cols, pitch, splits; those given must
    be the last ones), and, without rows, its grid: split_sum_grid(rows, cols). A grid-stride
    loop."""
    record = _records.SPLIT_SUM_ARGS
    sizes = {name: size for name, size in dict(rows=rows, cols=cols, pitch=pitch,
                                                splits=splits).items() if size is not None}
    return KernelPlan(device, op, "split_sum", (ctype,),
                      (1, 1, 1) if rows is None else split_sum_grid(rows, cols),
                      (_SPLIT_SUM_THREADS, 1, 1), 0, record, record.tail(**sizes, relu=int(relu)),
                      dependent)


def split_sum_grid(rows, cols):
    """The split sum's grid for out [rows, cols]: a thread an element, up to blocks enough to
    fill a GPU (then a grid-stride loop), at least one."""
    return max(1, min(-(-rows * cols // _SPLIT_SUM_THREADS), _SPLIT_SUM_BLOCKS)), 1, 1
