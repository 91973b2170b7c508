"""The gated delta rule chunk-wise (the WY / UT-transform form), for prompt prefill and training.

Per head, state S [Dv, Dk]: S_t = g_t S_{t-1} + u_t k_t^T, u_t = b_t (v_t - g_t S_{t-1} k_t), y_t = S_t q_t.
Within a chunk, U = (I + A)^-1 (b V - (b G) K S_0^T), G_t = g_1...g_t, A strictly lower triangular: matrix
products instead of mlx-lm's op group per step. Equal to float rounding (`tests/test_prefill.py`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def _unit_lower_inverse(a: mx.array, size: int) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C] as (I - a)(I + a^2)(I + a^4)...: log2(C) products."""
    eye = mx.eye(size, dtype=a.dtype)
    x = -a
    inv = eye + x
    span = 2
    while span < size:
        x = x @ x
        inv = inv + inv @ x  # inv @ (I + x)
        span *= 2
    return inv


def chunked_gated_delta(q, k, v, log_g, beta, chunk: int = 32, state=None):
    """q, k [B, T, Hk, Dk] (normalised), v [B, T, Hv, Dv], log_g, beta [B, T, Hv], state [B, Hv, Dv, Dk]
    (None: zeros) -> y [B, T, Hv, Dv] and the state after step T. log_g = beta = 0 leaves the state as is."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    pad = (-T) % chunk
    if pad:
        widths = lambda nd: [(0, 0), (0, pad)] + [(0, 0)] * (nd - 2)
        q, k, v = (mx.pad(t, widths(4)) for t in (q, k, v))
        log_g, beta = (mx.pad(t, widths(3)) for t in (log_g, beta))
    N = (T + pad) // chunk

    def chunks(t):  # [B, T', H, ...] -> [B, H, N, C, ...]
        t = t.reshape(B, N, chunk, Hv, *t.shape[3:])
        return t.transpose(0, 3, 1, 2, *range(4, t.ndim))

    q, k, v = chunks(q), chunks(k), chunks(v)  # [B, H, N, C, D]
    log_g, beta = chunks(log_g), chunks(beta)  # [B, H, N, C]
    f32 = mx.float32
    q, k, v, log_g, beta = (t.astype(f32) for t in (q, k, v, log_g, beta))

    cum = mx.cumsum(log_g, axis=-1)  # [B, H, N, C] log G_t
    diff = cum[..., :, None] - cum[..., None, :]  # [B, H, N, C, C] log(G_t / G_s)
    idx = mx.arange(chunk)
    incl = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    ratio = mx.exp(mx.where(incl, diff, 0.0)) * incl  # G_t/G_s for s <= t, else 0

    kt = k.swapaxes(-1, -2)  # [B, H, N, Dk, C]
    a = beta[..., None] * (ratio * strict) * (k @ kt)  # [B, H, N, C, C]
    inv = _unit_lower_inverse(a, chunk)
    gate = mx.exp(cum)  # G_t
    w = inv @ ((beta * gate)[..., None] * k)  # [B, H, N, C, Dk]
    u0 = inv @ (beta[..., None] * v)  # [B, H, N, C, Dv]
    scores = ratio * (q @ kt)  # [B, H, N, C, C]
    q_gated = gate[..., None] * q  # [B, H, N, C, Dk]
    last = cum[..., -1:]  # [B, H, N, 1]
    k_to_end = mx.exp(last - cum)[..., None] * k  # [B, H, N, C, Dk]
    chunk_decay = mx.exp(last)[..., None]  # [B, H, N, 1, 1]

    state = mx.zeros((B, Hv, Dv, Dk), dtype=f32) if state is None else state.astype(f32)
    ys = []
    for n in range(N):
        st = state.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        u = u0[:, :, n] - w[:, :, n] @ st  # [B, H, C, Dv]
        ys.append(q_gated[:, :, n] @ st + scores[:, :, n] @ u)  # [B, H, C, Dv]
        state = chunk_decay[:, :, n] * state + u.swapaxes(-1, -2) @ k_to_end[:, :, n]
    y = mx.stack(ys, axis=2).reshape(B, Hv, N * chunk, Dv).transpose(0, 2, 1, 3)
    return y[:, :T].astype(v.dtype), state


def log_gate(A_log, a, dt_bias):
    """log g of mlx-lm's compute_g: g = exp(-exp(A_log) * softplus(a + dt_bias))."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)
