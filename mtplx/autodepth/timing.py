"""What the job's own cycles say each depth costs, as a correction to the
calibrated cycle costs (`costs.CycleCosts`).

Calibration prices a cycle at each depth in a few seconds on a machine whose
speed moves by several percent from one second to the next: on a 2-core VM
its overhead factor (runtime cycle over bare passes) came out anywhere in
0.89-1.16 over a dozen calibrations at batch 1-16, enough to call a 5-15%
gain of depth 1 over plain decoding at batch 4 either way. A job that runs thousands of cycles can measure better,
as long as it compares depths over the same spells of the machine.

So the time from one cycle's launch to the next is taken as a sample of that
cycle's depth, and consecutive cycles at one depth form a run. Whenever the
depth changes, the new run's first samples are compared with the last
samples of the run before it, as a log ratio over the calibrated one: a
pair measured a few cycles apart, which a slow spell hits alike. The median of
the recent pairs between two depths corrects their calibrated ratio.

An interval counts only when
- nothing but the cycle happened in it (no prefill, no rows loaded or
  finished, no batch shrink: the runtime says so with `clean`), and
- the cycle before it ran the same depth. On the CPU backend a launch
  returns when its compute is nearly done, so the interval after a launch
  is that cycle's; on a GPU it is the previous cycle's, whose compute the
  host waits for. Both are the run's depth then.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Dict, List, Optional, Tuple

import numpy as np

from mtplx.autodepth.costs import CycleCosts

# Samples from each side of a depth change that make one pair: the ones
# closest in time to the change.
PAIR_SAMPLES = 4
# Pairs kept per two depths: a few hundred cycles back when depths are
# explored every few dozen cycles, so a correction follows the machine.
PAIR_WINDOW = 16
# Pairs two depths need before their measured ratio replaces calibration's.
MIN_PAIRS = 4


class CycleTimes:
    """Cycle times by depth from the runtime's launches -> corrected costs."""

    def __init__(
        self,
        calibrated: CycleCosts,
        pair_samples: int = PAIR_SAMPLES,
        window: int = PAIR_WINDOW,
        min_pairs: int = MIN_PAIRS,
    ):
        self.calibrated = calibrated
        self.pair_samples, self.window, self.min_pairs = pair_samples, window, min_pairs
        self.pairs: Dict[Tuple[int, int], deque] = {}  # (lo, hi) -> log(hi/lo) over calibrated
        self._last: Optional[Tuple[int, float]] = None  # the previous launch's depth and time
        self._depth_before_last: Optional[int] = None
        # The current run's samples, log(seconds / calibrated): its first and
        # its last `pair_samples`, all a pair uses (a run may last a whole job).
        self._run_first: List[float] = []
        self._run_last: deque = deque(maxlen=pair_samples)
        self._run_before: Optional[Tuple[int, List[float]]] = None  # depth, last samples
        self._corrected: Optional[CycleCosts] = None  # cached until a pair comes in

    def launched(self, depth: int, t: float, clean: bool) -> None:
        """A cycle at `depth` was launched at time `t` (seconds); `clean`:
        nothing but the previous cycle happened since the previous launch."""
        if self._last is not None:
            last_depth, last_t = self._last
            if clean and self._depth_before_last == last_depth and t > last_t:
                sample = math.log((t - last_t) / self.calibrated.cycle_s(last_depth))
                if len(self._run_first) < self.pair_samples:
                    self._run_first.append(sample)
                self._run_last.append(sample)
            if depth != last_depth:
                self._close_run(last_depth)
        self._depth_before_last = self._last[0] if self._last is not None else None
        self._last = (depth, t)

    def _close_run(self, depth: int) -> None:
        first, last = self._run_first, list(self._run_last)
        self._run_first, self._run_last = [], deque(maxlen=self.pair_samples)
        before = self._run_before
        if first and before is not None and before[0] != depth:
            lo, hi = sorted((before[0], depth))
            # log(measured / calibrated) of this run over the one before it
            diff = float(np.median(first) - np.median(before[1]))
            self.pairs.setdefault((lo, hi), deque(maxlen=self.window)).append(diff if depth == hi else -diff)
            self._corrected = None
        # A run without a sample leaves nothing to compare the next one with.
        self._run_before = (depth, last) if last else None

    def as_dict(self) -> dict:
        """The measured pairs (count, median log ratio over calibrated) and
        the costs predicted from them, for the job summary."""
        return {
            "pairs": {f"{lo}-{hi}": [len(v), float(np.median(v))] for (lo, hi), v in sorted(self.pairs.items())},
            "cycle_s": {str(k): v for k, v in self.costs().seconds.items()},
        }

    def pair_count(self, a: int, b: int) -> int:
        return len(self.pairs.get(tuple(sorted((a, b))), ()))

    def costs(self) -> CycleCosts:
        """Calibrated costs, with the ratio between depths corrected wherever
        the job has measured it (`MIN_PAIRS` pairs). Depths linked by measured
        pairs to the one run last take their measured ratios to it; any other
        depth above 0 takes the mean correction of the linked depths above 0,
        since what calibration misprices most is the overhead every
        speculating cycle shares; depth 0, unlinked, keeps its calibrated ratio."""
        if self._corrected is None:
            self._corrected = self._correct()
        return self._corrected

    def _correct(self) -> CycleCosts:
        cal = self.calibrated
        if self._last is None:
            return cal
        x = self._linked_corrections(self._last[0])
        spec = [v for k, v in x.items() if k > 0]
        shared = float(np.mean(spec)) if spec else 0.0
        seconds = {}
        for k, s in cal.seconds.items():
            seconds[k] = s * math.exp(x.get(k, shared if k > 0 else 0.0))
        return CycleCosts(cal.batch_size, seconds, cal.overhead)

    def _linked_corrections(self, root: int) -> Dict[int, float]:
        """log(measured / calibrated) of every depth linked to `root` by
        measured pairs, relative to root's (a walk over the pairs)."""
        medians = {key: float(np.median(v)) for key, v in self.pairs.items() if len(v) >= self.min_pairs}
        x, todo = {root: 0.0}, [root]
        while todo:
            a = todo.pop()
            for (lo, hi), m in medians.items():
                if a == lo and hi not in x:
                    x[hi] = x[a] + m
                    todo.append(hi)
                elif a == hi and lo not in x:
                    x[lo] = x[a] - m
                    todo.append(lo)
        return x
