"""Moving KV between placements (docs/design.md §3): a prefill group handing requests to a decode group, a DCP group
that grows or shrinks, an interleave or block-size change, and the context gather of a chunked-prefill step.

transfer_runs plans on the host: int64 [R, 8] rows (seq, src_rank, src_block, src_offset, dst_rank, dst_block,
dst_offset, length), each a run of tokens contiguous in both its source and its destination block, maximal, every
token of the window in exactly one run, rows ordered by (seq, position). Owners and local indices repeat with period
Q = lcm(N_src * block_size_src, N_dst * block_size_dst) positions, and no run crosses a multiple of Q (both sides
start a block there), so the runs of one period are found once, token by token, then tiled over each sequence's
whole periods; the periods that hold a window's start or end go token by token over their part of the window. The
work is the runs' count plus at most two periods' tokens a sequence, never more than its window's.

reshard_kv executes a plan over a process group and gather_kv all-gathers a window of every sequence. Both first
all-gather a small metadata tensor holding each rank's local verdict and what it holds, so that every refusal is
raised on every rank, with the same message, before anything moves. Caches move as bytes (fp8 included).
"""
import math
import numbers
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .distributed import _DTYPES, _all_gather
from .layout import Placement, _check_int, _local_index, _local_len, _owner, _ragged_arange

Tensor = torch.Tensor
I64 = torch.int64
RUN_FIELDS = ("seq", "src_rank", "src_block", "src_offset", "dst_rank", "dst_block", "dst_offset", "length")
SEQ, SRC_RANK, SRC_BLOCK, SRC_OFFSET, DST_RANK, DST_BLOCK, DST_OFFSET, LENGTH = range(8)

_MAX_CACHES, _MAX_ENTRY_DIMS, _MAX_MESSAGE = 4, 6, 480


# ----------------------------------------------------------------------------------------------------------------
# transfer_runs: the plan
# ----------------------------------------------------------------------------------------------------------------

def _token_runs(src: Placement, dst: Placement, lo: Tensor, hi: Tensor) -> Tuple[Tensor, Tensor]:
    """The maximal runs of the windows [lo, hi) ([E] each, each within one period), token by token: a token starts a
    run unless it follows its source-local predecessor (of its window and source rank) in the same source block and
    lands right after it in the same destination block. Returns (rows [R, 8] as transfer_runs' with the window's
    index in place of seq and the block-table column in place of each block id, ordered by (window, position)), and
    the first position of each row)."""
    counts = (hi - lo).clamp(min=0)
    e, step = _ragged_arange(counts)
    pos = lo[e] + step
    span = int(counts.max()) if counts.numel() else 1
    order = torch.argsort((e * src.world_size + _owner(pos, src.world_size, src.interleave)) * span + pos - lo[e])
    e, pos = e[order], pos[order]  # by window, then source rank, then position: local indices consecutive
    rs, js = _owner(pos, src.world_size, src.interleave), _local_index(pos, src.world_size, src.interleave)
    rd, jd = _owner(pos, dst.world_size, dst.interleave), _local_index(pos, dst.world_size, dst.interleave)
    new = torch.ones(pos.numel(), dtype=torch.bool)
    new[1:] = ((e[1:] != e[:-1]) | (rs[1:] != rs[:-1]) | (js[1:] % src.block_size == 0) | (rd[1:] != rd[:-1])
               | (jd[1:] != jd[:-1] + 1) | (jd[1:] % dst.block_size == 0))
    first = torch.nonzero(new).flatten()
    length = torch.diff(first, append=torch.tensor([pos.numel()]))
    by_position = torch.argsort(e[first] * span + pos[first] - lo[e[first]])
    first, length = first[by_position], length[by_position]
    e, rs, js, rd, jd = e[first], rs[first], js[first], rd[first], jd[first]
    rows = torch.stack([e, rs, js // src.block_size, js % src.block_size, rd, jd // dst.block_size,
                        jd % dst.block_size, length], 1)
    return rows, pos[first]


