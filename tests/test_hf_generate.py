"""examples/hf_generate.py: Hugging Face Llama (GQA) and DeepSeek-V3 (MLA) decoding with every layer's attention
through dcp_attention on gloo ranks, against the model's own generate. fp32: the same greedy tokens at world 2 and
3, every mode, interleave 1 and 2. bf16: logits as close to the fp32 model's as the model's own bf16 run."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="transformers is installed by scripts/setup.sh")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import hf_generate  # noqa: E402
from conftest import init_gloo, spawn_ranks  # noqa: E402


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_fp32_tokens_identical_to_generate_in_every_mode(world, interleave, capsys):
    assert hf_generate.main(["--world", str(world), "--interleave", str(interleave), "--steps", "6"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(hf_generate.FAMILIES)]
    assert len(rows) == 2 * 3, rows  # two models x three modes
    assert all("identical to generate" in row for row in rows), rows


@pytest.mark.parametrize("world,spec", [(2, 1), (3, 3)])
def test_fp32_speculative_verification_is_causal_across_shards(world, spec, capsys):
    """Each step verifies `spec` draft tokens with the step's token (multi-token decode): the draft queries see only
    the keys up to their own positions on every rank, so the logits, and the tokens, are the model's own."""
    assert hf_generate.main(["--world", str(world), "--interleave", "2", "--steps", "8", "--spec-tokens",
                             str(spec)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(hf_generate.FAMILIES)]
    assert len(rows) == 6 and all("identical to generate" in row for row in rows), rows


def _bf16_worker(rank, world, init_file):
    init_gloo(rank, world, init_file)
    for family in hf_generate.FAMILIES:
        res = hf_generate.run(family, world, rank, None, "a2a", torch.bfloat16, 6, 1)
        # the fp32 model (same weights; DeepSeek-V3's MoE has no float64 path) on the same tokens: the logits both
        # bf16 runs approximate, 1e-6-close to exact where bf16 is off by 1e-2
        model = hf_generate.build_model(family, torch.float32)
        seq = torch.cat([res["prompt"], res["tokens"]], 1)
        with torch.no_grad():
            exact = model(seq).logits[:, res["prompt"].shape[1] - 1:-1].double()
        own = hf_generate.build_model(family, torch.bfloat16)
        with torch.no_grad():
            own_logits = own(seq).logits[:, res["prompt"].shape[1] - 1:-1].double()
        err = (res["logits"].double() - exact).abs().max().item()
        base = (own_logits - exact).abs().max().item()
        assert err <= 2 * base + 1e-3, f"{family} rank {rank}: DCP bf16 logits off by {err:.3g}, the model's own " \
                                       f"bf16 by {base:.3g}"
    dist.barrier()
    dist.destroy_process_group()


def test_bf16_logits_as_accurate_as_the_models_own():
    spawn_ranks(_bf16_worker, 2)


def test_generate_rejects_bad_options(capsys):
    for argv, msg in ((["--world", "4"], "--world must divide the models' 6 attention heads"),
                      (["--interleave", "3"], "--interleave must divide the block size 16"),
                      (["--steps", "0"], "--steps must be >= 1"),
                      (["--spec-tokens", "-1"], "--spec-tokens must be >= 0"),
                      (["--device", "cuda", "--world", "6"], "--device cuda needs one GPU per rank")):
        with pytest.raises(SystemExit):
            hf_generate.main(argv)
        assert msg in capsys.readouterr().err
