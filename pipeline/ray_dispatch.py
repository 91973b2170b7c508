"""Handing shards to Ray actors: keep every live actor busy, and give the
shards of an actor that died to the others.

Each actor holds up to IN_FLIGHT shards: one decoding and one queued behind
it, so it never waits for the driver between shards. A shard whose actor died
is sent again (its worker skips the rows an earlier attempt wrote); after
MAX_ATTEMPTS, or when no actor is left, the job stops with a JobError and the
rows written so far stay for a rerun to resume from.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

from .errors import JobError

IN_FLIGHT = 2
MAX_ATTEMPTS = 3
WAIT_SECONDS = 0.5  # the longest a signal waits to be acted on


@dataclass
class Shard:
    number: int
    rows_ref: object  # ray.ObjectRef of the shard's PromptRows: put once, sent again on a retry
    attempts: int = 0


@dataclass
class DispatchStats:
    shards: int = 0
    retried: int = 0
    actors_lost: int = 0


def dispatch(
    ray,
    workers: List,
    shards: Iterator[Tuple[int, list]],
    on_report: Callable,
    log: Callable[[str], None],
    shield: Callable = nullcontext,
) -> DispatchStats:
    """Run every shard to completion on `workers` (actor handles); each
    ShardReport goes to `on_report` as it arrives.

    Every step runs inside `shield()` (the job's Stopper.critical): a signal
    handler must not raise inside Ray's compiled wait, so a signal is held
    until the step ends, which WAIT_SECONDS bounds."""
    stats = DispatchStats()
    retry: deque = deque()
    running: dict = {}  # ObjectRef -> (worker index, Shard)
    load = {i: 0 for i in range(len(workers))}  # live workers -> shards held

    def next_shard() -> Optional[Shard]:
        if retry:
            return retry.popleft()
        item = next(shards, None)
        if item is None:
            return None
        stats.shards += 1
        return Shard(item[0], ray.put(item[1]))

    def fill() -> None:
        while True:
            idle = [i for i, n in load.items() if n < IN_FLIGHT]
            if not idle:
                return
            shard = next_shard()
            if shard is None:
                return
            i = min(idle, key=lambda j: (load[j], j))
            shard.attempts += 1
            running[workers[i].run_shard.remote(shard.number, shard.rows_ref)] = (i, shard)
            load[i] += 1

    def finished(ref) -> None:
        i, shard = running.pop(ref)
        if i in load:
            load[i] -= 1
        try:
            report = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            _lost(i, shard, e, load, retry, stats, log)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, JobError):
                raise JobError(str(cause)) from None
            raise
        else:
            on_report(report)

    with shield():
        fill()
    while running:
        with shield():
            ready, _ = ray.wait(list(running), num_returns=1, timeout=WAIT_SECONDS)
            if ready:
                finished(ready[0])
                fill()
    return stats


def _lost(i: int, shard: Shard, error, load: dict, retry: deque, stats: DispatchStats, log) -> None:
    if i in load:
        del load[i]
        stats.actors_lost += 1
        log(f"actor {i} died ({_first_line(error)}); {len(load)} left")
    if shard.attempts >= MAX_ATTEMPTS:
        raise JobError(
            f"shard {shard.number} failed on {shard.attempts} actors (last: {_first_line(error)}); "
            "the rows written so far are kept: rerun the same command to resume"
        )
    if not load:
        raise JobError(
            f"every Ray actor died (last: {_first_line(error)}); the rows written so far are kept: "
            "rerun the same command to resume"
        )
    stats.retried += 1
    retry.append(shard)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
