"""Bare costs that bound what speculation can gain, measured on this machine.

- `step_s`: one trunk forward of 1 token per row (plain decoding's step);
- `verify_s[k]`: one trunk forward of k+1 tokens per row (a verify pass);
- `head_s`: one head forward of 1 token per row (a draft step).
Costs are measured with the slot caches and the compiled passes the runtime
uses (`mtplx.compiled.trunk_pass`, staged as the runtime stages it, and the
head's `SlotPass`), at a given batch size and context length,
anchored to the step's fastest of interleaved rounds (`BareCostSampler`). `CycleCosts`
are the runtime's own whole cycles (`measure_cycle_costs`).
"""

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
    """Seconds per decode cycle of the runtime itself at each depth: the whole
    cycle (head catch-up, drafts, verify, accept, commit, host bookkeeping),
    so what speculation costs beyond the bare passes is in it. Depth 0's
    cycle stands in for the one-token step."""

    batch_size: int
    seconds: Dict[int, float]
    # Measured cycle time relative to depth 0 over the bare passes' ratio,
    # when the shape across depths comes from bare costs (`_shaped_by_bare`).
    overhead: Optional[float] = None

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
    """1 + sum of cumulative acceptance rates of depths 1..k (DESIGN "Metrics")."""
    return 1.0 + float(sum(acceptance_by_depth[:k]))


def predicted_speedup(costs: BareCosts, acceptance_by_depth: Sequence[float], k: int) -> float:
    """ideal tokens per cycle x one-token step time / cycle time."""
    if k == 0:
        return 1.0
    return ideal_tokens_per_cycle(acceptance_by_depth, k) * costs.step_s / costs.cycle_s(k)


class BareCostSampler:
    """The bare passes, ready to be timed in interleaved rounds (bursts of
    back-to-back calls) whenever `sample` is called; `costs` pools every
    round so far. The step keeps its fastest round (interference on a shared
    machine only ever adds time); every other pass is the step times the
    median of its ratios to the step within a round, since interleaving
    exposes neighbouring bursts to the same slow spells and the ratios are
    what the predictions use. A verify includes the commit that selects each
    row's gated-delta state, as the runtime pays it.

    Rounds taken in one go can all fall in one slow spell of the machine:
    on this 2-core VM such a spell adds about the same time to every pass,
    which pulls the ratios towards 1 (verify k=2 over the step measured
    1.29-1.30 in two such spells, 1.39-1.51 otherwise). Sampled between the
    benchmark's own rounds, or between calibration's decodes
    (`measure_cycle_costs`), they cover more of the machine's spells.
    """

    def __init__(self, model, batch_size: int, depths: Sequence[int], context: int, compiled: bool = True):
        prepare_for_decoding(model)  # the model as the runtime decodes with it
        self.batch_size, self.context, self.depths = batch_size, context, list(depths)
        self.threads = CycleThreads(model)  # the passes set OpenBLAS's threads as their cycles would
        self.passes = _bare_passes(model, batch_size, self.depths, context, compiled, self.threads)
        self.times: Dict = {name: [] for name in self.passes}

    def sample(self, rounds: int) -> None:
        """Time `rounds` more interleaved rounds of every pass (the first
        call warms them up: tracing and kernel builds)."""
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


# A round times each pass over a burst of calls, each launched before the
# previous one is read, as the runtime launches cycles (on the CPU backend
# that overlaps little).
BURST = 4
# Untimed calls of a pass before its burst. A pass's first call after
# another pass runs cold: it also pays for OpenBLAS's thread count switching
# (the step runs at the caller's count, a verify at batch 4 single-threaded,
# `mtplx.blas_threads`) and for whatever the other pass left behind, which
# the runtime's cycles, one kind after another at one count, do not. Timed
# cold, the verifies over the step came out low and the head high: at batch
# 4 on the built-in model (30 interleaved rounds) verify k=1, 2, 3 over the
# step 1.239, 1.472, 1.738 and a head pass 0.060 of it, against 1.262,
# 1.520, 1.800 and 0.056 after one untimed call; with OpenBLAS held at one
# thread (no switch) the gap was 0.3%, 1.4%, 2.5% and -8%.
LEAD = 1


