"""Running a job: validate everything, then stream input -> runtime -> parts,
then summarise. `dry_run` stops before the weights are loaded."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, List, Optional

from .engine import (ModelRef, OpenEngine, check_memory_cap, load_tokenizer, max_context_of, open_engine, read_config,
                     resolve_model, sampling_params)
from .errors import EXIT_OK, EXIT_ROW_ERRORS, JobError
from .ids import KeySet, check_ids
from .inputs import InputSource, open_input
from .outdir import (AUTO_SAMPLED_DEPTH, SUMMARY, OutputState, open_output, output_in_use, output_lock, resume_note,
                     start_output, write_json_atomic)
from .packer import length_ordered, requests
from .plan import Plan, make_plan
from .progress import Progress
from .prompts import PromptEncoder
from .reader import PromptRow, read_rows
from .rows import completion_row, error_row
from .scoring import make_scorer
from .signals import JobInterrupted, Stopper
from .spec import JobSpec
from .summary import build_summary, throughput
from .writer import PartWriter

Log = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    overwrite: bool = False
    retry_errors: bool = False  # rows a previous run wrote with an error are run again
    dry_run: bool = False
    quiet: bool = False
    logprobs: bool = False  # on top of [generation] logprobs
    max_memory: Optional[int] = None  # overrides [batch] max_memory


@dataclass
class RunResult:
    exit_code: int
    summary: Optional[dict] = None
    report: List[str] = field(default_factory=list)  # for stdout, unless --quiet
    warnings: List[str] = field(default_factory=list)  # for stderr, always


@dataclass
class Prepared:
    spec: JobSpec
    ref: ModelRef
    source: InputSource
    plan: Plan
    manifest: dict

    @property
    def output_rows(self) -> int:
        """Rows the finished output holds: input rows x templates x samples."""
        return self.source.num_rows * self.plan.variants * self.plan.n


def prepare(spec: JobSpec, opts: RunOptions) -> Prepared:
    """Every check that needs no weights: model path, input files, columns, ids."""
    if opts.logprobs:
        spec = replace(spec, generation=replace(spec.generation, logprobs=True))
    if opts.max_memory is not None:
        spec = replace(spec, batch=replace(spec.batch, max_memory=opts.max_memory))
    ref = resolve_model(spec.model.path)
    source = open_input(spec.input, exclude=Path(spec.output.path))  # parts under the input are not input
    plan = make_plan(spec, source, logprobs=spec.generation.logprobs)
    if plan.id_column:
        check_ids(lambda: source.iter_batches([plan.id_column], 65536), plan.id_column, source.label)
    identity = {"spec": spec.identity(), "model": ref.fingerprint, "input": source.fingerprint}
    canonical = json.dumps(identity, sort_keys=True, default=str)
    identity = json.loads(canonical)  # as the manifest will hold it (tuples become lists)
    spec_hash = hashlib.sha256(canonical.encode()).hexdigest()
    manifest = {"job": spec.name, "spec_hash": spec_hash, "identity": identity, "schema": [f.name for f in plan.schema]}
    return Prepared(spec, ref, source, plan, manifest)


def run_job(spec: JobSpec, opts: RunOptions, *, engine_factory: OpenEngine = open_engine, log: Log = print) -> RunResult:
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


def run_locally(job: Prepared, opts: RunOptions, state: OutputState, engine_factory: OpenEngine, started: float,
                log: Log) -> RunResult:
    """The job in this process, on an output directory this run holds."""
    out = state.path
    auto = job.spec.model.depth == "auto"
    if auto and not opts.quiet:  # calibration is silent and takes seconds to a minute
        log(f"{job.spec.name}: depth auto: timing the decode passes on this machine first")
    # depth "auto": a resumed job's sampled rows draw at the depth its first run chose.
    recorded = state.recorded.get(AUTO_SAMPLED_DEPTH) if auto else None
    given = {} if recorded is None else {"sampled_depth": recorded}
    todo = job.output_rows - state.rows_done
    engine = engine_factory(job.ref, slots_for(job.spec, todo), job.spec.batch.max_memory, **given)
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
    writer = PartWriter(out, job.plan.schema, state.next_part, flush_rows=job.spec.output.flush_rows,
                        flush_seconds=job.spec.output.flush_seconds, stopper=stopper)
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


def slots_for(spec: JobSpec, todo: int) -> JobSpec:
    """The spec with no more decode slots than samples left to do: a cycle
    computes every slot, and depth "auto" calibrates at the runtime's batch
    size (a 5-row greedy job at the default 16 slots planned plain decoding
    there; at 5 slots it speculates). Slots only schedule: a row's output
    does not depend on them (`BatchSpec`)."""
    if 0 < todo < spec.batch.max_batch:
        return replace(spec, batch=replace(spec.batch, max_batch=todo))
    return spec


def finish_holding_signals(job: Prepared, out: Path, run: dict, runtime: dict, stopper: Stopper) -> RunResult:
    """Every row is written: a signal now waits for summary.json, then still
    gives 128 + signal, so whoever sent it sees that it was acted on.
    `stopper` must be installed."""
    result = None
    try:
        with stopper.critical():
            result = finish_job(job, out, run, runtime)
    except JobInterrupted as e:
        msg = f"interrupted by {e} after the last row: the output and {SUMMARY} are complete"
        return RunResult(128 + e.signum, result.summary, result.report, result.warnings + [msg])
    return result


def finish_job(job: Prepared, out: Path, run: dict, runtime: dict) -> RunResult:
    """summary.json from the parts plus this run's figures; the exit code."""
    model = {"path": str(job.ref.path), "default": job.ref.is_default, "fingerprint": job.ref.fingerprint}
    summary = build_summary(out, name=job.spec.name, spec=job.spec.to_dict(), manifest=job.manifest, model=model,
                            input_rows=job.source.num_rows, run=run, runtime=runtime)
    write_json_atomic(out / SUMMARY, summary)
    warnings = []
    if summary["errors"]:
        warnings.append(f"finished with {summary['errors']} row errors (see the error column of the part files)")
    return RunResult(EXIT_ROW_ERRORS if summary["errors"] else EXIT_OK, summary, _final_lines(summary), warnings)


