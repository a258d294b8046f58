"""dcp_attention: one DCP decode step over a torch.distributed group (docs/design.md §1, §5).

Steps: gather queries over heads (rank-major; skipped when q_replicated), partial attention over this rank's KV
shard, then the exchange of `mode`: "a2a" (one all_to_all of packed output+LSE, fp32 merge), "ag_rs" (vLLM's:
all-gather LSE, rescale own partial, reduce-scatter) or "ag" (all-gather outputs and LSE, merge locally). The same
code runs over gloo (CPU) and NCCL (GPU); nothing in a step synchronises with the host.
"""
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import ops
from .layout import Placement

Tensor = torch.Tensor
MODES = ("a2a", "ag_rs", "ag")

# Newer torch names these all_gather_single / reduce_scatter_single and deprecates the old names; older torch (2.11,
# say, which engines still pin) has only all_gather_into_tensor / reduce_scatter_tensor. Same arguments either way.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class GQAShard:
    """This rank's GQA KV shard: k_cache, v_cache [num_blocks, block_size, H_kv, D]; block_table [B, max_blocks]
    int32 (the same on every rank); seq_lens [B] int32, this rank's local lengths; softmax scale. placement: the
    Placement the cache was written with (optional): dcp_attention then refuses a group or cache it does not match.
    k_scale, v_scale: the scales of float8_e4m3fn caches, 1-element fp32 tensors (docs/design.md §6)."""
    k_cache: Tensor
    v_cache: Tensor
    block_table: Tensor
    seq_lens: Tensor
    scale: float
    cu_seqlens_q: Optional[Tensor] = None  # multi-token decode: [B + 1] int32, seq_lens then [T] (docs/design.md §6)
    placement: Optional[Placement] = None
    k_scale: Optional[Tensor] = None
    v_scale: Optional[Tensor] = None


@dataclass
class MLAShard:
    """This rank's MLA latent-cache shard: kv_cache [num_blocks, block_size, D_latent + rope_dim] (latent first);
    w_uk [H, D_nope, D_latent] and w_uv [H, D_latent, D_v] cover all H = N * H_loc heads when given. scale: the
    model's softmax scale, absorbed or not (DeepSeek-V3: 192 ** -0.5; mla_decode_partial). rope_dim: where w_uk or
    w_uv is given it must equal the cache's last dim minus their D_latent (checked); where neither is, nothing else
    fixes the latent width (D_latent = the cache's last dim - rope_dim), so a wrong rope_dim would attend rope dims as
    values: set it from the model's config (qk_rope_head_dim). kv_scale: the scale of a float8_e4m3fn cache, a
    1-element fp32 tensor (docs/design.md §6)."""
    kv_cache: Tensor
    block_table: Tensor
    seq_lens: Tensor
    scale: float
    rope_dim: int = 64
    w_uk: Optional[Tensor] = None
    w_uv: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None  # as GQAShard's
    placement: Optional[Placement] = None  # as GQAShard's
    kv_scale: Optional[Tensor] = None


class Workspace:
    """Buffers that dcp_attention, gather_heads and merge_across keep between steps: the gathered queries, the
    exchange's send and receive buffers, and the merged output and LSE. They are keyed by role and made again only
    when a shape, dtype or device changes (`allocations` counts the buffers made), so a repeated step makes none of
    them again.

    The decode op still allocates its own outputs each step (the partial out and LSE, and on a GPU the split plan and
    the per-split partials), from torch's allocator: on a GPU its caching allocator, so no cudaMalloc once warm, and a
    CUDA graph capture serves them from the graph's pool. Some results are workspace buffers (mode "a2a": out and lse;
    "ag_rs": out): they hold their values until the next step with the same Workspace overwrites them.
    """

    def __init__(self) -> None:
        self._bufs: Dict[str, Tensor] = {}
        self.allocations = 0

    def get(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != device:
            buf = self._bufs[name] = torch.empty(tuple(shape), dtype=dtype, device=device)
            self.allocations += 1
        return buf


def _cache(shard: Union[GQAShard, MLAShard]) -> Tensor:
    """The shard's (first) cache tensor: K for GQA, the latent cache for MLA."""
    return shard.k_cache if isinstance(shard, GQAShard) else shard.kv_cache


def _check_placement(shard, world_size: int, rank: int) -> None:
    """A shard that carries its Placement must be used in the group, at the rank and with the cache it was written
    for: a mismatch would attend the wrong tokens without any other error."""
    p = shard.placement
    if p is None:
        return
    if not isinstance(p, Placement):
        raise TypeError(f"dcp_attention: shard.placement must be a dcp_ops.Placement or None, got {type(p).__name__}")
    if (p.world_size, p.rank) != (world_size, rank):
        raise ValueError(f"dcp_attention: shard.placement is for rank {p.rank} of {p.world_size}, but this is rank "
                         f"{rank} of a group of {world_size}")
    cache = _cache(shard)
    if cache.dim() >= 2 and cache.shape[1] != p.block_size:
        raise ValueError(f"dcp_attention: shard.placement has block_size {p.block_size}, but the cache's is "
                         f"{cache.shape[1]}")


def _check_workspace(op: str, workspace) -> None:
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"{op}: workspace must be a dcp_ops.Workspace or None, got {type(workspace).__name__}")


