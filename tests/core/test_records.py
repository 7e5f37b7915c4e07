"""The kernels' argument records (sbnet_cupy/core/records.py): the C++ definitions that g++ builds
check every field's offset and the size that Python packs; the values pack at the offsets the
record names; the launches that pass their values by position pass them in the record's order
(checked against the same values built by name)."""

import shutil
import struct
import subprocess

import pytest

import cuda_emulation
from sbnet_cupy.blocks import stack as _blocks, block_conv, reduce_mask
from sbnet_cupy.core import backend as _backend, launch as _launch, plan, records as _records

OPS = sorted({record.op for record in _records.records() if record.op} | {"common"})


@pytest.mark.emulated
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("op", OPS)
def test_the_compiler_lays_out_the_records_as_python_packs_them(tmp_path, op):
    """The header's static_asserts (sizeof and the offset of every field) hold for g++, as the
    NVRTC compile check finds for NVRTC; one wrong offset fails."""
    source = tmp_path / "records.cpp"
    source.write_text(_records.header(op))
    subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(source)], check=True)
    record = next(r for r in _records.records() if r.op in (op, None) and len(r.fields) > 1)
    wrong = _records.header(op).replace(
        f"__builtin_offsetof({record.name}, {record.fields[1][0]}) == "
        f"{record.field_offsets[1]}",
        f"__builtin_offsetof({record.name}, {record.fields[1][0]}) == "
        f"{record.field_offsets[1] + 4}")
    source.write_text(wrong)
    assert subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(source)],
                          capture_output=True).returncode != 0


@pytest.mark.parametrize("record", _records.records(), ids=lambda r: r.name)
def test_each_value_lands_at_its_fields_offset(record):
    values = [i + 1.5 if char in "fd" else i + 1
              for i, char in enumerate(c for c in record.format[1:] if c.isalpha() and c != "x")]
    buffer = bytearray(record.size + 8)
    record.pack_into(buffer, 8, *values)
    chars = [c for c in record.format[1:] if c.isalpha() and c != "x"]
    assert len(values) == len(record.names) == len(record.offsets) == len(chars)
    for value, offset, char in zip(values, record.offsets, chars):
        assert struct.unpack_from("<" + char, buffer, 8 + offset)[0] == value
    assert record.size % record.align == 0 and record.size <= _launch._ARG_BYTES


def test_records_are_built_by_name():
    side = _records.BLOCK_SIDE.values(height=5, width=6, off_h=-1, off_w=-2, str_h=3, str_w=4,
                                      stack=0)
    assert side == (5, 6, -1, -2, 3, 4, 0)
    assert _records.CONV_ARGS.tail(groups=3, warps_q=2, warps_y=1, split_cin=8) == (1, 2, 3, 8)
    assert _records.BLOCK_CONV_PAIR_ARGS.names[:2] == ("conv.src", "conv.dst")
    assert _records.P2V_ARGS.names[-1] == "vsize[3]"
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'stack'"):
        _records.BLOCK_SIDE.values(height=5, width=6, off_h=-1, off_w=-2, str_h=3, str_w=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'depth'"):
        _records.BLOCK_SIDE.values(height=5, width=6, off_h=-1, off_w=-2, str_h=3, str_w=4,
                                   stack=0, depth=1)
    with pytest.raises(TypeError, match="missing"):
        _records.CONV_ARGS.tail(split_cin=8, warps_y=1)  # not a whole tail
    with pytest.raises(ValueError, match="BlockConvArgs.in takes 7 values, got 6"):
        _records.BLOCK_CONV_ARGS.tail(in_=side[:6], out=side, relu_out=0, zero_outside=0,
                                      paired=0, k_groups=1, step_taps_y=0, step_taps_x=0,
                                      step_channels=0, halo_chunk=0)


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="one a statement"):
        _records._parse("const int* a, b;", "Bad")
    with pytest.raises(ValueError, match="unknown type 'Side'"):
        _records._parse("Side s;", "Bad")
    with pytest.raises(ValueError, match="declared twice"):
        _records._parse("int a; double a;", "Bad")


# --- the launches that pass their values by position ----------------------------------------

INFO = _launch.DeviceInfo(sms=4, shared_per_block_optin=_launch.H100.shared_per_block_optin,
                          shared_per_sm=_launch.H100.shared_per_sm, compute_capability=(9, 0))


