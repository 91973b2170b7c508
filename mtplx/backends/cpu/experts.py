"""Half-precision mixture-of-experts weights, made runnable on the CPU.

MLX's CPU backend runs the experts' gathered matmul (`mx.gather_mm`, behind
mlx-lm's `SwitchLinear`) in float32 only: a bf16 or fp16 MoE checkpoint
(DeepSeek-V3 and GLM ship bf16) stops at its first forward with
"[GatherMM::eval] Currently only supports float32". `float32_experts`
converts the float experts' weights to float32 once, in place, and has them
take their input in float32 and give back the input's dtype; every other
layer keeps the checkpoint's dtype. The experts then take twice their bf16
memory. Quantised experts (`gather_qmm`) run in any dtype and are left as
they are. `mtplx.load` applies it, so `model.forward` and `model.head` run
on what it returns; the runtime applies it again, for a model whose dtype
was changed after loading (experts already converted are left alone).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.switch_layers import SwitchLinear


class Float32SwitchLinear(SwitchLinear):
    def __call__(self, x, indices, sorted_indices=False):
        return super().__call__(x.astype(mx.float32), indices, sorted_indices).astype(x.dtype)


def float32_experts(model) -> int:
    """Convert an MTPModel's half-precision float experts (trunk and head),
    only on the CPU; returns how many layers this call converted and keeps
    the running total in `model.info["float32_experts"]`."""
    if mx.default_device() != mx.cpu:
        return 0
    count = sum(_convert(m) for m in (model.trunk, model.head) if m is not None)
    model.info["float32_experts"] = model.info.get("float32_experts", 0) + count
    return count


def _convert(module) -> int:
    count = 0
    for _, m in module.named_modules():
        if type(m) is SwitchLinear and m.weight.dtype in (mx.bfloat16, mx.float16):
            m.weight = m.weight.astype(mx.float32)
            if "bias" in m:
                m.bias = m.bias.astype(mx.float32)
            m.__class__ = Float32SwitchLinear
            count += 1
    return count
