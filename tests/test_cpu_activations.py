"""SwiGLU over a polynomial exp for the CPU backend (mtplx.backends.cpu.activations):
close to MLX's exp everywhere, and models that compute what mlx-lm computes."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mtplx
from mtplx.backends.cpu.activations import fast_attention, fast_exp, fast_swiglu, use_fast_activations
from mtplx.testing import tiny_checkpoint

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the swap is for the CPU backend")

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]


def test_fast_exp_is_within_3e_7_of_exp_over_the_float32_range_and_saturates_outside():
    x = np.concatenate([np.linspace(-87, 88, 200_001), np.random.default_rng(0).normal(0, 5, 100_000)])
    got = np.array(fast_exp(mx.array(x.astype(np.float32)))).astype(np.float64)
    want = np.exp(x.astype(np.float32).astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 3e-7  # MLX's own CPU exp: 3.9e-6
    edges = np.array(fast_exp(mx.array([-1e4, -np.inf, 1e4, np.inf, np.nan], dtype=mx.float32)))
    assert edges[0] == edges[1] == 0 and np.isfinite(edges[2]) and edges[2] == edges[3] > 1e38
    assert np.isnan(edges[4])


def test_pow_exp_is_as_close_to_exp_as_mlxs_exp():
    from mtplx.backends.cpu.activations import pow_exp

    x = np.linspace(-87, 88, 200_001).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    for f, bound in ((pow_exp, 4e-6), (mx.exp, 4e-6)):
        got = np.array(f(mx.array(x))).astype(np.float64)
        assert np.max(np.abs(got - want) / want) < bound


def test_fast_swiglu_matches_mlx_lms_swiglu():
    from mlx_lm.models.activations import swiglu

    rng = np.random.default_rng(1)
    gate = mx.array(rng.normal(0, 4, (64, 300)).astype(np.float32))
    x = mx.array(rng.normal(0, 1, (64, 300)).astype(np.float32))
    np.testing.assert_allclose(np.array(fast_swiglu(gate, x)), np.array(swiglu(gate, x)), rtol=1e-5, atol=1e-6)
    saturated = np.array(fast_swiglu(mx.array([-200.0, 200.0]), mx.array([1.0, 1.0])))
    assert abs(saturated[0]) < 1e-30 and saturated[1] == 200.0


@pytest.mark.parametrize("B,Hq,Hkv,L,S", [(2, 4, 2, 1, 10), (3, 4, 2, 5, 12), (1, 4, 4, 7, 7)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "causal"])
@pytest.mark.parametrize("step", [False, True])
def test_fast_attention_matches_mlx_fast_attention(B, Hq, Hkv, L, S, mask_kind, step):
    rng = np.random.default_rng(L * S)
    q = mx.array(rng.normal(size=(B, Hq, L, 8)).astype(np.float32))
    k = mx.array(rng.normal(size=(B, Hkv, S, 8)).astype(np.float32))
    v = mx.array(rng.normal(size=(B, Hkv, S, 6)).astype(np.float32))
    mask = {
        "none": None,
        "bool": mx.array(rng.random((B, 1, L, S)) < 0.6) | (mx.arange(S) == 0),  # every query sees key 0
        "additive": mx.array(rng.normal(size=(B, 1, L, S)).astype(np.float32)),
        "causal": "causal",
    }[mask_kind]
    if mask_kind == "causal" and L > S:
        pytest.skip("a causal mask needs S >= L")
    got = fast_attention(q, k, v, 0.35, mask, step=step)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=mask)
    assert got.shape == want.shape and mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


def _causal_masks(B: int, L: int, S: int, pad: int):
    """A lower-right causal bool mask [L, S] and the same over rows whose
    first `pad` keys are left padding [B, 1, L, S] (mlx-lm's batch caches)."""
    causal = mx.arange(S)[None, :] <= (S - L + mx.arange(L))[:, None]  # [L, S]
    padded = causal[None, None] & (mx.arange(S) >= mx.array([pad * b for b in range(B)])[:, None, None, None])
    return causal, padded


@pytest.mark.parametrize("mask_kind", ["causal", "causal_array", "causal_padded", "bool", "additive", "none"])
def test_prompt_attention_in_query_blocks_matches_mlx_fast_attention(mask_kind):
    from mtplx.backends.cpu.activations import QUERY_BLOCK_MIN_ROWS, _query_block_rows

    B, Hq, Hkv, L, S, D = 2, 4, 2, 72, 90, 8  # queries at positions 18..89, the last block ragged
    rng = np.random.default_rng(7)
    q, k = (mx.array(rng.normal(size=(B, h, n, D)).astype(np.float32)) for h, n in ((Hq, L), (Hkv, S)))
    v = mx.array(rng.normal(size=(B, Hkv, S, 6)).astype(np.float32))
    causal, padded = _causal_masks(B, L, S, pad=5)
    mask = {
        "causal": "causal",
        "causal_array": causal,
        "causal_padded": padded,
        "bool": mx.array(rng.random((B, 1, L, S)) < 0.6) | (mx.arange(S) == 0),
        "additive": mx.array(rng.normal(size=(B, 1, L, S)).astype(np.float32)),
        "none": None,
    }[mask_kind]
    block_scores = B * Hq * QUERY_BLOCK_MIN_ROWS * S  # blocks of 16 query rows
    assert _query_block_rows(B, Hq, L, S, block_scores) == QUERY_BLOCK_MIN_ROWS
    got = fast_attention(q, k, v, 0.35, mask, causal=mask_kind.startswith("causal"), block_scores=block_scores)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=mask)
    assert got.shape == want.shape and mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


