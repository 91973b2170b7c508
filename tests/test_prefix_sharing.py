"""Shared prompt prefixes (docs/design.md, "Shared prefixes"): prompts that
begin alike prefill the common prefix once, and every completion is what it is
without sharing, token for token."""

import mlx.core as mx
import numpy as np
import pytest
from model_helpers import make_predictable

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.decode.prefix import PrefixCache, plan_shares, split_grain
from mtplx.decode.sampling import SamplingParams
from mtplx.testing import tiny_checkpoint

VOCAB = 48
TIE_GAP = 1e-4
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]
# Dense float32 families: batch-invariant on the CPU, so sharing changes no bit.
DENSE = {"qwen3_5", "mimo"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        path = tiny_checkpoint(fam, tmp_path_factory.mktemp(fam), vocab_size=VOCAB)
        out[fam] = make_predictable(mtplx.load(path))
    return out


def _prompts(block=150, seed=0, tails=(3, 7, 20, 1, 40, 12, 33, 0)):
    """Prompts behind one shared block: tails of several lengths (one short of
    the chunk-wise recurrence's 16, one empty) and one that is a cut of it."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, VOCAB, block).tolist()
    out = [shared + rng.integers(1, VOCAB, n).tolist() for n in tails]
    out[-1] = shared[:100]  # a prompt that is a prefix of the others
    return out


def _top2_gap(model, tokens):
    logits = model.trunk(mx.array([tokens]))[0, -1]
    top = mx.sort(logits)[-2:]
    return float(top[1] - top[0])


def _generate(model, prompts, share, chunk=512, depth=2, **kw):
    rt = MTPLXRuntime(model, MTPContract(depth=depth, share_prefix_min=share, prefill_chunk=chunk), max_batch=4)
    return rt, rt.generate(prompts, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [512, 64])
def test_greedy_completions_with_shared_prefixes_equal_those_without(models, family, chunk):
    # chunk 64: the shared prefix (144 tokens) ends inside a prefill chunk.
    model = models[family]
    prompts = _prompts()
    rt, shared = _generate(model, prompts, 64, chunk, max_tokens=12, logprobs=True)
    _, alone = _generate(model, prompts, 0, chunk, max_tokens=12, logprobs=True)
    assert [c.shared_prefix_tokens for c in shared] == [144] * 7 + [96]
    assert rt.stats["shared_prefix_tokens"] == 144 * 7 + 96
    ties = []
    for p, got, ref in zip(prompts, shared, alone):
        if family in DENSE:
            assert got.tokens == ref.tokens and got.logprobs == ref.logprobs  # bit for bit
            continue
        j = next((j for j, (g, r) in enumerate(zip(got.tokens, ref.tokens)) if g != r), None)
        if j is not None:
            gap = _top2_gap(model, p + ref.tokens[:j])
            assert gap < TIE_GAP, f"diverged at {j}: {got.tokens[j]} vs {ref.tokens[j]}, top-2 gap {gap:.2e}"
            ties.append((j, gap))
        else:
            assert got.tokens == ref.tokens
    if ties:
        print(f"{family}: near-ties met: {ties}")


@pytest.mark.parametrize("acceptance", ["residual", "coupled"])
def test_sampled_completions_with_shared_prefixes_equal_those_without(models, acceptance):
    model = models["qwen3_5"]
    prompts = _prompts(seed=1)
    outs = []
    for share in (64, 0):
        rt = MTPLXRuntime(model, MTPContract(depth=3, acceptance=acceptance, share_prefix_min=share), max_batch=4)
        sampling = SamplingParams(temperature=0.9, top_p=0.95)
        outs.append(rt.generate(prompts, sampling=sampling, max_tokens=14, n=2, seed=7, logprobs=True))
    assert [(c.tokens, c.logprobs) for c in outs[0]] == [(c.tokens, c.logprobs) for c in outs[1]]
    assert len({tuple(c.tokens) for c in outs[0]}) > 1


def test_a_prefix_cut_inside_a_prefill_chunk_leaves_every_cache_bit_for_bit(models):
    """Hybrid model: KV, gated-delta conv windows and states, head pairs and
    the first-token logits, from a shared prefix or not, equal to the bit."""
    from mtplx.decode.passes import SlotPass
    from mtplx.decode.prefill import prefill_by_length
    from mtplx.decode.prefix import build_prefixes
    from mtplx.decode.prepare import prepare_for_decoding

    model = models["qwen3_5"]
    prepare_for_decoding(model)
    prompts = _prompts(seed=2)
    chunk = 64
    plan = plan_shares(prompts, 64, split_grain(chunk), [])
    # 144 nests in 96 (the short prompt's, and a multiple of 16 but not of 64).
    assert {len(k) - 1 for k in plan.parents} == {96, 144} and plan.starts.count(None) == 0
    step = SlotPass(model.forward, keep_pending=False, compiled=True)
    states = build_prefixes(model, prompts, plan, PrefixCache(1 << 30), chunk, True).states
    got = prefill_by_length(model, prompts, chunk, True, step=step, starts=states)
    want = prefill_by_length(model, prompts, chunk, True, step=step)
    for g, w in zip(got, want):
        assert g.length == w.length
        assert mx.array_equal(g.last_logits, w.last_logits).item()
        assert mx.array_equal(g.last_hidden, w.last_hidden).item()
        for a, b in zip(g.trunk_cache + g.head_cache, w.trunk_cache + w.head_cache):
            for x, y in zip(vars(a).values(), vars(b).values()):
                assert x.shape == y.shape and mx.array_equal(x, y).item()


def test_the_builtin_model_completes_shared_few_shot_prompts_as_without_sharing():
    import pyarrow.parquet as pq
    from conftest import REPO

    from mtplx.models.loader import encode_text

    path = REPO / "jobs" / "data" / "fewshot.parquet"
    if not path.exists():
        pytest.skip("jobs/data not generated (python jobs/make_data.py)")
    model = mtplx.load()
    rows = pq.read_table(path).slice(0, 6).to_pylist()
    # A cut of the block keeps the test short; it still spans two prefill chunks.
    prompts = [encode_text(model.tokenizer, r["shots"][:1200] + r["prompt"]) for r in rows]
    outs = []
    for share in (64, 0):
        rt = MTPLXRuntime(model, MTPContract(depth=2, share_prefix_min=share, prefill_chunk=128), max_batch=4)
        outs.append(rt.generate(prompts, max_tokens=16, logprobs=True))
    assert all(c.shared_prefix_tokens > 128 for c in outs[0])
    assert [(c.tokens, c.logprobs) for c in outs[0]] == [(c.tokens, c.logprobs) for c in outs[1]]


def test_a_prefix_state_is_reused_from_the_cache_by_later_groups_and_calls(models):
    model = models["qwen3_5"]
    prompts = _prompts(seed=3)
    rt = MTPLXRuntime(model, MTPContract(depth=1, share_prefix_min=64), max_batch=2)  # groups of 2 rows
    first = rt.generate(prompts, max_tokens=4)
    total = sum(len(p) for p in prompts)
    # The 144-token prefix is computed once; the 96-token one (the short
    # prompt's, which no other row of its group shares) once from scratch.
    assert rt.stats["prefill_tokens"] == total - rt.stats["shared_prefix_tokens"] + 144 + 96
    assert len(rt.prefixes.entries) == 2
    rt._reset_stats()
    again = rt.generate(prompts, max_tokens=4)
    assert rt.stats["prefill_tokens"] == total - rt.stats["shared_prefix_tokens"]  # every prefix from the cache
    assert [c.tokens for c in first] == [c.tokens for c in again]


def test_sharing_off_prefills_every_prompt_whole(models):
    model = models["qwen3_5"]
    prompts = _prompts(seed=4)
    rt, outs = _generate(model, prompts, 0, max_tokens=2)
    assert rt.stats["prefill_tokens"] == sum(len(p) for p in prompts)
    assert rt.stats["shared_prefix_tokens"] == 0 and all(c.shared_prefix_tokens == 0 for c in outs)
    assert not rt.prefixes.entries


def test_prefixes_nest_at_each_level_that_pays_and_are_cut_on_the_grain():
    rng = np.random.default_rng(0)
    system = rng.integers(1, 99, 90).tolist()
    block_a, block_b = rng.integers(1, 99, 120).tolist(), rng.integers(1, 99, 120).tolist()
    rows = [system + block_a + [i] for i in range(3)] + [system + block_b + [i] for i in range(3)]
    rows.append(rng.integers(1, 99, 200).tolist())  # shares nothing
    plan = plan_shares(rows, 64, 16, [])
    a, b = tuple(rows[0][:209]), tuple(rows[3][:209])  # 208 = 90 + 120 - 2, cut down to a multiple of 16
    outer = tuple(system[:81])  # the system prompt's 90 tokens cut to 80
    assert plan.starts == [a, a, a, b, b, b, None]
    assert plan.parents == {a: outer, b: outer, outer: None}
    # A level under min_len from the start is no share; one that saves less
    # than a prompt pass costs is skipped.
    assert plan_shares(rows, 256, 16, []).starts == [None] * 7
    two = plan_shares(rows[:2] + rows[3:5], 64, 16, [], call_positions=10**6)
    assert two.starts == [None] * 4 and not two.parents


def test_a_cached_prefix_serves_a_prompt_that_no_other_prompt_shares():
    rng = np.random.default_rng(1)
    block = rng.integers(1, 99, 100).tolist()
    key = tuple(block[:65])
    plan = plan_shares([block + [5, 6]], 64, 16, [key])
    assert plan.starts == [key] and plan.parents == {key: None}


def test_the_prefix_cache_drops_the_least_recently_used_state_past_its_bound():
    from mtplx.decode.prefill import PrefixState

    def state(t):
        kv = (mx.zeros((1, 1, 10, 25)), mx.zeros((1, 1, 10, 25)))  # 2 x 1000 bytes
        return PrefixState(tuple(range(t, t + 11)), [kv], None)

    cache = PrefixCache(max_bytes=5000)
    for t in range(3):
        cache.put(state(t), with_head=False)
    assert len(cache.entries) == 2 and cache.nbytes == 4000  # the first one is out
    assert cache.get(tuple(range(1, 12)), False) is not None  # now the most recent
    cache.put(state(5), with_head=False)
    assert cache.keys(False) == [tuple(range(1, 12)), tuple(range(5, 16))]
    assert cache.get(tuple(range(1, 12)), True) is None  # states with head pairs are another key


def test_split_points_are_the_recurrence_chunks_within_whole_prefill_chunks():
    assert split_grain(512) == 16 and split_grain(64) == 16
    assert split_grain(40) == 40  # chunks not made of whole recurrence chunks: prefixes end on theirs


def test_the_contract_refuses_a_negative_share_prefix_min():
    with pytest.raises(ValueError, match="share_prefix_min"):
        MTPContract(share_prefix_min=-1)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        MTPContract(prefix_cache_bytes=-5)
    assert MTPContract().share_prefix_min == 64


def test_the_builtin_model_prefills_a_prompt_bit_for_bit_alone_and_in_a_padded_group():
    # What sharing's exactness rests on: a prompt pass computes each row as it
    # would alone, so a suffix pass from a prefix (another group) changes no bit.
    from mtplx.decode.passes import SlotPass
    from mtplx.decode.prefill import prefill_by_length
    from mtplx.decode.prepare import prepare_for_decoding

    model = mtplx.load()
    prepare_for_decoding(model)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(1, 500, n).tolist() for n in (300, 291, 250, 263)]
    step = SlotPass(model.forward, keep_pending=False, compiled=True)
    together = prefill_by_length(model, prompts, 128, True, call_positions=10**6, step=step)  # one padded group
    for p, pre in zip(prompts, together):
        alone = prefill_by_length(model, [p], 128, True, step=step)[0]
        assert mx.array_equal(pre.last_logits, alone.last_logits).item()
        for mine, ref in zip(pre.trunk_cache, alone.trunk_cache):
            assert all(mx.array_equal(a, b).item() for a, b in zip(vars(mine).values(), vars(ref).values()))
