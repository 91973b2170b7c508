"""The default model: an mlx-lm qwen3_5 trunk and `QwenMTPHead`, from a config in the Qwen3.5 release layout,
so that training, export and loading all go through the real code.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn

from mtplx.models.families.common import bind_shared
from mtplx.models.families.qwen import QwenMTPHead
from mtplx.training.chunked_delta import gated_delta_layer_train


@dataclass(frozen=True)
class ModelShape:
    """Deep and narrow, so one head pass costs a small fraction of a trunk pass."""

    # 512 entries: cheap lm_head and easy-to-predict tokens (acceptance is per token).
    vocab_size: int = 512
    hidden_size: int = 96
    num_hidden_layers: int = 20
    intermediate_size: int = 288
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 24
    linear_num_value_heads: int = 4
    linear_num_key_heads: int = 2
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 24
    # Layer i is full attention when (i + 1) % interval == 0: 2 is the fewest gated-delta layers besides none.
    full_attention_interval: int = 2
    max_position_embeddings: int = 4096
    # Untied: the bigram warm start needs its own output projection.
    tie_word_embeddings: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def text_config(shape: ModelShape) -> dict:
    n, every = shape.num_hidden_layers, shape.full_attention_interval
    tc = {
        "model_type": "qwen3_5_text",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_key_head_dim": shape.linear_key_head_dim,
        "linear_value_head_dim": shape.linear_value_head_dim,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": every,
        "layer_types": ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)],
        "rms_norm_eps": 1e-6,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": shape.tie_word_embeddings,
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
    if "linear_attention" not in tc["layer_types"]:
        # mlx-lm's sanitize recognises the HF layout by a gated-delta conv1d.
        raise ValueError("the trunk needs at least one gated-delta layer")
    return tc


def release_config(shape: ModelShape) -> dict:
    """config.json as a Qwen3.5 release writes it."""
    tc = text_config(shape)
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": tc,
        "tie_word_embeddings": tc["tie_word_embeddings"],
        "eos_token_id": tc["eos_token_id"],
    }


class TinyMTP(nn.Module):
    """Trunk + head in one module, so one optimizer trains both."""

    def __init__(self, config: dict):
        super().__init__()
        from mlx_lm.utils import _get_classes

        model_cls, args_cls = _get_classes(copy.deepcopy(config))
        self.trunk = model_cls(args_cls.from_dict(copy.deepcopy(config)))
        args = self.trunk.language_model.args
        ref = args.full_attention_interval - 1  # a full-attention layer, as mtplx.load picks
        self.head = QwenMTPHead(args, type(self.inner.layers[ref]), ref, 1)
        # Looked up at call time so that traced/updated parameters are used.
        bind_shared(self.head, embed=lambda t: self.inner.embed_tokens(t), lm_head=self.lm_head)

    @property
    def inner(self):
        return self.trunk.language_model.model

    def lm_head(self, x):
        lm = self.trunk.language_model
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(x)
        return lm.lm_head(x)

    def hidden(self, tokens: mx.array) -> mx.array:
        """The trunk output after its final norm [B, T, H] (what the head consumes), by mlx-lm's forward."""
        return self.inner(tokens)

    def hidden_chunked(self, tokens: mx.array) -> mx.array:
        """`hidden` from a zero state with gated-delta layers chunk-wise: the training forward."""
        x = self.inner.embed_tokens(tokens)  # [B, T, H]
        for layer in self.inner.layers:
            if layer.is_linear:
                h = x + gated_delta_layer_train(layer.linear_attn, layer.input_layernorm(x))
                x = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                x = layer(x, "causal", None)
        return self.inner.norm(x)


_RESIDUAL_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def initialize(model: TinyMTP, std: float = 0.02) -> None:
    """GPT-2 style init (global MLX seed): 2-D weights ~ N(0, std), residual-stream outputs ~ N(0, std / sqrt(2 L)).
    Under mlx-lm's defaults a deep narrow trunk's random residual branches drown the token embedding and it
    sits near the unigram loss for long; norms, conv, A_log and dt_bias keep mlx-lm's values."""
    from mlx.utils import tree_flatten

    layers = model.trunk.language_model.args.num_hidden_layers
    updates = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim != 2:
            continue
        scale = std / (2 * layers) ** 0.5 if name.endswith(_RESIDUAL_OUTPUTS) else std
        updates.append((name, scale * mx.random.normal(p.shape)))
    model.load_weights(updates, strict=False)


def count_parameters(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(module.parameters()))
