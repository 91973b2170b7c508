"""The benchmark's own logic: pairing, medians, the ideal and predicted
formulas, the records' schema and the table. No test asserts a speed."""

import json
import statistics
import sys
from collections import Counter

import pytest

import mtplx
from mtplx.autodepth.costs import BareCosts
from mtplx.bench import run as bench
from mtplx.bench.report import format_table, write_plot
from mtplx.bench.requirements import Cell, check_requirements, requirement_lines
from mtplx.bench.run import (
    BenchPlan,
    Run,
    acceptance_summary,
    add_auto_vs_best,
    add_measured_speedups,
    encode_prompts,
    median_interval,
    paired_ratios,
    parse_args,
    predicted_from_ideal,
    ratio_summary,
    settings_from_args,
    take_prompts,
)
from mtplx.decode.requests import Completion
from mtplx.testing import tiny_checkpoint

# ------------------------------------------------------------ unit: statistics


def test_paired_ratio_divides_each_engine_run_by_its_adjacent_baseline():
    pairs = [(10.0, 12.0), (20.0, 22.0), (5.0, 4.0)]
    assert paired_ratios(pairs) == pytest.approx([1.2, 1.1, 0.8])


def test_ratio_summary_is_the_median_with_its_interval_and_min_and_max_as_spread():
    s = ratio_summary([1.3, 0.9, 1.1, 1.0, 2.0])  # mean 1.26, median 1.1
    assert s["ratio_vs_mlx_lm"] == pytest.approx(1.1)
    assert s["ratio_spread"] == pytest.approx([0.9, 2.0])
    assert s["ratio_ci"] == pytest.approx([0.9, 2.0])  # five rounds: [min, max] is the 90% interval
    assert s["paired_ratios"] == [1.3, 0.9, 1.1, 1.0, 2.0]


def test_pairing_cancels_a_machine_slowdown_that_hits_one_pair():
    # The engine is always 1.25x its neighbour; the machine is 4x slower during pair 2.
    runs = [
        (Run(100, 1.0, 0.0), Run(125, 1.0, 0.0)),
        (Run(100, 4.0, 0.0), Run(125, 4.0, 0.0)),
        (Run(100, 1.0, 0.0), Run(125, 1.0, 0.0)),
    ]
    ratios = paired_ratios([(b.tokens_per_s, e.tokens_per_s) for b, e in runs])
    assert ratio_summary(ratios)["ratio_vs_mlx_lm"] == pytest.approx(1.25)
    assert ratio_summary(ratios)["ratio_spread"] == pytest.approx([1.25, 1.25])


def test_run_rates_count_tokens_over_wall_and_over_time_outside_prefill():
    run = Run(tokens=60, seconds=2.0, prefill_seconds=0.5)
    assert run.tokens_per_s == pytest.approx(30.0)
    assert run.decode_tokens_per_s == pytest.approx(40.0)


def _completion(tokens, steps, drafted, accepted):
    return Completion(
        index=0, tokens=list(range(tokens)), steps=steps, drafted_by_depth=drafted, accepted_by_depth=accepted
    )


def test_acceptance_summary_sums_rows_per_depth_as_design_metrics_define():
    rows = [
        _completion(tokens=9, steps=4, drafted=[4, 4], accepted=[3, 1]),
        _completion(tokens=4, steps=2, drafted=[2, 1], accepted=[1, 0]),
    ]
    s = acceptance_summary(rows, depth=2)
    assert s["acceptance_by_depth"] == pytest.approx([4 / 6, 1 / 5])
    assert s["acceptance_rate"] == pytest.approx(5 / 11)
    assert s["ideal_tokens_per_cycle"] == pytest.approx(1 + 5 / 6)
    # tokens delivered by cycles: each row's first token came from the prefill
    assert s["mean_accepted_length"] == pytest.approx((8 + 3) / 6)
    assert s["row_cycles"] == 6


def test_acceptance_summary_at_depth_zero_is_one_token_per_cycle():
    s = acceptance_summary([_completion(tokens=5, steps=4, drafted=[], accepted=[])], depth=0)
    assert s["acceptance_by_depth"] == [] and s["acceptance_rate"] is None
    assert s["ideal_tokens_per_cycle"] == 1.0 and s["mean_accepted_length"] == 1.0


def test_predicted_speedup_is_ideal_tokens_times_step_over_verify_plus_k_heads():
    costs = BareCosts(batch_size=1, context=64, step_s=10.0, verify_s={1: 11.0, 2: 12.0}, head_s=1.0)
    assert predicted_from_ideal(costs, 2.4, 2) == pytest.approx(2.4 * 10.0 / (12.0 + 2 * 1.0))
    assert predicted_from_ideal(costs, 1.5, 1) == pytest.approx(1.5 * 10.0 / 12.0)
    assert predicted_from_ideal(costs, 1.0, 0) == pytest.approx(1.0)
    assert predicted_from_ideal(costs, None, 1) is None
    # "auto" cycles at several depths: their mean cycle time, weighted by cycles.
    mean_cycle = (1 * 12.0 + 3 * (12.0 + 2.0)) / 4
    assert predicted_from_ideal(costs, 2.0, {1: 1, 2: 3}) == pytest.approx(2.0 * 10.0 / mean_cycle)


def test_measured_speedup_is_the_median_of_each_rounds_depth_over_depth_zero():
    recs = [
        {"depth": 0, "run_tokens_per_s": [100.0, 50.0, 80.0], "run_decode_tokens_per_s": [200.0, 100.0, 100.0]},
        {"depth": 2, "run_tokens_per_s": [150.0, 100.0, 40.0], "run_decode_tokens_per_s": [300.0, 300.0, 250.0]},
    ]
    add_measured_speedups(recs)
    assert recs[0]["measured_speedup"] == pytest.approx(1.0)
    assert recs[1]["measured_speedup"] == pytest.approx(1.5)  # median of 1.5, 2.0, 0.5
    assert recs[1]["measured_decode_speedup"] == pytest.approx(2.5)  # median of 1.5, 3.0, 2.5


