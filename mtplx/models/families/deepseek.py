"""DeepSeek-V3 / GLM-4.5..4.7 / GLM-4.7-Flash: MTP layer(s) after the last trunk layer.

Head wiring (checked against vLLM's deepseek_mtp.py, glm4_moe_mtp.py and
glm4_moe_lite_mtp.py; the three agree):
- The MTP layers sit at layer index `num_hidden_layers` ..
  `num_hidden_layers + num_nextn_predict_layers - 1`. Each holds `enorm`,
  `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`, its own
  `embed_tokens`, and a normal decoder layer (MoE/MLA as the trunk's layer of
  that index would be: vLLM builds it with the real index, so do we).
- e = enorm(embed(x_{t+1})), h = hnorm(h_t), x = eh_proj([e; h]) (embedding
  first), then the decoder layer. Logits: shared_head.head(shared_head.norm(x)).
  Depth i uses MTP layer (i-1) mod n, like vLLM's `spec_step_idx % n`.
- The embedding table: vLLM keeps only the FIRST MTP layer's `embed_tokens`
  and shares it across all MTP layers (DeepSeek-V3 report: "MTP modules share
  the embedding layer"); the other layers' copies are read, shape-checked and
  dropped. It is the head's own table, not the trunk's.
- The hidden state fed to the head is the trunk output after its final norm
  (vLLM's DeepseekV2Model / Glm4MoeModel return the normed state).
- For depth > 1 the layer output before `shared_head.norm` is fed back (the
  MTP layer's forward returns it; compute_logits applies the norm).
- vLLM zeroes the embedding where `positions == 0` ("masking inputs at
  position 0, as not needed by MTP"). In our runtime the pair (h_t, x_{t+1})
  sits at RoPE position t of the head's cache, which is the position vLLM
  gives it, so the pair (h_0, x_1) gets a zero embedding: position = the
  head cache's offset (int or per-row array) + t.
- Norm weights are plain `w` (no zero-centring).

mlx-lm 0.32 quirks handled here:
- deepseek_v3's sanitize drops only the literal `model.layers.61.*`, and
  glm4_moe's drops only `model.layers.{num_hidden_layers}.*`: `model_classes`
  gives mlx-lm a subclass of its own Model whose sanitize first drops every
  layer at or past num_hidden_layers (glm4_moe_lite already does).
- The head's tensors get the trunk's transforms (stacked experts, kv_b_proj
  split, fp8 block dequantisation with weight_scale_inv) by being presented
  to the trunk's sanitize as its last layer.

Parameter names of the head (also the `mtp.safetensors` sidecar names after
the "mtp." prefix): `embed_tokens.weight`, `layers.{j}.enorm.weight`,
`layers.{j}.hnorm.weight`, `layers.{j}.eh_proj.weight`,
`layers.{j}.shared_head.norm.weight`, `layers.{j}.shared_head.head.weight`,
`layers.{j}.mtp_block.<mlx-lm decoder layer parameters>`.
"""

from __future__ import annotations

import re
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from mtplx.models.adapter import CheckpointError, FamilyAdapter
from mtplx.models.families.common import decoder_block, load_head_weights, maybe_quantize_head, sanitize_as_trunk_layer

# Suffixes of an MTP layer that are not part of its decoder layer.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


def zero_embedding_at_position0(e: mx.array, cache) -> mx.array:
    """vLLM's `inputs_embeds[positions == 0] = 0` for the head's pairs.

    e [B, T, H]; a pair's position is the cache offset (int, or [B] per row)
    plus its index t.
    """
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
        # hidden [B, T, H], next_tokens [B, T] -> logits [B, T, V], out [B, T, H]
        # (T = 1 given `at` [B], each row's output position: common.decoder_block)
        j = (depth - 1) % len(self.layers)
        layer = self.layers[j]
        c = None if cache is None else cache[j]
        e = zero_embedding_at_position0(self.embed_tokens(next_tokens), c)
        x = layer.eh_proj(mx.concatenate([layer.enorm(e), layer.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, c, return_array=True)
        x = decoder_block(layer.mtp_block, x, mask, c, at)  # [B, T, H]: fed back for depth > 1
        return layer.shared_head.head(layer.shared_head.norm(x)), x


# -- trunk access ---------------------------------------------------------------


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


# -- mlx-lm trunk class that drops every MTP layer before its own sanitize --------

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


# -- building the head ------------------------------------------------------------


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
    """Each MTP layer's decoder block holds the tensors of the last trunk
    layer, of the same shapes: checked on the checkpoint's own names, before
    the trunk's transforms rename them (kv_b_proj -> embed_q / unembed_out)."""
    ref = f"model.layers.{n_trunk - 1}."
    # Block-fp8 scales are gone by now: the head's tensors come dequantised.
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
    # Present each MTP layer as the last trunk layer so the trunk's sanitize
    # applies its transforms (expert stacking, kv_b_proj split, fp8 dequant).
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
    # vLLM shares the first MTP layer's embedding across all MTP layers; the
    # later layers' copies are checked and dropped.
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