def _plan_rows(period: int, src: Placement, dst: Placement, lens: Tensor, start: Tensor, src_table: Tensor,
               dst_table: Tensor) -> Tensor:
    """Every run of every window, ordered by (seq, position). A window is cut into the periods it touches; the runs of
    a whole period are one period's runs, found once and tiled (the work is the runs' count, not the tokens'); the
    periods that hold a window's start or end run token by token over their part of the window only."""
    t0, t1 = start // period, (lens + period - 1) // period
    count = torch.where(lens > start, t1 - t0, 0)
    seq, step = _ragged_arange(count)
    t = t0[seq] + step
    edge = (t == t0[seq]) | (t == t1[seq] - 1)
    inner, cut = torch.nonzero(~edge).flatten(), torch.nonzero(edge).flatten()
    per = _token_runs(src, dst, torch.zeros(1, dtype=I64), torch.full((1,), period, dtype=I64))[0] if inner.numel() \
        else torch.empty(0, 8, dtype=I64)
    s, tt = seq[cut], t[cut]
    rows = _token_runs(src, dst, torch.maximum(start[s], tt * period), torch.minimum(lens[s], (tt + 1) * period))[0]
    window = rows[:, SEQ].clone()
    # each (seq, period) block's rows go to one range of the output, blocks in (seq, period) order
    size = torch.full((len(seq),), len(per), dtype=I64)
    size[cut] = torch.bincount(window, minlength=len(cut))
    offset = torch.cumsum(size, 0) - size
    out = torch.empty(int(size.sum()), 8, dtype=I64)
    if inner.numel():
        grid = per.expand(len(inner), *per.shape).clone()
        grid[:, :, SEQ] = seq[inner, None]
        for col, table, side in ((SRC_BLOCK, src_table, src), (DST_BLOCK, dst_table, dst)):
            per_period = period // (side.world_size * side.block_size)  # block-table columns a period spans
            grid[:, :, col] = table[seq[inner, None], t[inner, None] * per_period + per[None, :, col]]
        out[(offset[inner, None] + torch.arange(len(per))).flatten()] = grid.view(-1, 8)
    rows[:, SEQ] = s[window]
    for col, table in ((SRC_BLOCK, src_table), (DST_BLOCK, dst_table)):
        rows[:, col] = table[rows[:, SEQ], rows[:, col]]
    first_of_window = torch.cumsum(size[cut], 0) - size[cut]
    out[offset[cut][window] + torch.arange(len(rows)) - first_of_window[window]] = rows
    return out


def _check_block_ids(fn: str, runs: Tensor) -> None:
    for name, col in (("src_block_table", SRC_BLOCK), ("dst_block_table", DST_BLOCK)):
        bad = runs[:, col] < 0
        if bad.any():
            i = int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"{fn}: {name} row {int(runs[i, SEQ])} holds block id {int(runs[i, col])} where moved "
                             f"tokens live (run {runs[i].tolist()}); block ids in use must be >= 0")


