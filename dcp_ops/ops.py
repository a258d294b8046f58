"""Typed wrappers of the native ops (torch.ops.dcp_ops.*), with shapes in the docstrings, and their fake kernels.

Conventions (docs/design.md §2): LSE is fp32 natural log [T, H]; an empty shard gives lse = -inf and out = 0; merges
accumulate in fp32; block tables, seq lens and slots are int32.

Non-finite values: in the decode ops a NaN score (a NaN in an attended query, key or w_uk element) makes its row's out
and lse NaN, as the float64 reference does; a +inf score makes out NaN and lse +inf; a -inf score is a token of weight
0, and a row with only -inf scores, or no tokens, is empty. The merges take nonfinite_lse: "empty" (default, vLLM's
convention for LSE from other kernels) reads NaN and +inf LSE as empty partials; "propagate" (what dcp_attention
uses on our own partials) lets a NaN LSE make the merged row NaN, and a +inf one its LSE +inf and output NaN.

precision (the decode ops, docs/design.md §2): "native" (default) computes what FlashMLA, FlashInfer and vLLM compute on
16-bit caches: 16-bit operands into the tensor cores (the absorbed MLA query and the probabilities P rounded to the
cache's type), fp32 accumulation, fp32 softmax statistics and row sums. "fp32" gives results as if every product were
fp32 (split 16-bit terms on the tensor cores). fp32 caches compute in fp32 either way, and the CPU kernels are exact
under both.

Calls: tensors by position, options (precision, scales, lse_base, nonfinite_lse, preallocated buffers) by keyword; the
old positional forms of the merges' options still work in 0.2 with a DeprecationWarning. The wrappers return what they
computed or filled (pack_exchange its `send`, merge_exchange its `out` and `lse`, made when not given), where the raw
torch.ops.dcp_ops ops that fill a caller's buffers return nothing (their schemas, csrc/schemas.h, are unchanged).
"""
import math
import numbers
from typing import Optional, Tuple

import torch

from . import _C
from ._deprecated import keyword_only

_ops = torch.ops.dcp_ops
Tensor = torch.Tensor
PRECISIONS = ("native", "fp32")
NONFINITE_LSE = ("empty", "propagate")


