"""Calibration's timed decodes: one `BatchRuntime`, driven by `ScriptedDepths`, whose cycles play a burst of
each depth between plain bursts, so that each depth is compared with plain cycles milliseconds away (a slow
spell hits both alike). A depth-0 cycle of a runtime built for deeper cycles costs what a plain one does."""

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
    """Decode `prompts` through the cycles `depths`, whatever its rows sample (their tokens are thrown
    away): the time from each cycle's launch to the next (one fewer than the cycles)."""
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
    """(a plain cycle's median time, {depth: its cycle over a plain one}) from one `play`: each burst of
    depth k against the mean of the plain bursts on either side, the median over its bursts. An interval
    counts only after a cycle of the same depth: a burst's first cycle catches the head up, and the
    interval after a launch is that cycle's on the CPU backend but the previous one's on a GPU."""
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
