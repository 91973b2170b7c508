"""depth="auto": the speculation depth from a cost model calibrated at the job's batch
size, adjusted to the acceptance the job gets. Depth k's predicted speed-up over plain
decoding is (1 + sum_{i<=k} alpha_i) * cycle(0) / cycle(k), alpha_i the cumulative
acceptance at depth i. Cycles with a row sampling under the residual rule (whose draws
depend on the depth) run at one job depth chosen at calibration, every other cycle at
the depth `DepthController` picks. The plan is in `runtime.stats["auto_depth"]`. The rules and
the evidence for each constant: docs/autodepth.md."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from mtplx.autodepth.costs import CycleCosts, predicted_speedup
from mtplx.autodepth.timing import CycleTimes

DEFAULT_ACCEPTANCE = (0.5, 0.3, 0.18, 0.1)  # cautious prior, cumulative by depth


def acceptance_prior(model, depths: int = len(DEFAULT_ACCEPTANCE), sampled: bool = False) -> List[float]:
    """Cumulative acceptance by depth 1..`depths`: the checkpoint's training.json (the runtime's own,
    greedy or `sampled` at temperature 1; else teacher-forced greedy), else `DEFAULT_ACCEPTANCE`;
    extended at the last conditional rate."""
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


# Speculation starts only where predicted to beat plain decoding by this much: a job depth is never corrected.
SPECULATION_MARGIN = 1.05
# A speculating controller goes off only once no depth is predicted to pay at all (greedy output is depth-free).
KEEP_SPECULATING_ABOVE = 1.0
# A deeper depth must be predicted this much faster to be chosen or moved to: calibration noise, uneven
# finishes and the slow cycles after a change of depth are not in the prediction.
DEPTH_TOLERANCE = 1.05
# A running controller keeps a deeper depth only while it stays this much ahead (hysteresis near ties).
HOLD_DEEPER = 1.02
# At batch 1: the deepest depth within this of the fastest, and the gain it takes to change depth (one row
# finishes evenly, and one more position of a batch-1 pass is below what calibration resolves).
SINGLE_ROW_JOB_TIE = 1.02
# Off before `min_rows` if no depth pays even at this z of depth 1's one-sided Wilson bound (a useless head).
HOPELESS_Z = 3.0
# Each failed probe doubles the wait for the next, up to this many times `retry_rows`.
MAX_RETRY_BACKOFF = 8
# A timed, speculating controller runs an EXPLORE_CYCLES burst at a neighbouring depth every EXPLORE_EVERY
# cycles (EXPLORE_EVERY_MEASURED once each neighbour has MIN_PAIRS pairs), for `timing.CycleTimes`.
EXPLORE_EVERY = 32
EXPLORE_EVERY_MEASURED = 128
EXPLORE_CYCLES = 3
MEASURE_PLAIN_BURSTS = 4  # plain bursts tried before going off; after these, calibration's word decides


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
    """The shallowest (or `deepest`) depth within `tolerance` of the best; 0 unless one beats `margin`."""
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

    Keeps decayed counts of rows that reached and accepted each depth's draft, on
    top of `prior_weight` pseudo-rows at the prior's rates. Speculation goes off
    when no depth is predicted to pay and on only by the margin; while off it
    probes every `retry_rows` row-cycles for `probe_rows`, since only drafting
    cycles measure acceptance. `start_off`: begin off. `one_row`: a batch of one.
    Told each launch, it prices depths from the job's own cycles (`CycleTimes`).
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
        self.tie = SINGLE_ROW_JOB_TIE if one_row else DEPTH_TOLERANCE
        self.deepest = one_row
        self.max_depth = max_depth
        # Plain Python floats: K is a few, and numpy's per-call overhead would weigh on a short cycle.
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
        # A row reached d_i when i <= min(a + 1, drafted) (a <= drafted) and passed it when i <= a:
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
        """Decay the counts for the row-cycles since the last fade (lazy: off, nothing reads them)."""
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
        """The depth of the next cycle. `draining`: nothing waits to refill the batch and several rows
        run; then no probe starts: the last cycles run for the slowest rows, which predictions miss."""
        if self._explore_left > 0:
            self._explore_left -= 1
            return self._explore_depth
        if self.off and (self.rows_seen < self._retry_after or draining):
            return 0  # nothing to decide before a probe is due: an off cycle stays cheap
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
        # Timed, it measures plain decoding beside its depth before going off: that decides it.
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
        # A probe is judged on what it drafts: at its start the faded counts are near the prior.
        if pays and (not self.probing or self.rows_seen >= self.probe_rows):
            self.probing = False
            self._retry_after = self.retry_rows
        if self.off:
            return 0
        self._current = best
        return self._maybe_explore(best, measure_plain)

    def _hopeless(self, costs) -> bool:
        """Whether no depth pays even at the optimistic end of the acceptance seen (HOPELESS_Z)."""
        self._fade()
        best_case = wilson_upper(self.passed[0], self.reached[0], HOPELESS_Z)
        optimistic = [best_case] * self.max_depth  # every draft as likely as d_1
        return all(
            predicted_speedup(costs, optimistic, k) < KEEP_SPECULATING_ABOVE for k in range(1, self.max_depth + 1)
        )

    def _maybe_explore(self, best: int, measure_plain: bool) -> int:
        """`best`, or the first cycle of a burst at a neighbouring depth when one is due
        (EXPLORE_EVERY); `measure_plain`: about to go off, so plain decoding is due soon."""
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
    """Every depth 1..max_depth right after every depth 0..max_depth: the shapes the runtime traces
    its passes for (verify and drafts per depth, head catch-up per previous depth)."""
    return [k for depth in range(1, max_depth + 1) for prev in range(max_depth + 1) for k in (prev, depth)]


@dataclass
class AutoDepth:
    """The policy of depth "auto" (see `mtplx.decode.depth`): sampled rows under the residual
    rule at `job_depth`, every other cycle at the controller's choice."""

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
        """Whether prompts go through the head: not while sampled rows are plain and the controller is
        off. A row prefilled without it drafts from a head history with a gap: less acceptance, same output."""
        if self.controller is None or self.job_depth > 0:
            return True
        return not getattr(self.controller, "off", False)

    def finished(self) -> None:
        timing = getattr(self.controller, "timing", None)
        if timing is not None:
            self.record["measured_cycle_costs"] = timing.as_dict()
