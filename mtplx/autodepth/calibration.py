"""Calibration for depth "auto": time the bare passes and the runtime's own cycles
at the job's batch size on the machine it runs on, then plan the job's depths
(`plan_auto_depth`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from mtplx.autodepth import bursts
from mtplx.autodepth.bursts import burst_sequence, burst_times, tokens_bound
from mtplx.autodepth.costs import (
    BareCosts,
    BareCostSampler,
    CycleCosts,
    _anchored_to,
    _shaped_by_bare,
    predicted_speedup,
    verify_never_falling,
)
from mtplx.autodepth.policy import (
    DEPTH_TOLERANCE,
    KEEP_SPECULATING_ABOVE,
    SINGLE_ROW_JOB_TIE,
    SPECULATION_MARGIN,
    AutoDepth,
    DepthController,
    acceptance_prior,
    best_depth,
)
from mtplx.decode.contract import MTPContract
from mtplx.decode.depth import ScriptedDepths
from mtplx.decode.runtime import BatchRuntime
from mtplx.decode.sampling import SamplingParams

# Bare-pass rounds: BARE_ROUNDS_FIRST, then BARE_ROUNDS_BETWEEN after each round of the runtime's cycles,
# since rounds taken in one go can all fall in one slow spell, which flattens the cost shape across depths.
BARE_ROUNDS_FIRST = 5
BARE_ROUNDS_BETWEEN = 2

# Rounds of sampled cycles pricing the job depth (greedy ones price the draws at nothing), timed only where
# greedy prices put a depth over the margin; even, as every other round runs the depths in reverse.
SAMPLED_CALIBRATION_ROUNDS = 4


@dataclass(frozen=True)
class Effort:
    """How much calibration times: bare rounds before and between, rounds of greedy and of sampled cycles,
    cycles per burst, bursts of each depth per round, and the random prompts' length (each round prefills
    them anew)."""

    bare_first: int
    bare_between: int
    rounds: int
    sampled_rounds: int
    burst: int
    repeats: int
    prompt_len: int


FULL_EFFORT = Effort(
    BARE_ROUNDS_FIRST, BARE_ROUNDS_BETWEEN, 5, SAMPLED_CALIBRATION_ROUNDS, bursts.BURST, bursts.REPEATS, 48
)
# Where a step takes long (a model of real size on a CPU), the full effort runs for minutes at each batch size;
# there the passes' times are long and steady next to their jitter, so fewer samples price them as well.
LIGHT_EFFORT = Effort(2, 0, 2, 2, 3, 1, 16)
# The full effort costs about this many one-token steps (its cycles, and the bare passes' bursts); it is kept
# while that takes at most CALIBRATION_BUDGET_S.
FULL_EFFORT_STEPS = 1400
CALIBRATION_BUDGET_S = 60.0


def calibration_effort(step_s: float) -> Effort:
    """The full effort where it takes at most CALIBRATION_BUDGET_S at this step cost, else the light one."""
    return FULL_EFFORT if step_s * FULL_EFFORT_STEPS <= CALIBRATION_BUDGET_S else LIGHT_EFFORT


def measure_cycle_costs(
    model,
    batch_size: int,
    depths: Sequence[int],
    compiled: bool = True,
    prompt_len: int = 48,
    rounds: int = 5,
    bare: Union[BareCosts, "BareCostSampler", None] = None,
    bare_rounds_between: int = 2,
    temperature: float = 0.0,
    burst: Optional[int] = None,
    repeats: Optional[int] = None,
) -> CycleCosts:
    """Seconds per cycle of `BatchRuntime` at each depth on `batch_size` random prompts, greedy or
    sampled at `temperature`. Each round (after an untimed one that traces) is one decode playing a burst
    of every depth between plain bursts (`bursts`), deepest first every other round; a depth costs depth
    0's fastest round x its median ratio to the plain bursts beside it (`bursts.burst_times`). Given
    `bare` costs of this batch size (a `BareCostSampler` is sampled `bare_rounds_between` more rounds
    after each round), the shape across depths comes from them (`_shaped_by_bare`)."""
    burst = burst or bursts.BURST
    repeats = repeats or bursts.REPEATS
    sampling = SamplingParams(temperature=temperature)
    if model.max_context is not None:  # prompt + every token the cycles may add must fit the context

        def needed():
            return tokens_bound(burst_sequence(depths, burst, repeats))

        room = model.max_context - min(prompt_len, model.max_context // 2)
        while repeats > 1 and needed() > room:
            repeats -= 1
        while burst > 2 and needed() > room:
            burst -= 1
        prompt_len = max(1, min(prompt_len, model.max_context // 2, model.max_context - needed()))
    sequences = [burst_sequence(depths, burst, repeats, reverse=r % 2 == 1) for r in range(2)]
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.vocab_size, (batch_size, prompt_len)).tolist()
    # Every cycle at the full batch size: that is the cost being calibrated.
    contract = MTPContract(depth=max(depths), compile=compiled, shrink_batch=False)
    runtime = BatchRuntime(model, contract, max_batch=batch_size, policy=ScriptedDepths(sequences[0]))
    bursts.play(runtime, prompts, sequences[0], sampling)  # traces every depth after every other
    times = {k: [] for k in depths}
    for r in range(rounds):
        sequence = sequences[r % 2]
        plain, ratios = burst_times(sequence, bursts.play(runtime, prompts, sequence, sampling))
        for k in depths:
            times[k].append(plain if k == 0 else plain * ratios.get(k, float("nan")))
        if isinstance(bare, BareCostSampler):
            bare.sample(bare_rounds_between)
    if isinstance(bare, BareCostSampler):
        bare = bare.costs()
    if bare is not None:
        bare = verify_never_falling(bare)
    if bare is not None and 0 in times:
        seconds, overhead = _shaped_by_bare(times, bare)
        return CycleCosts(batch_size, seconds, overhead)
    return CycleCosts(batch_size, _anchored_to(times))


def _timed_every_depth(costs: CycleCosts, K: int) -> bool:
    return all(math.isfinite(costs.cycle_s(k)) for k in range(K + 1))


def _job_depth(costs, sampled_acceptance: Sequence[float], K: int, max_batch: int) -> int:
    one_row = max_batch == 1
    return best_depth(
        costs,
        sampled_acceptance,
        K,
        margin=SPECULATION_MARGIN,
        tolerance=SINGLE_ROW_JOB_TIE if one_row else DEPTH_TOLERANCE,
        deepest=one_row,
    )


def plan_auto_depth(model, contract, max_batch: int) -> AutoDepth:
    """Calibrate at this batch size and plan the job's depths."""
    if model.head is None:
        return AutoDepth(
            0,
            0,
            None,
            {
                "depth": 0,
                "reason": "no MTP head",
                "policy": "plain decoding: this checkpoint has no MTP head to draft with",
            },
        )
    K = contract.max_depth_auto
    acceptance = acceptance_prior(model, K)  # greedy: what the per-cycle controller starts from
    sampled = acceptance_prior(model, K, sampled=True)  # what the job depth (sampled rows) is chosen for
    # Bare passes give the cost shape across depths; the runtime's decodes, a whole cycle's cost beyond them.
    sampler = BareCostSampler(model, max_batch, depths=range(1, K + 1), context=64, compiled=contract.compile)
    sampler.sample(1)
    effort = calibration_effort(sampler.costs().step_s)
    sampler.sample(effort.bare_first - 1)
    costs = measure_cycle_costs(
        model,
        max_batch,
        depths=range(K + 1),
        compiled=contract.compile,
        prompt_len=effort.prompt_len,
        rounds=effort.rounds,
        bare=sampler,
        bare_rounds_between=effort.bare_between,
        burst=effort.burst,
        repeats=effort.repeats,
    )
    bare = sampler.costs()
    if not _timed_every_depth(costs, K):
        if contract.sampled_depth:  # a resumed job's depth still holds; every cycle runs at it
            k = contract.sampled_depth
            return AutoDepth(
                k,
                k,
                None,
                {
                    "depth": k,
                    "depth_from": "given (the job's first run)",
                    "reason": "calibration timed no decode cycle",
                    "policy": f"depth {k} in every cycle: calibration could not time a cycle",
                },
            )
        return AutoDepth(
            0,
            0,
            None,
            {
                "depth": 0,
                "reason": "calibration timed no decode cycle",
                "policy": "plain decoding: calibration could not time a decode cycle",
            },
        )
    job = contract.sampled_depth  # a resumed job's: its sampled rows draw as its first run's did
    sampled_costs = None
    if job is None:
        job = _job_depth(costs, sampled, K, max_batch)
        if job > 0:  # greedy cycles price the draws at nothing: decide on sampled cycles
            sampled_costs = measure_cycle_costs(
                model,
                max_batch,
                depths=range(K + 1),
                compiled=contract.compile,
                bare=bare,
                temperature=1.0,
                prompt_len=effort.prompt_len,
                rounds=effort.sampled_rounds,
                burst=effort.burst,
                repeats=effort.repeats,
            )
            if _timed_every_depth(sampled_costs, K):
                job = _job_depth(sampled_costs, sampled, K, max_batch)
            else:
                sampled_costs = None
    # Greedy rows keep a controller wherever a depth is predicted to win at all; it starts on only where one
    # wins by the margin, else off and probing (greedy output does not depend on the depth).
    greedy = best_depth(costs, acceptance, K, margin=KEEP_SPECULATING_ABOVE)
    start = best_depth(costs, acceptance, K, margin=SPECULATION_MARGIN)
    record = {
        "depth": job,
        "depth_from": "calibration" if contract.sampled_depth is None else "given (the job's first run)",
        "greedy_depth_at_start": start,
        "acceptance_prior": acceptance,
        "acceptance_prior_sampled": sampled,
        "bare_costs": bare.as_dict(),
        "calibration_effort": "full" if effort == FULL_EFFORT else "light",
        "cycle_costs": costs.as_dict(),
        "predicted_speedup": {str(d): predicted_speedup(costs, acceptance, d) for d in range(K + 1)},
        "predicted_speedup_sampled": {
            str(d): predicted_speedup(sampled_costs or costs, sampled, d) for d in range(K + 1)
        },
    }
    if sampled_costs is not None:
        record["cycle_costs_sampled"] = sampled_costs.as_dict()
    if job == 0 and greedy == 0:
        record["policy"] = "plain decoding: no depth is predicted to pay on this machine at this batch size"
        return AutoDepth(0, 0, None, record)
    record["policy"] = (
        f"depth {job} in cycles with a row sampling under the residual rule (one depth per job); "
        f"otherwise (greedy rows, or the coupled rule) 0..{K} per cycle from the running acceptance, "
        f"starting {'at depth ' + str(start) if start else 'with speculation off'}"
    )
    return AutoDepth(
        job, K, DepthController(costs, acceptance, K, start_off=start == 0, one_row=max_batch == 1), record
    )
