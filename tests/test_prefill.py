"""Prompt prefill of gated-delta layers: the chunk-wise recurrence agrees with
mlx-lm's step-by-step layer forward, right padding and all."""

import mlx.core as mx
import numpy as np
import pytest

import mtplx
from mtplx import backends
from mtplx.testing import tiny_checkpoint

VOCAB = 48


def _forward_in_two_calls(model, tokens, lengths, split, chunked: bool):
    """The trunk over right-padded `tokens` [B, L] in two calls (the second
    starts from the states the first left), as `prefill_batch` runs it."""
    saved = backends.CHUNKED_PREFILL_MIN
    backends.CHUNKED_PREFILL_MIN = 16 if chunked else 10**9
    try:
        cache = model.make_cache()
        for c in cache:
            if hasattr(c, "lengths"):
                c.lengths = mx.array(lengths, dtype=mx.int32)
        first, _ = model.forward(tokens[:, :split], cache)  # [B, split, V]
        second, _ = model.forward(tokens[:, split:], cache)  # [B, L - split, V]
        return mx.concatenate([first, second], axis=1), cache
    finally:
        backends.CHUNKED_PREFILL_MIN = saved


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_chunked_prefill_matches_mlx_lm_step_by_step_on_padded_rows(tmp_path, family):
    model = mtplx.load(tiny_checkpoint(family, tmp_path, vocab_size=VOCAB))
    lengths = [53, 31, 17, 40]  # right-padded to 53; the split falls inside some rows, past others
    rng = np.random.default_rng(0)
    tokens = mx.array([rng.integers(1, VOCAB, n).tolist() + [0] * (53 - n) for n in lengths], dtype=mx.int32)
    want, want_cache = _forward_in_two_calls(model, tokens, lengths, 24, chunked=False)
    got, got_cache = _forward_in_two_calls(model, tokens, lengths, 24, chunked=True)
    for b, n in enumerate(lengths):  # logits at each row's real positions
        assert mx.abs(got[b, :n] - want[b, :n]).max().item() < 1e-4 * max(1.0, mx.abs(want[b, :n]).max().item())
    linear = [i for i, kind in enumerate(model.layer_kinds) if kind == "linear"]
    assert linear
    for i in linear:
        conv_w, state_w = want_cache[i][0], want_cache[i][1]
        conv_g, state_g = got_cache[i][0], got_cache[i][1]
        # Each row's state stops at its own length: a padded step that moved
        # it would differ by O(1), not by the rounding of earlier layers.
        assert mx.abs(conv_g - conv_w).max().item() < 1e-5
        assert mx.abs(state_g - state_w).max().item() < 1e-5


def test_short_prompt_chunks_run_mlx_lm_step_by_step_bit_for_bit(tmp_path):
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path, vocab_size=VOCAB))
    tokens = mx.array([[5, 9, 3, 7, 11, 2, 8]], dtype=mx.int32)  # below CHUNKED_PREFILL_MIN
    assert tokens.shape[1] < backends.CHUNKED_PREFILL_MIN
    ours, _ = model.forward(tokens, model.make_cache())
    ref = model.trunk(tokens, cache=None)
    assert mx.array_equal(ours, ref).item()


def test_half_precision_prompts_prefill_bit_for_bit_as_mlx_lm(tmp_path):
    # In bf16 the chunk-wise form's rounding differences would move logits by
    # whole bf16 steps, so half-precision models keep mlx-lm's own recurrence.
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path, vocab_size=VOCAB))
    model.trunk.set_dtype(mx.bfloat16)
    tokens = mx.array([np.random.default_rng(1).integers(1, VOCAB, 40).tolist()], dtype=mx.int32)
    assert tokens.shape[1] >= backends.CHUNKED_PREFILL_MIN
    ours, _ = model.forward(tokens, model.make_cache())
    ref = model.trunk(tokens, cache=model.make_cache())
    assert ours.dtype == mx.bfloat16
    assert mx.array_equal(ours, ref).item()


