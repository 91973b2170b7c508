"""The gated-delta layers' depthwise causal conv as shifted multiply-adds over taps split once per model."""

from __future__ import annotations

import mlx.core as mx


def _depthwise_conv(x, taps, S: int):
    """K shifted multiply-adds, faster than the grouped Conv1d on the CPU: x [B, K-1+S, C], taps -> [B, S, C]."""
    out = x[:, 0:S] * taps[0]
    for j in range(1, len(taps)):
        out = out + x[:, j : j + S] * taps[j]
    return out


def _taps_of(weight) -> list:
    """K x [C]: a depthwise conv weight [C, K, 1], one row per tap."""
    return [mx.contiguous(weight[:, j, 0]) for j in range(weight.shape[1])]


def prepare_conv_taps(model) -> None:
    """Split every gated-delta layer's conv weight into taps once, not as graph nodes of every pass."""
    for layer in getattr(model.text_model, "layers", []):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None and hasattr(gdn, "conv1d"):
            weight = gdn.conv1d.weight
            if getattr(gdn, "conv_taps", (None,))[0] is weight:
                continue  # split already (every runtime and cost sampler prepares the model)
            taps = _taps_of(weight)
            mx.eval(taps)
            # Not among the parameters (nn.Module registers arrays set as attributes): no checkpoint weights.
            object.__setattr__(gdn, "conv_taps", (weight, taps))


def causal_conv(gdn, conv_input, S: int):
    """The layer's conv, [B, K-1+S, C] -> [B, S, C]: the shifted sum in float32; in half precision the
    layer's own Conv1d, since the shifted sum rounds after every term and greedy output left mlx-lm's."""
    if conv_input.dtype != mx.float32:
        return gdn.conv1d(conv_input)
    split = getattr(gdn, "conv_taps", None)
    weight = gdn.conv1d.weight
    taps = split[1] if split is not None and split[0] is weight else _taps_of(weight)
    return _depthwise_conv(conv_input, taps, S)
