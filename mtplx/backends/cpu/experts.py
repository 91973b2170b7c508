"""Half-precision mixture-of-experts weights made runnable on the CPU.

MLX's CPU `gather_mm` (behind `SwitchLinear`) takes float32 only: a bf16/fp16 MoE fails its first forward.
The float experts' weights become float32 once, in place (twice their bf16 memory), on float32 input cast
back to the input's dtype; quantised experts are left alone. `mtplx.load` applies it, and the runtime again.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.switch_layers import SwitchLinear


class Float32SwitchLinear(SwitchLinear):
    def __call__(self, x, indices, sorted_indices=False):
        return super().__call__(x.astype(mx.float32), indices, sorted_indices).astype(x.dtype)


def float32_experts(model) -> int:
    """Convert an MTPModel's half-precision experts (trunk and head), on the CPU only; returns how many
    layers this call converted (the running total is in `model.info["float32_experts"]`)."""
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
