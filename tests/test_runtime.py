"""The batched MTP decoder: exactness against mlx-lm, refill, poisoned slots,
metrics, reproducibility. fp32 tiny checkpoints in the real HF layouts."""

import mlx.core as mx
import numpy as np
import pytest
from exactness import assert_same_up_to_ties
from model_helpers import make_predictable, mlx_lm_greedy

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.decode.requests import Request
from mtplx.decode.sampling import SamplingParams
from mtplx.testing import tiny_checkpoint

VOCAB = 48
RUNTIME_FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for fam in RUNTIME_FAMILIES:
        path = tiny_checkpoint(fam, tmp_path_factory.mktemp(fam), vocab_size=VOCAB)
        out[fam] = make_predictable(mtplx.load(path))
    return out


def _prompts(n, seed=0, lengths=(3, 7, 12, 5, 9, 4, 6, 11)):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(1, VOCAB, size=lengths[i % len(lengths)])] for i in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", RUNTIME_FAMILIES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_greedy_speculative_equals_mlx_lm_greedy(models, family, depth):
    model = models[family]
    prompts = _prompts(8)
    max_tokens = [13, 6, 10, 14, 7, 12, 9, 11]  # ends rows mid-draft
    refs = [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    ties = []
    total_accepted = 0
    for batch in (1, 3, 8):
        rt = MTPLXRuntime(model, MTPContract(depth=depth), max_batch=batch)
        outs = _generate_each_max(rt, prompts, max_tokens)
        for p, out, ref in zip(prompts, outs, refs):
            assert_same_up_to_ties(model, p, out.tokens, ref, ties)
            total_accepted += sum(out.accepted_by_depth)
    if ties:
        print(f"{family} depth {depth}: near-ties met: {ties}")
    # The predictable head must accept sometimes, or rollback of 0 < a < k was not exercised.
    assert total_accepted > 0


def _generate_each_max(rt, prompts, max_tokens):
    """One stream with per-request max_tokens."""
    from mtplx.decode.requests import Request

    reqs = [Request(index=i, prompt=p, max_tokens=n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    return sorted(rt.stream(reqs), key=lambda c: c.index)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_one_token_prompts_draft_and_decode_exactly(models, family):
    # A one-token prompt leaves the head no pairs to prefill: with only such
    # rows the head caches start empty and the first catch-up allocates them.
    model = models[family]
    prompts = [[5], [17]]
    refs = [mlx_lm_greedy(model, p, 12) for p in prompts]
    for compile_ in (True, False):
        outs = MTPLXRuntime(model, MTPContract(depth=2, compile=compile_), max_batch=2).generate(prompts, max_tokens=12)
        ties = []
        for p, out, ref in zip(prompts, outs, refs):
            assert_same_up_to_ties(model, p, out.tokens, ref, ties)
        assert sum(sum(o.accepted_by_depth) for o in outs) > 0


def test_refill_gives_each_prompt_what_it_gets_alone(models):
    model = models["qwen3_5"]
    prompts = _prompts(20, seed=3)
    alone = [
        MTPLXRuntime(model, MTPContract(depth=2), max_batch=1).generate([p], max_tokens=10)[0].tokens for p in prompts
    ]
    batched = MTPLXRuntime(model, MTPContract(depth=2), max_batch=4).generate(prompts, max_tokens=10)
    ties = []
    for p, out, ref in zip(prompts, batched, alone):
        assert_same_up_to_ties(model, p, out.tokens, ref, ties)


def test_a_slot_freed_alone_is_refilled_from_a_prefill_of_a_whole_batch(models):
    """Rows that finish one at a time are replaced by rows prefilled a batch
    at a time (the rest wait, prefilled), with the tokens each prompt gets
    alone."""
    model = models["qwen3_5"]
    prompts = _prompts(12, seed=5, lengths=(6,))
    rt = MTPLXRuntime(model, MTPContract(depth=2), max_batch=4)
    groups = []
    prepare = rt.prepare
    rt.prepare = lambda batch, seed: groups.append(len(batch)) or prepare(batch, seed)
    requests = [Request(index=i, prompt=p, max_tokens=3 + 2 * i) for i, p in enumerate(prompts)]  # finish apart
    list(rt.stream(requests))
    assert groups == [4, 4, 4]
    alone = MTPLXRuntime(model, MTPContract(depth=2), max_batch=1)
    outs = {c.index: c.tokens for c in rt.stream(requests)}
    ties = []
    for r in requests:
        assert_same_up_to_ties(
            model, r.prompt, outs[r.index], alone.generate([r.prompt], max_tokens=r.max_tokens)[0].tokens, ties
        )


def test_poisoned_row_errors_and_its_slot_serves_the_next_prompt_exactly(tmp_path):
    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB)
    model = make_predictable(mtplx.load(path))
    # Pick prompts where row 0 generates, before its last token, a token that no
    # other row generates or holds: poisoning its embedding then hits row 0 alone.
    for seed in range(5, 50):
        prompts = _prompts(6, seed=seed)
        refs = [
            MTPLXRuntime(model, MTPContract(depth=2), max_batch=1).generate([p], max_tokens=12)[0].tokens
            for p in prompts
        ]
        others = set(t for r in refs[1:] for t in r) | set(t for p in prompts for t in p)
        candidates = [t for t in refs[0][1:-1] if t not in others]
        if candidates:
            break
    assert candidates, "fixture: no private token to poison"
    poison = candidates[0]
    emb = model.text_model.embed_tokens
    emb.weight = mx.where(mx.arange(VOCAB)[:, None] == poison, mx.nan, emb.weight)
    outs = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2).generate(prompts, max_tokens=12)
    assert outs[0].finish_reason == "error" and "non-finite" in outs[0].error
    first = refs[0].index(poison)
    assert outs[0].tokens == refs[0][: first + 1]  # it errors at the step after the poison
    for out, ref in zip(outs[1:], refs[1:]):
        assert out.finish_reason != "error"
        assert out.tokens == ref


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("poisoned", ["a drafted token", "end of sequence"])
def test_drafts_of_a_non_finite_token_leave_every_row_as_plain_decoding_gives_it(tmp_path, family, poisoned):
    """Feeding one token makes the trunk's forward NaN (its embedding row is).
    A rejected draft of it must not poison the positions before it in its
    verify (0 x NaN in masked attention) or the slot's later reads; an
    accepted end-of-sequence draft ends its row before the NaN position
    matters, as plain decoding never computes it."""
    path = tiny_checkpoint(family, tmp_path / "m", vocab_size=VOCAB)
    model = make_predictable(mtplx.load(path))
    prompts = _prompts(16, seed=5)

    def run(depth):
        rt = MTPLXRuntime(model, MTPContract(depth=depth), max_batch=4)
        drafted, draft = [], rt._draft
        rt._draft = lambda *a: (lambda out: drafted.append(np.array(out[0])) or out)(draft(*a))
        return rt.generate(prompts, max_tokens=16), set(np.concatenate([d.ravel() for d in drafted] or [[]]).tolist())

    before, drafted = run(3)
    if poisoned == "end of sequence":
        poison = min(model.eos_token_ids)
        assert sum(o.finish_reason == "stop" for o in before) >= 2, "fixture: too few rows end on end of sequence"
    else:  # drafted, and in as few prompts and completions as possible
        held = [t for o in before for t in o.tokens] + [t for p in prompts for t in set(p)]
        poison = min(sorted(drafted - set(model.eos_token_ids)), key=held.count)
    assert poison in drafted
    emb = model.text_model.embed_tokens
    emb.weight = mx.where(mx.arange(VOCAB)[:, None] == poison, mx.nan, emb.weight)
    plain, _ = run(0)
    spec, _ = run(3)
    assert sum(o.finish_reason != "error" for o in plain) >= 4
    for o, p in zip(spec, plain):  # rows that emit it error where plain decoding does
        assert (o.finish_reason, o.tokens, o.error) == (p.finish_reason, p.tokens, p.error)


@pytest.mark.parametrize("poison", [0, VOCAB - 1])
def test_a_non_finite_token_no_prompt_holds_leaves_prompts_prefilled_together_exact(tmp_path, poison):
    """Prompts of different lengths are prefilled padded together; no pad
    may be a token whose forward is non-finite (0 and the last id are the
    usual pad choices), or the rows' real positions read 0 x NaN."""
    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB)
    model = make_predictable(mtplx.load(path))
    prompts = [p for p in _prompts(12, seed=3, lengths=(3, 20, 9, 16)) if poison not in p]
    before = MTPLXRuntime(model, MTPContract(depth=0), max_batch=8).generate(prompts, max_tokens=6)
    emb = model.text_model.embed_tokens
    emb.weight = mx.where(mx.arange(VOCAB)[:, None] == poison, mx.nan, emb.weight)
    after = MTPLXRuntime(model, MTPContract(depth=0), max_batch=8).generate(prompts, max_tokens=6)
    clean = [i for i, o in enumerate(before) if poison not in o.tokens]
    assert len(clean) >= len(prompts) // 2
    for i in clean:
        assert (after[i].finish_reason, after[i].tokens) == (before[i].finish_reason, before[i].tokens)


