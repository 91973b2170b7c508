"""The near-tie rule of each device (mtplx.testing.near_tie), which the exactness tests apply."""

import mlx.core as mx
import pytest

from mtplx.testing import CPU_TIE_GAP, bf16_step, near_tie


@pytest.mark.parametrize("x", [1.0, 0.75, -3.0, 40.5, 1.5 * 2.0**-10])
def test_a_bf16_step_is_the_gap_to_the_next_bfloat16_number(x):
    b = mx.array([x], dtype=mx.bfloat16)
    above = mx.array([abs(x) + bf16_step(x)], dtype=mx.bfloat16)
    assert above.item() - abs(b.item()) == bf16_step(x)  # the next number, exactly one step up
    half_up = mx.array([abs(x) + 0.49 * bf16_step(x)], dtype=mx.bfloat16)
    assert half_up.item() == abs(b.item())  # nothing between


def test_on_a_gpu_a_near_tie_is_within_one_bf16_step_of_the_top_logit_and_on_the_cpu_below_1e_4():
    assert near_tie(2.0**-7, 1.5, gpu=True) and not near_tie(2.0**-6, 1.5, gpu=True)
    assert near_tie(2.0**-4, 20.0, gpu=True)  # the step grows with the logit
    assert not near_tie(2.0**-7, 1.5, gpu=False)
    assert near_tie(0.5 * CPU_TIE_GAP, 1.5, gpu=False) and not near_tie(CPU_TIE_GAP, 1.5, gpu=False)
