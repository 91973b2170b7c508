"""A reduced draft vocabulary (`MTPContract.draft_vocab`): the head scores a set
of ids alone, its logits equal the full head's there, the set is what was
asked for, and greedy speculation still emits mlx-lm's greedy tokens on every
family. (Sampled exactness with a reduced set: tests/test_runtime_sampling.py.)"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from exactness import assert_same_up_to_ties
from model_helpers import make_predictable, mlx_lm_greedy
from test_runtime import RUNTIME_FAMILIES, _generate_each_max, _prompts

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.decode.prepare import drafting_model
from mtplx.models.draft_vocab import ids_from_counts, merge_order_ids, with_draft_vocab
from mtplx.testing import tiny_checkpoint

VOCAB = 48
DRAFT = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for fam in RUNTIME_FAMILIES:
        path = tiny_checkpoint(fam, tmp_path_factory.mktemp(fam), vocab_size=VOCAB)
        out[fam] = make_predictable(mtplx.load(path))
    return out


def _head_logits(model):
    H = model.text_model.norm.weight.shape[0]
    hidden = mx.random.normal((2, 3, H), key=mx.random.key(1))
    tokens = mx.array([[1, 5, 9], [2, 7, 30]])
    logits, _ = model.head(hidden, tokens, cache=model.make_head_cache(), depth=1)
    return logits  # [2, 3, V or N]


@pytest.mark.parametrize("family", RUNTIME_FAMILIES)
def test_draft_head_scores_equal_the_full_heads_at_the_chosen_ids(models, family):
    model = models[family]
    ids = np.array([0, 3, 4, 10, 17, 31, 40, 47], dtype=np.int32)
    view = with_draft_vocab(model, ids)
    full, part = _head_logits(model), _head_logits(view)
    assert part.shape[-1] == len(ids)
    np.testing.assert_allclose(np.array(part), np.array(full)[..., ids], rtol=1e-5, atol=1e-5)
    assert view.trunk is model.trunk and model.draft_ids is None  # a view: the model itself is unchanged
    np.testing.assert_array_equal(np.array(view.draft_ids), ids)


def test_a_quantised_output_layer_gives_the_rows_of_its_own_product(tmp_path):
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path, vocab_size=64, hidden_size=64))
    nn.quantize(
        model.trunk, group_size=32, bits=8, class_predicate=lambda p, m: p.endswith(("lm_head", "embed_tokens"))
    )
    ids = np.arange(0, 64, 3, dtype=np.int32)
    full, part = _head_logits(model), _head_logits(with_draft_vocab(model, ids))
    np.testing.assert_allclose(np.array(part), np.array(full)[..., ids], rtol=1e-4, atol=1e-4)


def test_padded_output_rows_in_the_set_are_scored_then_cut(tmp_path):
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path, vocab_size=VOCAB, tokenizer_vocab_size=40))
    assert model.vocab_size == 40
    view = drafting_model(model, MTPContract(depth=1, draft_vocab=44))  # rows 0..43: 40 ids, 4 padded rows
    np.testing.assert_array_equal(np.array(view.draft_ids), np.arange(40))
    assert _head_logits(view).shape[-1] == 40


def test_merge_order_takes_the_first_ids_and_the_end_of_sequence_ids(models):
    model = models["qwen3_5"]
    eos = sorted(i for i in model.eos_token_ids if i < VOCAB)
    ids = merge_order_ids(model, 8)
    assert list(ids) == sorted(set(range(8)) | set(eos))
    assert list(merge_order_ids(model, 1000)) == list(range(VOCAB))


def test_ids_from_counts_rank_by_count_then_id_and_fill_in_merge_order(models):
    model = models["qwen3_5"]
    eos = {i for i in model.eos_token_ids if i < VOCAB}
    ids = ids_from_counts([[9, 9, 9, 30, 30, 5, 47], [30, 9]], 3, model)
    assert set(ids) == {9, 30, 5} | eos  # 5 and 47 once each: the lower id
    filled = set(ids_from_counts([[9]], 6, model))
    expected, t = {9} | eos, 0
    while len(expected) < 6:  # the lowest ids fill it
        expected.add(t)
        t += 1
    assert filled == expected


def test_draft_vocab_must_be_a_non_negative_int():
    for bad in (-1, 2.5, True, "32"):
        with pytest.raises(ValueError, match="draft_vocab"):
            MTPContract(draft_vocab=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("family", RUNTIME_FAMILIES)
def test_greedy_speculation_with_a_draft_vocabulary_equals_mlx_lm_greedy(models, family):
    model = models[family]
    prompts = _prompts(6)
    max_tokens = [13, 6, 10, 14, 7, 12]
    refs = [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    rt = MTPLXRuntime(model, MTPContract(depth=2, draft_vocab=DRAFT), max_batch=3)
    assert rt.model.draft_ids is not None and rt.model.draft_ids.shape[0] < VOCAB
    ties = []
    outs = _generate_each_max(rt, prompts, max_tokens)
    for p, out, ref in zip(prompts, outs, refs):
        assert_same_up_to_ties(model, p, out.tokens, ref, ties)
    assert sum(sum(o.accepted_by_depth) for o in outs) > 0
    if ties:
        print(f"{family}: near-ties met: {ties}")
