"""Costs that bound what speculation can gain: `BareCosts` of the bare passes (`step_s`: a trunk pass over
1 token per row; `verify_s[k]`: over k+1 tokens; `head_s`: a head pass), timed with the runtime's slot
caches and compiled passes, and `CycleCosts`, the runtime's own whole cycles (`calibration.measure_cycle_costs`)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from mtplx.backends import CycleThreads
from mtplx.decode.cache import SlotKVCache, commit_gdn, make_slot_caches
from mtplx.decode.passes import SlotPass, head_layer, trunk_pass
from mtplx.decode.prepare import prepare_for_decoding


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


@dataclass
class CycleCosts:
    """Seconds per cycle of the runtime itself at each depth (depth 0 stands for the step): whole cycles,
    so what speculation costs beyond the bare passes (drafts, accept, commit, host work) is in them."""

    batch_size: int
    seconds: Dict[int, float]
    overhead: Optional[float] = None  # measured over bare ratio to depth 0, when bare costs give the shape

    @property
    def step_s(self) -> float:
        return self.seconds[0]

    @property
    def verify_s(self) -> Dict[int, float]:
        return {k: s for k, s in self.seconds.items() if k > 0}

    def cycle_s(self, k: int) -> float:
        return self.seconds[k]

    def as_dict(self) -> dict:
        out = {"batch_size": self.batch_size, "cycle_s": {str(k): v for k, v in self.seconds.items()}}
        if self.overhead is not None:
            out["overhead_over_bare"] = self.overhead
        return out


def ideal_tokens_per_cycle(acceptance_by_depth: Sequence[float], k: int) -> float:
    """1 + sum of cumulative acceptance rates of depths 1..k (docs/design.md, "Metrics")."""
    return 1.0 + float(sum(acceptance_by_depth[:k]))


def predicted_speedup(costs: BareCosts, acceptance_by_depth: Sequence[float], k: int) -> float:
    """ideal tokens per cycle x one-token step time / cycle time."""
    if k == 0:
        return 1.0
    return ideal_tokens_per_cycle(acceptance_by_depth, k) * costs.step_s / costs.cycle_s(k)


class BareCostSampler:
    """The bare passes, timed in interleaved rounds of back-to-back bursts at each `sample`; `costs`
    pools every round: the step's fastest round (interference only adds time) and, for every other pass,
    the step x the median of its same-round ratios to it. Sampled between other work (the bench's rounds,
    calibration's decodes), the rounds cover more of a shared machine's slow spells."""

    def __init__(self, model, batch_size: int, depths: Sequence[int], context: int, compiled: bool = True):
        prepare_for_decoding(model)  # the model as the runtime decodes with it
        self.batch_size, self.context, self.depths = batch_size, context, list(depths)
        self.threads = CycleThreads(model)  # the passes set OpenBLAS's threads as their cycles would
        self.passes = _bare_passes(model, batch_size, self.depths, context, compiled, self.threads)
        self.times: Dict = {name: [] for name in self.passes}

    def sample(self, rounds: int) -> None:
        """Time `rounds` more interleaved rounds of every pass (the first call also warms them up)."""
        if rounds < 1:
            return
        warm = bool(self.times["step"])
        try:
            times = interleaved_times(self.passes, rounds, burst=BURST, warmups=0 if warm else 2, lead=LEAD)
        finally:
            self.threads.release()
        for name, ts in times.items():
            self.times[name] += ts

    def costs(self) -> BareCosts:
        best = _anchored_to(self.times, anchor="step")
        return BareCosts(
            batch_size=self.batch_size,
            context=self.context,
            step_s=best["step"],
            verify_s={k: best[k] for k in self.depths},
            head_s=best.get("head", 0.0),
        )


BURST = 4  # calls per timed burst, each launched before the previous one is read, as the runtime launches cycles
# Untimed calls before each burst: a pass's first call after another runs cold (OpenBLAS thread count
# switch, the other pass's leftovers), which the runtime's cycles do not (docs/bench-history.md).
LEAD = 1


def _bare_passes(model, B: int, depths: Sequence[int], context: int, compiled: bool, threads: CycleThreads) -> dict:
    """name -> a function running that pass once: "step" (1 token per row), k (a verify over k+1 tokens)
    and "head", each from `context` positions, rolled back after every call. The trunk passes share one
    set of caches, as the runtime's cycles do; a gated-delta state is not rolled back (its values do not
    change the cost)."""
    tokens = mx.zeros((B, max(depths, default=0) + 1), dtype=mx.int32)
    caches = _warm_trunk(model, B, context)
    passes = {}

    def verify_pass(T):
        run = trunk_pass(model, keep_pending=T > 1, compiled=compiled)
        keep = mx.ones((B,), dtype=mx.int32)

        def verify():
            threads.for_rows(B * T)  # as the runtime's cycle of this width runs it
            out = run((tokens[:, :T],), caches, T=T)
            commit_gdn(caches, keep, all_kept=T == 1, compiled=compiled)
            return [*out] + [a for c in caches for a in c.arrays]

        return _rolled_back(caches, verify)

    passes["step"] = verify_pass(1)
    passes.update({k: verify_pass(k + 1) for k in depths})
    if model.head is not None:
        hidden = mx.zeros((B, 1, _hidden_size(model)), dtype=mx.float32)
        head_cache = _warm_head(model, B, context)[:1]
        run = SlotPass(head_layer(model.head, 0), keep_pending=False, compiled=compiled)

        # One cost for every depth: timed at the count of a depth-1 cycle (2B rows).
        def head():
            threads.for_rows(2 * B)
            return run((hidden, tokens[:, :1]), head_cache, T=1)

        passes["head"] = _rolled_back(head_cache, head)
    return passes


def verify_never_falling(bare: BareCosts) -> BareCosts:
    """The verify costs as their least-squares non-decreasing fit over k (misordered neighbours pooled to
    their mean): a deeper verify never costs less, but need not cost more by the same step at every depth
    (OpenBLAS's Haswell kernels run 4 rows about as fast as 3), so a line over k would misprice them."""
    ks = sorted(bare.verify_s)
    blocks: List[List[float]] = []  # [mean, count] of pooled adjacent depths
    for k in ks:
        blocks.append([bare.verify_s[k], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    fitted, it = {}, iter(ks)
    for mean, count in blocks:
        for _ in range(int(count)):
            fitted[next(it)] = mean
    return BareCosts(bare.batch_size, bare.context, bare.step_s, fitted, bare.head_s)


def _shaped_by_bare(times: Dict[int, list], bare: BareCosts):
    """Depth 0's cost is its fastest round; depth k's that x bare.cycle_s(k) / bare.step_s x one overhead
    factor, the median over rounds and depths of the measured same-round ratio to depth 0 over the bare
    ratio. The many bare rounds give the shape across depths; the decodes, what a whole cycle adds."""
    rel = [
        (t / t0) / (bare.cycle_s(k) / bare.step_s)
        for k, ts in times.items()
        if k > 0
        for t, t0 in zip(ts, times[0])
        if not (math.isnan(t) or math.isnan(t0))
    ]
    overhead = float(np.median(rel)) if rel else 1.0
    base = _fastest(times[0])
    seconds = {k: base if k == 0 else base * overhead * bare.cycle_s(k) / bare.step_s for k in times}
    return seconds, overhead


def _anchored_to(times: Dict, anchor=0) -> Dict:
    """Per entry, the anchor's fastest round (depth 0's or the bare step's) x the median of the entry's
    same-round ratios to it (rounds without a time skipped); without the anchor, the fastest round.
    Same-round ratios, since each entry's own fastest round would follow whichever round was quick."""
    if anchor not in times:
        return {k: _fastest(ts) for k, ts in times.items()}
    base = _fastest(times[anchor])
    out = {}
    for k, ts in times.items():
        ratios = [t / t0 for t, t0 in zip(ts, times[anchor]) if not (math.isnan(t) or math.isnan(t0))]
        out[k] = base * float(np.median(ratios)) if ratios else _fastest(ts)
    return out


def _fastest(ts) -> float:
    """The fastest round with a time (inf when none has one)."""
    return min((t for t in ts if not math.isnan(t)), default=float("inf"))


def interleaved_times(fns: dict, repeats: int, burst: int = 1, warmups: int = 1, lead: int = 0) -> Dict[str, list]:
    """Seconds per call of each function, timed round-robin so that load from other processes hits
    every candidate alike; each timing is a burst of `burst` calls launched back to back, after `lead`
    untimed calls of the same function."""
    for fn in fns.values():  # warm-up: tracing and kernel builds
        for _ in range(warmups):
            mx.eval(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(lead):
                mx.eval(fn())
            t0 = time.perf_counter()
            for _ in range(burst):
                # Nothing of a call is kept over the next: a held reference to the caches a trunk
                # pass wrote makes MLX copy every KV cache at its next write, as the runtime never does.
                mx.async_eval(fn())
            mx.synchronize()
            times[name].append((time.perf_counter() - t0) / burst)
    return times


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
    """Each timed pass starts from the warm lengths, as a rolled-back verify does, with one lengths array
    in every KV cache as a commit leaves the runtime's trunk (`SlotBatch.commit_trunk`), so that a pass
    makes its positions and RoPE angles once (`mtplx.decode.passes._positions`)."""
    kv = [c for c in caches if isinstance(c, SlotKVCache)]
    lengths = kv[0].lengths if kv else None  # every row holds the warm context in every layer
    saved = [(c, c.host_max) for c in kv]

    def timed():
        for c, host_max in saved:
            c.set_lengths(lengths, host_max)
        return run()

    return timed


def _hidden_size(model) -> int:
    return int(model.text_model.embed_tokens.weight.shape[1])