def test_a_causal_prompt_block_reads_no_key_after_its_last_query():
    # A value past a block's last query is masked for the whole block, yet
    # read it would turn the block's output NaN (0 x NaN): only the blocks
    # whose queries reach it may see it.
    B, H, L, D = 1, 2, 64, 8
    rng = np.random.default_rng(8)
    q, k = (mx.array(rng.normal(size=(B, H, L, D)).astype(np.float32)) for _ in range(2))
    v = np.array(rng.normal(size=(B, H, L, D)).astype(np.float32))
    v[:, :, 40] = np.nan  # position 40: the third block of 16 queries
    blocked = fast_attention(q, k, mx.array(v), 0.35, "causal", block_scores=B * H * 16 * L)
    finite = np.isfinite(np.array(blocked)).all(axis=(0, 1, 3))  # [L]
    assert finite[:32].all() and not finite[32:].any()
    whole = fast_attention(q, k, mx.array(v), 0.35, "causal")  # one block: every query reads every key
    assert not np.isfinite(np.array(whole)).any()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_prompt_pass_with_blocked_attention_computes_what_mlx_lm_computes(tmp_path, monkeypatch, family):
    import mtplx.backends.cpu.activations as activations

    path = tiny_checkpoint(family, tmp_path / family, vocab_size=48)
    model, reference = mtplx.load(path), mtplx.load(path)
    use_fast_activations(model)
    monkeypatch.setattr(activations, "QUERY_BLOCK_SCORES", 4096)  # several blocks at these sizes
    tokens = mx.array(np.random.default_rng(3).integers(1, 48, (3, 70)), dtype=mx.int32)
    got, want = model.make_cache(), reference.make_cache()
    for a, b in ((0, 40), (40, 70)):  # the second call's queries start at position 40
        ours, _ = model.forward(tokens[:, a:b], got)
        ref, _ = reference.forward(tokens[:, a:b], want)
        assert mx.allclose(ours, ref, rtol=1e-4, atol=1e-5).item()


