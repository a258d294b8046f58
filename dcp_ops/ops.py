"""Typed wrappers of the native ops (torch.ops.dcp_ops.*), with shapes in the docstrings, and their fake kernels.

Conventions (DESIGN.md §2): LSE is fp32 natural log [T, H]; an empty shard gives lse = -inf and out = 0; NaN and +inf
LSE from other kernels count as -inf; merges accumulate in fp32; block tables, seq lens and slots are int32.

precision (the decode ops, DESIGN.md §2): "native" (default) computes what FlashMLA, FlashInfer and vLLM compute on
16-bit caches: 16-bit operands into the tensor cores (the absorbed MLA query and the probabilities P rounded to the
cache's type), fp32 accumulation, fp32 softmax statistics and row sums. "fp32" gives results as if every product
were fp32 (split 16-bit terms on the tensor cores). fp32 caches compute in fp32 either way, and the CPU kernels are
exact under both.
"""
import math
from typing import Optional, Tuple

import torch

_ops = torch.ops.dcp_ops
Tensor = torch.Tensor
PRECISIONS = ("native", "fp32")


def check_precision(op: str, precision: str) -> str:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{op}: precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def gqa_decode_partial(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                       scale: float, *, precision: str = "native") -> Tuple[Tensor, Tensor]:
    """Partial decode attention of GQA/MHA queries over this rank's paged KV tokens.

    q [T, H_q, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] (same dtype as q; strided views of a combined
    [2, ...] cache are fine); block_table [T, max_blocks] int32; seq_lens [T] int32 (this rank's local lengths).
    Query head h reads KV head h // (H_q / H_kv). Returns out [T, H_q, D] (q's dtype, normalised) and lse [T, H_q]
    fp32 natural log (-inf where seq_lens is 0). precision: "native" or "fp32" (the module docstring).
    """
    return _ops.gqa_decode_partial(q, k_cache, v_cache, block_table, seq_lens, float(scale),
                                   precision=check_precision("gqa_decode_partial", precision))


def mla_decode_partial(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                       scale: float, w_uk: Optional[Tensor] = None,
                       w_uv: Optional[Tensor] = None, *, precision: str = "native") -> Tuple[Tensor, Tensor]:
    """Partial decode attention of MLA queries over this rank's paged latent cache.

    q_nope [T, H, D_latent], or the pre-absorption [T, H, D_nope] with w_uk [H, D_nope, D_latent] fused in;
    q_pe [T, H, D_rope]; kv_cache [num_blocks, block_size, D_latent + D_rope] (latent first); block_table
    [T, max_blocks] int32; seq_lens [T] int32. Keys are whole cache rows, values their latent part.
    Returns out [T, H, D_latent] (or [T, H, D_v] with w_uv [H, D_latent, D_v] applied to the normalised output)
    in q's dtype, and lse [T, H] fp32 natural log. precision: "native" or "fp32" (the module docstring); in "native"
    the absorbed query is rounded to the cache's type after w_uk.
    """
    return _ops.mla_decode_partial(q_nope, q_pe, kv_cache, block_table, seq_lens, float(scale), w_uk, w_uv,
                                   precision=check_precision("mla_decode_partial", precision))


def merge_partials(outs: Tensor, lses: Tensor, lse_base: float = math.e) -> Tuple[Tensor, Tensor]:
    """Exact merge of N normalised partial outputs.

    outs [N, T, H, D] (fp32/bf16/fp16, any strides with a contiguous last dim); lses [N, T, H] fp32 in base
    `lse_base` (e or 2). Returns out [T, H, D] in outs' dtype and lse [T, H] fp32 natural log, accumulated in fp32.
    """
    return _ops.merge_partials(outs, lses, float(lse_base))


def correct_partial(out: Tensor, lses: Tensor, rank: int, lse_base: float = math.e) -> Tensor:
    """vLLM's correct_attn_out: rescales `out` [T, H, D] in place by exp(lse_rank - L), returns L [T, H] fp32 (natural).

    lses [N, T, H] fp32 holds every rank's LSE in base `lse_base`; rank selects this rank's row.
    """
    return _ops.correct_partial(out, lses, int(rank), float(lse_base))


