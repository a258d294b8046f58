"""Hugging Face Llama (GQA) and DeepSeek-V3 (MLA) decoding with DCP: every layer's attention through
dcp_ops.dcp_attention over N ranks, token for token against the model's own `generate`.

Each model is built from its `transformers` config with seeded random weights (nothing is downloaded). Every rank
runs the same model (projections, norms, MoE and MLP stay the model's own code) and holds 1/N of the KV cache:

  1. prefill: the model's own forward over the prompt; its cache holds the prompt's KV (GQA: rotated K and V;
     DeepSeek-V3: the normalised latent and the rotated k_pe), which each rank writes to its paged shard, owner-only,
     with Placement.slot_mapping + write_kv (the engine path);
  2. each decode step: the new token's KV is written to its owner the same way, then every layer attends through
     dcp_attention (an attention function registered with transformers' AttentionInterface). The query is gathered
     over heads before absorption (MLA: q_nope + rope, w_uk / w_uv being kv_b_proj's K and V parts).

The decode is teacher-forced with the model's own greedy tokens, so both runs see the same inputs at every step: the
generated tokens are identical when DCP's argmax equals the model's at every step. Printed per model, world size and
mode: that verdict (or the first step where the argmax differs), the largest logit difference, the KV bytes per rank
against an unsharded cache, and the time per step.

    python -m dcp_ops generate [--world 2] [--mode all] [--dtype float32] [--steps 8] [--interleave 1]
                               [--spec-tokens 0] [--device cpu]
"""
import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):  # run as a script from a checkout: the package is the directory above
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dcp_ops  # noqa: E402

FAMILIES = ("llama", "deepseek_v3")
MODES = ("a2a", "ag_rs", "ag")
BLOCK_SIZE = 16


