"""Depth policies: what the runtime asks, before each cycle, for that cycle's
speculation depth.

A policy is any object with these members (the runtime calls nothing else):

- `max_depth`: the deepest cycle it may ask for; the runtime builds its
  batch, draft chain and verify for it.
- `choose(sampled_residual, draining) -> int | None`: the next cycle's depth,
  or None to stop decoding (rows still running are dropped).
  `sampled_residual`: some row samples under the residual rule, whose draws
  depend on the depth; `draining()`: whether nothing is left to refill the
  batch (a call, because answering may read a request ahead).
- `launched(depth, t, clean)`, `observe(accepted, drafted)`: each cycle's
  launch time and, once read, its rows' accepted and drafted counts.
- `warm_up_depths()`: the depths to trace before the first real cycle.
- `prefills_head()`: whether prompts should be prefilled through the head.
- `record`: a dict shown as `stats["auto_depth"]`, or None.
- `finished()`: the decode ran to its end.

`FixedDepth` and `ScriptedDepths` live here; the adaptive policy of depth
"auto" is `mtplx.autodepth.policy.AutoDepth`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence


class FixedDepth:
    """Every cycle at one depth."""

    record = None

    def __init__(self, depth: int):
        self.max_depth = int(depth)

    def choose(self, sampled_residual: bool, draining: Callable[[], bool]) -> int:
        return self.max_depth

    def launched(self, depth: int, t: float, clean: bool) -> None:
        pass

    def observe(self, accepted, drafted) -> None:
        pass

    def warm_up_depths(self) -> Sequence[int]:
        return ()

    def prefills_head(self) -> bool:
        return self.max_depth > 0

    def finished(self) -> None:
        pass


class ScriptedDepths(FixedDepth):
    """Plays a given sequence of depths, then stops the decode: how calibration
    times bursts of each depth and how warm-up traces every depth.
    `sampled_depth`: when given, cycles with a row sampling under the residual
    rule run at it (and do not advance the script), as the job will run them."""

    def __init__(self, depths: Sequence[int], sampled_depth: Optional[int] = None, max_depth: Optional[int] = None):
        depths = list(depths)
        super().__init__(max_depth if max_depth is not None else max(depths, default=0))
        self._depths: Iterator[int] = iter(depths)
        self.sampled_depth = sampled_depth

    def choose(self, sampled_residual: bool, draining: Callable[[], bool]) -> Optional[int]:
        if sampled_residual and self.sampled_depth is not None:
            return self.sampled_depth
        return next(self._depths, None)
