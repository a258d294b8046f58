"""Named barriers, mbarriers and bulk copies as the SIMT executor emulates them (csrc/simt/barriers.h,
kernels/barriers.cuh), run through tests/simt's mbarrier_ring, cp_async_arrive and named_handoff kernels: a correct
kernel gets its data under every schedule, and each missing wait gets a wrong answer (or an error) under at least one,
as it may on a GPU."""
import pytest
import torch

pytestmark = pytest.mark.simt

SCHEDULES = ["forward", "reverse", "random:1", "random:7"]


@pytest.fixture(params=SCHEDULES)
def schedule(request, monkeypatch):
    monkeypatch.setenv("DCP_SIMT_SCHEDULE", request.param)
    return request.param


@pytest.mark.parametrize("tiles,stages,consumers", [(7, 2, 32), (9, 3, 64), (4, 4, 96), (1, 2, 32)])
def test_mbarrier_ring_delivers_every_tile(simt_ops, schedule, tiles, stages, consumers):
    x = torch.randn(tiles, 64)
    assert torch.equal(simt_ops.mbarrier_ring(x, stages, consumers), x)


def test_mbarrier_ring_without_the_full_wait_reads_before_the_copy(simt_ops, monkeypatch):
    """The consumers read a buffer without waiting for its copy: under `forward` the copies land only at a wait, so
    they read the poisoned shared memory. (With more tiles than buffers the producer then arrives on a full barrier
    whose phase has not completed: more arrivals than the phase expects, refused.)"""
    monkeypatch.setenv("DCP_SIMT_SCHEDULE", "forward")
    x = torch.randn(2, 64)
    assert torch.isnan(simt_ops.mbarrier_ring(x, 2, 32, misuse=1)).all()
    with pytest.raises(RuntimeError, match="1 arrival.s. with 0 pending"):
        simt_ops.mbarrier_ring(torch.randn(6, 64), 2, 32, misuse=1)


def test_mbarrier_ring_without_the_empty_wait_overwrites_a_buffer_in_use(simt_ops, monkeypatch):
    """The producer refills a buffer without waiting for the consumers to release it: under `reverse` the copies land
    at their issue, so the producer runs every tile through the buffers (each refill completes another phase of its
    full barrier) before a consumer reads one; the consumers find the phases they wait for two behind, which on a GPU
    reads a later tile or hangs, and here is a deadlock."""
    monkeypatch.setenv("DCP_SIMT_SCHEDULE", "reverse")
    with pytest.raises(RuntimeError, match="deadlock"):
        simt_ops.mbarrier_ring(torch.randn(6, 64), 2, 32, misuse=2)


def test_mbarrier_that_never_completes_is_a_deadlock(simt_ops, schedule):
    with pytest.raises(RuntimeError, match="deadlock.*named barriers or mbarriers"):
        simt_ops.mbarrier_ring(torch.randn(5, 64), 2, 32, misuse=3)


def test_mbarrier_used_before_its_init_is_refused(simt_ops):
    with pytest.raises(RuntimeError, match="never initialised"):
        simt_ops.mbarrier_ring(torch.randn(3, 64), 2, 32, misuse=4)


@pytest.mark.parametrize("reader", [0, 63])
def test_cp_async_arrive_lands_the_copies_at_the_barrier(simt_ops, schedule, reader):
    x = torch.randn(64 * 8)
    assert torch.equal(simt_ops.cp_async_arrive(x, reader, True), x)


def test_cp_async_arrive_read_without_a_wait_sees_poison(simt_ops, monkeypatch):
    monkeypatch.setenv("DCP_SIMT_SCHEDULE", "forward")
    x = torch.randn(64 * 8)
    out = simt_ops.cp_async_arrive(x, 0, False)
    assert torch.isnan(out).all()  # 0xff bytes: every copy still in flight


def test_named_barrier_hands_data_between_warps(simt_ops, schedule):
    x = torch.randn(64)
    assert torch.equal(simt_ops.named_handoff(x, 3, 64, 64, True), x)


def test_named_barrier_missing_sync_reads_before_the_write(simt_ops, monkeypatch):
    """Without the bar.sync the reading warp runs first under one of the two schedules and copies stale values."""
    x = torch.randn(64)
    outs = []
    for schedule in ("forward", "reverse"):
        monkeypatch.setenv("DCP_SIMT_SCHEDULE", schedule)
        outs.append(simt_ops.named_handoff(x, 3, 64, 64, False))
    assert any(not torch.equal(o, x) for o in outs)


@pytest.mark.parametrize("id_,count,sync_count,match", [
    (0, 64, 64, "id must be 1 to 15"), (15, 64, 64, "id must be 1 to 15"), (2, 48, 48, "multiple of 32"),
    (2, 96, 96, "at most the block"), (2, 64, 32, "different counts")])
def test_named_barrier_refuses_what_the_gpu_cannot_do(simt_ops, id_, count, sync_count, match):
    with pytest.raises(RuntimeError, match=match):
        simt_ops.named_handoff(torch.randn(64), id_, count, sync_count, True)


# ---- tensor-map copies (TMA) ------------------------------------------------------------------------------------