@pytest.mark.parametrize("dims,traditional", [(2, False), (8, False), (8, True)])
@pytest.mark.parametrize("offset", ["int", "per_row"])
def test_rope_over_queries_and_keys_together_is_bit_identical_to_a_call_each(dims, traditional, offset):
    from mtplx.backends.cpu.activations import _rope_together

    rng = np.random.default_rng(dims)
    rope = nn.RoPE(dims, traditional=traditional, base=10000)
    q = mx.array(rng.normal(size=(3, 4, 5, 8)).astype(np.float32))
    k = mx.array(rng.normal(size=(3, 5, 2, 8)).astype(np.float32)).transpose(0, 2, 1, 3)  # a view, as in the layer
    kw = {"offset": 7} if offset == "int" else {"offset": mx.array([0, 13, 130], dtype=mx.int32)}
    got_q, got_k = _rope_together(rope, mx.concatenate([q, k], axis=1), 4, **kw)
    assert mx.array_equal(got_q, rope(q, **kw)).item() and mx.array_equal(got_k, rope(k, **kw)).item()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_query_and_key_norms_side_by_side_are_bit_identical_to_a_norm_each(tmp_path, family):
    from mtplx.backends.cpu.activations import _normed_heads

    model = mtplx.load(tiny_checkpoint(family, tmp_path / family, vocab_size=48))
    use_fast_activations(model)
    layers = [l.self_attn for l in model.text_model.layers if hasattr(l, "self_attn")]
    assert layers and all(hasattr(a, "qk_norm_weights") for a in layers)
    attn = layers[0]
    rng = np.random.default_rng(9)
    D, Hq, Hkv = attn.head_dim, attn.num_attention_heads, attn.num_key_value_heads
    # distinct weights per norm, so that a swapped or shared weight would show
    attn.q_norm.weight = mx.array(rng.normal(size=(D,)).astype(np.float32))
    attn.k_norm.weight = mx.array(rng.normal(size=(D,)).astype(np.float32))
    q = mx.array(rng.normal(0, 3, (2, 5, Hq, D)).astype(np.float32))
    k = mx.array(rng.normal(0, 3, (2, 5, Hkv, D)).astype(np.float32))
    want = mx.concatenate([attn.q_norm(q), attn.k_norm(k)], axis=2).transpose(0, 2, 1, 3)
    assert mx.array_equal(_normed_heads(attn, q, k), want).item()  # weights replaced: a norm each
    from mtplx.backends.cpu.activations import prepare_qk_norms

    prepare_qk_norms(model.trunk)
    assert attn.qk_norm_weights[0] is attn.q_norm.weight
    assert mx.array_equal(_normed_heads(attn, q, k), want).item()  # one norm over both, bit for bit


@pytest.mark.parametrize("family", FAMILIES)
def test_a_swapped_model_computes_what_mlx_lm_computes_and_other_loads_are_untouched(tmp_path, family):
    path = tiny_checkpoint(family, tmp_path / family, vocab_size=48)
    model, other = mtplx.load(path), mtplx.load(path)
    tokens = mx.array(np.random.default_rng(2).integers(1, 48, (4, 40)), dtype=mx.int32)  # a prompt pass
    logits, hidden = model.forward(tokens)
    head_logits, head_out = model.head(hidden, tokens)
    before = {type(m) for _, m in other.trunk.named_modules()}

    count = use_fast_activations(model)
    assert count > 0 and use_fast_activations(model) == count  # once
    assert any(type(m).__name__.startswith("Fast") for _, m in model.trunk.named_modules())
    assert {type(m) for _, m in other.trunk.named_modules()} == before
    new_logits, new_hidden = model.forward(tokens)
    new_head_logits, new_head_out = model.head(new_hidden, tokens)
    for got, want in (
        (new_logits, logits),
        (new_hidden, hidden),
        (new_head_logits, head_logits),
        (new_head_out, head_out),
    ):
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item()
    assert not mx.array_equal(new_logits, logits).item()  # the activations did change