@pytest.fixture
def launches(monkeypatch):
    """Launches recorded as {field name: value}, on a device of INFO, without a GPU."""
    recorded = []

    def launch(kernel, stream, *values, grid=None, function=None):
        values += kernel.constants
        assert len(values) == len(kernel.record.names)
        recorded.append((kernel.function, dict(zip(kernel.record.names, values))))

    monkeypatch.setattr(plan.KernelPlan, "launch", launch)
    monkeypatch.setattr(_launch, "function",
                        lambda device, op, kernel, *args: f"{kernel}<{args}>")
    monkeypatch.setattr(_launch, "driver", cuda_emulation._Driver())
    monkeypatch.setattr(_launch, "device_info", lambda device: INFO)
    caches = (block_conv._plan, block_conv._halo_plan, block_conv._tile_channels,
              block_conv._pair_plan, reduce_mask._plan)
    for cache in caches:
        cache.cache_clear()
    yield recorded
    for cache in caches:
        cache.cache_clear()


def _named(record, values):
    return dict(zip(record.names, values))


class _At:
    """An array as the launches see it through _ADDRESSES: an address, a shape, a dtype."""

    def __init__(self, address, shape, dtype="float16"):
        self.address, self.shape, self.dtype = address, shape, dtype


class _Addresses(_backend.Backend):
    """A backend of _At arrays on device 0, stream 0; new arrays at 65536, 131072, ..."""

    name, gpu = "addresses", True

    def __init__(self):
        self.allocated = 0

    def device(self, a):
        return 0

    def pointer(self, a):
        return 0 if a is None else a.address

    def stream(self, device):
        return 0

    def dtype_name(self, a):
        return a.dtype

    def empty(self, shape, like, dtype=None):
        self.allocated += 1
        return _At(65536 * self.allocated, shape, dtype or like.dtype)


def test_block_sides_are_blockside_values():
    assert block_conv.image_side(30, 40, (-1, 2), (8, 9)) == _records.BLOCK_SIDE.values(
        height=30, width=40, off_h=-1, off_w=2, str_h=8, str_w=9, stack=0)
    assert block_conv.stack_side(10, 12) == _records.BLOCK_SIDE.values(
        height=10, width=12, off_h=0, off_w=0, str_h=0, str_w=0, stack=1)


@pytest.mark.parametrize("staging", ["streamed", "halo"])
def test_block_conv_passes_its_values_in_order(launches, monkeypatch, staging):
    monkeypatch.setattr(block_conv, "STAGING", staging)
    src_side = block_conv.image_side(30, 40, (-1, -1), (8, 8))
    dst_side = block_conv.stack_side(8, 8)
    block_conv.launch_block_conv(0, 0, "float32", 1024, 2048, 4096, 8192, 16384, 5, 2, 32, 48,
                                 (3, 3), (8, 8), src_side, dst_side, bias=256, scale=0, shift=0,
                                 relu_out=True, op="Assign")
    (kernel, got), = launches
    assert kernel.startswith("block_conv_halo" if staging == "halo" else "block_conv<")
    # The plan's fields as the launch chose them: each in its place, as the others show.
    plan = {k: got[k] for k in ("k_groups", "step_taps_y", "step_taps_x", "step_channels",
                                "halo_chunk")}
    want = _named(_records.BLOCK_CONV_ARGS, _records.BLOCK_CONV_ARGS.values(
        src=1024, dst=2048, weight=4096, bias=256, scale=0, shift=0, indices=8192,
        count=16384, rows=5, n_batch=2, cin=32, cout=48, kh=3, kw=3, out_h=8, out_w=8,
        in_=src_side, out=dst_side, relu_out=1, zero_outside=0, paired=1, **plan))
    assert got == want
    assert plan["k_groups"] >= 1
    if staging == "halo":
        assert plan["halo_chunk"] == 32 and plan["step_channels"] == 0
    else:
        # A stage is 32 of the 32 channels: k_groups stages step k_groups taps.
        assert plan["halo_chunk"] == 0 and plan["step_channels"] == 0
        assert (plan["step_taps_y"], plan["step_taps_x"]) == divmod(plan["k_groups"], 3)