def test_metrics_follow_their_definitions(models):
    model = models["qwen3_next"]
    outs = MTPLXRuntime(model, MTPContract(depth=3), max_batch=4).generate(_prompts(8), max_tokens=15)
    for o in outs:
        d, a = o.drafted_by_depth, o.accepted_by_depth
        assert len(d) == len(a) == 3
        assert all(ai <= di for ai, di in zip(a, d))
        assert all(a[i] >= a[i + 1] for i in range(2))
        assert all(d[i] >= d[i + 1] for i in range(2))
        emitted = 1 + o.steps + sum(a)
        if o.finish_reason == "length":
            assert len(o.tokens) <= emitted and len(o.tokens) == 15
        else:  # a stop discards what follows it in the cycle
            assert len(o.tokens) < emitted
        if o.steps:
            assert o.mean_accepted_length == pytest.approx((o.steps + sum(a)) / o.steps)


def test_headless_checkpoint_decodes_at_depth_zero_and_auto_and_refuses_to_draft(tmp_path):
    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB, mtp_num_hidden_layers=0)
    model = mtplx.load(path)
    assert model.head is None
    with pytest.raises(ValueError, match="no MTP head"):
        MTPLXRuntime(model, MTPContract(depth=2))
    for depth in (0, "auto"):
        rt = MTPLXRuntime(model, MTPContract(depth=depth), max_batch=2)
        out = rt.generate(_prompts(3), max_tokens=5)
        assert [o.tokens for o in out] == [mlx_lm_greedy(model, p, 5) for p in _prompts(3)]
    assert rt.depth == 0 and rt.stats["auto_depth"]["reason"] == "no MTP head"
    assert rt.stats["auto_depth"]["policy"].startswith("plain decoding")  # what a job at depth auto prints


