"""The writer: finished rows -> `part-NNNNN.parquet`, each written under a
temporary name, fsynced and renamed, so a part is either whole or absent
whatever moment the process dies at."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, List, Optional

import pyarrow as pa

from .errors import JobError
from .outdir import part_name, write_table_atomic
from .signals import Stopper


class PartWriter:
    def __init__(
        self,
        out: Path,
        schema: pa.Schema,
        first_part: int,
        *,
        flush_rows: int,
        flush_seconds: float,
        stopper: Optional[Stopper] = None,
        clock: Callable[[], float] = time.monotonic,
        naming: Callable[[int], str] = part_name,
    ):
        self.out = out
        self.naming = naming  # part number -> file name
        self.schema = schema
        self.next_part = first_part
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.stopper = stopper or Stopper()
        self.clock = clock
        self.rows: List[dict] = []
        self.rows_written = 0
        self.parts_written: List[Path] = []
        self._last_flush = clock()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.flush_rows or self.clock() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        with self.stopper.critical():
            self._write_part()

    def flush_now(self) -> None:
        """Flush while a signal is being handled: hold any further one."""
        with self.stopper.shielded():
            self._write_part()

    def _write_part(self) -> None:
        self._last_flush = self.clock()
        if not self.rows:
            return
        table = pa.Table.from_pylist(self.rows, schema=self.schema)
        final = self.out / self.naming(self.next_part)
        try:
            write_table_atomic(table, final)
        except OSError as e:
            raise JobError(f"cannot write {final}: {e.strerror or e}") from None
        self.parts_written.append(final)
        self.rows_written += len(self.rows)
        self.next_part += 1
        self.rows = []
