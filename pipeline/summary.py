"""Job metrics: totals over the part files (the record of what is done), the
throughput of the run that finished, `summary.json`, and `mtplx inspect`."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import JobError
from .outdir import MANIFEST, SUMMARY, existing_meta_path, part_files

METRIC_COLUMNS = (
    "error",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "drafted_by_depth",
    "accepted_by_depth",
    "mean_accepted_length",
    "decode_steps",
    "shared_prefix_tokens",
)


@dataclass
class Totals:
    parts: int = 0
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    undecoded_prompt_tokens: int = 0  # of rows with an error and no decode step (an over-long prompt, ...)
    completion_tokens: int = 0
    decode_steps: int = 0
    shared_prefix_tokens: int = 0  # prompt tokens rows took from a prefix prefilled once
    cycle_tokens: float = 0.0  # tokens emitted by verify cycles
    drafted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    finish_reasons: dict = field(default_factory=dict)
    scored: int = 0
    score_sum: float = 0.0
    has_score: bool = False

    def add_part(self, t: pa.Table) -> None:
        self.parts += 1
        self.rows += t.num_rows
        self.errors += t.num_rows - t.column("error").null_count
        self.prompt_tokens += _sum(t.column("prompt_tokens"))
        self.completion_tokens += _sum(t.column("completion_tokens"))
        steps = t.column("decode_steps").to_numpy(zero_copy_only=False).astype(np.float64)
        failed = t.column("error").is_valid().to_numpy(zero_copy_only=False)
        prompts = t.column("prompt_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
        self.undecoded_prompt_tokens += int(np.nansum(np.where(failed & ~(steps > 0), prompts, 0.0)))
        self.decode_steps += int(np.nansum(steps))
        if "shared_prefix_tokens" in t.column_names:  # parts written before the column existed lack it
            self.shared_prefix_tokens += _sum(t.column("shared_prefix_tokens"))
        mal = t.column("mean_accepted_length").to_numpy(zero_copy_only=False).astype(np.float64)
        self.cycle_tokens += float(np.nansum(np.where(steps > 0, mal * steps, 0.0)))
        self.drafted = _add_by_position(self.drafted, t.column("drafted_by_depth"))
        self.accepted = _add_by_position(self.accepted, t.column("accepted_by_depth"))
        for item in pc.value_counts(t.column("finish_reason").combine_chunks()).to_pylist():
            key = item["values"] or "null"
            self.finish_reasons[key] = self.finish_reasons.get(key, 0) + item["counts"]
        if "score" in t.column_names:
            self.has_score = True
            score = t.column("score")
            self.scored += len(score) - score.null_count
            self.score_sum += _sum(score)

    def metrics(self) -> dict:
        drafted, accepted = self.drafted, _pad(self.accepted, len(self.drafted))
        by_depth = [
            {"depth": i + 1, "drafted": int(d), "accepted": int(a), "rate": (a / d) if d else None}
            for i, (d, a) in enumerate(zip(drafted, accepted))
        ]
        total_drafted = int(drafted.sum())
        out = {
            "parts": self.parts,
            "rows": self.rows,
            "errors": self.errors,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "prompt_tokens": self.prompt_tokens,
            "undecoded_prompt_tokens": self.undecoded_prompt_tokens,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "completion_tokens": self.completion_tokens,
            "decode_steps": self.decode_steps,
            "acceptance_by_depth": by_depth,
            "acceptance_rate": (int(accepted.sum()) / total_drafted) if total_drafted else None,
            "mean_accepted_length": (self.cycle_tokens / self.decode_steps) if self.decode_steps else None,
            "ideal_tokens_per_cycle": (1 + int(accepted.sum()) / self.decode_steps) if self.decode_steps else None,
        }
        if self.has_score:
            out["scored_rows"] = self.scored
            out["accuracy"] = (self.score_sum / self.scored) if self.scored else None
        return out


def _sum(col: pa.ChunkedArray) -> float:
    v = pc.sum(col).as_py()
    return v or 0


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) >= n else np.concatenate([a, np.zeros(n - len(a), dtype=a.dtype)])


def _add_by_position(total: np.ndarray, lists: pa.ChunkedArray) -> np.ndarray:
    """Element-wise sums of ragged list<int> rows: sum over rows of x[i] per i."""
    arr = lists.combine_chunks()
    if len(arr) == 0:
        return total
    arr = arr.fill_null([]) if arr.null_count else arr
    values = arr.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    if not len(values):
        return total
    parents = pc.list_parent_indices(arr).to_numpy()
    starts = arr.offsets.to_numpy()[:-1] - arr.offset
    position = np.arange(len(values)) - starts[parents]
    sums = np.bincount(position, weights=values).astype(np.int64)
    n = max(len(total), len(sums))
    return _pad(total, n) + _pad(sums, n)


def totals_of(out: Path) -> Totals:
    totals = Totals()
    for p in part_files(out):
        try:
            schema = pq.read_schema(p)
            missing = [c for c in METRIC_COLUMNS if c not in schema.names]
            if missing:  # a foreign file named like a part
                raise JobError(f"{p} is not an MTPLX output part: it has no column {missing[0]!r}")
            cols = [c for c in METRIC_COLUMNS + ("score",) if c in schema.names]
            totals.add_part(pq.read_table(p, columns=cols))
        except (OSError, pa.ArrowException, ValueError) as e:
            raise JobError(f"cannot read output part {p}: {str(e).splitlines()[0]}") from None
    return totals


def peak_memory() -> dict:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"rss_bytes": int(rss if sys.platform == "darwin" else rss * 1024)}
    mx = sys.modules.get("mlx.core")
    if mx is not None and hasattr(mx, "get_peak_memory"):
        out["mlx_peak_bytes"] = int(mx.get_peak_memory())
    return out


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("mtplx", "mlx", "mlx-lm", "pyarrow", "numpy", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def throughput(stats: dict, wall: float, rows_this_run: int, completion_tokens_this_run: int) -> dict:
    def rate(tokens, seconds):
        return (tokens / seconds) if seconds else None

    return {
        "wall_seconds": wall,
        "rows_this_run": rows_this_run,
        "completion_tokens_this_run": completion_tokens_this_run,
        # Prompt tokens this run computed: a shared prefix counts once (shared_prefix_tokens: per row).
        "prefill_tokens": stats.get("prefill_tokens", 0),
        "rows_per_second": rate(rows_this_run, wall),
        "completion_tokens_per_second": rate(completion_tokens_this_run, wall),
        "prefill_tokens_per_second": rate(stats.get("prefill_tokens", 0), stats.get("prefill_seconds", 0.0)),
        "decode_tokens_per_second": rate(stats.get("decode_tokens", 0), stats.get("decode_seconds", 0.0)),
    }


def build_summary(
    out: Path, *, name: str, spec: dict, manifest: dict, model: dict, input_rows: int, run: dict, runtime: dict
) -> dict:
    summary = {"job": name, "complete": True, "output_dir": str(out), "input_rows": input_rows}
    summary.update(totals_of(out).metrics())
    summary.update(run)
    summary["peak_memory"] = peak_memory()
    summary["runtime"] = runtime
    summary["model"] = model
    summary["spec_hash"] = manifest["spec_hash"]
    summary["spec"] = spec
    summary["versions"] = versions()
    summary["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return summary


# ------------------------------------------------------------------ inspect


def load_or_compute(out: Path) -> dict:
    """summary.json when the job finished; otherwise totals from the parts."""
    if not out.is_dir():
        raise JobError(f"not an output directory: {out}")
    f = existing_meta_path(out, SUMMARY)
    if f is not None:
        try:
            return json.loads(f.read_text())
        except ValueError as e:
            raise JobError(f"unreadable {f}: {e}") from None
    found = existing_meta_path(out, MANIFEST)
    if found is None and not part_files(out):
        raise JobError(f"{out} holds no mtplx output (no {SUMMARY}, {MANIFEST} or part files)")
    summary = {"job": None, "complete": False, "output_dir": str(out)}
    try:
        manifest = json.loads(found.read_text())
        summary["job"] = manifest.get("job")
        summary["rows_expected"] = manifest.get("output_rows")
    except (AttributeError, OSError, ValueError):
        pass
    summary.update(totals_of(out).metrics())
    return summary


def format_summary(s: dict) -> str:
    lines = []
    state = "complete"
    if not s.get("complete"):
        expected = s.get("rows_expected")
        done = (
            f"{s.get('rows', 0)} of {expected} rows done" if expected is not None else f"{s.get('rows', 0)} rows done"
        )
        state = f"incomplete: {done} (no summary yet; totals from the parts; rerun the job to resume)"
    lines.append(f"job {s.get('job')}: {state}")
    lines.append(f"output: {s.get('output_dir')}  ({s.get('rows', 0)} rows in {s.get('parts', 0)} parts)")
    reasons = ", ".join(f"{k} {v}" for k, v in (s.get("finish_reasons") or {}).items())
    lines.append(f"errors: {s.get('errors', 0)}" + (f"   finish reasons: {reasons}" if reasons else ""))
    undecoded = s.get("undecoded_prompt_tokens") or 0
    lines.append(
        f"tokens: prompt {s.get('prompt_tokens', 0)}"
        + (f" ({undecoded} of them in rows that failed before decoding)" if undecoded else "")
        + f", completion {s.get('completion_tokens', 0)}, decode steps {s.get('decode_steps', 0)}"
    )
    if s.get("shared_prefix_tokens"):
        lines.append(
            f"shared prefixes: {s['shared_prefix_tokens']} prompt tokens taken from a prefix prefilled once"
            + (f"; {s['prefill_tokens']} prompt tokens prefilled in the last run" if "prefill_tokens" in s else "")
        )
    if "wall_seconds" in s:
        lines.append(
            f"last run: {_num(s.get('wall_seconds'), '.1f')} s wall, {s.get('rows_this_run')} rows, "
            f"prefill {_num(s.get('prefill_tokens_per_second'), '.0f')} tok/s, "
            f"decode {_num(s.get('decode_tokens_per_second'), '.0f')} tok/s"
        )
    if "peak_memory" in s:
        pm = s["peak_memory"]
        lines.append("peak memory: " + ", ".join(f"{k.replace('_bytes', '')} {v / 1e6:.0f} MB" for k, v in pm.items()))
    lines.append(
        f"acceptance: {_num(s.get('acceptance_rate'), '.3f')}   mean accepted length: "
        f"{_num(s.get('mean_accepted_length'), '.3f')} tokens/cycle   ideal tokens/cycle: "
        f"{_num(s.get('ideal_tokens_per_cycle'), '.3f')}"
    )
    if "accuracy" in s:
        lines.append(f"accuracy: {_num(s.get('accuracy'), '.4f')} over {s.get('scored_rows')} scored rows")
    lines.append("")
    lines += acceptance_table(s.get("acceptance_by_depth") or [])
    return "\n".join(lines)


def acceptance_table(rows: List[dict]) -> List[str]:
    if not rows:
        return ["acceptance by depth: no drafts (depth 0 or no decode cycles)"]
    header = f"{'depth':>5}  {'drafted':>10}  {'accepted':>10}  {'rate':>6}"
    out = ["acceptance by depth (accepted = d_1..d_depth all accepted):", header]
    for r in rows:
        out.append(f"{r['depth']:>5}  {r['drafted']:>10}  {r['accepted']:>10}  {_num(r.get('rate'), '.3f'):>6}")
    return out


def _num(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)
