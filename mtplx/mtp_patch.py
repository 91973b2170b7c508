"""The MTP contract and the per-family adapters that attach a head to a trunk.

mlx-lm builds the trunk. Each family adapter (in `mtplx/families/`) knows:
- which checkpoint keys hold the MTP head and how to turn them into the
  head module's parameters (the same transforms the trunk's sanitize applies);
- which hidden state the head consumes (before or after the final norm);
- how to run a trunk layer so that its state can be rolled back per row.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable, Dict, Literal, Optional, Union

import mlx.core as mx
import mlx.nn as nn

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


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the problem."""


@dataclass
class FamilyAdapter:
    """What MTPLX needs to know about one model family.

    The functions take the loaded mlx-lm trunk (and the raw config dict) so
    that adapters stay plain data plus functions.
    """

    name: str
    model_types: tuple
    # -> the inner text model: has .embed_tokens, .layers, .norm
    text_model: Callable[[nn.Module], nn.Module]
    # -> the trunk's output projection (post-norm hidden -> logits)
    lm_head: Callable[[nn.Module], Callable[[mx.array], mx.array]]
    # True when the head consumes the trunk state after its final norm
    hidden_after_norm: bool
    # keys of the raw checkpoint that belong to the MTP head
    is_mtp_key: Callable[[str, dict], bool]
    # (trunk, config, raw mtp tensors, all shard keys) -> head module with weights loaded
    build_head: Callable[..., nn.Module]
    # number of MTP layers declared by the config
    num_mtp_layers: Callable[[dict], int]
    # optional: mlx-lm model class override (to drop MTP keys mlx-lm does not)
    model_classes: Optional[Callable] = None
    # optional: run one trunk layer with a rollback-capable cache
    run_layer: Optional[Callable] = None
    # -> per trunk layer "attn" or "linear" (gated delta)
    layer_kinds: Optional[Callable] = None
    # (trunk, {shard key: shape}) -> True when the tensors are in HF layout
    hf_layout: Optional[Callable] = None
    notes: Dict[str, str] = field(default_factory=dict)


_FAMILIES: Dict[str, FamilyAdapter] = {}


def register(adapter: FamilyAdapter) -> FamilyAdapter:
    for mt in adapter.model_types:
        _FAMILIES[mt] = adapter
    return adapter


def supported_model_types() -> list:
    _import_families()
    return sorted(_FAMILIES)


def family_for(config: dict) -> FamilyAdapter:
    _import_families()
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; MTPLX supports: "
            + ", ".join(sorted(_FAMILIES))
        )
    return _FAMILIES[model_type]


def _import_families():
    # Importing a family module registers its adapter.
    from .families import deepseek, mimo, qwen  # noqa: F401
