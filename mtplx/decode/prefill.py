"""Prefill: the trunk and head over each prompt but its last token, right-padded
together (exact: queries only look back, and mlx-lm's gated-delta layer
freezes past each row's `lengths`), then the last tokens as one decode step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx

from mtplx.backends import CHUNKED_PREFILL_MIN, prompt_align
from mtplx.decode.cache import SlotGDNCache, make_slot_caches, rounded_capacity
from mtplx.decode.passes import StagedPass

# Shared prefixes end on multiples of this: the chunk-wise recurrence's chunk,
# the CPU prompt attention's query block and the width from which prompt forms
# run are all 16 (backends.CHUNKED_PREFILL_MIN, backends.prompt_align).
PROMPT_ALIGN = CHUNKED_PREFILL_MIN


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


@dataclass
class PrefixState:
    """The caches a prompt pass leaves after a shared prefix: `length` trunk
    entries and as many head pairs (h_t, x_{t+1}); `tokens` are the prefix and
    the token after it, which its last head pair reads (`decode.prefix`)."""

    tokens: tuple
    # Per trunk layer: (keys [1, H, P, Dk], values [1, H, P, Dv]), or (conv [1, K-1, C], state [1, Hv, Dv, Dk]).
    trunk: list
    head: Optional[list]  # per head layer: (keys [1, H, P, Dk], values [1, H, P, Dv]); None without head pairs

    @property
    def length(self) -> int:
        return len(self.tokens) - 1

    @property
    def nbytes(self) -> int:
        arrays = [a for pair in self.trunk + (self.head or []) for a in pair]
        return sum(a.nbytes for a in arrays)


@dataclass
class _PromptPass:
    """One group's prompt pass over every prompt but its last token."""

    cache: Optional[list]  # mlx-lm trunk caches, right-padded to L positions (None once copied to slots)
    head_cache: Optional[list]  # mlx-lm head caches: pairs (h_t, x_{t+1}) for t < L
    L: int  # the group's longest prefix
    rows: int


def prompt_pass(
    model, prompts: List[List[int]], chunk: int, with_head: bool, start: Optional[PrefixState] = None
) -> _PromptPass:
    """The trunk over each prompt but its last token, in chunks, and the head
    over the prompt's pairs, right-padded together. From `start` (a prefix
    every prompt begins with, and its next token too), only the positions
    after it: forwards still end on multiples of `chunk`, as without it."""
    P0 = 0 if start is None else start.length
    prefix = [len(p) - 1 for p in prompts]
    L = max(prefix)
    ranges = chunk_ranges(P0, L, chunk, prompt_align(model))
    L_pad = ranges[-1][1] if ranges else L
    # Padded with the row's own last token: a non-finite pad would poison the
    # row (0 x NaN), and this token would have anyway.
    tokens = mx.array([p + p[-1:] * (L_pad - n) for p, n in zip(prompts, prefix)], dtype=mx.int32)  # [B, L_pad+1]
    cache = model.make_cache()
    head_cache = model.make_head_cache() if with_head else None
    if start is not None:
        _seed(cache, start.trunk, len(prompts), P0)
        if head_cache is not None:
            _seed(head_cache, start.head, len(prompts), P0)
    for c in cache:
        if hasattr(c, "lengths"):  # gated-delta: freeze past each row's prefix
            c.lengths = mx.array([n - P0 for n in prefix], dtype=mx.int32)  # one per layer: each counts it down
    for a, b in ranges:
        # Only caches are read from this pass, so its logits are never computed.
        _, hidden = model.forward(tokens[:, a:b], cache)  # [B, b-a, H]
        if with_head:
            # Pairs (h_t, x_{t+1}): each prefix position's next token is in the prompt.
            for j in range(model.num_head_layers):
                model.head(hidden, tokens[:, a + 1 : b + 1], cache=head_cache, depth=j + 1)
        mx.eval([c.state for c in cache] + ([c.state for c in head_cache] if head_cache else []))
    return _PromptPass(cache, head_cache, L, len(prompts))


