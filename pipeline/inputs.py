"""Input sources: Parquet files (a file, a directory or a glob) or a `datasets`
dataset, streamed as pyarrow record batches so memory never holds the input
whole. Every failure names the file it came from."""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import JobError
from .spec import InputSpec

_GLOB_CHARS = set("*?[")


@dataclass
class InputSource:
    label: str  # how messages name the input
    schema: pa.Schema
    num_rows: int
    fingerprint: dict  # identifies the content for the spec hash
    files: List[Path] = field(default_factory=list)  # Parquet inputs
    file_schemas: List[pa.Schema] = field(default_factory=list)
    dataset: object = None  # a datasets.Dataset instead of files
    # Its strings must be valid UTF-8: a bad id cannot key a row, so it fails
    # the job as it is read, naming the file (a bad prompt is a row error).
    id_column: Optional[str] = None

    def column_names(self) -> List[str]:
        return list(self.schema.names)

    def check_columns(self, columns: Sequence[str]) -> None:
        """Every file has these columns, with the first file's types
        (dictionary encoding aside: it is how a file stores values, not what
        they are, and each writer picks its own index width)."""
        for f, schema in zip(self.files, self.file_schemas):
            for c in columns:
                i = schema.get_field_index(c)
                if i < 0:
                    raise JobError(f"Parquet file {f} has no column {c!r} (columns: {', '.join(schema.names)})")
                if not _agrees(schema.field(i).type, self.schema.field(c).type):
                    raise JobError(
                        f"column {c!r} is {schema.field(i).type} in {f} but {self.schema.field(c).type} "
                        f"in {self.files[_typed_by(self.file_schemas, c)]}; all input files must agree"
                    )

    def iter_batches(self, columns: Sequence[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
        """Record batches of just `columns`, in a fixed order. Columns keep
        their stored encoding (dictionary arrays stay dictionary arrays)."""
        strict = self.id_column if self.id_column in columns else None
        if self.dataset is not None:
            yield from _checked(_dataset_batches(self.dataset, columns, batch_rows), strict, self.label)
            return
        for f in self.files:
            batches = (_typed_as(b, self.schema) for b in _file_batches(f, columns, batch_rows))
            yield from _checked(batches, strict, str(f))


def open_input(spec: InputSpec, *, exclude: Optional[Path] = None) -> InputSource:
    """`exclude`: a directory whose files are never input (the job's output
    directory, which may lie inside an input directory)."""
    if spec.dataset is not None:
        return _open_dataset(spec)
    files = parquet_files(spec.path, exclude=exclude)
    schemas, rows, prints = [], 0, []
    root = _common_root(files)
    for f in files:
        meta, file_schema = _read_footer(f)
        schemas.append(file_schema)
        rows += meta.num_rows
        prints.append(_file_fingerprint(f, root, meta.num_rows))
    return InputSource(
        label=spec.path,
        schema=_reference_schema(schemas),
        num_rows=rows,
        files=files,
        file_schemas=schemas,
        fingerprint={"kind": "parquet", "files": prints},
        id_column=spec.id_column,
    )


def _reference_schema(schemas: List[pa.Schema]) -> pa.Schema:
    """The first file's schema, decoded, except that a column of null type
    there (pandas writes an empty file's string column so) takes its type
    from the first file that has one."""
    fields = []
    for f in decoded_schema(schemas[0]):
        if pa.types.is_null(f.type):
            i = _typed_by(schemas, f.name)
            f = f.with_type(value_type(schemas[i].field(f.name).type))
        fields.append(f)
    return pa.schema(fields, metadata=schemas[0].metadata)


def _typed_by(schemas: List[pa.Schema], name: str) -> int:
    """Index of the first schema whose column `name` has a type other than null (else 0)."""
    for i, schema in enumerate(schemas):
        j = schema.get_field_index(name)
        if j >= 0 and not pa.types.is_null(schema.field(j).type):
            return i
    return 0


def _agrees(file_type: pa.DataType, reference: pa.DataType) -> bool:
    """A file's column can be read as the reference type: the same values
    (dictionary encoding aside), or all null."""
    return value_type(file_type) == reference or pa.types.is_null(file_type)


def _typed_as(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """`batch` with its null-typed columns as the reference schema's nulls."""
    if not any(pa.types.is_null(t) for t in batch.schema.types):
        return batch
    columns = [
        pa.nulls(len(c), schema.field(name).type) if pa.types.is_null(c.type) else c
        for name, c in zip(batch.schema.names, batch.columns)
    ]
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def decoded_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` with dictionary-encoded columns as their value type: what the
    rows hold, so that the output (and the keys of the rows) do not depend on
    how the input happened to be encoded (a pandas `category` column)."""
    return pa.schema([f.with_type(value_type(f.type)) for f in schema], metadata=schema.metadata)


def value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def parquet_files(pattern: str, *, exclude: Optional[Path] = None) -> List[Path]:
    p = Path(pattern)
    skip = Path(exclude).resolve() if exclude is not None else None
    if any(c in pattern for c in _GLOB_CHARS) and not p.exists():
        files = [Path(f) for f in sorted(glob.glob(pattern, recursive=True)) if Path(f).is_file()]
    elif p.is_dir():
        if skip is not None and _inside(p, skip):  # the job's parts would come back as input on every rerun
            what = "is" if p.resolve() == skip else "contains"
            raise JobError(
                f"the output directory {exclude} {what} the input {pattern}; pick an output directory outside it"
            )
        files = sorted(f for f in p.rglob("*.parquet") if f.is_file() and not _hidden(f, p))
    elif p.is_file():  # one file cannot pick up the parts, wherever the output lies
        return [p]
    else:
        raise JobError(f"input not found: {pattern}")
    found = bool(files)
    if skip is not None:
        files = [f for f in files if not _inside(f, skip)]
    if not files:
        where = f" outside the output directory {exclude}" if found else ""
        raise JobError(f"no Parquet files in input {pattern}{where}")
    return files


def _inside(f: Path, root: Path) -> bool:
    """`f` is `root` or below it (`root` resolved); symlinks followed."""
    return f.resolve().is_relative_to(root)


def _hidden(f: Path, root: Path) -> bool:
    return any(part.startswith((".", "_")) for part in f.relative_to(root).parts)


def _read_footer(f: Path):
    try:
        meta = pq.read_metadata(f)
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException, ValueError) as e:
        raise JobError(f"corrupt or unreadable Parquet file {f}: {_first_line(e)}") from None
    return meta, schema


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in line)


def _common_root(files: List[Path]) -> Path:
    if len(files) == 1:
        return files[0].parent
    return Path(os.path.commonpath([str(f.resolve()) for f in files]))


def _file_fingerprint(f: Path, root: Path, num_rows: int) -> list:
    """Relative name, size, rows and a hash of the footer (which holds every
    column chunk's offsets and statistics): changes when the content does."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        fh.seek(max(0, size - 8))
        tail = fh.read(8)
        footer_len = int.from_bytes(tail[:4], "little")
        fh.seek(max(0, size - 8 - footer_len))
        footer = fh.read(footer_len)
    try:
        name = str(f.resolve().relative_to(root))
    except ValueError:
        name = f.name
    return [name, size, num_rows, hashlib.sha256(footer).hexdigest()[:16]]


def _file_batches(f: Path, columns: Sequence[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    try:
        pf = pq.ParquetFile(f)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise JobError(f"corrupt or unreadable Parquet file {f}: {_first_line(e)}") from None
    try:
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise JobError(
                f"Parquet file {f} has no column {missing[0]!r} (columns: {', '.join(pf.schema_arrow.names)})"
            )
        it = pf.iter_batches(batch_size=batch_rows, columns=list(columns))
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except (OSError, pa.ArrowException, ValueError) as e:
                raise JobError(f"corrupt Parquet file {f}: {_first_line(e)}") from None
            yield batch
    finally:
        pf.close()


# ------------------------------------------------------------------ datasets


def _open_dataset(spec: InputSpec) -> InputSource:
    try:
        import datasets
    except ImportError:
        raise JobError("[input] dataset needs the `datasets` package (pip install datasets)") from None
    name = spec.dataset
    try:
        if _saved_to_disk(Path(name)):
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                if spec.split not in ds:
                    raise JobError(f"dataset {name} has no split {spec.split!r} (splits: {', '.join(ds)})")
                ds = ds[spec.split]
        else:
            ds = datasets.load_dataset(name, spec.dataset_config, split=spec.split)
    except JobError:
        raise
    except Exception as e:  # datasets raises many unrelated types
        raise JobError(f"cannot load dataset {name!r}: {_first_line(e)}") from None
    fingerprint = {"kind": "datasets", "fingerprint": getattr(ds, "_fingerprint", None), "rows": ds.num_rows}
    return InputSource(
        label=name,
        schema=decoded_schema(ds.data.schema),
        num_rows=ds.num_rows,
        fingerprint=fingerprint,
        dataset=ds,
        id_column=spec.id_column,
    )


def _saved_to_disk(p: Path) -> bool:
    """A directory written by Dataset(Dict).save_to_disk, not a hub-style repo."""
    return (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()


def _dataset_batches(ds, columns: Sequence[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    # Arrow-formatted iteration respects index mappings (select/shuffle) and
    # reads from the memory-mapped cache a batch at a time.
    view = ds.select_columns(list(columns)).with_format("arrow")
    for table in view.iter(batch_size=batch_rows):
        for batch in table.to_batches():
            yield batch


def _checked(batches: Iterator[pa.RecordBatch], id_column: Optional[str], where: str) -> Iterator[pa.RecordBatch]:
    """`batches`, refusing an id that is not valid UTF-8 (row numbers count
    from 0 in `where`)."""
    seen = 0
    for batch in batches:
        if id_column is not None:
            bad = first_invalid_text(batch.column(id_column))
            if bad is not None:
                raise JobError(
                    f"id column {id_column!r} of {where} holds an id that is not valid UTF-8 "
                    f"(row {seen + bad}); fix the input, or leave [input] id_column unset (--id-column '') "
                    "to key rows by row index"
                )
        seen += batch.num_rows
        yield batch


def first_invalid_text(values: pa.Array) -> Optional[int]:
    """Index of the first string that is not valid UTF-8, or None."""
    t = value_type(values.type)
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return None
    try:
        values.validate(full=True)  # checks every string's UTF-8 in C++
        return None
    except pa.ArrowInvalid:
        pass
    for i in range(len(values)):  # only on failure: find which one
        try:
            values[i].as_py()
        except UnicodeDecodeError:
            return i
    return None