def test_length_groups_are_the_cheapest_cuts_of_the_sorted_lengths():
    import itertools

    from mtplx.decode.prefill import length_groups

    def cost(lengths, runs, call):
        return sum(call + (b - a) * lengths[b - 1] for a, b in runs)

    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = sorted(rng.integers(1, 200, rng.integers(1, 8)).tolist())
        call = int(rng.integers(0, 100))
        runs = length_groups(lengths, call)
        n = len(lengths)
        assert runs[0][0] == 0 and runs[-1][1] == n and all(r[1] == s[0] for r, s in zip(runs, runs[1:]))
        every = [[(0, n)]] + [
            list(zip((0,) + cuts, cuts + (n,))) for k in range(1, n) for cuts in itertools.combinations(range(1, n), k)
        ]
        assert cost(lengths, runs, call) == min(cost(lengths, r, call) for r in every)
    assert length_groups([10, 11, 12, 120, 128], 32) == [(0, 3), (3, 5)]
    assert length_groups([50] * 16, 32) == [(0, 16)]


def test_prefill_by_length_gives_each_prompt_what_it_gets_alone_in_input_order(tmp_path):
    from mtplx.decode.passes import SlotPass
    from mtplx.decode.prefill import prefill_batch, prefill_by_length
    from mtplx.decode.prepare import prepare_for_decoding

    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "q", vocab_size=48))
    prepare_for_decoding(model)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 48, n).tolist() for n in (40, 3, 1, 37, 5, 41)]
    # Groups of several lengths (one of one-token prompts) and one compiled
    # last-token step over all of them, padded to 8 rows.
    step = SlotPass(model.forward, keep_pending=False, compiled=True)
    got = prefill_by_length(model, prompts, chunk=512, with_head=True, call_positions=8, step=step)
    for p, pre in zip(prompts, got):
        alone = prefill_batch(model, [p], 512, True)[0]  # eager, unpadded
        assert pre.length == len(p)
        # Bit for bit: forwards end on multiples of 16 and prompt attention
        # reads keys up to its 16-row block's end, whatever the group.
        assert mx.array_equal(pre.last_logits, alone.last_logits).item()
        assert mx.array_equal(pre.last_hidden, alone.last_hidden).item()
        for mine, ref in zip(pre.trunk_cache, alone.trunk_cache):
            for a, b in zip(vars(mine).values(), vars(ref).values()):
                assert a.shape == b.shape and mx.array_equal(a, b).item()
        assert [h.keys.shape[2] for h in pre.head_cache] == [len(p) - 1] * len(pre.head_cache)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_the_first_token_logits_are_mlx_lm_s_after_its_one_token_short_prompt_pass(tmp_path, family):
    # In bf16, bit for bit: a prompt pass over the last prompt token too
    # rounds it differently (mtplx.prefill.last_token_step).
    from model_helpers import bf16_checkpoint

    from mtplx.decode.prefill import prefill_by_length
    from mtplx.decode.prepare import prepare_for_decoding

    path = bf16_checkpoint(family, tmp_path / family)
    model, reference = mtplx.load(path), mtplx.load(path)
    prepare_for_decoding(model)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 48, n).tolist() for n in (12, 1, 30, 29)]
    # Chunks of 8 leave none of one position, which mlx-lm's latent
    # attention would compute in its one-position form (as it does itself
    # when its own 2048-token chunks leave one).
    got = prefill_by_length(model, prompts, chunk=8, with_head=False)
    for p, pre in zip(prompts, got):
        cache = reference.make_cache()
        if len(p) > 1:
            reference.trunk(mx.array([p[:-1]]), cache=cache)
        want = reference.trunk(mx.array([p[-1:]]), cache=cache)[:, -1]  # [1, V]
        assert pre.last_logits.dtype == mx.bfloat16
        assert mx.array_equal(pre.last_logits, want).item()