def test_decode_over_predicted_divides_each_rounds_speedup_by_that_rounds_own_prediction():
    recs = [
        {
            "depth": 0,
            "run_tokens_per_s": [1.0] * 3,
            "run_decode_tokens_per_s": [100.0, 100.0, 100.0],
            "run_predicted_speedups": [1.0] * 3,
        },
        # Round speed-ups 1.2, 1.8, 1.35 against their own predictions 1.25, 2.0, 1.5: shares 0.96, 0.9, 0.9.
        {
            "depth": 2,
            "run_tokens_per_s": [1.0] * 3,
            "run_decode_tokens_per_s": [120.0, 180.0, 135.0],
            "run_predicted_speedups": [1.25, 2.0, 1.5],
            "predicted_speedup": 1.5,
        },
    ]
    add_measured_speedups(recs)
    assert "decode_over_predicted" not in recs[0]
    assert recs[1]["decode_over_predicted"] == pytest.approx(0.9)
    # Against the pooled prediction the median round (1.35 / 1.5) says the same only by chance:
    assert recs[1]["measured_decode_speedup"] / recs[1]["predicted_speedup"] == pytest.approx(0.9)
    recs[1]["run_predicted_speedups"] = [1.25, 1.2, 1.5]  # a round of easy prompts no longer looks slow
    add_measured_speedups(recs)
    assert recs[1]["decode_over_predicted"] == pytest.approx(0.96)
    assert recs[1]["decode_over_predicted_ci"] is None  # 3 rounds: too few for a 90% interval


def test_auto_vs_best_pairs_each_round_with_the_depth_best_on_the_other_rounds():
    base = [100.0, 100.0, 100.0, 100.0]  # mlx-lm's run of each round
    runs = {
        0: [140.0, 130.0, 150.0, 140.0],
        1: [200.0, 150.0, 150.0, 160.0],  # best on the even rounds (medians 1.75 against 1.45, 1.5)
        2: [150.0, 170.0, 150.0, 170.0],  # best on the odd rounds (1.7 against 1.55)
    }
    recs = [
        {
            "depth": d,
            "run_tokens_per_s": r,
            "paired_ratios": [x / b for x, b in zip(r, base)],
            "ratio_vs_mlx_lm": statistics.median(x / b for x, b in zip(r, base)),
        }
        for d, r in runs.items()
    ]
    recs.append({"depth": "auto", "ratio_vs_mlx_lm": 1.6, "run_tokens_per_s": [180.0, 153.0, 150.0, 136.0]})
    add_auto_vs_best(recs)
    auto = recs[3]
    assert auto["best_fixed_depth"] == 2  # medians 1.4, 1.55, 1.6 over every round
    # Odd rounds pair with depth 1 (best on the even ones), even rounds with depth 2.
    assert auto["auto_vs_best"] == pytest.approx(
        statistics.median([180 / 150, 153 / 150, 150 / 150, 136 / 160])
    )  # 1.01
    # On the same rounds: every round against depth 2.
    assert auto["auto_vs_best_same_rounds"] == pytest.approx(statistics.median([1.2, 0.9, 1.0, 0.8]))
    assert "auto_vs_best" not in recs[1]


def test_auto_vs_best_leaves_out_depths_without_a_ratio_and_needs_one_with_it():
    # A setting whose mlx-lm runs all generated nothing (every row stopped at
    # once) has no ratio at any depth.
    recs = [
        {"depth": 0, "ratio_vs_mlx_lm": None, "run_tokens_per_s": [100.0], "paired_ratios": []},
        {"depth": "auto", "ratio_vs_mlx_lm": None, "run_tokens_per_s": [108.0]},
    ]
    add_auto_vs_best(recs)
    assert "auto_vs_best" not in recs[1]
    recs.insert(1, {"depth": 1, "ratio_vs_mlx_lm": 1.6, "run_tokens_per_s": [120.0], "paired_ratios": [1.6]})
    add_auto_vs_best(recs)
    assert recs[2]["best_fixed_depth"] == 1 and recs[2]["auto_vs_best"] == pytest.approx(0.9)


def test_auto_vs_best_of_a_single_round_pairs_it_with_the_best_depth():
    recs = [
        {"depth": 0, "ratio_vs_mlx_lm": 1.4, "run_tokens_per_s": [100.0], "paired_ratios": [1.4]},
        {"depth": 1, "ratio_vs_mlx_lm": 1.6, "run_tokens_per_s": [120.0], "paired_ratios": [1.6]},
        {"depth": "auto", "ratio_vs_mlx_lm": 1.3, "run_tokens_per_s": [108.0]},
    ]
    add_auto_vs_best(recs)
    assert recs[2]["best_fixed_depth"] == 1 and recs[2]["auto_vs_best"] == pytest.approx(0.9)


def test_median_interval_is_the_order_statistics_whose_binomial_coverage_reaches_the_level():
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == [1.0, 5.0]  # n=5: [min, max] covers 1 - 2/32
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None  # [min, max] covers 0.875 < 0.9
    assert median_interval([float(x) for x in range(1, 11)]) == [2.0, 9.0]  # 0.979; [3, 8] would be 0.891
    # Coverage over many draws of 10 and of 40 from a skewed distribution whose median is 1.
    import numpy as np

    rng = np.random.default_rng(0)
    for n, coverage in ((10, 0.9785), (40, 0.9193)):
        hits = 0
        for _ in range(3000):
            lo, hi = median_interval(list(rng.lognormal(0.0, 0.5, n)))
            hits += lo <= 1.0 <= hi
        # 3000 draws: the binomial standard error is under 0.0055; 4 of them is a false alarm at 3e-5.
        assert abs(hits / 3000 - coverage) < 0.022