def _bare_passes(model, B: int, depths: Sequence[int], context: int, compiled: bool, threads: CycleThreads) -> dict:
    """name -> a function running that pass once and returning its outputs:
    "step" (1 token per row), k (a verify over k+1 tokens) and "head"; each
    starts from `context` positions, rolled back after every call.

    The trunk passes share one set of caches, as the runtime's cycles do (a
    `BareCostSampler` keeps them through a batch size's runs: one set per
    pass would hold five KV caches of B x context of a large checkpoint). A
    gated-delta state is not rolled back; its values do not change the cost."""
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
    """The verify costs replaced by their least-squares non-decreasing fit
    over k (adjacent depths timed out of order pooled to their mean).

    A deeper verify runs more tokens, so it never costs less; but it need not
    cost more by the same step at every depth. OpenBLAS's Haswell kernels
    (forced by some machines' environment) run a GEMM over 3 rows slower
    than one over 4, and at batch 1 (k + 1 rows) a verify over 4 tokens timed
    within 1% of one over 3 in every measurement here (3.55 / 3.57, 3.49 /
    3.45, 3.37 / 3.40 ms in three `make bench` runs). The least-squares line
    over k that calibration used before spread depth 1 -> 2's step over
    2 -> 3, priced depth 3's cycle 11% over depth 2's where the bench's fixed
    depths ran it 4-6% over, and the batch-1 greedy controller ran depth 2 in
    97% of its cycles: auto came out at 0.907 and 0.919 of a fixed depth 3 in
    two of three runs (2026-12-01). The line was chosen on an earlier machine
    (SkylakeX kernels, affine costs), where one calibration timed k=3 only 3%
    over k=2 at batch 1 and the job ran depth 3, 3% slower than depth 2: with
    depths truly apart, the noise of 15 interleaved rounds can still misorder
    two of them, and pooling then takes their mean."""
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
    """Depth 0's cost is its fastest round; depth k's is that x the bare
    cycle ratio bare.cycle_s(k) / bare.step_s x one overhead factor: the
    median, over every round and depth, of the measured same-round ratio to
    depth 0 divided by the bare ratio.

    The bare passes are timed in many interleaved rounds and give the shape
    across depths; a few short decodes per depth cannot (on this 2-core VM
    one calibration measured depth 3 cheaper than depth 2, and the job ran
    depth 3). The runtime's own cycles give the one thing the bare passes
    lack: what a whole cycle costs beyond them, pooled over all depths."""
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
    """Per entry, the anchor's fastest round (depth 0's, or the bare step's)
    x the median of the entry's same-round ratios to the anchor (rounds
    without a time skipped); without the anchor, the fastest round.

    Each entry's own fastest round would give ratios that move with
    whichever round happened to be quick for it: over five measurements at
    batch 1 here, verify k=1 over the step spread 1.155-1.301 that way and
    1.164-1.253 as same-round ratios (k=2: 1.280-1.581 and 1.280-1.451)."""
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
    """Seconds per call of each function, timed round-robin so that load from
    other processes on a shared machine hits every candidate alike; each
    timing is a burst of `burst` calls launched back to back, after `lead`
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
                # Nothing of a call is kept over the next: a trunk pass's
                # outputs include the caches it wrote, and a reference held
                # to them made MLX copy every KV cache whole at the next
                # write instead of updating it in place, as the runtime's
                # cycles do (at batch 16 a step with capacity 1024 timed
                # 2.4x one with 256 so; 1.00-1.02x without the reference).
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
    """Each timed pass starts from the warm lengths, as a rolled-back verify
    does, and, as a commit leaves the runtime's trunk, with one lengths
    array in every KV cache (`SlotBatch.commit_trunk`), so that a pass makes
    its positions and RoPE angles once (`mtplx.compiled._positions`). With
    an array per layer the bare step on the built-in model had 1679 nodes
    where the runtime's plain cycle has 1436."""
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
