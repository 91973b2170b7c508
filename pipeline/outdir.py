"""The output directory: its lock, manifest, the resume scan and --overwrite.

The directory is a Parquet dataset at every moment: its visible files are the
complete part files alone. `.mtplx/` holds the manifest, the summary and crash
logs, and a part is written as a hidden `.part-*.tmp` and renamed, so every
reader that skips hidden names (pyarrow, pandas, datasets) or globs
`*.parquet` (duckdb, polars) reads exactly the finished rows.

The part files are the only record of what is done. `manifest.json` is written
once, before the first part, and holds the hash of everything that decides the
rows' content (spec, model fingerprint, input fingerprint); a later run on the
same directory must match it or is refused. A directory written before
`.mtplx/` existed (manifest and summary beside the parts) resumes as before and
has them moved into `.mtplx/` when the run starts writing.

A run holds `.mtplx.lock` (an flock, which the kernel releases however the
process ends, `kill -9` included) from its resume scan to its summary: two
runs resuming from the same parts at once would write the same rows twice
and reuse each other's part names.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import JobError
from .ids import KeySet, id_hashes, row_keys
from .plan import Plan

META_DIR = ".mtplx"
MANIFEST = "manifest.json"
# The manifest's record of depth "auto"'s depth for sampled rows (residual
# rule), chosen by the first run's calibration and reused on resume.
AUTO_SAMPLED_DEPTH = "auto_sampled_depth"
SUMMARY = "summary.json"
LOCK = ".mtplx.lock"
# `part-NNNNN.parquet` (the local engine) or `part-sSSSSS-KKKKK.parquet` (part
# K of shard S, the Ray engine: a retried shard reuses its own names).
PART_RE = re.compile(r"^part-(?:(\d{5,})|s(\d{5,})-(\d{5,}))\.parquet$")
TEMP_SUFFIX = ".tmp"


def meta_path(out: Path, name: str) -> Path:
    """Where the output directory keeps `name` (manifest.json, summary.json)."""
    return Path(out) / META_DIR / name


def legacy_meta_path(out: Path, name: str) -> Path:
    """Where directories written before `.mtplx/` kept it."""
    return Path(out) / name


def existing_meta_path(out: Path, name: str) -> Optional[Path]:
    """`name`'s file in either layout, or None."""
    return next((p for p in (meta_path(out, name), legacy_meta_path(out, name)) if p.is_file()), None)


def part_name(number: int) -> str:
    return f"part-{number:05d}.parquet"


def shard_part_name(shard: int, number: int) -> str:
    return f"part-s{shard:05d}-{number:05d}.parquet"


def _part_order(p: Path):
    plain, shard, number = PART_RE.match(p.name).groups()
    return (0, int(plain), 0) if plain is not None else (1, int(shard), int(number))


def part_files(out: Path) -> List[Path]:
    if not out.is_dir():
        return []
    parts = [p for p in out.iterdir() if PART_RE.match(p.name)]
    return sorted(parts, key=_part_order)


def shard_part_files(out: Path, shard: int) -> List[Path]:
    return [p for p in part_files(out) if _part_order(p)[:2] == (1, shard)]


def next_shard_part(parts: List[Path]) -> int:
    """The part number after the last of a shard's parts."""
    return 1 + max((_part_order(p)[2] for p in parts), default=-1)


def remove_shard_temp_files(out: Path, shard: int) -> None:
    """What an attempt at the shard that died mid-write left behind."""
    prefix = shard_part_name(shard, 0).rsplit("-", 1)[0] + "-"
    for p in [*out.glob(prefix + "*" + TEMP_SUFFIX), *out.glob("." + prefix + "*" + TEMP_SUFFIX)]:
        p.unlink(missing_ok=True)


@dataclass
class OutputState:
    path: Path
    done: KeySet  # keys of every row the parts hold
    rows_done: int
    next_part: int
    existed: bool  # a previous run left a manifest here
    next_shard: int = 0  # the first shard number no part file uses
    overwrite: bool = False  # what a previous run wrote goes when this run starts writing
    recorded: dict = field(default_factory=dict)  # the manifest a previous run wrote
    legacy: bool = False  # written before `.mtplx/`: start_output moves its manifest and summary there
    # --retry-errors: part -> its rows with an error, left out of `done` and
    # `rows_done`; `start_output` removes them from their parts.
    error_rows: Dict[Path, int] = field(default_factory=dict)

    @property
    def errors_to_retry(self) -> int:
        return sum(self.error_rows.values())