def test_a_requirement_missed_only_when_its_whole_interval_is_below_the_bar():
    assert Cell("x", 0.96, [0.90, 0.99], 0.95).status == "met"
    assert Cell("x", 0.93, [0.90, 0.97], 0.95).status == "within noise"
    assert Cell("x", 0.93, None, 0.95).status == "within noise"  # too few rounds to tell
    assert Cell("x", 0.93, [0.88, 0.94], 0.95).status == "missed"


def test_requirements_check_depth0_decode_over_predicted_at_batch_1_and_4_and_auto():
    def rec(B, depth, **kw):
        return {"engine": "mtplx", "batch_size": B, "temperature": 0.0, "depth": depth, **kw}

    records = [
        {"engine": "mlx_lm", "batch_size": 4, "temperature": 0.0, "depth": None, "ratio_vs_mlx_lm": 1.0},
        rec(4, 0, ratio_vs_mlx_lm=1.2, ratio_ci=[1.1, 1.3], predicted_speedup=1.0, measured_decode_speedup=1.0),
        rec(
            4,
            2,
            ratio_vs_mlx_lm=1.3,
            predicted_speedup=1.2,
            measured_decode_speedup=1.0,
            measured_decode_speedup_ci=[0.9, 1.06],
        ),
        rec(
            16,
            2,
            ratio_vs_mlx_lm=1.0,
            predicted_speedup=1.2,
            measured_decode_speedup=0.5,
            measured_decode_speedup_ci=[0.4, 0.6],
        ),  # batch 16: not required
        rec(
            4,
            "auto",
            ratio_vs_mlx_lm=1.25,
            predicted_speedup=1.1,
            measured_decode_speedup=1.0,
            auto_vs_best=0.96,
            auto_vs_best_ci=[0.9, 1.0],
            best_fixed_depth=2,
        ),
    ]
    depth0, decode, auto = check_requirements(records)
    assert [(c.label, c.status) for c in depth0.cells] == [("B=4 T=0", "met")]
    [cell] = decode.cells
    assert cell.label == "B=4 T=0 depth 2" and cell.value == pytest.approx(1.0 / 1.2)
    assert cell.ci == pytest.approx([0.75, 1.06 / 1.2]) and cell.status == "missed"
    assert [(c.value, c.status) for c in auto.cells] == [(0.96, "met")]
    table = "\n".join(requirement_lines(records))
    assert "decode speed-up >= 0.9 of predicted at batch 1, 4: 0 of 1 met" in table
    assert "B=4 T=0 depth 2: 0.833 [0.750, 0.883] (missed)" in table
    # A record with each round's share of its own prediction is judged by that.
    records[2].update(decode_over_predicted=0.93, decode_over_predicted_ci=[0.85, 0.97])
    [cell] = check_requirements(records)[1].cells
    assert (cell.value, cell.ci, cell.status) == (0.93, [0.85, 0.97], "met")


def test_take_prompts_takes_n_from_a_start_cycling_a_small_pool():
    assert take_prompts([[1], [2]], 5) == [[1], [2], [1], [2], [1]]
    assert take_prompts([[1], [2], [3]], 2, start=2) == [[3], [1]]  # a later round's prompts


class _CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


def test_prompts_are_clipped_to_their_last_tokens():
    pool = encode_prompts(_CharTokenizer(), ["abcdef", [1, 2]], max_tokens=3)
    assert pool == [[ord("d"), ord("e"), ord("f")], [1, 2]]
    with pytest.raises(ValueError):
        encode_prompts(_CharTokenizer(), ["", "x"])


def test_default_prompts_come_from_the_prompts_parquet_else_the_built_in_list(tmp_path, monkeypatch):
    from conftest import write_parquet

    path = write_parquet(tmp_path / "p.parquet", id=["a", "b"], prompt=["def f():\n", "def g():\n"])
    monkeypatch.setattr(bench, "REPO_PROMPTS", path)
    assert bench.default_prompts() == (["def f():\n", "def g():\n"], str(path))
    monkeypatch.setattr(bench, "REPO_PROMPTS", tmp_path / "missing.parquet")
    assert bench.default_prompts() == (list(bench.BUILTIN_PROMPTS), "built-in")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 not really")
    no_column = write_parquet(tmp_path / "q.parquet", id=["a"], text=["x"])
    for bad in (corrupt, no_column):
        monkeypatch.setattr(bench, "REPO_PROMPTS", bad)
        assert bench.default_prompts() == (list(bench.BUILTIN_PROMPTS), "built-in")


def test_the_blas_named_is_the_one_mlx_can_call_not_numpys_private_copy(monkeypatch):
    numpy_own = "/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-8fb3d286.so"
    mlx_own = "/venv/lib/python3.11/site-packages/mlx/lib/libblas.so.3"
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(bench, "_mapped_libraries", lambda parts: [mlx_own, numpy_own])
    assert bench.blas_in_use()["name"] == "mlx bundled (reference BLAS)"
    preloaded = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    monkeypatch.setattr(bench, "_mapped_libraries", lambda parts: [preloaded, mlx_own, numpy_own])
    assert bench.blas_in_use()["name"] == "OpenBLAS"


def test_runs_of_fewer_than_eight_prompts_get_proportionally_more_rounds():
    one_batch = BenchPlan((1, 2, 4, 16), (0,), (0.0,), 8, None, 5, 0)
    assert [one_batch.rounds(B) for B in (1, 2, 3, 4, 5, 8, 16)] == [40, 20, 10, 10, 5, 5, 5]
    three_prompts = BenchPlan((1, 16), (0,), (0.0,), 8, 3, 3, 0)  # --prompts 3 at every batch size
    assert [three_prompts.rounds(B) for B in (1, 16)] == [6, 6]


