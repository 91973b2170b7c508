"""Running a job: validate everything, then stream input -> runtime -> parts,
then summarise. `dry_run` stops before the weights are loaded."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from .engine import (
    OpenEngine,
    check_memory_cap,
    load_tokenizer,
    max_context_of,
    open_engine,
    read_config,
    resolve_model,
)
from .errors import EXIT_OK, JobError
from .ids import ROW_INDEX, KeySet, check_ids
from .inputs import InputSource, open_input
from .job import Prepared, RunResult, finish_holding_signals, slots_for
from .outdir import (
    AUTO_SAMPLED_DEPTH,
    MANIFEST,
    OutputState,
    existing_meta_path,
    open_output,
    output_in_use,
    output_lock,
    resume_note,
    start_output,
)
from .plan import make_plan
from .progress import Progress
from .prompts import PromptEncoder
from .reader import read_rows
from .signals import JobInterrupted, Stopper
from .spec import JobSpec
from .streaming import stream_rows
from .summary import throughput
from .writer import PartWriter

Log = Callable[[str], None]
DEFAULT_ID_COLUMN = "id"


@dataclass(frozen=True)
class RunOptions:
    overwrite: bool = False
    retry_errors: bool = False  # rows a previous run wrote with an error are run again
    dry_run: bool = False
    quiet: bool = False
    logprobs: bool = False  # on top of [generation] logprobs
    max_memory: Optional[int] = None  # overrides [batch] max_memory
    share_prefix_min: Optional[int] = None  # overrides [batch] share_prefix_min


def prepare(spec: JobSpec, opts: RunOptions) -> Prepared:
    """Every check that needs no weights: model path, input files, columns, ids."""
    if opts.logprobs:
        spec = replace(spec, generation=replace(spec.generation, logprobs=True))
    if opts.max_memory is not None:
        spec = replace(spec, batch=replace(spec.batch, max_memory=opts.max_memory))
    if opts.share_prefix_min is not None:
        spec = replace(spec, batch=replace(spec.batch, share_prefix_min=opts.share_prefix_min))
    ref = resolve_model(spec.model.path)
    _check_max_tokens(spec, max_context_of(read_config(ref.path)))
    source = open_input(spec.input, exclude=Path(spec.output.path))  # parts under the input are not input
    spec = _with_default_id_column(spec, source)
    plan = make_plan(spec, source, logprobs=spec.generation.logprobs)
    if plan.id_column:
        check_ids(lambda: source.iter_batches([plan.id_column], 65536), plan.id_column, source.label)
    identity = {"spec": spec.identity(), "model": ref.fingerprint, "input": source.fingerprint}
    canonical = json.dumps(identity, sort_keys=True, default=str)
    identity = json.loads(canonical)  # as the manifest will hold it (tuples become lists)
    spec_hash = hashlib.sha256(canonical.encode()).hexdigest()
    manifest = {"job": spec.name, "spec_hash": spec_hash, "identity": identity, "schema": [f.name for f in plan.schema]}
    job = Prepared(spec, ref, source, plan, manifest)
    manifest.update(input_rows=source.num_rows, output_rows=job.output_rows)  # what `mtplx inspect` counts against
    return job


def _with_default_id_column(spec: JobSpec, source: InputSource) -> JobSpec:
    """An unset [input] id_column is the input's `id` column where it has one, as `mtplx generate`
    takes it; an output directory a job keyed by row index before this default keeps resuming so."""
    if spec.input.id_column is not None or DEFAULT_ID_COLUMN not in source.column_names():
        return spec
    found = existing_meta_path(Path(spec.output.path), MANIFEST)
    if found is not None:
        try:
            if ROW_INDEX in json.loads(found.read_text()).get("schema", []):
                return spec
        except (OSError, ValueError, AttributeError):
            pass  # open_output names an unreadable manifest
    return replace(spec, input=replace(spec.input, id_column=DEFAULT_ID_COLUMN))


def _size_on_disk(path: Path) -> str:
    size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


def _check_max_tokens(spec: JobSpec, limit: Optional[int]) -> None:
    """max_tokens that leave no room for a prompt in the model's context would fail every row."""
    max_tokens = spec.generation.max_tokens
    if limit is not None and max_tokens >= limit:
        raise JobError(
            f"[generation] max_tokens {max_tokens} leaves no room for a prompt in the model's context of "
            f"{limit} tokens (max_position_embeddings); set max_tokens below {limit}"
        )


def run_job(
    spec: JobSpec, opts: RunOptions, *, engine_factory: OpenEngine = open_engine, log: Log = print
) -> RunResult:
    started = time.monotonic()
    if spec.engine == "ray":
        from .ray_engine import import_ray

        import_ray()  # before anything else: without Ray, say how to install it
    job = prepare(spec, opts)
    if opts.dry_run:
        return dry_run(job, opts)
    out = Path(job.spec.output.path)
    with output_lock(out):
        state = open_output(out, job.plan, job.manifest, overwrite=opts.overwrite, retry_errors=opts.retry_errors)
        if job.spec.engine == "ray":
            from .ray_engine import run_on_ray

            return run_on_ray(job, opts, state, started, log)
        return run_locally(job, opts, state, engine_factory, started, log)


