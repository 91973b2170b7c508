"""The gated-delta layer of a training forward, its recurrence chunk-wise (models.families.gated_delta_chunked)
so back-propagation does not unroll one op group per token."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mtplx.models.families.gated_delta_chunked import chunked_gated_delta, log_gate
from mtplx.models.families.qwen import split_qkv


def gated_delta_layer_train(gdn, x: mx.array, chunk: int = 32) -> mx.array:
    """mlx-lm's GatedDeltaNet.__call__ without cache or mask, the recurrence chunk-wise; same parameters."""
    B, S, _ = x.shape
    qkv = gdn.in_proj_qkv(x)  # [B, S, conv_dim]
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b, a = gdn.in_proj_b(x), gdn.in_proj_a(x)  # [B, S, Hv]
    conv_input = mx.concatenate([mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), x.dtype), qkv], axis=1)
    conv_out = nn.silu(gdn.conv1d(conv_input))  # [B, S, conv_dim]
    q, k, v = split_qkv(gdn, conv_out)
    y, _ = chunked_gated_delta(q, k, v, log_gate(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b), chunk)
    out = gdn.norm(y, z)  # [B, S, Hv, Dv]
    return gdn.out_proj(out.reshape(B, S, -1))
