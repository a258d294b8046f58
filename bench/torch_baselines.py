"""The plain-torch ways a user computes the benchmarked ops from the same paged cache without dcp_ops: gather the
pages, then bmm + softmax or scaled_dot_product_attention; the merge as logsumexp and a weighted sum.

Device-agnostic: bench_cpu.py times them on the CPU, gpu/bench_cuda.py on the GPU. Every sequence of a benchmark row
is L tokens long, so none needs a mask. `dt` is the dtype the matmuls run in (an engine's bf16 path rounds the
absorbed query and the probabilities to bf16).
"""
import torch
import torch.nn.functional as F


def gather(cache, table, L):
    """What plain torch must do with a paged cache: gather the pages into [B, L, ...]."""
    B = table.shape[0]
    return cache[table.long()].reshape(B, -1, *cache.shape[2:])[:, :L]


def gqa_bmm(q, k, v, table, L, scale, dt):
    """q [B, Hq, D], k / v [blocks, block_size, Hkv, D] -> [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    K = gather(k, table, L).to(dt).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    V = gather(v, table, L).to(dt).transpose(1, 2)  # [B, Hkv, L, D]
    s = torch.matmul(q.to(dt).view(B, Hkv, Hq // Hkv, D), K) * scale
    return torch.matmul(torch.softmax(s.float(), -1).to(dt), V).view(B, Hq, D)


def gqa_sdpa(q, k, v, table, L, scale):
    B, Hq, D = q.shape
    K = gather(k, table, L).transpose(1, 2)
    V = gather(v, table, L).transpose(1, 2)
    return F.scaled_dot_product_attention(q.view(B, Hq, 1, D), K, V, scale=scale, enable_gqa=True).view(B, Hq, D)


def mla_absorbed(q_nope, q_pe, w_uk, dt):
    """The query in latent space, [B, H, latent + rope]: q_nope absorbed by w_uk [H, d_nope, latent] when given."""
    ql = q_nope.to(dt)
    if w_uk is not None:
        ql = torch.bmm(ql.transpose(0, 1), w_uk.to(dt)).transpose(0, 1)
    return torch.cat([ql, q_pe.to(dt)], -1)


def _up(out, w_uv):
    """[B, H, latent] -> [B, H, d_v] by w_uv [H, latent, d_v] when given."""
    return out if w_uv is None else torch.bmm(out.transpose(0, 1), w_uv.to(out.dtype)).transpose(0, 1)


def mla_bmm(q_nope, q_pe, kv, table, L, scale, w_uk, dt, w_uv=None):
    """kv [blocks, block_size, latent + rope] -> [B, H, latent] (or [B, H, d_v] with w_uv)."""
    latent = kv.shape[-1] - q_pe.shape[-1]
    K = gather(kv, table, L).to(dt)  # [B, L, latent + rope]
    s = torch.bmm(mla_absorbed(q_nope, q_pe, w_uk, dt), K.transpose(1, 2)) * scale
    return _up(torch.bmm(torch.softmax(s.float(), -1).to(dt), K[..., :latent]), w_uv)


def mla_sdpa(q_nope, q_pe, kv, table, L, scale, w_uk, w_uv=None):
    latent = kv.shape[-1] - q_pe.shape[-1]
    K = gather(kv, table, L)[:, None]  # one latent KV head; the H query heads act as H query rows
    q = mla_absorbed(q_nope, q_pe, w_uk, kv.dtype)[:, None]
    return _up(F.scaled_dot_product_attention(q, K, K[..., :latent], scale=scale)[:, 0], w_uv)


def merge(outs, lses):
    """outs [N, ...rows, D], lses [N, ...rows] (fp32) -> (out in outs' dtype, lse)."""
    m = torch.logsumexp(lses, 0)
    return (torch.exp(lses - m)[..., None] * outs.float()).sum(0).to(outs.dtype), m
