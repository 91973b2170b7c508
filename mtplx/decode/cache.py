"""Batch caches with one slot per row and per-row commit/rollback.

Every row of a decode batch owns one slot. A slot's valid length moves on its
own, so rolling back rejected draft entries is `lengths -= k - a_b`: nothing
moves in memory. Entries past a row's length are masked, new entries are
stored with non-finite values as 0, and a slot is zeroed when its row leaves:
a NaN in a masked V entry would still poison attention (0 x NaN).

`SlotKVCache` implements the cache protocol mlx-lm's attention layers call
(`offset`, `update_and_fetch`, `make_mask`), so no model file is forked.
`SlotGDNCache` holds gated-delta (linear attention) state, which cannot be
trimmed; the verify-time forward keeps the state after each verified step and
the conv input window, so commit selects each row's state at its accepted
position.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Union

import mlx.core as mx

from mtplx.backends import RopeSpec, rope_angles

_STEP = 256  # capacity grows in multiples of this many positions


# A compiled pass reads keys up to a multiple of this many positions, not the
# whole capacity: one trace per bucket a batch's lengths pass through.
SPAN_BUCKET = 64


def rounded_capacity(needed: int) -> int:
    """The capacity a slot cache holding `needed` positions grows to."""
    return -(-needed // _STEP) * _STEP


def read_span(needed: int, capacity: int) -> int:
    """Positions a compiled pass reads from a slot cache of `capacity` when
    its rows hold at most `needed` (writes included): `needed` rounded up to
    a whole SPAN_BUCKET. Read over the whole capacity, a batch of short rows
    paid for every position of it: 16,000 sampled rows of under 16 positions
    on a tiny test checkpoint at batch 1024 took 22.4 s against 18.5 s (the
    rest is the copy each write makes of the whole cache), and the built-in
    model decoded 2-15% faster at batch 4-64 with a bucket (paired medians,
    prompts of 16-128 tokens, 64 new)."""
    return min(capacity, -(-max(needed, 1) // SPAN_BUCKET) * SPAN_BUCKET)


def put_rows(full: mx.array, rows: Sequence[int], values: Union[mx.array, float]) -> mx.array:
    """`full` [B, ...] with rows `rows` (host ints, distinct) replaced by
    `values` ([len(rows), ...] in that order, or a scalar).

    Every row at once is `values` itself and one run of consecutive rows one
    slice update; only other sets of rows take a scatter, which MLX's CPU
    backend runs element by element: loading 4 rows into a [4, 2, 256, 24]
    key cache took 323 us as a scatter and 111 us as a slice update (16
    rows into 16: 1084 against 216), and a batch's loads write every
    attention layer's keys and values."""
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
    # A Python 0.0 takes x's dtype and is a constant; mx.zeros((), dtype)
    # was a Full node of its own in every attention layer's pass.
    return mx.where(mx.isfinite(x), x, 0.0)


def _query_positions(lengths: mx.array, T: int) -> mx.array:
    """int32 [B, T]: the positions of a pass's T new tokens in each row."""
    return lengths[:, None] + mx.arange(T)[None, :]


class PassPositions(NamedTuple):
    """What every attention layer of one pass derives from the rows'
    lengths alone: which keys each query sees and where the new entries go.
    On the CPU backend each is a handful of small ops that cost more to
    dispatch than to run; the trunk's layers all hold the same lengths, so a
    pass makes them once for all its layers (`mtplx.compiled.SlotPass`).
    So are the RoPE angles, where the layers rotate with them
    (`mtplx.rope_angles`)."""

    mask: mx.array  # bool [B, 1, T, S]: query t of row b sees keys j <= lengths[b] + t
    write_index: mx.array  # int32 [B, 1, T, 1]: where a pass writes each row's keys and values
    cos: Optional[mx.array] = None  # float32 [B, 1, T, dims/2] (None: each layer rotates on its own)
    sin: Optional[mx.array] = None

    def arrays(self) -> list:
        return [a for a in self if a is not None]


