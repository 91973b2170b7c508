"""Float32 numerics: log-softmax, normalisation, non-finite guards and the
residual distribution (edge cases and probability conservation)."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplx.decode.numerics import (
    ZERO_MASS_TOL,
    NonFiniteError,
    log_softmax_f32,
    nonfinite_rows,
    raise_if_nonfinite,
    replace_nonfinite_rows,
    safe_normalize,
)
from mtplx.decode.sampling import residual_distribution


def np_(x):
    return np.array(x, dtype=np.float64)


def assert_is_distribution(r, atol=1e-6):
    r = np_(r)
    assert np.all(np.isfinite(r))
    assert np.all(r >= 0.0), "negative probability"
    np.testing.assert_allclose(r.sum(-1), 1.0, atol=atol)


def conservation_error(p, q, r):
    """max_x |min(p,q)(x) + (1 - sum min(p,q)) * r(x) - p(x)| in float64."""
    p, q, r = np_(p), np_(q), np_(r)
    overlap = np.minimum(p, q)
    rebuilt = overlap + (1.0 - overlap.sum(-1, keepdims=True)) * r
    return np.max(np.abs(rebuilt - p))


# ------------------------------------------------------------ basic helpers


def test_log_softmax_f32_matches_float64_and_keeps_masked_tokens_at_minus_inf():
    x = mx.array([[1.0, 2.0, -mx.inf, 0.5], [100.0, -100.0, 3.0, 3.0]], dtype=mx.float16)
    got = log_softmax_f32(x)
    assert got.dtype == mx.float32
    ref = np_(x.astype(mx.float32))
    ref = ref - np.log(np.sum(np.exp(ref - ref.max(-1, keepdims=True)), -1, keepdims=True)) - ref.max(-1, keepdims=True)
    np.testing.assert_allclose(np_(got), ref, rtol=1e-6, atol=1e-6)
    assert np_(got)[0, 2] == -np.inf


def test_log_softmax_f32_of_an_all_masked_row_is_nan_so_guards_see_it():
    got = log_softmax_f32(mx.full((2, 3), -mx.inf))
    assert np.all(np.isnan(np_(got)))


def test_safe_normalize_divides_by_sum_and_leaves_zero_rows_zero():
    x = mx.array([[1.0, 3.0], [0.0, 0.0]])
    np.testing.assert_allclose(np_(safe_normalize(x)), [[0.25, 0.75], [0.0, 0.0]])
    np.testing.assert_allclose(np_(safe_normalize(mx.array([[1.0], [3.0]]), axis=0)), [[0.25], [0.75]])


def test_nonfinite_rows_flags_exactly_rows_with_nan_or_inf():
    x = np.zeros((5, 2, 3), dtype=np.float32)
    x[1, 1, 2] = np.nan
    x[3, 0, 0] = np.inf
    x[4, 1, 1] = -np.inf
    assert np.array(nonfinite_rows(mx.array(x))).tolist() == [False, True, False, True, True]
    assert np.array(nonfinite_rows(mx.array([1.0, np.nan]))).tolist() == [False, True]
    assert np.array(nonfinite_rows(mx.array([[1, 2]]))).tolist() == [False]


def test_raise_if_nonfinite_names_the_rows_by_index_or_given_name():
    x = mx.array([[0.5, 0.5], [np.nan, 1.0], [0.1, 0.9], [np.inf, 0.0]])
    with pytest.raises(NonFiniteError, match=r"rows=\[1, 3\]") as info:
        raise_if_nonfinite(x)
    assert info.value.rows == [1, 3]
    with pytest.raises(NonFiniteError, match=r"rows=\['b', 'd'\]"):
        raise_if_nonfinite(x, row_names=["a", "b", "c", "d"])
    raise_if_nonfinite(x[::2][:1])  # a finite batch passes silently
    assert issubclass(NonFiniteError, ValueError)


def test_replace_nonfinite_rows_makes_bad_rows_uniform_and_leaves_others_alone():
    x = mx.array([[[0.2, 0.8, 0.0, 0.0]], [[np.nan, 0.0, 0.0, 1.0]]])  # [2, 1, 4]
    fixed = replace_nonfinite_rows(x, nonfinite_rows(x))
    np.testing.assert_array_equal(np_(fixed[0]), np_(x[0]))
    np.testing.assert_allclose(np_(fixed[1]), [[0.25] * 4])
    assert not np.array(nonfinite_rows(fixed)).any()


# ------------------------------------------------------ residual edge cases


def test_zero_mass_tol_is_small_but_well_above_float32_dust():
    assert 1e-7 < ZERO_MASS_TOL <= 1e-5


def test_residual_when_draft_covers_target_falls_back_to_target():
    p = mx.array([0.1, 0.2, 0.3, 0.4])
    r = residual_distribution(p, p)
    np.testing.assert_allclose(np_(r), np_(p), atol=1e-7)
    assert_is_distribution(r)


def test_residual_of_disjoint_supports_is_the_target():
    p = mx.array([0.5, 0.5, 0.0, 0.0])
    q = mx.array([0.0, 0.0, 0.25, 0.75])
    np.testing.assert_allclose(np_(residual_distribution(p, q)), np_(p), atol=1e-7)


def test_residual_with_one_hot_draft_removes_that_token_only():
    p = mx.array([0.1, 0.2, 0.3, 0.4])
    q = mx.array([0.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(np_(residual_distribution(p, q)), [1 / 6, 2 / 6, 3 / 6, 0.0], atol=1e-6)


def test_residual_with_one_hot_target_is_that_one_hot():
    p = mx.array([0.0, 1.0, 0.0])
    for q in ([0.3, 0.3, 0.4], [0.0, 0.0, 1.0], [0.0, 0.5, 0.5]):
        np.testing.assert_array_equal(np_(residual_distribution(p, mx.array(q))), [0.0, 1.0, 0.0])


def test_residual_with_equal_one_hots_falls_back_to_the_target():
    p = mx.array([0.0, 1.0, 0.0])
    np.testing.assert_array_equal(np_(residual_distribution(p, p)), [0.0, 1.0, 0.0])


def test_residual_float_dust_never_gives_negative_probabilities():
    # q exceeds p by float32 rounding dust on some tokens and differs by
    # less than ZERO_MASS_TOL in total: the fallback is the (clean) target.
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(50), size=64).astype(np.float32)  # [64, 50]
    q = (p * (1 + rng.uniform(-3e-7, 3e-7, size=p.shape))).astype(np.float32)
    r = residual_distribution(mx.array(p), mx.array(q))
    assert_is_distribution(r)
    np.testing.assert_allclose(np_(r), p, atol=1e-6)
    # Dust on top of a real difference: negatives are clipped before the sum.
    p2 = np.array([0.5, 0.5, 0.0, 0.0], np.float32)
    q2 = np.array([0.25, 0.5 + 1e-8, 1e-9, 0.25 - 1e-8 - 1e-9], np.float32)
    r2 = np_(residual_distribution(mx.array(p2), mx.array(q2)))
    assert np.all(r2 >= 0)
    np.testing.assert_allclose(r2, [1.0, 0.0, 0.0, 0.0], atol=1e-6)


def test_residual_mask_zero_gives_the_target_and_mask_is_per_row():
    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.ones(6), size=(3, 2)).astype(np.float32)  # [B=3, T=2, V=6]
    q = rng.dirichlet(np.ones(6), size=(3, 2)).astype(np.float32)
    np.testing.assert_allclose(np_(residual_distribution(mx.array(p), mx.array(q), 0.0)), p, atol=1e-6)
    mixed = np_(residual_distribution(mx.array(p), mx.array(q), mx.array([1.0, 0.0, 1.0])))
    full = np_(residual_distribution(mx.array(p), mx.array(q)))
    np.testing.assert_allclose(mixed[1], p[1], atol=1e-6)
    np.testing.assert_allclose(mixed[[0, 2]], full[[0, 2]], atol=0)
    per_position = np_(residual_distribution(mx.array(p), mx.array(q), mx.array([[0.0, 1.0]] * 3)))
    np.testing.assert_allclose(per_position[:, 0], p[:, 0], atol=1e-6)
    np.testing.assert_allclose(per_position[:, 1], full[:, 1], atol=0)


@pytest.mark.parametrize("shape", [(7,), (5, 7), (3, 4, 7)])
def test_residual_keeps_shape_and_gives_distributions(shape):
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]).astype(np.float32).reshape(shape)
    q = rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]).astype(np.float32).reshape(shape)
    r = residual_distribution(mx.array(p), mx.array(q))
    assert r.shape == shape and r.dtype == mx.float32
    assert_is_distribution(r)
    assert conservation_error(p, q, r) < 2e-6


# ---------------------------------------------------------- conservation


def test_conservation_on_a_batch_of_random_and_sparse_pairs():
    # min(p,q) + (1 - sum min(p,q)) * residual == p, token by token: the
    # accept/correct step as a whole reproduces p exactly.
    rng = np.random.default_rng(6)
    B, V = 4000, 9
    p = rng.dirichlet(np.full(V, 0.3), size=B)
    q = rng.dirichlet(np.full(V, 0.3), size=B)
    p[rng.random((B, V)) < 0.3] = 0.0  # sparse supports, some disjoint
    q[rng.random((B, V)) < 0.3] = 0.0
    p[:, 0] += 1e-3
    q[:, -1] += 1e-3
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
    q[:200] = p[:200]  # identical pairs: residual mass exactly zero
    r = residual_distribution(mx.array(p), mx.array(q))
    assert_is_distribution(r)
    assert conservation_error(p, q, r) < 2e-6


def _normalised(weights):
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).astype(np.float32)


weights = st.lists(st.one_of(st.just(0.0), st.just(1e-9), st.floats(0.0, 1.0)), min_size=2, max_size=8).filter(
    lambda w: sum(w) > 1e-3
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(weights, st.data())
def test_conservation_on_adversarial_pairs(pw, data):
    qw = data.draw(
        st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1.0)), min_size=len(pw), max_size=len(pw)).filter(
            lambda w: sum(w) > 1e-3
        )
    )
    p, q = _normalised(pw), _normalised(qw)
    r = residual_distribution(mx.array(p), mx.array(q))
    assert_is_distribution(r)
    assert conservation_error(p, q, r) < 2e-6
    # residual never puts mass where the target has none
    assert np.all(np_(r)[p == 0] == 0)
