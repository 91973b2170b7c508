"""DeepSeek-V3 / GLM-4.5..4.7 / GLM-4.7-Flash: MTP layer(s) after the last trunk layer (as vLLM's *_mtp.py).

MTP layer j is checkpoint layer num_hidden_layers + j: x = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)]), h_t
after the trunk's final norm, then a decoder layer built at its real index, whose output is fed back for
depth > 1 and gives logits through `shared_head`. The first MTP layer's embedding (the head's own, not the
trunk's) serves all, zeroed at position 0 as in vLLM. mlx-lm's sanitize drops only some MTP layers:
`model_classes` drops them all first.
"""

from __future__ import annotations

import re
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from mtplx.models.adapter import CheckpointError, FamilyAdapter
from mtplx.models.families.common import decoder_block, load_head_weights, maybe_quantize_head, sanitize_as_trunk_layer

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


def zero_embedding_at_position0(e: mx.array, cache) -> mx.array:
    """vLLM's `inputs_embeds[positions == 0] = 0`: e [B, T, H], position = cache offset (int or [B]) + t."""
    offset = 0 if cache is None else cache.offset
    if isinstance(offset, int) and offset > 0:
        return e
    T = e.shape[1]
    positions = mx.array(offset)[..., None] + mx.arange(T)  # [T] or [B, T]
    return e * (positions != 0)[..., None].astype(e.dtype)  # [B, T, H]


