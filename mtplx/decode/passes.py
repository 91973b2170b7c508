"""Decode passes over the slot caches as compiled MLX graphs (at decode
batch sizes a forward is mostly op dispatch, which `mx.compile` fuses). A
traced pass is a pure function of arrays, so the cache arrays go in and
come out; the read span reaches it as a marker input's shape (`span_marker`)."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from mtplx import backends
from mtplx.backends import RopeSpec
from mtplx.decode.cache import PassPositions, SlotGDNCache, SlotKVCache, pass_positions, read_span


class SlotPass:
    """`run(*inputs, caches)` as one compiled graph over the caches' arrays,
    leaving the caches as an eager call would (`pending` when `keep_pending`).
    A pass whose caches are not allocated yet runs eagerly."""

    def __init__(self, run: Callable, keep_pending: bool, compiled: bool = True, rope: Optional[RopeSpec] = None):
        self.run = run
        self.keep_pending = keep_pending
        self.compiled = compiled
        self.rope = rope  # the RoPE whose angles its attention layers take from the pass (`backends.cpu.rope_angles`)
        self._kinds: tuple = ()
        self._fn = mx.compile(self._pure) if compiled else self._pure

    def __call__(self, inputs: Sequence[mx.array], caches: List, T: int, shared: Optional[dict] = None):
        """`shared`: a dict the SlotPasses of one `StagedPass` share, so caches
        holding one lengths array share their `PassPositions`."""
        if not self.compiled or any(a is None for a in _cache_arrays(caches)):
            return self.run(*inputs, caches)
        for c in caches:
            if isinstance(c, SlotKVCache):
                c.reserve(c.host_max + T)  # may replace keys/values, so they are read after
        kinds = tuple(type(c) for c in caches)
        if kinds != self._kinds:
            if self._kinds:  # the trace depends on the cache layout
                raise ValueError("a SlotPass serves one cache layout")
            self._kinds = kinds
        needed = max((c.host_max for c in caches if isinstance(c, SlotKVCache)), default=0) + T
        span = common_span(caches, needed)
        positions = _positions(caches, T, span, {} if shared is None else shared, self.rope)
        outs = self._fn(span_marker(span), *inputs, *positions, *_cache_arrays(caches))
        with_pending = self.keep_pending and T > 1
        n_run = len(outs) - _n_outputs(caches, T, with_pending)
        _write_back(caches, outs[n_run:], T, with_pending)
        result = outs[:n_run]
        return result[0] if len(result) == 1 else tuple(result)

    def _pure(self, span, *flat):
        n_arrays = sum(3 if k is SlotKVCache else 2 for k in self._kinds)
        per_cache = 2 if self.rope is None else 4
        n_positions = per_cache * self._kinds.count(SlotKVCache)  # a PassPositions per KV cache
        inputs, arrays = flat[: len(flat) - n_arrays - n_positions], flat[len(flat) - n_arrays :]
        shadows = shadow_caches(self._kinds, arrays, T=_steps(inputs), span=span.shape[0])
        positions = iter(flat[len(inputs) : len(inputs) + n_positions])
        for s in shadows:
            if isinstance(s, SlotKVCache):
                s.positions = PassPositions(*(next(positions) for _ in range(per_cache)))
        out = self.run(*inputs, shadows)
        out = list(out) if isinstance(out, tuple) else [out]
        return out + _shadow_outputs(shadows, self.keep_pending)


class StagedPass:
    """The trunk's forward as a chain of `SlotPass`es of `layers_per_stage`
    layers (0: one), each started with `mx.async_eval` once built, so the host
    builds the next while MLX's CPU worker runs it (docs/performance.md).
    `(inputs, caches, T)` -> (logits, hidden)."""

    def __init__(
        self,
        model,
        keep_pending: bool,
        compiled: bool = True,
        layers_per_stage: int = 0,
        rope: Optional[RopeSpec] = None,
    ):
        self.compiled = compiled
        n = len(model.layer_kinds)
        per_stage = layers_per_stage if layers_per_stage > 0 else n
        bounds = list(range(0, n, per_stage)) + [n]
        self.stages = [
            (slice(a, b), SlotPass(_stage(model, a, b, first=a == 0, last=b == n), keep_pending, compiled, rope))
            for a, b in zip(bounds[:-1], bounds[1:])
        ]

    def __call__(self, inputs: Sequence[mx.array], caches: List, T: int):
        shared = {}  # the stages' attention layers share one PassPositions
        for layers, run in self.stages[:-1]:
            x = run(inputs, caches[layers], T, shared)  # [B, T, H]
            mx.async_eval(x)
            inputs = (x,)
        layers, run = self.stages[-1]
        return run(inputs, caches[layers], T, shared)


def trunk_pass(model, keep_pending: bool, compiled: bool = True) -> StagedPass:
    """The runtime's trunk pass (step, verify, prefill's last step), staged as the backend says."""
    layers_per_stage, rope = backends.pass_stages(model)
    return StagedPass(model, keep_pending, compiled, layers_per_stage, rope)


def _stage(model, start: int, stop: int, first: bool, last: bool) -> Callable:
    """Trunk layers start..stop as run(tokens [B, T] or x [B, T, H], caches),
    with the embedding when first, logits and hidden states when last."""

    def run(x, caches):
        x = model.run_layers(model.embed(x) if first else x, caches, start, stop)
        return model.logits_and_hidden(x) if last else x

    return run


def head_layer(head, j: int) -> Callable:
    """Head layer j's pass: run(hidden [B, T, H], tokens [B, T], [cache_j])."""
    n = len(head.layers)

    def run(hidden, tokens, caches):
        cache = [None] * n
        cache[j] = caches[0]
        return head(hidden, tokens, cache=cache, depth=j + 1)

    return run


