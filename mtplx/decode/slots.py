"""The decode batch: one slot per row, its device caches and host bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import numpy as np

from mtplx.decode.cache import SlotGDNCache, SlotKVCache, commit_gdn, make_slot_caches
from mtplx.decode.prefill import Prefilled
from mtplx.decode.requests import Request


@dataclass
class Row:
    """Host-side state of the row living in one slot."""

    req: Request
    sample_index: int
    key_hash: int  # row_hash of the row id (and the request's own seed)
    prompt_tokens: int
    depth: int
    shared_prefix_tokens: int = 0  # prompt tokens its prefill took from a shared prefix
    tokens: List[int] = field(default_factory=list)
    drafted: Optional[np.ndarray] = None  # [k] cycles that drafted at depth i+1
    accepted: Optional[np.ndarray] = None  # [k] cycles that accepted d_1..d_{i+1}
    steps: int = 0
    logprobs: Optional[List[float]] = None
    stop_checked: int = 0
    done: bool = False
    stop_ids: Optional[frozenset] = None  # end-of-sequence and the request's stop ids, set on first use

    def __post_init__(self):
        self.drafted = np.zeros(self.depth, dtype=np.int64)
        self.accepted = np.zeros(self.depth, dtype=np.int64)
        if self.req.logprobs:
            self.logprobs = []


class SlotBatch:
    """Caches and per-row state of `size` slots. A cycle's state lives on the
    device, so it launches before the host reads the last; the host's lengths
    (as of the last read) plus cycles in flight bound the span read."""

    def __init__(self, model, size: int, depth: int):
        self.size = size
        self.depth = depth
        self.trunk = make_slot_caches(model.layer_kinds, size)
        n_head = model.num_head_layers if depth > 0 else 0
        self.head = [SlotKVCache(size) for _ in range(n_head)]
        self.rows: List[Optional[Row]] = [None] * size
        self.trunk_len = np.zeros(size, dtype=np.int64)
        self.head_len = np.zeros(size, dtype=np.int64)
        self.primary = mx.zeros((size,), dtype=mx.int32)  # [B] last emitted token
        self.emitted = mx.zeros((size,), dtype=mx.int32)  # [B] tokens emitted so far
        self.max_tokens = mx.ones((size,), dtype=mx.int32)  # [B]
        self.active = mx.zeros((size,), dtype=mx.bool_)  # [B]
        # The head's pending inputs (draft.HeadPending): the last verify's pairs.
        self.cu_hidden = None  # [B, k+1, H], allocated on first load
        self.cu_tokens = mx.zeros((size, depth + 1), dtype=mx.int32)  # [B, k+1]
        self.cu_take = mx.zeros((size,), dtype=mx.int32)  # [B]
        self.cu_keep = mx.zeros((size,), dtype=mx.int32)  # [B]
        self.sampling = None  # BatchSampling of the rows in the slots
        self.key_base = None  # [B] uint64 the rows' sampling keys derive from (None: all greedy)
        self._loads = []  # (slot, Prefilled, first token) waiting for flush
        self._released = set()  # slots to zero at flush

    def free_slots(self) -> List[int]:
        return [b for b, r in enumerate(self.rows) if r is None]

    def any_active(self) -> bool:
        return any(r is not None for r in self.rows)

    def span_bound(self, lengths: np.ndarray, in_flight: int) -> int:
        """Max length any row can have with `in_flight` unread cycles."""
        return int(lengths.max()) + in_flight * (self.depth + 1)

    # `flush` applies staged loads and releases in one write per cache.
    def load(self, b: int, pre: Prefilled, row: Row, first_token: int):
        self.rows[b] = row
        self.trunk_len[b] = pre.length
        self.head_len[b] = _head_pairs(pre) if self.head else 0
        self._released.discard(b)
        self._loads.append((b, pre, first_token))

    def release(self, b: int):
        """Free a row's slot; `flush` zeroes it, so no NaN survives into the next row."""
        self.rows[b] = None
        self.trunk_len[b] = 0
        self.head_len[b] = 0
        self._released.add(b)

    def flush(self, in_flight: int) -> bool:
        """Apply the staged loads and releases; True when there were any."""
        if not (self._loads or self._released):
            return False
        trunk_span = self.span_bound(self.trunk_len, in_flight)
        head_span = self.span_bound(self.head_len, in_flight)
        if self._released:
            released = sorted(self._released)
            rows = mx.array(released, dtype=mx.int32)
            for c in self.trunk:
                c.zero_rows(released) if isinstance(c, SlotGDNCache) else c.zero_rows(released, trunk_span)
            for c in self.head:
                c.zero_rows(released, head_span)
            self.active[rows] = False
            self.primary[rows] = 0
            self.cu_keep[rows] = 0
            self.cu_take[rows] = 0
            if self.cu_hidden is not None:
                self.cu_hidden[rows] = 0
            self._released.clear()
        if self._loads:
            self._write_loads(trunk_span, head_span)
        return True

    def _write_loads(self, trunk_span: int, head_span: int):
        slots = [b for b, _, _ in self._loads]
        rows = mx.array(slots, dtype=mx.int32)  # [R]
        pres = [pre for _, pre, _ in self._loads]
        lengths = mx.array([pre.length for pre in pres], dtype=mx.int32)  # [R]
        for i, slot in enumerate(self.trunk):
            if isinstance(slot, SlotGDNCache):
                conv = _stack(pres, lambda p: p.trunk_cache[i].conv)  # [R, K-1, C]
                state = _stack(pres, lambda p: p.trunk_cache[i].state)  # [R, Hv, Dv, Dk]
                slot.write_rows(slots, conv, state)
            else:
                k, v = _stack_kv(pres, lambda p: p.trunk_cache[i], lambda p: p.length)
                slot.write_rows(slots, k, v, lengths, trunk_span)
        if self.head:
            head_lengths = mx.array([_head_pairs(pre) for pre in pres], dtype=mx.int32)  # [R]
            for j, slot in enumerate(self.head):
                k, v = _stack_kv(pres, lambda p: None if p.head_cache is None else p.head_cache[j], _head_pairs)
                slot.write_rows(slots, k, v, head_lengths, head_span)
        firsts = mx.array([t for _, _, t in self._loads], dtype=mx.int32)  # [R]
        self.primary[rows] = firsts
        self.emitted[rows] = 1
        self.max_tokens[rows] = mx.array([self.rows[b].req.max_tokens for b, _, _ in self._loads], dtype=mx.int32)
        self.active[rows] = True
        if self.head:
            W = self.cu_tokens.shape[1]  # the last cycle's k+1 (depth "auto" varies it)
            last = _stack(pres, lambda p: p.last_hidden)  # [R, H]
            if self.cu_hidden is None:
                self.cu_hidden = mx.zeros((self.size, W, last.shape[-1]), dtype=last.dtype)
            pad = mx.zeros((len(pres), W - 1, last.shape[-1]), dtype=last.dtype)
            self.cu_hidden[rows] = mx.concatenate([last[:, None], pad], axis=1)
            tok = mx.zeros((len(pres), W), dtype=mx.int32)
            tok[:, 0] = firsts
            self.cu_tokens[rows] = tok
            self.cu_take[rows] = 0
            self.cu_keep[rows] = 1
        self._loads.clear()

    def shrink_size(self) -> int:
        """The smallest power of two holding the occupied slots (few traced shapes)."""
        live = sum(r is not None for r in self.rows)
        return 1 << max(live - 1, 0).bit_length()

    def shrunk(self) -> "SlotBatch":
        """The occupied slots, in order, in `shrink_size()` slots; after `flush`."""
        assert not self._loads and not self._released, "flush before shrinking"
        size = self.shrink_size()
        live = [b for b, r in enumerate(self.rows) if r is not None]
        free = [b for b, r in enumerate(self.rows) if r is None]
        slots = live + free[: size - len(live)]
        idx = mx.array(slots, dtype=mx.int32)  # [size]
        out = SlotBatch.__new__(SlotBatch)
        out.size, out.depth = size, self.depth
        out.trunk = [c.take_rows(idx) for c in self.trunk]
        out.head = [c.take_rows(idx) for c in self.head]
        out.rows = [self.rows[b] for b in slots]
        out.trunk_len, out.head_len = self.trunk_len[slots], self.head_len[slots]
        for name in ("primary", "emitted", "max_tokens", "active", "cu_tokens", "cu_take", "cu_keep"):
            setattr(out, name, getattr(self, name)[idx])
        out.cu_hidden = None if self.cu_hidden is None else self.cu_hidden[idx]
        out.sampling = out.key_base = None  # the runtime sets them for the rows it holds
        out._loads, out._released = [], set()
        return out

    def trunk_lengths(self) -> Optional[mx.array]:
        """[B]: entries each row holds in the trunk's attention caches (None without any)."""
        return next((c.lengths for c in self.trunk if isinstance(c, SlotKVCache)), None)

    def commit_trunk(
        self, before: Optional[mx.array], keep: mx.array, all_kept: bool, span: int, compiled: bool = True
    ):
        """Row b keeps keep[b] verify entries; `before` [B]: `trunk_lengths()` before it."""
        commit_gdn(self.trunk, keep, all_kept, compiled)
        if before is None:
            return
        # One array for every layer, so a pass makes its `PassPositions` once.
        lengths = before + keep
        for c in self.trunk:
            if isinstance(c, SlotKVCache):
                c.set_lengths(lengths, span)

    def cache_state(self) -> list:
        """The arrays a cycle leaves behind, to evaluate with its outputs."""
        out = [self.primary, self.emitted, self.cu_tokens, self.cu_take, self.cu_keep]
        if self.cu_hidden is not None:
            out.append(self.cu_hidden)
        for c in self.trunk + self.head:
            out.extend(x for x in c.arrays if x is not None)
        return out


