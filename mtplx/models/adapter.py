"""What MTPLX needs to know about one model family, and the error a checkpoint
that cannot be loaded raises.

mlx-lm builds the trunk. Each family adapter (`mtplx/models/families/`) knows:
- which checkpoint keys hold the MTP head and how to turn them into the
  head module's parameters (the same transforms the trunk's sanitize applies);
- which hidden state the head consumes (before or after the final norm);
- how to run a trunk layer so that its state can be rolled back per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn


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
