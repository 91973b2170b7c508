"""Model families and the error of a checkpoint that cannot be loaded. mlx-lm builds the trunk; a family
adapter (`mtplx/models/families/`) knows the MTP head's keys, which hidden state it reads, and how to run a
trunk layer so that its state can be rolled back per row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the problem."""


@dataclass
class FamilyAdapter:
    """One model family; the functions take the loaded mlx-lm trunk (and the raw config dict)."""

    name: str
    model_types: tuple
    text_model: Callable[[nn.Module], nn.Module]  # -> the inner model: .embed_tokens, .layers, .norm
    lm_head: Callable[[nn.Module], Callable[[mx.array], mx.array]]  # -> post-norm hidden -> logits
    hidden_after_norm: bool  # the head reads the trunk state after its final norm
    is_mtp_key: Callable[[str, dict], bool]  # raw checkpoint keys of the MTP head
    build_head: Callable[..., nn.Module]  # (trunk, config, mtp tensors, shard shapes) -> loaded head
    num_mtp_layers: Callable[[dict], int]  # MTP layers the config declares
    model_classes: Optional[Callable] = None  # mlx-lm model classes (to drop MTP keys mlx-lm keeps)
    run_layer: Optional[Callable] = None  # runs a trunk layer with a rollback-capable cache
    layer_kinds: Optional[Callable] = None  # -> per trunk layer "attn" or "linear" (gated delta)
    hf_layout: Optional[Callable] = None  # (trunk, {shard key: shape}) -> tensors in HF layout?
    notes: Dict[str, str] = field(default_factory=dict)
