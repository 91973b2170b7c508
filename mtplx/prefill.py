"""Prefill prompts: the trunk over each prompt, in chunks, and the head over
the prompt's pairs, so the head's history is complete before the first draft.

Prompts are prefilled together, right-padded to the longest (each with its
own last token). Right padding is exact for both layer kinds: a row's queries only look back, and mlx-lm's
gated-delta layer freezes its state (and conv window) past each row's
`lengths`. Each row's caches are then cut to its own length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx


@dataclass
class RowKV:
    keys: mx.array  # [1, H, L, Dk]
    values: mx.array  # [1, H, L, Dv]


@dataclass
class RowGDN:
    conv: mx.array  # [1, K-1, C]
    state: mx.array  # [1, Hv, Dv, Dk]


@dataclass
class Prefilled:
    trunk_cache: list  # per trunk layer: RowKV (L entries) or RowGDN
    head_cache: Optional[list]  # per head layer: RowKV of L-1 pairs (h_t, x_{t+1})
    last_logits: mx.array  # [1, V] the trunk's logits after the last prompt token
    last_hidden: mx.array  # [1, H] the head-facing hidden state at the last position
    length: int


def prefill_batch(model, prompts: List[List[int]], chunk: int, with_head: bool) -> List[Prefilled]:
    lengths = [len(p) for p in prompts]
    L = max(lengths)
    # A row is padded with its own last token: whatever the pad computes is
    # discarded, but a pad whose forward is non-finite would still poison
    # the row's real positions (0 x NaN in masked attention and in the
    # chunk-wise gated delta), and this token would have poisoned it anyway.
    tokens = mx.array([p + p[-1:] * (L - len(p)) for p in prompts], dtype=mx.int32)  # [B, L]
    cache = model.make_cache()
    for c in cache:
        if hasattr(c, "lengths"):  # gated-delta: freeze past each row's end
            c.lengths = mx.array(lengths, dtype=mx.int32)
    head_cache = model.make_head_cache() if with_head else None
    last_at = mx.array(lengths, dtype=mx.int32) - 1  # [B]
    last_logits = last_hidden = None
    prev_last = None  # [B, 1, H] hidden of the previous chunk's last position
    for start in range(0, L, chunk):
        T = min(chunk, L - start)
        logits, hidden = model.forward(tokens[:, start : start + T], cache)  # [B, T, V], [B, T, H]
        idx = mx.clip(last_at - start, 0, T - 1)  # [B]
        here = (last_at >= start) & (last_at < start + T)  # [B]
        ll = mx.take_along_axis(logits, idx[:, None, None], axis=1)[:, 0]  # [B, V]
        lh = mx.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]  # [B, H]
        last_logits = ll if last_logits is None else mx.where(here[:, None], ll, last_logits)
        last_hidden = lh if last_hidden is None else mx.where(here[:, None], lh, last_hidden)
        if with_head:
            # Pairs (h_t, x_{t+1}) whose next token is in the padded batch.
            hs = hidden[:, :-1] if prev_last is None else mx.concatenate([prev_last, hidden[:, :-1]], axis=1)
            nxt = tokens[:, max(start, 1) : start + T]
            if nxt.shape[1]:
                for j in range(model.num_head_layers):
                    model.head(hs, nxt, cache=head_cache, depth=j + 1)
            prev_last = hidden[:, -1:]
        mx.eval([c.state for c in cache] + ([c.state for c in head_cache] if head_cache else []) + [last_logits, last_hidden])
    return [_row(model, cache, head_cache, last_logits, last_hidden, b, n) for b, n in enumerate(lengths)]


def _row(model, cache, head_cache, last_logits, last_hidden, b: int, n: int) -> Prefilled:
    trunk = []
    for kind, c in zip(model.layer_kinds, cache):
        if kind == "linear":
            trunk.append(RowGDN(c[0][b : b + 1], c[1][b : b + 1]))
        else:
            trunk.append(RowKV(c.keys[b : b + 1, :, :n], c.values[b : b + 1, :, :n]))
    head = None
    if head_cache is not None:
        head = [
            RowKV(c.keys[b : b + 1, :, : n - 1], c.values[b : b + 1, :, : n - 1]) if c.keys is not None else None
            for c in head_cache
        ]
    return Prefilled(trunk, head, last_logits[b : b + 1], last_hidden[b : b + 1], n)


# What one more prefill call costs, in padded prompt positions (a row x a
# position). Prefill time here is about 10 ms per call plus 0.3-0.4 ms per
# padded position (built-in model, batch 1-16, 16-128-token prompts).
PREFILL_CALL_POSITIONS = 32


def prefill_by_length(model, prompts: List[List[int]], chunk: int, with_head: bool,
                      call_positions: int = PREFILL_CALL_POSITIONS) -> List[Prefilled]:
    """`prefill_batch` over groups of similar lengths, results in input
    order. A batch is padded to its longest prompt, and prompts of 30 and
    128 tokens padded together compute 98 positions for nothing; a group
    per length range costs a call each instead (`length_groups`)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: List[Optional[Prefilled]] = [None] * len(prompts)
    for a, b in length_groups([len(prompts[i]) for i in order], call_positions):
        group = order[a:b]
        for i, pre in zip(group, prefill_batch(model, [prompts[i] for i in group], chunk, with_head)):
            out[i] = pre
    return out


def length_groups(lengths: List[int], call_positions: int) -> List[tuple]:
    """Ascending `lengths` cut into runs [a, b) that minimise the sum over
    runs of call_positions + rows x longest (dynamic programming)."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of lengths[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + call_positions + (j - i) * lengths[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], n
    while j > 0:
        runs.append((cut[j], j))
        j = cut[j]
    return runs[::-1]


def prefill(model, ids: List[int], chunk: int, with_head: bool) -> Prefilled:
    return prefill_batch(model, [ids], chunk, with_head)[0]