def _save_finished_rows(writer: PartWriter) -> None:
    """On an unexpected failure keep what is finished; the original error wins."""
    try:
        writer.flush_now()
    except Exception:
        pass


def _stream(job: Prepared, engine, state: OutputState, writer: PartWriter, progress: Progress) -> None:
    encoder = PromptEncoder(job.spec.prompt, engine.tokenizer)
    stream_rows(read_rows(job.source, job.plan, encoder, state.done), job.plan, engine, writer, progress)


def stream_rows(rows: Iterable[PromptRow], plan: Plan, engine, writer: PartWriter, progress) -> None:
    """Prompt rows -> length order -> the runtime -> output rows in `writer`;
    `progress.row(...)` is told about every row. The Ray actors run this too."""
    spec = plan.spec
    sampling = sampling_params(spec)
    scorer = make_scorer(spec.evaluation) if spec.evaluation else None
    inflight: dict = {}

    def on_error(r: PromptRow) -> None:
        for sample in r.todo:
            writer.add(error_row(plan, r, sample))
            progress.row(0, 0, 0, error=True)

    ordered = length_ordered(rows, spec.batch.window, on_error)
    feed = requests(ordered, plan, engine.request_type, sampling, inflight)
    for c in engine.stream(feed, seed=spec.sampling.seed):
        r = inflight[c.index]
        r.pending -= 1
        if r.pending == 0:
            del inflight[c.index]
        if c.sample_index not in r.todo:
            continue  # this sample was already in the output (a partly done row)
        writer.add(completion_row(plan, r, c, scorer))
        progress.row(len(c.tokens), sum(c.drafted_by_depth), sum(c.accepted_by_depth), c.finish_reason == "error")


def _final_lines(summary: dict) -> List[str]:
    lines = [
        f"{summary['job']}: {summary['rows']} rows in {summary['output_dir']} "
        f"({summary['rows_this_run']} this run, {summary['wall_seconds']:.1f} s); "
        f"acceptance {_fmt(summary.get('acceptance_rate'))}, "
        f"mean accepted length {_fmt(summary.get('mean_accepted_length'))}"
        + (f", accuracy {_fmt(summary.get('accuracy'))}" if "accuracy" in summary else "")
    ]
    return lines


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


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
        report.insert(2, f"engine: ray (address {r.address or 'auto-detected, else a new local instance'}, "
                         f"actors {r.actors or 'one per node'}, "
                         + (f"shards of {r.shard_rows} prompt rows)" if r.shard_rows else "shards sized to the job)"))
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