def test_a_half_precision_model_keeps_mlx_lms_activations_bit_for_bit(tmp_path):
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "q", vocab_size=48))
    model.trunk.set_dtype(mx.bfloat16)
    model.head.set_dtype(mx.bfloat16)
    tokens = mx.array(np.random.default_rng(2).integers(1, 48, (2, 20)), dtype=mx.int32)
    logits, _ = model.forward(tokens)
    assert use_fast_activations(model) == 0
    assert not any(type(m).__name__.startswith("Fast") for _, m in model.trunk.named_modules())
    assert mx.array_equal(model.forward(tokens)[0], logits).item()


def test_decode_passes_take_the_power_form_at_every_batch_size_and_prompt_passes_the_polynomial():
    from mtplx.backends.cpu.activations import FAST_MIN_POSITIONS, conv_silu, fast_silu, step_silu

    step = mx.random.normal((64, FAST_MIN_POSITIONS - 1, 96))  # a wide batch, a verify's few positions
    prompt = mx.random.normal((1, FAST_MIN_POSITIONS, 96))
    assert mx.array_equal(conv_silu(step), step_silu(step)).item()
    assert all(mx.array_equal(conv_silu(step[b : b + 1, :1]), conv_silu(step)[b : b + 1, :1]).item() for b in (0, 63))
    assert mx.array_equal(conv_silu(prompt), fast_silu(prompt)).item()
    for x in (step, prompt):
        assert mx.allclose(conv_silu(x), nn.silu(x), rtol=1e-5, atol=1e-6).item()


def test_gated_delta_layers_take_the_fast_conv_activation_and_gated_norm(tmp_path):
    from mtplx.backends.cpu.activations import conv_silu
    from mtplx.models.families.qwen import _conv_activation

    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "q", vocab_size=48))
    gdns = [layer.linear_attn for layer in model.text_model.layers if hasattr(layer, "linear_attn")]
    assert gdns and all(_conv_activation(g) is nn.silu for g in gdns)
    use_fast_activations(model)
    assert all(_conv_activation(g) is conv_silu for g in gdns)
    assert all(type(g.norm).__name__ == "FastQwen3NextRMSNormGated" for g in gdns)
    D = gdns[0].norm.weight.shape[0]
    for T in (3, 20):  # a decode pass, a prompt pass
        x, z = mx.random.normal((2, T, D)), mx.random.normal((2, T, D))
        want = mx.fast.rms_norm(x, gdns[0].norm.weight, gdns[0].norm.eps) * (z * mx.sigmoid(z))
        assert mx.allclose(gdns[0].norm(x, z), want, rtol=1e-5, atol=1e-6).item()


def test_no_verify_spans_a_prompt_pass():
    from mtplx import MTPContract
    from mtplx.backends.cpu.activations import FAST_MIN_POSITIONS
    from mtplx.decode.contract import MAX_DEPTH

    assert MAX_DEPTH + 1 < FAST_MIN_POSITIONS
    MTPContract(depth=MAX_DEPTH)
    for bad in (dict(depth=MAX_DEPTH + 1), dict(depth="auto", max_depth_auto=MAX_DEPTH + 1)):
        with pytest.raises(ValueError, match="depth"):
            MTPContract(**bad)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_activations_round_what_float32_computes(dtype):
    from mtplx.backends.cpu.activations import fast_silu, step_silu, step_swiglu

    x = mx.random.normal((4, 20, 64)) * 6
    h = x.astype(dtype)
    want = nn.silu(h.astype(mx.float32))
    for f in (
        fast_silu,
        step_silu,
        lambda v: step_swiglu(v, mx.ones_like(v)),
        lambda v: fast_swiglu(v, mx.ones_like(v)),
    ):
        got = f(h)
        assert got.dtype == dtype
        assert mx.allclose(got.astype(mx.float32), want, rtol=1e-2, atol=1e-2).item()
        assert (
            mx.abs(got.astype(mx.float32) - want) <= mx.abs(want.astype(dtype).astype(mx.float32) - want) * 1.01 + 1e-6
        ).mean().item() > 0.99
