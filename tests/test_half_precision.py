"""bf16 checkpoints, as the releases ship. Speculative greedy output is
MTPLX's plain greedy output token for token in every family; in the Qwen
families (whose decode steps now take the gated-delta layer's own Conv1d in
half precision) and on these prompts in the others, it is also mlx-lm's.
mlx-lm's greedy rule is MTPLX's: the lowest id among the largest bf16
log-probabilities, which ties logits a bf16 step apart.

Not bit for bit in general: mlx-lm feeds the last prompt token as a
one-position step, MTPLX computes it in the prompt pass, and in bf16 the two
forms can round a logit one step apart (seen on a glm4_moe_lite checkpoint:
a divergence from mlx-lm at a top-2 gap of one bf16 step)."""

import glob

import mlx.core as mx
import numpy as np
import pytest

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.sampling import greedy_tokens
from mtplx.testing import tiny_checkpoint

from model_helpers import mlx_lm_greedy

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]
# Token for token with mlx-lm's greedy decoding on these prompts (see above).
MATCHES_MLX_LM = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "mimo"}
VOCAB = 48


def bf16_checkpoint(family, path):
    path = tiny_checkpoint(family, path, vocab_size=VOCAB, max_position_embeddings=300)
    for f in glob.glob(str(path / "*.safetensors")):
        tensors = mx.load(f)
        mx.save_safetensors(f, {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in tensors.items()},
                            metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_on_a_bf16_checkpoint_emits_plain_decodings_tokens(tmp_path, family):
    path = bf16_checkpoint(family, tmp_path / family)
    model = mtplx.load(path)
    assert model.forward(mx.array([[1, 2]]))[0].dtype == mx.bfloat16
    prompts = [np.random.default_rng(5).integers(1, VOCAB, size=n).tolist() for n in (9, 130, 40)]
    plain = [o.tokens for o in MTPLXRuntime(model, MTPContract(depth=0), max_batch=2).generate(prompts, max_tokens=24)]
    if family in MATCHES_MLX_LM:
        reference = mtplx.load(path)
        assert plain == [mlx_lm_greedy(reference, p, 24) for p in prompts]
    for depth in (1, 3):
        spec = MTPLXRuntime(model, MTPContract(depth=depth), max_batch=2).generate(prompts, max_tokens=24)
        assert [o.tokens for o in spec] == plain, f"depth {depth}"


def test_greedy_takes_the_lowest_id_among_tied_bf16_log_probabilities():
    # 48 logits near 0.5: their log-probabilities (about -3.4) are on a grid
    # four times coarser than the logits, so a logit one step above the
    # others ties with them after the subtraction.
    values = [0.5] * 48
    values[3] = 0.50390625  # one bf16 step above 0.5
    logits = mx.array([values], dtype=mx.bfloat16)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert logprobs[0, 0].item() == logprobs[0, 3].item()  # the premise: a tie in bf16
    assert int(mx.argmax(logits, -1)[0]) == 3
    assert int(greedy_tokens(logits)[0]) == int(mx.argmax(logprobs, -1)[0]) == 0  # mlx-lm's choice
    assert int(greedy_tokens(logits.astype(mx.float32))[0]) == 3  # float32: the top logit
