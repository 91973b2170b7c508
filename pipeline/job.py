"""A prepared job and how a run of it finishes: summary.json and the exit code."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Optional

from .engine import ModelRef
from .errors import EXIT_OK, EXIT_ROW_ERRORS
from .inputs import InputSource
from .outdir import SUMMARY, meta_path, write_json_atomic
from .plan import Plan
from .signals import JobInterrupted, Stopper
from .spec import JobSpec
from .summary import build_summary


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
    summary = build_summary(
        out,
        name=job.spec.name,
        spec=job.spec.to_dict(),
        manifest=job.manifest,
        model=model,
        input_rows=job.source.num_rows,
        run=run,
        runtime=runtime,
    )
    write_json_atomic(meta_path(out, SUMMARY), summary)
    warnings = []
    if summary["errors"]:
        warnings.append(f"finished with {summary['errors']} row errors (see the error column of the part files)")
    return RunResult(EXIT_ROW_ERRORS if summary["errors"] else EXIT_OK, summary, _final_lines(summary), warnings)


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
