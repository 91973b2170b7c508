"""Depth policies: what the runtime asks, before each cycle, for its depth.

A policy is any object with these members (the runtime calls nothing else):

- `max_depth`: the deepest cycle it may ask for (the batch is built for it).
- `choose(sampled_residual, draining) -> int | None`: the next cycle's depth,
  or None to stop decoding (running rows are dropped). `sampled_residual`:
  some row samples under the residual rule, whose draws depend on the depth;
  `draining()`: nothing is left to refill the batch (a call: it may read ahead).
- `launched(depth, t, clean)`, `observe(accepted, drafted)`: each cycle's
  launch time and, once read, its live rows' accepted and drafted counts.
- `warm_up_depths()`: the depths to trace before the first real cycle.
- `prefills_head()`: whether prompts go through the head.
- `record`: a dict shown as `stats["auto_depth"]`, or None.
- `finished()`: the decode ran to its end.

Depth "auto"'s adaptive policy is `mtplx.autodepth.policy.AutoDepth`.
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
    """Plays a sequence of depths, then stops the decode (calibration bursts,
    warm-up). `sampled_depth`: when given, cycles with a row sampling under
    the residual rule run at it without advancing the script."""

    def __init__(self, depths: Sequence[int], sampled_depth: Optional[int] = None, max_depth: Optional[int] = None):
        depths = list(depths)
        super().__init__(max_depth if max_depth is not None else max(depths, default=0))
        self._depths: Iterator[int] = iter(depths)
        self.sampled_depth = sampled_depth

    def choose(self, sampled_residual: bool, draining: Callable[[], bool]) -> Optional[int]:
        if sampled_residual and self.sampled_depth is not None:
            return self.sampled_depth
        return next(self._depths, None)
