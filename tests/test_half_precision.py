"""bf16 checkpoints, as the releases ship. Speculative greedy output is
MTPLX's plain greedy output token for token in every family, and that is
mlx-lm's greedy decoding token for token. mlx-lm's greedy rule is MTPLX's:
the lowest id among the largest bf16 log-probabilities, which ties logits a
bf16 step apart.

Bit for bit with mlx-lm needs each position computed in the same form. Its
prompt pass stops one token short and feeds the last prompt token as a
one-position step; a prompt pass over the whole prompt rounds that position
differently, and on a bf16 DeepSeek-V3 checkpoint greedy decoding then left
mlx-lm's on 7 of 40 prompts (`mtplx.prefill.last_token_step`)."""

import mlx.core as mx
import numpy as np
import pytest
from exactness import assert_same_up_to_ties, on_gpu
from model_helpers import bf16_checkpoint, make_predictable, mlx_lm_greedy

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.decode.sampling import greedy_tokens

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]
VOCAB = 48


def assert_same(reference, prompts, got, want, what):
    """Token for token on the CPU; on a GPU, up to near-ties of the reference (tests/exactness.py)."""
    if not on_gpu():
        assert got == want, what
        return
    ties = []
    for p, g, w in zip(prompts, got, want):
        assert_same_up_to_ties(reference, p, g, w, ties)
    if ties:
        print(f"{what}: near-ties met: {ties}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_on_a_bf16_checkpoint_emits_mlx_lm_greedy_tokens(tmp_path, family):
    path = bf16_checkpoint(family, tmp_path / family)
    model, reference = mtplx.load(path), mtplx.load(path)
    for m in (model, reference):  # a head that drafts right often, so that commits of accepted drafts run
        make_predictable(m)
    assert model.forward(mx.array([[1, 2]]))[0].dtype == mx.bfloat16
    rng = np.random.default_rng(1)
    # Lengths 1-60 and 130. When the prompt pass computed the last prompt
    # token, 2 of these left mlx-lm's decoding on the deepseek_v3
    # checkpoint and 2 on the glm4_moe_lite one.
    prompts = [rng.integers(1, VOCAB, size=int(n)).tolist() for n in rng.integers(1, 61, size=22)] + [
        rng.integers(1, VOCAB, size=130).tolist(),
        [5],
    ]
    # One prompt at a time against mlx-lm: prefilled with other prompts, a
    # bf16 mixture of experts can round an output one bf16 step apart (a
    # qwen3_next checkpoint at batch 4: a logit of 1.234 where mlx-lm had
    # 1.25, one step under the top), and greedy then flips there.
    alone = [o.tokens for o in MTPLXRuntime(model, MTPContract(depth=0), max_batch=1).generate(prompts, max_tokens=16)]
    assert_same(reference, prompts, alone, [mlx_lm_greedy(reference, p, 16) for p in prompts], "depth 0 alone")
    plain = [o.tokens for o in MTPLXRuntime(model, MTPContract(depth=0), max_batch=4).generate(prompts, max_tokens=16)]
    for depth in (1, 3):
        for B, want in ((1, alone), (4, plain)):
            spec = MTPLXRuntime(model, MTPContract(depth=depth), max_batch=B).generate(prompts, max_tokens=16)
            assert_same(reference, prompts, [o.tokens for o in spec], want, f"depth {depth}, batch {B}")
        drafted, accepted = (sum(getattr(o, f)[0] for o in spec) for f in ("drafted_by_depth", "accepted_by_depth"))
        assert accepted > 0.2 * drafted, f"depth {depth}: d_1 was rarely accepted"


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
