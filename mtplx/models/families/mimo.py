"""MiMo: Qwen2-style trunk, `model.mtp_layers.N.*` head (as vLLM's mimo_mtp.py, mimo.py).

x = input_proj([hidden_layernorm(h_t); token_layernorm(embed(x_{t+1}))]) (hidden first), h_t before the
trunk's final norm, then a Qwen2 decoder layer, fed back for depth > 1 (vLLM drafts depth 1 only), and
`final_layernorm` and the trunk's lm_head. The embedding is zeroed at position 0, as for DeepSeek.
"""

from __future__ import annotations

import re
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from mtplx.models.adapter import CheckpointError, FamilyAdapter
from mtplx.models.families.common import (
    bind_shared,
    decoder_block,
    load_head_weights,
    maybe_quantize_head,
    sanitize_as_trunk_layer,
)
from mtplx.models.families.deepseek import zero_embedding_at_position0

_OWN = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")
_PREFIX = "model.mtp_layers."


class MiMoMTPLayer(nn.Module):
    def __init__(self, args, layer_cls):
        super().__init__()
        H = args.hidden_size
        self.token_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.hidden_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.mtp_block = layer_cls(args)
        self.final_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)


class MiMoMTPHead(nn.Module):
    def __init__(self, args, layer_cls, num_layers: int):
        super().__init__()
        self.layers = [MiMoMTPLayer(args, layer_cls) for _ in range(num_layers)]

    def __call__(self, hidden, next_tokens, cache=None, depth: int = 1, at=None):
        # hidden [B, T, H] (pre-norm), next_tokens [B, T] -> logits [B, T, V], out [B, T, H] (T = 1 given `at`)
        j = (depth - 1) % len(self.layers)
        layer = self.layers[j]
        c = None if cache is None else cache[j]
        e = zero_embedding_at_position0(self.embed(next_tokens), c)
        x = layer.input_proj(mx.concatenate([layer.hidden_layernorm(hidden), layer.token_layernorm(e)], axis=-1))
        mask = create_attention_mask(x, c, return_array=True)
        x = decoder_block(layer.mtp_block, x, mask, c, at)  # [B, T, H]: fed back for depth > 1
        return self.lm_head(layer.final_layernorm(x)), x


def _text_model(trunk):
    return trunk.model


def _lm_head(trunk):
    if trunk.args.tie_word_embeddings:
        return lambda x: trunk.model.embed_tokens.as_linear(x)
    return lambda x: trunk.lm_head(x)


def _num_mtp_layers(config: dict) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def _is_mtp_key(key: str, config: dict) -> bool:
    return key.startswith(_PREFIX)


def _layer_ids(tensors, pattern: str):
    return sorted({int(m.group(1)) for k in tensors for m in [re.match(pattern, k)] if m})


def _build_head(trunk, config, tensors: Dict[str, mx.array], shard_shapes, quantization=None, mlx_layout=False):
    args = trunk.args
    inner = _text_model(trunk)
    pattern = r"mtp\.layers\.(\d+)\." if mlx_layout else r"model\.mtp_layers\.(\d+)\."
    ids = _layer_ids(tensors, pattern)
    n = len(ids)
    if n == 0 or ids != list(range(n)):
        raise CheckpointError(f"MTP layers must be numbered 0..N-1, found {ids}")
    if not mlx_layout and n != _num_mtp_layers(config):
        raise CheckpointError(
            f"checkpoint holds {n} MTP layer(s) but config.json declares "
            f"num_nextn_predict_layers={_num_mtp_layers(config)}"
        )
    head = MiMoMTPHead(args, type(inner.layers[0]), n)
    if mlx_layout:
        weights = {k[len("mtp.") :]: v for k, v in tensors.items()}
    else:
        weights = _hf_to_head(trunk, tensors, n)
    maybe_quantize_head(head, weights, quantization)
    load_head_weights(head, weights, "mimo MTP head (its layers.j is checkpoint model.mtp_layers.j)")
    bind_shared(head, embed=lambda t: inner.embed_tokens(t), lm_head=_lm_head(trunk))
    return head


def _hf_to_head(trunk, tensors, n: int) -> Dict[str, mx.array]:
    weights = {}
    for j in range(n):
        src = f"{_PREFIX}{j}."
        layer = {k: v for k, v in tensors.items() if k.startswith(src)}
        # MiMo's sanitize has no per-layer transform yet; going through it keeps the head in step with one.
        for suffix, v in sanitize_as_trunk_layer(trunk, layer, src, "model.layers.0.", "").items():
            inner = "" if suffix.startswith(_OWN) else "mtp_block."
            weights[f"layers.{j}.{inner}{suffix}"] = v
    return weights


MIMO = FamilyAdapter(
    name="mimo",
    model_types=("mimo",),
    text_model=_text_model,
    lm_head=_lm_head,
    hidden_after_norm=False,
    is_mtp_key=_is_mtp_key,
    build_head=_build_head,
    num_mtp_layers=_num_mtp_layers,
    notes={"reference": "vLLM mimo_mtp.py, mimo.py"},
)
