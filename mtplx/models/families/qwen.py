"""Qwen3.5 / Qwen3.6 / Qwen3-Next: hybrid gated-delta trunk, `mtp.*` head (as vLLM's qwen3_*_mtp.py).

x = fc([pre_fc_norm_embedding(embed(x_{t+1})); pre_fc_norm_hidden(h_t)]), h_t after the trunk's final norm,
then decoder layer (depth - 1) mod n and `mtp.norm` (fed back for depth > 1). The HF norms are zero-centred
(1 + w): mlx-lm's sanitize shifts the decoder layer's, and the head-level ones get the same +1 here.
"""

from __future__ import annotations

import re
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.gated_delta import compute_g

from mtplx import backends
from mtplx.models.adapter import CheckpointError, FamilyAdapter
from mtplx.models.families.common import (
    bind_shared,
    decoder_block,
    load_head_weights,
    maybe_quantize_head,
    sanitize_as_trunk_layer,
)
from mtplx.models.families.gated_delta_chunked import chunked_gated_delta, log_gate

_HEAD_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


class QwenMTPHead(nn.Module):
    def __init__(self, args, layer_cls, ref_layer_idx: int, num_layers: int):
        super().__init__()
        H = args.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [layer_cls(args, ref_layer_idx) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def __call__(self, hidden, next_tokens, cache=None, depth: int = 1, at=None):
        # hidden [B, T, H], next_tokens [B, T] -> logits [B, T, V], out [B, T, H] (T = 1 given `at` [B])
        e = self.pre_fc_norm_embedding(self.embed(next_tokens))
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(mx.concatenate([e, h], axis=-1))  # [B, T, H]
        j = (depth - 1) % len(self.layers)
        c = None if cache is None else cache[j]
        mask = create_attention_mask(x, c, return_array=True)
        x = decoder_block(self.layers[j], x, mask, c, at)
        out = self.norm(x)
        return self.lm_head(out), out


def _args(trunk):
    return trunk.language_model.args if hasattr(trunk, "language_model") else trunk.args


def _text_model(trunk):
    return trunk.language_model.model if hasattr(trunk, "language_model") else trunk.model


def _lm_head(trunk):
    lm = trunk.language_model if hasattr(trunk, "language_model") else trunk
    if lm.args.tie_word_embeddings:
        return lambda x: lm.model.embed_tokens.as_linear(x)
    return lambda x: lm.lm_head(x)


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _num_mtp_layers(config: dict) -> int:
    tc = _text_config(config)
    return int(tc.get("mtp_num_hidden_layers", tc.get("num_nextn_predict_layers", 0)) or 0)


def _is_mtp_key(key: str, config: dict) -> bool:
    return key.startswith("mtp.")


def _hf_layout(trunk, shard_shapes: Dict[str, tuple]) -> bool:
    # The trunk sanitize's test: HF conv1d weights are [C, 1, K]; Qwen3-Next is HF with experts one by one.
    if any("conv1d.weight" in k and s[-1] != 1 for k, s in shard_shapes.items()):
        return True
    return any(".mlp.experts.0.up_proj.weight" in k for k in shard_shapes)


def _build_head(trunk, config, tensors: Dict[str, mx.array], shard_shapes, quantization=None, mlx_layout=False):
    args = _args(trunk)
    inner = _text_model(trunk)
    layer_ids = sorted({int(m.group(1)) for k in tensors for m in [re.match(r"mtp\.layers\.(\d+)\.", k)] if m})
    n = len(layer_ids)
    if n == 0:
        raise CheckpointError("MTP tensors found but no mtp.layers.N.* decoder layer")
    if layer_ids != list(range(n)):
        raise CheckpointError(f"MTP layers are not numbered 0..{n - 1}: {layer_ids}")
    ref = args.full_attention_interval - 1
    head = QwenMTPHead(args, type(inner.layers[ref]), ref, n)

    if mlx_layout:
        weights = {k[len("mtp.") :]: v for k, v in tensors.items()}
    else:
        weights = _hf_to_head(trunk, args, tensors, shard_shapes, ref, n)
    maybe_quantize_head(head, weights, quantization)
    load_head_weights(head, weights, "qwen MTP head (its X is checkpoint mtp.X)")
    bind_shared(head, embed=lambda t: inner.embed_tokens(t), lm_head=_lm_head(trunk))
    return head


def _hf_to_head(trunk, args, tensors, shard_shapes, ref, n):
    hf = _hf_layout(trunk, shard_shapes)
    # A gated-delta conv weight in HF shape tells the qwen3_5 sanitize to shift the zero-centred norms.
    lin = 0 if ref != 0 else 1
    trigger = {f"model.layers.{lin}.linear_attn.conv1d.weight": mx.zeros((1, 1, 2))} if hf else None
    weights = {}
    for j in range(n):
        prefix = f"mtp.layers.{j}."
        layer = {k: v for k, v in tensors.items() if k.startswith(prefix)}
        if getattr(trunk, "model_type", None) == "qwen3_5_moe":
            layer = _fused_experts(layer, prefix)
        weights.update(sanitize_as_trunk_layer(trunk, layer, prefix, f"model.layers.{ref}.", f"layers.{j}.", trigger))
    for k, v in tensors.items():
        if k.startswith("mtp.layers."):
            continue
        name = k[len("mtp.") :]
        if hf and name in _HEAD_NORMS:
            v = v + 1.0
        weights[name] = v
    return weights


def _fused_experts(layer: Dict[str, mx.array], prefix: str) -> Dict[str, mx.array]:
    """A Qwen3.5-MoE MTP layer's experts (stored one by one in the releases) fused as its trunk's sanitize takes."""
    mlp = f"{prefix}mlp.experts."
    each = re.compile(re.escape(mlp) + r"(\d+)\.(gate|up|down)_proj\.weight$")
    found = {(int(m.group(1)), m.group(2)): k for k in layer for m in [each.match(k)] if m}
    if not found:
        return layer
    E = 1 + max(e for e, _ in found)
    missing = [f"{mlp}{e}.{p}_proj.weight" for e in range(E) for p in ("gate", "up", "down") if (e, p) not in found]
    if missing:
        raise CheckpointError(f"missing MTP tensor {missing[0]!r}")
    out = {k: v for k, v in layer.items() if not each.match(k)}
    out[f"{mlp}gate_up_proj"] = mx.stack(
        [mx.concatenate([layer[found[(e, "gate")]], layer[found[(e, "up")]]], axis=0) for e in range(E)]
    )  # [E, 2I, H]
    out[f"{mlp}down_proj"] = mx.stack([layer[found[(e, "down")]] for e in range(E)])  # [E, H, I]
    return out


def _project(gdn, x):
    """The layer's own input projections -> (mixed_qkv, z, b, a)."""
    B, S, _ = x.shape
    if hasattr(gdn, "in_proj_qkvz"):  # Qwen3-Next packs q, k, v, z and b, a
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return mixed, z, b, a
    rows = x.reshape(B * S, -1)  # [B*S, D]: four GEMMs without a Flatten and Unflatten each
    z = gdn.in_proj_z(rows).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    mixed, b, a = (proj(rows).reshape(B, S, -1) for proj in (gdn.in_proj_qkv, gdn.in_proj_b, gdn.in_proj_a))
    return mixed, z, b, a


def _conv_activation(gdn):
    """silu, or the layer's `conv_activation` (mtplx.backends.cpu.activations: a faster exp)."""
    return getattr(gdn, "conv_activation", nn.silu)


def split_qkv(gdn, conv_out):
    """Conv output [B, S, C] -> q, k as `normalize_qk` in one norm side by side (bit for bit, fewer nodes), v."""
    B, S, _ = conv_out.shape
    Hk, Dk = gdn.num_k_heads, gdn.head_k_dim
    qk = conv_out[..., : 2 * gdn.key_dim].reshape(B, S, 2 * Hk, Dk)  # q's heads, then k's
    inv_scale = Dk**-0.5
    scales = mx.array([inv_scale**2] * Hk + [inv_scale] * Hk, dtype=qk.dtype)[:, None]  # [2 Hk, 1]
    qk = mx.fast.rms_norm(qk, None, 1e-6 * inv_scale**2) * scales  # normalize_qk's eps, on mean(x^2)
    v = conv_out[..., 2 * gdn.key_dim :].reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    return qk[:, :, :Hk], qk[:, :, Hk:], v


def gated_delta_verify(gdn, x, cache):
    """The gated-delta layer's own forward, keeping the conv input and every step's state in `cache.pending`
    so commit picks each row's state at its accepted step (`mtplx.decode.cache.commit_gdn`), no replay."""
    B, S, _ = x.shape
    mixed, z, b, a = _project(gdn, x)  # [B, S, C], [B, S, Hv, Dv], [B, S, Hv] x2
    K = gdn.conv_kernel_size
    cache.ensure((K - 1, gdn.conv_dim), x.dtype, (gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim))
    conv_input = mx.concatenate([cache.conv, mixed], axis=1)  # [B, K-1+S, C]
    conv_out = _conv_activation(gdn)(backends.causal_conv(gdn, conv_input, S))  # [B, S, C]
    q, k, v = split_qkv(gdn, conv_out)
    out, states = _recurrence(gdn, q, k, v, a, b, cache.state)  # [B, S, Hv, Dv], S x [B, Hv, Dv, Dk]
    state = states[-1]
    cache.pending = (conv_input, states)  # [B, K-1+S, C], S x [B, Hv, Dv, Dk]
    cache.conv = conv_input[:, -(K - 1) :]
    cache.state = state  # until commit: the state after all S steps
    out = gdn.norm(out, z)  # [B, S, Hv, Dv]
    return gdn.out_proj(out.reshape(B * S, -1)).reshape(B, S, -1)


def _recurrence(gdn, q, k, v, a, b, state):
    """mlx-lm's `gated_delta_ops` step by step, bit for bit, keeping each step's state; step-independent work
    is done once. q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], a, b [B, S, Hv], state [B, Hv, Dv, Dk]."""
    B, S, Hv, Dv = v.shape
    beta = mx.sigmoid(b)  # [B, S, Hv]
    g = compute_g(gdn.A_log, a, gdn.dt_bias)  # [B, S, Hv]
    r = Hv // q.shape[2]
    if r > 1:
        q, k = mx.repeat(q, r, -2), mx.repeat(k, r, -2)  # [B, S, Hv, Dk]
    qs = _by_step(q[:, :, :, None, :])  # S x [B, 1, Hv, 1, Dk]
    ks = _by_step(k[:, :, :, None, :])  # S x [B, 1, Hv, 1, Dk]
    vs = _by_step(v[..., None])  # S x [B, 1, Hv, Dv, 1]
    gs = _by_step(g[..., None, None])  # S x [B, 1, Hv, 1, 1]
    betas = _by_step(beta[..., None, None])  # S x [B, 1, Hv, 1, 1]
    state = state[:, None]  # [B, 1, Hv, Dv, Dk]
    ys, states = [], []
    for t in range(S):
        state = state * gs[t]
        kv_mem = (state * ks[t]).sum(axis=-1, keepdims=True)  # [B, 1, Hv, Dv, 1]
        delta = (vs[t] - kv_mem) * betas[t]  # [B, 1, Hv, Dv, 1]
        state = state + ks[t] * delta
        ys.append((state * qs[t]).sum(axis=-1).astype(q.dtype))  # [B, 1, Hv, Dv]
        states.append(state.reshape(B, Hv, Dv, -1))
    return (ys[0] if S == 1 else mx.concatenate(ys, axis=1)), states


def _by_step(x):
    """x [B, S, ...] -> S arrays [B, 1, ...] (no node when S is 1)."""
    return [x] if x.shape[1] == 1 else mx.split(x, x.shape[1], axis=1)


# Float32 prompt chunks this long run chunk-wise; half precision keeps step-by-step ops (docs/performance.md).
CHUNKED_PREFILL_MIN = 16
PREFILL_CHUNK = 16  # tokens per chunk of the chunk-wise recurrence


def gated_delta_prefill(gdn, x, mask, cache):
    """The layer's own forward over a prompt chunk and an mlx-lm ArraysCache, with the recurrence chunk-wise
    (`gated_delta_chunked`: equal to float rounding). Steps past a row's length leave its state as is."""
    B, S, _ = x.shape
    mixed, z, b, a = _project(gdn, x)  # [B, S, C], [B, S, Hv, Dv], [B, S, Hv] x2
    K = gdn.conv_kernel_size
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, K - 1, gdn.conv_dim), dtype=x.dtype)
    if mask is not None:
        mixed = mx.where(mask[..., None], mixed, 0)
    conv_input = mx.concatenate([conv_state, mixed], axis=1)  # [B, K-1+S, C]
    if cache.lengths is not None:
        ends = mx.clip(cache.lengths, 0, S)
        cache[0] = mx.take_along_axis(conv_input, (ends[:, None] + mx.arange(K - 1))[..., None], axis=1)
    else:
        cache[0] = mx.contiguous(conv_input[:, -(K - 1) :, :])
    conv_out = _conv_activation(gdn)(backends.causal_conv(gdn, conv_input, S))  # [B, S, C]
    q, k, v = split_qkv(gdn, conv_out)
    log_g = log_gate(gdn.A_log, a, gdn.dt_bias)  # [B, S, Hv]
    beta = mx.sigmoid(b)  # [B, S, Hv]
    if mask is not None:  # a padded step: g = 1, beta = 0
        log_g, beta = mx.where(mask[..., None], log_g, 0.0), mx.where(mask[..., None], beta, 0.0)
    out, cache[1] = chunked_gated_delta(q, k, v, log_g, beta, PREFILL_CHUNK, cache[1])
    cache.advance(S)
    out = gdn.norm(out, z)  # [B, S, Hv, Dv]
    return gdn.out_proj(out.reshape(B * S, -1)).reshape(B, S, -1)


