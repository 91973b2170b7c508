"""Head catch-up and drafts d_1..d_k as one compiled graph per (k, sampling).
The catch-up's entries are kept; the chain's land past each row's new
length, masked until the next catch-up (k+1 wide, more than the chain's
k-1) overwrites them, so the chain writes in place rather than into copies.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx

from mtplx.decode.accept import choose_draft, sampling_arrays
from mtplx.decode.cache import SlotKVCache
from mtplx.decode.passes import common_span, shadow_caches, span_marker


class HeadPending(NamedTuple):
    """The head's inputs the last verify left: pairs (H_t, token_t), of which
    a row keeps `keep`; the output at `take` is the primary's."""

    hidden: mx.array  # [B, T, H]
    tokens: mx.array  # [B, T]
    take: mx.array  # [B]
    keep: mx.array  # [B]


class DraftChain:
    """`chain(pending, draws, sampling, head_caches, k, span)` -> drafts [B, k],
    q [B, k, V] (None when all greedy); `span` bounds the caches' lengths.
    `ids` [N]: the head scores these ids alone (`models.draft_vocab`), of a
    vocabulary of `vocab`; None: the head's logits are over the vocabulary."""

    def __init__(
        self,
        head,
        num_layers: int,
        rule: str,
        compiled: bool = True,
        ids: Optional[mx.array] = None,
        vocab: Optional[int] = None,
    ):
        self.head = head
        self.num_layers = num_layers
        self.rule = rule
        self.compiled = compiled
        self.ids, self.vocab = ids, vocab
        self._fns: Dict[Tuple, Callable] = {}

    def __call__(
        self,
        pending: HeadPending,
        draws: Optional[mx.array],
        sampling,
        head_caches: List[SlotKVCache],
        k: int,
        span: int,
    ):
        greedy = sampling.all_greedy
        T = pending.tokens.shape[1]
        for j, c in enumerate(head_caches):
            if c.keys is None:  # only one-token prompts so far: no head entries yet
                self._allocate(c, j, pending.hidden)
            c.reserve(span + T + k - 1)  # the catch-up's entries, then the chain's (not kept)
        fn = self._fn(k, greedy, sampling.any_filter, sampling.any_greedy)
        arrays = [a for c in head_caches for a in (c.keys, c.values, c.lengths)]
        sampled = [] if greedy else [draws, *sampling_arrays(sampling)]
        read = span_marker(common_span(head_caches, span + T + k - 1))  # the catch-up's writes, then the chain's
        out = fn(read, *pending, *sampled, *arrays)
        n_drafts = 1 if greedy else 2
        written = iter(out[n_drafts:])
        for c in head_caches:
            c.keys, c.values, c.lengths = next(written), next(written), next(written)
            c.host_max = span + T
        return (out[0], None) if greedy else (out[0], out[1])

    def _allocate(self, cache: SlotKVCache, j: int, hidden: mx.array):
        """Empty keys and values of head layer j's shapes (from an eager probe), for `reserve` to grow."""
        probe = SlotKVCache(1)
        self.head(
            mx.zeros((1, 1, hidden.shape[-1]), dtype=hidden.dtype),
            mx.zeros((1, 1), dtype=mx.int32),
            cache=_only(probe, j, self.num_layers),
            depth=j + 1,
        )
        B = cache.batch_size
        cache.keys = mx.zeros((B, probe.keys.shape[1], 0, probe.keys.shape[3]), dtype=probe.keys.dtype)
        cache.values = mx.zeros((B, probe.values.shape[1], 0, probe.values.shape[3]), dtype=probe.values.dtype)

    def _fn(self, k: int, greedy: bool, any_filter: bool, any_greedy: bool) -> Callable:
        key = (k, greedy, any_filter, any_greedy)
        if key not in self._fns:
            run = self._graph(k, greedy, any_filter, any_greedy)
            self._fns[key] = mx.compile(run) if self.compiled else run
        return self._fns[key]

    def _graph(self, k: int, greedy: bool, any_filter: bool, any_greedy: bool) -> Callable:
        n, head, rule, ids, vocab = self.num_layers, self.head, self.rule, self.ids, self.vocab

        def run(marker, cu_hidden, cu_tokens, take, keep, *rest):
            n_sampled = 0 if greedy else 6  # the cycle's draws (accept.cycle_draws) + the five sampling arrays
            sampled, arrays = rest[:n_sampled], rest[n_sampled:]
            # Step 0: every head layer's catch-up over the pending pairs, kept.
            T, S = cu_tokens.shape[1], marker.shape[0]  # S: positions read, 0 for the whole capacity
            caches = shadow_caches((SlotKVCache,) * n, arrays, T=T, span=S)
            written = []
            for j, cache in enumerate(caches):
                # MLP and LM head run at each row's primary alone (models.families.common).
                lg, out = head(
                    cu_hidden, cu_tokens, cache=_only(cache, j, n), depth=j + 1, at=take
                )  # [B, 1, V], [B, 1, H]
                if j == 0:
                    logits, hidden = lg[:, 0], out[:, 0]  # [B, V], [B, H]
                written += [cache.keys, cache.values, arrays[3 * j + 2] + keep]
            # Step 1: the chain, on caches over the written arrays.
            chain = shadow_caches((SlotKVCache,) * n, written, T=1, span=S)
            drafts, qs = [], []
            for i in range(1, k + 1):
                draws_i = None if greedy else sampled[0][:, i - 1 : i]  # [B, 1, ...]
                if ids is not None and not greedy:
                    logits = _on_vocab(logits, ids, vocab)  # [B, V]
                d_i, q_i = choose_draft(
                    logits, draws_i, sampled[1:], greedy, any_filter, any_greedy, rule
                )  # [B, 1], [B, 1, V]
                if ids is not None and greedy:
                    d_i = mx.take(ids, d_i)  # [B, 1]: the index in the draft vocabulary -> its id
                drafts.append(d_i)
                qs.append(q_i)
                if i < k:
                    j = i % n
                    cache = chain[j]
                    cache.host_max = (S or cache.keys.shape[2]) - 1  # again after a step on this layer: the whole span
                    lg, out = head(hidden[:, None], d_i, cache=_only(cache, j, n), depth=j + 1)  # [B, 1, V], [B, 1, H]
                    logits, hidden = lg[:, 0], out[:, 0]
            d = mx.concatenate(drafts, axis=1)  # [B, k]
            # The chain's writes stay in the arrays; the lengths are the catch-up's.
            kept = [a for j, c in enumerate(chain) for a in (c.keys, c.values, written[3 * j + 2])]
            return ([d] if greedy else [d, mx.concatenate(qs, axis=1)]) + kept  # [B, k], [B, k, V]

        return run


def _on_vocab(logits: mx.array, ids: mx.array, vocab: int) -> mx.array:
    """Draft-vocabulary logits [B, N] placed at their ids of [B, vocab]; every other id gets -1e30, a zero
    probability at any temperature and under any filter, yet finite (a non-finite head means a broken row)."""
    B, N = logits.shape
    full = mx.full((B, vocab), -1e30, dtype=mx.float32)
    return mx.put_along_axis(full, mx.broadcast_to(ids[None], (B, N)), logits.astype(mx.float32), axis=-1)


def _only(cache: SlotKVCache, j: int, n: int) -> list:
    """The head's cache list with layer j's cache alone (the others unused)."""
    return [cache if l == j else None for l in range(n)]
