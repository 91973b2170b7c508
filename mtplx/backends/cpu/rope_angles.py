"""RoPE angles made once per trunk pass instead of once per attention layer.

On the CPU `mx.fast.rope` runs as fallback ops that build the angles in every attention layer. A pass builds
them once (`mtplx.decode.cache.pass_positions`) with the fallback's own ops, and each layer rotates as the
fallback does: the same bits, which `matches_fast_rope` checks on this device before a pass relies on it.
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
    """The spec of a plain, non-traditional `nn.RoPE`; None for others (scaled variants differ)."""
    if type(rope) is not nn.RoPE or rope.traditional or rope.base is None:
        return None
    return RopeSpec(int(rope.dims), float(rope.base), float(rope.scale))


def rope_angles(lengths: mx.array, T: int, spec: RopeSpec) -> Tuple[mx.array, mx.array]:
    """float32 cos, sin [B, 1, T, dims/2] of the T positions after each row's `lengths` [B], as the fallback's."""
    positions = (mx.arange(T, dtype=mx.float32) + lengths[:, None, None]) * spec.scale  # [B, 1, T]
    theta = positions[..., None] * _inverse_frequencies(spec)  # [B, 1, T, dims/2]
    return mx.cos(theta), mx.sin(theta)


def rotate(x: mx.array, dims: int, cos: mx.array, sin: mx.array) -> mx.array:
    """x [B, N, T, D] rotated by `rope_angles` over its first `dims` features, as `mx.fast.rope`."""
    half = dims // 2
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:dims]
    parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return mx.concatenate(parts, axis=-1)


@lru_cache(maxsize=None)
def _inverse_frequencies(spec: RopeSpec) -> mx.array:
    """float32 [dims/2]: exp(-i * log(base) / (dims/2)) with the fallback's float32 constant, once per spec."""
    half = spec.dims // 2
    step = np.float32(_logf(spec.base)) / np.float32(half)
    freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step, dtype=mx.float32))
    mx.eval(freqs)
    return freqs


@lru_cache(maxsize=None)
def _logf(x: float) -> float:
    """The C library's `logf`, which the fallback calls (Python's log rounds from double and can land one
    unit away); without one, the double rounded to float32, for `matches_fast_rope` to judge."""
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
    """Whether `rotate` over `rope_angles` gives `mx.fast.rope`'s bits on this device, offsets 0 to 131071."""
    offsets = mx.array([0, 1, 127, 4093, 65531, 131071], dtype=mx.int32)
    T = 3
    x = mx.random.normal((len(offsets), 2, T, head_dim), key=mx.random.key(0)).astype(dtype)
    cos, sin = rope_angles(offsets, T, spec)
    ours = rotate(x, spec.dims, cos, sin)
    theirs = mx.fast.rope(x, spec.dims, traditional=False, base=spec.base, scale=spec.scale, offset=offsets)
    return bool(mx.array_equal(ours, theirs).item())
