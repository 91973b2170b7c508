"""MTPContract: how the runtime speculates."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal, Optional, Union

Depth = Union[int, Literal["auto"]]

# The deepest speculation: a verify spans depth + 1 positions per row, and
# passes over 16 or more are prompt passes, which on the CPU take other
# numerics (`mtplx.cpu_activations.FAST_MIN_POSITIONS`); a verify must run
# a decode step's ops exactly.
MAX_DEPTH = 14


@dataclass(frozen=True)
class MTPContract:
    """How the runtime speculates.

    depth: draft tokens per cycle (0 = plain decoding, at most MAX_DEPTH),
        or "auto" to pick it from a cost model calibrated on this machine.
    acceptance: "residual" (highest acceptance) or "coupled" (output equals
        plain keyed sampling bit for bit, whatever the depth).
    prefill_chunk: prompt tokens per row per prefill forward.
    prefill_batch_tokens: prompts are prefilled together, right-padded, until
        rows x longest prompt reaches this; with prefill_chunk it bounds
        prefill memory.
    compile: run the decode passes as compiled MLX graphs (`mtplx.compiled`);
        False runs the same ops eagerly (same output, slower).
    shrink_batch: once no prompt is waiting, decode the rows still running
        in a batch their own size (the next power of two) rather than the
        full one; what each row outputs does not change.
    sampled_depth: with depth "auto", the depth of every cycle in which a
        row samples under the residual rule, given instead of calibrated:
        a resumed job passes the one its first run chose, so that all its
        sampled rows draw alike. None: calibration picks it.
    """

    depth: Depth = 1
    acceptance: Literal["residual", "coupled"] = "residual"
    prefill_chunk: int = 512
    prefill_batch_tokens: int = 4096
    max_depth_auto: int = 3
    compile: bool = True
    shrink_batch: bool = True
    sampled_depth: Optional[int] = None

    def __post_init__(self):
        if self.depth != "auto" and not _int_in(self.depth, 0, MAX_DEPTH):
            raise ValueError(f"depth must be an int in 0..{MAX_DEPTH} or 'auto', got {self.depth!r}")
        if not _int_in(self.max_depth_auto, 0, MAX_DEPTH):
            raise ValueError(f"max_depth_auto must be in 0..{MAX_DEPTH}, got {self.max_depth_auto!r}")
        if self.acceptance not in ("residual", "coupled"):
            raise ValueError(f"acceptance must be 'residual' or 'coupled', got {self.acceptance!r}")
        if self.prefill_chunk < 1 or self.prefill_batch_tokens < 1:
            raise ValueError("prefill_chunk and prefill_batch_tokens must be >= 1")
        if self.sampled_depth is not None:
            if self.depth != "auto":
                raise ValueError("sampled_depth is for depth 'auto' (a fixed depth is every row's depth)")
            if not _int_in(self.sampled_depth, 0, self.max_depth_auto):
                raise ValueError(f"sampled_depth must be in 0..{self.max_depth_auto}, got {self.sampled_depth!r}")


def _int_in(v, lo: int, hi: int) -> bool:
    # bool is an int subclass, but depth=True is a mistake, not depth 1.
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and lo <= v <= hi
