"""MTPContract: how the runtime speculates."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal, Optional, Union

Depth = Union[int, Literal["auto"]]

# A verify spans depth + 1 positions and must run a decode step's ops; from 16
# on, the CPU takes prompt-pass numerics (`backends.cpu.activations.FAST_MIN_POSITIONS`).
MAX_DEPTH = 14


@dataclass(frozen=True)
class MTPContract:
    """How the runtime speculates.

    depth: draft tokens per cycle (0 = plain decoding, at most MAX_DEPTH),
        or "auto" to pick it from a cost model calibrated where it runs.
    acceptance: "residual" (highest acceptance) or "coupled" (output equals
        plain keyed sampling bit for bit, whatever the depth).
    prefill_chunk: prompt tokens per row per prefill forward.
    prefill_batch_tokens: prompts are prefilled together until rows x
        longest prompt reaches this (with prefill_chunk, bounds its memory).
    compile: run decode passes as compiled MLX graphs (`decode.passes`);
        False runs the same ops eagerly.
    shrink_batch: once no prompt waits, decode the remaining rows in a batch
        of the next power of two; outputs do not change.
    draft_vocab: the head scores only this many ids (`models.draft_vocab`:
        the output layer's first rows, the tokenizer's merge order, plus the
        end-of-sequence ids), cutting the output layer's share of each draft.
        Exact under both rules; acceptance falls by the target's mass outside
        the set. 0: the whole vocabulary.
    sampled_depth: with depth "auto", the depth of cycles where a row samples
        under the residual rule, instead of calibrating it (a resumed job
        passes its first run's). None: calibration picks it.
    share_prefix_min: prompts sharing a prefix of at least this many tokens
        prefill it once (docs/design.md, "Shared prefixes"); 0 turns sharing
        off. Outputs do not change.
    prefix_cache_bytes: bound of the LRU cache of shared prefix states;
        None: `decode.prefix.DEFAULT_PREFIX_CACHE_BYTES` (1 GiB).
    """

    depth: Depth = 1
    acceptance: Literal["residual", "coupled"] = "residual"
    prefill_chunk: int = 512
    prefill_batch_tokens: int = 4096
    max_depth_auto: int = 3
    compile: bool = True
    shrink_batch: bool = True
    sampled_depth: Optional[int] = None
    draft_vocab: int = 0
    share_prefix_min: int = 64
    prefix_cache_bytes: Optional[int] = None

    def __post_init__(self):
        if self.depth != "auto" and not _int_in(self.depth, 0, MAX_DEPTH):
            raise ValueError(f"depth must be an int in 0..{MAX_DEPTH} or 'auto', got {self.depth!r}")
        if not _int_in(self.max_depth_auto, 0, MAX_DEPTH):
            raise ValueError(f"max_depth_auto must be in 0..{MAX_DEPTH}, got {self.max_depth_auto!r}")
        if self.acceptance not in ("residual", "coupled"):
            raise ValueError(f"acceptance must be 'residual' or 'coupled', got {self.acceptance!r}")
        if self.prefill_chunk < 1 or self.prefill_batch_tokens < 1:
            raise ValueError("prefill_chunk and prefill_batch_tokens must be >= 1")
        if not _int_in(self.draft_vocab, 0, 1 << 31):
            raise ValueError(f"draft_vocab must be an int >= 0 (0: the whole vocabulary), got {self.draft_vocab!r}")
        if not _int_in(self.share_prefix_min, 0, 1 << 62):
            raise ValueError(f"share_prefix_min must be an int >= 0 (0: no sharing), got {self.share_prefix_min!r}")
        if self.prefix_cache_bytes is not None and not _int_in(self.prefix_cache_bytes, 0, 1 << 62):
            raise ValueError(f"prefix_cache_bytes must be an int >= 0 or None, got {self.prefix_cache_bytes!r}")
        if self.sampled_depth is not None:
            if self.depth != "auto":
                raise ValueError("sampled_depth is for depth 'auto' (a fixed depth is every row's depth)")
            if not _int_in(self.sampled_depth, 0, self.max_depth_auto):
                raise ValueError(f"sampled_depth must be in 0..{self.max_depth_auto}, got {self.sampled_depth!r}")


def _int_in(v, lo: int, hi: int) -> bool:
    # bool is an int subclass, but depth=True is a mistake, not depth 1.
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and lo <= v <= hi