def _all_gather(out: Tensor, inp: Tensor, group) -> None:
    """out [N, *inp.shape] <- every rank's inp, rank-major (c10d wants the gathered dim flattened)."""
    _gather_into(out.view(-1, *inp.shape[1:]), inp.contiguous(), group=group)


def _partial(q_all: Tensor, shard: Union[GQAShard, MLAShard], precision: str) -> Tuple[Tensor, Tensor]:
    if isinstance(shard, GQAShard):
        return ops.gqa_decode_partial(q_all, shard.k_cache, shard.v_cache, shard.block_table, shard.seq_lens,
                                      shard.scale, precision=precision, cu_seqlens_q=shard.cu_seqlens_q,
                                      k_scale=shard.k_scale, v_scale=shard.v_scale)
    else:  # an MLAShard (dcp_attention checked the type)
        rope = shard.rope_dim
        if not 0 <= rope < q_all.shape[-1]:
            raise ValueError(f"dcp_attention: MLAShard.rope_dim must be in [0, q's last dim = {q_all.shape[-1]}), "
                             f"got {rope}")
        width = shard.kv_cache.shape[-1]
        for name, w, dim in (("w_uk", shard.w_uk, -1), ("w_uv", shard.w_uv, 1)):
            if w is not None and w.dim() == 3 and w.shape[dim] + rope != width:
                raise ValueError(f"dcp_attention: MLAShard.rope_dim {rope} does not match the cache and {name}: "
                                 f"kv_cache's last dim {width} is D_latent + rope_dim, and {name} gives D_latent = "
                                 f"{w.shape[dim]}, so rope_dim must be {width - w.shape[dim]}")
        split = q_all.shape[-1] - rope  # rope last; rope_dim 0 leaves an empty q_pe
        return ops.mla_decode_partial(q_all[..., :split], q_all[..., split:], shard.kv_cache, shard.block_table,
                                      shard.seq_lens, shard.scale, shard.w_uk, shard.w_uv, precision=precision,
                                      cu_seqlens_q=shard.cu_seqlens_q, kv_scale=shard.kv_scale)


def exchange_bytes(mode: str, T: int, H: int, d_out: int, world_size: int, dtype: torch.dtype,
                   q_dim: Optional[int] = None, q_replicated: bool = False) -> int:
    """Bytes one rank sends per layer (and step) in `mode`, Q gather included when q_dim is given.

    T tokens, H heads in all, d_out the exchanged width (MLA: D_latent, or D_v with w_uv applied before the merge).
    """
    ops.check_choice("exchange_bytes", "mode", mode, MODES)
    es = torch.empty((), dtype=dtype).element_size()
    n, h_loc = world_size, H // world_size
    q = 0 if q_dim is None or q_replicated else (n - 1) * T * h_loc * q_dim * es  # ring all-gather
    if mode == "a2a":
        return q + (n - 1) * T * h_loc * (d_out + ops.exchange_pad(dtype)) * es
    if mode == "ag_rs":  # the reduce-scatter carries fp32 terms, whatever the dtype (fp32 accumulation)
        return q + (n - 1) * T * H * 4 + (n - 1) * T * h_loc * d_out * 4
    return q + (n - 1) * T * H * (4 + d_out * es)


# Dtypes by code, so that a rank can tell another's dtype from an int of an all-gathered metadata tensor (a step's
# signature here, a cache's in reshard.py).
_DTYPES = tuple(getattr(torch, n) for n in ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
                                            "float8_e4m3fnuz", "float8_e5m2fnuz", "uint8", "int8", "int16", "int32",
                                            "int64") if hasattr(torch, n))


