"""The built-in default model shipped in mtplx/assets/tiny/."""

import json

import mlx.core as mx
import pytest

import mtplx
from mtplx.assets import default_model_path
from mtplx.training.corpus import held_out_examples, split_corpus, stdlib_sources
from mtplx.training.evaluate import teacher_forced_acceptance

# Teacher-forced greedy acceptance of the shipped model on these 16 prompts
# (32 tokens each) measured 0.795 at depth 1 and 0.619 cumulative at depth 2.
# An extra +1 on the head's norms measured 0.643 / 0.361, on its decoder
# layer's norms 0.293 / 0.072, so these floors catch a norm-shift mistake.
DEPTH1_FLOOR = 0.70
DEPTH2_FLOOR = 0.50


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


def test_shipped_head_greedy_acceptance_stays_above_floor(model, examples):
    prompts = [model.tokenizer.encode(e.prompt) for e in examples]
    prompts = [p for p in prompts if len(p) >= 48][:16]
    got = teacher_forced_acceptance(model, prompts, new_tokens=32, prompt_len=48)
    assert got["prompts"] == 16
    assert got["depth1"] > DEPTH1_FLOOR
    assert got["depth2_cumulative"] > DEPTH2_FLOOR