def write_json_atomic(path: Path, data: dict) -> None:
    def write(f):
        f.write((json.dumps(data, indent=2, sort_keys=False, default=str) + "\n").encode())

    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_atomically(path, write)


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """A part file, whole or not at all (`_replace_atomically`)."""
    _replace_atomically(path, lambda f: pq.write_table(table, f, compression="zstd"))


def _replace_atomically(path: Path, write: Callable) -> None:
    """`write(f)` into a temporary file beside `path`, fsynced, renamed over
    `path`, and the rename fsynced: killed at any moment, `path` is the old
    file or the new one, never part of one."""
    tmp = path.with_name("." + path.name + TEMP_SUFFIX)  # hidden: no reader sees a half-written file
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def check_writable(out: Path) -> None:
    """Refuse an output path that is not a directory we can write, naming it."""
    if out.exists() and not out.is_dir():
        raise JobError(f"output path {out} exists and is not a directory")
    probe_dir = out
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise JobError(f"output directory {out} cannot be created: {probe_dir} is not a directory")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise JobError(f"output directory {out} is not writable ({probe_dir} denies writing)")
    try:  # os.access says yes to root, and on filesystems that refuse files (/proc): try one
        tempfile.TemporaryFile(dir=probe_dir).close()
    except OSError as e:
        raise JobError(f"cannot write to output directory {out}: {e.strerror or e} in {probe_dir}") from None


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold `out` for this run, or refuse if another run holds it."""
    check_writable(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise JobError(f"cannot write to output directory {out}: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobError(_in_use(out, fd)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def output_in_use(out: Path) -> Optional[str]:
    """The refusal `output_lock` would give now, else None (for dry runs)."""
    try:
        fd = os.open(out / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _in_use(out, fd)
    finally:
        os.close(fd)


def _in_use(out: Path, fd: int) -> str:
    holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
    pid = f" (pid {holder})" if holder.isdigit() else ""
    return f"output directory {out} is in use by another run{pid}; wait for it to end or pick another directory"


def open_output(out: Path, plan: Plan, manifest: dict, *, overwrite: bool, retry_errors: bool = False) -> OutputState:
    """What `out` holds, checked against this job. Writes nothing: a job that
    fails a later check (the model, the memory cap) leaves a previous run's
    output as it was, --overwrite included. `start_output` writes.
    retry_errors: rows written with an error count as not done."""
    check_writable(out)
    if overwrite:
        return OutputState(out, KeySet(), 0, 0, existed=False, overwrite=True)
    found = existing_meta_path(out, MANIFEST)
    existed = found is not None
    recorded = {}
    if existed:
        recorded = _check_manifest(found, manifest)
    elif part_files(out):
        raise JobError(
            f"{out} holds part files but no {MANIFEST}; pass --overwrite to start over, or pick another directory"
        )
    legacy = existed and found == legacy_meta_path(out, MANIFEST)
    return replace(_scan_parts(out, plan, existed, retry_errors), recorded=recorded, legacy=legacy)


def resume_note(state: OutputState) -> str:
    """The log line on what this run starts from."""
    if not state.rows_done and not state.errors_to_retry:
        return f"writing to {state.path}"
    note = f"resuming: {state.rows_done} rows already in {state.path}"
    if state.errors_to_retry:
        note += f"; {state.errors_to_retry} rows written with an error run again (--retry-errors)"
    return note


def start_output(state: OutputState, manifest: dict) -> None:
    """Ready `out` for this run's parts, once everything else has been
    checked: --overwrite removes the previous run's output, a half-written
    part is dropped, and a new job's manifest is written."""
    out = state.path
    try:
        out.mkdir(parents=True, exist_ok=True)
        if state.overwrite:
            clear_output(out)
        _remove_temp_files(out)
        if state.legacy:
            _move_into_meta_dir(out)
        for part in state.error_rows:
            drop_error_rows(part)
        if not state.existed:
            write_json_atomic(meta_path(out, MANIFEST), manifest)
    except OSError as e:
        raise JobError(f"cannot write to output directory {out}: {e.strerror or e}") from None


def drop_error_rows(part: Path) -> None:
    """Rewrite `part` without its rows that have an error (--retry-errors),
    or remove it if nothing else is left. The new part replaces the old one
    in one rename: killed at any moment, the directory holds one or the
    other, and each row at most once; a row gone is one the run writes again."""
    table = pq.read_table(part)
    kept = table.filter(pc.is_null(table.column("error")))
    if kept.num_rows:
        write_table_atomic(kept, part)
    else:
        part.unlink()
        fsync_dir(part.parent)


