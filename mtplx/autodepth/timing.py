"""What the job's own cycles say each depth costs: a correction to calibration's `costs.CycleCosts`, which
its few seconds on a noisy machine can misprice by enough to decide whether speculation pays.

Each launch-to-launch interval samples its cycle's depth; consecutive cycles at one depth form a run. At
each change of depth the new run's first samples are compared with the previous run's last (a log ratio
over the calibrated one): a pair a few cycles apart, which a slow spell hits alike; the median of recent
pairs corrects the two depths' calibrated ratio. An interval counts only when `clean` (nothing but the
cycle happened) and the cycle before it ran the same depth (on the CPU backend the interval after a
launch is that cycle's, on a GPU the previous one's)."""

from __future__ import annotations

import math
from collections import deque
from typing import Dict, List, Optional, Tuple

import numpy as np

from mtplx.autodepth.costs import CycleCosts

PAIR_SAMPLES = 4  # samples from each side of a depth change that make a pair: those closest to it
PAIR_WINDOW = 16  # pairs kept per two depths: a few hundred cycles back, so a correction follows the machine
MIN_PAIRS = 4  # pairs two depths need before their measured ratio replaces calibration's


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
        # The current run's samples, log(seconds / calibrated): its first and last `pair_samples`.
        self._run_first: List[float] = []
        self._run_last: deque = deque(maxlen=pair_samples)
        self._run_before: Optional[Tuple[int, List[float]]] = None  # depth, last samples
        self._corrected: Optional[CycleCosts] = None  # cached until a pair comes in

    def launched(self, depth: int, t: float, clean: bool) -> None:
        """A cycle at `depth` launched at `t` (seconds); `clean`: nothing but the previous cycle since."""
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
        """The measured pairs (count, median log ratio) and the costs predicted from them."""
        return {
            "pairs": {f"{lo}-{hi}": [len(v), float(np.median(v))] for (lo, hi), v in sorted(self.pairs.items())},
            "cycle_s": {str(k): v for k, v in self.costs().seconds.items()},
        }

    def pair_count(self, a: int, b: int) -> int:
        return len(self.pairs.get(tuple(sorted((a, b))), ()))

    def costs(self) -> CycleCosts:
        """Calibrated costs, each depth's ratio corrected where measured (`MIN_PAIRS` pairs, linked to the
        depth run last); other depths above 0 take the linked ones' mean correction (the overhead every
        speculating cycle shares), depth 0 its calibrated ratio."""
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
