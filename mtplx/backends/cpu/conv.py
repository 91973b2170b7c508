"""The gated-delta layers' depthwise causal conv as shifted multiply-adds,
with each layer's conv weight split into its taps once."""

from __future__ import annotations

import mlx.core as mx


def _depthwise_conv(x, taps, S: int):
    """The layer's depthwise causal conv as K shifted multiply-adds: the same
    sum as its grouped Conv1d to float rounding, several times faster on the
    CPU backend (a prompt chunk of 16 rows x 96 tokens of the built-in model:
    0.40 against 2.62 ms a layer). x [B, K-1+S, C], taps K x [C] -> [B, S, C]."""
    out = x[:, 0:S] * taps[0]
    for j in range(1, len(taps)):
        out = out + x[:, j : j + S] * taps[j]
    return out


def _taps_of(weight) -> list:
    """K x [C]: a depthwise conv weight [C, K, 1], one row per tap."""
    return [mx.contiguous(weight[:, j, 0]) for j in range(weight.shape[1])]


def prepare_conv_taps(model) -> None:
    """Split every gated-delta layer's conv weight into its taps once, ahead
    of the passes (`mtplx.decode_model`). Split inside a pass (a slice, a
    transpose, then a gather and a squeeze per tap) they were 10 of the 76
    nodes of a layer's decode graph on the built-in model, dispatched every
    pass; the taps are the same values."""
    for layer in getattr(model.text_model, "layers", []):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None and hasattr(gdn, "conv1d"):
            weight = gdn.conv1d.weight
            if getattr(gdn, "conv_taps", (None,))[0] is weight:
                continue  # split already (every runtime and cost sampler prepares the model)
            taps = _taps_of(weight)
            mx.eval(taps)
            # Beside the module's parameters, not among them: the taps are
            # no weights of the checkpoint (nn.Module registers arrays and
            # lists set as attributes).
            object.__setattr__(gdn, "conv_taps", (weight, taps))


def causal_conv(gdn, conv_input, S: int):
    """The layer's conv over [B, K-1+S, C] -> [B, S, C]: the fast form in
    float32; in half precision the layer's own Conv1d, because the shifted
    sum rounds after every term (decode logits of a bf16 Qwen3.5 moved by
    up to 0.012 against mlx-lm's, and greedy output parted from mlx-lm's at
    top-2 gaps of 0.016-0.031)."""
    if conv_input.dtype != mx.float32:
        return gdn.conv1d(conv_input)
    split = getattr(gdn, "conv_taps", None)
    weight = gdn.conv1d.weight
    taps = split[1] if split is not None and split[0] is weight else _taps_of(weight)
    return _depthwise_conv(conv_input, taps, S)
