"""depth="auto": the cost model's choice, and that it runs exactly."""

import json

import numpy as np
import pytest
from model_helpers import make_predictable

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.autodepth.costs import BareCosts, CycleCosts, ideal_tokens_per_cycle, predicted_speedup
from mtplx.autodepth.policy import (
    DEPTH_TOLERANCE,
    EXPLORE_CYCLES,
    HOLD_DEEPER,
    MEASURE_PLAIN_BURSTS,
    SINGLE_ROW_JOB_TIE,
    AutoDepth,
    DepthController,
    best_depth,
    conditional_rates,
)
from mtplx.decode.sampling import SamplingParams
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


def test_a_deeper_depth_must_be_predicted_faster_by_the_tolerance_to_be_chosen():
    # Depth 3 predicted 1% faster than depth 2: within timing noise, so 2.
    costs = _costs(10.0, {1: 12.0, 2: 12.5, 3: 13.0}, 0.5)
    acc = [0.8, 0.6, 0.22]
    s2, s3 = predicted_speedup(costs, acc, 2), predicted_speedup(costs, acc, 3)
    assert 1.0 < s3 / s2 < DEPTH_TOLERANCE
    assert best_depth(costs, acc, 3) == 2
    # With a far better third draft, depth 3 clears the tolerance and wins.
    acc = [0.8, 0.6, 0.35]
    assert predicted_speedup(costs, acc, 3) / predicted_speedup(costs, acc, 2) > DEPTH_TOLERANCE
    assert best_depth(costs, acc, 3) == 3


def test_one_rows_job_depth_is_the_deepest_within_a_near_tie_of_the_fastest():
    costs = _costs(10.0, {1: 12.0, 2: 12.5, 3: 13.0}, 0.5)
    acc = [0.8, 0.6, 0.22]  # depth 3 predicted 1% faster than depth 2
    tie = SINGLE_ROW_JOB_TIE
    assert best_depth(costs, acc, 3, tolerance=tie, deepest=True) == 3
    acc = [0.8, 0.6, 0.10]  # depth 3 predicted slower than depth 2 by more than the tie
    s2, s3 = predicted_speedup(costs, acc, 2), predicted_speedup(costs, acc, 3)
    assert s3 * tie < s2
    assert best_depth(costs, acc, 3, tolerance=tie, deepest=True) == 2
    acc = [0.8, 0.6, 0.15]  # depth 2 ahead, but within the tie: the deeper one
    s2, s3 = predicted_speedup(costs, acc, 2), predicted_speedup(costs, acc, 3)
    assert s3 < s2 <= s3 * tie
    assert best_depth(costs, acc, 3, tolerance=tie, deepest=True) == 3


def test_compute_bound_verify_falls_back_to_plain_decoding():
    # Verify cost grows linearly with tokens, as at large batches: nothing pays.
    costs = _costs(10.0, {1: 20.0, 2: 30.0, 3: 40.0}, 2.0)
    assert best_depth(costs, [0.7, 0.5, 0.3], 3) == 0


def test_auto_depth_runtime_records_its_choice_and_decodes_like_plain_greedy(tmp_path):
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11]]
    auto = MTPLXRuntime(model, MTPContract(depth="auto"), max_batch=2)
    record = auto.stats["auto_depth"]
    assert record["depth"] == auto.policy.job_depth and 0 <= auto.policy.job_depth <= auto.depth <= 3
    assert set(record["predicted_speedup"]) == {"0", "1", "2", "3"}
    plain = MTPLXRuntime(model, MTPContract(depth=0), max_batch=2)
    assert [o.tokens for o in auto.generate(prompts, max_tokens=6)] == [
        o.tokens for o in plain.generate(prompts, max_tokens=6)
    ]
    assert sum(record["cycles_by_depth"].values()) == auto.stats["cycles"] > 0


def test_auto_calibrates_where_calibration_prompts_exceed_the_context_or_every_token_ends_a_row(tmp_path, monkeypatch):
    short = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "short", vocab_size=48, max_position_embeddings=40))
    auto = MTPLXRuntime(short, MTPContract(depth="auto"), max_batch=2)
    assert all(np.isfinite(v) for v in auto.stats["auto_depth"]["cycle_costs"]["cycle_s"].values())
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    monkeypatch.setattr(type(model), "eos_token_ids", property(lambda self: set(range(48))))
    auto = MTPLXRuntime(model, MTPContract(depth="auto"), max_batch=2)
    assert all(np.isfinite(v) for v in auto.stats["auto_depth"]["cycle_costs"]["cycle_s"].values())
    outs = auto.generate([[3, 4, 5], [7, 8]], max_tokens=4)
    assert [(o.finish_reason, o.tokens) for o in outs] == [("stop", []), ("stop", [])]


def _fake_cycle_costs(calls, greedy, sampled):
    """measure_cycle_costs standing in for the timed decodes: `greedy` or
    `sampled` cycle seconds by depth, by the temperature it is asked for."""

    def measure(model, B, depths, temperature=0.0, **kw):
        calls.append(temperature)
        return CycleCosts(B, {k: (sampled if temperature else greedy)[k] for k in depths})

    return measure


def test_the_job_depth_of_sampled_rows_is_priced_on_sampled_cycles(tmp_path, monkeypatch):
    import mtplx.autodepth.calibration as autodepth

    # The default prior (no training.json) predicts depth 2 at 1.5x plain on
    # these greedy cycles; cycles that also draw their drafts cost enough
    # more that no depth beats plain decoding.
    calls = []
    monkeypatch.setattr(
        autodepth,
        "measure_cycle_costs",
        _fake_cycle_costs(calls, greedy={0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, sampled={0: 1.0, 1: 1.6, 2: 2.0, 3: 2.4}),
    )
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    auto = MTPLXRuntime(model, MTPContract(depth="auto"), max_batch=2)
    record = auto.stats["auto_depth"]
    assert calls == [0.0, 1.0]
    assert auto.policy.job_depth == record["depth"] == 0
    assert record["cycle_costs_sampled"]["cycle_s"]["1"] == 1.6
    assert max(record["predicted_speedup_sampled"].values()) == 1.0  # depth 0's
    assert auto.policy.controller is not None  # greedy rows still speculate, on greedy cycles' prices
    # Where sampled cycles cost what greedy ones do, the same prices keep depth 2.
    calls.clear()
    monkeypatch.setattr(
        autodepth,
        "measure_cycle_costs",
        _fake_cycle_costs(calls, greedy={0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, sampled={0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}),
    )
    assert MTPLXRuntime(model, MTPContract(depth="auto"), max_batch=2).policy.job_depth == 2


def test_sampled_cycles_are_not_timed_where_greedy_pricing_already_keeps_sampled_rows_plain(tmp_path, monkeypatch):
    import mtplx.autodepth.calibration as autodepth

    calls = []
    slow = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}  # no depth pays even on greedy cycles
    monkeypatch.setattr(autodepth, "measure_cycle_costs", _fake_cycle_costs(calls, greedy=slow, sampled=slow))
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    auto = MTPLXRuntime(model, MTPContract(depth="auto"), max_batch=2)
    assert calls == [0.0] and auto.policy.job_depth == 0
    assert "cycle_costs_sampled" not in auto.stats["auto_depth"]


def test_auto_falls_back_to_plain_decoding_when_calibration_times_no_cycle(tmp_path, monkeypatch):
    import mtplx.autodepth.calibration as autodepth

    nan = float("nan")
    monkeypatch.setattr(
        autodepth, "measure_cycle_costs", lambda model, B, depths, **kw: CycleCosts(B, {k: nan for k in depths})
    )
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    auto = MTPLXRuntime(model, MTPContract(depth="auto"), max_batch=2)
    assert auto.depth == 0 and auto.stats["auto_depth"]["reason"] == "calibration timed no decode cycle"
    plain = MTPLXRuntime(model, MTPContract(depth=0), max_batch=2)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11]]
    assert [o.tokens for o in auto.generate(prompts, max_tokens=5)] == [
        o.tokens for o in plain.generate(prompts, max_tokens=5)
    ]