def build_model(family: str, dtype: torch.dtype, seed: int = 0):
    """A small model of the family with seeded random weights (dims the CUDA kernels take too)."""
    import transformers
    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                                       max_position_embeddings=512)
        model = transformers.LlamaForCausalLM(cfg)
    else:  # DeepSeek-V3's structure: q / kv low-rank projections, kv_a_layernorm, decoupled RoPE with YaRN, MoE
        cfg = transformers.DeepseekV3Config(
            vocab_size=256, hidden_size=96, intermediate_size=192, moe_intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=6, q_lora_rank=48, kv_lora_rank=128, qk_nope_head_dim=32,
            qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, max_position_embeddings=512,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
        model = transformers.DeepseekV3ForCausalLM(cfg)
    return model.to(dtype).eval()


class DcpAttention:
    """This rank's state for one decode step, and the attention function transformers calls for every layer."""

    def __init__(self, model, family: str, group, placement: dcp_ops.Placement, mode: str, block_table: torch.Tensor,
                 num_blocks: int, dtype: torch.dtype, device: torch.device):
        self.family, self.group, self.placement, self.mode = family, group, placement, mode
        self.table = block_table
        self.active = False
        self.latent: Dict[int, torch.Tensor] = {}
        self.caches: List[tuple] = []
        self.w: List[tuple] = []
        self.step: Optional[tuple] = None  # (slots, local lengths) of the current step
        for layer in model.model.layers:
            a = layer.self_attn
            if family == "llama":
                kv_shape = (num_blocks, BLOCK_SIZE, a.config.num_key_value_heads, a.head_dim)
                self.caches.append((torch.full(kv_shape, float("nan"), dtype=dtype, device=device),
                                    torch.full(kv_shape, float("nan"), dtype=dtype, device=device)))
            else:
                self.caches.append((torch.full((num_blocks, BLOCK_SIZE, a.kv_lora_rank + a.qk_rope_head_dim),
                                               float("nan"), dtype=dtype, device=device),))
                w = a.kv_b_proj.weight.detach().view(a.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
                self.w.append((w[:, :a.qk_nope_head_dim].contiguous(),                     # w_uk [H, nope, latent]
                               w[:, a.qk_nope_head_dim:].transpose(1, 2).contiguous()))    # w_uv [H, latent, v]
                # the normalised latent of the tokens in flight, read by __call__
                a.kv_a_layernorm.register_forward_hook(
                    lambda mod, inp, out, i=a.layer_idx: self.latent.__setitem__(i, out.detach()))

    def write(self, layer: int, positions: torch.Tensor, seq_ids: torch.Tensor, k_rows: torch.Tensor,
              v_rows: Optional[torch.Tensor]) -> None:
        """Owner-only append of tokens at global `positions` of requests `seq_ids` (k_rows [T, ...])."""
        slots = self.placement.slot_mapping(self.table, seq_ids, positions)
        dcp_ops.write_kv(self.caches[layer][0], k_rows, slots)
        if v_rows is not None:
            dcp_ops.write_kv(self.caches[layer][1], v_rows, slots)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if not self.active:  # prefill: the model's own attention
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
        i = module.layer_idx
        positions, seq_ids, lens, cu = self.step  # S tokens per sequence: the step's token (and its drafts)
        B, H, S = query.shape[:3]
        flat = lambda x: x.transpose(1, 2).flatten(0, 1)  # noqa: E731  [B, heads, S, d] -> [B * S, heads, d]
        if self.family == "llama":  # key / value: this step's tokens only (the model runs without its own cache)
            self.write(i, positions, seq_ids, flat(key), flat(value))
            shard = dcp_ops.GQAShard(*self.caches[i], self.table, lens, scaling, cu, placement=self.placement)
        else:  # the latent from kv_a_layernorm, the rotated k_pe from the expanded key's rope part
            nope = module.qk_nope_head_dim
            row = torch.cat([self.latent[i].flatten(0, 1), key[:, 0, :, nope:].flatten(0, 1)], -1)
            self.write(i, positions, seq_ids, row, None)
            shard = dcp_ops.MLAShard(self.caches[i][0], self.table, lens, scaling, module.qk_rope_head_dim,
                                     *self.w[i], cu, placement=self.placement)
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        h_loc = H // n
        q = flat(query[:, r * h_loc:(r + 1) * h_loc]).contiguous()  # this rank's heads; dcp_attention gathers them
        out = dcp_ops.dcp_attention(q, shard, self.group, mode=self.mode)
        if self.mode != "ag":  # a replicated model needs every head: gather the ranks' slices, rank-major
            parts = [torch.empty_like(out) for _ in range(n)]
            dist.all_gather(parts, out, group=self.group)
            out = torch.cat(parts, 1)
        return out.view(B, S, H, -1), None  # [B, S, H, D_v], as transformers' attention functions return


def _prompt_kv(model, family: str, cache) -> List[tuple]:
    """(K rows, V rows or None) per layer of the prefill cache, [B, L, ...] in the paged caches' row layout."""
    rows = []
    for layer in cache.layers:
        if family == "llama":
            rows.append((layer.keys.transpose(1, 2), layer.values.transpose(1, 2)))  # [B, L, H_kv, D]
        else:  # DeepSeek-V3's cache holds the latent [B, 1, L, r] and the rotated k_pe [B, 1, L, rope]
            rows.append((torch.cat([layer.keys[:, 0], layer.values[:, 0]], -1), None))
    return rows


def run(family: str, world: int, rank: int, group, mode: str, dtype: torch.dtype, steps: int, interleave: int,
        batch: int = 3, prompt_len: int = 21, seed: int = 0, device: torch.device = torch.device("cpu"),
        spec: int = 0) -> dict:
    """One rank's DCP decode of `steps` tokens, teacher-forced with the model's own greedy tokens. spec > 0: each
    step verifies `spec` draft tokens (the model's own next tokens, so all accepted) with the step's token: multi-token
    decode of 1 + spec queries per sequence, each causal by its global position."""
    import transformers
    model = build_model(family, dtype, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    with torch.no_grad():
        own = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    own_tokens = own.sequences[:, prompt_len:]
    total = prompt_len + steps
    per_block = BLOCK_SIZE * world  # a block-table entry is a virtual block of BLOCK_SIZE * world tokens
    max_blocks = -(-total // per_block)
    table = torch.arange(batch * max_blocks, dtype=torch.int32, device=device).view(batch, max_blocks)
    placement = dcp_ops.Placement(world, rank, BLOCK_SIZE, interleave)
    attn = DcpAttention(model, family, group, placement, mode, table, batch * max_blocks, dtype, device)
    transformers.AttentionInterface.register("dcp_ops", attn)
    model.set_attn_implementation("dcp_ops")
    seq_ids = torch.arange(batch, device=device).repeat_interleave(prompt_len)
    positions = torch.arange(prompt_len, device=device).repeat(batch)
    with torch.no_grad():
        pre = model(prompt, use_cache=True)  # the model's own prefill (attn.active is False)
        for i, (k_rows, v_rows) in enumerate(_prompt_kv(model, family, pre.past_key_values)):
            attn.write(i, positions, seq_ids, k_rows.flatten(0, 1),
                       v_rows.flatten(0, 1) if v_rows is not None else None)
        attn.active = True
        logits, diverged, t0 = [pre.logits[:, -1].float()], None, time.perf_counter()
        s, n_steps = 1, 0
        while s < steps:  # inputs: own_tokens[s - 1 ..] at positions prompt_len + s - 1 .., predicting tokens s ..
            S = min(1 + spec, steps - s)
            pos = prompt_len + s - 1 + torch.arange(S, device=device)  # [S]
            positions = pos.repeat(batch)  # sequence-major, as cu_seqlens_q counts them
            attn.step = (positions, torch.arange(batch, device=device).repeat_interleave(S),
                         placement.local_causal_lens(positions),
                         torch.arange(0, batch * S + 1, S, dtype=torch.int32, device=device))
            out = model(own_tokens[:, s - 1:s - 1 + S], position_ids=pos.expand(batch, S), use_cache=False)
            logits.extend(out.logits[:, j].float() for j in range(S))
            s, n_steps = s + S, n_steps + 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        per_step = (time.perf_counter() - t0) / max(n_steps, 1)
    ours = torch.stack(logits, 1).cpu()  # [B, steps, vocab]
    theirs = torch.stack([x.float() for x in own.logits], 1).cpu()
    own_tokens, prompt = own_tokens.cpu(), prompt.cpu()
    agree = ours.argmax(-1) == own_tokens
    if not bool(agree.all()):
        diverged = int((~agree).any(0).nonzero()[0, 0])
    kv_local = sum(c.numel() * c.element_size() for cs in attn.caches for c in cs)
    return dict(family=family, world=world, mode=mode, identical=diverged is None, diverged=diverged,
                max_logit_diff=float((ours - theirs).abs().max()), kv_bytes_rank=kv_local,
                kv_bytes_unsharded=kv_local * world, ms_per_step=per_step * 1e3, logits=ours, tokens=own_tokens,
                prompt=prompt)


def _worker(rank: int, world: int, init_file: Optional[str], args, results) -> None:
    """One rank: init_file names the file:// store of spawned ranks; None means a launcher's env:// variables."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) if init_file is None else rank
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            init_method="env://" if init_file is None else f"file://{init_file}", rank=rank,
                            world_size=world)
    for family in args.family:
        for mode in args.mode:
            res = run(family, world, rank, None, mode, getattr(torch, args.dtype), args.steps, args.interleave,
                      device=device, spec=args.spec_tokens)
            if rank == 0:
                results.append({k: v for k, v in res.items() if k not in ("logits", "tokens", "prompt")})
    dist.barrier()
    dist.destroy_process_group()
    if init_file is not None:
        # A spawned rank leaves without the interpreter's finalization, where gloo's threads now and then abort the
        # process ("terminate called without an active exception", SIGABRT after the work is done; the class of
        # exit crash of pytorch/pytorch#179291). Its results went to the parent through `results` already.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcp_ops generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="DCP ranks: CPU processes over gloo, or GPUs over NCCL")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--mode", default="all", choices=MODES + ("all",))
    p.add_argument("--family", default="all", choices=FAMILIES + ("all",))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--interleave", type=int, default=1, help="KV interleave; must divide the block size (16)")
    p.add_argument("--spec-tokens", type=int, default=0,
                   help="verify this many draft tokens per step (multi-token decode; the drafts are the model's own)")
    args = p.parse_args(argv)
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))  # torchrun
    if launched:
        args.world = int(os.environ["WORLD_SIZE"])
    if args.world < 1 or 6 % args.world:
        p.error(f"--world must divide the models' 6 attention heads (1, 2, 3 or 6), got {args.world}")
    if args.interleave < 1 or BLOCK_SIZE % args.interleave:
        p.error(f"--interleave must divide the block size {BLOCK_SIZE}, got {args.interleave}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.spec_tokens < 0:
        p.error(f"--spec-tokens must be >= 0, got {args.spec_tokens}")
    if args.device == "cuda" and torch.cuda.device_count() < args.world and not launched:
        p.error(f"--device cuda needs one GPU per rank: {args.world} ranks, {torch.cuda.device_count()} GPUs visible")
    args.mode = MODES if args.mode == "all" else (args.mode,)
    args.family = FAMILIES if args.family == "all" else (args.family,)
    if launched:  # this process is one rank of the launcher's group; rank 0 prints
        rows = []
        _worker(int(os.environ["RANK"]), args.world, None, args, rows)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        with tempfile.TemporaryDirectory() as d, mp.Manager() as manager:
            results = manager.list()
            mp.spawn(_worker, args=(args.world, os.path.join(d, "store"), args, results), nprocs=args.world)
            rows = list(results)
    where = "GPU ranks (NCCL)" if args.device == "cuda" else "CPU ranks (gloo)"
    print(f"Hugging Face models, every layer's attention through dcp_attention on {args.world} {where}, "
          f"{args.dtype}, {args.steps} tokens, interleave {args.interleave}"
          + (f", {args.spec_tokens} draft tokens verified per step" if args.spec_tokens else ""))
    print(f"{'model':12} {'mode':6} {'tokens':24} {'max |logit diff|':>16} {'KV/rank':>9} {'unsharded':>9} "
          f"{'ms/step':>8}")
    ok = True
    for r in rows:
        verdict = "identical to generate" if r["identical"] else f"argmax differs at step {r['diverged']}"
        ok &= r["identical"] or args.dtype != "float32"
        print(f"{r['family']:12} {r['mode']:6} {verdict:24} {r['max_logit_diff']:16.3e} "
              f"{r['kv_bytes_rank'] / 1024:8.1f}K {r['kv_bytes_unsharded'] / 1024:8.1f}K {r['ms_per_step']:8.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
