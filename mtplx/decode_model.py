"""The in-place changes a model gets before MTPLX decodes with it, in one
place: the runtime applies them, and the bare-cost passes time the model as
the runtime runs it. Each is idempotent and says why in its own module:

- `gemm_layout.lay_out_for_cpu_gemm`: float32 dense weights as contiguous
  [in, out] arrays (CPU only);
- `cpu_activations.use_fast_activations`: exp-heavy ops over a faster exp
  (CPU only, float32 models only);
- `cpu_experts.float32_experts`: half-precision float experts in float32,
  which MLX's CPU gather_mm needs (`mtplx.load` applies it too);
- `mla_attention.use_one_mla_form`: DeepSeek/GLM latent attention in its
  one-position form in every decode pass (any backend);
- `families.qwen.prepare_conv_taps`: gated-delta conv weights split into
  their taps once, not in every pass.
"""

from __future__ import annotations

from .cpu_activations import use_fast_activations
from .cpu_experts import float32_experts
from .families.qwen import prepare_conv_taps
from .gemm_layout import lay_out_for_cpu_gemm
from .mla_attention import use_one_mla_form


def prepare_for_decoding(model) -> None:
    lay_out_for_cpu_gemm(model)
    use_fast_activations(model)
    float32_experts(model)
    use_one_mla_form(model)
    prepare_conv_taps(model)
