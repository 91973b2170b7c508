"""Bare costs that bound what speculation can gain, measured on this machine.

- `step_s`: one trunk forward of 1 token per row (plain decoding's step);
- `verify_s[k]`: one trunk forward of k+1 tokens per row (a verify pass);
- `head_s`: one head forward of 1 token per row (a draft step).
Costs are measured with the slot caches and the compiled passes the runtime
uses (`mtplx.compiled.SlotPass`), at a given batch size and context length,
as medians of repeated timed passes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Sequence

import mlx.core as mx

from .cache import SlotKVCache, make_slot_caches
from .compiled import SlotPass, head_layer


@dataclass
class BareCosts:
    batch_size: int
    context: int
    step_s: float
    verify_s: Dict[int, float] = field(default_factory=dict)
    head_s: float = 0.0

    def cycle_s(self, k: int) -> float:
        """Predicted time of one decode cycle at depth k."""
        if k == 0:
            return self.step_s
        return self.verify_s[k] + k * self.head_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["verify_s"] = {str(k): v for k, v in self.verify_s.items()}
        return d


def ideal_tokens_per_cycle(acceptance_by_depth: Sequence[float], k: int) -> float:
    """1 + sum of cumulative acceptance rates of depths 1..k (DESIGN "Metrics")."""
    return 1.0 + float(sum(acceptance_by_depth[:k]))


def predicted_speedup(costs: BareCosts, acceptance_by_depth: Sequence[float], k: int) -> float:
    """ideal tokens per cycle x one-token step time / cycle time."""
    if k == 0:
        return 1.0
    return ideal_tokens_per_cycle(acceptance_by_depth, k) * costs.step_s / costs.cycle_s(k)


def measure_bare_costs(
    model,
    batch_size: int,
    depths: Sequence[int] = (1, 2, 3),
    context: int = 64,
    repeats: int = 7,
    compiled: bool = True,
) -> BareCosts:
    """Median wall time of the bare passes on a warm cache of `context` tokens."""
    B = batch_size
    tokens = mx.zeros((B, max(depths, default=0) + 1), dtype=mx.int32)

    def trunk_pass(T, keep_pending):
        caches = _warm_trunk(model, B, context)
        run = SlotPass(model.forward, keep_pending=keep_pending, compiled=compiled)
        return _rolled_back(caches, lambda: run((tokens[:, :T],), caches, T=T))

    costs = BareCosts(batch_size=B, context=context, step_s=_median_time(trunk_pass(1, False), repeats))
    for k in depths:
        costs.verify_s[k] = _median_time(trunk_pass(k + 1, True), repeats)
    if model.head is not None:
        hidden = mx.zeros((B, 1, _hidden_size(model)), dtype=mx.float32)
        head_cache = _warm_head(model, B, context)[:1]
        run = SlotPass(head_layer(model.head, 0), keep_pending=False, compiled=compiled)
        costs.head_s = _median_time(_rolled_back(head_cache, lambda: run((hidden, tokens[:, :1]), head_cache, T=1)), repeats)
    return costs


def _median_time(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up (tracing, kernel builds)
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _warm_trunk(model, B: int, context: int):
    """Slot caches holding `context` positions of every row."""
    caches = make_slot_caches(model.layer_kinds, B)
    model.forward(mx.zeros((B, context), dtype=mx.int32), caches)
    return caches


def _warm_head(model, B: int, context: int):
    caches = [SlotKVCache(B) for _ in range(model.num_head_layers)]
    H = _hidden_size(model)
    model.head(mx.zeros((B, context, H)), mx.zeros((B, context), dtype=mx.int32), cache=caches)
    return caches


def _rolled_back(caches, run):
    """Each timed pass starts from the warm lengths, as a rolled-back verify does."""
    saved = [(c, c.lengths, c.host_max) for c in caches if isinstance(c, SlotKVCache)]

    def timed():
        for c, lengths, host_max in saved:
            c.set_lengths(lengths, host_max)
        return run()

    return timed


def _hidden_size(model) -> int:
    return int(model.text_model.embed_tokens.weight.shape[1])