def test_plan_rejects_bad_depths_and_sizes():
    with pytest.raises(ValueError):
        BenchPlan((1,), (0, -1), (0.0,), 4, None, 1, 0)
    with pytest.raises(ValueError):
        BenchPlan((0,), (0,), (0.0,), 4, None, 1, 0)
    with pytest.raises(ValueError, match="repeat"):  # one size's --prompts count would be lost
        BenchPlan((2, 2), (0,), (0.0,), 4, {2: 3}, 1, 0)
    assert BenchPlan((1,), (1, "auto"), (0.0,), 4, None, 1, 0).cost_depths(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="0..14"):  # refused before a model loads, as the runtime would
        BenchPlan((1,), (0, 50), (0.0,), 4, None, 1, 0)
    for seed in (-1, 2**64):  # mlx-lm's sampler seeds from it
        with pytest.raises(ValueError, match="seed"):
            BenchPlan((1,), (0,), (0.0,), 4, None, 1, seed)


def test_quick_flag_gives_make_bench_settings_and_flags_override_it():
    s = settings_from_args(parse_args(["--output", "x.json", "--quick", "--max-tokens", "32"]))
    assert s["batch_sizes"] == (1, 4, 16) and s["depths"] == (0, 1, 2, 3, "auto")
    assert s["max_tokens"] == 32 and s["repeats"] == 5 and s["max_prompt_tokens"] == 128
    assert s["num_prompts"] == {1: 1, 4: 32, 16: 16}  # batch 4 streams 32 prompts through its slots
    plain = settings_from_args(parse_args(["--output", "x.json", "--depths", "0,auto"]))
    assert plain["depths"] == (0, "auto") and "batch_sizes" not in plain  # run_bench's default
    assert "num_prompts" not in plain  # one full batch per run


def test_prompts_per_run_is_one_count_or_one_per_batch_size():
    quick = BenchPlan((1, 4, 16), (0,), (0.0,), 8, {1: 1, 4: 16, 16: 16}, 5, 0)
    assert [quick.prompts_per_run(B) for B in (1, 4, 16)] == [1, 16, 16]
    assert [quick.rounds(B) for B in (1, 4, 16)] == [40, 5, 5]
    s = settings_from_args(parse_args(["--output", "x", "--batch-sizes", "1,4", "--prompts", "2,8"]))
    assert s["num_prompts"] == {1: 2, 4: 8}
    s = settings_from_args(parse_args(["--output", "x", "--batch-sizes", "1,4", "--prompts", "8"]))
    assert s["num_prompts"] == 8
    with pytest.raises(ValueError, match="one per batch size"):
        settings_from_args(parse_args(["--output", "x", "--batch-sizes", "1,4,16", "--prompts", "2,8"]))
    # --quick's counts are by batch size: one it leaves out runs one batch.
    s = settings_from_args(parse_args(["--output", "x", "--quick", "--batch-sizes", "2,4"]))
    plan = BenchPlan(s["batch_sizes"], (0,), (0.0,), 8, s["num_prompts"], 5, 0)
    assert [plan.prompts_per_run(B) for B in (2, 4)] == [2, 32]
    with pytest.raises(ValueError):
        BenchPlan((4,), (0,), (0.0,), 8, {4: 0}, 5, 0)


# ------------------------------------------------------------ the run order


class _FakeRuntime:
    def __init__(self, depth):
        self.depth = depth
        self.stats = {}


def test_rounds_run_the_baseline_then_every_depth_in_a_changing_order_then_bare_costs(monkeypatch):
    calls = []
    speeds = iter([50, 60, 100, 10, 130, 12, 5, 6, 7])  # tok/s of successive timed calls

    def fake_baseline(model, prompts, max_tokens, temperature, seed, batch_size):
        n = max_tokens
        calls.append(("mlx_lm", n, prompts[0][0]))
        return Run(100, 1.0, 0.0) if n == 4 else Run(100, 100 / next(speeds), 0.0)

    def fake_engine(rt, prompts, max_tokens, temperature, seed):
        n = max_tokens
        calls.append((rt.depth, n, prompts[0][0]))
        outs = [_completion(tokens=n, steps=n - 1, drafted=[n - 1] * rt.depth, accepted=[1] * rt.depth)]
        return Run(100, 1.0, 0.0, outs) if n == 4 else Run(100, 100 / next(speeds), 0.0, outs)

    monkeypatch.setattr(bench, "run_baseline", fake_baseline)
    monkeypatch.setattr(bench, "run_engine", fake_engine)
    plan = BenchPlan((1,), (0, 1), (0.0,), 8, 8, 2, 0)  # 8 prompts per run: 2 rounds
    monkeypatch.setattr(bench, "WARMUP_TOKENS", 4)
    costs = BareCosts(batch_size=1, context=8, step_s=1.0, verify_s={1: 1.0}, head_s=0.1)
    runtimes = {0: _FakeRuntime(0), 1: _FakeRuntime(1)}
    batches = [[[1, 2]], [[3, 4]]]  # one per round
    base_runs, pairs = bench.run_rounds(None, runtimes, batches, 1, 0.0, plan, lambda: calls.append("bare"))
    recs = bench.setting_records(runtimes, 1, 0.0, base_runs, pairs, costs, plan, lambda s: None)
    assert calls == [
        ("mlx_lm", 4, 1),
        (0, 4, 1),
        (1, 4, 1),  # warm-up on the first round's prompts
        ("mlx_lm", 8, 1),
        (0, 8, 1),
        (1, 8, 1),
        "bare",  # round 1, then a round of bare costs
        ("mlx_lm", 8, 3),
        (1, 8, 3),
        (0, 8, 3),
        "bare",  # round 2: its own prompts, the order changes
    ]
    base, d0, d1 = recs
    assert base["engine"] == "mlx_lm" and base["runs"] == 2
    assert base["tokens_per_s"] == pytest.approx(statistics.median([50, 10]))
    # each engine run is paired with its round's baseline run
    assert d0["paired_ratios"] == pytest.approx([60 / 50, 12 / 10])
    assert d1["paired_ratios"] == pytest.approx([100 / 50, 130 / 10])
    assert d0["run_tokens_per_s"] == pytest.approx([60, 12]) and d1["run_tokens_per_s"] == pytest.approx([100, 130])
    assert d1["measured_speedup"] == pytest.approx(statistics.median([100 / 60, 130 / 12]))


