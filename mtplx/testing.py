"""Tiny random checkpoints in the exact Hugging Face release layouts, for tests and dry runs without a hub:
real config fields, tensor names and shapes (sharded, with an index) and a working tokenizer, so that
`mlx_lm.load` and `mtplx.load` open them as a downloaded release. The tensors are the mlx-lm model (and MTPLX's
head) built at random with the trunk's sanitize undone: the inverse transforms test the forward ones.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Callable, Dict

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtplx.models.checkpoint import write_shards  # noqa: F401  (tests and training write shards too)
from mtplx.models.fp8 import fp8_block_size
from mtplx.models.tokenizer_files import write_char_tokenizer
from mtplx.models.widen import SHAPES, widen, widened_config  # noqa: F401  (a model of real size with a trained model's function)

FAMILIES: Dict[str, Callable] = {}

# Where greedy output may leave mlx-lm's greedy decoding: only at a near-tie of the reference, a top-2 logit gap
# small enough for the device's float differences to flip (README, "Exactness"). On the CPU (float32), below
# CPU_TIE_GAP: batch-shape noise, the CPU weight layout, chunk-wise prefill. On a GPU, within one bfloat16 step
# of the larger logit: TF32 matmuls (MLX_ENABLE_TF32 is on by default), fused kernels and reductions whose order
# depends on the shape.
CPU_TIE_GAP = 1e-4
_BF16_MANTISSA_BITS = 7  # bits after the leading one


def bf16_step(x: float) -> float:
    """The spacing of bfloat16 numbers at |x|."""
    x = abs(float(x))
    if x < 2.0**-126:
        return 2.0 ** (-126 - _BF16_MANTISSA_BITS)  # subnormals
    return 2.0 ** (math.floor(math.log2(x)) - _BF16_MANTISSA_BITS)


def near_tie(gap: float, top: float, gpu: bool) -> bool:
    """Whether a reference top-2 gap (`top` the larger logit) is one that the device may flip."""
    return gap <= bf16_step(top) if gpu else gap < CPU_TIE_GAP


def tie_rule(gpu: bool) -> str:
    return "a top-2 gap within one bfloat16 step of the larger logit" if gpu else f"a top-2 gap below {CPU_TIE_GAP}"


def tiny_checkpoint(family: str, path, *, seed: int = 0, num_shards: int = 2, **config_overrides) -> Path:
    """Write a random tiny checkpoint of `family` at `path`; returns the path. `config_overrides` replace
    fields of the (text) config, e.g. vocab_size=32, mtp_num_hidden_layers=0 (no head)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    config, tensors = FAMILIES[family](dict(config_overrides))
    tensors = {k: v.astype(mx.float32) if v.dtype in (mx.float16, mx.bfloat16) else v for k, v in tensors.items()}
    block = fp8_block_size(config)
    if block is not None:  # quantization_config={"quant_method": "fp8", ...}: the releases' block fp8
        tensors = _fp8_layers(tensors, block)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_shards(path, tensors, num_shards)
    tc = config.get("text_config", config)
    write_char_tokenizer(path, tc["vocab_size"])
    return path


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

# The HF layout's zero-centred norms (shifted by +1 by mlx-lm's sanitize or MTPLX's loader); the gated-delta
# output norm (`linear_attn.norm`) is plain.
_QWEN_SHIFTED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")
_QWEN_SHIFTED_EXACT = (
    "model.language_model.norm.weight",
    "model.norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
)


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
    if (name.endswith(_QWEN_SHIFTED) or name in _QWEN_SHIFTED_EXACT) and v.ndim == 1:
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

        from mtplx.models.families.qwen import QwenMTPHead

        tc = _qwen_text_config(text_type, moe, o)
        if nested:
            arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
            config = {
                "architectures": [arch],
                "model_type": model_type,
                "text_config": tc,
                "tie_word_embeddings": tc["tie_word_embeddings"],
                "eos_token_id": tc["eos_token_id"],
            }
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
                name = name.replace("language_model.model.", "model.language_model.").replace(
                    "language_model.lm_head", "lm_head"
                )
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


# -- DeepSeek-V3 / GLM-4.5 (glm4_moe) / GLM-4.7-Flash (glm4_moe_lite) ----------

_DEEPSEEK_MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}


