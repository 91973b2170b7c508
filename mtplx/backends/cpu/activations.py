"""Exp-heavy ops with an exp the CPU backend runs faster.

MLX's CPU `exp` (behind `sigmoid`, `silu` and `softmax`) computes one
element at a time: 12.5 ms per million floats on this machine, where an add
takes 0.16 ms and NumPy's exp 0.6 ms. A prompt pass applies `silu` to every
hidden unit of every token and a softmax to every query-key pair, so exps
are a large share of a prefill (batch 16, 128-token prompts, built-in
model: about 60% of it, in the MLPs, attention, and Qwen's gated-delta conv
and gated norm), and a fair share of a decode step at batch 16.

Two replacements, because a compiled decode pass and an eager prompt pass
favour different ones (both in float32; half-precision models keep mlx-lm's
ops, see `use_fast_activations`):
- prompt passes (at least `FAST_MIN_POSITIONS` positions per row):
  `fast_exp`, the textbook range reduction exp(x) = 2^n exp(r),
  |r| <= ln2 / 2, a degree-6 polynomial for exp(r) and 2^n built in the
  exponent bits: 3.4 ms per million, relative error at most 2.5e-7 over
  [-87, 88] (MLX's exp: 3.9e-6); 0 below that range and exp(88) above, so
  a sigmoid still saturates, a masked softmax entry weighs nothing, and NaN
  stays NaN. Its exponent-bits view splits a compiled graph's fused
  kernels, which at batch 1 cost more graph nodes than its exps save.
- decode steps and verifies: `pow_exp`, 2^(x log2 e) with MLX's `power`,
  which runs faster than its `exp` and fuses as `exp` does; within 3.7e-6
  of exp. It is used at every batch size and verify width, so a row's
  decode numerics do not depend on them (`tests/test_gemm_layout.py`).

`use_fast_activations` swaps, in place and once, the mlx-lm classes whose
exp-heavy op it replaces (`_swaps`) for subclasses that run the same ops
with these exps: dense MLPs' SwiGLU, Qwen's attention (its softmax, as
`fast_attention`, and the output gate) and gated RMSNorm, and the
gated-delta conv's silu (read by MTPLX's own verify and prefill forwards).
A prompt pass's attention runs in blocks of query rows, each reading keys
up to its last query (`QUERY_BLOCK_SCORES`).
Mixture-of-experts MLPs keep mlx-lm's. Only on the CPU: GPU backends
vectorise exp. Like `gemm_layout`, `mtplx.load` leaves the model as mlx-lm
computes it; the runtime and the cost measurements that plan for it swap
the model they decode with.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mtplx.backends.cpu.gemm_layout import token_rows
from mtplx.backends.cpu.rope_angles import RopeSpec, matches_fast_rope, rotate, spec_of

_LOG2E = 1.4426950408889634
# ln 2 in two parts (Cody-Waite): n * _LN2_HI is exact for |n| < 2^15, so
# the reduction loses no bits for large |x|.
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_INV_FACTORIALS = (1.0, 1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 x, as elementwise ops that compile into one kernel."""
    low = x < -87.0  # exp underflows: 0, as a masked softmax entry must be
    x = mx.clip(x, -87.0, 88.0)
    n = mx.floor(x * _LOG2E + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln2 / 2
    p = _INV_FACTORIALS[-1]
    for c in reversed(_INV_FACTORIALS[:-1]):
        p = p * r + c  # Horner: sum r^i / i!
    two_n = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # 2^n in the exponent bits
    return mx.where(low, 0.0, p * two_n)


# Passes over this many positions per row (x [B, T, ...]) take the fast
# forms: prompt chunks (the same bound as the chunk-wise gated-delta prefill,
# families.qwen.CHUNKED_PREFILL_MIN), never a decode step or verify.
FAST_MIN_POSITIONS = 16  # above any verify: mtp_patch.MAX_DEPTH + 1 positions


def _prompt_pass(x: mx.array) -> bool:
    return x.ndim >= 2 and x.shape[1] >= FAST_MIN_POSITIONS


# -- decode passes: exp as a power of two ---------------------------------------
# MLX's CPU `power` runs faster than its `exp` (4.8 against 12.3 ms per
# million floats here) and fuses into a compiled graph's kernels as exp
# does (60 silus over 288 floats: 0.24 ms against 0.52 with exp, 1.3-3.7
# with the polynomial).


def pow_exp(x: mx.array) -> mx.array:
    """exp(x) as 2^(x log2 e): within 3.7e-6 of exp, as MLX's own CPU exp."""
    return mx.power(2.0, x * _LOG2E)


def _forms(exp, **compile_args) -> tuple:
    """sigmoid, silu, swiglu (mlx-lm's: silu(gate) * x), precise_swiglu
    (mlx-lm's: (h, gate, x) -> silu(gate) * x in h's dtype) and the float32
    softmax over the last axis, unmasked and where `allowed` (bool,
    broadcastable), each with `exp`, in float32, rounded to the input's dtype."""
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
    # (The softmaxes are traced per shape: a shapeless trace of their
    # reductions crashed MLX 0.32.)
    return (*elementwise, mx.compile(softmax), mx.compile(masked_softmax))


# Prompt passes: the polynomial, traced per shape (its exponent-bits view has no shapeless form).
_fast_sigmoid, fast_silu, fast_swiglu, fast_precise_swiglu, _softmax, _masked_softmax = _forms(fast_exp)
# Decode passes: the power.
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
) -> mx.array:
    """What `mx.fast.scaled_dot_product_attention` computes on the CPU (its
    fallback: scores, a float32 softmax, values), with `fast_exp`, or with
    `pow_exp` for a decode pass (`step`).
    q [B, Hq, L, D], k and v [B, Hkv, S, D] (Hq a multiple of Hkv); mask
    None, "causal", bool (True: attend) or additive, broadcastable to
    [B, Hq, L, S] -> [B, Hq, L, Dv].

    A prompt pass whose scores pass `block_scores` floats (default
    `QUERY_BLOCK_SCORES`) runs in blocks of query rows. `causal`: the
    queries are the last L of the S key positions and the mask lets none of
    them see a later one ("causal" always is), so a block reads keys only up
    to its own last query's position."""
    L, S = q.shape[2], k.shape[2]
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