def _run_layer(layer, x, mask, cache):
    if getattr(layer, "is_linear", False) and cache is not None:
        if getattr(cache, "keeps_steps", False):  # a decode slot cache (mtplx.decode.cache.SlotGDNCache)
            h = x + gated_delta_verify(layer.linear_attn, layer.input_layernorm(x), cache)
        elif backends.chunked_prefill(x):
            h = x + gated_delta_prefill(layer.linear_attn, layer.input_layernorm(x), mask, cache)
        else:
            return layer(x, mask, cache)
        return h + layer.mlp(layer.post_attention_layernorm(h))
    return layer(x, mask, cache)


def _layer_kinds(trunk) -> List[str]:
    return ["linear" if getattr(l, "is_linear", False) else "attn" for l in _text_model(trunk).layers]


QWEN = FamilyAdapter(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_moe", "qwen3_next"),
    text_model=_text_model,
    lm_head=_lm_head,
    hidden_after_norm=True,
    is_mtp_key=_is_mtp_key,
    build_head=_build_head,
    num_mtp_layers=_num_mtp_layers,
    run_layer=_run_layer,
    layer_kinds=_layer_kinds,
    hf_layout=_hf_layout,
    notes={"reference": "vLLM qwen3_next_mtp.py, qwen3_5_mtp.py"},
)