def _deepseek_family_config(model_type: str, o: dict) -> dict:
    """Tiny configs with the release field names; few trunk layers (MoE from
    layer 1) so the MTP layer sits at index 2, not mlx-lm's literal 61."""
    cfg = {
        "model_type": model_type,
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    if model_type == "deepseek_v3":
        cfg.update(
            _DEEPSEEK_MLA,
            architectures=["DeepseekV3ForCausalLM"],
            n_group=2,
            topk_group=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            moe_layer_freq=1,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            attention_bias=False,
            rope_scaling={
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    elif model_type == "glm4_moe":
        cfg.update(
            architectures=["Glm4MoeForCausalLM"],
            num_attention_heads=4,
            head_dim=16,
            partial_rotary_factor=0.5,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
            rope_scaling=None,
            use_qk_norm=False,
            attention_bias=True,
        )
    else:  # glm4_moe_lite
        cfg.update(
            _DEEPSEEK_MLA,
            architectures=["Glm4MoeLiteForCausalLM"],
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            moe_layer_freq=1,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
            rope_scaling=None,
            partial_rotary_factor=1.0,
            attention_bias=False,
        )
    cfg.update(o)
    return cfg


def _deepseek_to_hf(weights: Dict[str, mx.array], args) -> Dict[str, mx.array]:
    """Undo the trunk sanitize: unstack experts, re-fuse kv_b_proj (MLA)."""
    out = {}
    for name, v in weights.items():
        if ".switch_mlp." in name:
            prefix, rest = name.split(".switch_mlp.")
            proj = rest.split(".")[0]
            out.update({f"{prefix}.experts.{e}.{proj}.weight": v[e] for e in range(v.shape[0])})
        elif name.endswith(".self_attn.embed_q.weight"):
            prefix = name[: -len("embed_q.weight")]
            wk = v.swapaxes(-1, -2)  # [heads, nope, kv_lora]
            wv = weights[prefix + "unembed_out.weight"]  # [heads, v_dim, kv_lora]
            kv_b = mx.concatenate([wk, wv], axis=1)  # [heads, nope + v_dim, kv_lora]
            out[prefix + "kv_b_proj.weight"] = kv_b.reshape(-1, args.kv_lora_rank)
        elif not name.endswith(".self_attn.unembed_out.weight"):
            out[name] = v
    return out


def fp8_block_quantize(w: mx.array, block: int = 128):
    """(fp8 e4m3 bytes, weight_scale_inv) in DeepSeek's layout: w ~ q * scale_inv per block."""
    m, n = w.shape
    pm, pn = (-m) % block, (-n) % block
    blocks = mx.pad(w, ((0, pm), (0, pn))).reshape((m + pm) // block, block, (n + pn) // block, block)
    scale_inv = mx.maximum(mx.abs(blocks).max(axis=(1, 3)) / 448.0, 1e-12)  # [m/b, n/b]
    q = mx.to_fp8(blocks / scale_inv[:, None, :, None]).reshape(m + pm, n + pn)[:m, :n]
    return q, scale_inv


def _fp8_layers(tensors: Dict[str, mx.array], block: int) -> Dict[str, mx.array]:
    # Releases store decoder-layer projections in fp8, all else (eh_proj, router, norms) in high precision.
    out = {}
    for k, v in tensors.items():
        if (
            (".layers." in k or ".mtp_layers." in k)
            and k.endswith("_proj.weight")
            and v.ndim == 2
            and "eh_proj" not in k
        ):
            out[k], out[k + "_scale_inv"] = fp8_block_quantize(v, block)
        else:
            out[k] = v
    return out


def _deepseek_checkpoint(model_type: str):
    def build(o: dict):
        from mlx_lm.utils import _get_classes

        from mtplx.models.families.deepseek import DeepSeekMTPHead

        config = _deepseek_family_config(model_type, o)
        model_cls, args_cls = _get_classes(copy.deepcopy(config))
        args = args_cls.from_dict(copy.deepcopy(config))
        trunk = model_cls(args)
        _randomize_norms(trunk)
        weights = dict(tree_flatten(trunk.parameters()))
        n_trunk, n_mtp = config["num_hidden_layers"], config["num_nextn_predict_layers"]
        if n_mtp:
            head = DeepSeekMTPHead(args, type(trunk.model.layers[-1]), n_trunk, n_mtp)
            _randomize_norms(head)
            for name, v in tree_flatten(head.parameters()):
                weights.update(_deepseek_head_to_hf(name, v, n_trunk, n_mtp))
        return config, _deepseek_to_hf(weights, args)

    return build


def _deepseek_head_to_hf(name: str, v: mx.array, n_trunk: int, n_mtp: int) -> Dict[str, mx.array]:
    if name == "embed_tokens.weight":
        # Every MTP layer of a release carries a copy of the shared embedding.
        return {f"model.layers.{n_trunk + j}.embed_tokens.weight": v for j in range(n_mtp)}
    _, j, rest = name.split(".", 2)  # layers.{j}.rest
    rest = rest[len("mtp_block.") :] if rest.startswith("mtp_block.") else rest
    return {f"model.layers.{n_trunk + int(j)}.{rest}": v}


FAMILIES["deepseek_v3"] = _deepseek_checkpoint("deepseek_v3")
FAMILIES["glm4_moe"] = _deepseek_checkpoint("glm4_moe")
FAMILIES["glm4_moe_lite"] = _deepseek_checkpoint("glm4_moe_lite")


# -- MiMo -------------------------------------------------------------------------


def _mimo_config(o: dict) -> dict:
    cfg = {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 640000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    cfg.update(o)
    return cfg


@_family("mimo")
def _mimo_checkpoint(o: dict):
    from mlx_lm.utils import _get_classes

    from mtplx.models.families.mimo import MiMoMTPHead

    config = _mimo_config(o)
    model_cls, args_cls = _get_classes(copy.deepcopy(config))
    args = args_cls.from_dict(copy.deepcopy(config))
    trunk = model_cls(args)
    _randomize_norms(trunk)
    tensors = dict(tree_flatten(trunk.parameters()))  # MiMo's trunk names are the HF names
    n_mtp = config["num_nextn_predict_layers"]
    if n_mtp:
        head = MiMoMTPHead(args, type(trunk.model.layers[0]), n_mtp)
        _randomize_norms(head)
        for name, v in tree_flatten(head.parameters()):
            _, j, rest = name.split(".", 2)  # layers.{j}.rest
            rest = rest[len("mtp_block.") :] if rest.startswith("mtp_block.") else rest
            tensors[f"model.mtp_layers.{j}.{rest}"] = v
    return config, tensors
