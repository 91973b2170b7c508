"""Sampled output of the whole runtime follows the target distribution.

One prompt, many samples (one request with n rows, each with its own keys),
depth 2 on a vocabulary of 32, top_k=4. The first three generated tokens
t0 (from the prefill logits), t1 and t2 (decided by the first speculative
cycle: drafted, accepted or corrected) are compared with the exact target,
computed by enumerating the trunk's own probabilities:
- the joint of (t0, t1) and of (t1, t2), 16 cells each;
- the joint of (t0, t1, t2), 64 cells.
Each rule runs with the whole vocabulary and with a reduced draft vocabulary
(the head scores ids 0..DRAFT_VOCAB-1 alone, so part of the target's support
can only come from a rejection). False-alarm rate: 1e-3 for the whole file
(Bonferroni over the 12 honest tests), cells expecting fewer than 5 pooled. The same statistic must reject a
planted 1% TV error and a deliberately broken acceptance rule, so its power
is proven, not assumed.
"""

import mlx.core as mx
import numpy as np
import pytest
from model_helpers import make_predictable
from stats import chi2_threshold, chisq, noncentral_power

import mtplx
import mtplx.decode.sampling as sampling
from mtplx import MTPContract, MTPLXRuntime
from mtplx.decode.accept import forget_traces
from mtplx.decode.sampling import SamplingParams, batch_sampling, target_probs
from mtplx.testing import tiny_checkpoint

N = 16_000
TEMPERATURE = 1.5  # checked below: the target is neither near-one-hot nor near-uniform
TOP_K = 4
FAMILY_ALPHA = 1e-3
N_HONEST = 12
DRAFT_VOCAB = 12  # of 32: checked below to leave a share of the target outside the set
SETTINGS = [("residual", 0), ("coupled", 0), ("residual", DRAFT_VOCAB), ("coupled", DRAFT_VOCAB)]
THRESH_ALPHA = FAMILY_ALPHA / N_HONEST
PROMPT = [5, 9, 2, 14, 7]
SP = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("v32"), vocab_size=32, seed=4)
    return make_predictable(mtplx.load(path), layer_scale=0.5)


def _target(model, prefix):
    logits, _ = model.forward(mx.array([PROMPT + [int(t) for t in prefix]]))
    p = target_probs(logits[:, -1:], batch_sampling([SP]))[0, 0]
    return np.array(p, dtype=np.float64)


@pytest.fixture(scope="module")
def exact(model):
    """P(t0, t1, t2) by enumeration over the top-k supports."""
    V = 32
    joint = np.zeros((V, V, V))
    p0 = _target(model, [])
    for a in np.nonzero(p0)[0]:
        p1 = _target(model, [a])
        for b in np.nonzero(p1)[0]:
            joint[a, b] += p0[a] * p1[b] * _target(model, [a, b])
    return joint


def _samples(model, rule, draft_vocab=0):
    rt = MTPLXRuntime(model, MTPContract(depth=2, acceptance=rule, draft_vocab=draft_vocab), max_batch=1024)
    rt.eos = set()  # keep every row to 4 tokens so each has t0, t1, t2
    outs = rt.generate([PROMPT], sampling=SP, max_tokens=4, n=N, seed=2024)
    toks = np.array([o.tokens[:3] for o in outs])
    accepted = np.sum([o.accepted_by_depth for o in outs], axis=0)
    return toks, accepted


@pytest.fixture(scope="module")
def samples(model):
    return {setting: _samples(model, *setting) for setting in SETTINGS}


def _tables(toks, exact):
    V = exact.shape[0]

    def counts(cols, shape):
        flat = np.ravel_multi_index(tuple(toks[:, c] for c in cols), shape)
        return np.bincount(flat, minlength=int(np.prod(shape))).astype(np.float64)

    return {
        "t0,t1": (counts([0, 1], (V, V)), exact.sum(axis=2).ravel()),
        "t1,t2": (counts([1, 2], (V, V)), exact.sum(axis=0).ravel()),
        "t0,t1,t2": (counts([0, 1, 2], (V, V, V)), exact.ravel()),
    }


@pytest.mark.gpu
def test_target_is_neither_one_hot_nor_uniform(exact):
    p01 = exact.sum(axis=2)
    top = np.sort(p01.ravel())[::-1]
    assert 0.05 < top[0] < 0.6, top[:4]
    assert np.count_nonzero(p01 > 0.01) >= 6


@pytest.mark.gpu
def test_reduced_draft_vocabulary_leaves_target_mass_outside_the_set(exact, model):
    assert DRAFT_VOCAB < model.vocab_size
    for axis in ((1, 2), (0, 2), (0, 1)):  # t0, t1, t2
        outside = exact.sum(axis=axis)[DRAFT_VOCAB:].sum()
        assert 0.1 < outside < 0.9, (axis, outside)


@pytest.mark.gpu
@pytest.mark.parametrize("rule,draft_vocab", SETTINGS)
def test_sampled_tokens_follow_the_exact_target(samples, exact, rule, draft_vocab):
    toks, accepted = samples[rule, draft_vocab]
    assert accepted[0] > 0.1 * N, "the head must accept often enough to test acceptance"
    for name, (counts, probs) in _tables(toks, exact).items():
        stat, df = chisq(counts, probs)
        thr = chi2_threshold(THRESH_ALPHA, df)
        print(
            f"{rule}, draft vocabulary {draft_vocab or 'all'} {name}: "
            f"chi2 {stat:.1f} (df {df}) threshold {thr:.1f}, accepted {accepted}"
        )
        assert stat < thr


def _planted(probs):
    """Move 1% of mass from the likeliest cell to the rarest one that the test keeps."""
    p = probs.copy()
    kept = np.nonzero(p * N >= 5)[0]
    hi, lo = kept[np.argmax(p[kept])], kept[np.argmin(p[kept])]
    p[hi] -= 0.01
    p[lo] += 0.01
    return p


@pytest.mark.gpu
def test_same_test_rejects_a_planted_one_percent_tv_error(samples, exact):
    toks, _ = samples["residual", 0]
    counts, probs = _tables(toks, exact)["t1,t2"]
    planted = _planted(probs)
    stat, df = chisq(counts, planted)
    thr = chi2_threshold(THRESH_ALPHA, df)
    kept = planted * N >= 5
    lam = N * np.sum((probs[kept] - planted[kept]) ** 2 / planted[kept])
    power = noncentral_power(thr, df, lam)
    print(f"planted 1% TV: chi2 {stat:.1f} (df {df}) threshold {thr:.1f}, noncentrality {lam:.0f}, power {power:.4f}")
    assert power > 0.99
    assert stat > thr


@pytest.fixture
def fresh_traces():
    # The accept step runs as a traced graph; the planted bug must be traced,
    # and must not outlive its test.
    forget_traces()
    yield
    forget_traces()


@pytest.mark.gpu
def test_same_test_rejects_a_broken_acceptance_rule(model, exact, monkeypatch, fresh_traces):
    # The classic bug: the correction drawn from the target instead of the residual.
    monkeypatch.setattr(sampling, "residual_distribution", lambda target, draft, mask=None: target)
    toks, _ = _samples(model, "residual")
    counts, probs = _tables(toks, exact)["t1,t2"]
    stat, df = chisq(counts, probs)
    thr = chi2_threshold(THRESH_ALPHA, df)
    print(f"broken rule: chi2 {stat:.1f} (df {df}) threshold {thr:.1f}")
    assert stat > thr
