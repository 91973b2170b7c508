"""Batch caches with one slot per row and per-row rollback (docs/design.md,
"Slot caches and per-row rollback"). `SlotKVCache` speaks mlx-lm's attention
cache protocol and rolls back by length; `SlotGDNCache` holds gated-delta
state, of which commit selects each row's step."""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Union

import mlx.core as mx

from mtplx.backends import RopeSpec, rope_angles

_STEP = 256  # capacity grows in multiples of this many positions


# A compiled pass reads keys up to a multiple of this, not the whole
# capacity: one trace per bucket (docs/performance.md).
SPAN_BUCKET = 64


def rounded_capacity(needed: int) -> int:
    """The capacity a slot cache holding `needed` positions grows to."""
    return -(-needed // _STEP) * _STEP


def read_span(needed: int, capacity: int) -> int:
    """Positions a compiled pass reads from a cache of `capacity` whose rows
    hold at most `needed` (writes included), rounded up to a SPAN_BUCKET."""
    return min(capacity, -(-max(needed, 1) // SPAN_BUCKET) * SPAN_BUCKET)


def put_rows(full: mx.array, rows: Sequence[int], values: Union[mx.array, float]) -> mx.array:
    """`full` [B, ...] with distinct host rows `rows` set to `values` ([R, ...] or a
    scalar); consecutive rows take a slice update (MLX's CPU scatter is slow)."""
    R = len(rows)
    if R == 0:
        return full
    shape = (R, *full.shape[1:])
    if isinstance(values, mx.array):
        values = mx.broadcast_to(values.astype(full.dtype), shape)
    else:
        values = mx.full(shape, values, dtype=full.dtype)
    start = rows[0]
    if list(rows) == list(range(start, start + R)):
        if R == full.shape[0]:
            return values
        return mx.slice_update(full, values, mx.array([start]), axes=(0,))
    full[mx.array(rows, dtype=mx.int32)] = values
    return full


def _finite_or_zero(x: mx.array) -> mx.array:
    # A Python 0.0 is a constant of x's dtype, not a graph node.
    return mx.where(mx.isfinite(x), x, 0.0)


def _query_positions(lengths: mx.array, T: int) -> mx.array:
    """int32 [B, T]: the positions of a pass's T new tokens in each row."""
    return lengths[:, None] + mx.arange(T)[None, :]


class PassPositions(NamedTuple):
    """What attention layers derive from the rows' lengths alone, made once
    per pass for all of them (`passes.SlotPass`)."""

    mask: mx.array  # bool [B, 1, T, S]: query t of row b sees keys j <= lengths[b] + t
    write_index: mx.array  # int32 [B, 1, T, 1]: where a pass writes each row's keys and values
    cos: Optional[mx.array] = None  # float32 [B, 1, T, dims/2] (None: each layer rotates on its own)
    sin: Optional[mx.array] = None

    def arrays(self) -> list:
        return [a for a in self if a is not None]


def pass_positions(lengths: mx.array, T: int, span: int, rope: Optional[RopeSpec] = None) -> PassPositions:
    """`PassPositions` of a pass of T positions reading `span` keys, rows
    holding `lengths` [B] before it (RoPE angles when `rope` is given)."""
    q = _query_positions(lengths, T)  # [B, T]
    mask = mx.arange(span)[None, None, :] <= q[:, :, None]  # [B, T, S]
    angles = rope_angles(lengths, T, rope) if rope is not None else (None, None)
    return PassPositions(mask[:, None], q[:, None, :, None], *angles)


class SlotKVCache:
    """Attention KV with a write position per row. `lengths[b]`: row b's
    valid entries (its next RoPE position); `host_max` bounds max(lengths)
    on the host, so the fetched span needs no device sync."""

    per_row_lengths = True  # what the CPU attention form tells a slot cache by

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.keys: Optional[mx.array] = None  # [B, H, C, Dk]
        self.values: Optional[mx.array] = None  # [B, H, C, Dv]
        self.lengths = mx.zeros((batch_size,), dtype=mx.int32)  # [B]
        self.host_max = 0
        # Inside a compiled pass: its shared `PassPositions`.
        self.positions: Optional["PassPositions"] = None

    # mlx-lm's attention cache protocol.
    @property
    def offset(self) -> mx.array:
        return self.lengths

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **_):
        span = self.host_max + N
        if window_size is None:
            return (self.positions or pass_positions(self.lengths, N, span)).mask  # [B, 1, N, S]
        q = _query_positions(self.lengths, N)[:, :, None]  # [B, N, 1]
        keys = mx.arange(span)[None, None, :]  # [1, 1, S]
        return ((keys <= q) & (keys > q - window_size))[:, None]  # [B, 1, N, S]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, T, _ = keys.shape  # [B, H, T, Dk]
        # Masked entries still meet a weight of 0, and 0 x NaN is NaN. A kept
        # entry's non-finite state still reaches its logits (decode.accept).
        keys, values = _finite_or_zero(keys), _finite_or_zero(values)
        self._reserve(self.host_max + T, keys, values)
        # (Outside a shared pass the mask made beside the index is never evaluated.)
        idx = (self.positions or pass_positions(self.lengths, T, self.host_max + T)).write_index  # [B, 1, T, 1]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(idx, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(idx, values.shape), values, axis=2)
        self.lengths = self.lengths + T
        self.host_max += T
        return self.keys[:, :, : self.host_max], self.values[:, :, : self.host_max]

    def is_trimmable(self):
        return False

    def reserve(self, needed: int):
        """Grow the capacity to at least `needed` positions (keys must exist)."""
        self._reserve(needed, self.keys, self.values)

    def _reserve(self, needed: int, keys: mx.array, values: mx.array):
        have = 0 if self.keys is None else self.keys.shape[2]
        if needed <= have:
            return
        grow = ((needed - have + _STEP - 1) // _STEP) * _STEP
        B, H = self.batch_size, keys.shape[1]
        new_k = mx.zeros((B, H, grow, keys.shape[3]), dtype=keys.dtype)
        new_v = mx.zeros((B, H, grow, values.shape[3]), dtype=values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def set_lengths(self, lengths: mx.array, host_max: int):
        """Commit: keep `lengths[b]` entries of each row. An int32 array is
        kept as is, so caches handed one array share it (`passes._positions`)."""
        self.lengths = lengths if lengths.dtype == mx.int32 else lengths.astype(mx.int32)
        self.host_max = int(host_max)

    def write_rows(self, rows: Sequence[int], keys: mx.array, values: mx.array, lengths: mx.array, host_max: int):
        """Replace slots `rows` (host ints) with keys/values [R, H, L, D] and lengths [R]."""
        L = keys.shape[2]
        if L == 0:  # nothing to write (one-token prompts have no head pairs)
            self.zero_rows(rows, host_max)
            self.lengths = put_rows(self.lengths, rows, lengths.astype(mx.int32))
            return
        self._reserve(L, keys, values)
        cap = self.keys.shape[2]
        pad = [(0, 0), (0, 0), (0, cap - L), (0, 0)]
        self.keys = put_rows(self.keys, rows, mx.pad(keys, pad))
        self.values = put_rows(self.values, rows, mx.pad(values, pad))
        self.lengths = put_rows(self.lengths, rows, lengths.astype(mx.int32))
        self.host_max = int(host_max)

    def zero_rows(self, rows: Sequence[int], host_max: int):
        if self.keys is not None:
            self.keys = put_rows(self.keys, rows, 0.0)
            self.values = put_rows(self.values, rows, 0.0)
        self.lengths = put_rows(self.lengths, rows, 0)
        self.host_max = int(host_max)

    def take_rows(self, rows: mx.array) -> "SlotKVCache":
        """A cache of len(rows) slots holding slots `rows` of this one."""
        out = SlotKVCache(rows.shape[0])
        if self.keys is not None:
            out.keys, out.values = self.keys[rows], self.values[rows]  # [R, H, C, D]
        out.lengths = self.lengths[rows]
        out.host_max = self.host_max
        return out

    @property
    def state(self):
        return self.keys, self.values, self.lengths

    @property
    def arrays(self):
        return [self.keys, self.values, self.lengths]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class SlotGDNCache:
    """Gated-delta state per row: conv window and recurrent state. A verify
    (`models.families.qwen`) leaves each step's state and the conv input in
    `pending`; `commit_gdn` keeps each row's at its accepted position."""

    keeps_steps = True  # how a family's layer tells its verify cache from a prompt's

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.conv: Optional[mx.array] = None  # [B, K-1, C]
        self.state: Optional[mx.array] = None  # [B, Hv, Dv, Dk]
        self.pending = None

    def ensure(self, conv_shape, conv_dtype, state_shape):
        if self.conv is None:
            self.conv = mx.zeros((self.batch_size, *conv_shape), dtype=conv_dtype)
            self.state = mx.zeros((self.batch_size, *state_shape), dtype=mx.float32)

    @property
    def arrays(self):
        return [self.conv, self.state]

    def write_rows(self, rows: Sequence[int], conv: mx.array, state: mx.array):
        """Replace whole slots `rows` (host ints): conv [R, K-1, C], state [R, Hv, Dv, Dk]."""
        self.ensure(conv.shape[1:], conv.dtype, state.shape[1:])
        self.conv = put_rows(self.conv, rows, conv)
        self.state = put_rows(self.state, rows, state)

    def take_rows(self, rows: mx.array) -> "SlotGDNCache":
        """A cache of slots `rows` of this one (between cycles: nothing pending)."""
        out = SlotGDNCache(rows.shape[0])
        if self.conv is not None:
            out.conv, out.state = self.conv[rows], self.state[rows]  # [R, K-1, C], [R, Hv, Dv, Dk]
        return out

    def zero_rows(self, rows: Sequence[int]):
        if self.conv is not None:
            self.conv = put_rows(self.conv, rows, 0.0)
            self.state = put_rows(self.state, rows, 0.0)

    @property
    def nbytes(self) -> int:
        return 0 if self.conv is None else self.conv.nbytes + self.state.nbytes


def commit_gdn(caches: List["SlotGDNCache"], keep: mx.array, all_kept: bool, compiled: bool = True):
    """Commit every gated-delta cache of a verify: row b keeps `keep[b]` of
    the T steps (0, an empty slot, keeps 1); compiled, as one graph."""
    layers = [c for c in caches if isinstance(c, SlotGDNCache) and c.pending is not None]
    pending = [c.pending for c in layers]
    for c in layers:
        c.pending = None
    if all_kept or not layers:  # the verify already left the state after all T steps
        return
    kept = (_kept_states_compiled if compiled else _kept_states)(keep, pending)
    for c, (conv, state) in zip(layers, kept):
        c.conv, c.state = conv, state


def _kept_states(keep: mx.array, pending: list) -> list:
    """Per layer (conv_input [B, K-1+T, C], T x state [B, Hv, Dv, Dk]) -> conv
    window and state after step keep[b]; a select per step, T is small."""
    keep = mx.maximum(keep, 1)  # [B]
    out = []
    for conv_input, states in pending:
        T = len(states)
        n = conv_input.shape[1] - T  # K-1
        conv, state = conv_input[:, T:], states[-1]  # keep == T
        for a in range(T - 1, 0, -1):
            pick = keep == a  # [B]
            conv = mx.where(pick[:, None, None], conv_input[:, a : a + n], conv)
            state = mx.where(pick[:, None, None, None], states[a - 1], state)
        out.append((conv, state))
    return out


_kept_states_compiled = mx.compile(_kept_states)


def make_slot_caches(layer_kinds: List[str], batch_size: int) -> list:
    """One slot cache per trunk layer: 'attn' -> KV, 'linear' -> gated delta."""
    return [SlotGDNCache(batch_size) if kind == "linear" else SlotKVCache(batch_size) for kind in layer_kinds]