# -- the running controller ------------------------------------------------------


def test_conditional_rates_divide_each_cumulative_rate_by_the_one_before():
    assert conditional_rates([0.8, 0.4, 0.1]) == pytest.approx([0.8, 0.5, 0.25])
    assert conditional_rates([0.0, 0.0]) == [0.0, 0.0]


def _cycle(controller, rows, accepted, drafted):
    controller.observe(np.full(rows, accepted), np.full(rows, drafted))


def test_controller_starts_from_the_prior_then_follows_the_acceptance_it_sees():
    costs = _costs(10.0, {1: 10.5, 2: 11.0, 3: 11.5}, 0.5)
    c = DepthController(costs, prior=[0.5, 0.2, 0.05], max_depth=3)
    assert c.acceptance() == pytest.approx([0.5, 0.2, 0.05])
    start = c.choose()
    for _ in range(50):  # every row accepts everything it drafts
        _cycle(c, rows=8, accepted=3, drafted=3)
    assert c.acceptance()[2] > 0.75  # from a prior of 0.05; the prior keeps some weight
    assert c.choose() == 3 > start


def test_controller_counts_a_depth_reached_only_past_every_accepted_draft_before_it():
    costs = _costs(10.0, {1: 10.5, 2: 11.0, 3: 11.5}, 0.5)
    c = DepthController(costs, prior=[0.5, 0.2, 0.05], max_depth=3, prior_weight=1.0, half_life_rows=1e12)
    accepted, drafted = [0, 1, 3, 2, 1, 0], [3, 3, 3, 2, 1, 0]
    c.observe(accepted, drafted)
    # d_i reached: accepted d_1..d_{i-1} and drafted d_i; passed: accepted d_i.
    reached = [sum(a >= i - 1 and d >= i for a, d in zip(accepted, drafted)) for i in (1, 2, 3)]
    passed = [sum(a >= i for a in accepted) for i in (1, 2, 3)]
    assert reached == [5, 3, 1] and passed == [4, 2, 1]
    assert c.reached == pytest.approx(reached) and c.passed == pytest.approx(passed)
    c.observe([0, 0], [0, 0])  # a plain cycle counts nothing
    assert c.reached == pytest.approx(reached)


def test_a_one_row_controller_runs_the_deepest_depth_within_a_near_tie():
    # Depth 1 within DEPTH_TOLERANCE of the fastest (depth 2), depth 3 within
    # the single-row tie: a batch of rows takes the shallowest, one row the deepest.
    costs = _costs(10.0, {1: 10.0, 2: 12.2, 3: 13.5}, 0.5)
    prior = [0.75, 0.5, 0.3]
    s1, s2, s3 = (predicted_speedup(costs, prior, k) for k in (1, 2, 3))
    assert s3 < s2 and s2 <= s3 * SINGLE_ROW_JOB_TIE and s2 <= s1 * DEPTH_TOLERANCE
    assert DepthController(costs, prior, max_depth=3).choose() == 1
    one_row = DepthController(costs, prior, max_depth=3, one_row=True)
    assert one_row.choose() == 3
    for _ in range(200):  # d_3 never accepted: depth 2 clearly ahead
        one_row.observe([2], [3])
    assert one_row.choose() == 2


def test_controller_goes_shallower_when_deep_drafts_stop_being_accepted():
    costs = _costs(10.0, {1: 10.5, 2: 11.0, 3: 11.5}, 0.5)
    c = DepthController(costs, prior=[0.9, 0.8, 0.7], max_depth=3)
    assert c.choose() == 3
    for _ in range(50):  # d_1 always accepted, d_2 never
        _cycle(c, rows=8, accepted=1, drafted=3)
    assert c.acceptance()[0] > 0.95 and c.acceptance()[1] < 0.15
    assert c.choose() == 1


def test_controller_switches_speculation_off_when_nothing_is_accepted_and_retries_later():
    costs = _costs(10.0, {1: 12.0, 2: 14.0, 3: 16.0}, 0.5)
    c = DepthController(costs, prior=[0.7, 0.5, 0.3], max_depth=3, min_rows=64, retry_rows=512)
    assert c.choose() > 0
    _cycle(c, rows=8, accepted=0, drafted=1)
    assert c.choose() > 0  # too few rows seen to give up
    for _ in range(20):
        _cycle(c, rows=8, accepted=0, drafted=1)
    assert c.choose() == 0
    for _ in range(40):  # off: cycles draft nothing, the evidence fades
        _cycle(c, rows=8, accepted=0, drafted=0)
        assert c.choose() == 0
    for _ in range(110):
        _cycle(c, rows=8, accepted=0, drafted=0)
    assert c.choose() > 0  # 1,200 row-cycles later the prior speaks again


def test_a_head_that_drafts_almost_nothing_right_goes_off_long_before_min_rows():
    # Depth 1 pays above a = 0.4 ((1 + a) x 10 / 14); deeper depths cost more.
    costs = _costs(10.0, {1: 14.0, 2: 17.0, 3: 20.0}, 0.0)
    for a, off_within in ((0.0, 64), (0.03, 96)):
        c = DepthController(costs, prior=[0.7, 0.5, 0.3], max_depth=3, min_rows=256)
        assert c.choose() > 0
        rows = 0
        while c.choose() > 0:
            accepted = (np.random.default_rng(rows).random(4) < a).astype(np.int64)
            c.observe(accepted, np.full(4, 3))
            rows += 4
            assert rows <= off_within, (a, c.acceptance())
        assert rows >= 16  # not on a handful of rows
    # At an acceptance where speculation pays a little, or a little less than
    # break-even, the evidence is not clear: it keeps speculating until min_rows.
    for a in (0.5, 0.3):
        c = DepthController(costs, prior=[0.7, 0.5, 0.3], max_depth=3, min_rows=256)
        for cycle in range(60):  # 240 row-cycles, a of them accepting d_1
            assert c.choose() > 0, (a, cycle, c.acceptance())
            r = 4 * cycle + np.arange(5)
            c.observe(np.diff(np.floor(r * a)).astype(np.int64), np.full(4, 3))


