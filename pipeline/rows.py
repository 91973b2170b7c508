"""Output rows: one dict per (prompt row, sample), in the plan's schema."""

from __future__ import annotations

from typing import Optional

from .plan import RENDERED_PROMPT, Plan
from .reader import PromptRow
from .scoring import ScoreError, Scorer


def _key_fields(plan: Plan, row: PromptRow, sample_index: int) -> dict:
    out = {plan.key_column: row.id}
    if plan.multi_template:
        out["template_index"] = row.template_index
    if plan.n > 1:
        out["sample_index"] = sample_index
    out.update(row.values)
    if plan.templates:
        out[RENDERED_PROMPT] = row.text
    return out


def completion_row(plan: Plan, row: PromptRow, c, scorer: Optional[Scorer]) -> dict:
    """`c` is a runtime Completion."""
    out = _key_fields(plan, row, c.sample_index)
    failed = c.finish_reason == "error"
    out.update(
        completion=None if failed else c.text,
        completion_tokens=len(c.tokens),
        prompt_tokens=c.prompt_tokens or row.prompt_length,
        finish_reason=c.finish_reason,
        error=c.error,
        drafted_by_depth=list(c.drafted_by_depth),
        accepted_by_depth=list(c.accepted_by_depth),
        acceptance_rate=c.acceptance_rate,
        mean_accepted_length=c.mean_accepted_length,
        decode_steps=c.steps,
        shared_prefix_tokens=getattr(c, "shared_prefix_tokens", 0),
    )
    if plan.logprobs:
        out["logprobs"] = None if c.logprobs is None else list(c.logprobs)
    if scorer is not None:
        try:
            out["score"] = None if failed else scorer(c.text, row.reference)
        except ScoreError as e:  # the completion stands; the row says what to fix in its reference
            out.update(score=None, error=str(e))
    return out


def error_row(plan: Plan, row: PromptRow, sample_index: int) -> dict:
    """A row the pipeline rejected before the runtime (null prompt, ...)."""
    out = _key_fields(plan, row, sample_index)
    out.update(
        completion=None,
        completion_tokens=0,
        prompt_tokens=row.prompt_length,
        finish_reason="error",
        error=row.error,
        drafted_by_depth=[],
        accepted_by_depth=[],
        acceptance_rate=None,
        mean_accepted_length=None,
        decode_steps=0,
        shared_prefix_tokens=0,
    )
    if plan.logprobs:
        out["logprobs"] = None
    if plan.reference_column:
        out["score"] = None
    return out