def clear_output(out: Path) -> None:
    """--overwrite: remove what a previous run wrote, and nothing else."""
    if not out.is_dir():
        return
    for p in _files_in(out):
        if PART_RE.match(p.name) or p.name.endswith(TEMP_SUFFIX) or p.name in (MANIFEST, SUMMARY):
            try:
                p.unlink()
            except OSError as e:
                raise JobError(f"--overwrite cannot remove {p}: {e.strerror or e}") from None


def _files_in(out: Path) -> List[Path]:
    """The entries of `out` and of its `.mtplx/`, where a run writes."""
    meta = out / META_DIR
    return [*out.iterdir(), *(meta.iterdir() if meta.is_dir() else [])]


def _remove_temp_files(out: Path) -> None:
    for p in _files_in(out):
        if p.name.endswith(TEMP_SUFFIX) and p.is_file():
            p.unlink()


def _move_into_meta_dir(out: Path) -> None:
    """A directory of the layout before `.mtplx/`: its manifest and summary move there."""
    (out / META_DIR).mkdir(exist_ok=True)
    for name in (SUMMARY, MANIFEST):  # the manifest last: until it moves, the old layout is whole
        old = legacy_meta_path(out, name)
        if old.is_file():
            os.replace(old, meta_path(out, name))
    fsync_dir(out / META_DIR)
    fsync_dir(out)


def _check_manifest(path: Path, manifest: dict) -> dict:
    out = path.parent.parent if path.parent.name == META_DIR else path.parent
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise JobError(f"unreadable {path} ({e}); pass --overwrite to start over") from None
    if old.get("spec_hash") == manifest["spec_hash"]:
        return old
    what = changed_parts(old.get("identity", {}), manifest["identity"])
    raise JobError(
        f"output directory {out} was written by a different job ({what} changed); "
        "resume needs the same spec, model and input: pass --overwrite to start over, or pick another output directory"
    )


def changed_parts(old: dict, new: dict) -> str:
    names = []
    for key in ("model", "input", "spec"):
        if old.get(key) != new.get(key):
            if key == "spec":
                o, n = old.get("spec", {}) or {}, new.get("spec", {})
                sections = [s for s in n if o.get(s) != n.get(s)] or ["spec"]
                names += [f"[{s}]" for s in sections]
            else:
                names.append({"model": "the model", "input": "the input data"}[key])
    return ", ".join(names) or "the spec"


def _scan_parts(out: Path, plan: Plan, existed: bool, retry_errors: bool = False) -> OutputState:
    parts = part_files(out)
    error_rows = {} if retry_errors else None
    done, rows = scan_keys(parts, plan, error_rows)
    twice = int(np.count_nonzero(done.keys[1:] == done.keys[:-1]))
    if twice:  # resuming would keep them: every input row must appear once
        raise JobError(
            f"the part files in {out} hold {twice} rows more than once (written by two runs at once?); "
            "pass --overwrite to start over"
        )
    orders = [_part_order(p) for p in parts]
    next_part = 1 + max((n for kind, n, _ in orders if kind == 0), default=-1)
    next_shard = 1 + max((s for kind, s, _ in orders if kind == 1), default=-1)
    return OutputState(out, done, rows, next_part, existed, next_shard, error_rows=error_rows or {})


def scan_keys(parts: List[Path], plan: Plan, error_rows: Optional[Dict[Path, int]] = None):
    """(KeySet of the rows the parts hold, their row count). Given a dict
    `error_rows`, rows with an error are left out of both and counted in it
    by part (the parts that hold none are not entered)."""
    chunks, rows = [], 0
    for p in parts:
        table = _read_columns(p, list(plan.key_columns) + (["error"] if error_rows is not None else []))
        if error_rows is not None:
            failed = len(table) - table.column("error").null_count
            if failed:
                error_rows[p] = failed
                table = table.filter(pc.is_null(table.column("error")))
        ids = table.column(plan.key_column).combine_chunks()
        hashes = id_hashes(ids)
        t = _column_or_zero(table, "template_index")
        s = _column_or_zero(table, "sample_index")
        chunks.append(row_keys(hashes, t, s))
        rows += table.num_rows
    return KeySet(chunks), rows


def _read_columns(p: Path, columns: List[str]) -> pa.Table:
    try:
        return pq.read_table(p, columns=columns)
    except (OSError, pa.ArrowException, ValueError, KeyError) as e:
        raise JobError(
            f"cannot read output part {p}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


def _column_or_zero(table: pa.Table, name: str) -> np.ndarray:
    if name not in table.column_names:
        return np.zeros(table.num_rows, dtype=np.uint64)
    return table.column(name).to_numpy().astype(np.uint64)