def _head_pairs(pre: Prefilled) -> int:
    """Head entries a prefilled row brings (none: `BatchRuntime._prefill_head`)."""
    return 0 if pre.head_cache is None else pre.length - 1


def _stack(pres: List[Prefilled], get) -> mx.array:
    """One [1, ...] array per prefill concatenated on axis 0; consecutive rows
    sharing a prefill (a request's samples) share one broadcast."""
    out, i = [], 0
    while i < len(pres):
        j = i
        while j < len(pres) and pres[j] is pres[i]:
            j += 1
        x = get(pres[i])
        out.append(mx.broadcast_to(x, (j - i, *x.shape[1:])))
        i = j
    return mx.concatenate(out, axis=0)


def _stack_kv(pres: List[Prefilled], get_cache, get_len):
    """Keys and values [R, H, Lmax, D] of per-row caches, zero past each length."""
    L = max(get_len(p) for p in pres)
    ref = next((get_cache(p) for p in pres if get_cache(p) is not None and get_len(p) > 0), None)
    if ref is None:  # every prompt is one token long: the head has no pairs yet
        return mx.zeros((len(pres), 1, 0, 1)), mx.zeros((len(pres), 1, 0, 1))

    def padded(p, which):
        n = get_len(p)
        if n == 0:
            x = getattr(ref, which)
            return mx.zeros((1, x.shape[1], L, x.shape[3]), dtype=x.dtype)
        x = getattr(get_cache(p), which)[..., :n, :]
        return mx.pad(x, [(0, 0), (0, 0), (0, L - n), (0, 0)])

    return _stack(pres, lambda p: padded(p, "keys")), _stack(pres, lambda p: padded(p, "values"))
