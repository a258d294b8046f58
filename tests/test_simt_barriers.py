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
