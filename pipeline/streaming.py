"""Prompt rows through the runtime into output rows: what a local run and
every Ray actor do with their rows."""

from __future__ import annotations

from typing import Iterable

from .engine import sampling_params
from .packer import length_ordered, requests
from .plan import Plan
from .reader import PromptRow
from .rows import completion_row, error_row
from .scoring import make_scorer
from .writer import PartWriter


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

    ordered = length_ordered(rows, spec.batch.window, on_error, spec.batch.share_prefix_min)
    feed = requests(ordered, plan, engine.request_type, sampling, inflight)
    for c in engine.stream(feed, seed=spec.sampling.seed):
        r = inflight[c.index]
        r.pending -= 1
        if r.pending == 0:
            del inflight[c.index]
        if c.sample_index not in r.todo:
            continue  # this sample was already in the output (a partly done row)
        writer.add(completion_row(plan, r, c, scorer))
        progress.row(
            len(c.tokens),
            sum(c.drafted_by_depth),
            sum(c.accepted_by_depth),
            c.finish_reason == "error",
            prompt_tokens=c.prompt_tokens or r.prompt_length,
            shared=getattr(c, "shared_prefix_tokens", 0),
        )