def test_an_off_controller_probes_and_stays_on_only_if_the_running_acceptance_pays():
    costs = _costs(10.0, {1: 14.0, 2: 17.0, 3: 20.0}, 0.0)
    poor_prior = [0.3, 0.1, 0.03]  # depth 1: 1.3 x 10 / 14 = 0.93, no depth pays
    for accepted, stays_on in ((1, True), (0, False)):  # the job's prompts: all d_1 accepted, or none
        c = DepthController(costs, poor_prior, 3, retry_rows=256, probe_rows=64, start_off=True)
        for _ in range(31):  # off: nothing drafted, nothing learnt
            assert c.choose() == 0
            _cycle(c, rows=8, accepted=0, drafted=0)
        _cycle(c, rows=8, accepted=0, drafted=0)  # 256 row-cycles off
        assert c.choose() > 0  # a probe, although the estimate still does not pay
        for _ in range(16):  # 128 row-cycles, past the probe's 64
            _cycle(c, rows=8, accepted=accepted, drafted=1)
            k = c.choose()
        assert (k > 0) == stays_on, (accepted, c.acceptance())


def test_failed_probes_come_ever_less_often_until_one_pays():
    costs = _costs(10.0, {1: 14.0, 2: 17.0, 3: 20.0}, 0.0)  # depth 1 pays above a = 0.4

    def rows_until_probe(c):
        rows = 0
        while c.choose() == 0:
            _cycle(c, rows=8, accepted=0, drafted=0)
            rows += 8
            assert rows <= 10_000
        return rows

    def probe(c, accepted):  # until the probe ends: off again, or on for good
        for _ in range(40):
            _cycle(c, rows=8, accepted=accepted, drafted=1)
            if c.choose() == 0 or not c.probing:
                return

    c = DepthController(costs, [0.3, 0.1, 0.03], 3, retry_rows=256, probe_rows=64, start_off=True)
    waits = []
    for _ in range(5):
        waits.append(rows_until_probe(c))
        probe(c, accepted=0)
    assert waits == [256, 512, 1024, 2048, 2048]  # doubled, up to MAX_RETRY_BACKOFF x retry_rows
    assert rows_until_probe(c) == 2048
    probe(c, accepted=1)  # this probe pays: speculation stays on
    assert c.choose() > 0 and not c.probing
    for _ in range(40):  # the prompts stop accepting: off again, and the next probe comes at retry_rows
        _cycle(c, rows=8, accepted=0, drafted=1)
        if c.choose() == 0:
            break
    assert rows_until_probe(c) == 256


def test_failed_probes_back_off_also_where_the_prior_pays():
    # At a probe's start the faded counts are back near a prior that pays;
    # the probe is still judged on what it drafts, and its failure counts.
    costs = _costs(10.0, {1: 14.0, 2: 17.0, 3: 20.0}, 0.0)
    c = DepthController(costs, [0.7, 0.5, 0.3], 3, retry_rows=256, probe_rows=64)
    starts, rows, was_on = [], 0, True
    for _ in range(1000):
        k = c.choose()
        if k > 0 and not was_on:
            starts.append(rows)
        was_on = k > 0
        c.observe(np.zeros(4, dtype=np.int64), np.full(4, k))  # nothing ever accepted
        rows += 4
    gaps = np.diff(starts)
    assert len(starts) >= 3 and all(b > a for a, b in zip(gaps, gaps[1:])), starts  # ever longer waits


def test_an_off_controller_does_not_probe_while_its_batch_drains():
    costs = _costs(10.0, {1: 14.0, 2: 17.0, 3: 20.0}, 0.0)
    c = DepthController(costs, [0.3, 0.1, 0.03], 3, retry_rows=256, probe_rows=64, start_off=True)
    for _ in range(40):  # 320 row-cycles off, past retry_rows, with nothing left to refill the batch
        _cycle(c, rows=8, accepted=0, drafted=0)
        assert c.choose(draining=True) == 0
    assert c.choose() > 0 and c.probing  # rows wait again: the probe that was due


def test_a_speculating_controller_keeps_on_while_a_depth_still_beats_plain_and_needs_the_margin_to_go_on():
    # Depth 1 only, cycle 14 against a step of 10: it is predicted to pay
    # (1 + a) x 10 / 14, i.e. 1.05 (SPECULATION_MARGIN) at a = 0.47 and
    # 1.0 (KEEP_SPECULATING_ABOVE) at a = 0.4.
    costs = _costs(10.0, {1: 14.0}, 0.0)
    for a, on in ((0.44, True), (0.36, False)):  # 1.008 and 0.952 at the running acceptance
        c = DepthController(costs, [0.6], 1, min_rows=64, prior_weight=1.0)
        assert c.choose() == 1  # the prior: 1.6 x 10 / 14 = 1.14
        accepted = (np.arange(25) < 25 * a).astype(np.int64)  # 11 or 9 of 25 rows
        for _ in range(40):  # 1,000 row-cycles
            c.observe(accepted, np.ones(25, dtype=np.int64))
            k = c.choose()
        assert c.acceptance()[0] == pytest.approx(a, abs=0.01)
        assert (k == 1) == on, (a, c.acceptance())
    # Off, the same acceptance does not turn it back on: a probe needs the margin.
    c = DepthController(costs, [0.44], 1, min_rows=64, retry_rows=64, probe_rows=32, start_off=True)
    assert c.choose() == 0
    _cycle(c, rows=64, accepted=0, drafted=0)
    assert c.choose() == 1 and c.probing
    for _ in range(8):
        c.observe(np.array([1, 1, 1, 1, 0, 0, 0, 0, 0]), np.ones(9, dtype=np.int64))  # a = 0.44
        k = c.choose()
    assert k == 0


class _Scripted:
    """A controller that plays a fixed sequence of depths (0 included)."""

    def __init__(self, depths):
        self.depths = list(depths)
        self.i = 0
        self.seen = 0
        self.draining = []  # what the runtime said at each choice

    def choose(self, draining=False):
        self.draining.append(draining)
        k = self.depths[self.i % len(self.depths)]
        self.i += 1
        return k

    def observe(self, accepted, drafted):
        self.seen += len(accepted)

    def launched(self, depth, t, clean):
        pass


def _with_scripted_auto(model, script, job_depth=2, max_batch=3, acceptance="residual"):
    rt = MTPLXRuntime(model, MTPContract(depth=3, acceptance=acceptance), max_batch=max_batch)
    rt.policy = AutoDepth(job_depth, 3, _Scripted(script), {"cycles_by_depth": {str(k): 0 for k in range(4)}})
    return rt


