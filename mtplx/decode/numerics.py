"""Float32 numerics shared by sampling and the runtime.

Everything here works on whole batches on device. The only host
synchronisation is `raise_if_nonfinite`, which exists to turn a silent NaN
into an error that names the rows it came from.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

# A residual distribution whose total mass is at or below this is treated as
# empty and replaced by the target. Mass this small means p and q agree to
# within a total-variation distance of ZERO_MASS_TOL, so a rejection (the only
# way the residual is ever sampled) happens with probability <= ZERO_MASS_TOL,
# and sampling from p instead changes the output distribution by at most that
# much. Renormalising a mass that small would instead amplify float32 rounding
# dust (about 1e-7 per entry) into a meaningless distribution.
ZERO_MASS_TOL = 1e-6


def log_softmax_f32(logits: mx.array) -> mx.array:
    """Log-softmax over the last axis, computed in float32.

    -inf entries (masked tokens) give -inf. A row that is all -inf has no
    distribution and comes out NaN, so the non-finite guards catch it.
    """
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def safe_normalize(x: mx.array, axis: int = -1) -> mx.array:
    """x / sum(x) along `axis`; a slice that sums to zero is returned unchanged
    (all zeros) instead of becoming NaN."""
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
    """Non-finite values where probabilities or logits were expected.

    `rows` holds the offending rows (their names when the caller gave them).
    A plain message string is accepted too (rows then stays empty).
    """

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
    """Host check: raise NonFiniteError naming every row of x that is not
    finite (row_names[i] instead of i when given)."""
    raise_for_rows(nonfinite_rows(x), row_names)


def replace_nonfinite_rows(x: mx.array, bad: mx.array, value: float | None = None) -> mx.array:
    """Rows flagged in bool [B] `bad` replaced by a constant so a batch can go
    on while the caller records those rows as errors.

    The default constant is 1/V (V = last axis): read as probabilities that is
    the uniform distribution, read as logits it is too, so the same call makes
    either kind of tensor safe to sample from.
    """
    if value is None:
        value = 1.0 / x.shape[-1] if x.ndim > 1 and x.shape[-1] else 0.0
    bad = bad.reshape(bad.shape + (1,) * (x.ndim - 1))  # [B, 1, ...]
    return mx.where(bad, mx.array(value, dtype=x.dtype), x)
