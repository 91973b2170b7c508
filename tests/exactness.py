"""Where greedy output may leave mlx-lm's greedy decoding on the device the suite runs on: only at a near-tie
of the reference (`mtplx.testing.near_tie`: below 1e-4 on the CPU, within one bfloat16 step of the larger logit
on a GPU)."""

import mlx.core as mx

from mtplx import testing


def on_gpu() -> bool:
    return mx.default_device().type == mx.gpu


def near_tie(gap: float, top: float) -> bool:
    return testing.near_tie(gap, top, gpu=on_gpu())


def top2(model, tokens):
    """(the top-2 logit gap, the top logit) of the reference's next position."""
    logits = model.trunk(mx.array([tokens]))[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:]
    return float(top[1] - top[0]), float(top[1])


def assert_same_up_to_ties(model, prompt, got, ref, ties):
    """Token-for-token equality, except a divergence at a near-tie of the reference."""
    for j, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            gap, top = top2(model, prompt + ref[:j])
            rule = testing.tie_rule(on_gpu())
            assert near_tie(gap, top), f"diverged at {j}: got {g}, mlx-lm {r}, top-2 gap {gap:.2e}, not {rule}"
            ties.append((j, gap))
            return
    assert len(got) == len(ref), f"lengths differ: {len(got)} vs {len(ref)}"
