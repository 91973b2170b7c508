"""The packer: orders prompts by length within a bounded window (prompts that
begin alike together, so a shared prefix is live while its rows run) and
streams them into the runtime as Requests. It never builds batches: the runtime pulls
requests lazily and owns batch composition and the token budget.

Rows that failed before tokenising (null prompt, ...) never reach the runtime;
they are handed to `on_error` as soon as they are read.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, List

from .plan import Plan
from .reader import PromptRow


def length_ordered(
    rows: Iterable[PromptRow], window: int, on_error: Callable[[PromptRow], None], share_prefix_min: int = 0
) -> Iterator[PromptRow]:
    """Rows sorted by (prompt length, input order) within consecutive windows
    of `window` good rows: deterministic, and memory bounded by the window.
    With `share_prefix_min`, rows whose first that many tokens agree come
    together, their group placed at its shortest prompt's length."""
    buf: List[PromptRow] = []
    for r in rows:
        if r.error is not None:
            on_error(r)
            continue
        buf.append(r)
        if len(buf) >= window:
            yield from _sorted(buf, share_prefix_min)
            buf = []
    yield from _sorted(buf, share_prefix_min)


def _sorted(buf: List[PromptRow], share_prefix_min: int = 0) -> List[PromptRow]:
    def own(r):
        return (r.prompt_length, r.ordinal, r.template_index)

    if not share_prefix_min:
        return sorted(buf, key=own)
    # Rows too short to share sort alone; each group of a common head sorts at its first row.
    heads: Dict[tuple, tuple] = {}
    for r in buf:
        if r.prompt_length > share_prefix_min:
            head = tuple(r.tokens[:share_prefix_min])
            heads[head] = min(heads.get(head, own(r)), own(r))

    def key(r):
        first = heads[tuple(r.tokens[:share_prefix_min])] if r.prompt_length > share_prefix_min else own(r)
        return first + own(r)

    return sorted(buf, key=key)


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
