"""Write a trained TinyMTP in the Qwen3.5 Hugging Face release layout, undoing mlx-lm's qwen3_5 sanitize
exactly, so `mtplx.load` and `mlx_lm.load` read it as a downloaded release: conv1d [C, K, 1] -> [C, 1, K];
the Qwen3NextRMSNorm weights zero-centred (applied as 1 + w; the gated-delta linear_attn.norm is plain);
the text model under `model.language_model.`, the head under `mtp.`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten

from mtplx.testing import write_shards
from mtplx.training.model import TinyMTP

_ZERO_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_HEAD_ZERO_CENTRED = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


def _to_hf(name: str, v: mx.array) -> mx.array:
    if name.endswith("conv1d.weight"):
        return v.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
    if name.endswith(_ZERO_CENTRED):
        return v - 1.0
    return v


def hf_tensors(model: TinyMTP, dtype=mx.float32) -> Dict[str, mx.array]:
    out = {}
    for name, v in tree_flatten(model.trunk.parameters()):
        hf = name.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
        v = _to_hf(hf, v)
        if hf == "model.language_model.norm.weight":
            v = v - 1.0
        out[hf] = v
    for name, v in tree_flatten(model.head.parameters()):
        v = _to_hf(name, v)
        if name in _HEAD_ZERO_CENTRED:
            v = v - 1.0
        out["mtp." + name] = v
    # A_log stays float32, as mlx-lm's cast predicate keeps it.
    return {k: (v if k.endswith("A_log") else v.astype(dtype)) for k, v in out.items()}


def export_checkpoint(model: TinyMTP, config: dict, out_dir: Path, dtype=mx.float32) -> Dict[str, int]:
    """config.json, one safetensors shard and its index (not the tokenizer); returns {tensors, bytes}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model, dtype)
    mx.eval(tensors)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_shards(out_dir, tensors, num_shards=1)
    return {"tensors": len(tensors), "bytes": sum(v.nbytes for v in tensors.values())}