def pass_positions(lengths: mx.array, T: int, span: int, rope: Optional[RopeSpec] = None) -> PassPositions:
    """`PassPositions` of a pass of T positions reading `span` keys from
    caches whose rows hold `lengths` [B] entries before it, with the RoPE
    angles of `rope` at those positions when given."""
    q = _query_positions(lengths, T)  # [B, T]
    mask = mx.arange(span)[None, None, :] <= q[:, :, None]  # [B, T, S]
    angles = rope_angles(lengths, T, rope) if rope is not None else (None, None)
    return PassPositions(mask[:, None], q[:, None, :, None], *angles)


class SlotKVCache:
    """Attention KV with a write position per row.

    `lengths[b]` is the number of valid entries of row b, which is also the
    RoPE position of the next token written to that row. `host_max` mirrors
    max(lengths) on the host so the fetched span never needs a device sync.
    """

    per_row_lengths = True  # what the CPU attention form tells a slot cache by

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.keys: Optional[mx.array] = None  # [B, H, C, Dk]
        self.values: Optional[mx.array] = None  # [B, H, C, Dv]
        self.lengths = mx.zeros((batch_size,), dtype=mx.int32)  # [B]
        self.host_max = 0
        # Inside a compiled pass: the mask and write index of its span, made
        # once for every attention layer of the pass (`PassPositions`).
        self.positions: Optional["PassPositions"] = None

    # -- the protocol mlx-lm attention layers use --------------------------
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
        # Entries past a row's length are masked, but attention multiplies
        # their values by a weight of exactly 0, and 0 x NaN is NaN: a
        # rejected draft whose forward went non-finite would poison the
        # positions before it in its own verify and every later read of the
        # slot. Stored as 0 instead, they stay harmless; an entry the row
        # keeps carries its non-finite hidden state on the residual stream,
        # so that position's logits still flag the row (mtplx.decide).
        keys, values = _finite_or_zero(keys), _finite_or_zero(values)
        self._reserve(self.host_max + T, keys, values)
        # (Outside a shared pass the mask made beside the index is never
        # evaluated: nothing reads it.)
        idx = (self.positions or pass_positions(self.lengths, T, self.host_max + T)).write_index  # [B, 1, T, 1]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(idx, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(idx, values.shape), values, axis=2)
        self.lengths = self.lengths + T
        self.host_max += T
        return self.keys[:, :, : self.host_max], self.values[:, :, : self.host_max]

    def is_trimmable(self):
        return False

    # -- what the runtime calls --------------------------------------------
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
        """Commit: keep `lengths[b]` entries of each row (rollback is free).
        An int32 array is kept as it is, so that caches handed one array
        share it (`mtplx.compiled._positions`)."""
        self.lengths = lengths if lengths.dtype == mx.int32 else lengths.astype(mx.int32)
        self.host_max = int(host_max)

    def write_rows(self, rows: Sequence[int], keys: mx.array, values: mx.array, lengths: mx.array, host_max: int):
        """Replace whole slots: slots `rows` (host ints) get keys/values
        [R, H, L, D] (zero past them) and lengths [R]."""
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
    """Gated-delta state per row: the conv window and the recurrent state.

    During verify the layer's own forward (see `families/qwen.py`) stores the
    state after each step and the conv input in `pending`; `commit_gdn` keeps,
    per row, the state after its accepted position.
    """

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
        """A cache of len(rows) slots holding slots `rows` of this one
        (between cycles: nothing pending)."""
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
    the T verified steps (keep <= T; 0, an empty slot, keeps 1). Compiled,
    all layers' selects run as one fused graph instead of a few small ops
    per layer."""
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
    """Per layer (conv_input [B, K-1+T, C], T x state [B, Hv, Dv, Dk]) -> the
    conv window and state after step keep[b] of each row. A select per
    candidate step rather than a gather over a stacked copy: T is small."""
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
