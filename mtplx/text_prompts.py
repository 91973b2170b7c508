"""A str prompt as token ids, the way mlx-lm's `generate` encodes one: the
tokenizer's special tokens (its BOS) are added unless the text already
starts with the BOS text, as a chat-templated prompt does. Encoded with
them, such a prompt started with two BOS tokens and decoded differently."""

from __future__ import annotations

from typing import List


def encode_text(tokenizer, text: str) -> List[int]:
    bos = getattr(tokenizer, "bos_token", None)
    add = not (isinstance(bos, str) and bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add))