def _window(fn: str, seq_lens: Tensor, start: Optional[Tensor], end: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(start, end) int64 on the CPU, checked: 0 <= start <= end <= seq_lens; defaults 0 and seq_lens."""
    _check_int(seq_lens, fn, "seq_lens")
    if seq_lens.dim() != 1:
        raise ValueError(f"{fn}: seq_lens must be 1-D [B], got shape {tuple(seq_lens.shape)}")
    lens = seq_lens.detach().cpu().long()
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"{fn}: seq_lens must be >= 0, got min {int(lens.min())}")
    bounds = {}
    for name, t, default, ceiling in (("end", end, lens, lens), ("start", start, torch.zeros_like(lens), None)):
        if t is None:
            bounds[name] = default
            continue
        _check_int(t, fn, name)
        if t.shape != lens.shape:
            raise ValueError(f"{fn}: {name} must be [B] = {tuple(lens.shape)} as seq_lens, got {tuple(t.shape)}")
        v = t.detach().cpu().long()
        top = bounds["end"] if ceiling is None else ceiling
        bad = (v < 0) | (v > top)
        if bad.any():
            b = int(torch.nonzero(bad)[0, 0])
            upper = "end" if ceiling is None else "seq_lens"
            raise ValueError(f"{fn}: {name} must be in [0, {upper}] for every sequence, got {name}[{b}] = {int(v[b])} "
                             f"with {upper}[{b}] = {int(top[b])}")
        bounds[name] = v
    return bounds["start"], bounds["end"]


def _check_table(fn: str, name: str, table: Tensor, lens: Tensor, start: Tensor, side: Placement, who: str) -> Tensor:
    """The table as int64 on the CPU, wide enough for every moved token (rank 0 holds the most)."""
    _check_int(table, fn, name)
    if table.dim() != 2 or table.shape[0] != lens.shape[0]:
        raise ValueError(f"{fn}: {name} must be [B = {lens.shape[0]}, max_blocks], got shape {tuple(table.shape)}")
    need = (_local_len(lens, side.world_size, 0, side.interleave).long() + side.block_size - 1) // side.block_size
    need = torch.where(lens > start, need, 0)
    if need.numel() and int(need.max()) > table.shape[1]:
        b = int(torch.argmax(need))
        raise ValueError(f"{fn}: {name} has {table.shape[1]} columns, but sequence {b} (seq_len {int(lens[b])}) needs "
                         f"{int(need[b])} on the {who} side (world_size {side.world_size}, block_size "
                         f"{side.block_size}, interleave {side.interleave})")
    return table.detach().cpu().long()


def transfer_runs(src: Placement, dst: Placement, seq_lens: Tensor, src_block_table: Tensor,
                  dst_block_table: Tensor, start: Optional[Tensor] = None) -> Tensor:
    """The plan that moves KV from placement `src` to placement `dst` (host-side, vectorised).

    src, dst: Placements of the two sides; only their world_size, block_size and interleave are used. seq_lens [B]:
    global lengths; src_block_table, dst_block_table [B, max_blocks] int: each side's table (the same on all its
    ranks); start [B] (optional): only positions start <= p < seq_len move. Returns int64 [R, 8] rows (seq, src_rank,
    src_block, src_offset, dst_rank, dst_block, dst_offset, length) on the CPU: `length` tokens at consecutive slots
    of one source block and of one destination block; runs are maximal, every moved token is in exactly one, and
    rows are ordered by (seq, position of the first token). A table too narrow for its side is refused by name.
    """
    fn = "transfer_runs"
    for name, p in (("src", src), ("dst", dst)):
        if not isinstance(p, Placement):
            raise TypeError(f"{fn}: {name} must be a dcp_ops.Placement, got {type(p).__name__}")
    first, lens = _window(fn, seq_lens, start, None)
    src_table = _check_table(fn, "src_block_table", src_block_table, lens, first, src, "src")
    dst_table = _check_table(fn, "dst_block_table", dst_block_table, lens, first, dst, "dst")
    moved = lens > first
    if not bool(moved.any()):
        return torch.empty(0, 8, dtype=I64)
    period = math.lcm(src.world_size * src.block_size, dst.world_size * dst.block_size)
    runs = _plan_rows(period, src, dst, lens, first, src_table, dst_table)
    _check_block_ids(fn, runs)
    return runs


# ----------------------------------------------------------------------------------------------------------------
# Refusals that every rank raises alike
# ----------------------------------------------------------------------------------------------------------------

def _comm_device(group) -> torch.device:
    backend = str(dist.get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def _membership(fn: str, group) -> Tuple[int, int]:
    if not dist.is_initialized():
        raise ValueError(f"{fn}: torch.distributed is not initialized")
    me = dist.get_rank(group)
    if me < 0:
        raise ValueError(f"{fn}: this process is not a member of group")
    return me, dist.get_world_size(group)


def _local_verdict(check: Callable[[], None]) -> Optional[Tuple[int, str]]:
    """(2 for TypeError / 1 for anything else, message) of what `check` raises on this rank, or None. Any exception
    is caught: a rank that raised on its own would leave the others waiting in the collective that follows."""
    try:
        check()
    except TypeError as e:
        return 2, str(e)
    except Exception as e:  # noqa: BLE001 (reported to every rank as a ValueError, with its type)
        return 1, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return None


def _agree(fn: str, group, verdict: Optional[Tuple[int, str]], fields: List[int]) -> List[List[int]]:
    """All-gathers every rank's local verdict and fields (a fixed number of ints); raises the lowest failing rank's
    error on every rank, else returns each rank's fields, in group-rank order."""
    kind, message = verdict or (0, "")
    raw = message.encode()
    text = list(raw if len(raw) <= _MAX_MESSAGE else raw[:_MAX_MESSAGE - 3] + "...".encode())
    mine = torch.tensor([kind, len(text)] + text + [0] * (_MAX_MESSAGE - len(text)) + list(fields), dtype=I64)
    device = _comm_device(group)
    every = torch.empty((dist.get_world_size(group), mine.numel()), dtype=I64, device=device)
    _all_gather(every, mine.to(device), group)
    rows = every.cpu().tolist()
    for g, row in enumerate(rows):
        if row[0]:
            shown = bytes(row[2:2 + row[1]]).decode(errors="ignore")
            raise (TypeError if row[0] == 2 else ValueError)(f"{shown} (raised on group rank {g})")
    return [row[2 + _MAX_MESSAGE:] for row in rows]


def _check_agreement(fn: str, name: str, values: Sequence) -> None:
    if len({repr(v) for v in values}) > 1:
        raise ValueError(f"{fn}: the ranks of the group disagree on {name}: "
                         + ", ".join(f"group rank {g}: {v}" for g, v in enumerate(values)))


def _checksum(t: Tensor) -> int:
    """A position-weighted checksum (mod a prime, no overflow): tells whether the ranks hold the same values."""
    p = 2 ** 31 - 1
    flat = t.detach().cpu().long().flatten()
    weights = torch.arange(1, flat.numel() + 1, dtype=I64) % p
    return int(((torch.remainder(flat, p) * weights) % p).sum() % p) if flat.numel() else 0


