"""Prefill one prompt at batch 1: the trunk over the prompt, in chunks, and
the head over the prompt's pairs, so the head's history is complete before
the first draft."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx


@dataclass
class Prefilled:
    trunk_cache: list  # mlx-lm caches at batch 1, covering the whole prompt
    head_cache: Optional[list]  # one KVCache per head layer: pairs (h_t, x_{t+1}), t < n-1
    last_logits: mx.array  # [1, V] the trunk's logits after the last prompt token
    last_hidden: mx.array  # [1, H] the head-facing hidden state at the last position
    length: int


def prefill(model, ids: List[int], chunk: int, with_head: bool) -> Prefilled:
    cache = model.make_cache()
    head_cache = model.make_head_cache() if with_head else None
    prev_last = None  # [1, 1, H] hidden of the previous chunk's last position
    logits = hidden = None
    for start in range(0, len(ids), chunk):
        toks = ids[start : start + chunk]
        logits, hidden = model.forward(mx.array([toks]), cache)  # [1, T, V], [1, T, H]
        if with_head:
            # Pairs (h_t, x_{t+1}) whose next token is already known.
            hs = hidden[:, :-1] if prev_last is None else mx.concatenate([prev_last, hidden[:, :-1]], axis=1)
            nxt = ids[max(start, 1) : start + len(toks)]
            if nxt:
                for j in range(model.num_head_layers):
                    model.head(hs, mx.array([nxt]), cache=head_cache, depth=j + 1)
            prev_last = hidden[:, -1:]
        mx.eval([c.state for c in cache] + ([c.state for c in head_cache] if head_cache else []))
    return Prefilled(cache, head_cache, logits[:, -1], hidden[:, -1], len(ids))
