"""The built-in default model shipped in mtplx/assets/tiny/."""

import json

import mlx.core as mx
import pytest

import mtplx
from mtplx.assets import default_model_path
from mtplx.training.corpus import held_out_examples, split_corpus, stdlib_sources

# Greedy acceptance of the shipped model through the runtime (depth 2, the
# first 16 held-out prompts, 64 new tokens) measured 0.598 at depth 1 and
# 0.374 cumulative at depth 2; the floors sit a little below. A head loaded
# without its zero-centred norm shift measured 0.0 / 0.0 (the negative
# control below keeps that proof in the suite).
DEPTH1_FLOOR = 0.52
DEPTH2_FLOOR = 0.30


@pytest.fixture(scope="module")
def model():
    return mtplx.load(default_model_path())


@pytest.fixture(scope="module")
def examples():
    _, held = split_corpus(stdlib_sources())
    return held_out_examples(held)


def test_shipped_model_loads_with_a_complete_head(model):
    assert model.config["model_type"] == "qwen3_5"
    assert model.head is not None and len(model.head.layers) == 1
    kinds = model.layer_kinds
    assert "linear" in kinds and "attn" in kinds and len(kinds) >= 8


def test_shipped_artifact_fits_the_package_budget():
    files = [p for p in default_model_path().iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 1024 * 1024


def test_shipped_metadata_records_how_it_was_trained():
    meta = json.loads((default_model_path() / "training.json").read_text())
    for key in ("seed", "steps", "corpus", "loss_curve", "wall_s", "acceptance_teacher_forced"):
        assert key in meta
    assert meta["corpus"]["held_out_modules"]


def test_shipped_trunk_through_mlx_lm_equals_mtplx_load(model):
    import mlx_lm

    trunk, tokenizer = mlx_lm.load(str(default_model_path()))
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n")
    assert ids == list(model.tokenizer.encode("def add(a, b):\n    return a + b\n"))
    tokens = mx.array([ids])
    logits, _ = model.forward(tokens)
    assert mx.abs(trunk(tokens) - logits).max().item() < 1e-4


def test_shipped_tokenizer_round_trips_held_out_source(model, examples):
    for ex in examples[:8]:
        text = ex.prompt + ex.reference
        assert model.tokenizer.decode(model.tokenizer.encode(text)) == text


def _runtime_acceptance(model, prompts):
    from mtplx import MTPContract, MTPLXRuntime

    outs = MTPLXRuntime(model, MTPContract(depth=2), max_batch=16).generate(prompts, max_tokens=64)
    drafted = [sum(o.drafted_by_depth[i] for o in outs) for i in range(2)]
    accepted = [sum(o.accepted_by_depth[i] for o in outs) for i in range(2)]
    return [a / d for a, d in zip(accepted, drafted)]


def _held_out_prompts(model, examples):
    return [model.tokenizer.encode(e.prompt) for e in examples[:16]]


def test_shipped_head_greedy_acceptance_stays_above_floor(model, examples):
    depth1, depth2 = _runtime_acceptance(model, _held_out_prompts(model, examples))
    print(f"runtime greedy acceptance: depth 1 {depth1:.3f}, cumulative depth 2 {depth2:.3f}")
    assert depth1 > DEPTH1_FLOOR
    assert depth2 > DEPTH2_FLOOR


def test_acceptance_floor_catches_a_head_without_its_norm_shift(examples):
    broken = mtplx.load(default_model_path())
    head = broken.head
    # The HF checkpoint stores zero-centred norms; undo the loader's +1.
    head.pre_fc_norm_embedding.weight = head.pre_fc_norm_embedding.weight - 1.0
    head.pre_fc_norm_hidden.weight = head.pre_fc_norm_hidden.weight - 1.0
    head.norm.weight = head.norm.weight - 1.0
    depth1, depth2 = _runtime_acceptance(broken, _held_out_prompts(broken, examples))
    print(f"without the norm shift: depth 1 {depth1:.3f}, cumulative depth 2 {depth2:.3f}")
    assert depth1 < DEPTH1_FLOOR
