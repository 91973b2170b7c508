"""The one seam where the device chooses MTPLX's forms: `forms(device)` names the form for each concern.

On MLX's CPU backend MTPLX swaps in faster forms (`mtplx/backends/cpu/`, imported only from here). On a GPU
(CUDA or Metal) the trunk runs mlx-lm's modules as loaded, with their `mx.fast` kernels; MTPLX keeps only the
algorithm's own forms, as on every device: the slot caches with a length per row (`mtplx.decode.cache`); the
per-step gated-delta states of a verify, so commit picks each row's state at its accepted step
(`mtplx.models.families.qwen.gated_delta_verify`); DeepSeek/GLM latent attention in its one-position form
for every decode pass (`mtplx.decode.mla`).
"""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

from mtplx.backends.cpu import activations, blas_threads, conv, experts, gemm_layout
from mtplx.backends.cpu.rope_angles import RopeSpec, rope_angles

__all__ = [
    "forms",
    "on_cpu",
    "prepare_model",
    "prepare_loaded",
    "probabilities_exp",
    "causal_conv",
    "chunked_prefill",
    "prompt_align",
    "pass_stages",
    "CycleThreads",
    "blas_info",
    "RopeSpec",
    "rope_angles",
]

CPU_FORMS = {
    "linear": "cpu.gemm_layout: float32 weights stored [in, out] for BLAS's NN GEMM",
    "activations": "cpu.activations: exp as a polynomial (prompts) or a power of two (decode); "
    "prompt attention in blocks of query rows",
    "rope": "cpu.rope_angles: one cos and sin per pass for every attention layer",
    "pass_stages": "one trunk layer per staged graph",
    "experts": "cpu.experts: half-precision experts computed in float32",
    "gated_delta_conv": "cpu.conv: shifted multiply-adds (float32)",
    "gated_delta_prefill": "chunk-wise recurrence (float32 chunks of 16+ tokens)",
    "probabilities_exp": "cpu.activations.pow_exp",
    "blas_threads": "cpu.blas_threads: OpenBLAS threads per cycle",
}
GPU_FORMS = {
    "linear": "mlx-lm nn.Linear",
    "activations": "mlx-lm",
    "rope": "mx.fast.rope",
    "pass_stages": "one graph per pass",
    "experts": "mlx-lm SwitchGLU",
    "gated_delta_conv": "mlx-lm Conv1d",
    "gated_delta_prefill": "mlx-lm gated-delta layer",
    "probabilities_exp": "mx.exp",
    "blas_threads": "none",
}

# A float32 prompt chunk at least this long runs the recurrence chunk-wise on the CPU.
CHUNKED_PREFILL_MIN = 16


def on_cpu(device: Optional[mx.Device] = None) -> bool:
    device = mx.default_device() if device is None else device
    return device.type == mx.cpu


def forms(device: Optional[mx.Device] = None) -> Dict[str, str]:
    """Concern -> the form MTPLX uses for it on `device` (the default device)."""
    return dict(CPU_FORMS if on_cpu(device) else GPU_FORMS)


def prepare_model(model) -> None:
    """The device's in-place changes to a model MTPLX decodes with (idempotent)."""
    if not on_cpu():
        return
    gemm_layout.lay_out_for_cpu_gemm(model)
    activations.use_fast_activations(model)
    experts.float32_experts(model)
    conv.prepare_conv_taps(model)


def prepare_loaded(model) -> None:
    """What a loaded model needs to run a forward at all: MLX's CPU gather_mm takes float32 experts only."""
    if on_cpu():
        experts.float32_experts(model)


def probabilities_exp(x: mx.array) -> mx.array:
    """exp for the target and draft probabilities."""
    return activations.pow_exp(x) if on_cpu() else mx.exp(x)


def causal_conv(gdn, conv_input: mx.array, S: int) -> mx.array:
    """A gated-delta layer's depthwise causal conv over [B, K-1+S, C] -> [B, S, C]."""
    if on_cpu():
        return conv.causal_conv(gdn, conv_input, S)
    return gdn.conv1d(conv_input)


def chunked_prefill(x: mx.array) -> bool:
    """Whether a gated-delta layer runs prompt chunk x [B, S, H] chunk-wise (else the layer's own forward)."""
    return on_cpu() and x.dtype == mx.float32 and x.shape[1] >= CHUNKED_PREFILL_MIN


def prompt_align(model) -> int:
    """Positions a prompt pass's forwards start and end on (padded), so that a row computes what it would alone:
    CHUNKED_PREFILL_MIN where the CPU's float32 prompt forms run (their recurrence chunks and attention blocks
    are that long), else 1 (mlx-lm's forms, over the prompt as mlx-lm feeds it)."""
    return CHUNKED_PREFILL_MIN if on_cpu() and activations.activation_dtype(model) == mx.float32 else 1


def pass_stages(model):
    """(trunk layers per staged graph, the RoPE whose angles a pass makes once); (0, None): one graph."""
    if not on_cpu():
        return 0, None
    return 1, activations.shared_rope_spec(model)


class CycleThreads:
    """OpenBLAS's thread count per decode cycle and prompt pass on the CPU (`cpu.blas_threads`)."""

    def __init__(self, model):
        self.active = on_cpu()
        self.row_cost = blas_threads.gemm_row_cost(model) if self.active else None

    def for_rows(self, rows: int) -> None:
        if self.active:
            blas_threads.use_threads(blas_threads.decode_threads(self.row_cost, rows), self)

    def for_prompts(self) -> None:
        if self.active:
            blas_threads.use_threads(None, self)

    def release(self) -> None:
        if self.active:
            blas_threads.release_threads(self)


def blas_info() -> dict:
    """OpenBLAS's kernels and thread count, where it is loaded."""
    return {"core": blas_threads.openblas_core(), "threads": blas_threads.openblas_threads()}