def test_a_prompt_that_fills_the_context_with_max_tokens_is_decoded_at_every_depth(tmp_path):
    """prompt + max_tokens <= the model's context is accepted whatever the
    depth (the verify's writes past a row's end are rejected drafts); one
    token more is refused at every depth."""
    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB, max_position_embeddings=40)
    model = make_predictable(mtplx.load(path))
    fits, over = _prompts(1, seed=2, lengths=(34,))[0], _prompts(1, seed=2, lengths=(35,))[0]
    plain = None
    for depth in (0, 1, 3):
        outs = MTPLXRuntime(model, MTPContract(depth=depth), max_batch=2).generate([fits, over], max_tokens=6)
        assert outs[0].error is None, outs[0].error
        assert outs[1].finish_reason == "error" and "context of 40 tokens" in outs[1].error
        plain = plain or outs[0].tokens
        assert outs[0].tokens == plain


def test_empty_and_overlong_prompts_become_error_rows(models):
    model = models["qwen3_5"]
    too_long = [1] * (model.max_context + 1)
    outs = MTPLXRuntime(model, MTPContract(depth=1), max_batch=2).generate([[], too_long, [3, 4, 5]], max_tokens=4)
    assert outs[0].finish_reason == "error" and "empty" in outs[0].error
    assert outs[1].finish_reason == "error" and "context" in outs[1].error
    assert outs[2].finish_reason in ("length", "stop") and outs[2].error is None


