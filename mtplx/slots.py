"""The decode batch: one slot per row, its device caches and host bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import numpy as np

from .cache import SlotGDNCache, SlotKVCache, make_slot_caches
from .completion import Request
from .prefill import Prefilled


@dataclass
class Row:
    """Host-side state of the row living in one slot."""

    req: Request
    sample_index: int
    key_hash: int  # row_hash of the row id (and the request's own seed)
    prompt_tokens: int
    depth: int
    tokens: List[int] = field(default_factory=list)
    drafted: Optional[np.ndarray] = None  # [k] cycles that drafted at depth i+1
    accepted: Optional[np.ndarray] = None  # [k] cycles that accepted d_1..d_{i+1}
    steps: int = 0
    logprobs: Optional[List[float]] = None
    stop_checked: int = 0
    done: bool = False

    def __post_init__(self):
        self.drafted = np.zeros(self.depth, dtype=np.int64)
        self.accepted = np.zeros(self.depth, dtype=np.int64)
        if self.req.logprobs:
            self.logprobs = []


class SlotBatch:
    """Caches of `size` slots. Trunk and head lengths are mirrored on the host
    (they change only at commit), so no cycle needs a sync to know them."""

    def __init__(self, model, size: int, depth: int):
        self.size = size
        self.depth = depth
        self.trunk = make_slot_caches(model.layer_kinds, size)
        n_head = model.num_head_layers if depth > 0 else 0
        self.head = [SlotKVCache(size) for _ in range(n_head)]
        self.trunk_len = np.zeros(size, dtype=np.int64)
        self.head_len = np.zeros(size, dtype=np.int64)
        self.rows: List[Optional[Row]] = [None] * size
        self.primary = mx.zeros((size,), dtype=mx.int32)  # [B] last emitted token
        # The head's pending depth-1 inputs (catch-up pairs + the new primary):
        width = max(depth, 0) + 1
        self.cu_hidden = None  # [B, k+1, H], allocated on first load
        self.cu_tokens = mx.zeros((size, width), dtype=mx.int32)  # [B, k+1]
        self.cu_take = np.zeros(size, dtype=np.int64)  # index of the primary's pair
        self.cu_keep = np.zeros(size, dtype=np.int64)  # pairs to commit per row
        self.head_logits = None  # [B, V] q_1 logits for the next cycle
        self.head_hidden = None  # [B, H] head output fed to depth 2
        self.sampling = None  # BatchSampling of the rows in the slots

    # -- occupancy -------------------------------------------------------
    def free_slots(self) -> List[int]:
        return [b for b, r in enumerate(self.rows) if r is None]

    def active(self) -> np.ndarray:
        return np.array([r is not None for r in self.rows])

    def any_active(self) -> bool:
        return any(r is not None for r in self.rows)

    # -- moving prefilled state in and out -------------------------------
    def load(self, b: int, pre: Prefilled, row: Row, first_token: int):
        L = pre.length
        self.trunk_len[b] = L
        for slot, c in zip(self.trunk, pre.trunk_cache):
            if isinstance(slot, SlotGDNCache):
                slot.load_row(b, c[0], c[1])
            else:
                slot.load_row(b, c.keys[..., :L, :], c.values[..., :L, :], int(self.trunk_len.max()))
        if self.head:
            self.head_len[b] = L - 1
            for slot, c in zip(self.head, pre.head_cache):
                if c.keys is None:
                    slot.zero_row(b)
                    slot.set_lengths(slot.lengths, int(self.head_len.max()))
                else:
                    slot.load_row(b, c.keys[..., : L - 1, :], c.values[..., : L - 1, :], int(self.head_len.max()))
            H = pre.last_hidden.shape[-1]
            if self.cu_hidden is None:
                self.cu_hidden = mx.zeros((self.size, self.depth + 1, H), dtype=pre.last_hidden.dtype)
            self.cu_hidden[b] = 0
            self.cu_hidden[b, 0] = pre.last_hidden[0]
            self.cu_tokens[b] = 0
            self.cu_tokens[b, 0] = first_token
            self.cu_take[b] = 0
            self.cu_keep[b] = 1
        self.primary[b] = first_token
        self.rows[b] = row

    def release(self, b: int):
        """Zero a finished row's slot so nothing of it (NaN included) survives."""
        for c in self.trunk + self.head:
            c.zero_row(b)
        self.trunk_len[b] = 0
        self.head_len[b] = 0
        self.cu_keep[b] = 0
        self.cu_take[b] = 0
        self.primary[b] = 0
        if self.cu_hidden is not None:
            self.cu_hidden[b] = 0
        self.rows[b] = None

    # -- commit ------------------------------------------------------------
    def commit_trunk(self, keep: np.ndarray, all_kept: bool):
        """Row b keeps keep[b] of the verify entries (0 for empty slots)."""
        self.trunk_len += keep
        lengths = mx.array(self.trunk_len.astype(np.int32))
        host_max = int(self.trunk_len.max())
        keep_dev = mx.array(np.maximum(keep, 1).astype(np.int32))
        for c in self.trunk:
            if isinstance(c, SlotGDNCache):
                c.commit(keep_dev, all_kept)
            else:
                c.set_lengths(lengths, host_max)

    def set_head_lengths(self, lengths: np.ndarray):
        dev = mx.array(lengths.astype(np.int32))
        for c in self.head:
            c.set_lengths(dev, int(lengths.max()))
