"""Dense float32 weights laid out for the CPU's GEMM.

`nn.Linear` computes `x @ W.T` with W stored [out, in]: a transposed-B GEMM, which OpenBLAS's small-matrix
kernels refuse at most decode shapes (the general path copies the whole weight every call). Each weight is
stored as the transpose of a contiguous [in, out] array: the same shape, name and values, but an "NN" GEMM,
faster and batch-invariant with OpenBLAS's AVX-512 kernels (docs/performance.md). `mtplx.load` keeps the
file layout; the runtime re-lays the model it decodes with, once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def lay_out_for_cpu_gemm(model) -> int:
    """Re-lay every float32 `nn.Linear` weight as (contiguous [in, out]).T, once, on the CPU; returns the count."""
    return once_on_cpu(model, "gemm_layout", _relay_linears)


def once_on_cpu(model, key: str, adapt) -> int:
    """`adapt(module) -> count` over trunk and head, once per model and on the CPU; total in `model.info[key]`."""
    if mx.default_device() != mx.cpu:
        return 0
    if key not in model.info:
        parts = [m for m in (model.trunk, model.head) if m is not None]
        model.info[key] = sum(adapt(m) for m in parts)
    return model.info[key]


class RelaidLinear(nn.Linear):
    """An `nn.Linear` multiplying by its contiguous [in, out] `_w_in_out` directly: `x @ weight.T` without a
    Transpose node per projection (the CPU's decode time goes per node). A replaced `weight` is used as is."""

    def __call__(self, x: mx.array) -> mx.array:
        if self["weight"] is not self._w_view:
            return super().__call__(x)
        if "bias" in self:
            return mx.addmm(self["bias"], x, self._w_in_out)
        return x @ self._w_in_out


def _relay_linears(module: nn.Module) -> int:
    count = 0
    for _, m in module.named_modules():
        if type(m) is nn.Linear and m.weight.dtype == mx.float32:
            w_in_out = mx.contiguous(m.weight.T)  # [in, out]
            mx.eval(w_in_out)  # one matrix at a time: the old buffer is freed as we go
            m.weight = w_in_out.T  # [out, in], strides (1, out): the same values, name and shape
            # Underscored: not a parameter, so parameters() and saving are unchanged.
            m._w_in_out, m._w_view = w_in_out, m.weight
            m.__class__ = RelaidLinear
            count += 1
    return count


def token_rows(x: mx.array) -> mx.array:
    """x [..., D] as [N, D], one Reshape a layer's projections share instead of a Flatten and Unflatten each."""
    return x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
