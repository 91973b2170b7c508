"""Step 1 of a cycle, drafting d_1..d_k, as one compiled graph.

Drafting alternates a draft choice (argmax, or a keyed draw from q) with a
one-token head pass that feeds the head its own output back. Launched one
graph at a time that is 2k-1 graph calls per cycle, each of which costs the
CPU backend more to dispatch than its few small ops cost to run; traced as
one graph per (k, sampling kind) it is one call.

The head entries the chain writes, from the head's own hidden states, are
rolled back at the end of every cycle anyway (DESIGN "One decode cycle", step
1). So the chain writes them into its own copies of the cache arrays and
hands nothing back: the cache keeps its lengths and arrays, the positions
past each row's length stay masked until the next catch-up overwrites them,
and a non-finite draft hidden never lands in a cache.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .cache import SlotKVCache
from .compiled import shadow_caches
from .decide import choose_draft, sampling_arrays


class DraftChain:
    """`chain(logits, hidden, keys, sampling, head_caches, k)` -> drafts
    [B, k] and q [B, k, V] (None when every row is greedy), from the depth-1
    head output at each row's primary: logits [B, V], hidden [B, H]."""

    def __init__(self, head, num_layers: int, rule: str, compiled: bool = True):
        self.head = head
        self.num_layers = num_layers
        self.rule = rule
        self.compiled = compiled
        self._fns: Dict[Tuple, Callable] = {}

    def __call__(self, logits: mx.array, hidden: mx.array, keys: Optional[mx.array], sampling,
                 head_caches: List[SlotKVCache], k: int):
        greedy = sampling.all_greedy
        used = sorted({i % self.num_layers for i in range(1, k)})  # depth i+1 runs head layer i mod n
        for j in used:
            c = head_caches[j]
            if c.keys is None:
                raise RuntimeError("drafting needs the head caches written by the catch-up pass")
            c.reserve(c.host_max + k - 1)  # the chain's entries must fit (they are not kept)
        fn = self._fn(k, greedy, sampling.any_filter, tuple(used))
        arrays = [a for j in used for a in (head_caches[j].keys, head_caches[j].values, head_caches[j].lengths)]
        sampled = [] if greedy else [keys, *sampling_arrays(sampling)]
        out = fn(logits, hidden, *sampled, *arrays)
        return (out[0], None) if greedy else (out[0], out[1])

    def _fn(self, k: int, greedy: bool, any_filter: bool, used: Tuple[int, ...]) -> Callable:
        key = (k, greedy, any_filter, used)
        if key not in self._fns:
            run = self._chain(k, greedy, any_filter, used)
            self._fns[key] = mx.compile(run) if self.compiled else run
        return self._fns[key]

    def _chain(self, k: int, greedy: bool, any_filter: bool, used: Tuple[int, ...]) -> Callable:
        n, head, rule = self.num_layers, self.head, self.rule

        def run(logits, hidden, *rest):
            n_sampled = 0 if greedy else 6  # keys [B, k, 2] + the five sampling arrays
            sampled, arrays = rest[:n_sampled], rest[n_sampled:]
            # Caches over the given arrays: their writes make new arrays, never touching these.
            caches = dict(zip(used, shadow_caches((SlotKVCache,) * len(used), arrays, T=1)))
            drafts, qs = [], []
            for i in range(1, k + 1):
                keys_i = None if greedy else sampled[0][:, i - 1 : i]  # [B, 1, 2]
                d_i, q_i = choose_draft(logits, keys_i, sampled[1:], greedy, any_filter, rule)  # [B, 1], [B, 1, V]
                drafts.append(d_i)
                qs.append(q_i)
                if i < k:
                    j = i % n
                    cache = caches[j]
                    cache.host_max = cache.keys.shape[2] - 1  # again after a step on this layer: the whole capacity
                    lg, out = head(hidden[:, None], d_i, cache=[cache if l == j else None for l in range(n)],
                                   depth=j + 1)  # [B, 1, V], [B, 1, H]
                    logits, hidden = lg[:, 0], out[:, 0]
            d = mx.concatenate(drafts, axis=1)  # [B, k]
            return [d] if greedy else [d, mx.concatenate(qs, axis=1)]  # [B, k], [B, k, V]

        return run
