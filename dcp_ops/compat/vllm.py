"""vLLM-compatible DCP helpers: vLLM's names, arguments, layouts and semantics, on dcp_ops kernels.

A vLLM attention backend switches by changing imports, e.g. ``from dcp_ops.compat.vllm import cp_lse_ag_out_rs``.
`cp_group` may be vLLM's GroupCoordinator (its `device_group` is used) or a torch.distributed ProcessGroup;
`ctx` (vLLM's CPTritonContext) is accepted and ignored. LSE is in base e, or base 2 with is_lse_base_on_e=False,
and returned in the same base. NaN and +inf LSE count as empty shards (-inf), as in vLLM's kernels.
"""
import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import ops
from ..distributed import _all_gather, merge_across
from ..layout import local_seq_lens

Tensor = torch.Tensor
LN2 = math.log(2.0)


def _pg(cp_group):
    return getattr(cp_group, "device_group", cp_group)


def _base(is_lse_base_on_e: bool) -> float:
    return math.e if is_lse_base_on_e else 2.0


def _to_base(lse_natural: Tensor, is_lse_base_on_e: bool) -> Tensor:
    return lse_natural if is_lse_base_on_e else lse_natural / LN2


def _gather_lses(cp_attn_lse: Tensor, pg) -> Tensor:
    n = dist.get_world_size(pg)
    lses = torch.empty((n,) + tuple(cp_attn_lse.shape), dtype=torch.float32, device=cp_attn_lse.device)
    _all_gather(lses, cp_attn_lse.float(), pg)
    return lses


def correct_attn_out(out: Tensor, lses: Tensor, cp_rank: int, ctx=None,
                     is_lse_base_on_e: bool = True) -> Tuple[Tensor, Tensor]:
    """out [B, H, D] is rescaled in place by exp(lse_rank - L); lses [N, B, H]. Returns (out, L [B, H])."""
    total = ops.correct_partial(out, lses.float(), cp_rank, lse_base=_base(is_lse_base_on_e))
    return out, _to_base(total, is_lse_base_on_e)


def cp_lse_ag_out_rs(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group, ctx=None, return_lse: bool = False,
                     is_lse_base_on_e: bool = True) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """All-gather LSE, correct this rank's partial (in place), reduce-scatter over heads, summing in fp32 (vLLM sums
    in the output dtype).

    cp_attn_out [B, H, D], cp_attn_lse [B, H] -> out [B, H/N, D] (and lse [B, H/N] when return_lse).
    """
    return _merge(cp_attn_out, cp_attn_lse, cp_group, "ag_rs", return_lse, is_lse_base_on_e)


def cp_lse_ag_out_ar(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group, ctx=None, return_lse: bool = False,
                     is_lse_base_on_e: bool = True) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """All-gather LSE, correct, all-reduce, summing in fp32 (vLLM sums in the output dtype): every rank gets all heads
    [B, H, D] (and lse [B, H]), in cp_attn_out."""
    pg = _pg(cp_group)
    n, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if n == 1:
        return (cp_attn_out, cp_attn_lse) if return_lse else cp_attn_out
    lses = _gather_lses(cp_attn_lse, pg)
    # The all-reduce is the merge's sum: fp32 terms, summed in fp32 (a bf16 / fp16 sum would round at every rank's
    # term), then stored back into cp_attn_out, which is returned as vLLM returns its corrected, reduced `out`.
    out = cp_attn_out if cp_attn_out.dtype == torch.float32 else cp_attn_out.float()
    out, lse = correct_attn_out(out, lses, rank, ctx, is_lse_base_on_e)
    dist.all_reduce(out, group=pg)
    if out is not cp_attn_out:
        cp_attn_out.copy_(out)
    return (cp_attn_out, lse) if return_lse else cp_attn_out


def dcp_a2a_lse_reduce(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group, ctx=None, return_lse: bool = False,
                       is_lse_base_on_e: bool = True) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """One all-to-all of packed output + LSE, merged in fp32: [B, H, D], [B, H] -> [B, H/N, D] (and [B, H/N])."""
    return _merge(cp_attn_out, cp_attn_lse, cp_group, "a2a", return_lse, is_lse_base_on_e)


def _merge(out: Tensor, lse: Tensor, cp_group, mode: str, return_lse: bool, is_lse_base_on_e: bool):
    pg = _pg(cp_group)
    if dist.get_world_size(pg) == 1:
        return (out, lse) if return_lse else out
    lse_nat = lse.float() * (1.0 if is_lse_base_on_e else LN2)
    res, res_lse = merge_across(out, lse_nat, pg, mode=mode)
    return (res, _to_base(res_lse, is_lse_base_on_e)) if return_lse else res


def get_dcp_local_seq_lens(seq_lens: Tensor, dcp_size: int = 1, dcp_rank: Optional[int] = None,
                           cp_kv_cache_interleave_size: int = 1) -> Tensor:
    """Local KV lengths, int32: [B] for dcp_rank, or [B, dcp_size] (every rank's) when dcp_rank is None; like vLLM,
    a size-1 rank dim is squeezed.

    Multi-token decode (speculative decoding with DCP; vLLM's RFC defines no per-query form yet): a backend passes
    the decode ops one length per query token, dcp_ops.local_causal_lens(positions, dcp_size, dcp_rank,
    cp_kv_cache_interleave_size) of the query tokens' global positions (for a request of length L verifying k
    tokens, positions L - k .. L - 1), with cu_seqlens_q = query_start_loc (docs/design.md §6)."""
    ranks = range(dcp_size) if dcp_rank is None else [dcp_rank]
    cols = [local_seq_lens(seq_lens.to(torch.int32), dcp_size, r, cp_kv_cache_interleave_size) for r in ranks]
    return torch.stack(cols, -1).squeeze(1)


def mask_empty_lse(lse: Tensor, local_seq_lens: Tensor, query_start_loc: Optional[Tensor] = None) -> Tensor:
    """lse [T, H] with -inf on rows this rank has no KV for (local length 0) and on padding rows past
    query_start_loc[-1]. query_start_loc [B + 1] maps token rows to requests (decode: None, one row per request)."""
    T = lse.shape[0]
    if query_start_loc is None:
        lens = local_seq_lens[:T]
        empty = torch.zeros(T, dtype=torch.bool, device=lse.device)
        empty[:lens.numel()] = lens == 0
        empty[lens.numel():] = True
    else:
        rows = torch.arange(T, device=lse.device)
        req = torch.searchsorted(query_start_loc.to(rows.dtype), rows, right=True) - 1
        padding = rows >= query_start_loc[-1]
        req = req.clamp(0, local_seq_lens.numel() - 1)
        empty = padding | (local_seq_lens[req] == 0)
    return torch.where(empty[:, None], torch.full_like(lse, -math.inf), lse)
