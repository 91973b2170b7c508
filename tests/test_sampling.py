"""Sampling: parameters, keys, logit processing, and the speculative step's
exactness (distribution for both rules, token identity for the coupled rule,
greedy behaviour, batch invariance, non-finite handling).

Statistical tests use a chi-square goodness-of-fit test whose tail is the
regularized upper incomplete gamma function Q(df/2, x/2), computed here with
its power series (x < df/2 + 1) or its continued fraction (otherwise). The
honest tests share one family-wise false-alarm rate, FAMILY_ALPHA, split over
all of them by Bonferroni; the same per-test threshold is then shown to reject
a planted 1% total-variation error and deliberately broken rules.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from stats import chi2_sf, chi2_threshold, chisq, noncentral_power

import mtplx.decode.sampling as sampling
from mtplx.decode.numerics import NonFiniteError, nonfinite_rows
from mtplx.decode.sampling import (
    RULES,
    BatchSampling,
    Purpose,
    SamplingParams,
    batch_sampling,
    draft_tokens,
    gumbel_from_keys,
    position_keys,
    purpose_keys,
    row_hash,
    sample_plain,
    speculative_accept,
    target_probs,
    uniform_from_keys,
)

# ----------------------------------------------------------- chi-square


def test_chi2_tail_matches_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    for x in (0.5, 3.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)
    assert chi2_sf(11.070497693516351, 5) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(20.515005652432873, 5) == pytest.approx(0.001, rel=1e-8)
    assert chi2_sf(37.56623478662507, 20) == pytest.approx(0.01, rel=1e-8)
    assert chi2_threshold(0.05, 5) == pytest.approx(11.070497693516351, rel=1e-9)


# --------------------------------------------------- the exactness harness

FAMILY_ALPHA = 1e-3  # chance that any honest chi-square test below fails by luck
N_ROWS = 150_000  # independent rows per chain (each row: its own keys)
L = 6  # emitted positions tested per chain
V = 6
KS = (1, 2, 3, 4)
FAMILIES = ("random", "adversarial")
# every honest test: each chain tests L marginals and one 2-token joint
N_TESTS = len(RULES) * len(KS) * len(FAMILIES) * (L + 1)
PER_TEST_ALPHA = FAMILY_ALPHA / N_TESTS
N_TABLES = L + max(KS)  # lookahead tables for the last cycles


def _normalise(rows) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    return (rows / rows.sum(-1, keepdims=True)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def tables(family: str) -> tuple[np.ndarray, np.ndarray]:
    """(p, q) float32 [N_TABLES, V]: the target and draft distribution at
    each absolute position, independent of the drafted prefix, so every
    emitted position's distribution is known exactly."""
    rng = np.random.default_rng(11 if family == "random" else 12)
    # every cell >= 0.05 so expected counts are large and the planted error
    # is testable everywhere
    p = 0.7 * rng.dirichlet(np.full(V, 2.0), size=N_TABLES) + 0.3 / V
    q = 0.7 * rng.dirichlet(np.full(V, 2.0), size=N_TABLES) + 0.3 / V
    if family == "random":
        return _normalise(p), _normalise(q)
    base = np.array([0.3, 0.25, 0.2, 0.15, 0.07, 0.03])
    p_dust = _normalise([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
    q_dust = (p_dust * (1.0 + 2e-7 * np.array([1, -1, 1, -1, 1, -1]))).astype(np.float32)
    adversarial = [
        (base, base),  # q == p: everything accepted, bonus at the end
        ([0.5, 0.3, 0.2, 0, 0, 0], [0, 0, 0, 0.2, 0.3, 0.5]),  # disjoint: always rejected
        ([0.05, 0.1, 0.15, 0.2, 0.22, 0.28], [1, 0, 0, 0, 0, 0]),  # q one-hot on p's rarest token
        ([0, 0, 0, 0, 1, 0], np.ones(V)),  # p one-hot, q uniform
        (p_dust, q_dust),  # p and q differ by float dust: zero-mass fallback
        ([0.85, 0.1, 0.05, 0, 0, 0], [0.05, 0, 0, 0.05, 0.1, 0.8]),  # peaked apart, q covers p's zeros
    ]
    for i, (pi, qi) in enumerate(adversarial):
        p[i], q[i] = pi, qi
    p, q = _normalise(p), _normalise(q)
    q[4] = q_dust
    return p, q


def run_chain(p_tab, q_tab, k: int, rule: str, n: int, seed: int, length: int = L) -> np.ndarray:
    """int [n, length]: n independent rows decoded speculatively at depth k,
    cycle after cycle, with the target p_tab[t] and draft q_tab[t] at
    position t. Rows near the end draft only up to the last position
    (num_valid), as the runtime does near max_tokens."""
    P, Q = mx.array(p_tab), mx.array(q_tab)
    hashes = np.arange(n, dtype=np.uint64) + np.uint64(seed * 1_000_003)
    start = np.zeros(n, dtype=np.int64)
    out = np.full((n, length), -1, dtype=np.int64)
    while (start < length).any():
        live = np.flatnonzero(start < length)
        s = start[live]
        pos = (s[:, None] + np.arange(k + 1)).astype(np.int32)  # [A, k+1]
        keys = position_keys(seed, hashes[live], 0, mx.array(pos))  # [A, k+1, 2]
        p = P[mx.array(pos)]  # [A, k+1, V]
        q = Q[mx.array(pos[:, :k])]  # [A, k, V]
        num_valid = mx.array(np.minimum(k, length - 1 - s).astype(np.int32))
        d = draft_tokens(q, keys[:, :k], rule)  # [A, k]
        a, nxt = speculative_accept(d, q, p, keys, num_valid=num_valid, rule=rule)
        a, nxt, d = np.array(a), np.array(nxt), np.array(d)
        for j in range(k + 1):
            emitted = j <= a
            token = nxt if j == k else np.where(j < a, d[:, j], nxt)
            out[live[emitted], s[emitted] + j] = token[emitted]
        start[live] = s + a + 1
    assert (out >= 0).all()
    return out


def chain_seed(rule: str, k: int, family: str) -> int:
    return 1000 * RULES.index(rule) + 100 * k + FAMILIES.index(family)


@functools.lru_cache(maxsize=None)
def honest_chain(rule: str, k: int, family: str) -> np.ndarray:
    p, q = tables(family)
    return run_chain(p, q, k, rule, N_ROWS, chain_seed(rule, k, family))


def position_tests(out: np.ndarray, p_tab: np.ndarray):
    """(name, stat, df) for each position's marginal and the joint of the
    first two positions."""
    results = []
    for t in range(out.shape[1]):
        stat, df = chisq(np.bincount(out[:, t], minlength=V), p_tab[t])
        results.append((f"pos{t}", stat, df))
    joint = np.bincount(out[:, 0] * V + out[:, 1], minlength=V * V)
    stat, df = chisq(joint, np.outer(p_tab[0].astype(np.float64), p_tab[1]).ravel())
    results.append(("pos0*pos1", stat, df))
    return results


def passes(stat: float, df: int) -> bool:
    if df == 0:  # a one-hot target: the only check is "no impossible token"
        return stat == 0
    return stat <= chi2_threshold(PER_TEST_ALPHA, df)


@pytest.mark.gpu
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("rule", RULES)
def test_every_emitted_position_and_the_first_joint_follow_the_target(rule, k):
    for family in FAMILIES:
        out = honest_chain(rule, k, family)
        p_tab, _ = tables(family)
        for name, stat, df in position_tests(out, p_tab):
            thr = chi2_threshold(PER_TEST_ALPHA, df) if df else 0.0
            print(
                f"honest rule={rule} k={k} family={family} {name}: n={len(out)} "
                f"chi2={stat:.2f} df={df} threshold={thr:.2f} (alpha/test={PER_TEST_ALPHA:.2e})"
            )
            assert passes(stat, df), f"{rule} k={k} {family} {name}: chi2={stat:.2f} df={df}"


def planted(p: np.ndarray, to: str) -> np.ndarray:
    """p with 0.01 of mass moved from its likeliest token to its rarest one
    ("rarest") or to its second likeliest ("runner-up", the hardest 1% error
    to see): a total-variation error of exactly 0.01."""
    p = p.astype(np.float64).copy()
    order = np.argsort(-p)
    p[order[0]] -= 0.01
    p[order[-1] if to == "rarest" else order[1]] += 0.01
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("rule", RULES)
def test_same_test_detects_a_planted_one_percent_tv_error(rule, k):
    # The honest samples are tested against a target that is off by TV 0.01:
    # at every position, and for both ways of planting it, the test must
    # reject at the honest per-test threshold. The sample size is also
    # checked to give that test >= 99% power.
    out = honest_chain(rule, k, "random")
    p_tab, _ = tables("random")
    for t in range(L):
        for to in ("rarest", "runner-up"):
            wrong = planted(p_tab[t], to)
            assert np.abs(wrong - p_tab[t]).sum() / 2 == pytest.approx(0.01)
            stat, df = chisq(np.bincount(out[:, t], minlength=V), wrong)
            thr = chi2_threshold(PER_TEST_ALPHA, df)
            lam = len(out) * float(np.sum((p_tab[t] - wrong) ** 2 / wrong))
            power = noncentral_power(thr, df, lam)
            print(
                f"planted({to}) rule={rule} k={k} pos{t}: n={len(out)} chi2={stat:.2f} df={df} "
                f"threshold={thr:.2f} noncentrality={lam:.1f} power~{power:.4f}"
            )
            assert power >= 0.99
            assert stat > thr


def _wrong_residual_unclipped(target, draft, mask=None):
    # the residual with negatives left in (normalised by the positive mass)
    m = 1.0 if mask is None else sampling._per_row(mask, target.ndim)
    diff = target - m * draft
    return diff / mx.maximum(mx.sum(mx.maximum(diff, 0.0), axis=-1, keepdims=True), 1e-12)


def _wrong_correction_from_target(target, draft, mask=None):
    return target


def _wrong_accept_inverted(u, p_d, q_d):
    return u * p_d < q_d  # u < q/p instead of u < p/q


def _wrong_gumbel_on_probs(probs, keys):
    noise = gumbel_from_keys(purpose_keys(keys, Purpose.GUMBEL), probs.shape[-1])
    return mx.argmax(probs + noise, axis=-1).astype(mx.int32)  # probs, not log-probs


WRONG_RULES = {
    "residual without max(.,0)": ("residual", "residual_distribution", _wrong_residual_unclipped),
    "correction drawn from the target": ("residual", "residual_distribution", _wrong_correction_from_target),
    "accept on u < q/p": ("residual", "_accept_flags", _wrong_accept_inverted),
    "coupled Gumbel on probabilities": ("coupled", "_gumbel_argmax", _wrong_gumbel_on_probs),
}


@pytest.mark.gpu
@pytest.mark.parametrize("bug", list(WRONG_RULES))
def test_same_test_detects_a_deliberately_wrong_rule(bug, monkeypatch):
    rule, name, wrong = WRONG_RULES[bug]
    monkeypatch.setattr(sampling, name, wrong)
    p_tab, q_tab = tables("random")
    out = run_chain(p_tab, q_tab, 2, rule, N_ROWS // 2, seed=77)
    results = position_tests(out, p_tab)
    for test_name, stat, df in results:
        print(f"wrong rule [{bug}] {test_name}: n={len(out)} chi2={stat:.2f} df={df}")
    worst = max(stat / chi2_threshold(PER_TEST_ALPHA, df) for _, stat, df in results)
    assert worst > 1.0, f"{bug} went undetected"


# ------------------------------------------- coupled == plain, token by token


def markov_tables(rng, steps: int, vocab: int, concentration: float):
    """float32 [steps, vocab, vocab]: distribution of the token at each
    position given the previous token, so every draft changes what follows."""
    return rng.dirichlet(np.full(vocab, concentration), size=(steps, vocab)).astype(np.float32)


def decode_plain(P, n, seed, hashes, length, rule):
    """Plain keyed sampling of a Markov chain, one token at a time."""
    prev = np.zeros(n, dtype=np.int64)
    out = np.zeros((n, length), dtype=np.int64)
    for t in range(length):
        keys = position_keys(seed, hashes, 0, mx.full((n, 1), t, dtype=mx.int32))  # [n, 1, 2]
        p = mx.array(P[t, prev])[:, None]  # [n, 1, V]
        prev = out[:, t] = np.array(sample_plain(p, keys, rule))[:, 0]
    return out


def decode_speculative(P, Q, k, n, seed, hashes, length, rule):
    """Speculative decoding of the same chain: the drafter drafts one depth at
    a time from its own table, conditioned on its previous draft; the target
    conditions p_{i+1} on d_i. Returns tokens and the accepted counts seen."""
    vocab = P.shape[-1]
    start = np.zeros(n, dtype=np.int64)
    prev = np.zeros(n, dtype=np.int64)
    out = np.full((n, length), -1, dtype=np.int64)
    accepted_seen = []
    while (start < length).any():
        live = np.flatnonzero(start < length)
        s = start[live]
        pos = (s[:, None] + np.arange(k + 1)).astype(np.int32)  # [A, k+1]
        keys = position_keys(seed, hashes[live], 0, mx.array(pos))
        context = prev[live]
        drafts, qs, ps = [], [], []
        for i in range(k + 1):
            ps.append(P[pos[:, i], context])
            if i == k:
                break
            qs.append(Q[pos[:, i], context])
            d = np.array(draft_tokens(mx.array(qs[-1])[:, None], keys[:, i : i + 1], rule))[:, 0]
            drafts.append(d)
            context = d
        d = np.stack(drafts, 1) if k else np.zeros((len(live), 0), dtype=np.int64)
        q = np.stack(qs, 1) if k else np.zeros((len(live), 0, vocab), dtype=np.float32)
        num_valid = np.minimum(k, length - 1 - s).astype(np.int32)
        a, nxt = speculative_accept(
            mx.array(d.astype(np.int32)),
            mx.array(q),
            mx.array(np.stack(ps, 1)),
            keys,
            num_valid=mx.array(num_valid),
            rule=rule,
        )
        a, nxt = np.array(a), np.array(nxt)
        accepted_seen.append(a)
        for j in range(k + 1):
            emitted = j <= a
            token = nxt if j == k else np.where(j < a, d[:, j] if k else 0, nxt)
            out[live[emitted], s[emitted] + j] = token[emitted]
        prev[live] = nxt
        start[live] = s + a + 1
    return out, np.concatenate(accepted_seen)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_coupled_output_equals_plain_keyed_sampling_token_for_token(k):
    rng = np.random.default_rng(5)
    n, length, vocab, seed = 400, 12, 8, 99
    P = markov_tables(rng, length + 4, vocab, 0.5)
    Q = (0.6 * P + 0.4 * markov_tables(rng, length + 4, vocab, 0.5)).astype(np.float32)
    hashes = [row_hash(f"row-{i}") for i in range(n)]
    hashes = np.array(hashes, dtype=np.uint64)
    plain = decode_plain(P, n, seed, hashes, length, "coupled")
    spec, accepted = decode_speculative(P, Q, k, n, seed, hashes, length, "coupled")
    np.testing.assert_array_equal(spec, plain)
    if k:  # the comparison exercised both acceptances and rejections
        assert 0 < accepted.mean() < k


def test_depth_zero_residual_is_plain_keyed_sampling():
    rng = np.random.default_rng(6)
    n, length, vocab, seed = 400, 6, 8, 5
    P = markov_tables(rng, length + 1, vocab, 0.5)
    hashes = np.arange(n, dtype=np.uint64)
    plain = decode_plain(P, n, seed, hashes, length, "residual")
    spec, _ = decode_speculative(P, P, 0, n, seed, hashes, length, "residual")
    np.testing.assert_array_equal(spec, plain)


# ------------------------------------------------------------------ greedy


GREEDY = SamplingParams(temperature=0.0)


def _tied_logits(rng, shape):
    return rng.integers(0, 3, size=shape).astype(np.float32)  # many exact ties


def test_greedy_target_is_one_hot_of_the_lowest_id_argmax():
    rng = np.random.default_rng(7)
    logits = _tied_logits(rng, (16, 3, 10))
    p = np.array(target_probs(mx.array(logits), batch_sampling([GREEDY] * 16)))
    assert (logits == logits.max(-1, keepdims=True)).sum(-1).max() > 1  # ties present
    expected = np.eye(10, dtype=np.float32)[logits.argmax(-1)]  # numpy: first maximum
    np.testing.assert_array_equal(p, expected)
    flat = np.array(target_probs(mx.array(logits[:, 0]), batch_sampling([GREEDY] * 16)))
    np.testing.assert_array_equal(flat, expected[:, 0])


@pytest.mark.parametrize("rule", RULES)
def test_greedy_accepts_exactly_while_draft_equals_argmax(rule):
    rng = np.random.default_rng(8)
    k, vocab = 4, 10
    B = 3 * (k + 1)
    logits = _tied_logits(rng, (B, k + 1, vocab))
    best = logits.argmax(-1)  # [B, k+1], lowest id among ties
    matches = np.arange(B) % (k + 1)  # row b drafts matches[b] correct tokens first
    draft = rng.integers(0, vocab, size=(B, k))
    for b in range(B):
        draft[b, : matches[b]] = best[b, : matches[b]]
        if matches[b] < k:
            draft[b, matches[b]] = (best[b, matches[b]] + 1 + rng.integers(0, vocab - 1)) % vocab
    # a greedy drafter's own logits, tied between the draft and a higher id
    draft_logits = np.zeros((B, k, vocab), dtype=np.float32)
    np.put_along_axis(draft_logits, draft[..., None], 1.0, axis=-1)
    draft_logits[..., -1] = 1.0
    bs = batch_sampling([GREEDY] * B)
    p = target_probs(mx.array(logits), bs)
    q = target_probs(mx.array(draft_logits), bs)
    np.testing.assert_array_equal(np.array(q).argmax(-1), draft)
    keys = position_keys(3, np.arange(B), 0, mx.array(np.tile(np.arange(k + 1), (B, 1)).astype(np.int32)))
    d = draft_tokens(q, keys[:, :k], rule)
    np.testing.assert_array_equal(np.array(d), draft)
    a, nxt = speculative_accept(d, q, p, keys, rule=rule)
    np.testing.assert_array_equal(np.array(a), matches)
    np.testing.assert_array_equal(np.array(nxt), best[np.arange(B), matches])
    # rows limited to 2 drafts stop there and take the argmax at index 2
    a2, nxt2 = speculative_accept(d, q, p, keys, num_valid=mx.full((B,), 2, dtype=mx.int32), rule=rule)
    np.testing.assert_array_equal(np.array(a2), np.minimum(matches, 2))
    np.testing.assert_array_equal(np.array(nxt2), best[np.arange(B), np.minimum(matches, 2)])


# ---------------------------------------------------- target_probs filters


def reference_probs(x: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """One row's distribution, step by step in float64 (test reference)."""
    z = x.astype(np.float64) / sp.temperature
    keep = np.ones_like(z, dtype=bool)
    order = np.argsort(-z)
    if sp.top_k:
        keep[order[sp.top_k :]] = False

    def renorm():
        w = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        return w / w.sum()

    if sp.top_p < 1:
        ps = renorm()[order]
        before = np.cumsum(ps) - ps
        keep[order[before >= sp.top_p]] = False
    if sp.min_p > 0:
        ps = renorm()
        keep &= ps >= sp.min_p * ps.max()
    return renorm()


FILTER_PARAMS = [
    SamplingParams(1.0),
    SamplingParams(0.7),
    SamplingParams(1.3, top_k=5),
    SamplingParams(1.0, top_k=1),
    SamplingParams(1.0, top_p=0.6),
    SamplingParams(0.5, top_p=0.9, top_k=8),
    SamplingParams(1.0, min_p=0.2),
    SamplingParams(2.0, top_k=12, top_p=0.8, min_p=0.05),
]


def test_target_probs_applies_each_rows_temperature_top_k_top_p_min_p():
    rng = np.random.default_rng(9)
    B, T, vocab = len(FILTER_PARAMS), 2, 30
    logits = rng.normal(0, 2, size=(B, T, vocab)).astype(np.float32)  # no ties
    got = np.array(target_probs(mx.array(logits), batch_sampling(FILTER_PARAMS)))
    for b, sp in enumerate(FILTER_PARAMS):
        for t in range(T):
            ref = reference_probs(logits[b, t], sp)
            np.testing.assert_array_equal(got[b, t] > 0, ref > 0, err_msg=f"support of {sp}")
            np.testing.assert_allclose(got[b, t], ref, atol=2e-6, err_msg=str(sp))
    assert (got[3] > 0).sum(-1).tolist() == [1, 1]  # top_k=1


def test_a_tiny_temperature_samples_the_argmax_instead_of_overflowing_to_nan():
    # x / 1e-40 overflows float32; the distribution must still be the argmax's.
    logits = mx.array([[[3.0, 1.0, 2.5, -4.0]], [[0.5, 0.7, 0.6, 0.1]]])  # [2, 1, 4]
    for t in (1e-30, 1e-40, 1e-45):
        for sp in (SamplingParams(t), SamplingParams(t, top_k=2, top_p=0.9, min_p=0.1)):
            p = np.array(target_probs(logits, batch_sampling([sp, sp])))
            np.testing.assert_array_equal(p[:, 0], [[1, 0, 0, 0], [0, 1, 0, 0]], err_msg=f"{sp}")


def test_target_probs_keeps_masked_logits_at_zero_probability():
    logits = mx.array([[0.0, -mx.inf, 1.0, -mx.inf]])
    for sp in (SamplingParams(1.0), SamplingParams(1.0, top_k=3, top_p=0.99)):
        p = np.array(target_probs(logits, batch_sampling([sp])))
        assert p[0, 1] == 0 and p[0, 3] == 0 and np.isfinite(p).all()


# --------------------------------------------------------- batch invariance


MIXED_PARAMS = [
    GREEDY,
    SamplingParams(1.0),
    SamplingParams(0.6, top_k=4),
    SamplingParams(1.2, top_p=0.7),
    SamplingParams(0.9, min_p=0.1),
    SamplingParams(1.0, top_k=20, top_p=0.95, min_p=0.02),
    SamplingParams(0.3),
    SamplingParams(1.0, top_k=1),
]


@pytest.mark.parametrize("rule", RULES)
def test_row_result_is_the_same_alone_and_in_a_mixed_batch_of_64(rule):
    rng = np.random.default_rng(10)
    B, k, vocab = 64, 3, 40
    params = [MIXED_PARAMS[i % len(MIXED_PARAMS)] for i in range(B)]
    target_logits = rng.normal(0, 2, size=(B, k + 1, vocab)).astype(np.float32)
    draft_logits = (target_logits[:, :k] + rng.normal(0, 1, size=(B, k, vocab))).astype(np.float32)
    hashes = np.array([row_hash(("job", i)) for i in range(B)], dtype=np.uint64)
    samples = rng.integers(0, 3, size=B)
    positions = (rng.integers(0, 50, size=(B, 1)) + np.arange(k + 1)).astype(np.int32)
    num_valid = rng.integers(0, k + 1, size=B).astype(np.int32)

    def step(rows):
        bs = batch_sampling([params[r] for r in rows])
        p = target_probs(mx.array(target_logits[rows]), bs)
        q = target_probs(mx.array(draft_logits[rows]), bs)
        keys = position_keys(4242, hashes[rows], samples[rows], mx.array(positions[rows]))
        d = draft_tokens(q, keys[:, :k], rule)
        a, nxt = speculative_accept(d, q, p, keys, num_valid=mx.array(num_valid[rows]), rule=rule)
        return [np.array(x) for x in (p, keys, d, a, nxt)]

    together = step(np.arange(B))
    assert len(set(together[3].tolist())) > 1  # a mix of accepted counts
    for r in range(B):
        alone = step(np.array([r]))
        for name, x, y in zip(("p", "keys", "draft", "accepted", "next"), together, alone):
            np.testing.assert_array_equal(x[r], y[0], err_msg=f"row {r} {name} changed with the batch")


# -------------------------------------------------------------------- keys


def _py_mix64(z: int) -> int:
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _py_position_key(seed: int, rh: int, sample: int, pos: int) -> tuple[int, int]:
    """Pure-Python integer reference for position_keys (the specification
    of the key schedule, independent of numpy and mlx)."""
    m = (1 << 64) - 1
    h = _py_mix64((seed & m) ^ sampling._SALT_SEED)
    h = _py_mix64(h ^ rh)
    h = _py_mix64((h + (sample + 1) * sampling._GAMMA) & m)
    w = _py_mix64(h ^ _py_mix64((pos + sampling._SALT_POS) & m))
    return w >> 32, w & 0xFFFFFFFF


def test_row_hash_is_a_stable_type_tagged_64_bit_hash():
    assert row_hash("row-a") == 8288070443215957050
    assert row_hash(17) == 13456320106966450902
    assert row_hash(np.int64(17)) == row_hash(17)
    values = [row_hash(x) for x in (7, "7", b"7", 7.5, (7,), None, True)]
    assert len(set(values)) == len(values)
    assert all(0 <= v < 2**64 for v in values)


def test_position_keys_are_fixed_integer_values():
    keys = position_keys(
        2024, [row_hash("row-a"), row_hash(17)], [0, 3], mx.array([[0, 1, 2], [7, 8, 9]], dtype=mx.int32)
    )
    assert keys.dtype == mx.uint32 and keys.shape == (2, 3, 2)
    assert np.array(keys).tolist() == [
        [[2798762394, 1296064122], [3089009394, 2333053041], [2190453902, 3406155987]],
        [[2765490489, 2403174462], [468672577, 2943751102], [886895914, 1891249228]],
    ]
    rng = np.random.default_rng(1)
    hashes = [int(h) for h in rng.integers(0, 2**64, size=5, dtype=np.uint64)]
    samples = [0, 1, 2, 0, 7]
    positions = rng.integers(0, 5000, size=(5, 4)).astype(np.int32)
    got = np.array(position_keys(2**40 + 3, hashes, samples, mx.array(positions)))
    for b in range(5):
        for t in range(4):
            assert tuple(got[b, t]) == _py_position_key(2**40 + 3, hashes[b], samples[b], int(positions[b, t]))


def test_keys_and_draws_are_identical_in_a_fresh_process():
    script = (
        "import json, mlx.core as mx, numpy as np\n"
        "from mtplx.decode.sampling import *\n"
        "k = position_keys(5, [row_hash('a'), row_hash(('b', 2))], [0, 1],"
        " mx.array([[0, 1], [2, 3]], dtype=mx.int32))\n"
        "print(json.dumps([np.array(k).tolist(),"
        " np.array(uniform_from_keys(purpose_keys(k, Purpose.ACCEPT))).tolist(),"
        " np.array(gumbel_from_keys(purpose_keys(k, Purpose.GUMBEL), 4)).tolist()]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    other = json.loads(result.stdout)
    k = position_keys(5, [row_hash("a"), row_hash(("b", 2))], [0, 1], mx.array([[0, 1], [2, 3]], dtype=mx.int32))
    mine = [
        np.array(k).tolist(),
        np.array(uniform_from_keys(purpose_keys(k, Purpose.ACCEPT))).tolist(),
        np.array(gumbel_from_keys(purpose_keys(k, Purpose.GUMBEL), 4)).tolist(),
    ]
    assert other == mine


def _as_words(keys) -> np.ndarray:
    keys = np.array(keys).astype(np.uint64).reshape(-1, 2)
    return (keys[:, 0] << np.uint64(32)) | keys[:, 1]


def test_keys_differ_across_rows_samples_positions_and_purposes():
    n_rows, n_pos = 300, 40
    hashes = [row_hash(i) for i in range(n_rows)]
    positions = mx.array(np.tile(np.arange(n_pos, dtype=np.int32), (n_rows, 1)))
    keys = position_keys(1, hashes, 0, positions)  # [300, 40, 2]
    other_sample = position_keys(1, hashes, 1, positions)
    other_seed = position_keys(2, hashes, 0, positions)
    words = [_as_words(keys), _as_words(other_sample), _as_words(other_seed)]
    words += [_as_words(purpose_keys(keys, p)) for p in Purpose]
    everything = np.concatenate(words)
    assert len(np.unique(everything)) == everything.size


def test_a_rows_keys_do_not_depend_on_the_batch():
    hashes = [row_hash(f"r{i}") for i in range(9)]
    samples = list(range(9))
    positions = np.arange(27, dtype=np.int32).reshape(9, 3)
    together = np.array(position_keys(7, hashes, samples, mx.array(positions)))
    for r in (0, 4, 8):
        alone = np.array(position_keys(7, [hashes[r]], [samples[r]], mx.array(positions[r : r + 1])))
        np.testing.assert_array_equal(alone[0], together[r])
    shuffled = np.array(position_keys(7, hashes[::-1], samples[::-1], mx.array(np.ascontiguousarray(positions[::-1]))))
    np.testing.assert_array_equal(shuffled[::-1], together)


def test_uniforms_and_gumbels_are_in_range_and_well_distributed():
    n = 200_000
    keys = position_keys(3, np.arange(n), 0, mx.zeros((n, 1), dtype=mx.int32))
    u = np.array(uniform_from_keys(purpose_keys(keys, Purpose.ACCEPT)))[:, 0]
    assert u.min() >= 0.0 and u.max() < 1.0
    bins = 50
    stat, df = chisq(np.bincount((u * bins).astype(int), minlength=bins), np.full(bins, 1 / bins))
    print(f"uniform histogram: chi2={stat:.1f} df={df} threshold={chi2_threshold(1e-4, df):.1f}")
    assert stat < chi2_threshold(1e-4, df)
    g = np.array(gumbel_from_keys(purpose_keys(keys[:20_000], Purpose.GUMBEL), 10))
    assert np.isfinite(g).all()
    assert abs(g.mean() - 0.5772156649) < 0.01  # Euler-Mascheroni: the Gumbel mean
    assert abs(g.var() - math.pi**2 / 6) < 0.03


# ---------------------------------------------------------------- non-finite


@pytest.mark.parametrize("rule", RULES)
def test_nan_logits_raise_naming_the_row_and_nonfinite_rows_flags_it(rule):
    rng = np.random.default_rng(12)
    B, k, vocab = 4, 2, 9
    logits = rng.normal(size=(B, k + 1, vocab)).astype(np.float32)
    logits[2, 1, 5] = np.nan
    params = [SamplingParams(1.0), GREEDY, SamplingParams(0.8, top_k=3), GREEDY]
    bs = batch_sampling(params)
    p = target_probs(mx.array(logits), bs)
    q = target_probs(mx.array(logits[:, :k]), bs)
    assert np.array(nonfinite_rows(p)).tolist() == [False, False, True, False]
    keys = position_keys(0, np.arange(B), 0, mx.array(np.tile(np.arange(k + 1, dtype=np.int32), (B, 1))))
    d = mx.zeros((B, k), dtype=mx.int32)
    with pytest.raises(NonFiniteError, match=r"rows=\[2\]"):
        speculative_accept(d, q, p, keys, rule=rule)
    # a greedy row with NaN logits is not turned into a made-up argmax
    logits[1, 0, 0] = np.nan
    p = target_probs(mx.array(logits), bs)
    assert np.array(nonfinite_rows(p)).tolist() == [False, True, True, False]
    with pytest.raises(NonFiniteError, match=r"rows=\[1, 2\]"):
        speculative_accept(d, q, p, keys, rule=rule)
    # +inf logits are as broken as NaN; -inf (masked tokens) is not
    logits = rng.normal(size=(B, k + 1, vocab)).astype(np.float32)
    logits[3, 2, 0] = np.inf
    logits[0, :, 1] = -np.inf
    p = target_probs(mx.array(logits), bs)
    assert np.array(nonfinite_rows(p)).tolist() == [False, False, False, True]
    # without the host check the step still runs, and the caller flags the row
    a, nxt = speculative_accept(d, q, p, keys, rule=rule, check_finite=False)
    assert a.shape == (B,) and nxt.shape == (B,)


# ------------------------------------------------------------ parameters


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_sampling_params_reject_invalid_values_with_a_clear_message(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_greedy_and_batch_as_arrays():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    bs = batch_sampling([SamplingParams(), SamplingParams(0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3)])
    assert isinstance(bs, BatchSampling)
    assert [x.dtype for x in bs[:5]] == [mx.float32, mx.int32, mx.float32, mx.float32, mx.bool_]
    assert bs.any_filter and not bs.all_greedy
    assert batch_sampling([SamplingParams()]).all_greedy
    assert not batch_sampling([SamplingParams(), SamplingParams(0.7)]).any_filter
    assert np.array(bs.greedy).tolist() == [True, False]
    assert np.array(bs.top_k).tolist() == [0, 5]
    with pytest.raises(Exception):
        SamplingParams().temperature = 1.0  # frozen


def test_a_batch_without_greedy_rows_skips_the_one_hot_and_gets_the_same_probabilities():
    mixed = batch_sampling([SamplingParams(), SamplingParams(0.7)])
    sampled = batch_sampling([SamplingParams(0.7), SamplingParams(1.3, top_k=3)])
    assert mixed.any_greedy and not sampled.any_greedy
    logits = mx.random.normal((2, 3, 11), key=mx.random.key(5))  # [B, T, V]
    general = target_probs(logits, sampled._replace(any_greedy=True))  # the graph a mixed batch runs
    assert mx.array_equal(target_probs(logits, sampled), general).item()
    # The flag is what keeps a greedy row's one-hot: without it the row would sample.
    p = np.array(target_probs(logits, mixed))
    assert np.array_equal(p[0], np.eye(11, dtype=np.float32)[np.argmax(np.array(logits[0]), axis=-1)])
    assert not np.array_equal(p[0], np.array(target_probs(logits, mixed._replace(any_greedy=False)))[0])


def test_inverse_cdf_draw_never_picks_a_zero_probability_token_even_at_the_top_uniform():
    top = 1.0 - 2.0**-24  # the largest uniform uniform_from_keys makes
    probs = mx.array([[0.25, 0.75, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0], [0.1, 0.0, 0.2, 0.0]])
    for u, want in ((top, [1, 3, 0, 2]), (0.0, [0, 1, 0, 0]), (0.3, [1, 1, 0, 0])):
        got = sampling._categorical(probs, mx.full((4,), u, dtype=mx.float32))
        assert got.tolist() == want, (u, got.tolist())
    # Unnormalised rows whose total is a power of two or just below one: the
    # top uniform times the total stays below the total, so the draw is the last positive token.
    for total in (1.0, 2.0, 0.9999999, 3.0):
        p = mx.array([[total / 3, 0.0, total * 2 / 3, 0.0]])
        assert sampling._categorical(p, mx.array([top], dtype=mx.float32)).item() == 2


def test_the_cycle_draws_are_the_public_keyed_draws_bit_for_bit():
    keys = mx.random.randint(0, 2**31, (5, 3, 2), key=mx.random.key(1)).astype(mx.uint32)  # [B, T, 2]
    keys = keys * 2 + mx.array([1, 0], dtype=mx.uint32)  # both words' top bits and low bits in play
    for p in sampling.Purpose:
        tag = sampling._mix64(sampling._mx_u64(int(p) + sampling._SALT_PURPOSE), sampling._mx_u64)  # on the device
        assert sampling._PURPOSE_TAGS[p] == int(np.array(tag))
        assert mx.array_equal(sampling._uniform_for(keys, p), uniform_from_keys(purpose_keys(keys, p))).item()
        assert mx.array_equal(sampling._gumbel_for(keys, p, 7), gumbel_from_keys(purpose_keys(keys, p), 7)).item()


def test_the_residual_uniforms_drawn_together_are_each_purposes_keyed_draw_bit_for_bit():
    base = sampling.row_key_base(3, [sampling.row_hash(i) for i in range(5)], [0, 1, 0, 2, 0])  # [B]
    positions = mx.array(np.random.default_rng(2).integers(0, 10_000, size=(5, 4)), dtype=mx.int32)  # [B, T]
    keys = sampling.keys_from_base(base, positions)  # [B, T, 2]
    for compiled in (False, True):
        u = sampling.residual_uniforms(base, positions, compiled=compiled)  # [B, T, 3]
        assert u.shape == (5, 4, len(sampling.RESIDUAL_DRAWS))
        for i, purpose in enumerate(sampling.RESIDUAL_DRAWS):
            assert mx.array_equal(u[..., i], sampling._uniform_for(keys, purpose)).item()


@pytest.mark.parametrize("k", [0, 1, 3])
def test_residual_accept_on_the_drawn_uniforms_decides_as_speculative_accept_on_the_keys(k):
    rng = np.random.default_rng(k)
    B, V = 200, 6  # a small vocabulary: drafts are often accepted, often corrected
    p = mx.softmax(mx.array(rng.normal(size=(B, k + 1, V)).astype(np.float32)), axis=-1)
    q = mx.softmax(mx.array(rng.normal(size=(B, k, V)).astype(np.float32)), axis=-1)
    draft = mx.array(rng.integers(0, V, size=(B, k)).astype(np.int32))
    nv = mx.array(rng.integers(0, k + 1, size=B).astype(np.int32))
    base = sampling.row_key_base(9, [sampling.row_hash(i) for i in range(B)], 0)
    positions = mx.array(rng.integers(0, 500, size=(B, 1)) + np.arange(k + 1), dtype=mx.int32)  # [B, k+1]
    keys = sampling.keys_from_base(base, positions)
    a_ref, n_ref = speculative_accept(draft, q, p, keys, num_valid=nv, rule="residual")
    a, n = sampling.residual_accept(draft, q, p, sampling.residual_uniforms(base, positions), nv)
    assert a.tolist() == a_ref.tolist() and n.tolist() == n_ref.tolist()
    if k:  # the case mixes accepted, corrected and bonus rows, so each path was compared
        assert 0 < int(mx.sum(a == nv)) < B and int(mx.sum(a == 0)) > 0


def test_unknown_rule_is_rejected():
    with pytest.raises(ValueError, match="rule"):
        sample_plain(mx.ones((1, 1, 2)) / 2, mx.zeros((1, 1, 2), dtype=mx.uint32), "typo")


def test_greedy_fast_path_equals_the_general_rule_on_one_hot_targets():
    rng = np.random.default_rng(7)
    B, k, V = 64, 3, 12
    logits = mx.array(rng.integers(0, 4, size=(B, k + 1, V)).astype(np.float32))  # many exact ties
    draft = mx.array(rng.integers(0, V, size=(B, k)).astype(np.int32))
    nv = mx.array(rng.integers(0, k + 1, size=B).astype(np.int32))
    bs = batch_sampling([SamplingParams()] * B)
    p = target_probs(logits, bs)
    keys = sampling.position_keys(0, list(range(B)), [0] * B, mx.zeros((B, k + 1), dtype=mx.int32))
    for rule in ("residual", "coupled"):
        a_ref, n_ref = speculative_accept(draft, p[:, :k], p, keys, num_valid=nv, rule=rule)
        a, n = sampling.greedy_accept(draft, logits, num_valid=nv)
        assert np.array_equal(np.array(a), np.array(a_ref)) and np.array_equal(np.array(n), np.array(n_ref))
