"""depth="auto": the cost model's choice, and that it runs exactly."""

import pytest

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.autodepth import best_depth
from mtplx.costs import BareCosts, ideal_tokens_per_cycle, predicted_speedup
from mtplx.testing import tiny_checkpoint


def _costs(step, verify, head):
    return BareCosts(batch_size=1, context=64, step_s=step, verify_s=verify, head_s=head)


def test_predicted_speedup_is_ideal_tokens_times_step_over_cycle():
    costs = _costs(10.0, {1: 11.0, 2: 12.0}, 1.0)
    acc = [0.8, 0.6]
    assert ideal_tokens_per_cycle(acc, 2) == pytest.approx(2.4)
    assert predicted_speedup(costs, acc, 2) == pytest.approx(2.4 * 10.0 / (12.0 + 2 * 1.0))
    assert predicted_speedup(costs, acc, 0) == 1.0


def test_cheap_verify_and_good_acceptance_pick_a_deep_draft():
    costs = _costs(10.0, {1: 10.5, 2: 11.0, 3: 11.5}, 0.5)
    assert best_depth(costs, [0.9, 0.8, 0.7], 3) == 3


def test_compute_bound_verify_falls_back_to_plain_decoding():
    # Verify cost grows linearly with tokens, as at large batches: nothing pays.
    costs = _costs(10.0, {1: 20.0, 2: 30.0, 3: 40.0}, 2.0)
    assert best_depth(costs, [0.7, 0.5, 0.3], 3) == 0


def test_auto_depth_runtime_records_its_choice_and_decodes_like_plain_greedy(tmp_path):
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11]]
    auto = MTPLXRuntime(model, MTPContract(depth="auto"), max_batch=2)
    record = auto.stats["auto_depth"]
    assert record["depth"] == auto.depth and 0 <= auto.depth <= 3
    assert set(record["predicted_speedup"]) == {"0", "1", "2", "3"}
    plain = MTPLXRuntime(model, MTPContract(depth=0), max_batch=2)
    assert [o.tokens for o in auto.generate(prompts, max_tokens=6)] == [o.tokens for o in plain.generate(prompts, max_tokens=6)]
