"""What goes into the runtime and what comes out, and the host-side stop rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

from mtplx.decode.checks import positive_int, stop_strings, stop_token_id_list
from mtplx.decode.sampling import SamplingParams


@dataclass
class Request:
    """One prompt to complete. `row_id` keys the row's randomness (default: index)."""

    index: int
    prompt: Union[Sequence[int], str]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    row_id: Any = None
    n: int = 1
    stop: Tuple[str, ...] = ()
    stop_token_ids: Tuple[int, ...] = ()
    logprobs: bool = False

    def __post_init__(self):
        self.max_tokens = positive_int("max_tokens", self.max_tokens)
        self.n = positive_int("n", self.n)
        if self.row_id is None:
            self.row_id = self.index
        self.stop = stop_strings(self.stop)
        self.stop_token_ids = stop_token_id_list(self.stop_token_ids)
        if not isinstance(self.sampling, SamplingParams):  # else the whole stream fails mid-decode
            raise TypeError(f"sampling must be a SamplingParams, got {self.sampling!r}")


@dataclass
class Completion:
    index: int
    sample_index: int = 0
    row_id: Any = None
    tokens: List[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" | "length" | "error"
    error: Optional[str] = None
    drafted_by_depth: List[int] = field(default_factory=list)
    accepted_by_depth: List[int] = field(default_factory=list)
    steps: int = 0
    prompt_tokens: int = 0
    logprobs: Optional[List[float]] = None
    shared_prefix_tokens: int = 0  # prompt tokens its prefill took from a shared prefix

    @property
    def acceptance_rate(self) -> Optional[float]:
        drafted = sum(self.drafted_by_depth)
        return sum(self.accepted_by_depth) / drafted if drafted else None

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """Tokens emitted by verify cycles per cycle (correction/bonus included)."""
        if not self.steps:
            return None
        return (self.steps + sum(self.accepted_by_depth)) / self.steps


def error_completion(req: Request, sample_index: int, message: str, prompt_tokens: int = 0) -> Completion:
    return Completion(
        index=req.index,
        sample_index=sample_index,
        row_id=req.row_id,
        finish_reason="error",
        error=message,
        prompt_tokens=prompt_tokens,
    )


def find_stop_string(tokenizer, tokens: List[int], stops: Sequence[str], checked: int):
    """First stop string in the decoded text, as (tokens to keep, text before it).
    `checked` tokens are known not to complete one, so a match spanning tokens
    or cycles is found at the token that completes it."""
    text = tokenizer.decode(tokens)
    if not any(s in text for s in stops):
        return None
    for m in range(max(checked, 1), len(tokens) + 1):
        prefix = tokenizer.decode(tokens[:m])
        hits = [prefix.find(s) for s in stops if s in prefix]
        if hits:
            return m, prefix[: min(hits)]
    return None
