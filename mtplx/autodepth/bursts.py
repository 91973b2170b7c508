"""Calibration's timed decodes (`costs.measure_cycle_costs`): one runtime
whose cycles play a burst of each depth between bursts of plain decoding, so
that every depth is compared with plain cycles a few milliseconds away.

A slow spell of a shared machine then hits both sides of a comparison alike.
Timed as separate decodes, one runtime per depth (each about 0.1 s), the
ratio of a depth-1 cycle to a plain one moved much more between
calibrations. Eight calibrations of each kind in one process on this 2-core
VM (2026-12-06, built-in model, 5 rounds each):

| Batch | Separate decodes | Bursts |
|---|---|---|
| 4 | 1.355-1.641 (median 1.59) | 1.403-1.551 (median 1.51) |
| 1 (six of each) | 1.129-1.383 | 1.183-1.223 |

The bench's fixed-depth runs at batch 4 put the ratio at 1.42-1.5
(measured decode speed-ups near the bare passes' prediction, whose ratio
was 1.47).

A depth-0 cycle of a runtime built for deeper cycles costs what a plain
runtime's does (1.006x, median of 20 paired decodes at batch 4): a
one-token verify keeps nothing pending for the head.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from mtplx.decode.depth import ScriptedDepths
from mtplx.decode.runtime import BatchRuntime
from mtplx.decode.sampling import SamplingParams

BURST = 4  # cycles per burst; a burst's first cycle is not timed (below)
REPEATS = 2  # bursts of each depth per round


def play(
    runtime: BatchRuntime, prompts: List[List[int]], depths: Sequence[int], sampling: SamplingParams
) -> List[float]:
    """Decode `prompts` through the cycles `depths` on a runtime built for the
    deepest of them, whatever its rows sample (calibration throws their
    tokens away): the time from each cycle's launch to the next (one fewer
    than the cycles)."""
    runtime.policy = ScriptedDepths(depths, max_depth=runtime.depth)
    runtime.launch_started.clear()
    eos, runtime.eos = runtime.eos, set()  # a random prompt's end of sequence would end its row early
    try:
        runtime.generate(prompts, sampling=sampling, max_tokens=tokens_bound(depths))
    finally:
        runtime.eos = eos
    return list(np.diff(list(runtime.launch_started)))


def burst_sequence(
    depths: Sequence[int], burst: int = BURST, repeats: int = REPEATS, reverse: bool = False
) -> List[int]:
    """Plain bursts around a burst of every other depth, `repeats` times
    (0 1 0 2 0 3 0 1 0 2 0 3 0, each `burst` cycles long; deepest first when
    `reverse`, so that no depth always comes late in a round)."""
    others = sorted((k for k in set(depths) if k > 0), reverse=reverse)
    seq: List[int] = []
    for _ in range(repeats):
        for k in others:
            seq += [0] * burst + [k] * burst
    return seq + [0] * (burst + 1)  # one more: the last launch has no next one to time it by


def tokens_bound(depths: Sequence[int]) -> int:
    """The `max_tokens` a play of these cycles asks for: the most tokens a
    row can gain over them (k + 1 each), plus the prefill's first token and
    one to spare, so that no row ends before the last cycle."""
    return sum(k + 1 for k in depths) + 2


def burst_times(played: Sequence[int], intervals: Sequence[float]) -> Tuple[float, Dict[int, float]]:
    """(a plain cycle's median time, {depth: its cycle over a plain one}) from
    one `play`: each burst of depth k against the mean of the plain bursts
    on either side, the median over its bursts.

    The interval after launch i counts for its depth only when cycle i - 1
    ran that depth too. A burst's first cycle also catches the head up over
    the pairs the bursts before it left, or follows one that did; and the
    interval after a launch is that cycle's on the CPU backend (a launch
    returns when its compute is nearly done) but the previous one's on a GPU
    (the host waits for it at the next launch): either way a cycle of the
    burst's depth."""
    bursts: List[Tuple[int, List[float]]] = []
    for i, k in enumerate(played):
        if i == 0 or played[i - 1] != k:
            bursts.append((k, []))
        elif i < len(intervals):
            bursts[-1][1].append(intervals[i])
    medians = [(k, float(np.median(ts)) if ts else float("nan")) for k, ts in bursts]
    plain = [t for k, ts in bursts if k == 0 for t in ts]
    ratios: Dict[int, List[float]] = {}
    for j in range(1, len(medians) - 1):
        k, t = medians[j]
        if k > 0 and medians[j - 1][0] == 0 and medians[j + 1][0] == 0:
            around = (medians[j - 1][1] + medians[j + 1][1]) / 2
            if np.isfinite(t) and np.isfinite(around):
                ratios.setdefault(k, []).append(t / around)
    t0 = float(np.median(plain)) if plain else float("nan")
    return t0, {k: float(np.median(rs)) for k, rs in ratios.items()}
