"""MLA attention (DeepSeek-V3, GLM-4.7-Flash): a verify over k+1 positions
computes what k+1 one-position decode steps compute, so greedy speculation
emits plain decoding's tokens also in bf16, where mlx-lm's two forms (latent
space for one position, decompressed keys and values for several) differ by
whole bf16 steps."""

import mlx.core as mx
import numpy as np
import pytest

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.decode.cache import make_slot_caches
from mtplx.decode.passes import SlotPass
from mtplx.testing import tiny_checkpoint

MLA_FAMILIES = ["deepseek_v3", "glm4_moe_lite"]


@pytest.fixture(scope="module", params=MLA_FAMILIES)
def bf16_model(request, tmp_path_factory):
    model = mtplx.load(tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), vocab_size=48))
    model.trunk.set_dtype(mx.bfloat16)  # as the releases ship
    model.head.set_dtype(mx.bfloat16)
    MTPLXRuntime(model, MTPContract(depth=2), max_batch=2)  # the runtime's adaptations, MLA's one form among them
    return model


def _logits(model, prompt, tokens, widths):
    """Logits of `tokens` fed after `prompt` in passes of the given widths."""
    caches = make_slot_caches(model.layer_kinds, 1)
    model.forward(mx.array([prompt]), caches)
    out, at = [], 0
    for T in widths:
        logits, _ = SlotPass(model.forward, keep_pending=T > 1)((mx.array([tokens[at : at + T]]),), caches, T=T)
        out.append(logits[0])  # [T, V]
        at += T
    return mx.concatenate(out, axis=0).astype(mx.float32)  # [len(tokens), V]


def test_a_verify_computes_the_logits_of_one_position_decode_steps(bf16_model):
    rng = np.random.default_rng(3)
    prompt, tokens = rng.integers(1, 48, 9).tolist(), rng.integers(1, 48, 4).tolist()
    steps = _logits(bf16_model, prompt, tokens, [1, 1, 1, 1])
    verify = _logits(bf16_model, prompt, tokens, [4])
    assert mx.abs(verify - steps).max().item() <= 1e-3  # the two forms differed by whole bf16 steps


def test_greedy_speculation_emits_plain_decodings_tokens_in_bf16(bf16_model):
    prompts = np.random.default_rng(5).integers(1, 48, (6, 7)).tolist()
    plain = MTPLXRuntime(bf16_model, MTPContract(depth=0), max_batch=3).generate(prompts, max_tokens=20)
    for depth in (1, 3):
        spec = MTPLXRuntime(bf16_model, MTPContract(depth=depth), max_batch=3).generate(prompts, max_tokens=20)
        assert [o.tokens for o in spec] == [o.tokens for o in plain], f"depth {depth}"