def _check_caches(fn: str, name: str, caches, single: bool = False) -> None:
    """A list of 1.._MAX_CACHES caches [num_blocks, block_size, *entry] that share num_blocks, block_size and
    device, with a contiguous last dim (so they view as bytes). single: one cache, named `name` alone."""
    if not isinstance(caches, (list, tuple)) or not 1 <= len(caches) <= _MAX_CACHES:
        got = type(caches).__name__ + (f" of {len(caches)}" if isinstance(caches, (list, tuple)) else "")
        raise TypeError(f"{fn}: {name} must be None or a list of 1 to {_MAX_CACHES} cache tensors, got {got}")
    for c, cache in enumerate(caches):
        label = name if single else f"{name}[{c}]"
        if not isinstance(cache, Tensor):
            raise TypeError(f"{fn}: {label} must be a tensor, got {type(cache).__name__}")
        if not 3 <= cache.dim() <= 2 + _MAX_ENTRY_DIMS:
            raise ValueError(f"{fn}: {label} must be [num_blocks, block_size, *entry] with 1 to {_MAX_ENTRY_DIMS} "
                             f"entry dims, got shape {tuple(cache.shape)}")
        if cache.dtype not in _DTYPES:
            raise ValueError(f"{fn}: {label} has dtype {cache.dtype}, not one of {_DTYPES}")
        if cache.element_size() > 1 and cache.stride(-1) != 1:
            raise ValueError(f"{fn}: {label} must have a contiguous last dim (it moves as bytes), got strides "
                             f"{cache.stride()}")
        if cache.shape[:2] != caches[0].shape[:2] or cache.device != caches[0].device:
            raise ValueError(f"{fn}: {label} is [{cache.shape[0]}, {cache.shape[1]}, ...] on {cache.device}, but "
                             f"{name}[0] is [{caches[0].shape[0]}, {caches[0].shape[1]}, ...] on {caches[0].device}")


@dataclass
class _Holding:
    """What one rank holds on one side, as its metadata says."""
    present: bool
    num_blocks: int
    block_size: int
    caches: List[Tuple[int, Tuple[int, ...]]]  # (dtype code, entry shape) of each cache


_SIDE_LEN = 3 + _MAX_CACHES * (2 + _MAX_ENTRY_DIMS)


def _holding_fields(caches) -> List[int]:
    out = [0] * _SIDE_LEN
    if caches is None:
        return out
    out[:3] = [len(caches), caches[0].shape[0], caches[0].shape[1]]
    for c, cache in enumerate(caches):
        entry = list(cache.shape[2:])
        base = 3 + c * (2 + _MAX_ENTRY_DIMS)
        out[base:base + 2 + len(entry)] = [_DTYPES.index(cache.dtype), len(entry)] + entry
    return out


def _parse_holding(v: List[int]) -> _Holding:
    caches = []
    for c in range(v[0]):
        base = 3 + c * (2 + _MAX_ENTRY_DIMS)
        caches.append((v[base], tuple(v[base + 2:base + 2 + v[base + 1]])))
    return _Holding(v[0] > 0, v[1], v[2], caches)


def _entry_bytes(holding: _Holding) -> List[int]:
    """Bytes of one token's entry in each cache."""
    size = [torch.empty((), dtype=_DTYPES[code]).element_size() for code, _ in holding.caches]
    return [s * math.prod(entry) for s, (_, entry) in zip(size, holding.caches)]


def _check_cache_agreement(fn: str, holders: List[Tuple[str, int, _Holding]]) -> None:
    """Every held cache list has the same count, and cache c the same dtype and entry shape everywhere."""
    name0, g0, h0 = holders[0]
    for name, g, h in holders[1:]:
        if len(h.caches) != len(h0.caches):
            raise ValueError(f"{fn}: {name} holds {len(h.caches)} caches on group rank {g}, but {name0} holds "
                             f"{len(h0.caches)} on group rank {g0}")
        for c, ((code, entry), (code0, entry0)) in enumerate(zip(h.caches, h0.caches)):
            if code != code0:
                raise ValueError(f"{fn}: {name}[{c}] on group rank {g} has dtype {_DTYPES[code]}, but {name0}[{c}] "
                                 f"on group rank {g0} has {_DTYPES[code0]}")
            if entry != entry0:
                raise ValueError(f"{fn}: {name}[{c}] on group rank {g} has entry shape {list(entry)}, but "
                                 f"{name0}[{c}] on group rank {g0} has {list(entry0)}")


# ----------------------------------------------------------------------------------------------------------------
# reshard_kv: executing a plan over a group
# ----------------------------------------------------------------------------------------------------------------

def _check_rank_list(fn: str, name: str, ranks, world: int) -> None:
    if not isinstance(ranks, (list, tuple)) or not all(
            isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in ranks):
        raise TypeError(f"{fn}: {name} must be a list of group ranks (ints), got {ranks!r}")
    if not 1 <= len(ranks) <= world:
        raise ValueError(f"{fn}: {name} must list 1 to {world} group ranks (the group's size), got {len(ranks)}")
    if not all(0 <= r < world for r in ranks):
        raise ValueError(f"{fn}: {name} must hold group ranks in [0, {world}), got {list(ranks)}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{fn}: {name} must list distinct group ranks, got {list(ranks)}")