def test_block_conv_pair_passes_its_values_in_order(launches, monkeypatch):
    monkeypatch.setattr(block_conv, "STAGING", "streamed")
    params = type("Params", (), dict(bsize=(10, 10), bsize_out=(8, 8), boffset=(-1, -1),
                                     bstrides=(8, 8)))()
    # scale, shift, w1, b1, w2, b2, w3
    weights = tuple(_At(address, shape) for address, shape in zip(
        (16, 32, 64, 128, 256, 512, 1024),
        ((64,), (64,), (32, 1, 1, 64), (32,), (32, 3, 3, 32), (32,), (64, 1, 1, 32))))
    block_conv.launch_res_unit(_Addresses(), _At(4096, (1, 32, 32, 64)),
                               _At(8192, (1, 32, 32, 64)), weights, _At(2048, (6, 3), "int32"),
                               _At(2064, (1,), "int32"), params)
    (_, first), (kernel, got) = launches
    assert kernel.startswith("block_conv_pair")
    # The first stack, the backend's first array; no second stack.
    conv = _records.BLOCK_CONV_ARGS.values(
        src=65536, dst=0, weight=256, bias=512, scale=0, shift=0, indices=2048,
        count=2064, rows=6, n_batch=1, cin=32, cout=32, kh=3, kw=3, out_h=8, out_w=8,
        in_=block_conv.stack_side(10, 10), out=block_conv.stack_side(8, 8), relu_out=1,
        zero_outside=0, paired=0, k_groups=got["conv.k_groups"],
        step_taps_y=got["conv.step_taps_y"], step_taps_x=got["conv.step_taps_x"],
        step_channels=got["conv.step_channels"], halo_chunk=0)
    want = _named(_records.BLOCK_CONV_PAIR_ARGS, _records.BLOCK_CONV_PAIR_ARGS.values(
        conv=conv, dst2=8192, weight2=1024, cout2=64,
        out2=block_conv.image_side(32, 32, (0, 0), (8, 8)), paired2=1))
    assert got == want
    assert first["in.height"] == 32 and first["scale"] == 16 and first["zero_outside"] == 1


def test_gather_and_scatter_pass_their_values_in_order(launches):
    record = _records.STACK_ARGS
    kernel = plan.KernelPlan(0, "sparse_gather", "f", (), (1, 1, 1), (32, 1, 1), 0, record,
                             record.tail(words_per_pixel=7, tile_rows=2, log2_tile_c=3,
                                         pitch=40))
    _blocks.launch(kernel, 0, 100, 200, 500, 600, 300, 400, 9, (2, 30, 40),
                   ((10, 12), (-1, -2), (8, 9)))
    (_, got), = launches
    assert got == _named(_records.STACK_ARGS, _records.STACK_ARGS.values(
        src=100, dst=200, scale=500, shift=600,
        list=_records.BLOCK_LIST.values(indices=300, count=400, rows=9, n_batch=2, height=30,
                                        width=40, bh=10, bw=12, off_h=-1, off_w=-2, str_h=8,
                                        str_w=9),
        words_per_pixel=7, tile_rows=2, log2_tile_c=3, pitch=40))


def test_reduce_mask_passes_its_values_in_order(launches):
    reduce_mask.launch_reduce_mask(_Addresses(), _At(100, (2, 30, 40), "float32"), (4, 5),
                                   ((10, 12), (-1, -2), (8, 9)), 0.25, True,
                                   _At(300, (40, 3), "int32"), _At(400, (1,), "int32"), 40,
                                   _At(1000, (2,), "uint32"))
    (_, got), = launches
    assert got == _named(_records.REDUCE_MASK_ARGS, _records.REDUCE_MASK_ARGS.values(
        mask=100, words=1004, tickets=1000, indices=300, count=400, tol=0.25, n_batch=2,
        height=30, width=40, bh=10, bw=12, off_h=-1, off_w=-2, str_h=8, str_w=9, bcount_h=4,
        bcount_w=5, capacity=40, fill_rows=40))


def test_split_sum_passes_its_values_in_order(launches):
    plan.split_sum_plan(0, "submanifold", "float", 7, 5, 8, 3, relu=True).launch(0, 100, 200,
                                                                                 300)
    (_, got), = launches
    assert got == _named(_records.SPLIT_SUM_ARGS, _records.SPLIT_SUM_ARGS.values(
        partial=100, bias=200, out=300, rows=7, cols=5, pitch=8, splits=3, relu=1))
