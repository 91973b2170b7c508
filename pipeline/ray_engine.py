"""The Ray engine: the same job, spread over the machines of a Ray cluster.

The driver (the `mtplx run` process) validates the job, owns the manifest and
the resume scan exactly as the local engine does, reads and tokenises the
input, and cuts the rows still to do into shards of `[ray] shard_rows`
prompt rows. One actor per machine (`ShardWorker`) loads the model once and
decodes each shard it is handed through the runtime's continuous batching,
writing `part-sSSSSS-KKKKK.parquet` into the shared output directory. The
part files stay the only record of what is done, so a rerun resumes, and
`summary.json` is computed from them as for a local run.

Ray is optional: this module imports it only inside functions, and
`import_ray` turns its absence into one line that says how to install it.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, replace
from itertools import count
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from .engine import load_tokenizer
from .errors import JobError
from .outdir import AUTO_SAMPLED_DEPTH, OutputState, part_files, resume_note, start_output
from .progress import Progress
from .prompts import PromptEncoder
from .reader import PromptRow, read_rows
from .signals import JobInterrupted, Stopper
from .summary import throughput

INSTALL_HINT = "--engine ray needs Ray, which is not installed: pip install 'mtplx[ray]'"
MLX_RESOURCE = "mlx"  # what `ray start --resources '{"mlx": 1}'` advertises: one MTPLX actor per machine


def import_ray():
    try:
        import ray
    except ImportError:
        raise JobError(INSTALL_HINT) from None
    return ray


@dataclass(frozen=True)
class Placement:
    actors: int
    options: dict  # for ActorClass.options()
    rule: str  # how the actors were placed, for the summary


def place_actors(resources: dict, nodes: int, wanted: Optional[int]) -> Placement:
    """One actor per machine that advertises the `mlx` resource; on a cluster
    that advertises none, one CPU each, spread over the nodes (by default one
    per node)."""
    mlx = int(resources.get(MLX_RESOURCE, 0))
    if mlx:
        n = wanted or mlx
        if n > mlx:
            raise JobError(
                f"{n} actors asked for, but the cluster advertises {mlx} {MLX_RESOURCE!r} resource(s) "
                "(one per machine: ray start ... --resources '{\"mlx\": 1}')"
            )
        return Placement(n, {"num_cpus": 1, "resources": {MLX_RESOURCE: 1}}, f"resource {MLX_RESOURCE}")
    cpus = int(resources.get("CPU", 0))
    n = wanted or max(nodes, 1)
    if n > cpus:
        raise JobError(
            f"{n} actors asked for, but the cluster has {cpus} CPUs and no {MLX_RESOURCE!r} resource "
            "(each actor takes one CPU)"
        )
    return Placement(n, {"num_cpus": 1, "scheduling_strategy": "SPREAD"}, "CPU, spread over nodes")


MAX_SHARD_ROWS = 1024


def shard_size(wanted: Optional[int], prompts: int, actors: int, max_batch: int) -> int:
    """Prompt rows per shard. Each shard is one continuous-batching stream that
    drains at its end, so shards are long (8 slot-fulls, up to MAX_SHARD_ROWS);
    but a small job still gets about 4 shards per actor, and never fewer than
    one per actor, so that every actor works and the last shards balance."""
    if wanted:
        return wanted
    balanced = -(-prompts // (4 * actors))
    long_enough = min(8 * max_batch, -(-prompts // actors))
    return max(1, min(MAX_SHARD_ROWS, max(balanced, long_enough)))


def numbered_shards(rows: Iterator[PromptRow], shard_rows: int, first: int) -> Iterator[Tuple[int, List[PromptRow]]]:
    """Consecutive prompt rows in shards of `shard_rows`, numbered from
    `first` (the first number no existing part file uses)."""
    buf: List[PromptRow] = []
    numbers = count(first)
    for r in rows:
        buf.append(r)
        if len(buf) >= shard_rows:
            yield next(numbers), buf
            buf = []
    if buf:
        yield next(numbers), buf


def run_on_ray(job, opts, state: OutputState, started: float, log):
    """The Ray counterpart of `runner.run_locally`."""
    from .job import RunResult, finish_holding_signals, slots_for

    ray = import_ray()
    spec, out = job.spec, state.path
    todo = job.output_rows - state.rows_done
    owns = _connect(ray, spec.ray.address, opts.quiet)
    workers, settings = [], {"engine": "ray", "actors": 0}
    stopper = Stopper()
    try:
        if todo > 0:
            placement = place_actors(ray.cluster_resources(), _alive_nodes(ray), spec.ray.actors)
            recorded = state.recorded.get(AUTO_SAMPLED_DEPTH) if spec.model.depth == "auto" else None
            # No actor holds more samples than the job has left.
            workers, ready = _start_workers(ray, replace(job, spec=slots_for(spec, todo)), out, placement, recorded)
            settings = _settings(ready, placement, spec)
            prompts = -(-todo // job.plan.n)  # the shards count prompt rows; each has n samples
            settings["shard_rows"] = shard_size(
                spec.ray.shard_rows, prompts, placement.actors, settings.get("max_batch", spec.batch.max_batch)
            )
        manifest = job.manifest
        if workers and ready[0]["sampled_depth"] is not None:  # depth auto: what a resume reuses
            manifest = {**manifest, AUTO_SAMPLED_DEPTH: ready[0]["sampled_depth"]}
        start_output(state, manifest)  # the actors loaded the model: now --overwrite may remove
        if not opts.quiet:
            log(f"{spec.name}: {resume_note(state)}; on Ray with {len(workers)} actors")
        t0 = time.monotonic()
        progress = Progress(max(todo, 0), opts.quiet)
        tally = _RunTally(progress)
        stopper.install()
        try:
            if workers:
                from .ray_dispatch import dispatch

                encoder = PromptEncoder(spec.prompt, load_tokenizer(job.ref))
                rows = read_rows(job.source, job.plan, encoder, state.done)
                shards = numbered_shards(rows, settings["shard_rows"], state.next_shard)
                sent = dispatch(ray, workers, shards, tally.add, log, shield=stopper.critical)
                settings.update(shards=sent.shards, retried_shards=sent.retried, actors_lost=sent.actors_lost)
        except JobInterrupted as e:
            written = _rows_in_parts(out) - state.rows_done
            msg = f"interrupted by {e}: {written} rows written this run; rerun the same command to resume"
            return RunResult(128 + e.signum, None, [], [msg])
        finally:
            stopper.restore()
            progress.close()
    finally:
        _stop(ray, workers, owns)
    # Rows from the parts: an attempt that died wrote some its report never counted.
    written = _rows_in_parts(out) - state.rows_done
    run = throughput(tally.stats, time.monotonic() - started, written, tally.tokens)
    run["startup_seconds"] = t0 - started  # validation, resume scan, cluster connection, model loads
    runtime = {**settings, "stats": tally.stats, "actor_peak_memory": tally.actor_peak_memory}
    stopper.install()
    try:
        return finish_holding_signals(job, out, run, runtime, stopper)
    finally:
        stopper.restore()


class _RunTally:
    """Shard reports -> the progress bar and this run's summed figures."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.tokens = 0  # completion tokens of the shards finished this run
        self.stats: dict = {}
        self.actor_peak_memory: dict = {}  # the largest any actor reported

    def add(self, report) -> None:
        t = report.tally
        self.tokens += t.tokens
        for k, v in report.stats.items():
            self.stats[k] = self.stats.get(k, 0) + v
        for k, v in report.peak_memory.items():
            self.actor_peak_memory[k] = max(self.actor_peak_memory.get(k, 0), v)
        p = self.progress
        p.rows += t.rows
        p.errors += t.errors
        p.tokens += t.tokens
        p.drafted += t.drafted
        p.accepted += t.accepted
        p.prompt_tokens += t.prompt_tokens
        p.shared_prefix_tokens += t.shared_prefix_tokens
        p.bar.update(t.rows)
        p.bar.set_postfix_str(p.postfix(time.monotonic()), refresh=False)