def _positions(caches, T: int, span: int, shared: dict, rope: Optional[RopeSpec] = None) -> list:
    """The `PassPositions` of each KV cache for T positions reading `span` keys
    (0: capacity), flattened. Caches holding one lengths array (the trunk's:
    `SlotBatch.commit_trunk`) share them, across a `shared` dict too."""
    out = []
    for c in caches:
        if isinstance(c, SlotKVCache):
            key = (id(c.lengths), T, span or c.keys.shape[2])
            if key not in shared:  # the lengths are kept with them, so that their id stays theirs
                shared[key] = (c.lengths, pass_positions(c.lengths, T, key[2], rope))
            out += shared[key][1].arrays()
    return out


def _steps(inputs) -> int:
    """Positions per row: the first input is tokens [B, T] or hidden [B, T, H]."""
    return inputs[0].shape[1]


def _cache_arrays(caches) -> list:
    out = []
    for c in caches:
        out += [c.keys, c.values, c.lengths] if isinstance(c, SlotKVCache) else [c.conv, c.state]
    return out


@lru_cache(maxsize=None)
def span_marker(span: int) -> mx.array:
    """The read span as a trace sees it: the shape of an int8 [span] input (0: whole capacity)."""
    return mx.zeros((span,), dtype=mx.int8)


def common_span(caches, needed: int) -> int:
    """One read span for the KV caches (`cache.read_span`); 0 (capacity) if they differ."""
    capacities = {c.keys.shape[2] for c in caches if isinstance(c, SlotKVCache)}
    return read_span(needed, capacities.pop()) if len(capacities) == 1 else 0


def shadow_caches(kinds, arrays, T: int, span: int = 0) -> list:
    """Fresh caches over traced arrays, reading `span` positions (0: capacity)."""
    it = iter(arrays)
    shadows = []
    for kind in kinds:
        if kind is SlotKVCache:
            keys, values, lengths = next(it), next(it), next(it)
            s = SlotKVCache(keys.shape[0])
            s.keys, s.values, s.lengths = keys, values, lengths
            s.host_max = (span or keys.shape[2]) - T
        else:
            conv, state = next(it), next(it)
            s = SlotGDNCache(conv.shape[0])
            s.conv, s.state = conv, state
        shadows.append(s)
    return shadows


def _shadow_outputs(shadows, keep_pending: bool) -> list:
    out = []
    for s in shadows:
        if isinstance(s, SlotKVCache):
            out += [s.keys, s.values]
        else:
            out += [s.conv, s.state]
            if keep_pending and len(s.pending[1]) > 1:
                out += [s.pending[0], *s.pending[1]]  # [B, K-1+T, C], T x [B, Hv, Dv, Dk]
    return out


def _n_outputs(caches, T: int, with_pending: bool) -> int:
    return sum(2 if isinstance(c, SlotKVCache) else (3 + T if with_pending else 2) for c in caches)


def _write_back(caches, outs, T: int, with_pending: bool):
    it = iter(outs)
    for c in caches:
        if isinstance(c, SlotKVCache):
            c.keys, c.values = next(it), next(it)
            c.lengths = c.lengths + T
            c.host_max += T
        else:
            c.conv, c.state = next(it), next(it)
            # With one step the state after it is the only one: nothing to select.
            c.pending = (next(it), [next(it) for _ in range(T)]) if with_pending else None