@pytest.fixture(scope="module")
def predictable_qwen(tmp_path_factory):
    path = tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("auto") / "m", vocab_size=64)
    return make_predictable(mtplx.load(path))


def test_greedy_output_is_plain_greedy_while_the_depth_changes_every_cycle(predictable_qwen):
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20], [5, 6, 7, 8], [30, 31]]
    plain = MTPLXRuntime(predictable_qwen, MTPContract(depth=0), max_batch=3).generate(prompts, max_tokens=14)
    rt = _with_scripted_auto(predictable_qwen, [3, 1, 2, 3, 3, 1, 2])
    got = rt.generate(prompts, max_tokens=14)
    assert [c.tokens for c in got] == [c.tokens for c in plain]
    used = rt.policy.record["cycles_by_depth"]
    assert all(used[str(k)] > 0 for k in (1, 2, 3))
    assert rt.policy.controller.seen > 0
    accepted = sum(sum(c.accepted_by_depth) for c in got)
    assert accepted > 0  # the drafts were really used, not just skipped


def test_switching_speculation_off_mid_job_keeps_greedy_output_exact(predictable_qwen):
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20], [5, 6, 7, 8]]
    plain = MTPLXRuntime(predictable_qwen, MTPContract(depth=0), max_batch=3).generate(prompts, max_tokens=12)
    rt = _with_scripted_auto(predictable_qwen, [2, 2, 3] + [0] * 200)
    got = rt.generate(prompts, max_tokens=12)
    assert [c.tokens for c in got] == [c.tokens for c in plain]
    assert rt.policy.record["cycles_by_depth"]["0"] > 0


def test_prompts_prefilled_while_speculation_is_off_skip_the_head_and_still_decode_exactly(
    predictable_qwen, monkeypatch
):
    import mtplx.decode.runtime as runtime

    heads = []
    prefill = runtime.prefill_by_length
    monkeypatch.setattr(
        runtime,
        "prefill_by_length",
        lambda model, prompts, chunk, with_head, **kw: (
            heads.append(with_head) or prefill(model, prompts, chunk, with_head, **kw)
        ),
    )
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20], [5, 6, 7, 8], [30, 31]]
    plain = MTPLXRuntime(predictable_qwen, MTPContract(depth=0), max_batch=2).generate(prompts, max_tokens=12)
    # Sampled rows kept plain (job depth 0) and the greedy controller off
    # when each prompt is prefilled; then its cycles speculate anyway, as
    # after a probe: every row drafts from a head that never saw its prompt.
    rt = _with_scripted_auto(predictable_qwen, [2, 3, 1], job_depth=0, max_batch=2)
    rt.policy.controller.off = True
    got = rt.generate(prompts, max_tokens=12)
    assert heads and not any(heads)
    assert [c.tokens for c in got] == [c.tokens for c in plain]
    assert sum(sum(c.drafted_by_depth) for c in got) > 0
    # On (or with a job depth for sampled rows), the head runs over the prompts.
    heads.clear()
    rt.policy.controller.off = False
    assert [c.tokens for c in rt.generate(prompts, max_tokens=12)] == [c.tokens for c in plain]
    assert heads and all(heads)
    heads.clear()
    rt.policy.controller.off, rt.policy.job_depth = True, 1
    rt.generate(prompts[:2], max_tokens=4)
    assert heads == [True]


def test_the_runtime_tells_the_controller_whether_anything_waits_to_refill_the_batch(predictable_qwen):
    rt = _with_scripted_auto(predictable_qwen, [0], max_batch=2)
    rt.generate([[3, 4, 5], [7, 8, 9]], max_tokens=5)  # one batch: nothing waits from the first cycle
    assert rt.policy.controller.draining[0] is True
    rt.policy.controller.draining.clear()
    rt.generate([[3, 4, 5], [7, 8, 9], [5, 6], [9, 10, 11]], max_tokens=5)  # two wait at first
    flags = rt.policy.controller.draining
    assert flags[0] is False and True in flags


def test_coupled_sampling_under_a_moving_depth_equals_plain_keyed_sampling(predictable_qwen):
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20]]
    sp = SamplingParams(temperature=1.0)
    plain = MTPLXRuntime(predictable_qwen, MTPContract(depth=0, acceptance="coupled"), max_batch=3)
    want = plain.generate(prompts, sampling=sp, max_tokens=12, seed=5)
    rt = _with_scripted_auto(predictable_qwen, [1, 3, 2], acceptance="coupled")
    got = rt.generate(prompts, sampling=sp, max_tokens=12, seed=5)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    used = rt.policy.record["cycles_by_depth"]
    assert all(used[str(k)] > 0 for k in (1, 2, 3))


def test_rows_sampling_under_the_residual_rule_always_run_at_the_job_depth(predictable_qwen):
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12]]
    rt = _with_scripted_auto(predictable_qwen, [1, 3], job_depth=2)
    got = rt.generate(prompts, sampling=SamplingParams(temperature=1.0), max_tokens=10, seed=1)
    used = rt.policy.record["cycles_by_depth"]
    assert used["2"] > 0 and used["1"] == used["3"] == used["0"] == 0
    # ...and so each row's output is what a fixed depth-2 job gives it.
    fixed = MTPLXRuntime(predictable_qwen, MTPContract(depth=2), max_batch=3)
    want = fixed.generate(prompts, sampling=SamplingParams(temperature=1.0), max_tokens=10, seed=1)
    assert [c.tokens for c in got] == [c.tokens for c in want]


def test_prior_is_the_checkpoints_recorded_acceptance_extended_geometrically(tmp_path):
    from mtplx.assets import default_model_path
    from mtplx.autodepth.policy import acceptance_prior, extend_geometrically

    assert extend_geometrically([0.8, 0.4], 4) == pytest.approx([0.8, 0.4, 0.2, 0.1])
    # The built-in model records the runtime's own acceptance, greedy and sampled, at depths 1-3.
    builtin = mtplx.load(default_model_path())
    recorded = json.loads((builtin.path / "training.json").read_text())
    runtime = recorded["acceptance_runtime"]
    assert acceptance_prior(builtin, 3) == pytest.approx(runtime["greedy"]["by_depth"])
    assert acceptance_prior(builtin, 3, sampled=True) == pytest.approx(runtime["temperature_1"]["by_depth"])
    assert acceptance_prior(builtin, 3, sampled=True) != acceptance_prior(builtin, 3)
    # A record with the teacher-forced figure only: depths 1-2 from it, then geometric.
    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48)
    teacher = {"acceptance_teacher_forced": recorded["acceptance_teacher_forced"]}
    (path / "training.json").write_text(json.dumps(teacher))
    older = mtplx.load(path)
    prior = acceptance_prior(older, 3, sampled=True)
    tf = recorded["acceptance_teacher_forced"]
    assert prior[:2] == pytest.approx([tf["depth1"], tf["depth2_cumulative"]])
    assert prior[2] == pytest.approx(prior[1] ** 2 / prior[0])
    # A checkpoint without a record gets the cautious default.
    (path / "training.json").unlink()
    plain = mtplx.load(path)
    assert acceptance_prior(plain, 3) == pytest.approx([0.5, 0.3, 0.18])


