"""Dense weights laid out for the CPU's GEMM.

`nn.Linear` computes `x @ W.T` with W stored [out, in], so on the CPU backend
every projection reaches BLAS as a transposed-B GEMM. OpenBLAS's small-matrix
kernels (SkylakeX/Cooperlake builds, this machine's) refuse that "TN" case
once the output has more than 1200 cells (out x rows) or K < 32, where the
"NN" case is refused only above M x N x K = 1e6 (its `gemm_small_kernel_permit`).
At decode shapes past 1200 cells (a verify over 2+ tokens at batch 4, the LM
head at batch 4) the general path runs, which packs (copies) the whole
weight on every call. Measured on the built-in model at batch 4: a verify over
2-4 tokens takes 1.5-2 ms longer that way (of 11-16 ms).

Storing each weight as the transpose of a contiguous [in, out] array keeps its
shape, name and values but makes `W.T` row-major, so the GEMM is "NN". With
the SkylakeX-family kernels (this machine's) an NN product computes each
output element the same way whatever the number of rows, which makes
decoding batch-invariant: a row's logits are bit-identical at batch 1 and
16, and a verify over k+1 tokens is bit-identical to k+1 one-token steps
(with [out, in] storage both differ by ~1e-5). OpenBLAS's Haswell/Zen
kernels (AVX2-only CPUs) have no small-matrix path at all and send a one-row
product elsewhere: there (forced with OPENBLAS_CORETYPE=Haswell) the
re-laid passes were no slower, mostly a little faster, and batch 1 stays
~1e-6 off. Against mlx-lm's own layout the logits move by
1e-6 to 1e-5.

Each re-laid layer becomes a `RelaidLinear`, which multiplies by the [in, out]
array directly: the same GEMM, one graph node fewer per projection (one-token
step at batch 1 on the built-in model: 1981 -> 1830 nodes; 1-4% faster at
batch 1, 4 and 16 in in-process A/B runs).

Only float32 `nn.Linear` weights on the CPU are re-laid: quantized and
half-precision matmuls do not go through BLAS, and GPU GEMMs read the
transposed layout natively.

`mtplx.load` keeps the file layout, so a loaded trunk computes exactly what
mlx-lm's load of the same directory computes; the runtime (and the cost
measurements that plan for it) re-lay the model they decode with, once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def lay_out_for_cpu_gemm(model) -> int:
    """Re-lay, in place and once, every float32 `nn.Linear` weight of an
    MTPModel's trunk and head as (contiguous [in, out]).T, where MLX runs on
    the CPU; records and returns the count in `model.info["gemm_layout"]`."""
    return once_on_cpu(model, "gemm_layout", _relay_linears)


def once_on_cpu(model, key: str, adapt) -> int:
    """Run `adapt(module) -> count` over an MTPModel's trunk and head, once
    per model and only where MLX runs on the CPU; the total is kept in
    `model.info[key]` and returned (0 elsewhere)."""
    if mx.default_device() != mx.cpu:
        return 0
    if key not in model.info:
        parts = [m for m in (model.trunk, model.head) if m is not None]
        model.info[key] = sum(adapt(m) for m in parts)
    return model.info[key]


class RelaidLinear(nn.Linear):
    """An `nn.Linear` whose weight is the transpose of `_w_in_out`, a
    contiguous [in, out] array: it multiplies by that array directly.
    `x @ weight.T` computes the same GEMM, but puts a Transpose node in every
    graph for every projection (about 180 of a one-token step's ~2000 nodes
    on the built-in model), and at decode sizes the CPU backend's time goes
    per node. If `weight` is replaced later, the new weight is used as
    nn.Linear would."""

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
    """x [..., D] as [N, D]: its tokens as the rows of one matrix.

    MLX multiplies a [B, T, D] input by a weight matrix as a Flatten to
    [B*T, D], the GEMM and an Unflatten back, three graph nodes. A layer's
    projections of one input share one Reshape instead, and their outputs
    are reshaped straight to the shapes the layer uses. The GEMMs are the
    same products over the same rows, so every value is bit for bit the
    same. On the built-in model a decode cycle at batch 4 has 120 nodes
    fewer at depth 0 (1855 -> 1735) and 141 at depth 3 (2580 -> 2439); in
    paired in-process runs it decoded 0.98-1.04x as fast (median of six
    settings 1.02), since view nodes cost the CPU backend little."""
    return x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
