"""Row keys: every output row is keyed by (id, template index, sample index).

Keys are kept as sorted uint64 arrays rather than Python sets so that resume
and the duplicate check cost 8 bytes a row (80 MB for 10 million rows).
Integer ids map to their key exactly; string ids through a 64-bit BLAKE2b
hash, verified exactly whenever two keys meet in the duplicate check.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import JobError

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

ROW_INDEX = "row_index"  # the key column when the input has no id column


def is_id_type(t: pa.DataType) -> bool:
    """Integers or strings, also dictionary-encoded (a pandas `category`)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def id_hashes(values: pa.Array) -> np.ndarray:
    """uint64 [N] for a non-null integer or string id array. A dictionary-
    encoded id hashes as its value: the key must not depend on the encoding
    (the output holds plain values, which resume hashes again)."""
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    t = values.type
    if pa.types.is_integer(t):
        if pa.types.is_unsigned_integer(t):
            return values.to_numpy(zero_copy_only=False).astype(np.uint64)
        return values.cast(pa.int64()).to_numpy(zero_copy_only=False).view(np.uint64)
    return np.fromiter((_hash_str(s) for s in values.to_pylist()), dtype=np.uint64, count=len(values))


def _hash_str(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    # SplitMix64 finaliser: a bijection on uint64, so distinct ids stay distinct.
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def row_keys(id_hash: np.ndarray, template_index, sample_index) -> np.ndarray:
    """uint64 key of (id, template, sample); arguments broadcast."""
    ts = np.asarray(template_index, dtype=np.uint64) << np.uint64(32) | np.asarray(sample_index, dtype=np.uint64)
    with np.errstate(over="ignore"):
        salt = _mix(ts * _GAMMA + _GAMMA)
    return _mix(np.asarray(id_hash, dtype=np.uint64) ^ salt)


class KeySet:
    """A sorted uint64 key array with vectorised membership."""

    def __init__(self, chunks: Iterable[np.ndarray] = ()):
        chunks = [np.asarray(c, dtype=np.uint64) for c in chunks]
        self.keys = np.sort(np.concatenate(chunks)) if chunks else np.zeros(0, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.keys)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        if not len(self.keys):
            return np.zeros(np.shape(keys), dtype=bool)
        i = np.searchsorted(self.keys, keys)
        return self.keys[np.minimum(i, len(self.keys) - 1)] == keys


def check_ids(make_batches: Callable[[], Iterable[pa.RecordBatch]], column: str, label: str) -> int:
    """Reject null, mistyped and duplicate ids (one pass over the id column
    only, a second one to name a duplicate); returns the row count."""
    hashes: List[np.ndarray] = []
    seen = 0
    for batch in make_batches():
        values = batch.column(0)
        if not is_id_type(values.type):
            raise JobError(f"id column {column!r} must hold integers or strings, not {values.type}")
        nulls = values.null_count
        if nulls:
            first = seen + pc.index(pc.is_null(values), True).as_py()
            raise JobError(
                f"id column {column!r} of {label} has null ids (first at row {first}); every row needs an id"
            )
        hashes.append(id_hashes(values))
        seen += len(values)
    keys = np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    dup = np.nonzero(sorted_keys[1:] == sorted_keys[:-1])[0]
    if len(dup):
        rows = sorted(order[[dup[0], dup[0] + 1]].tolist())
        values = [id_value_at(make_batches(), r) for r in rows]
        what = (
            f"id {values[0]!r}"
            if values[0] == values[1]
            else f"ids {values[0]!r} and {values[1]!r} (64-bit key collision)"
        )
        raise JobError(
            f"duplicate ids in column {column!r} of {label}: rows {rows[0]} and {rows[1]} share {what} "
            f"({len(dup)} repeat{'s' if len(dup) > 1 else ''} in all); ids must be unique because output rows "
            "and resume are keyed by them (leave [input] id_column unset, or pass --id-column '', "
            "to key rows by row index)"
        )
    return seen


def id_value_at(batches: Iterable[pa.RecordBatch], row: int) -> Optional[object]:
    """The id at a global row number."""
    seen = 0
    for batch in batches:
        if row < seen + len(batch):
            return batch.column(0)[row - seen].as_py()
        seen += len(batch)
    return None