def _check_runs_tensor(fn: str, runs) -> None:
    if not isinstance(runs, Tensor) or runs.dtype != I64 or runs.dim() != 2 or runs.shape[1] != 8:
        got = f"{runs.dtype} {tuple(runs.shape)}" if isinstance(runs, Tensor) else type(runs).__name__
        raise ValueError(f"{fn}: runs must be transfer_runs' int64 [R, 8] tensor, got {got}")


def _reshard_fields(src_caches, dst_caches, runs, src_ranks, dst_ranks, world: int, ok: bool) -> List[int]:
    """[len(src_ranks), src_ranks padded to world, the same for dst_ranks, runs' rows and checksum, src holding,
    dst holding]: a fixed number of ints (zeros where this rank's verdict failed)."""
    if not ok:
        return [0] * (2 * (1 + world) + 2 + 2 * _SIDE_LEN)
    lists = []
    for ranks in (src_ranks, dst_ranks):
        lists += [len(ranks)] + [int(r) for r in ranks] + [-1] * (world - len(ranks))
    return lists + [runs.shape[0], _checksum(runs)] + _holding_fields(src_caches) + _holding_fields(dst_caches)


@dataclass
class _Plan:
    src_ranks: List[int]
    dst_ranks: List[int]
    src: List[_Holding]  # per group rank
    dst: List[_Holding]


def _parse_plan(fn: str, every: List[List[int]], world: int) -> _Plan:
    """Each rank's rank lists and runs must agree; returns them and each rank's holdings."""
    lists = []
    for side in range(2):
        at = side * (1 + world)
        values = [row[at + 1:at + 1 + row[at]] for row in every]
        _check_agreement(fn, ("src_ranks", "dst_ranks")[side], values)
        lists.append(values[0])
    at = 2 * (1 + world)
    _check_agreement(fn, "runs (rows, checksum)", [tuple(row[at:at + 2]) for row in every])
    at += 2
    src = [_parse_holding(row[at:at + _SIDE_LEN]) for row in every]
    dst = [_parse_holding(row[at + _SIDE_LEN:at + 2 * _SIDE_LEN]) for row in every]
    return _Plan(lists[0], lists[1], src, dst)


def _check_holdings(fn: str, plan: _Plan) -> None:
    """A rank holds caches of a side exactly when that side's rank list names it; the holdings agree; a side's
    ranks share one block size."""
    holders = []
    for name, ranks, holdings in (("src_caches", plan.src_ranks, plan.src), ("dst_caches", plan.dst_ranks, plan.dst)):
        listed = f"{name[:3]}_ranks"
        for g, h in enumerate(holdings):
            if h.present and g not in ranks:
                raise ValueError(f"{fn}: {name} is given on group rank {g}, which {listed} {ranks} does not list "
                                 f"(pass None there)")
            if not h.present and g in ranks:
                raise ValueError(f"{fn}: {name} is None on group rank {g}, which {listed} {ranks} lists as "
                                 f"placement rank {ranks.index(g)}")
        sizes = [holdings[g].block_size for g in ranks]
        if len(set(sizes)) > 1:
            raise ValueError(f"{fn}: {name} must share one block_size over {listed}, got "
                             + ", ".join(f"group rank {g}: {s}" for g, s in zip(ranks, sizes)))
        holders += [(name, g, holdings[g]) for g in ranks]
    _check_cache_agreement(fn, holders)


def _check_run_values(fn: str, runs: Tensor, plan: _Plan) -> None:
    """Every run names ranks of the lists and stays inside the caches of the ranks it reads and writes."""
    if not runs.numel():
        return
    bad = (runs[:, LENGTH] < 1) | (runs[:, [SEQ, SRC_BLOCK, SRC_OFFSET, DST_BLOCK, DST_OFFSET]] < 0).any(1)
    if bad.any():
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"{fn}: runs row {i} {runs[i].tolist()} has a negative field or a length < 1")
    for name, ranks, holdings, col in (("src", plan.src_ranks, plan.src, SRC_RANK),
                                       ("dst", plan.dst_ranks, plan.dst, DST_RANK)):
        rank = runs[:, col]
        outside = (rank < 0) | (rank >= len(ranks))
        if outside.any():
            i = int(torch.nonzero(outside)[0, 0])
            raise ValueError(f"{fn}: runs row {i} has {name}_rank {int(rank[i])}, but {name}_ranks lists "
                             f"{len(ranks)} ranks {ranks}")
        num_blocks = torch.tensor([holdings[g].num_blocks for g in ranks], dtype=I64)[rank]
        block_size = holdings[ranks[0]].block_size
        block, offset = runs[:, col + 1], runs[:, col + 2]
        outside = (block >= num_blocks) | (offset + runs[:, LENGTH] > block_size)
        if outside.any():
            i = int(torch.nonzero(outside)[0, 0])
            g = ranks[int(rank[i])]
            raise ValueError(f"{fn}: runs row {i} {runs[i].tolist()} points outside {name}_caches on group rank {g} "
                             f"(num_blocks {holdings[g].num_blocks}, block_size {block_size})")


