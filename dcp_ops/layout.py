"""KV placement across a DCP group (vLLM-compatible, docs/design.md §3). Int tensors in, int32 tensors out.

Interleave size I, group size N, rank r, global position p:
  owner(p)              = (p // I) % N
  local index j(p)      = (p // (N*I)) * I + p % I
  local length(L, r)    = (L // (N*I)) * I + clamp(L % (N*I) - r*I, 0, I)
  slot(p) on the owner  = block_table[req, p // (block_size*N)] * block_size + j % block_size   (-1 elsewhere)
Local token j of a request lives at block block_table[req, j // block_size], offset j % block_size, on every rank.

`Placement` holds one rank's (N, r, block_size, I) and answers all of these; the free functions are the same
formulas with the numbers passed each time. The per-step helpers (owner_rank, local_index, local_seq_lens,
local_causal_lens, slot_mapping) never read device data on the host: their value checks (negative positions,
out-of-range rows and columns) run where the tensors are on the CPU and not under torch.compile, or everywhere with
DCP_OPS_CHECK_VALUES=1; otherwise a token slot_mapping cannot place gets slot -1 (never written), so a decode step
can be captured in a CUDA graph and compiled with fullgraph=True. shard_kv / unshard_kv are setup helpers and check
always.
"""
import os
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ._deprecated import keyword_only, warn_renamed
from .ops import check_int

Tensor = torch.Tensor
_CHECK_ON_DEVICE = os.environ.get("DCP_OPS_CHECK_VALUES", "0") == "1"


def _check_int(t: Tensor, fn: str, name: str) -> None:
    if not isinstance(t, Tensor) or t.dtype not in (torch.int32, torch.int64):
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{fn}: {name} must be an int32 or int64 tensor, got {got}")


def _check_ints(fn: str, **values) -> None:
    for name, v in values.items():
        check_int(fn, name, v)


def _check_group(fn: str, world_size: int, interleave: int, rank: int = 0) -> None:
    _check_ints(fn, world_size=world_size, interleave=interleave, rank=rank)
    if world_size < 1:
        raise ValueError(f"{fn}: world_size must be >= 1, got {world_size}")
    if interleave < 1:
        raise ValueError(f"{fn}: interleave must be >= 1, got {interleave}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{fn}: rank must be in [0, world_size = {world_size}), got {rank}")


def _check_block_size(fn: str, block_size: int, interleave: int) -> None:
    _check_ints(fn, block_size=block_size)
    if block_size < 1 or block_size % interleave:
        raise ValueError(f"{fn}: interleave ({interleave}) must divide block_size ({block_size})")


def _host_checks(*tensors: Tensor) -> bool:
    """Whether value checks may read these tensors on the host (module docstring)."""
    if torch.compiler.is_compiling():
        return False
    return _CHECK_ON_DEVICE or all(t.device.type == "cpu" for t in tensors)


def _check_nonneg(t: Tensor, fn: str, name: str) -> None:
    if t.numel() and _host_checks(t) and int(t.min()) < 0:
        raise ValueError(f"{fn}: {name} must be >= 0, got min {int(t.min())}")


