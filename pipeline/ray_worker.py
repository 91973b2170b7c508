"""The Ray engine's worker: one per machine, it loads the model once and then
decodes whole shards of prompt rows with the runtime's continuous batching,
writing them through MTPLX's own writer as `part-sSSSSS-KKKKK.parquet`.

A plain class that never imports Ray: `ray_engine` wraps it with
`ray.remote`, and tests can drive it directly.

A shard may be attempted more than once (its actor died). Each attempt first
reads the keys of the shard's own parts and skips those rows, then numbers its
parts after them, so a retry finishes the shard without duplicating a row.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

import numpy as np
import pyarrow as pa

from .engine import ModelRef, model_fingerprint, open_engine
from .errors import JobError
from .ids import KeySet, id_hashes, row_keys
from .outdir import LOCK, next_shard_part, remove_shard_temp_files, scan_keys, shard_part_files, shard_part_name
from .plan import Plan
from .reader import PromptRow
from .spec import JobSpec
from .streaming import stream_rows
from .summary import peak_memory
from .writer import PartWriter

# Runtime counters that add up across shards and actors.
SUMMABLE_STATS = (
    "prefill_tokens",
    "shared_prefix_tokens",
    "decode_tokens",
    "prefill_seconds",
    "decode_seconds",
    "cycles",
)


@dataclass
class ShardTally:
    """What `runner.stream_rows` reports per row, counted for one shard."""

    rows: int = 0
    errors: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    shared_prefix_tokens: int = 0

    def row(
        self, tokens: int, drafted: int, accepted: int, error: bool, prompt_tokens: int = 0, shared: int = 0
    ) -> None:
        self.rows += 1
        self.prompt_tokens += prompt_tokens
        self.shared_prefix_tokens += shared
        self.errors += int(error)
        self.tokens += tokens
        self.drafted += drafted
        self.accepted += accepted


@dataclass
class ShardReport:
    shard: int
    node: str
    tally: ShardTally  # rows this attempt wrote
    skipped: int  # rows an earlier attempt at this shard had written
    stats: dict = field(default_factory=dict)  # runtime counters spent on the shard
    peak_memory: dict = field(default_factory=dict)  # the actor's, so far


class ShardWorker:
    def __init__(self, ref: ModelRef, spec: JobSpec, plan: Plan, out: str, sampled_depth: Optional[int] = None):
        self.node = socket.gethostname()
        self.plan = plan
        self.spec = spec
        self.out = Path(out)
        self.engine = None
        self.error = None  # a bad job seen on this node; reported by ready()
        try:
            self._check_node(ref)
            given = {} if sampled_depth is None else {"sampled_depth": sampled_depth}  # depth auto: the job's
            self.engine = open_engine(ref, spec, spec.batch.max_memory, **given)
        except JobError as e:
            self.error = f"on node {self.node}: {e}"

    def _check_node(self, ref: ModelRef) -> None:
        """The model and the output directory must be this node's too."""
        if not (ref.path / "config.json").is_file():
            raise JobError(f"model {ref.path} is not there; every node needs the checkpoint at the same path")
        if model_fingerprint(ref.path) != ref.fingerprint:
            raise JobError(f"model {ref.path} differs from the driver's (its fingerprint does not match)")
        if not (self.out / LOCK).is_file():  # the driver holds it from before any actor starts
            raise JobError(
                f"output directory {self.out} has no {LOCK} here: it must be a path every node shares (see docs/ray.md)"
            )

    def ready(self) -> dict:
        plan = self.engine.stats.get("auto_depth", {}) if self.engine else {}
        return {
            "node": self.node,
            "error": self.error,
            "settings": self.engine.settings if self.engine else {},
            "sampled_depth": plan.get("depth"),
        }

    def run_shard(self, shard: int, rows: List[PromptRow]) -> ShardReport:
        if self.error:
            raise JobError(self.error)
        remove_shard_temp_files(self.out, shard)
        earlier = shard_part_files(self.out, shard)
        done, skipped = scan_keys(earlier, self.plan)
        writer = PartWriter(
            self.out,
            self.plan.schema,
            next_shard_part(earlier),
            flush_rows=self.spec.output.flush_rows,
            flush_seconds=self.spec.output.flush_seconds,
            naming=partial(shard_part_name, shard),
        )
        tally = ShardTally()
        before = dict(self.engine.stats)
        try:
            stream_rows(still_to_do(rows, self.plan, done), self.plan, self.engine, writer, tally)
            writer.flush()
        except BaseException:
            _flush_finished(writer)
            raise
        after = self.engine.stats
        stats = {k: after[k] - before.get(k, 0) for k in SUMMABLE_STATS if k in after}
        return ShardReport(shard, self.node, tally, skipped, stats, peak_memory())


def still_to_do(rows: Iterable[PromptRow], plan: Plan, done: KeySet) -> Iterator[PromptRow]:
    """The rows, less the samples `done` holds (as the reader skips them)."""
    if not len(done):
        yield from rows
        return
    samples = np.arange(plan.n, dtype=np.uint64)
    key_type = plan.schema.field(plan.key_column).type
    for r in rows:
        hashed = id_hashes(pa.array([r.id], type=key_type))  # [1]
        present = done.contains(row_keys(hashed[0], r.template_index, samples))  # [n]
        todo = tuple(s for s in r.todo if not present[s])
        if todo:
            r.todo = todo
            yield r


def _flush_finished(writer: PartWriter) -> None:
    """On a failure keep the rows already finished; the original error wins."""
    try:
        writer.flush_now()
    except Exception:
        pass