def _step_signature(q: Tensor, shard, n: int, mode: str, q_replicated: bool, precision: str):
    """(field names, values) that every rank of a step must agree on, a fixed number of ints."""
    gqa, cache = isinstance(shard, GQAShard), _cache(shard)
    code = lambda dt: _DTYPES.index(dt) if dt in _DTYPES else -1  # noqa: E731
    fields = {
        "world_size": n, "mode": MODES.index(mode), "q_replicated": int(q_replicated),
        "precision": ops.PRECISIONS.index(precision), "T (query tokens)": q.shape[0], "q heads": q.shape[1],
        "q head dim": q.shape[2], "q dtype": code(q.dtype), "shard kind (0 GQA, 1 MLA)": int(not gqa),
        "cache dtype": code(cache.dtype), "cache block_size": cache.shape[1] if cache.dim() > 1 else -1,
        "cache row (H_kv * D, or D_latent + rope)": cache[0, 0].numel() if cache.dim() > 2 and cache.shape[0] else -1,
        "rope_dim": -1 if gqa else shard.rope_dim, "w_uk given": int(not gqa and shard.w_uk is not None),
        "w_uv given": int(not gqa and shard.w_uv is not None),
        "cu_seqlens_q given": int(shard.cu_seqlens_q is not None),
    }
    return list(fields), list(fields.values())


# How _check_group prints a signature field whose int stands for something else.
_SHOWN = {"mode": lambda v: repr(MODES[v]), "precision": lambda v: repr(ops.PRECISIONS[v]),
          "q dtype": lambda v: str(_DTYPES[v]) if v >= 0 else "other",
          "cache dtype": lambda v: str(_DTYPES[v]) if v >= 0 else "other"}


def _check_group(q: Tensor, shard, group, n: int, mode: str, q_replicated: bool, precision: str) -> None:
    """All-gathers the step's signature and raises the same ValueError on every rank when the ranks disagree, naming
    the field and each rank's value (check_group=True; one small collective and a host read)."""
    names, values = _step_signature(q, shard, n, mode, q_replicated, precision)
    mine = torch.tensor(values, dtype=torch.int64, device=q.device)
    every = torch.empty((n, len(values)), dtype=torch.int64, device=q.device)
    _all_gather(every, mine, group)
    rows = every.cpu().tolist()
    for j, name in enumerate(names):
        col = [row[j] for row in rows]
        if len(set(col)) > 1:
            shown = _SHOWN.get(name, str)
            raise ValueError(f"dcp_attention: the ranks of the group disagree on {name}: "
                             + ", ".join(f"rank {r}: {shown(v)}" for r, v in enumerate(col)))


