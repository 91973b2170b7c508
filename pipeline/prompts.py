"""Turning an input row into prompt tokens: a prompt column, a chat
`messages` column (the tokenizer's chat template), or str.format templates over
columns. A row that cannot make a prompt gets an error message, never an
exception: the job goes on without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Union

from mtplx import encode_text

from .errors import JobError
from .spec import PromptSpec

Rendered = Union[str, List[dict]]


@dataclass
class BuiltPrompt:
    tokens: Optional[List[int]]
    text: Optional[str]  # the rendered template text (template mode), else None
    error: Optional[str]


class PromptEncoder:
    def __init__(self, spec: PromptSpec, tokenizer):
        self.spec = spec
        self.tokenizer = tokenizer
        self.uses_chat = bool(spec.messages or spec.chat_template)
        if self.uses_chat and not _has_chat_template(tokenizer):
            raise JobError("the model's tokenizer has no chat template; [prompt] messages / chat_template need one")

    def build(self, row: dict, template_index: int = 0) -> BuiltPrompt:
        rendered, error = self._render(row, template_index)
        text = rendered if self.spec.templates and error is None else None
        if error is not None:
            return BuiltPrompt(None, text, error)
        try:
            return BuiltPrompt(self._encode(rendered), text, None)
        except Exception as e:  # a tokenizer or chat-template failure on this row only
            return BuiltPrompt(None, text, f"cannot tokenize the prompt: {type(e).__name__}: {e}")

    def _render(self, row: dict, template_index: int):
        s = self.spec
        if s.column:
            return _check_text(row[s.column], "prompt")
        if s.messages:
            return _check_messages(row[s.messages])
        values = {}
        for name in _fields_of(s.templates[template_index]):
            if row[name] is None:
                return None, f"column {name!r} is null"
            values[name] = row[name]
        try:
            text = s.templates[template_index].format_map(values)
        except (
            ValueError,
            TypeError,
            KeyError,
            IndexError,
            AttributeError,
        ) as e:  # a format spec this row's values do not take
            return None, f"cannot render the template: {type(e).__name__}: {e}"
        return _check_text(text, "rendered template")

    def _encode(self, rendered: Rendered) -> List[int]:
        tok = self.tokenizer
        if self.uses_chat:
            messages = rendered if isinstance(rendered, list) else [{"role": "user", "content": rendered}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok.encode(text, add_special_tokens=False))
        return encode_text(tok, rendered)


def _has_chat_template(tokenizer) -> bool:
    flag = getattr(tokenizer, "has_chat_template", None)
    if flag is not None:
        return bool(flag)
    return getattr(tokenizer, "chat_template", None) is not None


_FIELDS_CACHE: dict = {}


def _fields_of(template: str):
    if template not in _FIELDS_CACHE:
        from .spec import template_fields

        _FIELDS_CACHE[template] = template_fields("template", template)
    return _FIELDS_CACHE[template]


def _check_text(v: Any, what: str):
    if v is None:
        return None, f"{what} is null"
    if not isinstance(v, str):
        return None, f"{what} is not a string (got {type(v).__name__})"
    if not v:
        return None, f"{what} is empty"
    return v, None


def _check_messages(v: Any):
    bad = "messages must be a non-empty list of {role, content} objects with string values"
    if v is None:
        return None, "messages is null"
    if not isinstance(v, list) or not v:
        return None, bad
    out = []
    for m in v:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None, bad
        out.append({"role": m["role"], "content": m["content"]})
    return out, None
