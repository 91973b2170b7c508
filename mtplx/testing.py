"""Tiny random checkpoints written in the exact Hugging Face release layouts.

Tests, benchmarks and dry runs need real checkpoints without a hub. Each
family writes `config.json` with the real field names, tensors under their
real names and shapes (sharded, with `model.safetensors.index.json`), and a
working tokenizer, so that `mlx_lm.load` and `mtplx.load` both open it through
exactly the code path of a downloaded release.

The tensors are made by building the mlx-lm model (and MTPLX's head) at random
and undoing the trunk's sanitize: the inverse transforms are the test of the
forward ones.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable, Dict

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .tokenizer_files import write_char_tokenizer

FAMILIES: Dict[str, Callable] = {}


def tiny_checkpoint(family: str, path, *, seed: int = 0, num_shards: int = 2, **config_overrides) -> Path:
    """Write a random tiny checkpoint of `family` at `path`; returns the path.

    `config_overrides` replace fields of the (text) config, e.g. vocab_size=32,
    num_hidden_layers=3, mtp_num_hidden_layers=0 (no head).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    config, tensors = FAMILIES[family](dict(config_overrides))
    tensors = {k: v.astype(mx.float32) if v.dtype in (mx.float16, mx.bfloat16) else v for k, v in tensors.items()}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_shards(path, tensors, num_shards)
    tc = config.get("text_config", config)
    write_char_tokenizer(path, tc["vocab_size"])
    return path


def write_shards(path: Path, tensors: Dict[str, mx.array], num_shards: int) -> None:
    names = sorted(tensors)
    num_shards = max(1, min(num_shards, len(names)))
    per = (len(names) + num_shards - 1) // num_shards
    weight_map = {}
    total = 0
    for i in range(num_shards):
        part = names[i * per : (i + 1) * per]
        if not part:
            continue
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), {k: tensors[k] for k in part}, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
        total += sum(tensors[k].nbytes for k in part)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def _randomize_norms(module: nn.Module) -> None:
    # Norm weights of 1 would hide a missing zero-centre shift; make them distinct.
    updates = []
    for name, p in tree_flatten(module.parameters()):
        if name.endswith("norm.weight") and p.ndim == 1:
            updates.append((name, 1.0 + 0.2 * mx.random.normal(p.shape)))
    module.load_weights(updates, strict=False)


def _family(name):
    def wrap(fn):
        FAMILIES[name] = fn
        return fn

    return wrap


# -- Qwen3.5 / Qwen3.5-MoE / Qwen3-Next ----------------------------------------

_QWEN_SHIFTED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "norm.weight", ".q_norm.weight", ".k_norm.weight")


def _qwen_text_config(model_type: str, moe: bool, o: dict) -> dict:
    tc = {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 64,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mtp_num_hidden_layers": 1,
        "eos_token_id": 0,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
        },
    }
    if moe:
        tc.update(
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[],
        )
    tc.update(o)
    n, every = tc["num_hidden_layers"], tc["full_attention_interval"]
    tc["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    return tc


def _qwen_layer_to_hf(name: str, v: mx.array, fused_experts: bool) -> Dict[str, mx.array]:
    """Undo the trunk sanitize for one parameter of a decoder layer."""
    if "conv1d.weight" in name:
        return {name: v.moveaxis(2, 1)}  # MLX [C, K, 1] -> HF [C, 1, K]
    if name.endswith(_QWEN_SHIFTED) and v.ndim == 1:
        return {name: v - 1.0}  # HF stores zero-centred norms
    if ".switch_mlp." in name:
        prefix, rest = name.split(".switch_mlp.")
        proj = rest.split(".")[0]
        if fused_experts:
            # Qwen3.5-MoE stores gate and up fused: experts.gate_up_proj [E, 2I, H]
            if proj == "down_proj":
                return {f"{prefix}.experts.down_proj": v}
            return {f"{prefix}.experts.{proj}": v}  # joined below
        return {f"{prefix}.experts.{e}.{proj}.weight": v[e] for e in range(v.shape[0])}
    return {name: v}


def _fuse_gate_up(tensors: Dict[str, mx.array]) -> Dict[str, mx.array]:
    out = {}
    for k, v in tensors.items():
        if k.endswith(".experts.gate_proj"):
            up = tensors[k.replace("gate_proj", "up_proj")]
            out[k.replace("gate_proj", "gate_up_proj")] = mx.concatenate([v, up], axis=-2)
        elif not k.endswith(".experts.up_proj"):
            out[k] = v
    return out


def _qwen_checkpoint(model_type: str, text_type: str, moe: bool, nested: bool):
    def build(o: dict):
        from mlx_lm.utils import _get_classes

        from .families.qwen import QwenMTPHead

        tc = _qwen_text_config(text_type, moe, o)
        if nested:
            arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
            config = {"architectures": [arch], "model_type": model_type, "text_config": tc,
                      "tie_word_embeddings": tc["tie_word_embeddings"], "eos_token_id": tc["eos_token_id"]}
        else:
            config = dict(tc, model_type=model_type, architectures=["Qwen3NextForCausalLM"])
            config.setdefault("partial_rotary_factor", 0.25)
            config.setdefault("rope_theta", 10000.0)
        model_cls, args_cls = _get_classes(copy.deepcopy(config))
        trunk = model_cls(args_cls.from_dict(copy.deepcopy(config)))
        _randomize_norms(trunk)
        fused = nested and moe
        tensors = {}
        for name, v in tree_flatten(trunk.parameters()):
            if nested:
                name = name.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
            tensors.update(_qwen_layer_to_hf(name, v, fused))
        n_mtp = tc["mtp_num_hidden_layers"]
        if n_mtp:
            inner = trunk.language_model.model if nested else trunk.model
            args = trunk.language_model.args if nested else trunk.args
            ref = args.full_attention_interval - 1
            head = QwenMTPHead(args, type(inner.layers[ref]), ref, n_mtp)
            _randomize_norms(head)
            for name, v in tree_flatten(head.parameters()):
                tensors.update(_qwen_layer_to_hf("mtp." + name, v, fused))
        if fused:
            tensors = _fuse_gate_up(tensors)
        return config, tensors

    return build


FAMILIES["qwen3_5"] = _qwen_checkpoint("qwen3_5", "qwen3_5_text", moe=False, nested=True)
FAMILIES["qwen3_5_moe"] = _qwen_checkpoint("qwen3_5_moe", "qwen3_5_moe_text", moe=True, nested=True)
FAMILIES["qwen3_next"] = _qwen_checkpoint("qwen3_next", "qwen3_next", moe=True, nested=False)