def swizzled(addr, width):
    """The ISA's swizzle of a shared address: 16-byte granule i of a 128-byte line is stored at granule i XOR (the
    line number modulo width / 16) (as tests/test_simt_wgmma.py reads it for wgmma)."""
    return addr if width == 0 else addr ^ ((addr // 128) % (width // 16)) << 4


def expected_box(src, elem_bytes, dims, strides, box, swizzle, coords, dst, smem_bytes):
    """Shared memory after the copy, from cuTensorMapEncodeTiled's and the ISA's definitions: the box's elements in
    order (dimension 0 innermost), element i of the box at byte dst + i * elem_bytes before the swizzle, zeros where a
    coordinate leaves the tensor; the rest of shared memory keeps the 0xff poison (bytes 0 .. 7: the mbarrier)."""
    out = torch.full((smem_bytes,), 0xFF, dtype=torch.uint8)
    byte_strides = [elem_bytes] + list(strides)
    flat = src.tolist()
    count = 1
    for b in box:
        count *= b
    for i in range(count):
        rest, offset, inside = i, 0, True
        for d in range(len(dims)):
            c = coords[d] + rest % box[d]
            rest //= box[d]
            inside &= 0 <= c < dims[d]
            offset += c * byte_strides[d]
        at = swizzled(dst + i * elem_bytes, swizzle)
        for e in range(elem_bytes):
            out[at + e] = flat[offset + e] if inside else 0
    return out


def run_box(simt_ops, elem_bytes, dims, strides, box, swizzle, coords, dst=1024, wait=True):
    size = strides[-1] * dims[-1] if strides else dims[0] * elem_bytes
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)  # 0xff never: poison is told apart
    box_bytes = elem_bytes
    for b in box:
        box_bytes *= b
    smem = dst + box_bytes + 256
    got = simt_ops.tma_box(src, elem_bytes, dims, strides, box, swizzle, coords, dst, smem, wait)
    return got, expected_box(src, elem_bytes, dims, strides, box, swizzle, coords, dst, smem)


BOXES = [  # elem_bytes, dims, byte strides of dims 1.., box, swizzle, coords
    (2, [576, 64, 5], [1152, 1152 * 64], [64, 64, 1], 128, [64, 0, 3]),      # a paged MLA cache's column block
    (2, [576, 16, 9], [1280, 1280 * 16], [64, 16, 1], 128, [512, 0, 8]),     # block size 16, padded token stride
    (2, [576, 64, 5], [1152, 1152 * 64], [64, 64, 1], 128, [0, 32, 4]),      # past the block's end: zeros
    (2, [576, 64, 5], [1152, 1152 * 64], [64, 64, 1], 128, [544, -8, 0]),    # left of dim 1, right of dim 0
    (1, [576, 64, 3], [576, 576 * 64], [128, 64, 1], 128, [128, 0, 1]),      # an fp8 cache
    (2, [256, 40], [512], [32, 40], 64, [32, 0]),                            # 64-byte swizzle
    (2, [256, 40], [512], [16, 24], 32, [240, 30]),                          # 32-byte swizzle, both ends out
    (4, [100, 7], [400], [12, 7], 0, [90, 2]),                               # no swizzle, 48-byte rows
    (2, [64, 3, 4, 5, 6], [128, 384, 1536, 7680], [8, 2, 2, 2, 2], 0, [8, 1, 3, 4, 5]),  # rank 5
    (8, [40], [], [6], 0, [37]),                                             # rank 1
]


@pytest.mark.parametrize("case", range(len(BOXES)))
def test_tma_box_lands_as_the_isa_defines(simt_ops, schedule, case):
    got, want = run_box(simt_ops, *BOXES[case])
    assert torch.equal(got[8:], want[8:])  # bytes 0 .. 7 hold the mbarrier


def test_tma_box_destination_off_a_1024_boundary_swizzles_by_address(simt_ops):
    """The swizzle follows the shared address, not the offset from the destination: a box at 1024 + 384 is not the
    box at 1024 moved by 384."""
    torch.manual_seed(3)
    got, want = run_box(simt_ops, *BOXES[0], dst=1024 + 384)
    assert torch.equal(got[8:], want[8:])
    torch.manual_seed(3)  # the same source bytes
    moved = torch.roll(run_box(simt_ops, *BOXES[0], dst=1024)[0], 384)
    assert not torch.equal(got[1408:1408 + 8192], moved[1408:1408 + 8192])


def test_tma_box_read_without_a_wait_sees_poison(simt_ops, monkeypatch):
    monkeypatch.setenv("DCP_SIMT_SCHEDULE", "forward")
    got, want = run_box(simt_ops, *BOXES[0], wait=False)
    assert (got[1024:1024 + 64 * 64 * 2] == 0xFF).all() and not torch.equal(got[8:], want[8:])


@pytest.mark.parametrize("args,match", [
    ((2, [576, 64], [1100], [64, 64], 128, [0, 0]), "multiple of 16"),
    ((2, [576, 64], [1152], [72, 64], 128, [0, 0]), "exceeds the swizzle span"),
    ((2, [576, 64], [1152], [32, 64], 128, [0, 0]), "narrower than the swizzle span"),
    ((2, [576, 64], [1152], [4, 64], 0, [0, 0]), "inner dimension must be a multiple of 16 bytes"),
    ((2, [576, 64], [1152], [64, 300], 128, [0, 0]), "box dimension 1 must be 1 to 256"),
    ((3, [576, 64], [1152], [64, 64], 128, [0, 0]), "element size"),
])
def test_tma_map_refuses_what_cuTensorMapEncodeTiled_refuses(simt_ops, args, match):
    with pytest.raises(RuntimeError, match=match):
        run_box(simt_ops, *args)


def test_tma_box_destination_must_be_128_byte_aligned(simt_ops):
    with pytest.raises(RuntimeError, match="128-byte aligned"):
        run_box(simt_ops, *BOXES[0], dst=1024 + 64)