# The formulas on positions already checked (the helpers below check their arguments once, then use these).
def _owner(positions: Tensor, world_size: int, interleave: int) -> Tensor:
    return (positions // interleave) % world_size


def _local_index(positions: Tensor, world_size: int, interleave: int) -> Tensor:
    return (positions // (world_size * interleave)) * interleave + positions % interleave


def _local_len(lengths: Tensor, world_size: int, rank: int, interleave: int) -> Tensor:
    span = world_size * interleave
    return ((lengths // span) * interleave + (lengths % span - rank * interleave).clamp(0, interleave)).to(torch.int32)


def _check_positions(positions: Tensor, fn: str, world_size: int, interleave: int) -> None:
    _check_int(positions, fn, "positions")
    _check_group(fn, world_size, interleave)
    _check_nonneg(positions, fn, "positions")


def owner_rank(positions: Tensor, world_size: int, interleave: int = 1) -> Tensor:
    """Rank owning each global position: (p // I) % N. Same shape as positions, int32."""
    _check_positions(positions, "owner_rank", world_size, interleave)
    return _owner(positions, world_size, interleave).to(torch.int32)


def local_index(positions: Tensor, world_size: int, interleave: int = 1) -> Tensor:
    """Index of each global position among its owner's tokens: (p // (N*I)) * I + p % I, int32."""
    _check_positions(positions, "local_index", world_size, interleave)
    return _local_index(positions, world_size, interleave).to(torch.int32)


def local_seq_lens(seq_lens: Tensor, world_size: int, rank: int, interleave: int = 1) -> Tensor:
    """This rank's number of tokens for each global length: (L // (N*I)) * I + clamp(L % (N*I) - r*I, 0, I), int32."""
    _check_int(seq_lens, "local_seq_lens", "seq_lens")
    _check_group("local_seq_lens", world_size, interleave, rank)
    _check_nonneg(seq_lens, "local_seq_lens", "seq_lens")
    return _local_len(seq_lens, world_size, rank, interleave)


def local_causal_lens(positions: Tensor, world_size: int, rank: int, interleave: int = 1) -> Tensor:
    """For query tokens at global positions `positions` [T]: the number of this rank's tokens at positions <= p, the
    keys each attends under causal multi-token decode (docs/design.md §6), int32. Equal to local_seq_lens(p + 1)."""
    _check_int(positions, "local_causal_lens", "positions")
    _check_group("local_causal_lens", world_size, interleave, rank)
    _check_nonneg(positions, "local_causal_lens", "positions")
    return _local_len(positions + 1, world_size, rank, interleave)


def slot_mapping(block_table: Tensor, seq_ids: Tensor, positions: Tensor, block_size: int, world_size: int,
                 rank: int, interleave: int = 1) -> Tensor:
    """Flat cache slot of each new token on this rank, -1 where another rank owns it; int32.

    block_table [B, max_blocks] (the same on every rank); seq_ids [T] block-table row of each token; positions [T]
    global position of each token. A token whose row or block-table column is out of range, or whose block id is
    negative (padding), is refused when the value checks run (module docstring); otherwise it gets -1 and is never
    written.
    """
    fn = "slot_mapping"
    _check_int(block_table, fn, "block_table")
    _check_int(seq_ids, fn, "seq_ids")
    _check_int(positions, fn, "positions")
    _check_group(fn, world_size, interleave, rank)
    _check_block_size(fn, block_size, interleave)
    if block_table.dim() != 2:
        raise ValueError(f"{fn}: block_table must be 2-D [B, max_blocks], got shape {tuple(block_table.shape)}")
    if seq_ids.shape != positions.shape or seq_ids.dim() != 1:
        raise ValueError(f"{fn}: seq_ids and positions must both be [T], got {tuple(seq_ids.shape)} and "
                         f"{tuple(positions.shape)}")
    for name, t in (("seq_ids", seq_ids), ("positions", positions)):
        if t.device != block_table.device:
            raise ValueError(f"{fn}: {name} must be on block_table's device {block_table.device}, got {t.device}")
    B, max_blocks = block_table.shape
    col = positions // (block_size * world_size)  # block-table column (virtual block) of each token
    if seq_ids.numel() and _host_checks(block_table, seq_ids, positions):
        _check_nonneg(positions, fn, "positions")
        lo, hi = int(seq_ids.min()), int(seq_ids.max())
        if lo < 0 or hi >= B:
            raise ValueError(f"{fn}: seq_ids must be in [0, B = {B}), got range [{lo}, {hi}]")
        need = int(col.max())
        if need >= max_blocks:
            raise ValueError(f"{fn}: position {int(positions.max())} needs block-table column {need}, but "
                             f"block_table has {max_blocks} columns")
        vblock = block_table[seq_ids.long(), col.long()]
        if int(vblock.min()) < 0:  # uncovered token (at block size 1 its slot would be a silent -1)
            t = int(torch.nonzero(vblock < 0)[0, 0])
            raise ValueError(f"{fn}: block_table[{int(seq_ids[t])}, {int(col[t])}] = {int(vblock[t])} is the block "
                             f"of token {t} (position {int(positions[t])}); block ids must be >= 0")
        placed = torch.ones_like(positions, dtype=torch.bool)
    else:  # no host read: clamp the gather, then give a token that cannot be placed slot -1
        inside = (seq_ids >= 0) & (seq_ids < B) & (positions >= 0) & (col < max_blocks)
        vblock = block_table[seq_ids.clamp(0, max(B - 1, 0)).long(), col.clamp(0, max(max_blocks - 1, 0)).long()]
        placed = inside & (vblock >= 0)
    j = _local_index(positions, world_size, interleave)
    slots = vblock.to(torch.int64) * block_size + j % block_size
    mine = placed & (_owner(positions, world_size, interleave) == rank)
    return torch.where(mine, slots, torch.full_like(slots, -1)).to(torch.int32)


def _token_index(block_table: Tensor, seq_lens: Tensor, fn: str):
    """(row, position) of every token of every request, flattened: no Python loop over tokens."""
    _check_int(block_table, fn, "block_table")
    _check_int(seq_lens, fn, "seq_lens")
    if block_table.dim() != 2 or seq_lens.shape != (block_table.shape[0],):
        raise ValueError(f"{fn}: block_table must be [B, max_blocks] and seq_lens [B], got "
                         f"{tuple(block_table.shape)} and {tuple(seq_lens.shape)}")
    _check_nonneg(seq_lens, fn, "seq_lens")
    return _ragged_arange(seq_lens.long())


def _ragged_arange(counts: Tensor):
    """(row, index) of every element of ragged rows of counts[i] elements, flattened: row i repeated counts[i] times,
    and 0 .. counts[i] - 1 within it (no Python loop)."""
    rows = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    return rows, torch.arange(rows.numel(), device=counts.device) - (torch.cumsum(counts, 0) - counts)[rows]


def _check_cache(cache: Tensor, block_table: Tensor, fn: str, name: str) -> None:
    if cache.dim() < 3:
        raise ValueError(f"{fn}: {name} must be [num_blocks, block_size, *E], got shape {tuple(cache.shape)}")


def _placements(cache: Tensor, block_table: Tensor, seq_lens: Tensor, world_size: int, interleave: int, fn: str):
    """For every token: its unsharded (block, offset), its owner and its (block, offset) on the owner."""
    _check_group(fn, world_size, interleave)
    bs = cache.shape[1]
    if bs % interleave:
        raise ValueError(f"{fn}: interleave ({interleave}) must divide block_size ({bs})")
    rows, pos = _token_index(block_table, seq_lens, fn)
    max_len = block_table.shape[1] * bs
    if pos.numel() and int(seq_lens.max()) > max_len:
        raise ValueError(f"{fn}: seq_lens max {int(seq_lens.max())} exceeds block_table capacity {max_len}")
    bt = block_table.long()
    used = bt[rows, pos // bs]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache.shape[0]):
        raise ValueError(f"{fn}: block_table ids in use must be in [0, num_blocks = {cache.shape[0]}), got range "
                         f"[{int(used.min())}, {int(used.max())}]")
    src = (used, pos % bs)
    j = _local_index(pos, world_size, interleave)
    dst = (bt[rows, j // bs], j % bs)
    return src, _owner(pos, world_size, interleave), dst


@keyword_only
def shard_kv(cache: Tensor, block_table: Tensor, seq_lens: Tensor, world_size: int, interleave: int = 1, *,
             fill: float = 0.0, rank: Optional[int] = None) -> List[Tensor]:
    """Splits an unsharded paged cache [num_blocks, block_size, *E] into the N per-rank caches (same shape), a list
    indexed by rank.

    block_table [B, max_blocks] and seq_lens [B] (global lengths) describe the unsharded cache; the same block table
    addresses every shard (docs/design.md §3). Slots a shard does not use hold `fill` (NaN makes stray reads loud).
    One rank's shard alone (one cache's memory, not N): Placement.shard_kv. For tests and hand-offs of a cache that
    exists unsharded; engines write prefill KV straight to its owners with slot_mapping + write_kv.
    `rank=r` (deprecated, refused in 0.3) returns rank r's shard as a tensor, not a list: use Placement.shard_kv.
    """
    if rank is None:
        return _shard(cache, block_table, seq_lens, world_size, interleave, fill, range(world_size), "shard_kv")
    warnings.warn("shard_kv: rank= is deprecated and will be refused in dcp_ops 0.3 (it changes the return type to "
                  "a tensor); use Placement(world_size, rank, block_size, interleave).shard_kv(...)",
                  DeprecationWarning, stacklevel=3)
    _check_group("shard_kv", world_size, interleave, rank)
    return _shard(cache, block_table, seq_lens, world_size, interleave, fill, (rank,), "shard_kv")[0]


def _shard(cache: Tensor, block_table: Tensor, seq_lens: Tensor, world_size: int, interleave: int, fill: float,
           ranks, fn: str) -> List[Tensor]:
    """The shards of `ranks` (each a cache of the unsharded one's shape)."""
    _check_cache(cache, block_table, fn, "cache")
    src, owner, dst = _placements(cache, block_table, seq_lens, world_size, interleave, fn)
    shards = []
    for r in ranks:
        shard = torch.full_like(cache, fill)
        m = owner == r
        shard[dst[0][m], dst[1][m]] = cache[src[0][m], src[1][m]]
        shards.append(shard)
    return shards


@keyword_only
def unshard_kv(shards: Sequence[Tensor], block_table: Tensor, seq_lens: Tensor, interleave: int = 1, *,
               fill: float = 0.0) -> Tensor:
    """Inverse of shard_kv: rebuilds the unsharded cache from the N per-rank caches."""
    fn = "unshard_kv"
    if len(shards) < 1 or any(s.shape != shards[0].shape or s.dtype != shards[0].dtype for s in shards):
        raise ValueError(f"{fn}: shards must be a non-empty list of caches of one shape and dtype")
    _check_cache(shards[0], block_table, fn, "shards[0]")
    src, owner, dst = _placements(shards[0], block_table, seq_lens, len(shards), interleave, fn)
    cache = torch.full_like(shards[0], fill)
    for r, shard in enumerate(shards):
        m = owner == r
        cache[src[0][m], src[1][m]] = shard[dst[0][m], dst[1][m]]
    return cache


@dataclass(frozen=True)
class Placement:
    """One rank's KV placement in its DCP group (docs/design.md §3): the single source of the group size, the rank,
    the cache's block size and the interleave, so that slots, local lengths and shards cannot disagree.

    An engine makes one per rank (a shard may carry it: dcp_attention then refuses a group it does not match) and
    drives each step from it: slot_mapping for the step's new tokens (write_kv), local_seq_lens for the decode
    lengths, local_causal_lens for multi-token decode. None of the per-step methods reads device data on the host.
    """
    world_size: int
    rank: int
    block_size: int
    interleave: int = 1

    def __post_init__(self):
        _check_group("Placement", self.world_size, self.interleave, self.rank)
        _check_block_size("Placement", self.block_size, self.interleave)

    def owner_rank(self, positions: Tensor) -> Tensor:
        """The rank owning each global position (int32)."""
        return owner_rank(positions, self.world_size, self.interleave)

    def owner(self, positions: Tensor) -> Tensor:
        """Deprecated name of owner_rank (removed in 0.3)."""
        warn_renamed("Placement.owner", "Placement.owner_rank")
        return self.owner_rank(positions)

    def local_index(self, positions: Tensor) -> Tensor:
        """Each global position's index among its owner's tokens (int32)."""
        return local_index(positions, self.world_size, self.interleave)

    def local_seq_lens(self, seq_lens: Tensor) -> Tensor:
        """This rank's token count for each global length (int32): the decode ops' seq_lens."""
        return local_seq_lens(seq_lens, self.world_size, self.rank, self.interleave)

    def local_causal_lens(self, positions: Tensor) -> Tensor:
        """This rank's token count at global positions <= p for each query position p (int32)."""
        return local_causal_lens(positions, self.world_size, self.rank, self.interleave)

    def slot_mapping(self, block_table: Tensor, seq_ids: Tensor, positions: Tensor) -> Tensor:
        """This rank's flat cache slot of each new token, -1 where another rank owns it (int32): write_kv's."""
        return slot_mapping(block_table, seq_ids, positions, self.block_size, self.world_size, self.rank,
                            self.interleave)

    def shard_kv(self, cache: Tensor, block_table: Tensor, seq_lens: Tensor, *, fill: float = 0.0) -> Tensor:
        """This rank's shard of an unsharded paged cache (as shard_kv gives every rank's)."""
        if cache.dim() < 3 or cache.shape[1] != self.block_size:
            raise ValueError(f"Placement.shard_kv: cache must be [num_blocks, block_size = {self.block_size}, *E], "
                             f"got shape {tuple(cache.shape)}")
        return _shard(cache, block_table, seq_lens, self.world_size, self.interleave, fill, (self.rank,),
                      "Placement.shard_kv")[0]

    def shard(self, cache: Tensor, block_table: Tensor, seq_lens: Tensor, fill: float = 0.0) -> Tensor:
        """Deprecated name of shard_kv (removed in 0.3)."""
        warn_renamed("Placement.shard", "Placement.shard_kv")
        return self.shard_kv(cache, block_table, seq_lens, fill=fill)
