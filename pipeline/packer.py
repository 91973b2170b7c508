"""The packer: orders prompts by length within a bounded window and streams
them into the runtime as Requests. It never builds batches: the runtime pulls
requests lazily and owns batch composition and the token budget.

Rows that failed before tokenising (null prompt, ...) never reach the runtime;
they are handed to `on_error` as soon as they are read.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, List

from .plan import Plan
from .reader import PromptRow


def length_ordered(
    rows: Iterable[PromptRow], window: int, on_error: Callable[[PromptRow], None]
) -> Iterator[PromptRow]:
    """Rows sorted by (prompt length, input order) within consecutive windows
    of `window` good rows: deterministic, and memory bounded by the window."""
    buf: List[PromptRow] = []
    for r in rows:
        if r.error is not None:
            on_error(r)
            continue
        buf.append(r)
        if len(buf) >= window:
            yield from _sorted(buf)
            buf = []
    yield from _sorted(buf)


def _sorted(buf: List[PromptRow]) -> List[PromptRow]:
    return sorted(buf, key=lambda r: (r.prompt_length, r.ordinal, r.template_index))


def runtime_row_id(plan: Plan, row: PromptRow):
    """The id that keys a row's randomness: stable across runs and resumes."""
    return f"{row.id}#{row.template_index}" if plan.multi_template else row.id


def requests(rows: Iterable[PromptRow], plan: Plan, request_type, sampling, inflight: Dict[int, PromptRow]) -> Iterator:
    """Requests for the runtime; `inflight` maps each request index to its row
    until all its samples have come back."""
    g = plan.spec.generation
    for index, r in enumerate(rows):
        r.pending = plan.n
        inflight[index] = r
        yield request_type(
            index=index,
            prompt=r.tokens,
            sampling=sampling,
            max_tokens=g.max_tokens,
            row_id=runtime_row_id(plan, r),
            n=plan.n,
            stop=g.stop,
            stop_token_ids=g.stop_token_ids,
            logprobs=plan.logprobs,
        )