def test_a_greedy_prior_that_does_not_pay_starts_the_controller_off():
    costs = _costs(10.0, {1: 14.0, 2: 17.0, 3: 20.0}, 0.0)
    greedy = [0.3, 0.1, 0.03]  # depth 1: 1.3 x 10 / 14 = 0.93
    on = DepthController(costs, greedy, 3)
    off = DepthController(costs, greedy, 3, start_off=True)
    assert on.choose() > 0  # without start_off it speculates until min_rows have been seen
    assert off.choose() == 0
    assert off.choose() == 0


def test_cycle_costs_are_the_runtimes_own_cycles_at_every_depth(tmp_path):
    from mtplx.autodepth.calibration import measure_cycle_costs

    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    costs = measure_cycle_costs(model, 2, depths=range(3), burst=2, repeats=1, rounds=1)
    assert set(costs.seconds) == {0, 1, 2} and all(0 < s < 5 for s in costs.seconds.values())
    assert costs.overhead is None
    assert costs.step_s == costs.seconds[0] and costs.verify_s == {1: costs.seconds[1], 2: costs.seconds[2]}
    # The predicted speed-up divides cycle times directly.
    assert predicted_speedup(costs, [0.5, 0.25], 2) == pytest.approx(1.75 * costs.seconds[0] / costs.seconds[2])


def test_cycle_costs_play_every_depth_between_plain_bursts_deepest_first_every_other_round(tmp_path, monkeypatch):
    # A slow spell then hits a depth and the plain cycles it is compared with
    # alike, and a machine slowing over a round prices no depth up.
    from mtplx.autodepth import bursts
    from mtplx.autodepth.calibration import measure_cycle_costs

    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    played, play = [], bursts.play

    def recording(runtime, prompts, depths, sampling):
        intervals = play(runtime, prompts, depths, sampling)
        played.append((list(depths), len(intervals)))
        return intervals

    monkeypatch.setattr(bursts, "play", recording)
    measure_cycle_costs(model, 2, depths=range(3), burst=2, repeats=1, rounds=3)
    forward, backward = [0, 0, 1, 1, 0, 0, 2, 2, 0, 0, 0], [0, 0, 2, 2, 0, 0, 1, 1, 0, 0, 0]
    assert [d for d, _ in played] == [forward, forward, backward, forward]  # an untimed round, then 3
    assert all(n == len(d) - 1 for d, n in played)  # every cycle ran: launch to launch, one fewer


def test_a_bursts_cycles_count_only_after_a_cycle_of_its_own_depth_and_against_the_plain_bursts_beside_it():
    from mtplx.autodepth.bursts import burst_times

    played = [0, 0, 0, 1, 1, 1, 0, 0, 0, 2, 2, 2, 0, 0, 0]
    # Interval i follows launch i. The first of each burst (i = 0, 3, 6, 9,
    # 12) is left out: set to 100 here, it would move every median.
    intervals = [100, 2, 2, 100, 3, 3, 100, 4, 4, 100, 10, 12, 100, 6]
    plain, ratios = burst_times(played, intervals)
    assert plain == pytest.approx(4.0)  # median of 2, 2, 4, 4, 6
    assert ratios[1] == pytest.approx(3 / ((2 + 4) / 2))
    assert ratios[2] == pytest.approx(11 / ((4 + 6) / 2))
    # A decode cut short leaves the cycles after it untimed, not misread.
    plain, ratios = burst_times(played, intervals[:8])
    assert plain == pytest.approx(2.0) and ratios == {1: pytest.approx(1.0)}  # 3 against (2 + 4) / 2


def test_cycle_costs_sample_a_bare_cost_sampler_between_their_rounds_and_take_its_shape(tmp_path, monkeypatch):
    import mtplx.autodepth.calibration as costs_module
    from mtplx.autodepth.calibration import measure_cycle_costs

    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    calls = []

    class CountingSampler:  # stands in for costs.BareCostSampler
        def sample(self, rounds):
            calls.append(rounds)

        def costs(self):
            calls.append("costs")
            return BareCosts(batch_size=2, context=8, step_s=1.0, verify_s={1: 1.5, 2: 2.0}, head_s=0.0)

    monkeypatch.setattr(costs_module, "BareCostSampler", CountingSampler)  # what isinstance checks see
    costs = measure_cycle_costs(
        model, 2, depths=range(3), burst=2, repeats=1, rounds=3, bare=CountingSampler(), bare_rounds_between=2
    )
    assert calls == [2, 2, 2, "costs"]  # after every round of decodes, then the pooled costs
    assert costs.seconds[2] / costs.seconds[1] == pytest.approx(2.0 / 1.5)  # the sampler's shape


def test_calibration_takes_verify_costs_as_timed_with_depths_out_of_order_pooled(tmp_path, monkeypatch):
    import mtplx.autodepth.calibration as costs_module
    from mtplx.autodepth.calibration import measure_cycle_costs
    from mtplx.autodepth.costs import verify_never_falling

    exact = BareCosts(batch_size=1, context=8, step_s=3.0, verify_s={1: 3.6, 2: 4.0, 3: 4.4}, head_s=0.2)
    assert verify_never_falling(exact).verify_s == pytest.approx(exact.verify_s)
    # Batch 1 on Haswell kernels: a 4-token verify as cheap as a 3-token one. Kept, not put on a line.
    flat = BareCosts(batch_size=1, context=8, step_s=3.0, verify_s={1: 3.07, 2: 3.57, 3: 3.57}, head_s=0.2)
    assert verify_never_falling(flat).verify_s == pytest.approx(flat.verify_s)
    # Timed out of order (noise, or a kernel quirk): the two pooled to their mean.
    noisy = BareCosts(batch_size=1, context=8, step_s=3.0, verify_s={1: 4.65, 2: 5.59, 3: 5.42}, head_s=0.2)
    line = verify_never_falling(noisy)
    assert line.verify_s == pytest.approx({1: 4.65, 2: 5.505, 3: 5.505})
    assert (line.step_s, line.head_s) == (noisy.step_s, noisy.head_s)
    falling = BareCosts(batch_size=1, context=8, step_s=3.0, verify_s={1: 5.0, 2: 4.0, 3: 4.5}, head_s=0.2)
    assert verify_never_falling(falling).verify_s == pytest.approx({1: 4.5, 2: 4.5, 3: 4.5})
    down = BareCosts(batch_size=1, context=8, step_s=3.0, verify_s={1: 6.0, 2: 5.0, 3: 4.0}, head_s=0.2)
    assert verify_never_falling(down).verify_s == pytest.approx({1: 5.0, 2: 5.0, 3: 5.0})

    class FixedSampler:  # stands in for costs.BareCostSampler
        def sample(self, rounds):
            pass

        def costs(self):
            return noisy

    monkeypatch.setattr(costs_module, "BareCostSampler", FixedSampler)
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    costs = measure_cycle_costs(model, 1, depths=range(4), burst=2, repeats=1, rounds=1, bare=FixedSampler())
    assert costs.seconds[3] / costs.seconds[2] == pytest.approx(line.cycle_s(3) / line.cycle_s(2))