def check_choice(op: str, name: str, value, choices: Tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{op}: {name} must be one of {choices}, got {value!r}")
    return value


def check_precision(op: str, precision: str) -> str:
    return check_choice(op, "precision", precision, PRECISIONS)


def _str(op: str, name: str, x) -> str:
    """x, refused by name unless it is a str. The ops' string options (precision, nonfinite_lse) are checked for their
    value once, by the native op, which every caller reaches (csrc/validate.cpp, the same message as check_choice)."""
    if not isinstance(x, str):
        raise TypeError(f"{op}: {name} must be a str, got {type(x).__name__} {x!r}")
    return x


def _real(op: str, name: str, x) -> float:
    """x as a float, refused by name unless it is a real number (a bool or a tensor is not)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{op}: {name} must be a real number, got {type(x).__name__} {x!r}")
    return float(x)


def check_int(op: str, name: str, x) -> int:
    """x as an int, refused by name unless it is an integer (a float, even 2.0, would be truncated elsewhere)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {type(x).__name__} {x!r}")
    return int(x)


def _tensor(op: str, name: str, x, dims: int, shape: str) -> Tensor:
    """x, refused by name unless it is a tensor of `dims` dimensions (`shape` says which)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: {name} must be a tensor {shape}, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D {shape}, got shape {list(x.shape)}")
    return x


def gqa_decode_partial(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                       scale: float, *, precision: str = "native", cu_seqlens_q: Optional[Tensor] = None,
                       k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Partial decode attention of GQA/MHA queries over this rank's paged KV tokens.

    q [T, H_q, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] (q's dtype, or FP8 below; strided views of a
    combined [2, ...] cache are fine); block_table [T, max_blocks] int32; seq_lens [T] int32 (this rank's local lengths).
    Query head h reads KV head h // (H_q / H_kv). Returns out [T, H_q, D] (q's dtype, normalised) and lse [T, H_q]
    fp32 natural log (-inf where seq_lens is 0). precision: "native" or "fp32" (the module docstring).
    Multi-token decode (docs/design.md §6): with cu_seqlens_q [B + 1] int32, query tokens cu[b] .. cu[b+1]-1 belong
    to block-table row b (block_table [B, max_blocks]), and seq_lens [T] holds each query token's count of this
    rank's keys (local_causal_lens of its position).
    FP8 caches (docs/design.md §6): k_cache and v_cache of dtype torch.float8_e4m3fn with k_scale and v_scale, each a
    1-element fp32 tensor on their device (vLLM's); stored value x scale is the dequantized value. The query stays
    fp32 / bf16 / fp16 and the output has its dtype; k_scale folds into the softmax scale and v_scale into the output,
    in fp32.
    """
    return _ops.gqa_decode_partial(q, k_cache, v_cache, block_table, seq_lens,
                                   _real("gqa_decode_partial", "scale", scale),
                                   precision=_str("gqa_decode_partial", "precision", precision),
                                   cu_seqlens_q=cu_seqlens_q, k_scale=k_scale, v_scale=v_scale)


def mla_decode_partial(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                       scale: float, w_uk: Optional[Tensor] = None,
                       w_uv: Optional[Tensor] = None, *, precision: str = "native",
                       cu_seqlens_q: Optional[Tensor] = None,
                       kv_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Partial decode attention of MLA queries over this rank's paged latent cache.

    q_nope [T, H, D_latent], or the pre-absorption [T, H, D_nope] with w_uk [H, D_nope, D_latent] fused in;
    q_pe [T, H, D_rope]; kv_cache [num_blocks, block_size, D_latent + D_rope] (latent first); block_table
    [T, max_blocks] int32; seq_lens [T] int32. Keys are whole cache rows, values their latent part. scale: the
    model's softmax scale, the same with or without absorption (absorbing w_uk does not change a score), so for
    DeepSeek-V2 / V3 (qk_nope 128 + qk_rope 64) it is 192 ** -0.5, not (D_latent + D_rope) ** -0.5 = 576 ** -0.5.
    Returns out [T, H, D_latent] (or [T, H, D_v] with w_uv [H, D_latent, D_v] applied to the normalised output)
    in q's dtype, and lse [T, H] fp32 natural log. precision: "native" or "fp32" (the module docstring); in "native"
    the absorbed query is rounded to the cache's type after w_uk. cu_seqlens_q: multi-token decode, as in
    gqa_decode_partial. FP8 cache: kv_cache of dtype torch.float8_e4m3fn with kv_scale, a 1-element fp32 tensor on
    its device, scaling both keys and values (as gqa_decode_partial's k_scale and v_scale).
    """
    return _ops.mla_decode_partial(q_nope, q_pe, kv_cache, block_table, seq_lens,
                                   _real("mla_decode_partial", "scale", scale), w_uk, w_uv,
                                   precision=_str("mla_decode_partial", "precision", precision),
                                   cu_seqlens_q=cu_seqlens_q, kv_scale=kv_scale)


@keyword_only
def merge_partials(outs: Tensor, lses: Tensor, *, lse_base: float = math.e,
                   nonfinite_lse: str = "empty") -> Tuple[Tensor, Tensor]:
    """Exact merge of N normalised partial outputs.

    outs [N, T, H, D] (fp32/bf16/fp16, any strides with a contiguous last dim); lses [N, T, H] fp32 in base
    `lse_base` (e or 2). Returns out [T, H, D] in outs' dtype and lse [T, H] fp32 natural log, accumulated in fp32.
    nonfinite_lse: "empty" or "propagate" (the module docstring).
    """
    return _ops.merge_partials(outs, lses, _real("merge_partials", "lse_base", lse_base),
                               _str("merge_partials", "nonfinite_lse", nonfinite_lse))


@keyword_only
def correct_partial(out: Tensor, lses: Tensor, rank: int, *, lse_base: float = math.e,
                    nonfinite_lse: str = "empty") -> Tensor:
    """vLLM's correct_attn_out: rescales `out` [T, H, D] in place by exp(lse_rank - L), returns L [T, H] fp32 (natural).

    lses [N, T, H] fp32 holds every rank's LSE in base `lse_base`; rank selects this rank's row. nonfinite_lse:
    "empty" or "propagate" (the module docstring).
    """
    return _ops.correct_partial(out, lses, check_int("correct_partial", "rank", rank),
                                _real("correct_partial", "lse_base", lse_base),
                                _str("correct_partial", "nonfinite_lse", nonfinite_lse))


def exchange_pad(dtype: torch.dtype) -> int:
    """Elements after D in one packed a2a row: the native ops' pad (16 bytes), the fp32 LSE in the first 4."""
    return _C.exchange_pad_bytes // torch.empty((), dtype=dtype).element_size()


@keyword_only
def pack_exchange(out: Tensor, lse: Tensor, world_size: int, *, send: Optional[Tensor] = None) -> Tensor:
    """Packs this rank's partial for the a2a exchange.

    out [T, H, D], lse [T, H] fp32 (natural). Returns send [N, T, H/N, D + pad] in out's dtype: send[r, t, i, :D] =
    out[t, r*H/N + i], and the fp32 LSE bit-stored in the pad. `send` may be a preallocated buffer of that shape.
    """
    T, H, D = _tensor("pack_exchange", "out", out, 3, "[T, H, D]").shape
    world_size = check_int("pack_exchange", "world_size", world_size)
    if world_size <= 0 or H % world_size:
        raise ValueError(f"pack_exchange: out heads ({H}) must divide into world_size = {world_size} ranks")
    if send is None:
        send = out.new_empty((world_size, T, H // world_size, D + exchange_pad(out.dtype)))
    elif _tensor("pack_exchange", "send", send, 4, "[N, T, H/N, D + pad]").shape[0] != world_size:
        raise ValueError(f"pack_exchange: send.shape[0] must be world_size = {world_size}, got {send.shape[0]}")
    _ops.pack_exchange(out, lse, send)
    return send


@keyword_only
def merge_exchange(recv: Tensor, *, out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
                   nonfinite_lse: str = "empty") -> Tuple[Tensor, Tensor]:
    """Merges the a2a buffer received from every rank: recv [N, T, H_loc, D + pad] -> out [T, H_loc, D], lse [T, H_loc].

    fp32 accumulation; out in recv's dtype, lse fp32 natural. `out` and `lse` may be preallocated. nonfinite_lse:
    "empty" or "propagate" (the module docstring).
    """
    _str("merge_exchange", "nonfinite_lse", nonfinite_lse)
    N, T, Hl, row = _tensor("merge_exchange", "recv", recv, 4, "[N, T, H_loc, D + pad]").shape
    if out is None:
        if not recv.is_floating_point() or row <= exchange_pad(recv.dtype):
            raise ValueError(f"merge_exchange: recv must be a float tensor whose rows hold D > 0 elements and the "
                             f"pad, got dtype {recv.dtype} and rows of {row} elements")
        out = recv.new_empty((T, Hl, row - exchange_pad(recv.dtype)))
    if lse is None:
        lse = torch.empty((T, Hl), dtype=torch.float32, device=recv.device)
    _ops.merge_exchange(recv, out, lse, nonfinite_lse)
    return out, lse


@keyword_only
def write_kv(cache: Tensor, new: Tensor, slot_mapping: Tensor, *, scale: Optional[Tensor] = None) -> None:
    """Owner-only KV append: cache [num_blocks, block_size, *E] gets new[t] [*E] at flat slot slot_mapping[t] [T].

    Slot -1 (a token another rank owns) is skipped; any other slot outside [0, num_blocks * block_size) is an error.
    One call per cache tensor (GQA: K and V). Any dtype, equal for cache and new; or a torch.float8_e4m3fn cache with
    a float new and its scale, a 1-element fp32 tensor on the cache's device (vLLM's k_scale / v_scale): the cache then
    stores new / scale, saturated to +-448 and rounded to nearest even (NaN stays NaN), so that stored x scale is the
    dequantized value.
    """
    _ops.write_kv(cache, new, slot_mapping, scale=scale)


# Fake (meta) kernels so torch.compile and FakeTensor can trace the ops. They also run when an eager call mixes a meta
# tensor with real ones (dispatch picks Meta), so each first checks that every tensor argument is on one device, as the
# native validators do (those cannot run here: they call sizes(), which symbolic shapes do not have).
def _same_device(op: str, ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise RuntimeError(f"{op}: {name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


@torch.library.register_fake("dcp_ops::gqa_decode_partial")
def _gqa_fake(q, k_cache, v_cache, block_table, seq_lens, scale, precision="native", cu_seqlens_q=None, k_scale=None,
              v_scale=None):
    _same_device("gqa_decode_partial", "q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                 seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q, k_scale=k_scale, v_scale=v_scale)
    T, H, D = q.shape
    return q.new_empty((T, H, D)), q.new_empty((T, H), dtype=torch.float32)


@torch.library.register_fake("dcp_ops::mla_decode_partial")
def _mla_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, w_uk=None, w_uv=None, precision="native",
              cu_seqlens_q=None, kv_scale=None):
    _same_device("mla_decode_partial", "q_nope", q_nope, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table,
                 seq_lens=seq_lens, w_uk=w_uk, w_uv=w_uv, cu_seqlens_q=cu_seqlens_q, kv_scale=kv_scale)
    T, H, _ = q_nope.shape
    d_out = w_uv.shape[-1] if w_uv is not None else kv_cache.shape[-1] - q_pe.shape[-1]
    return q_nope.new_empty((T, H, d_out)), q_nope.new_empty((T, H), dtype=torch.float32)


@torch.library.register_fake("dcp_ops::merge_partials")
def _merge_fake(outs, lses, lse_base=math.e, nonfinite_lse="empty"):
    _same_device("merge_partials", "outs", outs, lses=lses)
    _, T, H, D = outs.shape
    return outs.new_empty((T, H, D)), lses.new_empty((T, H))


@torch.library.register_fake("dcp_ops::correct_partial")
def _correct_fake(out, lses, rank, lse_base=math.e, nonfinite_lse="empty"):
    _same_device("correct_partial", "out", out, lses=lses)
    return lses.new_empty(lses.shape[1:])


@torch.library.register_fake("dcp_ops::pack_exchange")
def _pack_fake(out, lse, send):
    _same_device("pack_exchange", "out", out, lse=lse, send=send)
    return None


@torch.library.register_fake("dcp_ops::merge_exchange")
def _merge_exchange_fake(recv, out, lse, nonfinite_lse="empty"):
    _same_device("merge_exchange", "recv", recv, out=out, lse=lse)
    return None


@torch.library.register_fake("dcp_ops::write_kv")
def _write_kv_fake(cache, new, slot_mapping, scale=None):
    _same_device("write_kv", "cache", cache, new=new, slot_mapping=slot_mapping, scale=scale)
    return None
