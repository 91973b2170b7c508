"""Job specs: TOML in, a validated frozen `JobSpec` out.

Every key is checked up front, an unknown key is an error (a typo must not be
silently ignored by a nightly job), and each message names the section and key.
Relative paths in a spec file are resolved against the file's own directory,
so a job runs the same from cron as from the repository root.
"""

from __future__ import annotations

import glob
import math
import os
import re
import string
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import tomllib

from mtplx import MAX_DEPTH

from .errors import JobError

SCORERS = ("exact", "contains", "regex")
ACCEPTANCE_RULES = ("residual", "coupled")
ENGINES = ("local", "ray")


@dataclass(frozen=True)
class ModelSpec:
    path: Optional[str] = None  # None: the built-in default model
    depth: Union[int, str] = 2  # draft tokens per cycle, 0 = plain decoding, or "auto"
    acceptance: str = "residual"
    draft_vocab: int = 0  # the head scores this many ids in merge order (MTPContract.draft_vocab); 0 = all


@dataclass(frozen=True)
class InputSpec:
    path: Optional[str] = None  # Parquet file, directory or glob
    dataset: Optional[str] = None  # a `datasets` name or a save_to_disk directory
    split: str = "train"
    dataset_config: Optional[str] = None
    id_column: Optional[str] = None  # None: the input's `id` column if it has one, else the row index; "": row index
    keep_columns: Tuple[str, ...] = ()


@dataclass(frozen=True)
class PromptSpec:
    column: Optional[str] = None
    messages: Optional[str] = None  # a column of OpenAI-style chat messages
    templates: Tuple[str, ...] = ()  # str.format templates over columns
    chat_template: bool = False  # wrap column/template text as one user message

    @property
    def mode(self) -> str:
        return "column" if self.column else "messages" if self.messages else "template"


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class GenerationSpec:
    max_tokens: int = 256
    n: int = 1
    stop: Tuple[str, ...] = ()
    stop_token_ids: Tuple[int, ...] = ()
    logprobs: bool = False


@dataclass(frozen=True)
class BatchSpec:
    """How the work is scheduled; none of it changes a row's output, so none of
    it is part of the spec hash (a job may resume with other settings)."""

    max_batch: int = 16
    token_budget: Optional[int] = None  # prefill tokens per step, runtime's own default if None
    max_memory: Optional[int] = None  # bytes
    window: int = 1024  # prompts sorted by length together
    read_rows: int = 1024  # rows per Parquet record batch
    share_prefix_min: int = 64  # prompts sharing this many leading tokens prefill them once; 0: off


@dataclass(frozen=True)
class OutputSpec:
    path: str = ""
    flush_rows: int = 1000
    flush_seconds: float = 60.0


@dataclass(frozen=True)
class EvaluationSpec:
    reference_column: str = ""
    scorer: str = "exact"
    ignore_case: bool = False
    strip: bool = True  # strip surrounding whitespace before exact/contains


