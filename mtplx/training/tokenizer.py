"""A byte-level BPE for the default model, trained in Qwen3.5's own pipeline (NFC, the Qwen split regex,
byte-level): transformers rebuilds any `qwen3_5` tokenizer with it, so `tokenizers` and mlx-lm agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import numpy as np

from mtplx.models.tokenizer_files import EOS, configure_qwen_pipeline, write_tokenizer_config


def train_bpe(texts: Sequence[str], vocab_size: int):
    """A `tokenizers.Tokenizer`: EOS at id 0, the 256 byte symbols, then merges from `texts` up to `vocab_size`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ValueError("vocab_size must cover EOS + 256 bytes + at least one merge (>= 258)")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    configure_qwen_pipeline(tok)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    write_tokenizer_config(path)


def encode_documents(tok, texts: Sequence[str]) -> np.ndarray:
    """All documents as one int32 stream, each followed by EOS (id 0)."""
    eos = tok.token_to_id(EOS)
    parts: List[np.ndarray] = []
    for enc in tok.encode_batch(list(texts)):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def check_round_trip(path: Path, samples: Sequence[str]) -> dict:
    """mlx-lm's tokenizer must give the `tokenizers` file's ids, and decoding must give the text back."""
    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    wrapped = load_tokenizer(path)
    for text in samples:
        ids = raw.encode(text).ids
        theirs = wrapped.encode(text)
        if list(theirs) != ids:
            raise AssertionError(f"mlx-lm and tokenizers disagree on {text[:60]!r}")
        if raw.decode(ids) != text or wrapped.decode(ids) != text:
            raise AssertionError(f"decode does not round-trip {text[:60]!r}")
    return {"samples": len(samples), "chars": sum(len(s) for s in samples)}
