"""Float32 numerics shared by sampling and the runtime, on whole batches on
device; only the raise_* checks read the host, to name the rows of a NaN."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

# A residual of mass <= this is replaced by the target: p and q are then this
# close in total variation, so a rejection (the residual's only use) has at
# most this probability; renormalising would amplify float32 rounding dust.
ZERO_MASS_TOL = 1e-6


def log_softmax_f32(logits: mx.array) -> mx.array:
    """Log-softmax over the last axis in float32; a row all -inf comes out NaN for the guards."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def safe_normalize(x: mx.array, axis: int = -1) -> mx.array:
    """x / sum(x) along `axis`; a slice summing to zero stays zero, not NaN."""
    x = x.astype(mx.float32)
    total = mx.sum(x, axis=axis, keepdims=True)
    positive = total > 0
    return mx.where(positive, x / mx.where(positive, total, 1.0), x)


def nonfinite_rows(x: mx.array) -> mx.array:
    """bool [B]: True where row b (axis 0) holds a NaN or an inf anywhere."""
    x = mx.array(x) if not isinstance(x, mx.array) else x
    if not mx.issubdtype(x.dtype, mx.floating):
        return mx.zeros((x.shape[0],), dtype=mx.bool_)
    bad = mx.logical_not(mx.isfinite(x))
    if x.ndim == 1:
        return bad
    return mx.any(bad, axis=tuple(range(1, x.ndim)))


class NonFiniteError(ValueError):
    """Non-finite probabilities or logits; `rows` names the offending rows
    (empty when built from a plain message)."""

    def __init__(self, rows=(), what: str = "values"):
        if isinstance(rows, str):
            self.rows = []
            super().__init__(rows)
            return
        self.rows = list(rows)
        super().__init__(f"non-finite {what} in rows={self.rows}")


def raise_for_rows(bad: mx.array, row_names: Sequence | None = None, what: str = "values") -> None:
    """Raise NonFiniteError for the rows flagged in bool [B] `bad`, if any."""
    flags = np.asarray(bad, dtype=bool).reshape(-1)
    if not flags.any():
        return
    idx = np.flatnonzero(flags).tolist()
    rows = [row_names[i] for i in idx] if row_names is not None else idx
    raise NonFiniteError(rows, what)


def raise_if_nonfinite(x: mx.array, row_names: Sequence | None = None) -> None:
    """Host check: raise NonFiniteError naming the non-finite rows of x."""
    raise_for_rows(nonfinite_rows(x), row_names)


def replace_nonfinite_rows(x: mx.array, bad: mx.array, value: float | None = None) -> mx.array:
    """Rows flagged in bool [B] `bad` replaced by a constant, so the batch goes
    on. The default 1/V (V = last axis) is the uniform distribution read as
    probabilities or as logits."""
    if value is None:
        value = 1.0 / x.shape[-1] if x.ndim > 1 and x.shape[-1] else 0.0
    bad = bad.reshape(bad.shape + (1,) * (x.ndim - 1))  # [B, 1, ...]
    return mx.where(bad, mx.array(value, dtype=x.dtype), x)
