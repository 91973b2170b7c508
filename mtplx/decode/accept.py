"""A cycle's token decisions as compiled graphs: the draft choice (traced in
decode.draft) and accept. A non-finite target position j stops a row's
drafts (num_valid) and errors it only if j is decided (`bad`)."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional

import mlx.core as mx

from mtplx.decode.numerics import log_softmax_f32, nonfinite_rows, replace_nonfinite_rows
from mtplx.decode.sampling import (
    BatchSampling,
    Purpose,
    draft_tokens,
    greedy_accept,
    keys_from_base,
    residual_accept,
    residual_draft,
    residual_draw,
    residual_uniforms,
    speculative_accept,
    target_probs,
)


class Decision(NamedTuple):
    accepted: mx.array  # [B] drafts accepted, a_b
    next_token: mx.array  # [B] correction or bonus token at index a_b
    emitted_ids: mx.array  # [B, k+1] d_1..d_a, then next_token at index a
    num_valid: mx.array  # [B] drafts that counted (max_tokens, non-finite cut-off)
    bad: mx.array  # [B] the decided position's logits were non-finite
    keep: mx.array  # [B] verify entries each slot keeps (0 for empty slots)
    logprobs: Optional[mx.array]  # [B, k+1] of emitted_ids, when asked for


def decide(
    logits: mx.array,
    drafts: mx.array,
    q: Optional[mx.array],
    num_valid: mx.array,
    active: mx.array,
    draws: Optional[mx.array],
    sampling: BatchSampling,
    rule: str,
    logprobs: bool,
    compiled: bool = True,
) -> Decision:
    """logits [B, k+1, V] of the verify, drafts [B, k], q [B, k, V] (None when
    greedy or k = 0), num_valid [B], active [B], draws (`cycle_draws`; None
    when every row is greedy)."""
    greedy = sampling.all_greedy
    fn = _decide_fn(greedy, sampling.any_filter, sampling.any_greedy, rule, logprobs, q is not None, compiled)
    args = [logits, drafts, num_valid, active]
    if not greedy:
        args += [draws, *sampling_arrays(sampling)]
        args += [q] if q is not None else []
    out = fn(*args)
    return Decision(*out[:6], out[6] if logprobs else None)


@lru_cache(maxsize=None)
def _decide_fn(
    greedy: bool, any_filter: bool, any_greedy: bool, rule: str, logprobs: bool, has_q: bool, compiled: bool
):
    def run(logits, drafts, num_valid, active, *sampled):
        k = drafts.shape[1]
        bad_pos = mx.any(~mx.isfinite(logits), axis=-1)  # [B, k+1]
        first_bad = mx.where(mx.any(bad_pos, axis=1), mx.argmax(bad_pos, axis=1), k + 1)  # [B]
        logits = mx.where(bad_pos[..., None], 0.0, logits)
        nv = mx.minimum(num_valid, first_bad.astype(mx.int32))  # [B]
        if greedy:
            accepted, nxt = greedy_accept(drafts, logits, num_valid=nv)  # [B], [B]
        else:
            draws, bs = sampled[0], _sampling_from(sampled[1:6], any_filter, any_greedy)
            p = target_probs(logits, bs, finite=True)  # [B, k+1, V]: non-finite positions zeroed above
            q = sampled[6] if has_q else p[:, :0]
            if rule == "residual":
                accepted, nxt = residual_accept(drafts, q, p, draws, nv)
            else:
                accepted, nxt = speculative_accept(drafts, q, p, draws, num_valid=nv, rule=rule, check_finite=False)
        emitted_ids = mx.where(
            mx.arange(k + 1)[None, :] == accepted[:, None],
            nxt[:, None],
            mx.concatenate([drafts, nxt[:, None]], axis=1),
        )  # [B, k+1]
        keep = mx.where(active, accepted + 1, 0)  # [B]
        out = [accepted, nxt, emitted_ids, nv, first_bad == accepted, keep]
        if logprobs:
            lp = log_softmax_f32(logits)  # [B, k+1, V]
            out.append(mx.take_along_axis(lp, emitted_ids[..., None], axis=-1)[..., 0])  # [B, k+1]
        return out

    return mx.compile(run) if compiled else run


def choose_draft(
    logits: mx.array,
    draws: Optional[mx.array],
    sampled: tuple,
    greedy: bool,
    any_filter: bool,
    any_greedy: bool,
    rule: str,
):
    """The draft at one depth: head logits [B, V], `cycle_draws` [B, 1, ...],
    `sampling_arrays` -> d [B, 1], q [B, 1, V] (None when greedy). Any q is
    exact, so a non-finite head drafts from the uniform, and a greedy draft
    needs no guard or tie rule (the verify checks it)."""
    if greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)[:, None], None  # [B, 1]
    logits = replace_nonfinite_rows(logits, nonfinite_rows(logits))  # [B, V]
    q = target_probs(logits[:, None], _sampling_from(sampled, any_filter, any_greedy), finite=True)  # [B, 1, V]
    if rule == "residual":
        return residual_draft(q, residual_draw(draws, Purpose.DRAFT)), q  # [B, 1], [B, 1, V]
    return draft_tokens(q, draws, rule), q  # [B, 1], [B, 1, V]


def cycle_draws(key_base: mx.array, positions: mx.array, rule: str, compiled: bool = True) -> mx.array:
    """A sampled cycle's randomness at positions [B, k+1] from `row_key_base`
    [B]: residual, the uniforms [B, k+1, 3]; coupled, the keys [B, k+1, 2]."""
    if rule == "residual":
        return residual_uniforms(key_base, positions, compiled=compiled)
    return keys_from_base(key_base, positions, compiled=compiled)


def sampling_arrays(bs: BatchSampling) -> list:
    """A batch's sampling parameters as the arrays a traced graph takes."""
    return [bs.temperature, bs.top_k, bs.top_p, bs.min_p, bs.greedy]


def _sampling_from(arrays, any_filter: bool, any_greedy: bool) -> BatchSampling:
    """BatchSampling inside a traced graph, from `sampling_arrays` (some row samples)."""
    return BatchSampling(*arrays, any_filter=any_filter, all_greedy=False, any_greedy=any_greedy)


def forget_traces() -> None:
    """Drop the traced graphs (a test that patches the sampling functions must retrace)."""
    _decide_fn.cache_clear()
