"""Regenerate the sample prompt sets in jobs/data/ from the held-out stdlib modules.

    python jobs/make_data.py [--out jobs/data]

prompts.parquet: id, module, prompt (a function's decorators, signature and
    docstring), reference (its real body). The modules are the ones the default
    model never saw in training (mtplx.training.corpus.HELD_OUT_MODULES).
topics.parquet: id, module, function, signature, summary (the docstring's
    first line): fields for a prompt template in synthetic-data jobs.
fewshot.parquet: id, module, shots, prompt, reference: short held-out prompts
    (not among the worked examples), each behind `shots`, one block of about
    FEWSHOT_TOKENS tokens of worked examples (prompt and body), the same in
    every row (stored once: Parquet's dictionary encoding).

Deterministic for a given Python version: rows are sorted by id and the
selection is an evenly spaced subset.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mtplx.training.corpus import held_out_examples, split_corpus, stdlib_sources

MAX_PROMPTS = 128
MAX_TOPICS = 64
FEWSHOT_TOKENS = 1500  # the shared block of worked examples, in the built-in model's tokens
FEWSHOT_QUESTIONS = 64
MAX_QUESTION_CHARS = 240  # "short" held-out prompts
MAX_SHOT_BODY_LINES = 8  # worked examples with short bodies: more of them fit the block


def evenly_spaced(rows: list, n: int) -> list:
    if len(rows) <= n:
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]


def build(out: Path) -> dict:
    _, held = split_corpus(stdlib_sources())
    examples = held_out_examples(held)
    prompts = evenly_spaced(examples, MAX_PROMPTS)
    topics = evenly_spaced([e for e in examples if e.summary], MAX_TOPICS)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table(
            {
                "id": [e.id for e in prompts],
                "module": [e.module for e in prompts],
                "prompt": [e.prompt for e in prompts],
                "reference": [e.reference for e in prompts],
            }
        ),
        out / "prompts.parquet",
    )
    pq.write_table(
        pa.table(
            {
                "id": [e.id for e in topics],
                "module": [e.module for e in topics],
                "function": [e.name for e in topics],
                "signature": [e.signature.rstrip("\n") for e in topics],
                "summary": [e.summary for e in topics],
            }
        ),
        out / "topics.parquet",
    )
    fewshot = fewshot_rows(examples)
    pq.write_table(pa.table(fewshot), out / "fewshot.parquet", use_dictionary=["shots"])
    return {"prompts": len(prompts), "topics": len(topics), "fewshot": len(fewshot["id"])}


def fewshot_rows(examples: list) -> dict:
    """Worked examples (evenly spaced, short bodies) until the block reaches
    FEWSHOT_TOKENS, then the short prompts left, evenly spaced."""
    count = _token_counter()
    shots, tokens, used = [], 0, set()
    for e in evenly_spaced([e for e in examples if e.reference.count("\n") <= MAX_SHOT_BODY_LINES], 400):
        if tokens >= FEWSHOT_TOKENS:
            break
        text = e.prompt + e.reference + "\n"
        shots.append(text)
        tokens += count(text)
        used.add(e.id)
    block = "".join(shots)
    questions = evenly_spaced(
        [e for e in examples if e.id not in used and len(e.prompt) <= MAX_QUESTION_CHARS], FEWSHOT_QUESTIONS
    )
    return {
        "id": [e.id for e in questions],
        "module": [e.module for e in questions],
        "shots": [block] * len(questions),
        "prompt": [e.prompt for e in questions],
        "reference": [e.reference for e in questions],
    }


def _token_counter():
    """Tokens of a text under the built-in model's tokenizer."""
    from tokenizers import Tokenizer

    from mtplx import default_model_path

    tok = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    args = p.parse_args(argv)
    counts = build(args.out)
    print(
        f"wrote {counts['prompts']} prompts, {counts['topics']} topics "
        f"and {counts['fewshot']} few-shot rows to {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