@dataclass(frozen=True)
class RaySpec:
    """Where and how wide a job runs on Ray (docs/ray.md); scheduling only,
    so not part of the spec hash."""

    address: Optional[str] = None  # None: ray.init()'s own search, else a new local instance
    actors: Optional[int] = None  # None: one per node advertising "mlx", else one per node
    shard_rows: Optional[int] = None  # prompt rows per shard handed to an actor; None: sized to the job


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    input: InputSpec = field(default_factory=InputSpec)
    prompt: PromptSpec = field(default_factory=PromptSpec)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    batch: BatchSpec = field(default_factory=BatchSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    evaluation: Optional[EvaluationSpec] = None
    name: str = "job"
    engine: str = "local"  # "local" or "ray"
    ray: RaySpec = field(default_factory=RaySpec)

    def to_dict(self) -> dict:
        return asdict(self)

    def identity(self) -> dict:
        """What decides the rows' content, minus the locations (the model and the
        input enter the hash by their fingerprints, so moving files is harmless)."""
        d = self.to_dict()
        for k in ("batch", "output", "name", "engine", "ray"):
            d.pop(k)
        d["model"].pop("path")
        if not d["model"]["draft_vocab"]:  # the default leaves the identity of jobs from before the setting
            d["model"].pop("draft_vocab")
        for k in ("path", "dataset"):
            d["input"].pop(k)
        d["input"]["id_column"] = d["input"].get("id_column") or None  # "" and unset both key rows by index
        return d


# ------------------------------------------------------------------ checkers

Checker = Callable[[str, Any], Any]


def _kind(v) -> str:
    return type(v).__name__


def _str(where, v):
    if not isinstance(v, str) or not v:
        raise JobError(f"{where} must be a non-empty string, got {v!r}")
    return v


def _str_or_empty(where, v):
    if not isinstance(v, str):
        raise JobError(f"{where} must be a string, got {v!r}")
    return v


def _bool(where, v):
    if not isinstance(v, bool):
        raise JobError(f"{where} must be true or false, got {v!r}")
    return v


def _int(lo: int, hi: Optional[int] = None) -> Checker:
    def check(where, v):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise JobError(f"{where} must be an integer {bound}, got {v!r}")
        return v

    return check


def _float(lo: float, hi: float, lo_open=False, hi_open=False) -> Checker:
    def check(where, v):
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
            raise JobError(f"{where} must be a number in {lb}{lo}, {hi}{rb}, got {v!r}")
        return float(v)

    return check


def _choice(*options) -> Checker:
    def check(where, v):
        if v not in options:
            raise JobError(f"{where} must be one of {', '.join(map(repr, options))}; got {v!r}")
        return v

    return check


def _list_of(item: Checker) -> Checker:
    def check(where, v):
        if not isinstance(v, list):
            raise JobError(f"{where} must be a list, got {_kind(v)} {v!r}")
        return tuple(item(f"{where}[{i}]", x) for i, x in enumerate(v))

    return check


def _depth(where, v):
    if v == "auto":
        return v
    return _int(0, MAX_DEPTH)(where + ' (or "auto")', v)


def _model_path(where, v):
    v = _str(where, v)
    return None if v == "default" else v


def _templates(where, v):
    items = (v,) if isinstance(v, str) else _list_of(_str)(where, v)
    if not items:
        raise JobError(f"{where} must not be empty")
    for i, t in enumerate(items):
        template_fields(f"{where}[{i}]" if len(items) > 1 else where, t)
    return tuple(items)


def _stop(where, v):
    items = (v,) if isinstance(v, str) else _list_of(_str)(where, v)
    return tuple(items)


_MEM_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(where: str, v) -> int:
    """Bytes from an int or a string like "8GB" / "512 MiB"."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", v) if isinstance(v, str) else None
    if m and m.group(2).lower() in _MEM_UNITS and float(m.group(1)) > 0:
        return int(float(m.group(1)) * _MEM_UNITS[m.group(2).lower()])
    raise JobError(f"{where} must be a size like 8GB, 512MiB or a byte count, got {v!r}")


def template_fields(where: str, template: str) -> Tuple[str, ...]:
    """The column names a str.format template uses; only plain {name} fields."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise JobError(f"{where}: invalid template ({e})") from None
    names = []
    for _, name, format_spec, conversion in parsed:
        if name is None:
            continue
        if name == "" or name.isdigit() or any(c in name for c in ".[]"):
            raise JobError(f"{where}: template fields must name a column, like {{question}}; got {{{name}}}")
        if conversion not in (None, "s", "r", "a"):
            raise JobError(f"{where}: {{{name}!{conversion}}} has an unknown conversion (use !s, !r or !a)")
        if "{" in (format_spec or ""):
            raise JobError(f"{where}: {{{name}:{format_spec}}} nests a field in its format spec; write it out")
        names.append(name)
    if not names:
        raise JobError(f"{where}: the template uses no column (write fields like {{question}})")
    return tuple(dict.fromkeys(names))


# ----------------------------------------------------------------- sections

SECTIONS: Dict[str, Tuple[type, Dict[str, Tuple[str, Checker]]]] = {
    # section: (dataclass, {toml key: (field, checker)})
    "model": (
        ModelSpec,
        {
            "path": ("path", _model_path),
            "depth": ("depth", _depth),
            "acceptance": ("acceptance", _choice(*ACCEPTANCE_RULES)),
            "draft_vocab": ("draft_vocab", _int(0)),
        },
    ),
    "input": (
        InputSpec,
        {
            "path": ("path", _str),
            "dataset": ("dataset", _str),
            "split": ("split", _str),
            "dataset_config": ("dataset_config", _str),
            "id_column": ("id_column", _str_or_empty),
            "keep_columns": ("keep_columns", _list_of(_str)),
        },
    ),
    "prompt": (
        PromptSpec,
        {
            "column": ("column", _str),
            "messages": ("messages", _str),
            "template": ("templates", _templates),
            "chat_template": ("chat_template", _bool),
        },
    ),
    "sampling": (
        SamplingSpec,
        {
            "temperature": ("temperature", _float(0.0, 100.0)),
            "top_p": ("top_p", _float(0.0, 1.0, lo_open=True)),
            "top_k": ("top_k", _int(0)),
            "min_p": ("min_p", _float(0.0, 1.0, hi_open=True)),
            "seed": ("seed", _int(0, 2**63 - 1)),
        },
    ),
    "generation": (
        GenerationSpec,
        {
            "max_tokens": ("max_tokens", _int(1)),
            "n": ("n", _int(1, 10_000)),
            "stop": ("stop", _stop),
            "stop_token_ids": ("stop_token_ids", _list_of(_int(0))),
            "logprobs": ("logprobs", _bool),
        },
    ),
    "batch": (
        BatchSpec,
        {
            "max_batch": ("max_batch", _int(1, 4096)),
            "token_budget": ("token_budget", _int(1)),
            "max_memory": ("max_memory", parse_memory),
            "window": ("window", _int(1)),
            "read_rows": ("read_rows", _int(1)),
            "share_prefix_min": ("share_prefix_min", _int(0)),
        },
    ),
    "output": (
        OutputSpec,
        {
            "path": ("path", _str),
            "flush_rows": ("flush_rows", _int(1)),
            "flush_seconds": ("flush_seconds", _float(0.0, 1e9, lo_open=True)),
        },
    ),
    "ray": (
        RaySpec,
        {
            "address": ("address", _str),
            "actors": ("actors", _int(1, 100_000)),
            "shard_rows": ("shard_rows", _int(1)),
        },
    ),
    "evaluation": (
        EvaluationSpec,
        {
            "reference_column": ("reference_column", _str),
            "scorer": ("scorer", _choice(*SCORERS)),
            "ignore_case": ("ignore_case", _bool),
            "strip": ("strip", _bool),
        },
    ),
}
TOP_LEVEL_KEYS = ("name", "engine")


def _parse_section(name: str, table) -> Any:
    cls, keys = SECTIONS[name]
    if not isinstance(table, dict):
        raise JobError(f"[{name}] must be a table, got {_kind(table)}")
    values = {}
    for key, v in table.items():
        if key not in keys:
            raise JobError(f"unknown key {key!r} in [{name}]; allowed: {', '.join(keys)}")
        fname, check = keys[key]
        values[fname] = check(f"[{name}] {key}", v)
    return cls(**values)


def spec_from_dict(doc: dict, base_dir: Optional[Path] = None) -> JobSpec:
    """Validate a parsed TOML document; relative paths resolve against base_dir."""
    for key, v in doc.items():
        if key not in SECTIONS and key not in TOP_LEVEL_KEYS:
            allowed = ", ".join([f"[{s}]" for s in SECTIONS] + list(TOP_LEVEL_KEYS))
            raise JobError(f"unknown key {key!r} at the top level of the job spec; allowed: {allowed}")
    parts = {name: _parse_section(name, doc[name]) for name in SECTIONS if name in doc}
    name = _str("name", doc["name"]) if "name" in doc else "job"
    engine = _choice(*ENGINES)("engine", doc["engine"]) if "engine" in doc else "local"
    spec = JobSpec(name=name, engine=engine, **parts)
    if base_dir is not None:
        spec = _resolve_paths(spec, Path(base_dir))
    check_spec(spec)
    return spec


def _resolve(base: Path, p: Optional[str], *, glob_ok=False) -> Optional[str]:
    if p is None:
        return None
    q = Path(p).expanduser()
    if q.is_absolute():
        return os.path.normpath(q)
    if glob_ok and any(c in p for c in "*?[") and not (base / q).exists():
        # A pattern: the spec's own directory may hold [ ] * ?, which are not part of it.
        return os.path.normpath(os.path.join(glob.escape(str(base)), str(q)))
    return os.path.normpath(base / q)


def _resolve_paths(spec: JobSpec, base: Path) -> JobSpec:
    model = replace(spec.model, path=_resolve(base, spec.model.path))
    inp = spec.input
    if inp.path is not None:
        inp = replace(inp, path=_resolve(base, inp.path, glob_ok=True))
    if inp.dataset is not None and (base / inp.dataset).exists():
        inp = replace(inp, dataset=str(base / inp.dataset))
    out = replace(spec.output, path=_resolve(base, spec.output.path) if spec.output.path else "")
    return replace(spec, model=model, input=inp, output=out)


def check_spec(spec: JobSpec) -> None:
    """Rules across keys."""
    if not spec.output.path:
        raise JobError("[output] path is required (the directory the part files go to)")
    if (spec.input.path is None) == (spec.input.dataset is None):
        raise JobError("[input] needs exactly one of path (Parquet file, directory or glob) or dataset")
    p = spec.prompt
    given = [k for k, v in (("column", p.column), ("messages", p.messages), ("template", p.templates)) if v]
    if len(given) != 1:
        raise JobError(
            "[prompt] needs exactly one of column, messages or template"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if p.messages and p.chat_template:
        raise JobError("[prompt] chat_template applies to column or template prompts; messages always use it")
    if spec.evaluation is not None and not spec.evaluation.reference_column:
        raise JobError("[evaluation] reference_column is required")
    if spec.input.id_column and spec.input.id_column in spec.input.keep_columns:
        raise JobError(f"[input] keep_columns repeats the id column {spec.input.id_column!r}")


def load_spec(path) -> JobSpec:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(f"job spec not found: {path}") from None
    except OSError as e:
        raise JobError(f"cannot read job spec {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise JobError(f"job spec {path} is not UTF-8 text (byte {e.start}); TOML files must be") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise JobError(f"{path}: invalid TOML ({e})") from None
    spec = spec_from_dict(doc, base_dir=path.resolve().parent)
    if "name" not in doc:
        spec = replace(spec, name=path.stem)
    return spec
