"""The draft chain (one graph for the head catch-up and d_1..d_k) against the
head run one pass at a time, eagerly, on its own copies of the caches."""

import json

import mlx.core as mx
import numpy as np
import pytest

import mtplx
from mtplx.decode.accept import cycle_draws
from mtplx.decode.cache import SlotKVCache
from mtplx.decode.draft import DraftChain, HeadPending
from mtplx.decode.sampling import (
    SamplingParams,
    batch_sampling,
    draft_tokens,
    greedy_tokens,
    keys_from_base,
    row_hash,
    row_key_base,
    target_probs,
)
from mtplx.testing import tiny_checkpoint

VOCAB = 48
B = 3
CASES = [("qwen3_5", {"mtp_num_hidden_layers": 2}), ("mimo", {}), ("deepseek_v3", {"num_nextn_predict_layers": 2})]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{next(iter(o.values()), 1)}layers" for f, o in CASES])
def model(request, tmp_path_factory):
    family, overrides = request.param
    path = tiny_checkpoint(family, tmp_path_factory.mktemp(family), vocab_size=VOCAB, **overrides)
    return mtplx.load(path)


def hidden_size(model) -> int:
    config = json.loads((model.path / "config.json").read_text())
    return config.get("text_config", config)["hidden_size"]


def head_caches(model, lengths, seed=0):
    """Head KV caches with written entries up to each row's length (a catch-up's result)."""
    rng = np.random.default_rng(seed)
    caches = []
    for j in range(model.num_head_layers):
        c = SlotKVCache(B)
        probe = SlotKVCache(B)  # the head's own K/V shapes, from one eager pass
        model.head(
            mx.zeros((B, 1, hidden_size(model))),
            mx.zeros((B, 1), dtype=mx.int32),
            cache=[probe if l == j else None for l in range(model.num_head_layers)],
            depth=j + 1,
        )
        H, D = probe.keys.shape[1], probe.keys.shape[3]
        L = max(lengths)
        c.keys = mx.array(rng.normal(size=(B, H, L, D)).astype(np.float32))
        c.values = mx.array(rng.normal(size=(B, H, L, probe.values.shape[3])).astype(np.float32))
        c.lengths = mx.array(lengths, dtype=mx.int32)
        c.host_max = L
        caches.append(c)
    return caches


def pending_pairs(model, rng, T: int) -> HeadPending:
    """T random pending pairs per row; rows keep 3, 1 and 2 of them and take
    the head's output at pair 2, 0 and 1."""
    return HeadPending(
        hidden=mx.array(rng.normal(size=(B, T, hidden_size(model))).astype(np.float32)),
        tokens=mx.array(rng.integers(0, VOCAB, size=(B, T)), dtype=mx.int32),
        take=mx.array([2, 0, 1], dtype=mx.int32),
        keep=mx.array([3, 1, 2], dtype=mx.int32),
    )


def copy_of(c: SlotKVCache) -> SlotKVCache:
    out = SlotKVCache(c.batch_size)
    out.keys, out.values, out.lengths, out.host_max = c.keys, c.values, c.lengths, c.host_max
    return out


def step_by_step(model, logits, hidden, keys, sampling, caches, k, rule):
    """Draft d_1..d_k as step 1 of the cycle (docs/design.md) says, one eager head pass at a time."""
    caches = [copy_of(c) for c in caches]
    n = model.num_head_layers
    drafts, qs = [], []
    for i in range(1, k + 1):
        if sampling.all_greedy:
            d = greedy_tokens(logits)[:, None]
        else:
            q = target_probs(logits[:, None], sampling)  # [B, 1, V]
            d = draft_tokens(q, keys[:, i - 1 : i], rule)
            qs.append(q)
        drafts.append(d)
        if i < k:
            j = i % n
            lg, out = model.head(
                hidden[:, None], d, cache=[caches[j] if l == j else None for l in range(n)], depth=j + 1
            )
            logits, hidden = lg[:, 0], out[:, 0]
    return mx.concatenate(drafts, axis=1), (mx.concatenate(qs, axis=1) if qs else None)


