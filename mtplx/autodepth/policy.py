"""depth="auto": pick the speculation depth from a cost model calibrated on
this machine, and keep adjusting it to the acceptance the job is getting.

The expected speed-up of depth k over plain decoding is
    (1 + sum_{i<=k} alpha_i) * cycle_time(0) / cycle_time(k)
with alpha_i the cumulative acceptance at depth i. The cycle times are
measured here at the runtime's batch size: the bare passes (one-token step,
verify over k+1 tokens, head pass; `costs.BareCostSampler`) give their
shape across depths, and short decodes of the runtime itself at every depth
(`costs.measure_cycle_costs`) give how much a whole cycle costs beyond the
bare passes. Every slot is computed whether or not a row occupies it, so the
ratio between depths does not move as rows come and go.
alpha starts from the model's own recorded evaluation when it ships one (the
built-in model records the runtime's acceptance on held-out prompts, greedy
and at temperature 1), else a cautious prior.

Two regimes, because under sampling with the residual rule a row's draws
depend on the depth each of its cycles used:
- **job depth**: calibration picks one depth for the whole job, from the
  sampled acceptance prior and the runtime's own sampled cycles (only
  sampled rows run at it). Every cycle in
  which some row samples under the residual rule runs at it, so such a row's
  output never depends on other rows or on timing. Depth 0 (no head work at
  all) unless a depth is predicted to beat plain decoding by 5%
  (`SPECULATION_MARGIN`); on compute-bound hardware at large batches none
  does.
- **adaptive**: when every row in the batch is greedy, or the job uses the
  coupled rule, output does not depend on the depth at all, so each cycle runs
  at the depth that the running acceptance (`DepthController`) predicts to be
  fastest. It starts speculating where the greedy prior predicts a depth to
  beat plain decoding by the margin (predicted to gain less, it starts off);
  once the running acceptance predicts no gain, the controller switches
  speculation off, and tries it again later (a probe, which stays on only if
  a depth then beats plain by the margin; none starts while nothing waits to
  refill a batch of several rows). Its cycles
  also measure what each depth costs (`cycle_timing.CycleTimes`, with short
  bursts at neighbouring depths), and those measurements replace the
  calibrated costs as they come in.
If neither regime speculates at the start, the job decodes plainly with no
head work at all (as at large batches on compute-bound hardware).

The choice, its inputs, the cycles run at each depth and the measured costs
are in `runtime.stats["auto_depth"]` (and so in the job summary).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from mtplx.autodepth.costs import CycleCosts, predicted_speedup
from mtplx.autodepth.timing import CycleTimes

DEFAULT_ACCEPTANCE = (0.5, 0.3, 0.18, 0.1)  # cautious prior, cumulative by depth


def acceptance_prior(model, depths: int = len(DEFAULT_ACCEPTANCE), sampled: bool = False) -> List[float]:
    """Cumulative acceptance by depth 1..`depths`, from the checkpoint's
    training.json: the runtime's own acceptance on held-out prompts, greedy or
    at temperature 1 (`sampled`), which the built-in model records for depths
    1-3; else the teacher-forced greedy figure (depths 1 and 2); else a
    cautious default. Depths past the recorded ones repeat the last
    conditional rate."""
    rates = list(DEFAULT_ACCEPTANCE)
    meta = model.path / "training.json"
    if meta.exists():
        try:
            found = json.loads(meta.read_text())
            runtime = found.get("acceptance_runtime", {}).get("temperature_1" if sampled else "greedy")
            if runtime and all(a is not None for a in runtime["by_depth"]):
                rates = [float(a) for a in runtime["by_depth"]]
            else:
                rec = found["acceptance_teacher_forced"]
                rates = [float(rec["depth1"])]
                if "depth2_cumulative" in rec:
                    rates.append(float(rec["depth2_cumulative"]))
        except (ValueError, KeyError, TypeError):
            rates = list(DEFAULT_ACCEPTANCE)
    return extend_geometrically(rates, depths)


def extend_geometrically(cumulative: Sequence[float], depths: int) -> List[float]:
    out = [float(a) for a in cumulative[:depths]]
    last = conditional_rates(out)[-1] if out else 0.0
    while len(out) < depths:
        out.append(out[-1] * last)
    return out


# Speculating must be predicted to win by this much: a job depth is fixed on a
# prior the job cannot correct. It was 1.1 while measured speed-ups came out
# at 0.8-0.95 of predicted ones at batch 4; since calibration prices the
# runtime's own cycles (CycleCosts.overhead) and OpenBLAS no longer spins
# beside the decode, they came out at 0.93-1.06 (make bench, 01:33 UTC
# 2026-11-30), while 1.1 kept batch 4 plain in two benches running where
# depth 1 measured 1.10x (greedy) and 1.25x (temperature 1) over it.
SPECULATION_MARGIN = 1.05

# A controller that is speculating (not probing) goes off only once no depth
# is predicted to beat plain decoding at all. Between 1 and the margin
# speculation still pays as predicted, and a greedy row's output does not
# depend on the depth, so the margin only guards turning it on. At batch 4
# here depth 1 is predicted 1.05-1.10 over plain with the greedy prior: one
# batch of prompts that accepted a little less than it took the controller
# off (212 of 282 cycles plain in a bench where depth 1 measured 1.27x over
# plain), and a probe comes only every `retry_rows`.
KEEP_SPECULATING_ABOVE = 1.0

# A deeper depth must be predicted to win by this much over a shallower one:
# calibration's verify-over-step ratios move by about 3% between two
# calibrations here, and a deeper depth's rows finish a batch less evenly
# and draw more keyed samples, neither of which the prediction sees. At 1.03
# one calibration put depth 2 3.7% ahead of depth 1 at batch 4, temperature
# 1, and the job ran depth 2; in the three benches of 2026-11-30 depth 1's
# measured decode speed-up over plain there was 1.20, 1.09 and 1.11, depth
# 2's 1.19, 0.98 and 1.02, which the bench's own bare costs predicted
# 0-5% apart (1.18 / 1.18, 1.14 / 1.11, 1.14 / 1.09).
# A running controller also leaves the depth it runs only for a depth
# predicted this much faster: the first cycle or two after a change of depth
# run slower (at batch 1 here the first depth-2 cycle after depth 1 took
# 5.8 ms against 5.4-5.6, and the first two depth-1 cycles after depth 2
# 4.9-5.0 against 4.4-4.8), and a controller that crossed back and forth
# near a tie paid for it: 0.949 of a fixed depth 1 over 50 paired rounds at
# batch 1 greedy, where it ran 0.998 once it stayed put.
DEPTH_TOLERANCE = 1.05

# Once deeper than the shallowest depth within DEPTH_TOLERANCE, a running
# controller stays there only while it is predicted at least this much faster
# than that depth: a near tie goes back to the shallower one, and the gap
# between the 5% it takes to go deeper and the 2% it takes to stay keeps it
# from crossing back and forth. Held within the whole tolerance, as before,
# a controller at batch 1 greedy ran depth 3 in a third of its cycles in two
# of three `make bench` runs (2026-11-30), where depth 3 measured 0.975 of
# depth 2, and auto came out at 0.926 and 0.938 of depth 2: calibration had
# scored the two within 1% (1.548 / 1.537, 1.294 / 1.299), so once at depth
# 3 nothing moved it back. Ties are mispriced either way there: in the next
# run it went to depth 1 (588, 524 and 198 cycles at depths 1, 2 and 3;
# depth 1 measured 0.95 of depth 2) and came out at 0.971 of depth 2.
HOLD_DEEPER = 1.02

# A job depth at batch size 1 is the deepest depth predicted within
# SINGLE_ROW_JOB_TIE of the fastest. Of the reasons for DEPTH_TOLERANCE only
# the deeper depth's extra keyed draws apply to one row at one fixed depth: no
# rows finish unevenly, nothing changes depth, and the draws' cost did not
# show in the measurements below. Under the tolerance, sampled rows at batch
# 1 ran depth 2 in seven of eight `make bench` runs (2026-11-30), where
# calibration put depth 3 up to 4.7% ahead of it; depth 3 measured 0.8-3.7%
# faster than depth 2 in all eight, and auto in those seven came out at
# 0.92-1.01 of the best fixed depth. Taking the fastest alone, calibration
# put depth 2 0.3% ahead in the next run (1.674 against 1.670), depth 3
# measured 10% faster, and auto came out at 0.915 of it (2026-12-01). At
# batch 1 the two predictions differ by one position of a dispatch-bound
# pass, which calibration cannot resolve: four samplings of 15 rounds each
# put (verify over 4 + 3 heads) / (verify over 3 + 2 heads) at 1.106-1.187.
# A batch-1 controller picks its greedy cycles' depth by the same rule, and
# this is also the gain it takes to change depth. Under DEPTH_TOLERANCE some
# adaptive runtimes at batch 1 greedy ran depth 1 in up to 28% of their
# cycles (a start or a few noisy pairs within 5%, and nothing 5% better to
# leave it for); over four processes of 64 paired rounds ten such runtimes
# came out at 0.906-0.991 of a fixed depth 3 (mean 0.958), six under this
# rule at 0.947-1.004 (mean 0.978) (2026-12-02).
SINGLE_ROW_JOB_TIE = 1.02

# A speculating controller goes off before `min_rows` once even an optimistic
# reading of what it has seen cannot pay: depth 1's acceptance at the upper
# end of its Wilson interval at HOPELESS_Z (one-sided, a 0.13% false alarm
# at any one check), and every deeper draft accepted as often as d_1 (the
# cumulative rate can only fall with depth). A head that drafts nearly
# nothing right (one never trained, or prompts far from its training) then
# costs some 50 row-cycles instead of `min_rows`: on a random tiny qwen3_5
# checkpoint (acceptance 0.03) auto ran 0.86 of plain greedy decoding at
# batch 1 over a 24-run bench, 225 of its 655 cycles at depth 1. A false
# alarm only costs speed until the next probe: greedy output does not depend
# on the depth.
HOPELESS_Z = 3.0

# Each probe that ends with speculation off doubles the wait before the next,
# up to this many times `retry_rows`; a probe that pays resets it. Where the
# head drafts nearly nothing right, every probe costs some 50 row-cycles
# at a speculating cycle's price (1.4x plain on a tiny checkpoint at batch
# 1): 2% of a job at one probe per 1,024 row-cycles, 0.3% at one per 8,192.
# A job whose prompts start to accept later finds out within that wait.
MAX_RETRY_BACKOFF = 8

# While speculating, a controller that is told its cycles' launch times
# (`DepthController.launched`) runs a short burst at a neighbouring depth
# (one shallower and one deeper in turn; at depth 1, plain decoding) every
# EXPLORE_EVERY cycles, so that `cycle_timing.CycleTimes` can measure what
# each costs next to the depth it runs; a burst of EXPLORE_CYCLES gives two
# intervals at its depth. Once every neighbour is measured (MIN_PAIRS pairs
# with the depth it runs), a burst comes every EXPLORE_EVERY_MEASURED cycles,
# to follow the machine and the context length. Greedy rows' output does not
# depend on the depth, so a burst only costs time. At batch 4 greedy here,
# with depth 1 the fastest, over 30 paired rounds against a fixed depth 1:
# bursts every 32 cycles throughout (9% of cycles at depths 0 and 2) ran
# 0.969, every 128 once measured (3%) 0.978, the same plan untimed, all at
# depth 1, 0.989-0.990.
EXPLORE_EVERY = 32
EXPLORE_EVERY_MEASURED = 128
EXPLORE_CYCLES = 3
# Bursts at plain decoding a controller runs to measure it before going off;
# where cycles are rarely clean (rows finishing every few cycles) the pairs
# may not come, and it goes off on calibration's word after these.
MEASURE_PLAIN_BURSTS = 4


def fastest_depth(scores: dict, tolerance: float = DEPTH_TOLERANCE, deepest: bool = False) -> int:
    """The shallowest (or `deepest`) depth predicted within `tolerance` of the fastest."""
    top = max(scores.values())
    within = [k for k, s in scores.items() if s * tolerance >= top]
    return max(within) if deepest else min(within)


def best_depth(
    costs,
    acceptance: Sequence[float],
    max_depth: int,
    margin: float = 1.0,
    tolerance: float = DEPTH_TOLERANCE,
    deepest: bool = False,
) -> int:
    """The shallowest (or `deepest`) depth predicted within `tolerance` of the
    best speed-up; 0 unless one beats `margin`."""
    depths = [k for k in range(1, max_depth + 1) if k in costs.verify_s and k <= len(acceptance)]
    scores = {k: predicted_speedup(costs, acceptance, k) for k in depths}
    if not scores:
        return 0
    best = fastest_depth(scores, tolerance, deepest)
    return best if max(scores.values()) >= margin else 0


def wilson_upper(successes: float, trials: float, z: float) -> float:
    """Upper end of the Wilson score interval of a rate (1.0 with no trials)."""
    if trials <= 0:
        return 1.0
    p = successes / trials
    centre = p + z * z / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return min(1.0, (centre + spread) / (1 + z * z / trials))


def conditional_rates(cumulative: Sequence[float]) -> List[float]:
    """P(d_i accepted | d_1..d_{i-1} accepted) from cumulative rates."""
    out, prev = [], 1.0
    for a in cumulative:
        out.append(min(1.0, float(a) / prev) if prev > 0 else 0.0)
        prev = float(a)
    return out


class DepthController:
    """Running acceptance by depth -> the fastest depth for the next cycle.

    Per depth i it keeps exponentially decayed counts of rows that reached
    d_i (accepted d_1..d_{i-1} and drafted d_i) and of rows that accepted it,
    on top of `prior_weight` pseudo-rows at the prior's rates, so one cycle
    cannot swing the choice and a depth not tried lately keeps its prior.

    When no depth is predicted to beat plain decoding any more
    (`KEEP_SPECULATING_ABOVE`) after `min_rows` row-cycles, speculation goes
    off (no head work); turning it on takes the margin. The counts
    keep decaying while it is off, so the estimate moves back toward the
    prior. Only a cycle that drafts measures acceptance, so after
    `retry_rows` row-cycles off, speculation is tried again for at least
    `probe_rows` row-cycles whatever the estimate: a job whose prompts accept
    better than the prior would otherwise never find out (greedy rows' output
    does not depend on the depth, so a probe only costs time). Probes that
    fail come ever less often (`MAX_RETRY_BACKOFF`).
    Early cycles of a row accept less than later ones, which is why a single
    bad spell must not switch it off for good. Before `min_rows` it goes off
    only on clear evidence: no depth pays even at the optimistic end of the
    acceptance seen (`HOPELESS_Z`). Rows that lived through an off
    spell draft from a head history with gaps: that lowers their acceptance,
    never their output. `start_off`: begin with speculation off, as when the
    prior is not predicted to pay by the margin; it then goes on at its
    first probe that pays. `one_row` (a batch of one): the deepest depth
    within SINGLE_ROW_JOB_TIE of the fastest, and a change of depth only for
    one predicted that much faster.

    The cycle costs it predicts from start as calibrated. Told each cycle's
    launch (`launched`), it measures them as the job runs (`CycleTimes`),
    exploring neighbouring depths in short bursts while speculating
    (`EXPLORE_EVERY`), and predicts from the measured costs wherever it has
    them: calibration's few seconds can misprice a whole speculating cycle
    by 10% on a noisy machine, which decides whether speculation pays at
    all where the gain is 5-15%.
    """

    def __init__(
        self,
        costs: CycleCosts,
        prior: Sequence[float],
        max_depth: int,
        half_life_rows: float = 256.0,
        prior_weight: float = 32.0,
        min_rows: int = 256,
        retry_rows: int = 1024,
        probe_rows: int = 64,
        start_off: bool = False,
        one_row: bool = False,
    ):
        self.costs = costs
        # One row: the deepest depth within a near tie, as for a one-row job depth (SINGLE_ROW_JOB_TIE).
        self.tie = SINGLE_ROW_JOB_TIE if one_row else DEPTH_TOLERANCE
        self.deepest = one_row
        self.max_depth = max_depth
        # Counts by depth as Python floats: K is at most a few, and numpy's
        # per-call cost made the controller ~0.1 ms of a 5-7 ms batch-1 cycle.
        self.prior_passed = [prior_weight * r for r in conditional_rates(prior[:max_depth])]  # [K]
        self.prior_reached = [float(prior_weight)] * max_depth  # [K]
        self.passed = [0.0] * max_depth  # [K]
        self.reached = [0.0] * max_depth  # [K]
        self._unfaded_rows = 0  # row-cycles whose decay is not applied to the counts yet
        self.half_life_rows = half_life_rows
        self.min_rows = min_rows
        self.retry_rows = retry_rows
        self._retry_after = retry_rows  # row-cycles off before the next probe (backs off)
        self.probe_rows = probe_rows
        self.probing = False  # on for a probe, not because the estimate pays
        self.rows_seen = 0  # row-cycles since speculation last went on or off
        self.off = start_off  # off from the start when the prior does not pay
        self.timing = CycleTimes(costs)
        self.timed = False  # whether launches are reported (then it explores)
        self.explore_every = EXPLORE_EVERY
        self._since_explore = 0
        self._explore_left = 0  # cycles of the burst still to run
        self._explore_depth = 0
        self._explore_turn = 0
        self._plain_bursts = 0  # bursts at plain decoding run to decide going off
        self._current = 0  # the depth chosen last outside a burst

    def launched(self, depth: int, t: float, clean: bool) -> None:
        """The runtime launched a cycle at `depth` at time `t` (seconds);
        `clean`: nothing but the previous cycle happened since the last one."""
        self.timed = True
        self.timing.launched(depth, t, clean)

    def observe(self, accepted: Sequence[int], drafted: Sequence[int]):
        """One cycle's active rows: accepted a_b and drafted (num_valid) counts."""
        n = len(accepted)
        if n == 0:
            return
        self.rows_seen += n
        self._unfaded_rows += n
        K = self.max_depth
        # A row reached d_i when it accepted d_1..d_{i-1} and drafted d_i,
        # i.e. i <= min(a + 1, drafted) (a <= drafted), and passed it when i <= a:
        # histograms of both, summed from the top.
        reached_at, passed_at = [0] * (K + 1), [0] * (K + 1)  # by depth 0..K
        for a, d in zip(accepted, drafted):
            reached_at[min(int(a) + 1, int(d), K)] += 1
            passed_at[min(int(a), K)] += 1
        if reached_at[0] == n:  # a plain cycle: nothing to count, the evidence fades
            return
        self._fade()
        reached = passed = 0
        for i in range(K, 0, -1):
            reached += reached_at[i]
            passed += passed_at[i]
            self.reached[i - 1] += reached
            self.passed[i - 1] += passed

    def _fade(self) -> None:
        """Decay the counts for the row-cycles seen since the last fade (kept
        lazy: off, a cycle would otherwise pay for it while nothing reads them)."""
        if self._unfaded_rows:
            decay = 0.5 ** (self._unfaded_rows / self.half_life_rows)
            self.reached = [decay * x for x in self.reached]
            self.passed = [decay * x for x in self.passed]
            self._unfaded_rows = 0

    def acceptance(self) -> List[float]:
        """Current cumulative acceptance estimate by depth."""
        self._fade()
        out, cum = [], 1.0
        for pp, p, pr, r in zip(self.prior_passed, self.passed, self.prior_reached, self.reached):
            cum *= (pp + p) / (pr + r)
            out.append(cum)
        return out

    def choose(self, draining: bool = False) -> int:
        """The depth of the next cycle. `draining`: nothing waits to refill
        the batch and several rows run. Then no probe starts: speculating
        lets rows drift apart, and once nothing refills the batch its last
        cycles run for its slowest rows, which a probe's prediction (each
        row's own cycles) does not see. In one batch of 16 here depth 1
        measured 0.85-0.99 of plain decoding where probes predicted more
        than the margin, and turned speculation on."""
        if self._explore_left > 0:
            self._explore_left -= 1
            return self._explore_depth
        if self.off and (self.rows_seen < self._retry_after or draining):
            return 0  # nothing to decide before a probe is due; a tiny model's cycle lasts under 1 ms
        acc = self.acceptance()
        costs = self.timing.costs() if self.timed else self.costs
        scores = {k: predicted_speedup(costs, acc, k) for k in range(1, self.max_depth + 1)}
        best = fastest_depth(scores, self.tie, self.deepest)
        current = self._current
        if current in scores and current < best and scores[current] * self.tie >= scores[best]:
            best = current  # changing depth costs a slow cycle or two: go deeper only for a clear gain
        elif current in scores and current > best and scores[current] >= scores[best] * HOLD_DEEPER:
            best = current  # a deeper depth is kept only while it stays clearly ahead
        pays = max(scores.values()) >= SPECULATION_MARGIN
        keeps = pays if self.probing else max(scores.values()) >= KEEP_SPECULATING_ABOVE
        hopeless = not self.off and self._hopeless(costs)
        going_off = (
            not self.off and not keeps and self.rows_seen >= (self.probe_rows if self.probing else self.min_rows)
        )
        going_off = going_off or hopeless
        # Timed, it first measures plain decoding beside the depth it runs:
        # that comparison decides whether speculation pays.
        measure_plain = (
            going_off
            and not hopeless
            and self.timed
            and self.explore_every > 0
            and not self.probing
            and (self.timing.pair_count(0, best) < self.timing.min_pairs and self._plain_bursts < MEASURE_PLAIN_BURSTS)
        )
        if not going_off:
            self._plain_bursts = 0
        if self.off:  # here only when a probe is due (see the top)
            self.off, self.rows_seen, self.probing = False, 0, True
        elif going_off and not measure_plain:
            self.off, self.rows_seen, self._plain_bursts = True, 0, 0
            if self.probing:  # a failed probe: wait longer for the next
                self._retry_after = min(2 * self._retry_after, MAX_RETRY_BACKOFF * self.retry_rows)
        # A probe is judged on what it drafts: at its start the faded counts
        # are back near the prior, which may pay.
        if pays and (not self.probing or self.rows_seen >= self.probe_rows):
            self.probing = False
            self._retry_after = self.retry_rows
        if self.off:
            return 0
        self._current = best
        return self._maybe_explore(best, measure_plain)

    def _hopeless(self, costs) -> bool:
        """Whether even an optimistic reading of the acceptance seen (HOPELESS_Z)
        predicts no depth to beat plain decoding."""
        self._fade()
        best_case = wilson_upper(self.passed[0], self.reached[0], HOPELESS_Z)
        optimistic = [best_case] * self.max_depth  # every draft as likely as d_1
        return all(
            predicted_speedup(costs, optimistic, k) < KEEP_SPECULATING_ABOVE for k in range(1, self.max_depth + 1)
        )

    def _maybe_explore(self, best: int, measure_plain: bool) -> int:
        """`best`, or the first cycle of a burst at a neighbouring depth when
        one is due (see EXPLORE_EVERY); `measure_plain`: about to go off, so
        plain decoding is due soon."""
        if not self.timed or self.probing or self.explore_every <= 0:
            return best
        near = [k for k in (best - 1, best + 1) if 0 <= k <= self.max_depth]
        if measure_plain:  # about to go off: plain decoding, after a few cycles at `best` to pair it with
            near, every = [0], 2 * EXPLORE_CYCLES
        elif all(self.timing.pair_count(k, best) >= self.timing.min_pairs for k in near):
            every = self.explore_every * EXPLORE_EVERY_MEASURED // EXPLORE_EVERY
        else:
            every = self.explore_every
        self._since_explore += 1
        if self._since_explore < every:
            return best
        self._since_explore = 0
        self._explore_turn += 1
        self._explore_depth = near[self._explore_turn % len(near)]
        self._explore_left = EXPLORE_CYCLES - 1
        if measure_plain:
            self._plain_bursts += 1
        return self._explore_depth


