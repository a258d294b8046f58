"""Moving KV between placements (docs/design.md §3): transfer_runs against a per-token mapping built with the
placement's own owner / local-index functions; reshard_kv and gather_kv on real gloo groups, checked slot for slot
against shard_kv of the unsharded cache, with NaN poison in every slot that must stay untouched; every refusal
raised alike on every rank before anything is written."""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import dcp_ops
from dcp_ops import Placement
from conftest import init_gloo, spawn_ranks

NAN = float("nan")
I32 = torch.int32


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _table(B: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A block table of distinct block ids in a random order."""
    return torch.randperm(B * cols, generator=gen).view(B, cols).int()


# ---------------------------------------------------------------------------------------------------------------
# transfer_runs
# ---------------------------------------------------------------------------------------------------------------

def _per_token_plan(src, dst, lens, start, src_table, dst_table):
    """{(seq, src_rank, src_block, src_offset): (dst_rank, dst_block, dst_offset, position)} of every moved token,
    one position at a time, from the placements' own owner and local_index."""
    want = {}
    for b, (n, s) in enumerate(zip(lens, start)):
        pos = torch.arange(n)
        (rs, js), (rd, jd) = [(side.owner_rank(pos).tolist(), side.local_index(pos).tolist()) for side in (src, dst)]
        for p in range(s, n):
            key = (b, rs[p], int(src_table[b, js[p] // src.block_size]), js[p] % src.block_size)
            want[key] = (rd[p], int(dst_table[b, jd[p] // dst.block_size]), jd[p] % dst.block_size, p)
    return want


def _check_plan(runs, src, dst, lens, start, src_table, dst_table):
    """Runs cover every moved token exactly once, each within one block on both sides, mapping it where the per-token
    plan does; rows in (seq, position) order; no two runs can be joined."""
    assert runs.dtype == torch.int64 and runs.dim() == 2 and runs.shape[1] == 8
    want = _per_token_plan(src, dst, lens, start, src_table, dst_table)
    got, ends, previous = {}, set(), None
    for seq, sr, sb, so, dr, db, do, n in runs.tolist():
        assert n >= 1 and so + n <= src.block_size and do + n <= dst.block_size
        for i in range(n):
            key = (seq, sr, sb, so + i)
            assert key not in got, f"token {key} in two runs"
            got[key] = (dr, db, do + i)
        order = (seq, want[(seq, sr, sb, so)][3])
        assert previous is None or order > previous, "rows out of (seq, position) order"
        previous = order
        ends.add((seq, sr, sb, so + n, dr, db, do + n))
    assert got == {k: v[:3] for k, v in want.items()}
    for seq, sr, sb, so, dr, db, do, n in runs.tolist():
        assert (seq, sr, sb, so, dr, db, do) not in ends, "two runs could be joined"


@st.composite
def _placements(draw):
    world = draw(st.integers(1, 8))
    block_size = draw(st.integers(1, 128))
    interleave = draw(st.sampled_from([d for d in range(1, block_size + 1) if block_size % d == 0]))
    return Placement(world, 0, block_size, interleave)


def _plan_case(src, dst, lens, starts, seed, extra_cols=1):
    gen = torch.Generator().manual_seed(seed)
    cols = lambda p: max(math.ceil(max(lens) / (p.world_size * p.block_size)), 1) + extra_cols  # noqa: E731
    src_table, dst_table = _table(len(lens), cols(src), gen), _table(len(lens), cols(dst), gen)
    runs = dcp_ops.transfer_runs(src, dst, torch.tensor(lens), src_table, dst_table,
                                 None if starts is None else torch.tensor(starts))
    _check_plan(runs, src, dst, lens, starts or [0] * len(lens), src_table, dst_table)
    return runs


@given(src=_placements(), dst=_placements(), lens=st.lists(st.integers(0, 5000), min_size=1, max_size=3),
       cuts=st.lists(st.floats(0, 1), min_size=3, max_size=3), seed=st.integers(0, 2 ** 31 - 1))
def test_transfer_runs_match_a_per_token_mapping(src, dst, lens, cuts, seed):
    starts = [int(n * c) for n, c in zip(lens, cuts)]
    _plan_case(src, dst, lens, starts, seed)


@pytest.mark.parametrize("src,dst", [
    ((3, 16, 1), (6, 16, 1)), ((6, 8, 8), (3, 32, 4)), ((1, 16, 1), (8, 16, 1)), ((8, 64, 1), (1, 16, 1)),
    ((8, 16, 1), (8, 64, 64)), ((4, 4, 2), (4, 4, 2)), ((5, 1, 1), (7, 3, 3)), ((2, 128, 128), (3, 96, 32))])
def test_transfer_runs_fixed_layouts(src, dst):
    """World sizes 3 and 6, plain TP (world 1) on either side, interleave 1 <-> block size, one layout to itself."""
    lens, starts = [0, 1, 777, 3000], [0, 1, 0, 1234]
    _plan_case(Placement(src[0], 0, *src[1:]), Placement(dst[0], 0, *dst[1:]), lens, starts, seed=sum(src + dst))
    _plan_case(Placement(src[0], 0, *src[1:]), Placement(dst[0], 0, *dst[1:]), lens, None, seed=7)


def test_transfer_runs_worked_example():
    """TP (world 1, block 4) to DCP 2 with interleave 2: positions 0-1 and 4-5 go to rank 0, 2-3 and 6-7 to rank 1."""
    runs = dcp_ops.transfer_runs(Placement(1, 0, 4), Placement(2, 0, 4, 2), torch.tensor([8]),
                                 torch.tensor([[10, 11]], dtype=I32), torch.tensor([[20]], dtype=I32))
    assert runs.tolist() == [[0, 0, 10, 0, 0, 20, 0, 2], [0, 0, 10, 2, 1, 20, 0, 2],
                             [0, 0, 11, 0, 0, 20, 2, 2], [0, 0, 11, 2, 1, 20, 2, 2]]
    # the same layout on both sides with one table: one run per block
    same = Placement(2, 0, 4, 2)
    table = torch.tensor([[3, 5]], dtype=I32)
    runs = dcp_ops.transfer_runs(same, same, torch.tensor([13]), table, table)
    assert runs.tolist() == [[0, 0, 3, 0, 0, 3, 0, 4], [0, 1, 3, 0, 1, 3, 0, 4], [0, 0, 5, 0, 0, 5, 0, 3],
                             [0, 1, 5, 0, 1, 5, 0, 2]]
    assert dcp_ops.transfer_runs(same, same, torch.tensor([0, 5]), table.repeat(2, 1), table.repeat(2, 1),
                                 torch.tensor([0, 5])).shape == (0, 8)


def test_transfer_runs_many_short_sequences_and_one_long():
    """A batch of 600 sequences of 8 tokens and one of 2000 under a 1536-token period: the plan holds the runs of
    the windows only (each short sequence's part of its period, token by token), against the per-token mapping."""
    lens = [8] * 600 + [2000]
    runs = _plan_case(Placement(6, 0, 64, 1), Placement(8, 0, 64, 1), lens, [i % 5 for i in range(len(lens))], 11)
    assert int(runs[:, 7].sum()) == sum(lens) - sum(i % 5 for i in range(len(lens)))


def test_transfer_runs_a_million_tokens():
    """A 1M-token sequence between two 8-rank layouts: whole blocks of 16 move (every token once); the plan is
    vectorised (bench/bench_reshard.py times it)."""
    n = 1 << 20
    src, dst = Placement(8, 0, 16, 16), Placement(8, 0, 64, 64)
    gen = torch.Generator().manual_seed(3)
    runs = dcp_ops.transfer_runs(src, dst, torch.tensor([n]), _table(1, n // 128, gen), _table(1, n // 512, gen),
                                 torch.tensor([1000]))
    assert int(runs[:, 7].sum()) == n - 1000 and int(runs[:, 7].max()) == 16
    assert runs.shape[0] == n // 16 - 62  # 1000 = 62 * 16 + 8: the run of 992..1007 keeps 8 tokens, the rest are whole


def test_transfer_runs_refusals():
    p2, p4 = Placement(2, 0, 8), Placement(4, 1, 8)
    lens = torch.tensor([100, 7])
    src_table, dst_table = torch.arange(14, dtype=I32).view(2, 7), torch.arange(8, dtype=I32).view(2, 4)
    with pytest.raises(ValueError, match=r"transfer_runs: dst_block_table has 3 columns, but sequence 0 \(seq_len "
                                         r"100\) needs 4 on the dst side \(world_size 4, block_size 8"):
        dcp_ops.transfer_runs(p2, p4, lens, src_table, dst_table[:, :3])
    with pytest.raises(TypeError, match="transfer_runs: src must be a dcp_ops.Placement, got tuple"):
        dcp_ops.transfer_runs((2, 0, 8), p4, lens, src_table, dst_table)
    with pytest.raises(ValueError, match=r"transfer_runs: start must be in \[0, end\] for every sequence, got "
                                         r"start\[1\] = 8 with end\[1\] = 7"):
        dcp_ops.transfer_runs(p2, p4, lens, src_table, dst_table, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="transfer_runs: seq_lens must be >= 0, got min -1"):
        dcp_ops.transfer_runs(p2, p4, torch.tensor([100, -1]), src_table, dst_table)
    with pytest.raises(ValueError, match=r"transfer_runs: src_block_table must be \[B = 2, max_blocks\]"):
        dcp_ops.transfer_runs(p2, p4, lens, src_table[:1], dst_table)
    bad = dst_table.clone()
    bad[0, 2] = -1
    with pytest.raises(ValueError, match="transfer_runs: dst_block_table row 0 holds block id -1 where moved tokens"):
        dcp_ops.transfer_runs(p2, p4, lens, src_table, bad)
    # the padding entry is fine when no moved token lives there (a window that starts past it)
    bad[0, 0] = -1
    bad[0, 2] = 2
    dcp_ops.transfer_runs(p2, p4, lens, src_table, bad, torch.tensor([32, 0]))


# ---------------------------------------------------------------------------------------------------------------
# reshard_kv and gather_kv on gloo groups
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One hand-off: each side's (world_size, block_size, interleave), the group ranks of each side's ranks, lengths,
    window starts, each cache's entry shape ([k, v] for GQA, [kv] for MLA) and dtype."""
    src: Tuple[int, int, int]
    dst: Tuple[int, int, int]
    src_ranks: Tuple[int, ...]
    dst_ranks: Tuple[int, ...]
    lens: Tuple[int, ...] = (45, 0, 130, 9)
    start: Optional[Tuple[int, ...]] = None
    entries: Tuple[Tuple[int, ...], ...] = ((2, 8), (2, 8))
    dtype: str = "float32"
    seed: int = 0


def _unsharded(tokens, table, block_size, dtype, start):
    """The paged cache an unsharded engine holds: token p of sequence b at table[b, p // bs], offset p % bs, for
    start[b] <= p; NaN everywhere else."""
    cache = torch.full((table.numel(), block_size, *tokens[0].shape[1:]), NAN, dtype=dtype)
    for b, x in enumerate(tokens):
        pos = torch.arange(start[b], len(x))
        cache[table[b, pos // block_size].long(), pos % block_size] = x[pos]
    return cache


def _side(case: Case, layout, tokens_per_cache, start, gen):
    """One side's placement, table and each rank's shards ([rank][cache]) of the window's tokens."""
    world, bs, interleave = layout
    table = _table(len(case.lens), math.ceil(max(case.lens) / bs) + 1, gen)  # wide enough to hold them unsharded
    lens = torch.tensor(case.lens)
    shards = [dcp_ops.shard_kv(_unsharded(tokens, table, bs, getattr(torch, case.dtype), start), table, lens, world,
                               interleave, fill=NAN) for tokens in tokens_per_cache]
    return Placement(world, 0, bs, interleave), table, [list(s) for s in zip(*shards)]


def _tokens(case: Case):
    """Every cache's tokens of every sequence, alike on every rank, and the generator that goes on to the tables."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    return [[(torch.randn(n, *entry, generator=gen) * 4).to(dtype) for n in case.lens] for entry in case.entries], gen


def _build(case: Case):
    """What every rank builds alike: (src placement, table, shards), (dst placement, table, expected shards)."""
    tokens, gen = _tokens(case)
    start = case.start or (0,) * len(case.lens)
    return _side(case, case.src, tokens, (0,) * len(case.lens), gen), _side(case, case.dst, tokens, start, gen)


def _run_case(rank: int, case: Case, built=None, src_caches=None):
    """Runs one hand-off on this rank and checks it: each destination cache is, byte for byte, the shard of the
    window's tokens (NaN poison kept everywhere else); source caches are unchanged. Returns this rank's dst caches.
    built: _build's sides (default: _build(case)); src_caches: this rank's (default: a copy of its built shards)."""
    (src, src_table, src_shards), (dst, dst_table, want) = built or _build(case)
    runs = dcp_ops.transfer_runs(src, dst, torch.tensor(case.lens), src_table, dst_table,
                                 None if case.start is None else torch.tensor(case.start))
    if rank in case.src_ranks and src_caches is None:
        src_caches = [s.clone() for s in src_shards[case.src_ranks.index(rank)]]
    before = [s.clone() for s in src_caches or []]
    dst_caches = None
    if rank in case.dst_ranks:
        dst_caches = [torch.full_like(w, NAN) for w in want[case.dst_ranks.index(rank)]]
    dcp_ops.reshard_kv(src_caches, dst_caches, runs, None, src_ranks=list(case.src_ranks),
                       dst_ranks=list(case.dst_ranks))
    for got, was in zip(src_caches or [], before):
        assert torch.equal(_bytes(got), _bytes(was)), f"rank {rank}: a source cache was written"
    for c, got in enumerate(dst_caches or []):
        assert torch.equal(_bytes(got), _bytes(want[case.dst_ranks.index(rank)][c])), f"rank {rank} cache {c}: {case}"
    return dst_caches


def _six_ranks_worker(rank, world, init_file):
    """Disjoint sides (1 -> 2, 2 -> 4, 4 -> 2 in reverse rank order) with bystander ranks, and 3 -> 5 overlapping; GQA
    and MLA entries; fp32, bf16, fp16 and fp8; an interleave change 1 -> block size; windows with a start."""
    init_gloo(rank, world, init_file)
    _run_case(rank, Case((1, 8, 1), (2, 4, 1), (5,), (0, 3), entries=((24,),)))
    _run_case(rank, Case((2, 16, 1), (4, 8, 8), (0, 1), (2, 3, 4, 5), dtype="bfloat16", seed=1))
    _run_case(rank, Case((4, 8, 2), (2, 16, 1), (2, 3, 4, 5), (1, 0), start=(40, 0, 77, 9), entries=((40,),),
                         dtype="float8_e4m3fn", seed=2))
    _run_case(rank, Case((3, 4, 4), (5, 8, 2), (4, 2, 0), (0, 1, 2, 3, 4), start=(3, 0, 64, 1), dtype="float16",
                         seed=3))
    dist.barrier()
    dist.destroy_process_group()


def _resize_worker(rank, world, init_file):
    """One group of 4 grows a DCP group 2 -> 4 (overlapping: ranks 0 and 1 on both sides), interleave 1 -> block size,
    then shrinks it 4 -> 2 back onto ranks 2 and 3, fp8 GQA; then a 4 -> 4 interleave change into the same tensors."""
    init_gloo(rank, world, init_file)
    grow = Case((2, 8, 1), (4, 8, 8), (0, 1), (0, 1, 2, 3), dtype="float8_e4m3fn", seed=4)
    built = _build(grow)
    grown = _run_case(rank, grow, built)
    tokens, gen = _tokens(grow)
    shrink = Case((4, 8, 8), (2, 4, 1), (0, 1, 2, 3), (2, 3), dtype="float8_e4m3fn", seed=4)
    back = _side(shrink, shrink.dst, tokens, (0,) * len(shrink.lens), gen)
    _run_case(rank, shrink, (built[1], back), src_caches=grown)
    # in place: each rank's source and destination caches are the same tensors (all reads come before any write)
    case = Case((4, 8, 1), (4, 8, 4), (0, 1, 2, 3), (0, 1, 2, 3), entries=((16,),), seed=5)
    (src, table, shards), (dst, _, _) = _build(case)
    lens = torch.tensor(case.lens)
    runs = dcp_ops.transfer_runs(src, dst, lens, table, table)
    caches = [s.clone() for s in shards[rank]]
    dcp_ops.reshard_kv(caches, caches, runs, None, src_ranks=[0, 1, 2, 3], dst_ranks=[0, 1, 2, 3])
    unsharded = dcp_ops.unshard_kv([s[0] for s in shards], table, lens, interleave=1, fill=NAN)
    want = dcp_ops.shard_kv(unsharded, table, lens, 4, interleave=4, fill=NAN)[rank]
    owned = ~want.isnan()
    assert owned.any() and torch.equal(caches[0][owned], want[owned])
    dist.barrier()
    dist.destroy_process_group()


def _expect_refusal(pattern: str, call, untouched):
    """`call` raises the same error on every rank, matching `pattern`, and writes none of `untouched`."""
    snapshot = [_bytes(t).clone() for t in untouched]
    with pytest.raises((ValueError, TypeError), match=pattern) as info:
        call()
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, f"{type(info.value).__name__}: {info.value}")
    assert len(set(messages)) == 1, messages
    for t, was in zip(untouched, snapshot):
        assert torch.equal(_bytes(t), was)


def _refusals_worker(rank, world, init_file):
    """Every refusal, raised alike on every rank of a group of 4 (src ranks 0, 1; dst ranks 2, 3), nothing written."""
    init_gloo(rank, world, init_file)
    case = Case((2, 8, 1), (2, 4, 2), (0, 1), (2, 3), entries=((16,),))
    (src, src_table, shards), (dst, dst_table, want) = _build(case)
    runs = dcp_ops.transfer_runs(src, dst, torch.tensor(case.lens), src_table, dst_table)
    src_caches = [s.clone() for s in shards[rank]] if rank < 2 else None
    dst_caches = [torch.full_like(w, NAN) for w in want[rank - 2]] if rank >= 2 else None
    held = (src_caches or []) + (dst_caches or [])

    def attempt(src_caches=src_caches, dst_caches=dst_caches, runs=runs, src_ranks=(0, 1), dst_ranks=(2, 3),
                **placements):
        return lambda: dcp_ops.reshard_kv(src_caches, dst_caches, runs, None, src_ranks=list(src_ranks),
                                          dst_ranks=list(dst_ranks), **placements)

    def on(ranks, value, otherwise):
        return value if rank in ranks else otherwise

    fp16 = [c.half() for c in dst_caches] if dst_caches else None
    wide = [torch.full((*c.shape[:2], 32), NAN) for c in dst_caches] if dst_caches else None
    two = dst_caches + dst_caches if dst_caches else None
    small = [c[:, :2] for c in dst_caches] if dst_caches else None
    outside = runs.clone()
    row, num_blocks = int(torch.nonzero(runs[:, 1] == 0)[1, 0]), shards[0][0].shape[0]
    outside[row, 2] = num_blocks
    cases = [
        (r"dst_caches\[0\] on group rank 2 has dtype torch.float16, but src_caches\[0\] on group rank 0 has "
         r"torch.float32", attempt(dst_caches=fp16)),
        (r"dst_caches\[0\] on group rank 2 has entry shape \[32\], but src_caches\[0\] on group rank 0 has \[16\]",
         attempt(dst_caches=wide)),
        ("dst_caches holds 2 caches on group rank 2, but src_caches holds 1", attempt(dst_caches=two)),
        (rf"runs row {row} .* points outside src_caches on group rank 0 \(num_blocks {num_blocks}, block_size 8\)",
         attempt(runs=outside)),
        (r"runs row \d+ has src_rank 1, but src_ranks lists 1 ranks \[0\]",
         attempt(src_ranks=(0,), src_caches=on([1], None, src_caches))),
        (r"src_ranks must list distinct group ranks, got \[0, 0\] \(raised on group rank 0\)",
         attempt(src_ranks=(0, 0))),
        (r"dst_ranks must hold group ranks in \[0, 4\), got \[2, 7\]", attempt(dst_ranks=(2, 7))),
        (r"the ranks of the group disagree on dst_ranks: group rank 0: \[2, 3\], group rank 1: \[2, 3\], "
         r"group rank 2: \[2, 3\], group rank 3: \[3, 2\]", attempt(dst_ranks=on([3], (3, 2), (2, 3)))),
        ("dst_caches is given on group rank 0, which dst_ranks", attempt(dst_caches=on([0], src_caches, dst_caches))),
        ("dst_caches is None on group rank 3, which dst_ranks .* lists as placement rank 1",
         attempt(dst_caches=on([3], None, dst_caches))),
        (r"reshard_kv: runs must be transfer_runs' int64 \[R, 8\] tensor, got torch.int32 .* \(raised on group "
         "rank 1\\)", attempt(runs=on([1], runs.int(), runs))),
        (r"the ranks of the group disagree on runs \(rows, checksum\)", attempt(runs=on([3], runs[:-1], runs))),
        ("dst_caches must share one block_size over dst_ranks", attempt(dst_caches=on([3], small, dst_caches))),
        ("src_caches must be None or a list of 1 to 4 cache tensors", attempt(src_caches=on([0], shards[0][0],
                                                                                           src_caches))),
        # the placements the plan was made for, when given: a plan for other blocks would write the wrong slots
        (r"dst_caches\[0\] has block_size 4, but dst has block_size 8 \(raised on group rank 2\)",
         attempt(src=src, dst=dcp_ops.Placement(2, 0, 8, 2))),
        ("src_ranks lists 2 group ranks, but src has world_size 3",
         attempt(src=dcp_ops.Placement(3, 0, 8, 1), dst=dst)),
    ]
    for pattern, call in cases:
        _expect_refusal(pattern, call, held)
    attempt(src=src, dst=dst)()  # and the group still works, the plan's own placements accepted
    for c, got in enumerate(dst_caches or []):
        assert torch.equal(_bytes(got), _bytes(want[rank - 2][c]))
    dist.barrier()
    dist.destroy_process_group()


def test_reshard_kv_disjoint_and_overlapping_sides():
    spawn_ranks(_six_ranks_worker, 6)


def test_reshard_kv_resizes_a_group_in_place():
    spawn_ranks(_resize_worker, 4)


def test_reshard_kv_refusals_on_every_rank():
    spawn_ranks(_refusals_worker, 4)


def _gather_case(rank, world, lens, entry, dtype, bs, interleave, start, end, seed):
    """gather_kv of one cache against the tokens themselves: [B, max(end - start), *entry], zeros past each window."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [(torch.randn(n, *entry, generator=gen) * 4).to(dtype) for n in lens]
    table = _table(len(lens), math.ceil(max(lens) / bs) + 1, gen)
    place = Placement(world, rank, bs, interleave)
    seq_lens = torch.tensor(lens)
    shard = place.shard_kv(_unsharded(tokens, table, bs, dtype, [0] * len(lens)), table, seq_lens, fill=NAN)
    got = dcp_ops.gather_kv(shard, table, seq_lens, place, None,
                            None if start is None else torch.tensor(start), None if end is None else torch.tensor(end))
    start, end = start or [0] * len(lens), end or lens
    want = torch.zeros(len(lens), max(e - s for s, e in zip(start, end)), *entry, dtype=dtype)
    for b, x in enumerate(tokens):
        want[b, :end[b] - start[b]] = x[start[b]:end[b]]
    assert got.dtype == dtype and torch.equal(_bytes(got), _bytes(want)), (rank, start, end)
    return shard, table, seq_lens, place


def _gather_worker(rank, world, init_file):
    """gather_kv on a group of 3 (interleave 2): MLA fp32 and fp8, GQA K and V (bf16), several windows; refusals."""
    init_gloo(rank, world, init_file)
    lens = [50, 0, 131, 7]
    for start, end in ((None, None), ([10, 0, 64, 7], None), ([0, 0, 3, 2], [17, 0, 100, 5]), ([5, 0, 9, 1],
                                                                                                [5, 0, 9, 1])):
        _gather_case(rank, world, lens, (24,), torch.float32, 8, 2, start, end, seed=1)
    _gather_case(rank, world, lens, (40,), torch.float8_e4m3fn, 4, 4, [1, 0, 30, 0], [49, 0, 131, 7], seed=2)
    for seed in (3, 4):  # GQA: K, then V
        _gather_case(rank, world, lens, (2, 8), torch.bfloat16, 16, 1, [0, 0, 100, 3], None, seed=seed)
    shard, table, seq_lens, place = _gather_case(rank, world, lens, (24,), torch.float32, 8, 2, None, None, seed=1)

    def attempt(cache=shard, placement=place, end=None):
        return lambda: dcp_ops.gather_kv(cache, table, seq_lens, placement, None, None, end)

    bad_end = torch.tensor([50, 0, 132, 7]) if rank == 1 else None
    cases = [
        (r"gather_kv: end must be in \[0, seq_lens\] for every sequence, got end\[2\] = 132 with seq_lens\[2\] = 131 "
         r"\(raised on group rank 1\)", attempt(end=bad_end)),
        (r"gather_kv: placement is for rank 1 of 3, but this is group rank 0 of 3",
         attempt(placement=Placement(3, 1, 8, 2) if rank == 0 else place)),
        ("gather_kv: the ranks of the group disagree on cache", attempt(cache=shard.half() if rank == 2 else shard)),
        ("gather_kv: the ranks of the group disagree on seq_lens, start, end",
         attempt(end=torch.tensor([50, 0, 130, 7]) if rank == 0 else None)),
    ]
    for pattern, call in cases:
        _expect_refusal(pattern, call, [shard])
    dist.barrier()
    dist.destroy_process_group()


def test_gather_kv_windows():
    spawn_ranks(_gather_worker, 3)