def caught_up(model, pending, caches):
    """Step 0 of the cycle (docs/design.md) eagerly: every head layer writes the pending pairs; each
    row keeps `keep` of them. -> the caches and the depth-1 (logits, hidden)
    at each row's primary."""
    caches = [copy_of(c) for c in caches]
    n = model.num_head_layers
    for j, c in enumerate(caches):
        before = c.lengths
        lg, out = model.head(
            pending.hidden, pending.tokens, cache=[c if l == j else None for l in range(n)], depth=j + 1
        )  # [B, T, V], [B, T, H]
        if j == 0:
            rows = mx.arange(B)
            logits, hidden = lg[rows, pending.take], out[rows, pending.take]  # [B, V], [B, H]
        c.lengths = before + pending.keep
    return caches, logits, hidden


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_chain_catches_the_head_up_then_drafts_what_the_head_fed_its_own_output_drafts(
    model, compiled, temperature
):
    rng = np.random.default_rng(1)
    caches = head_caches(model, [5, 9, 2])
    T = 3
    pending = pending_pairs(model, rng, T)
    sampling = batch_sampling([SamplingParams(temperature=temperature, top_k=0 if i else 7) for i in range(B)])
    k = 4
    key_base = row_key_base(11, [row_hash(b) for b in range(B)], 0)
    positions = mx.array([[p + i for i in range(k + 1)] for p in (0, 7, 30)], dtype=mx.int32)  # [B, k+1]
    keys = keys_from_base(key_base, positions)  # [B, k+1, 2]
    ref_caches, logits, hidden = caught_up(model, pending, caches)
    # The reference draws each draft from its position's key; the chain takes
    # the cycle's residual uniforms drawn beforehand, which must give the same.
    ref_drafts, ref_q = step_by_step(model, logits, hidden, keys, sampling, ref_caches, k, "residual")
    chain = DraftChain(model.head, model.num_head_layers, "residual", compiled=compiled)
    draws = cycle_draws(key_base, positions, "residual", compiled=compiled)
    drafts, q = chain(pending, draws, sampling, caches, k, span=9)
    assert drafts.shape == (B, k) and drafts.tolist() == ref_drafts.tolist()
    if temperature == 0.0:
        assert q is None
    else:
        assert q.shape == (B, k, VOCAB)
        np.testing.assert_allclose(np.array(q), np.array(ref_q), atol=1e-5)
    # The catch-up's entries are kept, the chain's are not: every row's
    # entries up to its new length are the eager catch-up's.
    for c, ref in zip(caches, ref_caches):
        assert c.lengths.tolist() == [5 + 3, 9 + 1, 2 + 2] and c.host_max == 9 + T
        for b, n in enumerate(c.lengths.tolist()):
            np.testing.assert_allclose(np.array(c.keys[b, :, :n]), np.array(ref.keys[b, :, :n]), atol=1e-5)
            np.testing.assert_allclose(np.array(c.values[b, :, :n]), np.array(ref.values[b, :, :n]), atol=1e-5)


@pytest.mark.parametrize("compiled", [True, False])
def test_draft_chain_writes_the_head_caches_in_place_without_copying_them(model, compiled):
    """The chain's entries (rolled back every cycle) go into the arrays the
    caches come back with: a copy per chain step would cost a whole head
    cache (batch x capacity) each time."""
    rng = np.random.default_rng(2)
    caches = head_caches(model, [5, 9, 2])
    for c in caches:
        c.reserve(1 << 15)  # a capacity far above what the chain reads
    mx.eval([a for c in caches for a in c.arrays])
    one_cache = caches[0].keys.nbytes + caches[0].values.nbytes
    T, k = 3, 4
    pending = pending_pairs(model, rng, T)
    sampling = batch_sampling([SamplingParams()] * B)
    chain = DraftChain(model.head, model.num_head_layers, "residual", compiled=compiled)
    grown = []
    for _ in range(2):  # the first call also traces
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        drafts, _ = chain(pending, None, sampling, caches, k, span=9)
        mx.eval(drafts, [a for c in caches for a in c.arrays])
        grown.append(mx.get_peak_memory() - before)
        for c in caches:  # back to the warm lengths: both calls write the same positions
            c.lengths, c.host_max = mx.array([5, 9, 2], dtype=mx.int32), 9
    assert grown[-1] < one_cache / 4, (grown, one_cache)
