"""Regenerate the sample prompt sets in jobs/data/ from the held-out stdlib modules.

    python jobs/make_data.py [--out jobs/data]

prompts.parquet: id, module, prompt (a function's decorators, signature and
    docstring), reference (its real body). The modules are the ones the default
    model never saw in training (mtplx.training.corpus.HELD_OUT_MODULES).
topics.parquet: id, module, function, signature, summary (the docstring's
    first line): fields for a prompt template in synthetic-data jobs.

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
    return {"prompts": len(prompts), "topics": len(topics)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    args = p.parse_args(argv)
    counts = build(args.out)
    print(f"wrote {counts['prompts']} prompts and {counts['topics']} topics to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
