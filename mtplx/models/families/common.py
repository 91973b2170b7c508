"""Pieces the family adapters share."""

from __future__ import annotations

from typing import Callable, Dict

import mlx.core as mx
import mlx.nn as nn

from mtplx.models.adapter import CheckpointError


def sanitize_as_trunk_layer(
    trunk: nn.Module,
    tensors: Dict[str, mx.array],
    src_prefix: str,
    trunk_prefix: str,
    out_prefix: str,
    extra: Dict[str, mx.array] | None = None,
) -> Dict[str, mx.array]:
    """The trunk's own sanitize (its transforms) over one head layer's tensors under a trunk layer's name;
    `extra`: tensors that only steer detection, dropped again."""
    presented = {trunk_prefix + k[len(src_prefix) :]: v for k, v in tensors.items()}
    presented.update(extra or {})
    try:
        sanitized = trunk.sanitize(presented)
    except KeyError as e:
        name = str(e.args[0]) if e.args else ""
        if name.startswith(trunk_prefix):
            name = src_prefix + name[len(trunk_prefix) :]
        raise CheckpointError(f"missing MTP tensor {name!r}") from None
    except ValueError as e:
        raise CheckpointError(f"MTP tensors under {src_prefix!r} cannot be transformed: {e}") from None
    result = {}
    for k, v in sanitized.items():
        suffix = _find_layer_suffix(k, trunk_prefix)
        if suffix is not None:
            result[out_prefix + suffix] = v
        elif not any(_same_tail(k, e) for e in (extra or {})):
            raise CheckpointError(f"head tensor {k!r} left its layer during sanitize")
    return result


def decoder_block(layer, x: mx.array, mask, cache, at=None) -> mx.array:
    """A head's pre-norm decoder layer, x [B, T, H] -> [B, T, H]; given `at` [B], only row b's position at[b],
    [B, 1, H]: every position writes its K/V, but the MLP (most of an MoE head pass) runs on those alone."""
    if at is None:
        return layer(x, mask, cache)
    h = x + layer.self_attn(layer.input_layernorm(x), mask, cache)  # [B, T, H]
    h = mx.take_along_axis(h, at.reshape(-1, 1, 1), axis=1)  # [B, 1, H]
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _same_tail(key: str, extra_key: str) -> bool:
    return key.endswith(extra_key.split("model.", 1)[-1])


def _find_layer_suffix(key: str, trunk_prefix: str):
    # sanitize may rename the front of "model.layers.3." (e.g. "language_model.model..."): match the tail.
    tail = trunk_prefix.split("model.", 1)[-1]  # "layers.3."
    i = key.find(tail)
    return None if i < 0 else key[i + len(tail) :]


def load_head_weights(head: nn.Module, weights: Dict[str, mx.array], where: str):
    """Strict load: every head parameter filled, every tensor consumed, shapes equal."""
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(head.parameters()))
    unknown = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights))
    if unknown:
        raise CheckpointError(f"{where}: unknown MTP tensor(s): {', '.join(unknown[:8])}")
    if missing:
        raise CheckpointError(f"{where}: missing MTP tensor(s): {', '.join(missing[:8])}")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(
                f"{where}: MTP tensor {k!r} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}"
            )
    head.load_weights(list(weights.items()), strict=True)


def maybe_quantize_head(head: nn.Module, weights: Dict[str, mx.array], quantization: dict | None):
    """Quantise the head module's layers that the stored weights hold quantised."""
    if not quantization:
        return
    nn.quantize(
        head,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights,
    )


def bind_shared(head: nn.Module, **fns: Callable):
    """Give the head the trunk's functions (embedding, lm_head) as plain attributes: no parameters twice."""
    for name, fn in fns.items():
        object.__setattr__(head, name, fn)