def chunk_ranges(start: int, end: int, chunk: int, align: int = PROMPT_ALIGN) -> List[tuple]:
    """The forwards [a, b) of a prompt pass over positions start..end: cut on
    the multiples of `chunk`, and each ending on a multiple of `align` (padded;
    at least that wide) where the chunk allows. With the CPU's float32 forms
    (`backends.prompt_align`) every position then meets the same forms,
    recurrence chunks and attention spans whatever the group's longest prompt,
    or a shared prefix cut on PROMPT_ALIGN (docs/design.md, "Shared prefixes")."""
    out, a = [], start
    while a < end:
        ceil = (a // chunk + 1) * chunk
        b = min(ceil, -(-max(end, a + align) // align) * align)
        out.append((a, b))
        a = b
    return out


def _seed(caches: list, arrays: list, rows: int, length: int) -> None:
    """mlx-lm caches holding a prefix state's arrays for each of `rows` rows."""
    for c, (x, y) in zip(caches, arrays):
        x = mx.broadcast_to(x, (rows, *x.shape[1:]))
        y = mx.broadcast_to(y, (rows, *y.shape[1:]))
        if hasattr(c, "offset"):  # KV: the next forward writes at `length`
            c.keys, c.values, c.offset = x, y, length
        else:  # gated delta: conv window and recurrent state
            c[0], c[1] = x, y


def prefix_state(p: _PromptPass, tokens: List[int]) -> PrefixState:
    """A one-row pass over `tokens` (a prefix and its next token) as a PrefixState."""
    P = len(tokens) - 1

    def kv(c):
        # Copies: a slice would keep the cache's whole buffer, past the bytes the prefix cache counts.
        return mx.contiguous(c.keys[:, :, :P]), mx.contiguous(c.values[:, :, :P])  # [1, H, P, D]

    trunk = [kv(c) if hasattr(c, "offset") else (c[0], c[1]) for c in p.cache]
    head = None if p.head_cache is None else [kv(c) for c in p.head_cache]
    return PrefixState(tuple(tokens), trunk, head)


def last_token_step(
    model, passes: List[_PromptPass], prefix: List[int], last: List[int], step: Optional[StagedPass] = None
):
    """Every row's last prompt token in one one-position step, as mlx-lm feeds
    it (the multi-position form rounds apart in half precision). The groups'
    caches (row b `prefix[b]` long) become one batch of slot caches; `step`
    runs it (eager if None). -> slot caches, logits [B, 1, V], hidden [B, 1, H]."""
    B = len(last)
    rows, capacity = B, max(p.L for p in passes) + 1
    if step is not None and step.compiled:
        # Shapes as decode batches have: a power of two of rows, whole capacity steps.
        rows, capacity = 1 << (B - 1).bit_length(), rounded_capacity(capacity)
    slots = make_slot_caches(model.layer_kinds, rows)
    for i, s in enumerate(slots):
        caches = [p.cache[i] for p in passes]
        if isinstance(s, SlotGDNCache):
            conv = _stacked(passes, [c[0] for c in caches], rows, None)  # [rows, K-1, C]
            if conv is not None:
                s.conv, s.state = conv, _stacked(passes, [c[1] for c in caches], rows, None)  # [rows, Hv, Dv, Dk]
        else:
            keys = _stacked(passes, [c.keys for c in caches], rows, capacity)
            if keys is not None:
                s.keys, s.values = keys, _stacked(passes, [c.values for c in caches], rows, capacity)
                s.lengths = mx.array(prefix + [0] * (rows - B), dtype=mx.int32)  # [rows]
                s.host_max = capacity - 1
    for p in passes:
        p.cache = None  # the slot caches replace them: a group's KV is not held twice
    tokens = mx.array([[t] for t in last] + [[0]] * (rows - B), dtype=mx.int32)  # [rows, 1]
    logits, hidden = step((tokens,), slots, T=1) if step is not None else model.forward(tokens, slots)
    mx.eval([a for s in slots for a in s.arrays if a is not None] + [logits, hidden])
    return slots, logits[:B], hidden[:B]  # [B, 1, V], [B, 1, H]


def _stacked(passes: List[_PromptPass], arrays: list, rows: int, length: Optional[int]) -> Optional[mx.array]:
    """The groups' arrays of one cache (KV cut to L, padded to `length`) as one
    [rows, ...] array, zeros where missing; None when no group has one."""
    ref = next((a for a in arrays if a is not None), None)
    if ref is None:
        return None
    parts = []
    for p, a in zip(passes, arrays):
        shape = (p.rows, *ref.shape[1:])
        if length is not None:
            shape = (p.rows, shape[1], length, shape[3])
            if a is not None:
                a = mx.pad(a[:, :, : p.L], [(0, 0), (0, 0), (0, length - p.L), (0, 0)])
        parts.append(a if a is not None else mx.zeros(shape, dtype=ref.dtype))
    out = mx.concatenate(parts, axis=0)
    return mx.pad(out, [(0, rows - out.shape[0])] + [(0, 0)] * (out.ndim - 1)) if rows > out.shape[0] else out


def _row(trunk: list, head_cache, logits, hidden, b: int, g: int, n: int) -> Prefilled:
    """Row b of the step's slot caches, row g of its group's head caches; n tokens."""
    rows = []
    for s in trunk:
        if isinstance(s, SlotGDNCache):
            rows.append(RowGDN(s.conv[b : b + 1], s.state[b : b + 1]))
        else:
            rows.append(RowKV(s.keys[b : b + 1, :, :n], s.values[b : b + 1, :, :n]))
    head = None
    if head_cache is not None:
        head = [
            RowKV(c.keys[g : g + 1, :, : n - 1], c.values[g : g + 1, :, : n - 1]) if c.keys is not None else None
            for c in head_cache
        ]
    return Prefilled(rows, head, logits[b : b + 1, 0], hidden[b : b + 1, 0], n)


def prefill_groups(
    model,
    prompts: List[List[int]],
    groups: List[List[int]],
    chunk: int,
    with_head: bool,
    step: Optional[StagedPass] = None,
    starts: Optional[List[Optional[PrefixState]]] = None,
) -> List[Prefilled]:
    """A prompt pass per group of indices (from the group's prefix state in
    `starts`, if any), one last-token step; input order."""
    starts = starts or [None] * len(groups)
    passes = [prompt_pass(model, [prompts[i] for i in g], chunk, with_head, s) for g, s in zip(groups, starts)]
    order = [i for g in groups for i in g]
    trunk, logits, hidden = last_token_step(
        model, passes, [len(prompts[i]) - 1 for i in order], [prompts[i][-1] for i in order], step
    )
    out: List[Optional[Prefilled]] = [None] * len(prompts)
    b = 0
    for g, p in zip(groups, passes):
        for j, i in enumerate(g):
            out[i] = _row(trunk, p.head_cache, logits, hidden, b, j, len(prompts[i]))
            b += 1
    return out


def prefill_batch(
    model, prompts: List[List[int]], chunk: int, with_head: bool, step: Optional[StagedPass] = None
) -> List[Prefilled]:
    """Every prompt in one prompt pass, right-padded to the longest."""
    return prefill_groups(model, prompts, [list(range(len(prompts)))], chunk, with_head, step)


# What one more prefill call costs, in padded prompt positions (rows x positions).
PREFILL_CALL_POSITIONS = 32


def prefill_by_length(
    model,
    prompts: List[List[int]],
    chunk: int,
    with_head: bool,
    call_positions: int = PREFILL_CALL_POSITIONS,
    step: Optional[StagedPass] = None,
    starts: Optional[List[Optional[PrefixState]]] = None,
) -> List[Prefilled]:
    """A prompt pass per group of prompts starting from the same prefix state
    (`starts`, per prompt; None: from scratch) and of similar lengths after it
    (a pass pads to its longest)."""
    starts = starts or [None] * len(prompts)
    by_start: dict = {}
    for i, s in enumerate(starts):
        by_start.setdefault(id(s), (s, []))[1].append(i)
    groups, group_starts = [], []
    for s, idx in by_start.values():
        P0 = 0 if s is None else s.length
        order = sorted(idx, key=lambda i: len(prompts[i]))
        for a, b in length_groups([len(prompts[i]) - P0 for i in order], call_positions):
            groups.append(order[a:b])
            group_starts.append(s)
    return prefill_groups(model, prompts, groups, chunk, with_head, step, group_starts)


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
