"""Plain-torch float64 definitions of every op and placement helper: the oracle every test compares against.

Written for reading, not speed. Each function returns float64 results (LSE natural log) and never mutates inputs.
The decode references take round_to=None (exact) or a 16-bit dtype: then they are the same-precision reference of
precision="native" (docs/design.md §7): float64 arithmetic with the absorbed MLA query rounded to that dtype after w_uk,
P = exp(s - max) rounded to it before P.V (the row sums and LSE from the unrounded P), and the output rounded once.
"""
import math
from typing import List, Optional, Tuple

import torch

Tensor = torch.Tensor
NEG_INF = float("-inf")


def _gather_tokens(cache: Tensor, block_table: Tensor, row: int, length: int) -> Tensor:
    """The first `length` tokens of request `row` from a paged cache [num_blocks, block_size, ...], float64."""
    bs = cache.shape[1]
    pos = torch.arange(length)
    return cache[block_table[row, pos // bs].long(), pos % bs].double()


def _dequantize(cache: Tensor, scale: Optional[Tensor]) -> Tensor:
    """A cache as float64 values: an FP8 cache's stored values times its scale (docs/design.md §6), else itself."""
    return cache.double() if scale is None else cache.double() * float(scale.reshape(()))


def _round(x: Tensor, dtype: Optional[torch.dtype]) -> Tensor:
    """x rounded to dtype and back to float64 (x itself when dtype is None)."""
    return x if dtype is None else x.to(dtype).double()


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float,
            round_to: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """q [H, Dk], k [L, H, Dk], v [L, H, Dv] -> (out [H, Dv], lse [H]); L == 0 gives zeros and -inf. With round_to,
    P = exp(s - max) is rounded to it before P.V; the row sums come from the unrounded P."""
    if k.shape[0] == 0:
        return q.new_zeros(q.shape[0], v.shape[-1]), q.new_full((q.shape[0],), NEG_INF)
    s = torch.einsum("hd,lhd->hl", q, k) * scale
    m = s.amax(-1, keepdim=True)  # NaN if a score is NaN; -inf if every score is (the row is then empty)
    p = torch.exp(s - torch.where(m == NEG_INF, torch.zeros_like(m), m))  # a +inf score gives NaN (inf - inf)
    total = p.sum(-1, keepdim=True)
    out = torch.einsum("hl,lhd->hd", _round(p, round_to), v) / total
    return torch.where(total == 0, torch.zeros_like(out), out), torch.logsumexp(s, -1)


def query_rows(block_table: Tensor, cu_seqlens_q: Optional[Tensor], T: int) -> Tensor:
    """Multi-token decode: the block-table row of each of the T query tokens (query tokens cu[b] .. cu[b+1]-1 are row
    b's); without cu_seqlens_q, token t is row t."""
    if cu_seqlens_q is None:
        return block_table
    rows = [b for b in range(block_table.shape[0]) for _ in range(int(cu_seqlens_q[b + 1] - cu_seqlens_q[b]))]
    assert len(rows) == T, "cu_seqlens_q must end at T"
    return block_table[torch.tensor(rows, dtype=torch.long)] if rows else block_table[:0]


def gqa_decode_partial(q, k_cache, v_cache, block_table, seq_lens, scale, round_to=None, cu_seqlens_q=None,
                       k_scale=None, v_scale=None):
    """(out [T, H_q, D], lse [T, H_q]) float64; query head h reads KV head h // (H_q / H_kv). round_to: the
    module docstring. cu_seqlens_q: multi-token decode (query_rows); query t attends this rank's first seq_lens[t]
    tokens of its row, which is causal attention when seq_lens = local_causal_lens of the query positions.
    k_scale / v_scale: FP8 caches, dequantized (value x scale) in float64."""
    T, Hq, _ = q.shape
    k_cache, v_cache = _dequantize(k_cache, k_scale), _dequantize(v_cache, v_scale)
    block_table = query_rows(block_table, cu_seqlens_q, T)
    group = Hq // k_cache.shape[2]
    out = torch.zeros(T, Hq, v_cache.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.zeros(T, Hq, dtype=torch.float64, device=q.device)
    for t in range(T):
        n = int(seq_lens[t])
        k = _gather_tokens(k_cache, block_table, t, n).repeat_interleave(group, dim=1)
        v = _gather_tokens(v_cache, block_table, t, n).repeat_interleave(group, dim=1)
        out[t], lse[t] = _attend(q[t].double(), k, v, scale, round_to)
    return _round(out, round_to), lse


def mla_decode_partial(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, w_uk=None, w_uv=None, round_to=None,
                       cu_seqlens_q=None, kv_scale=None):
    """(out [T, H, D_latent or D_v], lse [T, H]) float64. Keys: whole cache rows; values: the latent part.
    round_to: the module docstring; cu_seqlens_q, kv_scale: as gqa_decode_partial's."""
    T, H, _ = q_nope.shape
    kv_cache = _dequantize(kv_cache, kv_scale)
    block_table = query_rows(block_table, cu_seqlens_q, T)
    latent = kv_cache.shape[-1] - q_pe.shape[-1]
    q_lat = q_nope.double()
    if w_uk is not None:
        q_lat = torch.einsum("thn,hnl->thl", q_lat, w_uk.double())
    q = _round(torch.cat([q_lat, q_pe.double()], -1), round_to)
    out = torch.zeros(T, H, latent, dtype=torch.float64, device=q.device)
    lse = torch.zeros(T, H, dtype=torch.float64, device=q.device)
    for t in range(T):
        rows = _gather_tokens(kv_cache, block_table, t, int(seq_lens[t]))  # [L, Dl + Dr]
        k = rows[:, None, :].expand(-1, H, -1)
        v = rows[:, None, :latent].expand(-1, H, -1)
        out[t], lse[t] = _attend(q[t], k, v, scale, round_to)
    if w_uv is not None:
        out = torch.einsum("thl,hlv->thv", out, w_uv.double())
    return _round(out, round_to), lse


def sanitize_lse(lses: Tensor, lse_base: float = math.e) -> Tensor:
    """External LSE to natural log, float64; NaN and +inf mean an empty shard (-inf)."""
    x = lses.double() * math.log(lse_base)
    return torch.where(torch.isnan(x) | (x == math.inf), torch.full_like(x, NEG_INF), x)


def merge_weights(lses: Tensor, lse_base: float = math.e,
                  nonfinite_lse: str = "empty") -> Tuple[Tensor, Tensor]:
    """(weights [N, ...] = exp(lse_r - L), L [...]) float64; all-empty positions get weights 0 and L = -inf.

    nonfinite_lse="empty": NaN and +inf LSE are empty partials (sanitize_lse). "propagate": only -inf is empty; a NaN
    LSE makes L NaN and a +inf one (a +inf score) makes L +inf, and then every weight is NaN."""
    x = sanitize_lse(lses, lse_base) if nonfinite_lse == "empty" else lses.double() * math.log(lse_base)
    total = torch.logsumexp(x, 0)
    empty = total == NEG_INF
    w = torch.exp(x - torch.where(empty, torch.zeros_like(total), total))
    w = torch.where(x == NEG_INF, torch.zeros_like(w), w)  # an empty partial weighs 0, even next to an L of +inf
    return torch.where(torch.isnan(total) | (total == math.inf), torch.full_like(w, math.nan), w), total


def merge_partials(outs, lses, lse_base=math.e, nonfinite_lse="empty"):
    """(out [T, H, D], lse [T, H]) float64 from outs [N, T, H, D] and lses [N, T, H] in base lse_base."""
    w, total = merge_weights(lses, lse_base, nonfinite_lse)
    o = torch.where(w[..., None] != 0, outs.double(), torch.zeros((), dtype=torch.float64))  # empty rows may be NaN
    return (w[..., None] * o).sum(0), total


def correct_partial(out, lses, rank, lse_base=math.e, nonfinite_lse="empty"):
    """(out * exp(lse_rank - L), L) float64: vLLM's correct_attn_out, without mutating `out`."""
    w, total = merge_weights(lses, lse_base, nonfinite_lse)
    o = torch.where(w[rank][..., None] != 0, out.double(), torch.zeros((), dtype=torch.float64))
    return w[rank][..., None] * o, total


def pack_exchange(out, lse, world_size):
    """(payload [N, T, H/N, D], lse [N, T, H/N]): what rank r receives from this rank is head slice r."""
    T, H, D = out.shape
    hl = H // world_size
    return (out.double().reshape(T, world_size, hl, D).transpose(0, 1),
            lse.double().reshape(T, world_size, hl).transpose(0, 1))


def merge_exchange(payload, lses, nonfinite_lse="empty"):
    """Merge of what every rank sent: payload [N, T, H_loc, D], lses [N, T, H_loc] natural -> (out, lse)."""
    return merge_partials(payload, lses, nonfinite_lse=nonfinite_lse)


def write_kv(cache, new, slot_mapping, scale=None):
    """A copy of cache [num_blocks, block_size, *E] with new[t] at flat slot slot_mapping[t] (skipping -1); into a
    float8_e4m3fn cache, new / scale saturated to +-448 and converted by torch (nearest even, NaN kept)."""
    out = cache.clone()
    if scale is not None:
        new = torch.clamp(new.float() / scale.float().reshape(()), -448.0, 448.0).to(cache.dtype)
    bs = cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            out[slot // bs, slot % bs] = new[t]
    return out


# KV placement, one position at a time, straight from the formulas in docs/design.md §3.
def owner_rank(p: int, world_size: int, interleave: int = 1) -> int:
    return (p // interleave) % world_size


def local_index(p: int, world_size: int, interleave: int = 1) -> int:
    return (p // (world_size * interleave)) * interleave + p % interleave


def local_seq_len(length: int, world_size: int, rank: int, interleave: int = 1) -> int:
    """Counts the positions below `length` that `rank` owns."""
    return sum(1 for p in range(length) if owner_rank(p, world_size, interleave) == rank)


def local_causal_len(position: int, world_size: int, rank: int, interleave: int = 1) -> int:
    """Counts the positions <= `position` that `rank` owns: the keys a query at `position` attends there."""
    return local_seq_len(position + 1, world_size, rank, interleave)


def slot(block_table_row: List[int], p: int, block_size: int, world_size: int, rank: int,
         interleave: int = 1) -> int:
    if owner_rank(p, world_size, interleave) != rank:
        return -1
    j = local_index(p, world_size, interleave)
    return block_table_row[p // (block_size * world_size)] * block_size + j % block_size