def warm_up_depths(max_depth: int) -> List[int]:
    """Every depth 1..max_depth right after every depth 0..max_depth. A
    runtime traces its compiled passes per shape on first use: per depth the
    verify and the draft chain, per previous depth the head catch-up. An
    adaptive job would first visit most of them in the bursts of its early
    cycles (`EXPLORE_EVERY`); on the default model here their tracing takes
    about 50 ms in all at batch 1 and 4, against 3-10 ms a cycle."""
    return [k for depth in range(1, max_depth + 1) for prev in range(max_depth + 1) for k in (prev, depth)]


@dataclass
class AutoDepth:
    """The depth policy of depth "auto" (`mtplx.decode.depth` says what a
    policy answers): sampled rows under the residual rule at `job_depth`,
    every other cycle at the controller's choice."""

    job_depth: int  # the depth of every cycle with a row sampling under the residual rule
    max_depth: int  # the deepest any cycle may go (what the batch is built for)
    controller: Optional[DepthController]  # None: every cycle runs at job_depth
    record: dict = field(default_factory=dict)

    def choose(self, sampled_residual: bool, draining) -> int:
        if self.controller is None or sampled_residual:
            return self.job_depth  # a residual-rule row's draws depend on the depth
        return self.controller.choose(draining=draining())

    def launched(self, depth: int, t: float, clean: bool) -> None:
        if self.controller is not None:
            self.controller.launched(depth, t, clean=clean)

    def observe(self, accepted, drafted) -> None:
        if self.controller is not None:
            self.controller.observe(accepted, drafted)

    def warm_up_depths(self) -> List[int]:
        return warm_up_depths(self.max_depth) if self.controller is not None else []

    def prefills_head(self) -> bool:
        """Not while sampled rows are kept plain and the greedy controller is
        off: a head pass over every prompt would be work for nothing. A row
        prefilled without it drafts, once a probe turns speculation on, from
        a head history with a gap: that costs acceptance, never output."""
        if self.controller is None or self.job_depth > 0:
            return True
        return not getattr(self.controller, "off", False)

    def finished(self) -> None:
        timing = getattr(self.controller, "timing", None)
        if timing is not None:
            self.record["measured_cycle_costs"] = timing.as_dict()