def test_bare_costs_are_timed_at_the_longest_row_of_each_batch_not_at_the_rows_mean():
    """A batched pass reads every row up to the longest one, so each group of
    batch_size prompts (in the order they fill the slots) counts at its
    longest prompt, plus half the new tokens."""
    runs = [[[1] * 10, [1] * 30, [1] * 20, [1] * 40], [[1] * 50, [1] * 10, [1] * 10, [1] * 10]]
    assert bench.decode_context(runs, 1, 64) == round(statistics.mean([10, 30, 20, 40, 50, 10, 10, 10]) + 32)
    assert bench.decode_context(runs, 2, 64) == round(statistics.mean([30, 40, 50, 10]) + 32)
    assert bench.decode_context(runs, 4, 10) == round(statistics.mean([40, 50]) + 5)
    # a run shorter than the batch is one group
    assert bench.decode_context([[[1] * 7, [1] * 9]], 16, 2) == 9 + 1


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_balanced_orders_put_every_engine_at_every_place_and_after_every_other_equally_often(n):
    orders = bench.balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    places = Counter((p, e) for o in orders for p, e in enumerate(o))
    after = Counter(pair for o in orders for pair in zip([None] + o, o))  # None: the round's baseline
    assert set(places.values()) == {len(orders) // n} and len(places) == n * n
    assert set(after.values()) == {len(orders) // n} and len(after) == n * n  # (n-1) engines + the baseline each


def test_five_rounds_of_the_bench_give_each_of_five_engines_four_or_more_predecessors():
    # make bench: depths 0-3 and auto, five rounds at batch 4 and 16; a
    # rotation gave each engine one predecessor besides the baseline
    orders = bench.balanced_orders(5)[:5]
    before = {e: {p for o in orders for p, x in zip([None] + o, o) if x == e} for e in range(5)}
    assert all(len(ps) >= 4 for ps in before.values())


def test_bare_cost_sampler_pools_every_round_and_anchors_to_the_fastest_step(tiny_model):
    from mtplx import load
    from mtplx.autodepth.costs import BareCostSampler

    sampler = BareCostSampler(load(tiny_model), 2, depths=[1, 2], context=6)
    sampler.sample(2)
    sampler.sample(1)  # e.g. between two rounds of runs
    assert {name: len(ts) for name, ts in sampler.times.items()} == {"step": 3, 1: 3, 2: 3, "head": 3}
    c = sampler.costs()
    assert c.batch_size == 2 and c.context == 6 and set(c.verify_s) == {1, 2} and c.step_s > 0 and c.head_s > 0
    # the step's fastest round x the median of each pass's same-round ratios
    sampler.times = {"step": [2.0, 1.0, 3.0], 1: [3.0, 1.6, 6.0], 2: [4.0, 2.5, 9.0], "head": [0.2, 0.1, 0.9]}
    c = sampler.costs()
    assert c.step_s == 1.0
    assert c.verify_s == pytest.approx({1: 1.6, 2: 2.5}) and c.head_s == pytest.approx(0.1)


def test_interleaved_times_run_lead_calls_of_a_pass_untimed_before_its_burst(monkeypatch):
    import mlx.core as mx

    from mtplx.autodepth import costs

    clock, calls = [0.0], []

    def pass_named(name):
        def run():
            calls.append(name)
            # A lead call costs 100 s of fake time and a burst call 1 s: a
            # timing that included a lead call would read far above 1.
            clock[0] += 100.0 if len(calls) % 4 == 1 else 1.0
            return mx.zeros((1,))

        return run

    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
    times = costs.interleaved_times({"a": pass_named("a"), "b": pass_named("b")}, repeats=2, burst=3, warmups=0, lead=1)
    assert calls == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4  # per round and pass: 1 lead + a burst of 3
    assert times == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    assert costs.LEAD >= 1  # the bare-cost sampler times every pass warm


def test_interleaved_times_hold_no_output_of_a_call_over_the_next():
    """A trunk pass returns the caches it wrote; a reference to them held over
    the next call would make MLX copy every cache whole at that call's write
    (the runtime's cycles update them in place), so the bare costs would
    price a copy the runtime never pays."""
    import gc
    import weakref

    import mlx.core as mx

    from mtplx.autodepth import costs

    class Outputs(list):  # a list that a weak reference can follow
        pass

    previous, alive_at_call = [None], []

    def run():
        gc.collect()
        alive_at_call.append(previous[0] is not None and previous[0]() is not None)
        out = Outputs([mx.zeros((2,))])
        previous[0] = weakref.ref(out)
        return out

    costs.interleaved_times({"pass": run}, repeats=2, burst=3, warmups=1, lead=1)
    assert len(alive_at_call) == 1 + 2 * (1 + 3)
    assert not any(alive_at_call)


# ------------------------------------------------------------ a real tiny run

MTPLX_KEYS = {
    "engine",
    "batch_size",
    "depth",
    "depth_used",
    "temperature",
    "tokens_per_s",
    "ratio_vs_mlx_lm",
    "ratio_spread",
    "ratio_ci",
    "acceptance_by_depth",
    "mean_accepted_length",
    "ideal_tokens_per_cycle",
    "predicted_speedup",
    "measured_speedup",
    "measured_decode_speedup_ci",
    "bare_costs",
}


@pytest.fixture(scope="module")
def tiny_records(tiny_model):
    records = bench.run_bench(
        tiny_model,
        batch_sizes=(1, 2),
        depths=(0, 1, "auto"),
        temperatures=(0.0, 1.0),
        max_tokens=4,
        repeats=1,
        prompts=[[3, 4, 5], [6, 7, 8, 9, 10]],
        progress=False,
    )
    return json.loads(json.dumps(records))  # the records survive JSON unchanged


def test_tiny_run_writes_a_header_with_machine_versions_and_blas(tiny_records, tiny_model):
    header = tiny_records[0]
    assert header["engine"] == "header"
    assert header["model"] == str(tiny_model)
    assert header["machine"]["cpu_count"] >= 1 and header["machine"]["platform"]
    assert set(header["versions"]) >= {"python", "mlx", "mlx-lm", "mtplx"}
    assert header["blas"]["name"] and header["allocator"]
    assert header["prompts"]["count"] == 2 and header["max_tokens"] == 4


def test_a_run_of_more_prompts_than_slots_streams_them_all_through_the_batch(tiny_model):
    records = bench.run_bench(
        tiny_model,
        batch_sizes=(2,),
        depths=(0, 1),
        temperatures=(0.0,),
        max_tokens=3,
        repeats=1,
        num_prompts={2: 5},
        prompts=[[3, 4, 5], [6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16]],
        progress=False,
    )
    assert records[0]["prompts"]["per_run"] == {"2": 5}
    runs = records[1:]
    assert [r["num_prompts"] for r in runs] == [5, 5, 5]
    mtplx_runs = [r for r in runs if r["engine"] == "mtplx"]
    assert all(r["generated_tokens"] > 2 * 3 for r in mtplx_runs)  # more than one batch of 2 rows decoded


def test_a_checkpoint_without_an_mtp_head_is_benchmarked_plainly_or_refused_clearly(tmp_path):
    path = tiny_checkpoint("qwen3_5", tmp_path / "nohead", vocab_size=48, mtp_num_hidden_layers=0)
    records = bench.run_bench(
        path,
        batch_sizes=(1,),
        depths=(0, 2, "auto"),
        temperatures=(0.0,),
        max_tokens=3,
        repeats=1,
        prompts=[[3, 4, 5]],
        progress=False,
    )
    assert [(r["engine"], r["depth"]) for r in records[1:]] == [("mlx_lm", None), ("mtplx", 0), ("mtplx", "auto")]
    assert records[-1]["depth_used"] == 0
    with pytest.raises(ValueError, match="no MTP head.*--depths 0"):
        bench.run_bench(
            path,
            batch_sizes=(1,),
            depths=(2,),
            temperatures=(0.0,),
            max_tokens=3,
            repeats=1,
            prompts=[[3, 4, 5]],
            progress=False,
        )


def test_depth_0_runs_as_the_reference_of_measured_speedups_when_not_asked_for(tiny_model, capsys):
    records = bench.run_bench(
        tiny_model,
        batch_sizes=(1,),
        depths=(1,),
        temperatures=(0.0,),
        max_tokens=3,
        repeats=1,
        prompts=[[3, 4, 5]],
        progress=False,
    )
    assert "depth 0 added" in capsys.readouterr().err  # said even without progress lines
    assert records[0]["settings"]["depths"] == [0, 1] and records[0]["settings"]["depths_asked"] == [1]
    assert [(r["engine"], r["depth"]) for r in records[1:]] == [("mlx_lm", None), ("mtplx", 0), ("mtplx", 1)]
    assert records[-1]["measured_speedup"] is not None


def test_tiny_run_has_one_record_per_engine_batch_size_depth_and_temperature(tiny_records):
    keys = [(r["engine"], r["batch_size"], r["depth"], r["temperature"]) for r in tiny_records[1:]]
    expected = [
        (e, B, d, t)
        for B in (1, 2)
        for t in (0.0, 1.0)
        for e, d in [("mlx_lm", None), ("mtplx", 0), ("mtplx", 1), ("mtplx", "auto")]
    ]
    assert keys == expected


def test_tiny_run_mtplx_records_follow_the_schema_and_formulas(tiny_records):
    for r in tiny_records[1:]:
        if r["engine"] != "mtplx":
            assert r["ratio_vs_mlx_lm"] == 1.0 and r["tokens_per_s"] > 0
            continue
        assert MTPLX_KEYS <= set(r)
        k = r["depth_used"]
        assert k == r["depth"] or (r["depth"] == "auto" and isinstance(k, int) and "auto_choice" in r)
        if r["depth"] == "auto":  # cycles may run at any depth up to the deepest the batch is built for
            deepest = len(r["cycles_by_depth"]) - 1
            mix = {int(d): n for d, n in r["cycles_by_depth"].items() if n} or {0: 1}
        else:
            deepest, mix = k, {k: 1}
        assert len(r["acceptance_by_depth"]) == deepest
        assert r["ratio_vs_mlx_lm"] == pytest.approx(statistics.median(r["paired_ratios"]))
        assert r["ratio_spread"] == pytest.approx([min(r["paired_ratios"]), max(r["paired_ratios"])])
        c = r["bare_costs"]
        cycle_of = lambda d: c["step_s"] if d == 0 else c["verify_s"][str(d)] + d * c["head_s"]
        cycle = sum(n * cycle_of(d) for d, n in mix.items()) / sum(mix.values())
        assert r["predicted_speedup"] == pytest.approx(r["ideal_tokens_per_cycle"] * c["step_s"] / cycle)
        assert r["ideal_tokens_per_cycle"] >= 1.0
        assert 0 < r["rows_per_cycle"] <= r["batch_size"]  # batch 2 runs 2 prompts at once
        assert len(r["run_predicted_speedups"]) == r["runs"]
        if r["depth"] == 0:
            assert r["measured_speedup"] == pytest.approx(1.0)
            assert all(p == pytest.approx(1.0) for p in r["run_predicted_speedups"])
        else:
            assert r["decode_over_predicted"] == pytest.approx(
                statistics.median(
                    m / p for m, p in zip(_round_decode_speedups(tiny_records, r), r["run_predicted_speedups"])
                )
            )
        if r["depth"] == "auto":
            assert r["best_fixed_depth"] != "auto" and r["auto_vs_best"] > 0
        else:  # the cycle's time split: bare verify, k head passes, and the rest
            t = r["cycle_time"]
            assert t["verify_s"] == (c["step_s"] if k == 0 else c["verify_s"][str(k)])
            assert t["heads_s"] == pytest.approx(k * c["head_s"])
            assert t["cycle_s"] == pytest.approx(t["verify_s"] + t["heads_s"] + t["rest_s"]) and t["cycle_s"] > 0


def _round_decode_speedups(records, r):
    plain = next(
        p
        for p in records
        if p["engine"] == "mtplx"
        and p["depth"] == 0
        and (p["batch_size"], p["temperature"]) == (r["batch_size"], r["temperature"])
    )
    return [e / b for b, e in zip(plain["run_decode_tokens_per_s"], r["run_decode_tokens_per_s"])]


def test_tiny_run_auto_records_count_only_their_own_timed_cycles(tiny_records):
    # One "auto" runtime serves both temperatures and the warm-ups: its own
    # counts run on, but each record's mix (and so its prediction) is its runs'.
    autos = [r for r in tiny_records[1:] if r["depth"] == "auto"]
    assert len(autos) == 4
    for r in autos:
        assert r["cycles"] > 0
        assert sum(r["cycles_by_depth"].values()) == r["cycles"]
        assert r["auto_choice"]["cycles_by_depth"] == r["cycles_by_depth"]


def test_table_has_a_line_for_every_record_and_the_bare_costs(tiny_records):
    table = format_table(tiny_records)
    lines = table.splitlines()
    for r in tiny_records[1:]:
        depth = "-" if r["engine"] == "mlx_lm" else ("auto=" if r["depth"] == "auto" else str(r["depth"]))
        assert any(
            line.split()[:3] == [str(r["batch_size"]), f"{r['temperature']:g}", r["engine"]]
            and depth in line.split()[3]
            and f"{r['tokens_per_s']:.1f}" in line
            for line in lines
        ), (r, table)
    assert "bare costs" in table and "mlx-lm" in table
    fixed = [r for r in tiny_records[1:] if r["engine"] == "mtplx" and r["depth"] != "auto"]
    cycle_lines = [line for line in lines if "verify " in line and "heads " in line and "rest " in line]
    assert "one cycle (ms, share)" in table and len(cycle_lines) == len(fixed)
    assert "requirements (median [90% confidence interval of it]):" in table and "depth 0 >= 0.95 of mlx-lm" in table


def test_table_names_auto_by_the_depth_most_of_its_cycles_ran_at_not_the_job_depth(tiny_records):
    # Greedy rows follow the running controller, so auto's job depth (its
    # depth_used, for rows sampling under the residual rule) need not be what ran.
    auto = next(r for r in tiny_records if r.get("depth") == "auto")
    planted = [tiny_records[0], {**auto, "depth_used": 3, "cycles_by_depth": {"0": 1, "1": 3, "2": 9, "3": 4}}]
    line = next(line for line in format_table(planted).splitlines() if "auto=" in line)
    assert line.split()[3] == "auto=2"
    idle = {**auto, "depth_used": 3, "cycles_by_depth": {"0": 0, "1": 0, "2": 0, "3": 0}}
    line = next(line for line in format_table([tiny_records[0], idle]).splitlines() if "auto=" in line)
    assert line.split()[3] == "auto=3"  # no cycle timed: the planned depth


def _plot_records():
    rows = [{"engine": "header"}]
    for B in (1, 4):
        for t in (0.0, 1.0):
            rows.append(
                {"engine": "mlx_lm", "batch_size": B, "depth": None, "temperature": t, "tokens_per_s": 10.0 * B}
            )
            for d in (0, 2, "auto"):
                rows.append(
                    {"engine": "mtplx", "batch_size": B, "depth": d, "temperature": t, "tokens_per_s": 12.0 * B}
                )
    return rows


def test_plot_without_matplotlib_fails_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(RuntimeError, match="matplotlib"):
        write_plot(_plot_records(), tmp_path / "p.png")


def test_module_entry_asked_to_plot_without_matplotlib_stops_before_running_with_one_line(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the bench ran"))
    rc = bench.main(["--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "matplotlib" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b.json").exists()


def test_a_plot_format_matplotlib_cannot_write_is_refused_before_the_run(tmp_path, capsys):
    from mtplx.bench.report import check_plot_format

    check_plot_format(tmp_path / "p.png")
    with pytest.raises(ValueError, match="extension"):
        check_plot_format(tmp_path / "p.xyz")
    assert bench.main(["--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "p.xyz")]) == 2
    assert "extension" in capsys.readouterr().err and not (tmp_path / "b.json").exists()


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_plot(_plot_records(), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_module_entry_writes_json_records_and_prints_the_table(tiny_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(
        [
            "--model",
            str(tiny_model),
            "--output",
            str(out),
            "--batch-sizes",
            "1",
            "--depths",
            "0",
            "--temperatures",
            "0",
            "--max-tokens",
            "2",
            "--repeats",
            "1",
            "--prompts",
            "1",
            "--quiet",
        ]
    )
    assert rc == 0
    records = json.loads(out.read_text())
    assert [r["engine"] for r in records] == ["header", "mlx_lm", "mtplx"]
    assert "mlx_lm" in capsys.readouterr().out


def test_mtplx_bench_command_takes_prompts_per_batch_size_and_refuses_a_count_mismatch(tiny_model, tmp_path):
    from click.testing import CliRunner

    from pipeline.model_cli import bench_cmd

    out = tmp_path / "b.json"
    args = [
        "--model",
        str(tiny_model),
        "--batch-sizes",
        "1,2",
        "--depths",
        "0",
        "--temperatures",
        "0",
        "--max-tokens",
        "2",
        "--repeats",
        "1",
        "--quiet",
        "--output",
        str(out),
    ]
    result = CliRunner().invoke(bench_cmd, args + ["--prompts", "1,3"])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert records[0]["prompts"]["per_run"] == {"1": 1, "2": 3}
    bad = CliRunner().invoke(bench_cmd, args + ["--prompts", "1,2,3"])
    assert bad.exit_code != 0 and "one per batch size" in bad.output


@pytest.mark.parametrize("option", ["--output", "--plot"])
def test_an_unwritable_output_or_plot_path_is_refused_before_the_run(tiny_model, tmp_path, option):
    from click.testing import CliRunner

    from pipeline.model_cli import bench_cmd

    paths = {"--output": str(tmp_path / "b.json"), "--plot": str(tmp_path / "p.png")}
    paths[option] = str(tmp_path / "no-such-dir" / "x")
    args = [
        "--model",
        str(tiny_model),
        "--batch-sizes",
        "1",
        "--depths",
        "0",
        "--temperatures",
        "0",
        "--max-tokens",
        "2",
        "--repeats",
        "1",
        "--quiet",
        "--output",
        paths["--output"],
        "--plot",
        paths["--plot"],
    ]
    if option == "--plot":
        pytest.importorskip("matplotlib")
    result = CliRunner().invoke(bench_cmd, args)
    assert result.exit_code == 2 and f"cannot write {option}" in result.output
    assert "bare costs" not in result.output and not (tmp_path / "b.json").exists()  # nothing ran


def test_the_bench_takes_the_held_out_prompts_of_a_source_checkout():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    assert bench.REPO_PROMPTS == repo / "jobs" / "data" / "prompts.parquet" and bench.REPO_PROMPTS.is_file()


def test_fixed_rounds_replace_the_short_run_rule_and_bad_round_counts_are_refused():
    plan = BenchPlan((1, 64), (0,), (0.0,), 8, None, 5, 0, fixed_rounds=2)
    assert [plan.rounds(B) for B in (1, 64)] == [2, 2]
    for bad in (dict(fixed_rounds=0), dict(bare_rounds=(0, 1)), dict(bare_rounds=(3,)), dict(draft_vocab=-1)):
        with pytest.raises(ValueError):
            BenchPlan((1,), (0,), (0.0,), 8, None, 1, 0, **bad)


def test_flags_set_the_draft_vocabulary_the_rounds_and_the_bare_rounds():
    args = ["--output", "x.json", "--draft-vocab", "16", "--rounds", "2", "--bare-rounds", "3,1"]
    s = settings_from_args(parse_args(args))
    assert (s["draft_vocab"], s["rounds"], s["bare_rounds"]) == (16, 2, (3, 1))


def test_a_run_with_a_draft_vocabulary_records_it_and_times_the_head_it_drafts_with(tiny_model, monkeypatch):
    from mtplx.autodepth import costs

    heads = []
    sampler_init = costs.BareCostSampler.__init__

    def spy(self, model, *args, **kwargs):
        heads.append(model.draft_ids)
        sampler_init(self, model, *args, **kwargs)

    monkeypatch.setattr(costs.BareCostSampler, "__init__", spy)
    records = bench.run_bench(
        tiny_model,
        batch_sizes=(2,),
        depths=(0, 2),
        temperatures=(0.0,),
        max_tokens=4,
        prompts=[[3, 4, 5], [6, 7, 8, 9, 10]],
        progress=False,
        draft_vocab=16,
        rounds=1,
        bare_rounds=(1, 1),
    )
    header = records[0]["settings"]
    assert (header["draft_vocab"], header["rounds_by_batch_size"], header["bare_rounds"]) == (16, {"2": 1}, [1, 1])
    assert heads and all(ids is not None and ids.shape[0] < 64 for ids in heads)
    assert {r["depth"] for r in records[1:] if r["engine"] == "mtplx"} == {0, 2}


def test_the_widened_bench_checkpoint_is_written_once_and_again_when_its_shape_changes(tmp_path, monkeypatch):
    import mtplx
    from mtplx.bench import scale

    monkeypatch.setitem(scale.SHAPES, "small", dict(hidden=128, layers=20, intermediate=384))
    path = scale.widened_checkpoint("small", tmp_path)
    assert path == tmp_path / "widened-small" and mtplx.load(path).config["text_config"]["hidden_size"] == 128
    stamp = (path / scale.STAMP).stat().st_mtime_ns
    assert scale.widened_checkpoint("small", tmp_path) == path
    assert (path / scale.STAMP).stat().st_mtime_ns == stamp  # reused, not rewritten
    monkeypatch.setitem(scale.SHAPES, "small", dict(hidden=160, layers=20, intermediate=384))
    assert mtplx.load(scale.widened_checkpoint("small", tmp_path)).config["text_config"]["hidden_size"] == 160
    assert not (tmp_path / "widened-small.tmp").exists()
    with pytest.raises(ValueError, match="unknown shape"):
        scale.widened_checkpoint("qwen9-huge", tmp_path)


def test_the_header_records_peak_memory_and_each_rows_cache_bytes_at_the_decode_context(tiny_records, tiny_model):
    m = tiny_records[0]["memory"]
    assert m["peak_rss_bytes"] > 2**20
    c = m["cache_bytes_per_row"]
    model = mtplx.load(tiny_model)
    doubled = bench.cache_bytes_per_row(model, 2 * c["context"])
    assert c["trunk_kv"] > 0 and doubled["trunk_kv"] == 2 * c["trunk_kv"]  # attention KV grows with the context
    assert doubled["gated_delta_state"] == c["gated_delta_state"] > 0  # the recurrent state does not
    assert c["total"] == c["trunk_kv"] + c["gated_delta_state"] + c["head_kv"] and c["head_kv"] > 0
    assert "memory: peak RSS" in format_table(tiny_records)