def run_locally(
    job: Prepared, opts: RunOptions, state: OutputState, engine_factory: OpenEngine, started: float, log: Log
) -> RunResult:
    """The job in this process, on an output directory this run holds."""
    out = state.path
    auto = job.spec.model.depth == "auto"
    if auto and not opts.quiet:  # calibration is silent and takes seconds to a minute
        log(f"{job.spec.name}: depth auto: timing the decode passes on this machine first")
    # depth "auto": a resumed job's sampled rows draw at the depth its first run chose.
    recorded = state.recorded.get(AUTO_SAMPLED_DEPTH) if auto else None
    given = {} if recorded is None else {"sampled_depth": recorded}
    todo = job.output_rows - state.rows_done
    if not opts.quiet:
        log(f"{job.spec.name}: loading model {job.ref.path} ({_size_on_disk(job.ref.path)} on disk)")
    loading = time.monotonic()
    engine = engine_factory(job.ref, slots_for(job.spec, todo), job.spec.batch.max_memory, **given)
    if not opts.quiet:
        log(f"{job.spec.name}: model loaded and its decode passes ready in {time.monotonic() - loading:.1f} s")
    manifest = job.manifest
    if auto and "depth" in engine.stats.get("auto_depth", {}):
        manifest = {**manifest, AUTO_SAMPLED_DEPTH: engine.stats["auto_depth"]["depth"]}
    start_output(state, manifest)
    if not opts.quiet:
        if auto:
            log(f"{job.spec.name}: depth auto: {engine.stats.get('auto_depth', {}).get('policy', 'no plan recorded')}")
        log(f"{job.spec.name}: {resume_note(state)}")
    t0 = time.monotonic()
    progress = Progress(max(todo, 0), opts.quiet or todo <= 0)  # no bar over nothing to do (a finished job resumed)
    stopper = Stopper()
    writer = PartWriter(
        out,
        job.plan.schema,
        state.next_part,
        flush_rows=job.spec.output.flush_rows,
        flush_seconds=job.spec.output.flush_seconds,
        stopper=stopper,
    )
    stopper.install()
    try:
        _stream(job, engine, state, writer, progress)
        writer.flush()
        progress.close()
        run = throughput(engine.stats, time.monotonic() - started, writer.rows_written, progress.tokens)
        run["startup_seconds"] = t0 - started  # validation, resume scan, model load
        return finish_holding_signals(job, out, run, {**engine.settings, "stats": engine.stats}, stopper)
    except JobInterrupted as e:
        writer.flush_now()
        progress.close()
        msg = f"interrupted by {e}: {writer.rows_written} rows written this run; rerun the same command to resume"
        return RunResult(128 + e.signum, None, [], [msg])
    except BaseException:
        _save_finished_rows(writer)
        raise
    finally:
        stopper.restore()
        progress.close()


def _save_finished_rows(writer: PartWriter) -> None:
    """On an unexpected failure keep what is finished; the original error wins."""
    try:
        writer.flush_now()
    except Exception:
        pass


def _stream(job: Prepared, engine, state: OutputState, writer: PartWriter, progress: Progress) -> None:
    encoder = PromptEncoder(job.spec.prompt, engine.tokenizer)
    stream_rows(read_rows(job.source, job.plan, encoder, state.done), job.plan, engine, writer, progress)


# ------------------------------------------------------------------ dry run


def dry_run(job: Prepared, opts: RunOptions) -> RunResult:
    spec, plan = job.spec, job.plan
    out = Path(spec.output.path)
    in_use = output_in_use(out)
    if in_use:
        raise JobError(in_use)
    state = open_output(out, plan, job.manifest, overwrite=opts.overwrite, retry_errors=opts.retry_errors)
    if spec.batch.max_memory is not None:
        check_memory_cap(job.ref, spec)
    tokenizer = load_tokenizer(job.ref)
    max_ctx = max_context_of(read_config(job.ref.path))
    encoder = PromptEncoder(spec.prompt, tokenizer)
    prompts = tokens = longest = over = 0
    errors: Counter = Counter()
    for r in read_rows(job.source, plan, encoder, state.done if not opts.overwrite else KeySet()):
        if r.error is not None:
            errors[r.error] += len(r.todo)
            continue
        prompts += 1
        tokens += r.prompt_length
        longest = max(longest, r.prompt_length)
        if max_ctx is not None and r.prompt_length + spec.generation.max_tokens > max_ctx:
            over += len(r.todo)
    total = job.output_rows
    report = [
        f"job {spec.name}: dry run, the model's weights were not loaded",
        f"model: {job.ref.path}" + (" (built-in default)" if job.ref.is_default else ""),
        f"input: {job.source.label}: {job.source.num_rows} rows"
        + (f" in {_plural(len(job.source.files), 'Parquet file')}" if job.source.files else ""),
        f"output rows: {total} ({job.source.num_rows} rows x {_plural(plan.variants, 'template')} x n={plan.n}), "
        f"{state.rows_done} already in the output",
        f"prompts to run: {prompts}, prompt tokens {tokens}, longest {longest}",
        f"row errors seen already: {sum(errors.values())}"
        + "".join(f"\n  {n} x {msg}" for msg, n in errors.most_common(5)),
        f"over the context ({max_ctx} tokens, with max_tokens {spec.generation.max_tokens}): {over}",
        f"output: {out} ({_output_state(state, opts)})",
        f"columns: {', '.join(plan.schema.names)}",
    ]
    if spec.engine == "ray":
        r = spec.ray
        report.insert(
            2,
            f"engine: ray (address {r.address or 'auto-detected, else a new local instance'}, "
            f"actors {r.actors or 'one per node'}, "
            + (f"shards of {r.shard_rows} prompt rows)" if r.shard_rows else "shards sized to the job)"),
        )
    return RunResult(EXIT_OK, None, report)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _output_state(state: OutputState, opts: RunOptions) -> str:
    if opts.overwrite:
        return "--overwrite: previous output would be removed"
    if state.existed:
        retry = f", {state.errors_to_retry} rows with an error to run again" if state.errors_to_retry else ""
        return f"resume: {state.rows_done} rows in {state.next_part} part numbers used{retry}"
    return "new"
