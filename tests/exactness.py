"""Where greedy output may leave mlx-lm's greedy decoding, on each device (README, "Exactness").

Only at a near-tie of the reference: a top-2 logit gap small enough for the device's float differences to flip.
On the CPU (float32) that is a gap below 1e-4: batch-shape noise, the CPU weight layout, chunk-wise prefill.
On a GPU it is a gap within one bfloat16 step of the larger logit: TF32 matmuls (MLX_ENABLE_TF32 is on by
default), fused kernels and reductions whose order depends on the shape move logits by up to about that.
"""

import math

import mlx.core as mx

CPU_TIE_GAP = 1e-4
BF16_MANTISSA_BITS = 7  # bits after the leading one


def bf16_step(x: float) -> float:
    """The spacing of bfloat16 numbers at |x|."""
    x = abs(float(x))
    if x < 2.0**-126:
        return 2.0 ** (-126 - BF16_MANTISSA_BITS)  # subnormals
    return 2.0 ** (math.floor(math.log2(x)) - BF16_MANTISSA_BITS)


def on_gpu() -> bool:
    return mx.default_device().type == mx.gpu


def near_tie(gap: float, top: float, gpu: bool = None) -> bool:
    """Whether a reference top-2 gap (`top` the larger logit) is one the device may flip."""
    gpu = on_gpu() if gpu is None else gpu
    return gap <= bf16_step(top) if gpu else gap < CPU_TIE_GAP


def tie_rule(gpu: bool = None) -> str:
    gpu = on_gpu() if gpu is None else gpu
    return "a top-2 gap within one bfloat16 step of the larger logit" if gpu else f"a top-2 gap below {CPU_TIE_GAP}"


def top2(model, tokens):
    """(the top-2 logit gap, the top logit) of the reference's next position."""
    logits = model.trunk(mx.array([tokens]))[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:]
    return float(top[1] - top[0]), float(top[1])


def assert_same_up_to_ties(model, prompt, got, ref, ties):
    """Token-for-token equality, except a divergence at a near-tie of the reference (module docstring)."""
    for j, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            gap, top = top2(model, prompt + ref[:j])
            assert near_tie(gap, top), f"diverged at {j}: got {g}, mlx-lm {r}, top-2 gap {gap:.2e}, not {tie_rule()}"
            ties.append((j, gap))
            return
    assert len(got) == len(ref), f"lengths differ: {len(got)} vs {len(ref)}"