# Scores (floats) a prompt pass's attention computes at once. MLX's CPU
# kernels stream their operands through memory, and the softmax over a
# score array that outgrows the cache runs several times slower per score
# (the compiled softmax on the built-in model's batch-4 shapes: 6.3 ns a
# score up to 0.26M, 15 ns at 1M, 21 ns at 4.2M). In blocks of query rows
# it stays small, and under a causal mask each block skips the keys after
# its last query (about half of them). Prefills on the built-in model,
# against one block (two each, one process): 4 prompts of 512 tokens
# 534-575 ms against 1286-1319 (attention had been 73% of it), 4 of 1000
# 1345-1402 against 3385-3484, one of 2000 1103-1211 against 2561-2680,
# 16 of 128 360 against 399-454; one of 128 (no blocks) 39-40 either way.
QUERY_BLOCK_SCORES = 1 << 17
QUERY_BLOCK_MIN_ROWS = 16


def _query_block_rows(B: int, Hq: int, L: int, S: int, block_scores: int) -> int:
    """Query rows per block (a multiple of QUERY_BLOCK_MIN_ROWS), or 0 when
    the scores of all L rows fit in `block_scores`."""
    if B * Hq * L * S <= block_scores:
        return 0
    rows = max(QUERY_BLOCK_MIN_ROWS, block_scores // (B * Hq * S) // QUERY_BLOCK_MIN_ROWS * QUERY_BLOCK_MIN_ROWS)
    return rows if rows < L else 0


def _mask_block(mask, L: int, S: int, a: int, b: int, end: int):
    """Query rows a:b and keys :end of a mask broadcastable to [.., L, S]
    (axes of size 1 broadcast and stay)."""
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
    # The rep query heads of a key group are the rows of one product with its
    # keys, rather than rep products over keys broadcast along a rep axis.
    # Each score is the same dot product (bit for bit here); one attention
    # of the built-in model at batch 4 over 192 keys took 209 against 255 us
    # (3 queries), 141 against 167 us (1 query), eager.
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
    # Qwen3NextAttention's own __call__, with the faster exps: fast_attention
    # and the output gate over the polynomial on prompt passes, over pow_exp
    # on decode passes.
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
        # A prompt pass runs over an mlx-lm cache (or none), which holds just
        # the positions before and of these queries, under the causal mask
        # the family's forward made for it; slot caches read past the rows.
        causal = mask is not None and not getattr(cache, "per_row_lengths", False)
        output = fast_attention(queries, keys, values, self.scale, mask, causal=causal)
        gate = _fast_sigmoid(gate)
    else:
        output = fast_attention(queries, keys, values, self.scale, mask, step=True)
        gate = step_sigmoid(gate)
    output = output.transpose(0, 2, 1, 3).reshape(B * L, -1)
    return self.o_proj(output * gate).reshape(B, L, -1)


def _normed_heads(self, queries: mx.array, keys: mx.array) -> mx.array:
    """queries [B, L, Hq, D] and keys [B, L, Hkv, D], each through its own
    RMSNorm, as one [B, Hq + Hkv, L, D]. Where the layer's norms are plain
    RMSNorms of one eps (`prepare_qk_norms` then left their weights side by
    side), one norm runs over the heads side by side: every row gets the same
    ops, bit for bit, and a pass has 4 fewer nodes per attention layer (a
    one-token step 0.975x the time at batch 1 and 4, a verify over 3 tokens
    0.96-0.99x, interleaved in one process)."""
    prepared = getattr(self, "qk_norm_weights", None)
    if prepared is not None and prepared[0] is self.q_norm.weight and prepared[1] is self.k_norm.weight:
        both = mx.concatenate([queries, keys], axis=2)  # [B, L, Hq + Hkv, D]
        both = mx.fast.rms_norm(both, None, self.q_norm.eps) * prepared[2]  # x [Hq + Hkv, D] weights
    else:  # norms not prepared (or their weights replaced since): one each
        both = mx.concatenate([self.q_norm(queries), self.k_norm(keys)], axis=2)
    return both.transpose(0, 2, 1, 3)


def prepare_qk_norms(module) -> None:
    """Lay out the query and key norms' weights of every swapped Qwen
    attention under `module` as one [Hq + Hkv, D] array, once, ahead of the
    passes (built inside a compiled trace, it would be a node of every
    pass), where both norms are plain RMSNorms of one eps."""
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
    """The query and key heads [B, Hq + Hkv, L, D] (queries first) rotated in
    one RoPE call and split -> queries [B, Hq, L, D], keys [B, Hkv, L, D].
    On the CPU RoPE runs as ops (positions, their cos and sin, the
    rotation), so a call per tensor built those twice a layer; each element
    gets the same arithmetic either way. `angles`: a pass's
    `PassPositions`, whose cos and sin, where it has them, were made once
    for every layer of the pass (`shared_rope_spec`)."""
    if getattr(angles, "cos", None) is not None:
        heads = rotate(heads, rope.dims, angles.cos, angles.sin)
    else:
        heads = rope(heads, **offset)
    return heads[:, :n_queries], heads[:, n_queries:]


def shared_rope_spec(model) -> Optional[RopeSpec]:
    """The RoPE of every attention layer of the trunk, where each rotates
    with a pass's angles (`_rope_together`): all are this module's Qwen
    attention, all with one plain RoPE, and `rope_angles` gives that RoPE's
    bits here. None otherwise (each layer then rotates on its own)."""
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
    # The same as each of _swiglu_mlps' own __call__, with the faster exps,
    # over the tokens as rows of one matrix (`token_rows`).
    act = fast_swiglu if _prompt_pass(x) else step_swiglu
    rows = token_rows(x)  # [N, H]
    out = self.down_proj(act(self.gate_proj(rows), self.up_proj(rows)))  # [N, H]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _swiglu_mlps() -> tuple:
    """The mlx-lm MLP classes whose __call__ is down_proj(swiglu(gate_proj(x), up_proj(x)))."""
    from mlx_lm.models import deepseek_v3, glm4_moe, glm4_moe_lite, mimo, qwen3_next

    return (qwen3_next.Qwen3NextMLP, deepseek_v3.DeepseekV3MLP, glm4_moe.MLP, glm4_moe_lite.Glm4MoeLiteMLP, mimo.MLP)


def _swaps() -> dict:
    """mlx-lm class -> what its Fast subclass overrides. The gated-delta
    layers keep their own __call__ (which MTPLX's verify and prefill forwards
    replace, `families.qwen`); those read `conv_activation`."""
    from mlx_lm.models import qwen3_5, qwen3_next

    swaps = {cls: {"__call__": _swiglu_mlp_call} for cls in _swiglu_mlps()}
    swaps[qwen3_next.Qwen3NextRMSNormGated] = {"__call__": _gated_norm_call}
    swaps[qwen3_next.Qwen3NextAttention] = {"__call__": _qwen_attention_call}
    for cls in (qwen3_next.Qwen3NextGatedDeltaNet, qwen3_5.GatedDeltaNet):
        swaps[cls] = {"conv_activation": staticmethod(conv_silu)}
    return swaps


_fast_classes: dict = {}


def use_fast_activations(model) -> int:
    """Swap, in place and once, the exp-heavy ops of an MTPModel's trunk and
    head (module docstring) for their faster-exp forms, where MLX runs on
    the CPU and the model computes in float32; records and returns the count
    of modules swapped in `model.info["fast_activations"]`.

    A half-precision model keeps mlx-lm's ops: it rounds every op's output to
    8 (bf16) or 11 (fp16) bits, so an exp off by 1e-6 now and then moves an
    activation by a whole step, and greedy output off mlx-lm's at near-ties.
    A random bf16 checkpoint's trunk logits moved by up to 0.031 that way,
    and mlx-lm's own greedy output on that model object changed in 3 rows of
    10 (in float32: within 1e-5, the same tokens)."""
    from mtplx.backends.cpu.gemm_layout import once_on_cpu

    if activation_dtype(model) != mx.float32:
        return 0
    return once_on_cpu(model, "fast_activations", _swap)


def activation_dtype(model) -> mx.Dtype:
    """The dtype a model's hidden states take: its embedding's (the scales'
    where the embedding is quantised)."""
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
    """A subclass of an mlx-lm class with `overrides` (the weights, names and
    everything else are the instance's own)."""
    if cls not in _fast_classes:
        _fast_classes[cls] = type(f"Fast{cls.__name__}", (cls,), overrides)
    return _fast_classes[cls]