def dcp_attention(q: Tensor, shard: Union[GQAShard, MLAShard], group: Optional[dist.ProcessGroup] = None, *,
                  mode: str = "a2a", q_replicated: bool = False, return_lse: bool = False,
                  workspace: Optional[Workspace] = None, precision: str = "native", check_group: bool = False):
    """One DCP decode attention step.

    q: [T, H_loc, D] (GQA) or [T, H_loc, D_q + rope_dim] (MLA, rope last; D_q = D_nope with w_uk, else D_latent), this
    rank's heads, T query tokens (T = B, or several per sequence with the shard's cu_seqlens_q); with q_replicated=True,
    q already holds all N * H_loc heads. Returns out [T, H_loc, D_out] (all heads [T, H, D_out] for mode="ag"), and lse
    [T, H_loc] (or [T, H]) fp32 natural log when return_lse.
    precision: the decode op's numerics, "native" (default) or "fp32" (dcp_ops.ops). check_group=True (or
    DCP_OPS_CHECK_GROUP=1) first checks that every rank runs the same step (shapes, dtypes, mode, cache layout) and
    raises the same ValueError on every rank, naming what differs; off by default, as it costs a small collective and
    a host sync. Without it, ranks that disagree fail inside the backend's collectives (gloo aborts a process).
    """
    ops.check_choice("dcp_attention", "mode", mode, MODES)
    ops.check_precision("dcp_attention", precision)  # before any collective (the decode op checks it again)
    _check_workspace("dcp_attention", workspace)
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError(f"dcp_attention: q must be a 3-D tensor [T, H, D], got "
                         f"{tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
    n = dist.get_world_size(group)
    if not isinstance(shard, (GQAShard, MLAShard)):
        raise TypeError(f"dcp_attention: shard must be a GQAShard or MLAShard, got {type(shard).__name__}")
    if check_group or os.environ.get("DCP_OPS_CHECK_GROUP", "0") == "1":
        _check_group(q, shard, group, n, mode, q_replicated, precision)
    _check_placement(shard, n, dist.get_rank(group))
    ws = workspace if workspace is not None else Workspace()
    if q_replicated:
        if mode != "ag" and q.shape[1] % n:  # "ag" returns every head: nothing is split across ranks
            raise ValueError(f"dcp_attention: with q_replicated and mode {mode!r}, q's heads ({q.shape[1]}) must "
                             f"divide into {n} ranks (mode 'ag' takes any count)")
        q_all = q
    else:
        q_all = gather_heads(q, group, ws)
    out, lse = _partial(q_all, shard, precision)  # [T, H, D_out], [T, H]
    # our partials mark empty shards with -inf, so a NaN LSE is a NaN in this step's inputs: it reaches the caller
    res, res_lse = merge_across(out, lse, group, mode=mode, workspace=ws, nonfinite_lse="propagate")
    return (res, res_lse) if return_lse else res


def gather_heads(q: Tensor, group: Optional[dist.ProcessGroup] = None,
                 workspace: Optional[Workspace] = None) -> Tensor:
    """All-gather queries over heads: q [T, H_loc, D] on each rank -> [T, N * H_loc, D], head g = r * H_loc + h."""
    n = dist.get_world_size(group)
    ws = workspace if workspace is not None else Workspace()
    T, h_loc, Dq = q.shape
    gathered = ws.get("q_gather", (n, T, h_loc, Dq), q.dtype, q.device)
    _all_gather(gathered, q, group)
    q_all = ws.get("q_all", (T, n * h_loc, Dq), q.dtype, q.device)
    q_all.view(T, n, h_loc, Dq).copy_(gathered.permute(1, 0, 2, 3))
    return q_all


def merge_across(out: Tensor, lse: Tensor, group: Optional[dist.ProcessGroup] = None, *, mode: str = "a2a",
                 workspace: Optional[Workspace] = None, nonfinite_lse: str = "empty") -> Tuple[Tensor, Tensor]:
    """Exact merge of every rank's partial (out [T, H, D], lse [T, H] natural) by `mode`.

    Returns this rank's heads (out [T, H/N, D], lse [T, H/N]), or all heads for mode="ag". Every mode sums in fp32.
    Mode "ag_rs" rescales `out` in place first (as vLLM's cp_lse_ag_out_rs does) and reduce-scatters fp32 terms;
    "a2a" and "ag" leave `out` as it was. nonfinite_lse: "empty" (NaN and +inf LSE from other kernels are empty
    partials) or "propagate" (they poison the row; dcp_ops.ops).
    """
    ops.check_choice("merge_across", "mode", mode, MODES)
    ops.check_choice("merge_across", "nonfinite_lse", nonfinite_lse, ops.NONFINITE_LSE)  # before any collective
    _check_workspace("merge_across", workspace)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    ws = workspace if workspace is not None else Workspace()
    T, H, D = out.shape
    if mode != "ag" and H % n:
        raise ValueError(f"merge_across: heads ({H}) must divide into {n} ranks for mode {mode!r}")
    h_loc = H // n
    if mode == "a2a":
        send = ops.pack_exchange(out, lse, n, send=ws.get("a2a_send", (n, T, h_loc, D + ops.exchange_pad(out.dtype)),
                                                          out.dtype, out.device))
        recv = ws.get("a2a_recv", send.shape, send.dtype, send.device)
        dist.all_to_all_single(recv, send, group=group)
        return ops.merge_exchange(recv, out=ws.get("out", (T, h_loc, D), out.dtype, out.device),
                                  lse=ws.get("lse", (T, h_loc), torch.float32, out.device), nonfinite_lse=nonfinite_lse)
    if mode == "ag_rs":
        lses = ws.get("lse_gather", (n, T, H), torch.float32, lse.device)
        _all_gather(lses, lse, group)
        # The reduce-scatter does the merge's sum, so it gets fp32 terms (rescaled in fp32) and sums in fp32, as every
        # mode does (docs/design.md §2); a bf16 / fp16 sum rounded at each rank's term gave 1.6-4.6x the error of a
        # same-precision merge at 4-8 ranks. `out` is still rescaled in place, rounded to its dtype.
        fp32 = out.dtype == torch.float32
        part = out if fp32 else ws.get("rs_part", (T, H, D), torch.float32, out.device).copy_(out)
        total = ops.correct_partial(part, lses, rank, nonfinite_lse=nonfinite_lse)
        send = ws.get("rs_send", (n, T, h_loc, D), torch.float32, out.device)
        send.copy_(part.view(T, n, h_loc, D).transpose(0, 1))
        res = ws.get("out", (T, h_loc, D), out.dtype, out.device)
        summed = res if fp32 else ws.get("rs_sum", (T, h_loc, D), torch.float32, out.device)
        _reduce_scatter(summed.view(-1, D), send.view(-1, D), group=group)
        if not fp32:
            out.copy_(part)
            res.copy_(summed)
        return res, total[:, rank * h_loc:(rank + 1) * h_loc]
    outs = ws.get("ag_outs", (n, T, H, D), out.dtype, out.device)
    lses = ws.get("lse_gather", (n, T, H), torch.float32, lse.device)
    _all_gather(outs, out, group)
    _all_gather(lses, lse, group)
    return ops.merge_partials(outs, lses, nonfinite_lse=nonfinite_lse)