def _connect(ray, address: Optional[str], quiet: bool) -> bool:
    """Join the cluster (or start a local instance); True when this call
    started Ray and so must shut it down."""
    if ray.is_initialized():
        return False
    kwargs = {"logging_level": logging.ERROR if quiet else logging.INFO}
    if not (address or "").startswith("ray://"):
        kwargs["include_dashboard"] = False  # ignored when joining a running cluster
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError, RuntimeError) as e:
        where = f"at {address}" if address else "(none found, and a local one could not start)"
        raise JobError(f"cannot connect to the Ray cluster {where}: {_first_line(e)}") from None
    return True


def _rows_in_parts(out: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(p).num_rows for p in part_files(out))


def _alive_nodes(ray) -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def _start_workers(ray, job, out: Path, placement: Placement, sampled_depth=None):
    """The actors, each with the model loaded, and what each reported. At
    depth auto the job's sampled rows draw at one depth: a resumed job's
    recorded one, else the one the first actor's calibration picks, which
    the others are then given."""
    from .ray_worker import ShardWorker

    remote = ray.remote(ShardWorker)
    token = secrets.token_hex(3)  # names stay unique when jobs share a cluster

    def start(i: int, depth):
        return remote.options(name=f"mtplx-{job.spec.name}-{token}-{i}", max_restarts=0, **placement.options).remote(
            job.ref, job.spec, job.plan, str(out), depth
        )

    workers, ready = [], []
    try:
        if job.spec.model.depth == "auto" and sampled_depth is None and placement.actors > 1:
            workers.append(start(0, None))
            ready += _ready(ray, workers)
            sampled_depth = ready[0]["sampled_depth"]
        rest = [start(i, sampled_depth) for i in range(len(workers), placement.actors)]
        workers += rest
        ready += _ready(ray, rest)
    except ray.exceptions.RayError as e:
        _stop(ray, workers, False)
        raise JobError(f"an MTPLX actor could not start: {_first_line(e)}") from None
    except JobError:
        _stop(ray, workers, False)
        raise
    return workers, ready


def _ready(ray, workers) -> List[dict]:
    ready = ray.get([w.ready.remote() for w in workers])
    for info in ready:
        if info["error"]:
            raise JobError(info["error"])
    return ready


def _settings(ready: List[dict], placement: Placement, spec) -> dict:
    first = ready[0]["settings"]
    return {
        **first,
        "engine": "ray",
        "address": spec.ray.address,
        "actors": placement.actors,
        "placement": placement.rule,
        "per_actor": [{"node": r["node"], **r["settings"], "sampled_depth": r["sampled_depth"]} for r in ready],
    }


def _stop(ray, workers: List, owns: bool) -> None:
    for w in workers:
        try:
            ray.kill(w)
        except Exception:
            pass  # already gone
    if owns:
        ray.shutdown()


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