def test_cycle_costs_are_depth0s_fastest_round_times_each_depths_median_same_round_ratio():
    from mtplx.autodepth.costs import _anchored_to

    nan = float("nan")
    # Round 2 was a slow spell for every depth; round 3 stalled depth 1 alone.
    times = {0: [10.0, 20.0, 11.0], 1: [15.0, 31.0, 30.0], 2: [nan, 36.0, 19.8]}
    out = _anchored_to(times)
    assert out[0] == 10.0
    assert out[1] == pytest.approx(10.0 * 1.55)  # ratios 1.5, 1.55, 2.73 -> median 1.55
    assert out[2] == pytest.approx(10.0 * 1.8)  # round 1 has no time: ratios 1.8, 1.8
    # Without depth 0 there is nothing to anchor to: the fastest round.
    assert _anchored_to({1: [3.0, 2.0]}) == {1: 2.0}
    # The bare passes anchor to the one-token step the same way.
    bare = _anchored_to({"step": [10.0, 20.0, 11.0], 1: [15.0, 31.0, 30.0]}, anchor="step")
    assert bare["step"] == 10.0 and bare[1] == pytest.approx(10.0 * 1.55)


def test_with_bare_costs_the_shape_across_depths_is_theirs_and_the_overhead_is_pooled():
    from mtplx.autodepth.costs import BareCosts, _shaped_by_bare

    nan = float("nan")
    bare = BareCosts(batch_size=4, context=64, step_s=5.0, verify_s={1: 7.0, 2: 8.0, 3: 9.0}, head_s=0.5)
    # bare cycle ratios: 1.5, 1.8, 2.1. Measured depth 3 came out cheaper than
    # depth 2 (noise); pooled over depths the runtime costs 10% over bare.
    times = {0: [10.0, 20.0, 11.0], 1: [16.5, 33.0, 40.0], 2: [nan, 39.6, 21.78], 3: [19.0, 46.2, 25.41]}
    seconds, overhead = _shaped_by_bare(times, bare)
    assert overhead == pytest.approx(1.1)
    assert seconds[0] == 10.0
    for k, ratio in ((1, 1.5), (2, 1.8), (3, 2.1)):
        assert seconds[k] == pytest.approx(10.0 * 1.1 * ratio)
    assert seconds[1] < seconds[2] < seconds[3]


def _plant_calibration(monkeypatch, cycle_s: dict):
    """plan_auto_depth's calibration, without timing anything: every depth's
    cycle (and bare pass) costs cycle_s[k]."""
    import mtplx.autodepth.calibration as autodepth
    from mtplx.autodepth.costs import CycleCosts

    class PlantedSampler:
        def __init__(self, model, batch_size, *a, **k):
            self.batch_size = batch_size

        def sample(self, rounds):
            pass

        def costs(self):
            verify = {k: s for k, s in cycle_s.items() if k > 0}
            return BareCosts(batch_size=self.batch_size, context=64, step_s=cycle_s[0], verify_s=verify)

    monkeypatch.setattr(autodepth, "BareCostSampler", PlantedSampler)
    monkeypatch.setattr(
        autodepth, "measure_cycle_costs", lambda model, batch_size, **k: CycleCosts(batch_size, cycle_s)
    )


def test_greedy_rows_keep_a_controller_on_any_predicted_gain_and_start_speculating_past_the_margin(monkeypatch):
    import types

    import mtplx.autodepth.calibration as autodepth

    _plant_calibration(monkeypatch, {0: 10.0, 1: 14.0})
    model = types.SimpleNamespace(head=object())
    contract = MTPContract(depth="auto", max_depth_auto=1)
    # depth 1 predicted 1.48 x 10 / 14 = 1.06, 1.44 x 10 / 14 = 1.03, 1.36 x 10 / 14 = 0.97
    for prior, on in ((0.48, True), (0.44, False), (0.36, None)):
        monkeypatch.setattr(autodepth, "acceptance_prior", lambda model, depths, sampled=False: [prior])
        plan = autodepth.plan_auto_depth(model, contract, max_batch=4)
        assert plan.job_depth == (1 if on else 0)  # a depth fixed on a prior needs SPECULATION_MARGIN
        if on is None:
            assert plan.controller is None and plan.max_depth == 0  # plain decoding, no head work
        else:
            assert plan.record["greedy_depth_at_start"] == (1 if on else 0)
            assert plan.controller.choose() == (1 if on else 0)  # under the margin: off, probing later
            assert plan.controller.off != on


def test_a_job_depth_at_batch_1_is_the_fastest_predicted_while_larger_batches_keep_the_tolerance(monkeypatch):
    import types

    import mtplx.autodepth.calibration as autodepth
    from mtplx.autodepth.costs import CycleCosts

    cycle_s = {0: 10.0, 1: 12.0, 2: 14.0, 3: 16.0}
    _plant_calibration(monkeypatch, cycle_s)
    acc = [0.8, 0.6, 0.4]  # depth 2: 2.4 x 10 / 14 = 1.714; depth 3: 2.8 x 10 / 16 = 1.75, 2% ahead
    monkeypatch.setattr(autodepth, "acceptance_prior", lambda model, depths, sampled=False: acc)
    model = types.SimpleNamespace(head=object())
    contract = MTPContract(depth="auto", max_depth_auto=3)
    costs = CycleCosts(1, cycle_s)
    assert 1.0 < predicted_speedup(costs, acc, 3) / predicted_speedup(costs, acc, 2) < DEPTH_TOLERANCE
    assert autodepth.plan_auto_depth(model, contract, max_batch=1).job_depth == 3
    assert autodepth.plan_auto_depth(model, contract, max_batch=4).job_depth == 2


def test_a_job_depth_must_win_by_the_margin():
    costs = _costs(10.0, {1: 10.5, 2: 11.0, 3: 11.5}, 0.0)
    acc = [0.06, 0.0, 0.0]  # depth 1 predicted 1.06 / 1.05 = ~1.01x
    assert best_depth(costs, acc, 3) == 1
    assert best_depth(costs, acc, 3, margin=1.1) == 0