def exchange_pad(dtype: torch.dtype) -> int:
    """Elements after D in one packed a2a row: 16 bytes, the fp32 LSE in the first 4."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def pack_exchange(out: Tensor, lse: Tensor, world_size: int, send: Optional[Tensor] = None) -> Tensor:
    """Packs this rank's partial for the a2a exchange.

    out [T, H, D], lse [T, H] fp32 (natural). Returns send [N, T, H/N, D + pad] in out's dtype: send[r, t, i, :D] =
    out[t, r*H/N + i], and the fp32 LSE bit-stored in the pad. `send` may be a preallocated buffer of that shape.
    """
    T, H, D = out.shape
    if send is None:
        if world_size <= 0 or H % world_size:
            raise ValueError(f"pack_exchange: out heads ({H}) must divide into world_size = {world_size} ranks")
        send = out.new_empty((world_size, T, H // world_size, D + exchange_pad(out.dtype)))
    _ops.pack_exchange(out, lse, send)
    return send


def merge_exchange(recv: Tensor, out: Optional[Tensor] = None,
                   lse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Merges the a2a buffer received from every rank: recv [N, T, H_loc, D + pad] -> out [T, H_loc, D], lse [T, H_loc].

    fp32 accumulation; out in recv's dtype, lse fp32 natural. `out` and `lse` may be preallocated.
    """
    N, T, Hl, row = recv.shape
    if out is None:
        out = recv.new_empty((T, Hl, row - exchange_pad(recv.dtype)))
    if lse is None:
        lse = torch.empty((T, Hl), dtype=torch.float32, device=recv.device)
    _ops.merge_exchange(recv, out, lse)
    return out, lse


def write_kv(cache: Tensor, new: Tensor, slot_mapping: Tensor) -> None:
    """Owner-only KV append: cache [num_blocks, block_size, *E] gets new[t] [*E] at flat slot slot_mapping[t] [T].

    Slot -1 (a token another rank owns) is skipped; any other slot outside [0, num_blocks * block_size) is an error.
    One call per cache tensor (GQA: K and V). Any dtype, equal for cache and new.
    """
    _ops.write_kv(cache, new, slot_mapping)


# Fake (meta) kernels so torch.compile and FakeTensor can trace the ops. They also run when an eager call mixes a meta
# tensor with real ones (dispatch picks Meta), so each first checks that every tensor argument is on one device, as the
# native validators do (those cannot run here: they call sizes(), which symbolic shapes do not have).
def _same_device(op: str, ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise RuntimeError(f"{op}: {name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


@torch.library.register_fake("dcp_ops::gqa_decode_partial")
def _gqa_fake(q, k_cache, v_cache, block_table, seq_lens, scale, precision="native"):
    _same_device("gqa_decode_partial", "q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                 seq_lens=seq_lens)
    T, H, D = q.shape
    return q.new_empty((T, H, D)), q.new_empty((T, H), dtype=torch.float32)


@torch.library.register_fake("dcp_ops::mla_decode_partial")
def _mla_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, w_uk=None, w_uv=None, precision="native"):
    _same_device("mla_decode_partial", "q_nope", q_nope, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table,
                 seq_lens=seq_lens, w_uk=w_uk, w_uv=w_uv)
    T, H, _ = q_nope.shape
    d_out = w_uv.shape[-1] if w_uv is not None else kv_cache.shape[-1] - q_pe.shape[-1]
    return q_nope.new_empty((T, H, d_out)), q_nope.new_empty((T, H), dtype=torch.float32)


@torch.library.register_fake("dcp_ops::merge_partials")
def _merge_fake(outs, lses, lse_base=math.e):
    _same_device("merge_partials", "outs", outs, lses=lses)
    _, T, H, D = outs.shape
    return outs.new_empty((T, H, D)), lses.new_empty((T, H))


@torch.library.register_fake("dcp_ops::correct_partial")
def _correct_fake(out, lses, rank, lse_base=math.e):
    _same_device("correct_partial", "out", out, lses=lses)
    return lses.new_empty(lses.shape[1:])


@torch.library.register_fake("dcp_ops::pack_exchange")
def _pack_fake(out, lse, send):
    _same_device("pack_exchange", "out", out, lse=lse, send=send)
    return None


@torch.library.register_fake("dcp_ops::merge_exchange")
def _merge_exchange_fake(recv, out, lse):
    _same_device("merge_exchange", "recv", recv, out=out, lse=lse)
    return None


@torch.library.register_fake("dcp_ops::write_kv")
def _write_kv_fake(cache, new, slot_mapping):
    _same_device("write_kv", "cache", cache, new=new, slot_mapping=slot_mapping)
    return None
