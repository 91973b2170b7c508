"""Checks of what callers hand `BatchRuntime.generate` and `Request`, so a
mistake fails early with a clear message rather than deep in the decode
loop or silently (a lone string read as one prompt per character)."""

from __future__ import annotations

import math
import numbers
from collections import abc
from typing import List, Optional, Tuple


class PromptError(ValueError):
    """A prompt the runtime cannot decode; its row ends with an error."""


def positive_int(name: str, v) -> int:
    # Integral covers numpy ints; bool and float are mistakes.
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= 1, got {v!r}")
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return int(v)


def stop_strings(stop) -> Tuple[str, ...]:
    """`stop` as a tuple of strings. A lone string is one stop string, as in
    vLLM, not its characters; an empty one would match before any text."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)  # any iterable, an array too
    for s in stops:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {s!r}")
        if not s:
            raise ValueError('stop strings must not be empty ("" matches before any text)')
    return stops


def stop_token_id_list(ids) -> Tuple[int, ...]:
    """`stop_token_ids` as a tuple of ints; a lone int is one id."""
    ids = () if ids is None else (ids,) if isinstance(ids, numbers.Number) else tuple(ids)
    return tuple(_whole(t, "stop_token_ids must be integer token ids") for t in ids)


def _whole(v, message: str) -> int:
    n = whole_number(v)
    if n is None:
        raise TypeError(f"{message}, got {v!r}")
    return n


def whole_number(v) -> Optional[int]:
    """v as an int when it is an int, a numpy int or a whole float, else None (bool too)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    return None


def seed_value(seed) -> int:
    """A job seed: an integer that fits the 64-bit key word (else it would be silently truncated)."""
    if seed is None:
        return 0
    seed = _whole(seed, "seed must be an integer")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must fit in 64 bits, got {seed}")
    return int(seed)


def prompt_list(prompts) -> list:
    """`prompts` as a list, each a string or a sequence (a lone string or id list is refused)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, abc.Iterable):
        raise TypeError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
    prompts = list(prompts)
    for i, p in enumerate(prompts):
        if isinstance(p, bytes) or not isinstance(p, abc.Iterable):
            raise TypeError(
                f"prompts must be a list of strings or of token-id lists; prompts[{i}] is "
                f"{type(p).__name__} {_short_repr(p)} (wrap one prompt's ids as [ids])"
            )
    return prompts


def row_id_list(row_ids, count: int) -> Optional[list]:
    # A length mismatch would otherwise be an IndexError, or ids silently unused.
    if row_ids is None:
        return None
    if isinstance(row_ids, (str, bytes)) or not isinstance(row_ids, abc.Iterable):
        raise TypeError(f"row_ids must be a list with one id per prompt, got {type(row_ids).__name__}")
    row_ids = list(row_ids)
    if len(row_ids) != count:
        raise ValueError(f"row_ids must have one id per prompt: {len(row_ids)} ids for {count} prompts")
    return row_ids


def token_ids(prompt) -> List[int]:
    """A prompt's token ids as ints; a non-integer id is that row's PromptError."""
    if isinstance(prompt, bytes) or not isinstance(prompt, abc.Iterable):
        raise PromptError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if hasattr(prompt, "as_py"):  # a pyarrow list scalar
        prompt = prompt.as_py()
    if hasattr(prompt, "tolist"):  # numpy / mlx / pyarrow arrays: Python scalars, checked below
        prompt = prompt.tolist()
        if not isinstance(prompt, list):
            raise PromptError(f"prompt must be a list of token ids, got the scalar {prompt!r}")
    return [token_id(t, i) for i, t in enumerate(prompt)]


def token_id(t, i: int) -> int:
    if type(t) is int:  # the common case, kept cheap for long prompts
        return t
    if hasattr(t, "as_py"):  # a pyarrow scalar
        t = t.as_py()
    n = whole_number(t)
    if n is None:
        raise PromptError(f"prompt token ids must be integers; position {i} is {_short_repr(t)}")
    return n


def _short_repr(v, limit: int = 60) -> str:
    # The value goes into an error message (and an output row): keep it a line.
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def valid_text(prompt: str) -> str:
    """A str prompt the tokenizer can take: a lone surrogate (not UTF-8) makes
    tokenizers raise a TypeError that would end the whole call, not the row."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"prompt is not valid Unicode: {e.reason} at character {e.start}") from None
    return prompt