@pytest.mark.parametrize("depth", [0, 2])
def test_rows_left_at_the_end_run_in_a_smaller_batch_and_output_the_same(models, depth):
    from mtplx.decode.requests import Request

    model = models["qwen3_5"]
    prompts = _prompts(8, seed=5)
    # Rows end at different cycles (at the latest at their max_tokens), so the batch shrinks.
    limits = [3, 16, 5, 9, 2, 12, 7, 14]
    sps = [SamplingParams(), SamplingParams(temperature=1.0)] * 4
    reqs = [
        Request(index=i, prompt=p, sampling=sp, max_tokens=n, row_id=f"r{i}", logprobs=True)
        for i, (p, sp, n) in enumerate(zip(prompts, sps, limits))
    ]
    out = {}
    for shrink in (False, True):
        rt = MTPLXRuntime(model, MTPContract(depth=depth, shrink_batch=shrink), max_batch=8)
        out[shrink] = sorted(rt.stream(reqs, seed=5), key=lambda c: c.index)
        assert (rt.stats["batch_shrinks"] > 0) == shrink
    for a, b in zip(out[False], out[True]):
        assert a.error is None and b.error is None
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert (a.drafted_by_depth, a.accepted_by_depth) == (b.drafted_by_depth, b.accepted_by_depth)


def test_sampled_row_is_the_same_alone_and_in_a_batch(models):
    model = models["qwen3_5"]
    prompts = _prompts(6, seed=9)
    sp = [SamplingParams(temperature=0.8, top_k=8), SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)] * 2
    rt = MTPLXRuntime(model, MTPContract(depth=2), max_batch=4)
    batched = rt.generate(prompts, sampling=sp, max_tokens=10, seed=7, row_ids=[f"r{i}" for i in range(6)])
    for i in range(6):
        alone = MTPLXRuntime(model, MTPContract(depth=2), max_batch=1).generate(
            [prompts[i]], sampling=[sp[i]], max_tokens=10, seed=7, row_ids=[f"r{i}"]
        )[0]
        assert alone.tokens == batched[i].tokens


def test_coupled_rule_output_is_independent_of_depth(models):
    model = models["qwen3_5"]
    prompts = _prompts(5, seed=11)
    sp = SamplingParams(temperature=1.0)
    outs = [
        [
            o.tokens
            for o in MTPLXRuntime(model, MTPContract(depth=k, acceptance="coupled"), max_batch=3).generate(
                prompts, sampling=sp, max_tokens=10, seed=3
            )
        ]
        for k in (0, 1, 2, 3)
    ]
    assert outs[0] == outs[1] == outs[2] == outs[3]


def test_a_tiny_positive_temperature_decodes_as_greedy_at_every_depth(models):
    # Logits / 1e-40 overflow float32: the rows once came out empty, "stop".
    model = models["qwen3_5"]
    prompts = _prompts(4, seed=13)
    greedy = MTPLXRuntime(model, MTPContract(depth=0), max_batch=4).generate(prompts, max_tokens=10)
    assert sum(len(o.tokens) for o in greedy) >= 20
    for depth, t in ((0, 1e-40), (2, 1e-40), (2, 1e-46)):  # 1e-46 rounds to 0 in float32
        outs = MTPLXRuntime(model, MTPContract(depth=depth), max_batch=4).generate(
            prompts, sampling=SamplingParams(temperature=t), max_tokens=10, seed=3
        )
        assert [(o.tokens, o.finish_reason) for o in outs] == [(o.tokens, o.finish_reason) for o in greedy], depth


def test_n_samples_share_a_prefill_and_differ(models):
    model = models["qwen3_5"]
    rt = MTPLXRuntime(model, MTPContract(depth=2), max_batch=4)
    outs = rt.generate([_prompts(1)[0]], sampling=SamplingParams(temperature=1.0), max_tokens=8, n=4, seed=1)
    assert [o.sample_index for o in outs] == [0, 1, 2, 3]
    assert rt.stats["prefill_tokens"] == len(_prompts(1)[0])
    assert len({tuple(o.tokens) for o in outs}) > 1


