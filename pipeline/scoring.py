"""Scorers for evaluation jobs: 1.0 / 0.0 per row, None when there is no
answer to score against; `ScoreError` when the reference itself is broken."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable, Optional

from .spec import EvaluationSpec

Scorer = Callable[[str, object], Optional[float]]


class ScoreError(ValueError):
    """A reference the scorer cannot use (a regex that does not compile); the row's error names it."""


def make_scorer(spec: EvaluationSpec) -> Scorer:
    """exact: the completion equals the reference; contains: the reference
    occurs in the completion; regex: the reference, a regular expression, is
    found in the completion (re.search)."""

    def norm(s: str) -> str:
        s = s.strip() if spec.strip else s
        return s.casefold() if spec.ignore_case else s

    def score(completion: str, reference) -> Optional[float]:
        if reference is None or completion is None:
            return None
        ref = reference if isinstance(reference, str) else str(reference)  # an integer answer
        if not norm(ref):  # "" is in every completion and matches every regex: no answer to score against
            return None
        if spec.scorer == "exact":
            return float(norm(completion) == norm(ref))
        if spec.scorer == "contains":
            return float(norm(ref) in norm(completion))
        return float(_compile(ref, spec.ignore_case).search(completion) is not None)

    return score


@lru_cache(maxsize=1024)
def _compile(pattern: str, ignore_case: bool):
    try:
        return re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as e:
        raise ScoreError(f"scoring: the reference {pattern!r} is not a valid regular expression ({e})") from None