def test_speculation_back_on_after_an_off_spell_keeps_greedy_output_exact(predictable_qwen):
    # Rows that lived through depth-0 cycles draft from a head history with
    # gaps and stale pending pairs: fewer drafts accepted, the same tokens.
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20], [5, 6, 7, 8], [30, 31]]
    plain = MTPLXRuntime(predictable_qwen, MTPContract(depth=0), max_batch=3).generate(prompts, max_tokens=16)
    rt = _with_scripted_auto(predictable_qwen, [2, 3, 0, 0, 0, 2, 3, 1, 0, 3, 0, 0, 1])
    got = rt.generate(prompts, max_tokens=16)
    assert [c.tokens for c in got] == [c.tokens for c in plain]
    used = rt.policy.record["cycles_by_depth"]
    assert all(used[str(k)] > 0 for k in range(4))
    assert sum(sum(c.accepted_by_depth) for c in got) > 0


# -- measured cycle costs ------------------------------------------------------


def _timed_job(controller, true_cost, accept, cycles, rows=4, timed=True, seed=0, clean=True):
    """Cycles as the runtime runs them: choose a depth, launch (reporting the
    time when `timed`), then read each row's accepted count. Cycles take
    true_cost[depth] +-5%; each draft is accepted with probability `accept`."""
    rng = np.random.default_rng(seed)
    t, used = 0.0, []
    for _ in range(cycles):
        k = controller.choose()
        if timed:
            controller.launched(k, t, clean=clean)
        t += true_cost[k] * rng.uniform(0.95, 1.05)
        accepted = (rng.random((rows, k)) < accept).cumprod(axis=1).sum(axis=1)  # [rows]
        controller.observe(accepted, np.full(rows, k))
        used.append(k)
    return np.array(used)


def test_a_timed_controller_keeps_speculating_where_its_measured_cycles_pay_though_calibration_says_not():
    # Calibration priced depth 1 at 1.4 x plain: (1 + 0.35) / 1.4 = 0.96, no
    # gain. The job's cycles cost 1.15 x plain: 1.35 / 1.15 = 1.17.
    calibrated = CycleCosts(4, {0: 10.0, 1: 14.0})
    true = {0: 10.0, 1: 11.5}
    timed = DepthController(calibrated, [0.35], 1)
    used = _timed_job(timed, true, 0.35, 1200)
    assert (used[-400:] == 1).mean() > 0.85  # on, but for its bursts at plain decoding
    assert 0 < (used == 0).mean() < 0.15
    assert timed.timing.costs().seconds[1] / timed.timing.costs().seconds[0] == pytest.approx(1.15, abs=0.05)
    untimed = DepthController(calibrated, [0.35], 1)
    assert (_timed_job(untimed, true, 0.35, 1200, timed=False)[-400:] == 0).mean() > 0.8  # calibration's word: off
    # An untimed controller never explores: every cycle at depth 1 while on.
    fresh = DepthController(calibrated, [0.9], 1)
    assert (_timed_job(fresh, true, 0.9, 200, timed=False) == 1).all()


def test_a_timed_controller_goes_off_where_its_measured_cycles_do_not_pay_though_calibration_says_they_do():
    # Calibration: (1 + 0.35) x 10 / 11 = 1.23. The job's cycles: 1.35 / 1.4 = 0.96.
    calibrated = CycleCosts(4, {0: 10.0, 1: 11.0})
    true = {0: 10.0, 1: 14.0}
    timed = DepthController(calibrated, [0.35], 1)
    assert (_timed_job(timed, true, 0.35, 1200)[-400:] == 0).mean() > 0.8
    untimed = DepthController(calibrated, [0.35], 1)
    assert (_timed_job(untimed, true, 0.35, 1200, timed=False)[-400:] == 1).all()


def test_a_timed_controller_explores_the_depths_beside_the_one_it_runs_and_moves_to_the_faster():
    # Calibration makes depths 2 and 3 dear: depth 1 is the pick. Measured,
    # depth 2 costs little more than depth 1 and wins: 1.8 / 12 against 2.3 / 12.5.
    calibrated = CycleCosts(4, {0: 10.0, 1: 12.0, 2: 18.0, 3: 24.0})
    true = {0: 10.0, 1: 12.0, 2: 12.5, 3: 17.0}
    c = DepthController(calibrated, [0.8, 0.5, 0.2], 3)
    used = _timed_job(c, true, 0.8, 1500)
    assert used[0] == 1
    assert (used[-500:] == 2).mean() > 0.9
    assert set(used[-500:].tolist()) - {2}  # it keeps measuring, now and then, the depths beside it


def test_greedy_output_is_plain_greedy_while_a_timed_controller_explores(predictable_qwen):
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20], [5, 6, 7, 8], [30, 31]]
    plain = MTPLXRuntime(predictable_qwen, MTPContract(depth=0), max_batch=3).generate(prompts, max_tokens=14)
    calibrated = CycleCosts(3, {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3})
    controller = DepthController(calibrated, [0.9, 0.8, 0.7], 3)
    controller.explore_every = 2  # a burst every few cycles
    reported = []
    launched = controller.launched
    controller.launched = lambda k, t, clean: (reported.append((k, clean)), launched(k, t, clean))
    rt = MTPLXRuntime(predictable_qwen, MTPContract(depth=3), max_batch=3)
    rt.policy = AutoDepth(3, 3, controller, {"cycles_by_depth": {str(k): 0 for k in range(4)}})
    got = rt.generate(prompts, max_tokens=14)
    assert [c.tokens for c in got] == [c.tokens for c in plain]
    assert len(reported) == rt.stats["cycles"]
    assert len({k for k, _ in reported}) >= 2  # it explored
    assert reported[0][1] is False  # the first launch follows a prefill
    assert any(clean for _, clean in reported)
    measured = rt.policy.record["measured_cycle_costs"]  # what the job summary shows
    assert set(measured["cycle_s"]) == {"0", "1", "2", "3"} and measured["pairs"]


def test_warm_up_visits_every_speculating_depth_right_after_every_depth():
    from mtplx.autodepth.policy import warm_up_depths

    seq = warm_up_depths(3)
    after = {(a, b) for a, b in zip(seq, seq[1:])}
    assert {(prev, k) for prev in range(4) for k in range(1, 4)} <= after


def test_an_adaptive_runtime_traces_every_depth_before_the_job_and_starts_its_counts_at_zero(
    predictable_qwen, monkeypatch
):
    import mtplx.autodepth.calibration as autodepth
    from mtplx.autodepth.policy import warm_up_depths

    controller = DepthController(CycleCosts(2, {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}), [0.9, 0.8, 0.7], 3)
    monkeypatch.setattr(
        autodepth, "plan_auto_depth", lambda model, contract, max_batch: AutoDepth(0, 3, controller, {})
    )
    launched = []
    real_launch = MTPLXRuntime._launch

    def recording_launch(self, batch, in_flight, k):
        launched.append(k)
        return real_launch(self, batch, in_flight, k)

    monkeypatch.setattr(MTPLXRuntime, "_launch", recording_launch)
    rt = MTPLXRuntime(predictable_qwen, MTPContract(depth="auto"), max_batch=2)
    assert launched == warm_up_depths(3)  # every one played, on the runtime's own passes
    assert rt.policy.controller is controller and rt.eos == set(predictable_qwen.eos_token_ids)
    assert rt.stats["cycles"] == 0 and set(rt.policy.record["cycles_by_depth"].values()) == {0}
    assert not controller.timed  # the warm-up's cycles are no measurement
    prompts = [[3, 4, 5], [7, 8, 9, 10]]
    plain = MTPLXRuntime(predictable_qwen, MTPContract(depth=0), max_batch=2).generate(prompts, max_tokens=10)
    assert [c.tokens for c in rt.generate(prompts, max_tokens=10)] == [c.tokens for c in plain]


