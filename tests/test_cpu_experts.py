"""Half-precision mixture-of-experts checkpoints decode on the CPU backend,
whose gathered expert matmul runs in float32 only."""

import mlx.core as mx
import pytest

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.testing import tiny_checkpoint

PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe"])
def test_a_bf16_moe_model_decodes_and_speculation_matches_plain_decoding(tmp_path, family):
    model = mtplx.load(tiny_checkpoint(family, tmp_path / family, vocab_size=48))
    model.trunk.set_dtype(mx.bfloat16)  # as DeepSeek-V3 and GLM ship
    model.head.set_dtype(mx.bfloat16)
    plain = MTPLXRuntime(model, MTPContract(depth=0), max_batch=2).generate(PROMPTS, max_tokens=8)
    assert model.info["float32_experts"] > 0
    spec = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2).generate(PROMPTS, max_tokens=8)
    assert all(o.error is None for o in plain + spec)
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    hidden = model.forward(mx.array([PROMPTS[1]]))[1]
    assert hidden.dtype == mx.bfloat16  # only the experts compute in float32


def test_a_bf16_moe_checkpoint_runs_forward_and_head_straight_after_loading(tmp_path):
    from mtplx.models.convert import convert

    src = tiny_checkpoint("deepseek_v3", tmp_path / "src", vocab_size=48)
    dst = tmp_path / "bf16"
    convert(src, dst, dtype="bfloat16", progress=False)  # as DeepSeek-V3 ships
    model = mtplx.load(dst)
    assert model.info["float32_experts"] > 0
    tokens = mx.array([PROMPTS[1]])
    logits, hidden = model.forward(tokens)
    head_logits, _ = model.head(hidden, tokens)
    mx.eval(logits, head_logits)
    assert logits.dtype == mx.bfloat16 and mx.all(mx.isfinite(head_logits)).item()
