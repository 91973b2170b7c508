"""Shared prompt prefixes (docs/design.md, "Shared prefixes"): which prompts of
a prefill group start from a common prefix state, where each prefix is cut, the
prefixes they nest in, and a bounded LRU cache of prefix states.

A prefix of P tokens is shared by prompts that agree on their first P + 1
tokens: its state holds P trunk entries and the P head pairs (h_t, x_{t+1}),
the last of which reads token P. P is a multiple of `grain` (`split_grain`), so
a prompt pass from it computes each position as a pass from the start does."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from mtplx.decode.prefill import PREFILL_CALL_POSITIONS, PROMPT_ALIGN, PrefixState, prefix_state, prompt_pass

# Bytes of prefix states kept when the caller names no bound (MTPContract.prefix_cache_bytes).
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30

Key = Tuple[int, ...]  # a prefix's tokens and the one after it


def split_grain(prefill_chunk: int) -> int:
    """Prefix lengths are multiples of this: PROMPT_ALIGN where the prefill's
    chunks are made of whole ones, else the prefill's chunk."""
    return PROMPT_ALIGN if prefill_chunk % PROMPT_ALIGN == 0 else prefill_chunk


class PrefixCache:
    """Prefix states by key, least recently used first out past `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[Tuple[bool, Key], PrefixState]" = OrderedDict()
        self.nbytes = 0

    def get(self, key: Key, with_head: bool) -> Optional[PrefixState]:
        state = self.entries.get((with_head, key))
        if state is not None:
            self.entries.move_to_end((with_head, key))
        return state

    def put(self, state: PrefixState, with_head: bool) -> None:
        k = (with_head, state.tokens)
        if k in self.entries or state.nbytes > self.max_bytes:
            return
        self.entries[k] = state
        self.nbytes += state.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def keys(self, with_head: bool) -> List[Key]:
        return [t for h, t in self.entries if h == with_head]

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


@dataclass
class SharePlan:
    """Where each prompt's prefill starts and how its prefixes are built."""

    starts: List[Optional[Key]]  # per prompt: the prefix it starts from (None: from scratch)
    parents: Dict[Key, Optional[Key]]  # per prefix to build or reuse: the prefix it starts from


def plan_shares(
    prompts: Sequence[Sequence[int]],
    min_len: int,
    grain: int,
    cached: Sequence[Key] = (),
    call_positions: int = PREFILL_CALL_POSITIONS,
) -> SharePlan:
    """Each prompt starts from the longest prefix (of at least `min_len`
    tokens, a multiple of `grain`) it shares with another prompt of the group
    or with a cached prefix; prefixes nest the same way, level by level. A
    level is kept where it pays: cached, or its c starts (prompts and deeper
    prefixes) save (c - 1) x its length past its parent over `call_positions`,
    what one more prompt pass costs (`prefill.PREFILL_CALL_POSITIONS`)."""
    starts = _deepest_shares(prompts, min_len, grain, cached, strict=False)
    parents: Dict[Key, Optional[Key]] = {}
    todo = sorted({k for k in starts if k is not None})
    while todo:
        found = _deepest_shares(todo, min_len, grain, cached, strict=True)
        parents.update(zip(todo, found))
        todo = sorted({p for p in found if p is not None and p not in parents})
    cached_set = set(cached)
    for k in sorted(parents, key=len, reverse=True):  # deepest first: a level's starts are final
        p = parents[k]
        gain = len(k) - (0 if p is None else len(p))
        uses = sum(s == k for s in starts) + sum(q == k for q in parents.values())
        if k in cached_set or (uses - 1) * gain > call_positions:
            continue
        del parents[k]
        starts = [p if s == k else s for s in starts]
        parents = {q: (p if r == k else r) for q, r in parents.items()}
    return SharePlan(starts, parents)


def _deepest_shares(
    seqs: Sequence[Sequence[int]], min_len: int, grain: int, cached: Sequence[Key], strict: bool
) -> List[Optional[Key]]:
    """Per sequence: the key of its longest usable shared prefix, or None. A
    sequence of n tokens may share up to n - 1 (its trunk positions). `strict`:
    the sequences are prefix keys, each shares with the others less than
    itself, and one that extends it is its child, not a sharer."""
    lengths = sorted({len(k) - 1 for k in cached}, reverse=True)
    cached_set = set(cached)
    shared = _shared_lengths(seqs) if not strict else _sibling_lengths(seqs)
    out: List[Optional[Key]] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        top = len(seq) - 1 - int(strict)  # the longest prefix this sequence may start from
        P = (min(shared[i] - 1, top) // grain) * grain  # token P must be shared too
        hit = next((c for c in lengths if c <= top and tuple(seq[: c + 1]) in cached_set), 0)
        P = max(P, hit)
        if P >= min_len and P > 0:
            out[i] = tuple(seq[: P + 1])
    return out


def _shared_lengths(seqs: Sequence[Sequence[int]]) -> List[int]:
    """Per sequence, the longest prefix it shares with another: its
    neighbours' in token order (one sort, a comparison per neighbour)."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    common = [_common_length(seqs[a], seqs[b]) for a, b in zip(order, order[1:])]
    out = [0] * len(seqs)
    for rank, i in enumerate(order):
        out[i] = max(common[rank - 1] if rank > 0 else 0, common[rank] if rank < len(common) else 0)
    return out


def _sibling_lengths(keys: Sequence[Key]) -> List[int]:
    """Per key, the longest prefix it shares with a key that does not extend
    it (keys are few: one per shared prefix of a group)."""
    out = []
    for k in keys:
        common = [_common_length(k, j) for j in keys if j is not k]
        out.append(max([c for c in common if c < len(k)], default=0))
    return out


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class SharedPrefill:
    """A group's prefix states, in the order their prompts start from them."""

    states: List[Optional[PrefixState]]  # per prompt
    computed: int  # trunk positions the prefix passes computed


def build_prefixes(
    model, prompts: Sequence[Sequence[int]], plan: SharePlan, cache: PrefixCache, chunk: int, with_head: bool
) -> SharedPrefill:
    """The plan's prefix states, from the cache or computed (parents first,
    each as a one-row prompt pass from its parent) and cached."""
    states: Dict[Key, PrefixState] = {}
    computed = 0
    for key in sorted(plan.parents, key=len):
        state = cache.get(key, with_head)
        if state is None:
            parent = plan.parents[key]
            start = None if parent is None else states[parent]
            p = prompt_pass(model, [list(key)], chunk, with_head, start=start)
            state = prefix_state(p, list(key))
            computed += state.length - (0 if start is None else start.length)
            cache.put(state, with_head)
        states[key] = state
    return SharedPrefill([None if k is None else states[k] for k in plan.starts], computed)
