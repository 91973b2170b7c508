"""Exp-heavy ops over an exp the CPU backend runs faster (float32 models only).

MLX's CPU `exp` runs one element at a time (docs/performance.md). Prompt passes (>= `FAST_MIN_POSITIONS`
positions per row) use `fast_exp`, a polynomial with 2^n built in the exponent bits; decode passes use
`pow_exp`, which fuses into compiled kernels where that bit view splits them, at every batch size and verify
width alike. `use_fast_activations` swaps the mlx-lm classes in `_swaps` for subclasses over these exps;
`mtplx.load` leaves the model as mlx-lm computes it, the runtime swaps the model it decodes with.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mtplx.backends.cpu.gemm_layout import token_rows
from mtplx.backends.cpu.rope_angles import RopeSpec, matches_fast_rope, rotate, spec_of

_LOG2E = 1.4426950408889634
# ln 2 in two parts (Cody-Waite): n * _LN2_HI is exact for |n| < 2^15, so the reduction loses no bits.
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_INV_FACTORIALS = (1.0, 1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x), float32: 0 below -87, exp(88) above (a sigmoid saturates, a masked entry weighs 0, NaN stays)."""
    low = x < -87.0  # exp underflows: 0, as a masked softmax entry must be
    x = mx.clip(x, -87.0, 88.0)
    n = mx.floor(x * _LOG2E + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln2 / 2
    p = _INV_FACTORIALS[-1]
    for c in reversed(_INV_FACTORIALS[:-1]):
        p = p * r + c  # Horner: sum r^i / i!
    two_n = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # 2^n in the exponent bits
    return mx.where(low, 0.0, p * two_n)


# Passes over this many positions per row (x [B, T, ...]) are prompt chunks (as backends.CHUNKED_PREFILL_MIN).
FAST_MIN_POSITIONS = 16  # above any verify: mtplx.decode.contract.MAX_DEPTH + 1 positions


def _prompt_pass(x: mx.array) -> bool:
    return x.ndim >= 2 and x.shape[1] >= FAST_MIN_POSITIONS


def pow_exp(x: mx.array) -> mx.array:
    """exp(x) as 2^(x log2 e): MLX's CPU `power` runs faster than its `exp` and fuses the same way."""
    return mx.power(2.0, x * _LOG2E)


def _forms(exp, **compile_args) -> tuple:
    """sigmoid, silu, swiglu, precise_swiglu and softmax (plain and masked by bool `allowed`) over `exp`."""
    f32 = mx.float32

    def sigmoid(x):
        return (1.0 / (1.0 + exp(-x.astype(f32)))).astype(x.dtype)

    def silu(x):
        x32 = x.astype(f32)
        return (x32 / (1.0 + exp(-x32))).astype(x.dtype)

    def precise_swiglu(h, gate, x):
        g = gate.astype(f32)
        return (g / (1.0 + exp(-g)) * x.astype(f32)).astype(h.dtype)

    def swiglu(gate, x):
        return precise_swiglu(x, gate, x)

    def softmax(scores):
        scores = scores.astype(f32)
        e = exp(scores - scores.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def masked_softmax(scores, allowed):
        return softmax(mx.where(allowed, scores.astype(f32), -mx.inf))

    elementwise = [mx.compile(f, **compile_args) for f in (sigmoid, silu, swiglu, precise_swiglu)]
    # The softmaxes are traced per shape: a shapeless trace of their reductions crashed MLX 0.32.
    return (*elementwise, mx.compile(softmax), mx.compile(masked_softmax))


# Prompt passes: the polynomial, traced per shape (its bit view has no shapeless form); decode: the power.
_fast_sigmoid, fast_silu, fast_swiglu, fast_precise_swiglu, _softmax, _masked_softmax = _forms(fast_exp)
step_sigmoid, step_silu, step_swiglu, step_precise_swiglu, _step_softmax, _step_masked_softmax = _forms(
    pow_exp, shapeless=True
)


def conv_silu(x: mx.array) -> mx.array:
    """The gated-delta layers' conv activation, x [B, S, C]."""
    return fast_silu(x) if _prompt_pass(x) else step_silu(x)


def fast_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask,
    step: bool = False,
    causal: bool = False,
    block_scores: Optional[int] = None,
    block_rows: Optional[int] = None,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`'s CPU fallback over `fast_exp`, or `pow_exp` for a decode pass
    (`step`). q [B, Hq, L, D], k, v [B, Hkv, S, D]; mask None, "causal", bool (True: attend) or additive,
    broadcastable to [B, Hq, L, S] -> [B, Hq, L, Dv]. Past `block_scores` scores a prompt pass runs in blocks
    of query rows; `causal` (queries are the last L of S positions, none sees a later one) lets a block skip
    the keys after its last query; `block_rows` fixes the rows per block (causal), so a query's keys end where
    its block of that many rows ends, whatever the batch and the pass's length (`ALIGNED_BLOCK_ROWS`)."""
    L, S = q.shape[2], k.shape[2]
    if block_rows and not step:
        rows = block_rows if block_rows < L else 0
    else:
        rows = 0 if step else _query_block_rows(q.shape[0], q.shape[1], L, S, block_scores or QUERY_BLOCK_SCORES)
    if not rows:
        return _attention(q, k, v, scale, mask, step)
    causal = causal or (isinstance(mask, str) and mask == "causal")
    out = []
    for a in range(0, L, rows):
        b = min(a + rows, L)
        end = S - L + b if causal else S  # keys past the block's last query are masked for all of it
        block_mask = mask if isinstance(mask, str) else _mask_block(mask, L, S, a, b, end)
        out.append(_attention(q[:, :, a:b], k[:, :, :end], v[:, :, :end], scale, block_mask, step=False))
    return mx.concatenate(out, axis=2)  # [B, Hq, L, Dv]


# Scores computed at once: a softmax over more than the cache holds runs slower per score (docs/performance.md).
QUERY_BLOCK_SCORES = 1 << 17
QUERY_BLOCK_MIN_ROWS = 16
# A causal prompt pass over an mlx-lm cache takes blocks of this many query rows. A prompt pass's forwards start
# and end on multiples of it (`mtplx.decode.prefill.chunk_ranges`), so a query reads the keys up to its block's
# end whatever the batch, its longest prompt or a shared prefix: a softmax over more (masked) keys rounds apart.
ALIGNED_BLOCK_ROWS = 16


def _query_block_rows(B: int, Hq: int, L: int, S: int, block_scores: int) -> int:
    """Query rows per block (a multiple of QUERY_BLOCK_MIN_ROWS); 0 when all L rows' scores fit."""
    if B * Hq * L * S <= block_scores:
        return 0
    rows = max(QUERY_BLOCK_MIN_ROWS, block_scores // (B * Hq * S) // QUERY_BLOCK_MIN_ROWS * QUERY_BLOCK_MIN_ROWS)
    return rows if rows < L else 0


def _mask_block(mask, L: int, S: int, a: int, b: int, end: int):
    """Query rows a:b and keys :end of a mask broadcastable to [.., L, S] (size-1 axes stay)."""
    if mask is None or mask.ndim < 2:
        return mask
    rows = slice(a, b) if mask.shape[-2] == L else slice(None)
    keys = slice(0, end) if mask.shape[-1] == S else slice(None)
    return mask[..., rows, keys]


def _attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask, step: bool) -> mx.array:
    """fast_attention over all of q's rows at once."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    # A key group's rep query heads are the rows of one product with its keys: same dot products, faster.
    q = (q * scale).reshape(B, Hkv, rep * L, D)
    scores = (q @ k.swapaxes(-1, -2)).reshape(B, Hkv, rep, L, S)
    allowed = None
    if isinstance(mask, str):  # "causal": query i sits at position S - L + i
        allowed = mx.arange(S)[None, :] <= (S - L + mx.arange(L))[:, None]  # [L, S]
    elif mask is not None:
        mask = _per_group(mask, Hkv, rep)
        if mask.dtype == mx.bool_:
            allowed = mask
        else:
            scores = scores + mask
    softmax, masked = (_step_softmax, _step_masked_softmax) if step else (_softmax, _masked_softmax)
    p = (softmax(scores) if allowed is None else masked(scores, allowed)).astype(v.dtype)  # [B, Hkv, rep, L, S]
    return (p.reshape(B, Hkv, rep * L, S) @ v).reshape(B, Hq, L, -1)


def _per_group(mask: mx.array, Hkv: int, rep: int) -> mx.array:
    """A mask over [(B,) (H,) L, S] laid out over [B, Hkv, rep, L, S]."""
    if mask.ndim < 4 or mask.shape[1] == 1:
        return mask[..., None, :, :] if mask.ndim == 4 else mask
    return mask.reshape(mask.shape[0], Hkv, rep, *mask.shape[2:])


def _qwen_attention_call(self, x: mx.array, mask=None, cache=None) -> mx.array:
    # Qwen3NextAttention's own __call__ with the faster exps (softmax and output gate).
    if hasattr(cache, "bits"):  # a quantized KV cache: mlx-lm's own attention
        return type(self).__bases__[0].__call__(self, x, mask, cache)
    B, L, D = x.shape
    prompt = _prompt_pass(x)
    x = token_rows(x)  # [B*L, D]: the projections' GEMMs without a Flatten and Unflatten each
    queries, gate = mx.split(self.q_proj(x).reshape(B, L, self.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B * L, -1)
    keys, values = self.k_proj(x), self.v_proj(x)
    heads = _normed_heads(self, queries, keys.reshape(B, L, self.num_key_value_heads, -1))  # [B, Hq + Hkv, L, D]
    values = values.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    if cache is not None:
        queries, keys = _rope_together(
            self.rope, heads, self.num_attention_heads, offset=cache.offset, angles=getattr(cache, "positions", None)
        )
        keys, values = cache.update_and_fetch(keys, values)
    else:
        queries, keys = _rope_together(self.rope, heads, self.num_attention_heads)
    if prompt:
        # Causal blocks only over an mlx-lm cache (or none): it holds just the positions up to these queries.
        causal = mask is not None and not getattr(cache, "per_row_lengths", False)
        rows = ALIGNED_BLOCK_ROWS if causal else None
        output = fast_attention(queries, keys, values, self.scale, mask, causal=causal, block_rows=rows)
        gate = _fast_sigmoid(gate)
    else:
        output = fast_attention(queries, keys, values, self.scale, mask, step=True)
        gate = step_sigmoid(gate)
    output = output.transpose(0, 2, 1, 3).reshape(B * L, -1)
    return self.o_proj(output * gate).reshape(B, L, -1)


def _normed_heads(self, queries: mx.array, keys: mx.array) -> mx.array:
    """queries [B, L, Hq, D], keys [B, L, Hkv, D] normed -> [B, Hq + Hkv, L, D]: one norm over both where
    `prepare_qk_norms` laid their weights side by side (bit for bit, fewer graph nodes)."""
    prepared = getattr(self, "qk_norm_weights", None)
    if prepared is not None and prepared[0] is self.q_norm.weight and prepared[1] is self.k_norm.weight:
        both = mx.concatenate([queries, keys], axis=2)  # [B, L, Hq + Hkv, D]
        both = mx.fast.rms_norm(both, None, self.q_norm.eps) * prepared[2]  # x [Hq + Hkv, D] weights
    else:  # norms not prepared (or their weights replaced since): one each
        both = mx.concatenate([self.q_norm(queries), self.k_norm(keys)], axis=2)
    return both.transpose(0, 2, 1, 3)


def prepare_qk_norms(module) -> None:
    """Lay out the q and k norm weights (plain RMSNorms of one eps) of every swapped Qwen attention as one
    [Hq + Hkv, D] array, once: in a compiled trace it would be a node of every pass."""
    for _, m in module.named_modules():
        if getattr(type(m), "__call__", None) is not _qwen_attention_call:
            continue
        q, k = m.q_norm, m.k_norm
        if type(q) is not nn.RMSNorm or type(k) is not nn.RMSNorm or q.eps != k.eps:
            continue
        D = q.weight.shape[-1]
        weights = mx.concatenate(
            [
                mx.broadcast_to(q.weight, (m.num_attention_heads, D)),
                mx.broadcast_to(k.weight, (m.num_key_value_heads, D)),
            ]
        )
        mx.eval(weights)
        # Beside the parameters, not among them (nn.Module registers arrays set as attributes).
        object.__setattr__(m, "qk_norm_weights", (q.weight, k.weight, weights))


def _rope_together(rope, heads: mx.array, n_queries: int, angles=None, **offset):
    """Heads [B, Hq + Hkv, L, D] rotated in one RoPE call (ops on the CPU) -> queries, keys; `angles`: the
    pass's `PassPositions`, whose cos and sin (if any) serve every layer."""
    if getattr(angles, "cos", None) is not None:
        heads = rotate(heads, rope.dims, angles.cos, angles.sin)
    else:
        heads = rope(heads, **offset)
    return heads[:, :n_queries], heads[:, n_queries:]


def shared_rope_spec(model) -> Optional[RopeSpec]:
    """The one plain RoPE of every trunk attention layer, where all are this module's Qwen attention and
    `rope_angles` gives that RoPE's bits on this device; None otherwise (each layer rotates on its own)."""
    specs, head_dims = set(), set()
    for layer, kind in zip(model.text_model.layers, model.layer_kinds):
        if kind != "attn":
            continue
        attn = getattr(layer, "self_attn", None)
        if getattr(type(attn), "__call__", None) is not _qwen_attention_call:
            return None
        specs.add(spec_of(attn.rope))
        head_dims.add(int(attn.head_dim))
    if len(specs) != 1 or None in specs or len(head_dims) != 1:
        return None
    spec = specs.pop()
    return spec if matches_fast_rope(spec, head_dims.pop(), activation_dtype(model)) else None


def _gated_norm_call(self, hidden_states: mx.array, gate=None) -> mx.array:
    # Qwen3NextRMSNormGated's own __call__, with the faster exps.
    x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
    if gate is not None:
        return (fast_precise_swiglu if _prompt_pass(gate) else step_precise_swiglu)(hidden_states, gate, x)
    return x.astype(hidden_states.dtype)


def _swiglu_mlp_call(self, x: mx.array) -> mx.array:
    # _swiglu_mlps' own __call__ with the faster exps, over the tokens as rows of one matrix.
    act = fast_swiglu if _prompt_pass(x) else step_swiglu
    rows = token_rows(x)  # [N, H]
    out = self.down_proj(act(self.gate_proj(rows), self.up_proj(rows)))  # [N, H]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _swiglu_mlps() -> tuple:
    """The mlx-lm MLP classes whose __call__ is down_proj(swiglu(gate_proj(x), up_proj(x)))."""
    from mlx_lm.models import deepseek_v3, glm4_moe, glm4_moe_lite, mimo, qwen3_next

    return (qwen3_next.Qwen3NextMLP, deepseek_v3.DeepseekV3MLP, glm4_moe.MLP, glm4_moe_lite.Glm4MoeLiteMLP, mimo.MLP)


def _swaps() -> dict:
    """mlx-lm class -> its Fast overrides; gated-delta layers get the `conv_activation` our forwards read."""
    from mlx_lm.models import qwen3_5, qwen3_next

    swaps = {cls: {"__call__": _swiglu_mlp_call} for cls in _swiglu_mlps()}
    swaps[qwen3_next.Qwen3NextRMSNormGated] = {"__call__": _gated_norm_call}
    swaps[qwen3_next.Qwen3NextAttention] = {"__call__": _qwen_attention_call}
    for cls in (qwen3_next.Qwen3NextGatedDeltaNet, qwen3_5.GatedDeltaNet):
        swaps[cls] = {"conv_activation": staticmethod(conv_silu)}
    return swaps


_fast_classes: dict = {}


def use_fast_activations(model) -> int:
    """Swap, in place and once, the exp-heavy ops of a float32 MTPModel on the CPU; returns the count (kept in
    `model.info["fast_activations"]`). Half precision keeps mlx-lm's ops: its rounding turns a slightly
    different exp into whole-step activation changes, and greedy output off mlx-lm's (docs/performance.md)."""
    from mtplx.backends.cpu.gemm_layout import once_on_cpu

    if activation_dtype(model) != mx.float32:
        return 0
    return once_on_cpu(model, "fast_activations", _swap)


def activation_dtype(model) -> mx.Dtype:
    """The dtype of a model's hidden states: its embedding's (the scales' where quantised)."""
    emb = model.text_model.embed_tokens
    return emb.scales.dtype if "scales" in emb else emb.weight.dtype


def _swap(module) -> int:
    swaps = _swaps()
    count = 0
    for _, m in module.named_modules():
        if type(m) in swaps:
            m.__class__ = _fast_class(type(m), swaps[type(m)])
            count += 1
    prepare_qk_norms(module)
    return count


def _fast_class(cls, overrides: dict):
    """A subclass of an mlx-lm class with `overrides`; weights, names and the rest stay the instance's."""
    if cls not in _fast_classes:
        _fast_classes[cls] = type(f"Fast{cls.__name__}", (cls,), overrides)
    return _fast_classes[cls]