class SharedHead(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class DeepSeekMTPLayer(nn.Module):
    def __init__(self, args, layer_cls, layer_idx: int):
        super().__init__()
        H = args.hidden_size
        self.enorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.mtp_block = layer_cls(args, layer_idx)
        self.shared_head = SharedHead(args)


class DeepSeekMTPHead(nn.Module):
    def __init__(self, args, layer_cls, first_layer_idx: int, num_layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DeepSeekMTPLayer(args, layer_cls, first_layer_idx + j) for j in range(num_layers)]

    def __call__(self, hidden, next_tokens, cache=None, depth: int = 1, at=None):
        # hidden [B, T, H], next_tokens [B, T] -> logits [B, T, V], out [B, T, H] (T = 1 given `at` [B])
        j = (depth - 1) % len(self.layers)
        layer = self.layers[j]
        c = None if cache is None else cache[j]
        e = zero_embedding_at_position0(self.embed_tokens(next_tokens), c)
        x = layer.eh_proj(mx.concatenate([layer.enorm(e), layer.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, c, return_array=True)
        x = decoder_block(layer.mtp_block, x, mask, c, at)  # [B, T, H]: fed back for depth > 1
        return layer.shared_head.head(layer.shared_head.norm(x)), x


def _text_model(trunk):
    return trunk.model


def _lm_head(trunk):
    return lambda x: trunk.lm_head(x)


def _num_mtp_layers(config: dict) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def _mtp_layer_index(key: str):
    m = _LAYER_KEY.match(key)
    return None if m is None else int(m.group(1))


def _is_mtp_key(key: str, config: dict) -> bool:
    i = _mtp_layer_index(key)
    return i is not None and i >= int(config["num_hidden_layers"])


_TRUNK_CLASSES: Dict[type, type] = {}


def trunk_class_without_mtp(model_cls: type) -> type:
    """A subclass of mlx-lm's Model whose sanitize first drops layers >= num_hidden_layers."""
    if model_cls not in _TRUNK_CLASSES:

        def sanitize(self, weights):
            n = self.args.num_hidden_layers
            kept = {k: v for k, v in weights.items() if (_mtp_layer_index(k) or 0) < n}
            return model_cls.sanitize(self, kept)

        _TRUNK_CLASSES[model_cls] = type(
            model_cls.__name__, (model_cls,), {"sanitize": sanitize, "__module__": __name__}
        )
    return _TRUNK_CLASSES[model_cls]


def _model_classes(config: dict):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    return trunk_class_without_mtp(model_cls), args_cls


def _build_head(trunk, config, tensors: Dict[str, mx.array], shard_shapes, quantization=None, mlx_layout=False):
    args = trunk.args
    inner = _text_model(trunk)
    n_trunk = args.num_hidden_layers
    if mlx_layout:
        n = _count_sidecar_layers(tensors)
        weights = {k[len("mtp.") :]: v for k, v in tensors.items()}
    else:
        n = _check_layer_ids(tensors, n_trunk, _num_mtp_layers(config))
        _check_block_like_the_last_trunk_layer(tensors, shard_shapes, n_trunk, n)
        weights = _hf_to_head(trunk, tensors, n_trunk, n)
    ref = len(inner.layers) - 1
    head = DeepSeekMTPHead(args, type(inner.layers[ref]), n_trunk, n)
    maybe_quantize_head(head, weights, quantization)
    where = f"{config.get('model_type')} MTP head (its layers.j is checkpoint model.layers.{n_trunk}+j)"
    load_head_weights(head, weights, where)
    return head


def _count_sidecar_layers(tensors) -> int:
    ids = {int(m.group(1)) for k in tensors for m in [re.match(r"mtp\.layers\.(\d+)\.", k)] if m}
    if not ids:
        raise CheckpointError("mtp.safetensors holds no mtp.layers.N.* tensors")
    return max(ids) + 1


def _check_layer_ids(tensors, n_trunk: int, declared: int) -> int:
    ids = sorted({_mtp_layer_index(k) for k in tensors})
    n = len(ids)
    if ids != list(range(n_trunk, n_trunk + n)):
        raise CheckpointError(f"MTP layers must be numbered {n_trunk}..{n_trunk + n - 1}, found {ids}")
    if n != declared:
        raise CheckpointError(
            f"checkpoint holds {n} MTP layer(s) ({ids}) but config.json declares num_nextn_predict_layers={declared}"
        )
    return n


def _check_block_like_the_last_trunk_layer(tensors, shard_shapes: Dict[str, tuple], n_trunk: int, n: int) -> None:
    """Each MTP decoder block holds the last trunk layer's tensors and shapes (fp8 scales aside: dequantised)."""
    ref = f"model.layers.{n_trunk - 1}."
    block = {k[len(ref) :]: s for k, s in shard_shapes.items() if k.startswith(ref) and not k.endswith("_scale_inv")}
    for j in range(n):
        src = f"model.layers.{n_trunk + j}."
        have = {k[len(src) :]: tuple(v.shape) for k, v in tensors.items() if k.startswith(src)}
        missing = sorted(src + k for k in block if k not in have)
        if missing:
            more = f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""
            raise CheckpointError(f"missing MTP tensor(s): {', '.join(missing[:4])}{more}")
        for k, shape in block.items():
            if have[k] != tuple(shape):
                raise CheckpointError(
                    f"MTP tensor {src + k!r} has shape {have[k]}, expected {tuple(shape)} as {ref + k} has"
                )


def _hf_to_head(trunk, tensors, n_trunk: int, n: int) -> Dict[str, mx.array]:
    # Each MTP layer as the last trunk layer, so the trunk's sanitize applies its transforms.
    ref = f"model.layers.{n_trunk - 1}."
    weights, later_embeds = {}, {}
    for j in range(n):
        src = f"model.layers.{n_trunk + j}."
        layer = {k: v for k, v in tensors.items() if k.startswith(src)}
        for suffix, v in sanitize_as_trunk_layer(trunk, layer, src, ref, "").items():
            if suffix.startswith("embed_tokens."):
                if j == 0:
                    weights[suffix] = v
                else:
                    later_embeds[src + suffix] = v
            elif suffix.startswith(_OWN):
                weights[f"layers.{j}.{suffix}"] = v
            else:
                weights[f"layers.{j}.mtp_block.{suffix}"] = v
    first = weights.get("embed_tokens.weight")
    if first is None:
        raise CheckpointError(f"missing MTP tensor: model.layers.{n_trunk}.embed_tokens.weight")
    for k, v in later_embeds.items():
        if k.endswith(".weight") and v.shape != first.shape:
            raise CheckpointError(f"MTP tensor {k!r} has shape {tuple(v.shape)}, expected {tuple(first.shape)}")
    return weights


DEEPSEEK = FamilyAdapter(
    name="deepseek_v3",
    model_types=("deepseek_v3", "glm4_moe", "glm4_moe_lite"),
    text_model=_text_model,
    lm_head=_lm_head,
    hidden_after_norm=True,
    is_mtp_key=_is_mtp_key,
    build_head=_build_head,
    num_mtp_layers=_num_mtp_layers,
    model_classes=_model_classes,
    notes={"reference": "vLLM deepseek_mtp.py, glm4_moe_mtp.py, glm4_moe_lite_mtp.py"},
)
