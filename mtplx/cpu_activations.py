"""SwiGLU activations with an exp the CPU backend runs several times faster.

MLX's CPU `exp` (behind `sigmoid`, `silu` and `softmax`) computes one
element at a time: 12.5 ms per million floats on this machine, where an add
takes 0.16 ms and NumPy's exp 0.6 ms. A model's MLPs apply `silu` to every
hidden unit of every token, so at prefill and at batch 16 the exps are a
large share of a pass (batch 16, 128-token prompts, the built-in model:
about a quarter of the prefill in the MLPs' SwiGLU alone).

`fast_exp` is the textbook range reduction exp(x) = 2^n exp(r),
|r| <= ln2 / 2, with a degree-6 polynomial for exp(r) and 2^n built in the
exponent bits: a dozen elementwise ops that `mx.compile` fuses into one
kernel, 3.4 ms per million here. Its relative error is at most 2.5e-7 over
[-87, 88] against float64 (MLX's own CPU exp: 3.9e-6); below and above that
range it returns exp(-87) and exp(88), so a sigmoid still saturates to 0 and
1 and NaN stays NaN.

`use_fast_activations` swaps, in place and once, the SwiGLU of every MLP of
a model's trunk and head that runs mlx-lm's own SwiGLU (`_swiglu_mlps`, and
the experts' `SwitchGLU`), the gated RMSNorm of Qwen's gated-delta layers and
their conv's silu for the same products over `fast_exp`. Only on the
CPU: GPU backends vectorise exp. Like `gemm_layout`, `mtplx.load` leaves the
model as mlx-lm computes it; the runtime and the cost measurements that plan
for it swap the model they decode with.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

_LOG2E = 1.4426950408889634
# ln 2 in two parts (Cody-Waite): n * _LN2_HI is exact for |n| < 2^15, so
# the reduction loses no bits for large |x|.
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_INV_FACTORIALS = (1.0, 1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 x, as elementwise ops that compile into one kernel."""
    x = mx.clip(x, -87.0, 88.0)
    n = mx.floor(x * _LOG2E + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln2 / 2
    p = _INV_FACTORIALS[-1]
    for c in reversed(_INV_FACTORIALS[:-1]):
        p = p * r + c  # Horner: sum r^i / i!
    two_n = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # 2^n in the exponent bits
    return p * two_n


@mx.compile  # traced per shape: the exponent-bits view has no shapeless form
def fast_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's `swiglu`, with `fast_exp`."""
    return gate / (1.0 + fast_exp(-gate)) * x


@mx.compile
def fast_silu(x: mx.array) -> mx.array:
    """x * sigmoid(x) with `fast_exp` (the gated-delta layers' conv activation)."""
    return x / (1.0 + fast_exp(-x))


@mx.compile
def fast_precise_swiglu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `precise_swiglu` (silu(gate) * x in float32, in h's dtype) with `fast_exp`."""
    gate = gate.astype(mx.float32)
    return (gate / (1.0 + fast_exp(-gate)) * x.astype(mx.float32)).astype(h.dtype)


def _gated_norm_call(self, hidden_states: mx.array, gate=None) -> mx.array:
    # Qwen3NextRMSNormGated's own __call__, with fast_precise_swiglu.
    x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
    if gate is not None:
        return fast_precise_swiglu(hidden_states, gate, x)
    return x.astype(hidden_states.dtype)


def _swiglu_mlp_call(self, x: mx.array) -> mx.array:
    # The same as each of _SWIGLU_MLPS' own __call__, with fast_swiglu.
    return self.down_proj(fast_swiglu(self.gate_proj(x), self.up_proj(x)))


class FastSwiGLU(nn.Module):
    """mlx-lm's `switch_layers.SwiGLU` (the experts' activation): (x, gate) -> silu(gate) * x."""

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return fast_swiglu(gate, x)


def _swiglu_mlps() -> tuple:
    """The mlx-lm MLP classes whose __call__ is down_proj(swiglu(gate_proj(x), up_proj(x)))."""
    from mlx_lm.models import deepseek_v3, glm4_moe, glm4_moe_lite, mimo, qwen3_next

    return (qwen3_next.Qwen3NextMLP, deepseek_v3.DeepseekV3MLP, glm4_moe.MLP, glm4_moe_lite.Glm4MoeLiteMLP, mimo.MLP)


def _swaps() -> dict:
    """mlx-lm class -> what its Fast subclass overrides. The gated-delta
    layers keep their own __call__ (which MTPLX's verify and prefill forwards
    replace, `families.qwen`); those read `conv_activation`."""
    from mlx_lm.models import qwen3_5, qwen3_next

    swaps = {cls: {"__call__": _swiglu_mlp_call} for cls in _swiglu_mlps()}
    swaps[qwen3_next.Qwen3NextRMSNormGated] = {"__call__": _gated_norm_call}
    for cls in (qwen3_next.Qwen3NextGatedDeltaNet, qwen3_5.GatedDeltaNet):
        swaps[cls] = {"conv_activation": staticmethod(fast_silu)}
    return swaps


_fast_classes: dict = {}


def use_fast_activations(model) -> int:
    """Swap, in place and once, the exp-based activations of an MTPModel's
    trunk and head (module docstring) for their `fast_exp` forms, where MLX
    runs on the CPU; records and returns the count of modules swapped in
    `model.info["fast_activations"]`."""
    if mx.default_device() != mx.cpu:
        return 0
    if "fast_activations" not in model.info:
        parts = [m for m in (model.trunk, model.head) if m is not None]
        model.info["fast_activations"] = sum(_swap(m) for m in parts)
    return model.info["fast_activations"]


def _swap(module) -> int:
    from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

    swaps = _swaps()
    count = 0
    for _, m in module.named_modules():
        if type(m) in swaps:
            m.__class__ = _fast_class(type(m), swaps[type(m)])
            count += 1
        elif isinstance(m, SwitchGLU) and type(m.activation) is SwiGLU:
            m.activation = FastSwiGLU()
            count += 1
    return count


def _fast_class(cls, overrides: dict):
    """A subclass of an mlx-lm class with `overrides` (the weights, names and
    everything else are the instance's own)."""
    if cls not in _fast_classes:
        _fast_classes[cls] = type(f"Fast{cls.__name__}", (cls,), overrides)
    return _fast_classes[cls]