def _run_slots(runs: Tensor, col: int) -> Tuple[Tensor, Tensor]:
    """(block, offset) of every token of the runs, run after run, on side `col` (SRC_BLOCK or DST_BLOCK)."""
    n = runs[:, LENGTH]
    run_of, step = _ragged_arange(n)
    return runs[run_of, col], runs[run_of, col + 1] + step


def _as_bytes(cache: Tensor) -> Tensor:
    return cache.view(torch.uint8)


def _pack(caches: Sequence[Tensor], block: Tensor, offset: Tensor) -> Tensor:
    """[T, bytes per token]: each token's entries of every cache, as bytes."""
    dev = caches[0].device
    block, offset = block.to(dev), offset.to(dev)
    views = [_as_bytes(c) for c in caches]
    return torch.cat([v[block, offset].reshape(len(block), math.prod(v.shape[2:])) for v in views], 1)


def _unpack(caches: Sequence[Tensor], block: Tensor, offset: Tensor, data: Tensor) -> None:
    """Writes _pack's rows back into the caches' slots."""
    dev = caches[0].device
    block, offset, data = block.to(dev), offset.to(dev), data.to(dev)
    at = 0
    for c in caches:
        view = _as_bytes(c)
        width = math.prod(view.shape[2:])
        view[block, offset] = data[:, at:at + width].reshape(len(block), *view.shape[2:])
        at += width


def _peer_runs(runs: Tensor, mine: Tensor, peer: Tensor, world: int) -> Tuple[Tensor, List[int]]:
    """The runs selected by `mine`, grouped by peer group rank (stable), and each peer's token count."""
    sel, peers = runs[mine], peer[mine]
    order = torch.sort(peers, stable=True).indices
    counts = torch.zeros(world, dtype=I64).index_add_(0, peers, sel[:, LENGTH])
    return sel[order], counts.tolist()


def _move(src_caches, dst_caches, runs: Tensor, plan: _Plan, me: int, world: int, group) -> None:
    """Reads every source token this rank sends or copies, exchanges, then writes (so even aliased caches read
    before any write)."""
    src_g = torch.tensor(plan.src_ranks, dtype=I64)[runs[:, SRC_RANK]]
    dst_g = torch.tensor(plan.dst_ranks, dtype=I64)[runs[:, DST_RANK]]
    local = runs[(src_g == me) & (dst_g == me)]
    local_data = _pack(src_caches, *_run_slots(local, SRC_BLOCK)) if len(local) else None
    crossing = int(runs[src_g != dst_g, LENGTH].sum())  # the same on every rank: skip the exchange when 0
    if crossing:
        holder = plan.src[plan.src_ranks[0]]
        token_bytes = sum(_entry_bytes(holder))
        send, send_counts = _peer_runs(runs, (src_g == me) & (dst_g != me), dst_g, world)
        recv, recv_counts = _peer_runs(runs, (dst_g == me) & (src_g != me), src_g, world)
        device = _comm_device(group)
        out = torch.empty(sum(recv_counts) * token_bytes, dtype=torch.uint8, device=device)
        inp = (_pack(src_caches, *_run_slots(send, SRC_BLOCK)).to(device).flatten() if len(send)
               else torch.empty(0, dtype=torch.uint8, device=device))
        dist.all_to_all_single(out, inp, [n * token_bytes for n in recv_counts],
                               [n * token_bytes for n in send_counts], group=group)
        if len(recv):
            _unpack(dst_caches, *_run_slots(recv, DST_BLOCK), out.view(-1, token_bytes))
    if local_data is not None:
        _unpack(dst_caches, *_run_slots(local, DST_BLOCK), local_data)


def _check_plan_placement(fn: str, side: str, placement: Optional[Placement], ranks, caches) -> None:
    """A side's placement, when given, against its rank list and this process's caches of that side."""
    if placement is None:
        return
    if not isinstance(placement, Placement):
        raise TypeError(f"{fn}: {side} must be None or a dcp_ops.Placement, got {type(placement).__name__}")
    if len(ranks) != placement.world_size:
        raise ValueError(f"{fn}: {side}_ranks lists {len(ranks)} group ranks, but {side} has world_size "
                         f"{placement.world_size}")
    for c, cache in enumerate(caches or []):
        if cache.shape[1] != placement.block_size:
            raise ValueError(f"{fn}: {side}_caches[{c}] has block_size {cache.shape[1]}, but {side} has block_size "
                             f"{placement.block_size}")


