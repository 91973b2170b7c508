"""Block-fp8 checkpoints: each fp8 (e4m3) `X.weight` [m, n] has an `X.weight_scale_inv` with one scale per
b x b block. mlx-lm dequantises them in deepseek_v3's sanitize only; MTPLX does so before any family's
sanitize, to bfloat16, bit for bit as mlx-lm does."""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(config: dict) -> Optional[int]:
    """The block size of a block-fp8 checkpoint, or None for any other."""
    for c in (config, config.get("text_config") or {}):
        qc = c.get("quantization_config") or {}
        if qc.get("quant_method") == "fp8":
            return int((qc.get("weight_block_size") or [128])[0])
    return None


def dequantize_fp8_weights(weights: Dict[str, mx.array], block: int) -> Dict[str, mx.array]:
    """Scaled fp8 weights dequantised, scales dropped; a scale without an fp8 weight stays for the load to name."""

    def is_fp8(weight) -> bool:
        return weight is not None and weight.dtype == mx.uint8

    out = {}
    for k, v in weights.items():
        if k.endswith(SCALE_SUFFIX):
            if not is_fp8(weights.get(k[: -len(SCALE_SUFFIX)])):
                out[k] = v  # no fp8 weight takes it
            continue
        scale = weights.get(k + SCALE_SUFFIX)
        out[k] = dequantize_block(v, scale, block) if scale is not None and is_fp8(v) else v
    return out


def dequantize_block(q: mx.array, scale_inv: mx.array, block: int) -> mx.array:
    """fp8 bytes q [m, n] times the scale of each block [ceil(m/b), ceil(n/b)] -> bfloat16 [m, n]."""
    m, n = q.shape
    scale = mx.repeat(mx.repeat(scale_inv.astype(mx.float32), block, axis=0), block, axis=1)[:m, :n]  # [m, n]
    return (mx.from_fp8(q, dtype=mx.float32) * scale).astype(mx.bfloat16)


_DEQUANTIZING: Dict[tuple, type] = {}


def dequantizing_trunk_class(model_cls: type, block: int) -> type:
    """A subclass of an mlx-lm Model whose sanitize first dequantises the block-fp8 weights."""
    key = (model_cls, block)
    if key not in _DEQUANTIZING:
        own = getattr(model_cls, "sanitize", None)

        def sanitize(self, weights):
            weights = dequantize_fp8_weights(weights, block)
            return own(self, weights) if own is not None else weights

        _DEQUANTIZING[key] = type(model_cls.__name__, (model_cls,), {"sanitize": sanitize, "__module__": __name__})
    return _DEQUANTIZING[key]
