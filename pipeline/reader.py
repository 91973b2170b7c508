"""The reader: input record batches -> prompt rows, tokenised on the fly,
skipping every (id, template, sample) key the output already holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from .ids import KeySet, id_hashes, row_keys
from .inputs import InputSource
from .plan import Plan
from .prompts import BuiltPrompt, PromptEncoder


@dataclass
class PromptRow:
    ordinal: int  # the row's number in the input, across files
    template_index: int
    id: Any  # the id value, or the ordinal when rows are keyed by index
    values: dict  # passed-through column values
    tokens: Optional[List[int]]
    text: Optional[str]  # rendered template text
    error: Optional[str]
    todo: Tuple[int, ...]  # sample indices not yet in the output
    pending: int = 0  # completions still expected back from the runtime
    reference: Any = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) if self.tokens is not None else 0


def read_rows(source: InputSource, plan: Plan, encoder: PromptEncoder, done: KeySet) -> Iterator[PromptRow]:
    ordinal = 0
    read_rows_per_batch = plan.spec.batch.read_rows
    for batch in source.iter_batches(plan.read_columns, read_rows_per_batch):
        m = batch.num_rows
        if plan.id_column:
            id_array = batch.column(plan.id_column)
            ids = id_array.to_pylist()
            hashes = id_hashes(id_array) if len(done) else None
        else:
            ids = list(range(ordinal, ordinal + m))
            hashes = np.arange(ordinal, ordinal + m, dtype=np.uint64) if len(done) else None
        columns = {c: _values(batch.column(c)) for c in plan.read_columns if c != plan.id_column}
        todo = _todo_samples(hashes, plan, done, m)  # [variants][m] -> tuple of samples
        for i in range(m):
            values = {c: v[i] for c, v in columns.items()}
            bad_text = _null_invalid_text(values, plan)
            if plan.id_column:
                values[plan.id_column] = ids[i]
            for t in range(plan.variants):
                samples = todo[t][i] if todo is not None else tuple(range(plan.n))
                if not samples:
                    continue
                built = BuiltPrompt(None, None, bad_text) if bad_text else encoder.build(values, t)
                yield PromptRow(
                    ordinal=ordinal + i,
                    template_index=t,
                    id=ids[i],
                    values={c: values[c] for c in plan.passthrough},
                    tokens=built.tokens,
                    text=built.text,
                    error=built.error,
                    todo=samples,
                    reference=values.get(plan.reference_column) if plan.reference_column else None,
                )
        ordinal += m


class _InvalidText:
    """Stands for a value holding a string that is not valid UTF-8."""

    def __repr__(self) -> str:
        return "<invalid UTF-8>"


INVALID_TEXT = _InvalidText()


def _values(column: pa.Array) -> list:
    """The column as Python values; a value with invalid UTF-8 (Parquet does
    not check) becomes INVALID_TEXT, so that only its row fails."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        return [_value(column, i) for i in range(len(column))]


def _value(column: pa.Array, i: int):
    try:
        return column[i].as_py()
    except UnicodeDecodeError:
        return INVALID_TEXT


def _null_invalid_text(values: dict, plan: Plan) -> Optional[str]:
    """Nulls the values holding invalid UTF-8 (the output cannot hold them as
    text); returns the row error naming the first such column, or None."""
    bad = [c for c, v in values.items() if v is INVALID_TEXT]
    if not bad:
        return None
    for c in bad:
        values[c] = None
    prompt = plan.spec.prompt
    what = {prompt.column: "prompt", prompt.messages: "messages"}.get(bad[0], f"column {bad[0]!r}")
    return f"{what} is not valid UTF-8"


def _todo_samples(hashes, plan: Plan, done: KeySet, m: int):
    if hashes is None:
        return None
    out = []
    samples = np.arange(plan.n, dtype=np.uint64)
    for t in range(plan.variants):
        keys = row_keys(hashes[:, None], t, samples[None, :])  # [m, n]
        present = done.contains(keys)  # [m, n]
        out.append([tuple(np.nonzero(~present[i])[0].tolist()) for i in range(m)])
    return out
