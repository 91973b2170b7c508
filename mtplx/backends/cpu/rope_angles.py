"""RoPE angles made once per trunk pass instead of once per attention layer.

On the CPU, `mx.fast.rope` runs as MLX's fallback ops: from the rows'
offsets it builds the positions, the inverse frequencies, their product and
its cosine and sine, then rotates. Every attention layer of a pass rotates
at the same positions, yet in a staged pass (`mtplx.compiled.StagedPass`,
one graph per layer) each layer built those angles again: 8 of the 75 nodes
of an attention layer's decode graph on the built-in model. A pass now
builds them once (`cache.pass_positions`) with the fallback's own ops, in
its order, and each layer rotates with them as the fallback does, so every
element gets the same arithmetic and the same bits (`matches_fast_rope`
checks that on this machine before any pass relies on it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from functools import lru_cache
from typing import NamedTuple, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class RopeSpec(NamedTuple):
    """What the angles of a non-traditional `nn.RoPE` depend on, besides the positions."""

    dims: int
    base: float
    scale: float


def spec_of(rope) -> Optional[RopeSpec]:
    """The spec of a plain, non-traditional `nn.RoPE` (None for any other
    rotation: scaled variants compute other frequencies)."""
    if type(rope) is not nn.RoPE or rope.traditional or rope.base is None:
        return None
    return RopeSpec(int(rope.dims), float(rope.base), float(rope.scale))


def rope_angles(lengths: mx.array, T: int, spec: RopeSpec) -> Tuple[mx.array, mx.array]:
    """float32 cos and sin [B, 1, T, dims/2] of the T positions after each
    row's `lengths` [B] (int32), as the fallback of `mx.fast.rope` makes them."""
    positions = (mx.arange(T, dtype=mx.float32) + lengths[:, None, None]) * spec.scale  # [B, 1, T]
    theta = positions[..., None] * _inverse_frequencies(spec)  # [B, 1, T, dims/2]
    return mx.cos(theta), mx.sin(theta)


def rotate(x: mx.array, dims: int, cos: mx.array, sin: mx.array) -> mx.array:
    """x [B, N, T, D] rotated by the angles of `rope_angles` over its first
    `dims` features, as `mx.fast.rope(x, dims, traditional=False, ...)`."""
    half = dims // 2
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:dims]
    parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return mx.concatenate(parts, axis=-1)


@lru_cache(maxsize=None)
def _inverse_frequencies(spec: RopeSpec) -> mx.array:
    """float32 [dims/2]: exp(-i * log(base) / (dims/2)) for i = 0..dims/2-1,
    with the fallback's float32 constant; made once per spec, not in every
    pass (they depend on no position)."""
    half = spec.dims // 2
    step = np.float32(_logf(spec.base)) / np.float32(half)
    freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step, dtype=mx.float32))
    mx.eval(freqs)
    return freqs


@lru_cache(maxsize=None)
def _logf(x: float) -> float:
    """The C library's single-precision log, which the fallback's
    `std::log(float)` calls; Python's own log rounds from double and can land
    one unit away. Where no C library answers, the double rounded to float32
    (`matches_fast_rope` then decides whether it will do)."""
    name = ctypes.util.find_library("m")
    try:
        libm = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        logf = libm.logf
    except (OSError, AttributeError):
        return float(np.float32(math.log(x)))
    logf.restype, logf.argtypes = ctypes.c_float, [ctypes.c_float]
    return float(logf(x))


@lru_cache(maxsize=None)
def matches_fast_rope(spec: RopeSpec, head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether `rotate` over `rope_angles` gives `mx.fast.rope`'s bits on
    this device, over rows at offsets from 0 to past 100,000 and a few
    positions each."""
    offsets = mx.array([0, 1, 127, 4093, 65531, 131071], dtype=mx.int32)
    T = 3
    x = mx.random.normal((len(offsets), 2, T, head_dim), key=mx.random.key(0)).astype(dtype)
    cos, sin = rope_angles(offsets, T, spec)
    ours = rotate(x, spec.dims, cos, sin)
    theirs = mx.fast.rope(x, spec.dims, traditional=False, base=spec.base, scale=spec.scale, offset=offsets)
    return bool(mx.array_equal(ours, theirs).item())