def reshard_kv(src_caches: Optional[Sequence[Tensor]], dst_caches: Optional[Sequence[Tensor]], runs: Tensor,
               group: Optional[dist.ProcessGroup] = None, *, src_ranks: Sequence[int], dst_ranks: Sequence[int],
               src: Optional[Placement] = None, dst: Optional[Placement] = None) -> None:
    """Executes a transfer_runs plan over a process group (gloo or NCCL); every rank of the group calls it.

    src_caches, dst_caches: this process's caches of each side, a list ([k_cache, v_cache] for GQA, [kv_cache] for
    MLA), each [num_blocks, block_size, *entry]; None where the process holds no rank of that side (a process may
    hold one of each). src_ranks[i], dst_ranks[j]: the group rank holding each side's placement rank i, j. runs: the
    plan, the same on every rank. A run whose two ends are one process is a local copy; the others move as bytes
    (fp8 too) packed per peer, in one all_to_all_single. Source caches are never written, nor destination slots
    outside the runs. Refused with the same error on every rank before anything moves: rank lists that are
    malformed or differ between ranks, caches given (or missing) where the lists say otherwise, dtypes or entry
    shapes that differ between the sides, runs that differ between ranks or point outside a cache. src, dst
    (optional): the placements the plan was made for; given, a rank list of another length than its world size or
    a cache of another block size is refused too (a plan made for other blocks would otherwise write wrong slots).
    """
    fn = "reshard_kv"
    me, world = _membership(fn, group)

    def local_checks():
        _check_rank_list(fn, "src_ranks", src_ranks, world)
        _check_rank_list(fn, "dst_ranks", dst_ranks, world)
        for name, caches in (("src_caches", src_caches), ("dst_caches", dst_caches)):
            if caches is not None:
                _check_caches(fn, name, caches)
        _check_runs_tensor(fn, runs)
        _check_plan_placement(fn, "src", src, src_ranks, src_caches)
        _check_plan_placement(fn, "dst", dst, dst_ranks, dst_caches)

    verdict = _local_verdict(local_checks)
    every = _agree(fn, group, verdict, _reshard_fields(src_caches, dst_caches, runs, src_ranks, dst_ranks, world,
                                                       ok=verdict is None))
    plan = _parse_plan(fn, every, world)
    _check_holdings(fn, plan)
    cpu_runs = runs.detach().cpu()
    _check_run_values(fn, cpu_runs, plan)
    _move(src_caches, dst_caches, cpu_runs, plan, me, world, group)


# ----------------------------------------------------------------------------------------------------------------
# gather_kv: every sequence's window on every rank
# ----------------------------------------------------------------------------------------------------------------

def _check_gather_local(fn: str, cache, block_table, seq_lens, placement, start, end, me: int, world: int):
    """This rank's arguments; returns (start, end, table) on the CPU, int64."""
    if not isinstance(placement, Placement):
        raise TypeError(f"{fn}: placement must be a dcp_ops.Placement, got {type(placement).__name__}")
    if (placement.world_size, placement.rank) != (world, me):
        raise ValueError(f"{fn}: placement is for rank {placement.rank} of {placement.world_size}, but this is group "
                         f"rank {me} of {world}")
    _check_caches(fn, "cache", [cache], single=True)
    if cache.shape[1] != placement.block_size:
        raise ValueError(f"{fn}: cache has block_size {cache.shape[1]}, but placement's is {placement.block_size}")
    first, last = _window(fn, seq_lens, start, end)
    _check_int(block_table, fn, "block_table")
    if block_table.dim() != 2 or block_table.shape[0] != first.shape[0]:
        raise ValueError(f"{fn}: block_table must be [B = {first.shape[0]}, max_blocks], got shape "
                         f"{tuple(block_table.shape)}")
    return first, last, block_table.detach().cpu().long()


def _my_tokens(fn: str, table: Tensor, first: Tensor, last: Tensor, p: Placement, num_blocks: int):
    """(block, offset) of this rank's tokens in every window, sequence after sequence; ids checked."""
    lo = _local_len(first, p.world_size, p.rank, p.interleave).long()
    hi = _local_len(last, p.world_size, p.rank, p.interleave).long()
    seq, step = _ragged_arange(hi - lo)
    local = lo[seq] + step
    col = local // p.block_size
    if seq.numel() and int(col.max()) >= table.shape[1]:
        i = int(torch.argmax(col))
        raise ValueError(f"{fn}: block_table has {table.shape[1]} columns, but sequence {int(seq[i])} needs column "
                         f"{int(col[i])} on rank {p.rank}")
    block = table[seq, col]
    bad = (block < 0) | (block >= num_blocks)
    if bad.any():
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"{fn}: block_table[{int(seq[i])}, {int(col[i])}] = {int(block[i])} is outside the cache "
                         f"(num_blocks {num_blocks})")
    return block, local % p.block_size


