"""mtplx.testing.widen: the built-in model at a larger shape computes the same
function: logits within float32 rounding, the same greedy tokens on held-out
prompts (near-ties excepted and reported), the same acceptance."""

import json

import mlx.core as mx
import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import REPO

import mtplx
from mtplx.testing import tiny_checkpoint, widen

SHAPE = dict(hidden=192, layers=24, intermediate=576)
TIE_GAP = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    wide = widen(mtplx.default_model_path(), tmp_path_factory.mktemp("wide") / "m", **SHAPE)
    return mtplx.load(), mtplx.load(wide)


@pytest.fixture(scope="module")
def held_out():
    return pq.read_table(REPO / "jobs" / "data" / "prompts.parquet").column("prompt").to_pylist()[:12]


def test_the_widened_checkpoint_has_the_target_shape_in_the_release_layout(models):
    src, wide = models
    text = json.loads((wide.path / "config.json").read_text())["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]) == (192, 24, 576)
    assert text["num_attention_heads"] == 8 and text["num_key_value_heads"] == 4  # the source's 4 and 2, doubled
    assert text["linear_num_value_heads"] == 8 and text["linear_num_key_heads"] == 4
    assert text["head_dim"] == 24 and len(text["layer_types"]) == 24
    assert len(wide.layer_kinds) == 24 and wide.layer_kinds[:20] == src.layer_kinds
    assert any(f.name.endswith(".safetensors") for f in wide.path.iterdir()) and (wide.path / "tokenizer.json").exists()


def test_new_weights_that_feed_nothing_are_random_and_writes_into_new_dimensions_are_zero(models):
    _, wide = models
    layer = wide.text_model.layers[1].self_attn  # an attention layer of the source
    q = np.array(layer.q_proj.weight)  # [heads x 2 x 24, 192]
    assert np.count_nonzero(q[:, 96:]) == q[:, 96:].size  # new input columns: random, no kernel skips them
    o = np.array(layer.o_proj.weight)  # [192, 8 x 24]
    assert not o[96:].any() and not o[:, 4 * 24 :].any()  # nothing reaches the new residual dims or from new heads
    new = wide.text_model.layers[22]  # an added layer: random inputs, zero output
    assert np.array(new.mlp.gate_proj.weight).std() > 0 and not np.array(new.mlp.down_proj.weight).any()


def test_widened_logits_agree_with_the_sources_within_float32_rounding(models, held_out):
    src, wide = models
    worst = 0.0
    for prompt in held_out[:6]:
        tokens = mx.array([src.tokenizer.encode(prompt)[:64]])
        a, b = src.trunk(tokens), wide.trunk(tokens)  # [1, T, V]
        worst = max(worst, float(mx.max(mx.abs(a - b)) / mx.max(mx.abs(a))))
    print(f"max relative error of the trunk logits: {worst:.2e}")
    assert worst < 1e-5


def _decode(model, prompts):
    rt = mtplx.MTPLXRuntime(model, mtplx.MTPContract(depth=2), max_batch=4)
    out = rt.generate(prompts, max_tokens=24)
    drafted = sum(sum(c.drafted_by_depth) for c in out)
    return [c.tokens for c in out], sum(sum(c.accepted_by_depth) for c in out) / drafted


def test_widened_greedy_tokens_and_acceptance_equal_the_sources_on_held_out_prompts(models, held_out):
    src, wide = models
    (ref, acc_src), (got, acc_wide) = _decode(src, held_out), _decode(wide, held_out)
    ties = []
    for prompt, r, g in zip(held_out, ref, got):
        j = next((j for j, (x, y) in enumerate(zip(r, g)) if x != y), None)
        if j is None:
            assert len(r) == len(g)
            continue
        logits = src.trunk(mx.array([src.tokenizer.encode(prompt) + r[:j]]))[0, -1]
        gap = float(mx.sort(logits)[-1] - mx.sort(logits)[-2])
        assert gap < TIE_GAP, f"diverged at {j} with a top-2 gap of {gap:.2e}"
        ties.append((j, gap))
    print(f"near-ties met: {ties}; acceptance {acc_src:.4f} (source) and {acc_wide:.4f} (widened)")
    assert abs(acc_src - acc_wide) <= 0.02 and acc_src > 0.2


def test_widen_refuses_another_family_and_a_smaller_shape(tmp_path):
    with pytest.raises(mtplx.CheckpointError, match="dense qwen3_5"):
        widen(tiny_checkpoint("deepseek_v3", tmp_path / "d", vocab_size=48), tmp_path / "w", **SHAPE)
    with pytest.raises(ValueError, match="only grows"):
        widen(mtplx.default_model_path(), tmp_path / "w", hidden=64, layers=24, intermediate=576)


def test_a_padded_vocabulary_is_computed_and_never_sampled_by_the_decoder_or_the_baseline(tmp_path, models, held_out):
    from mlx_lm.generate import batch_generate

    from mtplx.bench.run import baseline_logits_processors

    src, _ = models
    wide = mtplx.load(widen(mtplx.default_model_path(), tmp_path / "v", **SHAPE, vocab_size=2048))
    assert wide.vocab_size == src.vocab_size == 512
    assert wide.trunk.language_model.lm_head.weight.shape == (2048, 192)  # the whole layer is computed
    tokens = mx.array([src.tokenizer.encode(held_out[0])[:32]])
    logits, _ = wide.logits_and_hidden(wide.run_layers(wide.embed(tokens), None))
    head_logits, _ = wide.head(mx.zeros((1, 1, 192)), tokens[:, :1])
    assert logits.shape[-1] == head_logits.shape[-1] == 512  # the decoder cuts the padded ids off
    (cut,) = baseline_logits_processors(wide)
    assert cut(None, mx.zeros((1, 2048))).shape == (1, 512) and baseline_logits_processors(src) == []
    assert _decode(wide, held_out[:4]) == _decode(src, held_out[:4])

    def mlx_lm_tokens(model, processors):
        ids = [model.tokenizer.encode(p) for p in held_out[:4]]
        return batch_generate(
            model.trunk, model.tokenizer, ids, max_tokens=12, return_token_ids=True, logits_processors=processors
        ).token_ids

    assert mlx_lm_tokens(wide, baseline_logits_processors(wide)) == mlx_lm_tokens(src, [])


@pytest.mark.parametrize(
    "name, hidden, layers, intermediate, heads, kv_heads",
    [("qwen3.5-0.8b", 1024, 24, 3584, 8, 2), ("qwen3.5-4b", 2560, 32, 9216, 16, 4)],  # the releases' (docs/scale.md)
)
def test_named_shapes_widen_the_built_in_model_to_the_releases_sizes(
    name, hidden, layers, intermediate, heads, kv_heads
):
    from mtplx.models.widen import attention_rows
    from mtplx.testing import SHAPES, widened_config

    text = widened_config(mtplx.default_model_path(), **SHAPES[name])["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]) == (hidden, layers, intermediate)
    assert text["vocab_size"] == 248320 and text["tokenizer_vocab_size"] == 512
    ours = attention_rows(text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"])
    assert abs(ours / attention_rows(heads, kv_heads, 256) - 1) < 0.01  # the same attention weight bytes a layer
    assert text["num_attention_heads"] == 2 * text["num_key_value_heads"]  # the source's ratio: its heads keep their KV


def test_widen_writes_bfloat16_weights_that_give_the_float32_widenings_logits_within_bf16_rounding(tmp_path, models):
    from mtplx.models.checkpoint import read_header, shard_files

    _, wide32 = models
    path = widen(mtplx.default_model_path(), tmp_path / "bf16", **SHAPE, dtype=mx.bfloat16)
    dtypes = {t["dtype"] for f in shard_files(path) for t in read_header(f).values()}
    assert dtypes == {"BF16"}
    assert json.loads((path / "config.json").read_text()) == json.loads((wide32.path / "config.json").read_text())
    wide16 = mtplx.load(path)
    tokens = mx.array([wide16.tokenizer.encode("def fibonacci(n):\n    ")])
    a, b = wide32.trunk(tokens).astype(mx.float32), wide16.trunk(tokens).astype(mx.float32)
    assert wide16.trunk(tokens).dtype == mx.bfloat16
    assert float(mx.max(mx.abs(a - b)) / mx.max(mx.abs(a))) < 0.05  # the same weights, rounded to 8 bits
