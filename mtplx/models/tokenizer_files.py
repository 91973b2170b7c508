"""Small working tokenizers in the Hugging Face file layout, for tiny test checkpoints: `transformers`
(through mlx-lm) and MTPLX both open them, with ids that fit a vocabulary as small as 32."""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
# Most frequent characters first, so small vocabularies keep the useful ones.
_CHARS = " etaoinsrhldcumfpgwybvkxjqz_()=:.,'\"\n0123456789ETAOINSRHLDCUMFPGWYBVKXJQZ[]{}+-*/<>#!?@&%|\\^~`$;"

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


# Qwen3.5's split before byte-level BPE: transformers rebuilds qwen3_5 tokenizers with it, so ours use it too.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def configure_qwen_pipeline(tok) -> None:
    """Set the normaliser, pre-tokeniser and decoder of a Qwen-style BPE."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()


def _byte_level_alphabet() -> dict:
    # The printable stand-in for each byte that byte-level BPE uses.
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def write_char_tokenizer(path: Path, vocab_size: int) -> None:
    """A character-level byte-BPE (no merges): id 0 is EOS, then the commonest ASCII characters."""
    from tokenizers import Tokenizer, models

    if vocab_size < 4:
        raise ValueError("vocab_size must be at least 4")
    alphabet = _byte_level_alphabet()
    chars = _CHARS[: vocab_size - 1]
    vocab = {EOS: 0, **{alphabet[ord(c)]: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    configure_qwen_pipeline(tok)
    tok.add_special_tokens([EOS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    write_tokenizer_config(path)


def write_tokenizer_config(path: Path) -> None:
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "TokenizersBackend",
                "eos_token": EOS,
                "pad_token": EOS,
                "unk_token": None,
                "bos_token": None,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1 << 20,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": EOS}))
