"""The plan of a job: which input columns are read, which are passed through,
and the exact output schema. Every missing or clashing column is found here,
before the model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import pyarrow as pa

from .errors import JobError
from .ids import ROW_INDEX, is_id_type
from .inputs import InputSource
from .spec import JobSpec, template_fields

RESULT_FIELDS = [
    pa.field("completion", pa.string()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("drafted_by_depth", pa.list_(pa.int32())),
    pa.field("accepted_by_depth", pa.list_(pa.int32())),
    pa.field("acceptance_rate", pa.float64()),
    pa.field("mean_accepted_length", pa.float64()),
    pa.field("decode_steps", pa.int32()),
    pa.field("shared_prefix_tokens", pa.int32()),  # prompt tokens taken from a prefix prefilled once
]
RENDERED_PROMPT = "rendered_prompt"


@dataclass(frozen=True)
class Plan:
    spec: JobSpec
    key_column: str  # the output column holding the id (the id column or row_index)
    id_column: Optional[str]  # None: rows keyed by row index
    prompt_columns: Tuple[str, ...]  # input columns the prompt is built from
    passthrough: Tuple[str, ...]  # input columns copied into every output row
    reference_column: Optional[str]
    templates: Tuple[str, ...]
    n: int
    logprobs: bool
    schema: pa.Schema  # of every part file

    @property
    def read_columns(self) -> Tuple[str, ...]:
        cols = ((self.id_column,) if self.id_column else ()) + self.prompt_columns + self.passthrough
        return tuple(dict.fromkeys(cols))

    @property
    def multi_template(self) -> bool:
        return len(self.templates) > 1

    @property
    def variants(self) -> int:
        """Template variants of each input row (1 unless several templates)."""
        return max(1, len(self.templates))

    @property
    def key_columns(self) -> Tuple[str, ...]:
        """The output columns that key a row."""
        return (
            (self.key_column,)
            + (("template_index",) if self.multi_template else ())
            + (("sample_index",) if self.n > 1 else ())
        )


def make_plan(spec: JobSpec, source: InputSource, logprobs: bool) -> Plan:
    p, names = spec.prompt, source.column_names()

    def need(column: str, what: str) -> str:
        if column not in names:
            raise JobError(f"input {source.label} has no column {column!r} ({what}); columns: {', '.join(names)}")
        return column

    id_column = spec.input.id_column
    if id_column:
        need(id_column, "[input] id_column")
        if not is_id_type(source.schema.field(id_column).type):
            raise JobError(
                f"id column {id_column!r} must hold integers or strings, not {source.schema.field(id_column).type}"
            )
    if p.column:
        prompt_columns = (need(p.column, "[prompt] column"),)
        _check_text_column(source, p.column)
    elif p.messages:
        prompt_columns = (need(p.messages, "[prompt] messages"),)
    else:
        fields = [f for t in p.templates for f in template_fields("[prompt] template", t)]
        prompt_columns = tuple(need(f, "used by [prompt] template") for f in dict.fromkeys(fields))
    reference = None
    if spec.evaluation is not None:
        reference = need(spec.evaluation.reference_column, "[evaluation] reference_column")
        t = source.schema.field(reference).type
        if not (is_id_type(t) or pa.types.is_null(t)):  # bytes or floats would be compared as their repr
            raise JobError(f"reference column {reference!r} must hold strings or integers, not {t}")
    keep = tuple(need(c, "[input] keep_columns") for c in spec.input.keep_columns)
    passthrough = tuple(
        c for c in dict.fromkeys(prompt_columns + ((reference,) if reference else ()) + keep) if c != id_column
    )
    source.check_columns(((id_column,) if id_column else ()) + prompt_columns + passthrough)
    plan = Plan(
        spec=spec,
        key_column=id_column or ROW_INDEX,
        id_column=id_column,
        prompt_columns=prompt_columns,
        passthrough=passthrough,
        reference_column=reference,
        templates=p.templates,
        n=spec.generation.n,
        logprobs=logprobs,
        schema=pa.schema([]),
    )
    return _with_schema(plan, source.schema)


def _check_text_column(source: InputSource, column: str) -> None:
    """A prompt column of another type than text (ints, bytes) is a mistake in the job, not in its rows."""
    t = source.schema.field(column).type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)):
        raise JobError(
            f"[prompt] column {column!r} of {source.label} must hold strings, not {t}; "
            "for chat messages use [prompt] messages, for other columns a [prompt] template"
        )


def _with_schema(plan: Plan, input_schema: pa.Schema) -> Plan:
    fields = []
    if plan.id_column:
        fields.append(input_schema.field(plan.id_column))
    else:
        fields.append(pa.field(ROW_INDEX, pa.int64()))
    if plan.multi_template:
        fields.append(pa.field("template_index", pa.int32()))
    if plan.n > 1:
        fields.append(pa.field("sample_index", pa.int32()))
    fields += [input_schema.field(c) for c in plan.passthrough]
    if plan.templates:
        fields.append(pa.field(RENDERED_PROMPT, pa.string()))
    fields += RESULT_FIELDS
    if plan.logprobs:
        fields.append(pa.field("logprobs", pa.list_(pa.float32())))
    if plan.reference_column:
        fields.append(pa.field("score", pa.float64()))
    seen = {}
    for i, f in enumerate(fields):
        if f.name in seen:
            raise JobError(
                f"input column {f.name!r} clashes with an output column of the same name; "
                "rename it in the input or leave it out of the job"
            )
        seen[f.name] = i
    # Passed-through values may be null even where the input declares them not.
    return replace(plan, schema=pa.schema([f.with_nullable(True) for f in fields]))