def test_stop_string_cuts_text_and_ends_tokens_at_the_completing_token(models):
    model = models["qwen3_5"]
    tok = model.tokenizer
    for seed in range(2, 40):  # a prompt whose continuation decodes to enough text
        prompt = _prompts(1, seed=seed)[0]
        full = MTPLXRuntime(model, MTPContract(depth=2), max_batch=1).generate([prompt], max_tokens=12)[0]
        text = tok.decode(full.tokens)
        if len(text) >= 8:
            break
    stop = text[4:6]  # spans whatever tokens it spans
    assert len(stop) == 2
    out = MTPLXRuntime(model, MTPContract(depth=2), max_batch=1).generate([prompt], max_tokens=12, stop=[stop])[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert stop in tok.decode(out.tokens) and stop not in tok.decode(out.tokens[:-1])


def test_a_stop_string_completed_before_a_stop_id_in_one_cycle_ends_the_row_as_plain_decoding_does(models):
    """Plain decoding meets tokens one at a time, so a stop string completed
    before a stop id (or end of sequence) wins; a cycle that accepts both at
    once must apply them in that order."""
    model = models["qwen3_5"]
    prompt = _prompts(1, seed=4, lengths=(6,))[0]
    ref = MTPLXRuntime(model, MTPContract(depth=0), max_batch=1).generate([prompt], max_tokens=16)[0].tokens
    spec_rt = MTPLXRuntime(model, MTPContract(depth=3), max_batch=1)
    plain_rt = MTPLXRuntime(model, MTPContract(depth=0), max_batch=1)
    cut_by_string = 0
    for j in range(1, len(ref) - 1):
        kw = dict(max_tokens=16, stop=[model.tokenizer.decode(ref[j : j + 1])], stop_token_ids=[ref[j + 1]])
        plain, spec = plain_rt.generate([prompt], **kw)[0], spec_rt.generate([prompt], **kw)[0]
        assert (spec.finish_reason, spec.tokens, spec.text) == (plain.finish_reason, plain.tokens, plain.text)
        cut_by_string += plain.text != model.tokenizer.decode(plain.tokens)
    assert cut_by_string  # some stop string did end a row before its stop id


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "mimo"])
def test_compiled_decode_passes_emit_what_the_same_ops_run_eagerly_emit(models, family):
    # Compiled passes read attention KV over the whole capacity and fuse
    # elementwise chains; neither may change a token, greedy or sampled.
    model = models[family]
    prompts = _prompts(5, seed=3)
    sampling = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)] * 2
    runs = []
    for compiled in (True, False):
        rt = MTPLXRuntime(model, MTPContract(depth=2, compile=compiled), max_batch=3)
        runs.append(rt.generate(prompts, sampling=sampling[:5], max_tokens=12, seed=9, logprobs=True))
    for c, e in zip(*runs):
        assert c.tokens == e.tokens
        assert c.accepted_by_depth == e.accepted_by_depth  # the drafts matched too
        assert c.logprobs == pytest.approx(e.logprobs, abs=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_head_gone_non_finite_costs_acceptance_only(tmp_path, temperature):
    """Every head logit NaN: each depth's draft is still a token of the
    vocabulary (q uniform when sampling), the verify rejects what it must,
    and no row errors; greedy output is plain decoding's."""
    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB)
    model = make_predictable(mtplx.load(path))
    prompts = _prompts(8, seed=2)
    plain = MTPLXRuntime(model, MTPContract(depth=0), max_batch=4).generate(prompts, max_tokens=12)
    model.head.norm.weight = mx.full(model.head.norm.weight.shape, mx.nan)
    rt = MTPLXRuntime(model, MTPContract(depth=3), max_batch=4)
    drafted, qs = [], []
    draft = rt._draft

    def recorded(*a):
        d, q = draft(*a)
        drafted.append(np.array(d))
        qs.append(None if q is None else np.array(q))
        return d, q

    rt._draft = recorded
    spec = rt.generate(prompts, SamplingParams(temperature=temperature), max_tokens=12)
    assert all(o.finish_reason in ("length", "stop") for o in spec), [o.error for o in spec]
    assert all(0 <= t < VOCAB for d in drafted for t in d.ravel().tolist())
    if temperature > 0:  # the residual rule's ratios and corrections read q: it must be a distribution
        for q in qs:
            assert np.isfinite(q).all() and np.allclose(q.sum(-1), 1.0, atol=1e-5)
    assert sum(sum(o.drafted_by_depth) for o in spec) > 0
    if temperature == 0:
        assert [o.tokens for o in spec] == [o.tokens for o in plain]