def _window_sources(first: Tensor, last: Tensor, p: Placement):
    """For every token of every window, in position order: (seq, index in the window, owner rank, index in the
    owner's packed tokens); and each rank's packed token count."""
    ranks = torch.arange(p.world_size, dtype=I64)[:, None]
    lo = _local_len(first[None, :], p.world_size, ranks, p.interleave).long()  # [N, B]
    count = _local_len(last[None, :], p.world_size, ranks, p.interleave).long() - lo
    base = torch.cumsum(count, 1) - count  # where sequence b starts in rank r's packed tokens
    width = last - first
    seq, slot = _ragged_arange(width)
    pos = first[seq] + slot
    owner = _owner(pos, p.world_size, p.interleave)
    packed = base[owner, seq] + _local_index(pos, p.world_size, p.interleave) - lo[owner, seq]
    return seq, slot, owner, packed, count.sum(1)


# name -> slice of gather_kv's metadata; every rank must hold the same values
_GATHER_FIELDS = {"placement (world_size, block_size, interleave)": (0, 3),
                  "cache (dtype code, entry dims, entry shape)": (3, 5 + _MAX_ENTRY_DIMS),
                  "B": (5 + _MAX_ENTRY_DIMS, 6 + _MAX_ENTRY_DIMS),
                  "seq_lens, start, end, block_table (checksums)": (6 + _MAX_ENTRY_DIMS, 10 + _MAX_ENTRY_DIMS)}
_GATHER_LEN = 10 + _MAX_ENTRY_DIMS


def _gather_fields(cache: Tensor, seq_lens: Tensor, p: Placement, first: Tensor, last: Tensor,
                   table: Tensor) -> List[int]:
    entry = list(cache.shape[2:])
    return ([p.world_size, p.block_size, p.interleave, _DTYPES.index(cache.dtype), len(entry)] + entry
            + [0] * (_MAX_ENTRY_DIMS - len(entry)) + [len(first), _checksum(seq_lens), _checksum(first),
                                                       _checksum(last), _checksum(table)])


def gather_kv(cache: Tensor, block_table: Tensor, seq_lens: Tensor, placement: Placement,
              group: Optional[dist.ProcessGroup] = None, start: Optional[Tensor] = None,
              end: Optional[Tensor] = None) -> Tensor:
    """Every sequence's KV for global positions [start, end), in position order, on every rank of a DCP group.

    cache [num_blocks, block_size, *entry]: this rank's cache (MLA latent; for GQA call once per K and V); block_table
    [B, max_blocks] and seq_lens [B] (global lengths) as for the decode ops; placement: this rank's, matching the group.
    start, end [B] (optional; 0 and seq_lens): 0 <= start <= end <= seq_lens. Returns [B, max(end - start), *entry] in
    the cache's dtype (fp8 moves as bytes; the caller dequantizes), zero past each sequence's window. Each rank's
    tokens move once: one all-gather of packed local tokens. Refused with the same error on every rank before
    anything moves.
    """
    fn = "gather_kv"
    me, world = _membership(fn, group)
    held = {}

    def local_checks():
        held["window"] = _check_gather_local(fn, cache, block_table, seq_lens, placement, start, end, me, world)
        held["mine"] = _my_tokens(fn, held["window"][2], *held["window"][:2], placement, cache.shape[0])

    verdict = _local_verdict(local_checks)
    fields = _gather_fields(cache, seq_lens, placement, *held["window"]) if verdict is None else [0] * _GATHER_LEN
    every = _agree(fn, group, verdict, fields)
    for name, (a, b) in _GATHER_FIELDS.items():
        _check_agreement(fn, name, [tuple(row[a:b]) for row in every])
    first, last, _ = held["window"]
    return _gather_windows(cache, first, last, held["mine"], placement, group)


def _gather_windows(cache: Tensor, first: Tensor, last: Tensor, mine, p: Placement, group) -> Tensor:
    entry = tuple(cache.shape[2:])
    token_bytes = math.prod(entry) * cache.element_size()
    width = int((last - first).max()) if len(first) else 0
    out = torch.zeros((len(first), width, *entry), dtype=cache.dtype, device=cache.device)
    seq, slot, owner, packed, counts = _window_sources(first, last, p)
    most = int(counts.max())
    if most == 0:
        return out
    device = _comm_device(group)
    send = torch.zeros((most, token_bytes), dtype=torch.uint8, device=device)
    send[:len(mine[0])] = _pack([cache], *mine).to(device)
    every = torch.empty((p.world_size, most, token_bytes), dtype=torch.uint8, device=device)
    _all_gather(every, send, group)
    rows = every[owner.to(device), packed.to(device)].to(cache.device)
    _as_bytes(out).view(len(first), width, token_bytes)[seq.to(cache.device), slot.to(cache.device)] = rows
    return out