def test_a_timed_controller_whose_cycles_are_never_clean_goes_off_on_calibrations_word_after_a_few_bursts():
    # Rows finishing every few cycles: no interval is a clean cycle, no pair comes.
    calibrated = CycleCosts(4, {0: 10.0, 1: 14.0})  # (1 + 0.35) / 1.4 = 0.96: calibration says off
    c = DepthController(calibrated, [0.35], 1)
    for cycles in range(1, 400):
        _timed_job(c, {0: 10.0, 1: 11.5}, 0.35, 1, clean=False, seed=cycles)
        if c.off:
            break
    assert c.off and not c.timing.pairs
    # 64 cycles (min_rows at 4 rows) on, then MEASURE_PLAIN_BURSTS bursts
    # of 3 cycles with 6 between them: it did not keep measuring for ever.
    assert 64 <= cycles <= 64 + (MEASURE_PLAIN_BURSTS + 1) * 3 * EXPLORE_CYCLES


def test_a_controller_goes_deeper_only_for_a_clear_gain_and_stays_deeper_only_while_clearly_ahead():
    # d_1 is always accepted: depth 1 scores 2 x 10 / 12, depth 2
    # (2 + q) x 10 / 14 with q the rate d_2 is accepted at, so depth 2 over
    # depth 1 is (2 + q) x 3 / 7. Observed exactly, in cycles of 1000 rows.
    costs = CycleCosts(1, {0: 10.0, 1: 12.0, 2: 14.0})

    def observed(c, q):
        m = round(q * 1000)
        for _ in range(20):
            c.observe(np.array([2] * m + [1] * (1000 - m)), np.full(1000, 2))

    c = DepthController(costs, [0.8, 0.64], 2, prior_weight=1.0)
    steps = [
        (0.265, 1),  # depth 2 at 0.971 of depth 1: depth 1
        (0.40, 1),  # depth 2 1.029x ahead: not past DEPTH_TOLERANCE, stays at 1
        (0.60, 2),  # 1.114x ahead: goes deeper
        (0.40, 2),  # 1.029x ahead: still past HOLD_DEEPER, stays at 2
        (0.36, 1),  # 1.011x ahead: a near tie goes back to the shallower depth
        (0.20, 1),  # depth 1 clearly faster: stays there
    ]
    for q, depth in steps:
        observed(c, q)
        assert c.choose() == depth, (q, c.acceptance())
    assert 1.0 < HOLD_DEEPER < (2 + 0.40) * 3 / 7 < DEPTH_TOLERANCE
    assert 1.0 < (2 + 0.36) * 3 / 7 < HOLD_DEEPER


def test_a_given_sampled_depth_is_the_depth_of_every_sampled_cycle(predictable_qwen):
    with pytest.raises(ValueError, match="sampled_depth is for depth 'auto'"):
        MTPContract(depth=2, sampled_depth=2)
    with pytest.raises(ValueError, match="sampled_depth must be in 0..3"):
        MTPContract(depth="auto", sampled_depth=4)
    prompts = [[3, 4, 5], [7, 8, 9, 10], [20], [5, 6]]
    sp = mtplx.SamplingParams(temperature=1.0)
    auto = MTPLXRuntime(predictable_qwen, MTPContract(depth="auto", sampled_depth=2), max_batch=2)
    assert auto.stats["auto_depth"]["depth"] == 2 and auto.stats["auto_depth"]["depth_from"].startswith("given")
    fixed = MTPLXRuntime(predictable_qwen, MTPContract(depth=2), max_batch=2)
    got = auto.generate(prompts, sampling=sp, max_tokens=8, seed=4)
    assert [o.tokens for o in got] == [o.tokens for o in fixed.generate(prompts, sampling=sp, max_tokens=8, seed=4)]
    by_depth = auto.stats["auto_depth"]["cycles_by_depth"]
    assert by_depth["2"] > 0 and by_depth["2"] == sum(by_depth.values())


def test_calibration_takes_its_light_effort_only_where_the_full_one_would_run_past_its_budget():
    from mtplx.autodepth.calibration import (
        CALIBRATION_BUDGET_S,
        FULL_EFFORT,
        FULL_EFFORT_STEPS,
        LIGHT_EFFORT,
        calibration_effort,
    )

    bound = CALIBRATION_BUDGET_S / FULL_EFFORT_STEPS
    assert calibration_effort(0.005) == FULL_EFFORT  # the built-in model's steps: calibration as it was
    assert calibration_effort(bound) == FULL_EFFORT and calibration_effort(bound * 1.01) == LIGHT_EFFORT
    light, full = LIGHT_EFFORT, FULL_EFFORT
    assert light.rounds < full.rounds and light.bare_first < full.bare_first and light.prompt_len < full.prompt_len
    assert light.sampled_rounds % 2 == 0  # every other round runs the depths in reverse


def test_a_slow_step_calibrates_with_the_light_effort_and_records_it(tmp_path, monkeypatch):
    import mtplx.autodepth.calibration as autodepth

    seen = []

    def fake(model, B, depths, **kw):
        seen.append({k: kw.get(k) for k in ("rounds", "burst", "repeats", "prompt_len", "bare_rounds_between")})
        return CycleCosts(B, {k: 1.0 + 0.05 * k for k in depths})

    class SlowSampler:
        def __init__(self, model, batch_size, *a, **k):
            self.batch_size, self.rounds = batch_size, []

        def sample(self, rounds):
            self.rounds.append(rounds)

        def costs(self):
            return BareCosts(self.batch_size, 64, 0.5, {1: 0.5, 2: 0.52, 3: 0.55}, head_s=0.01)

    monkeypatch.setattr(autodepth, "measure_cycle_costs", fake)
    monkeypatch.setattr(autodepth, "BareCostSampler", SlowSampler)
    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))
    auto = MTPLXRuntime(model, MTPContract(depth="auto"), max_batch=2)
    light = autodepth.LIGHT_EFFORT
    assert auto.stats["auto_depth"]["calibration_effort"] == "light"
    assert seen[0] == dict(
        rounds=light.rounds,
        burst=light.burst,
        repeats=light.repeats,
        prompt_len=light.prompt_len,
        bare_rounds_between=light.bare_between,
    )
