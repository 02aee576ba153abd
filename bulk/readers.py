"""Input files to rows: JSON Lines, CSV, Parquet or plain text lines, in the order given.

Each row becomes a ``Row`` (its number among every row of every input, its id, its text) or,
when it cannot be used, a ``Reject`` naming its file, its line and why. A wrong field name
for a whole file (a CSV header or a Parquet schema without it) is a ``ReaderError``, not a
reject per row.
"""

from __future__ import annotations

import csv
import glob
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

FORMATS = ("jsonl", "csv", "tsv", "parquet", "text")
_BY_SUFFIX = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".csv": "csv", ".tsv": "tsv",
    ".parquet": "parquet", ".pq": "parquet",
    ".txt": "text", ".text": "text",
}  # fmt: skip
PARQUET_BATCH_ROWS = 4096
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The ids a part's int64 column can hold."""
# Python's csv module refuses a field over 128 KiB by default, where JSON Lines and text
# inputs are truncated at --max-input-tokens: a long CSV passage is truncated the same way.
# The limit is the process's (every thread's reader shares it), so it is raised once, never
# set and restored around one reader; 2**31 - 1 is the largest a C long holds everywhere.
CSV_FIELD_LIMIT = 2**31 - 1


class ReaderError(Exception):
    """The inputs cannot be read at all: no such file, an unknown format, a missing column."""


@dataclass(frozen=True, slots=True)
class Fields:
    """Which fields of a row hold what. ``id`` None: the id is the row number."""

    text: str = "text"
    id: str | None = None
    query: str | None = None
    """Set for pairs (reranking): the row's query; ``text`` is then its document."""

    def names(self) -> list[str]:
        return [name for name in (self.text, self.id, self.query) if name is not None]


@dataclass(frozen=True, slots=True)
class Row:
    number: int
    """0-based, counted over every input in order, bad rows included."""
    id: Any
    text: str
    query: str | None = None
    file: str = ""
    line: int = 0


@dataclass(frozen=True, slots=True)
class Reject:
    number: int
    file: str
    line: int
    """1-based: the line of a text, JSON Lines or CSV file, the row of a Parquet file."""
    reason: str

    def record(self) -> dict[str, Any]:
        return {"row": self.number, "file": self.file, "line": self.line, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class InputFile:
    path: str
    format: str
    size_bytes: int


def expand_inputs(
    patterns: Sequence[str], input_format: str | None = None, *, exclude: str | None = None
) -> list[InputFile]:
    """Files named or matched by ``patterns`` (globs, ``**`` included), each glob's matches
    sorted, in the order given; each file's format from ``input_format`` or its suffix.
    ``exclude``: a folder (the job's ``--out``) whose files no glob matches: a glob that
    covers it would otherwise take the job's own ``rejects.jsonl`` and ``manifest.json`` for
    inputs on the rerun, and refuse to resume because the inputs changed."""
    if input_format is not None and input_format not in FORMATS:
        raise ReaderError(f"unknown input format {input_format!r}; expected one of {FORMATS}")
    excluded = Path(exclude).resolve() if exclude is not None else None
    files: list[InputFile] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(
                p
                for p in glob.glob(pattern, recursive=True)
                if Path(p).is_file()
                and (excluded is None or not Path(p).resolve().is_relative_to(excluded))
            )
            if not matches:
                outside = "" if excluded is None else f" outside {exclude}"
                raise ReaderError(f"no file{outside} matches {pattern!r}")
        else:
            if not Path(pattern).is_file():
                raise ReaderError(f"no such file: {pattern}")
            matches = [pattern]
        for match in matches:
            path = str(Path(match).resolve())
            files.append(InputFile(path, input_format or _format_of(path), os.path.getsize(path)))
    if not files:
        raise ReaderError("no input files given")
    if len({f.path for f in files}) != len(files):
        raise ReaderError("an input file is named twice")
    return files


def _format_of(path: str) -> str:
    found = _BY_SUFFIX.get(Path(path).suffix.lower())
    if found is None:
        raise ReaderError(
            f"cannot tell the format of {path} from its name; give --input-format "
            f"({', '.join(FORMATS)})"
        )
    return found


def read_rows(files: Sequence[InputFile], fields: Fields) -> Iterator[Row | Reject]:
    """Every row of ``files`` in order, numbered from 0 across them."""
    number = 0
    for file in files:
        for line, values, reason in _records(file, fields):
            if reason is None:
                reason = row_problem(values, fields)
            if reason is not None:
                yield Reject(number, file.path, line, reason)
            else:
                identifier = number if fields.id is None else values[fields.id]
                query = values[fields.query] if fields.query is not None else None
                yield Row(number, identifier, values[fields.text], query, file.path, line)
            number += 1


def count_rows(files: Sequence[InputFile]) -> int:
    """How many rows ``read_rows`` will yield (for CSV, lines less the header: quoted
    newlines make it an estimate)."""
    total = 0
    for file in files:
        if file.format == "parquet":
            total += _parquet_file(file.path).metadata.num_rows
        else:
            total += max(0, _count_lines(file.path) - (file.format in ("csv", "tsv")))
    return total


def _count_lines(path: str) -> int:
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def row_problem(values: dict[str, Any], fields: Fields) -> str | None:
    """Why a row's values cannot be used (a missing field, empty text...), or None."""
    for name in fields.names():
        value = values.get(name)
        if value is None:
            return f"missing field {name!r}"
        if name == fields.id:
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                return f"id field {name!r} is neither a string nor an integer"
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                return f"id {value} in field {name!r} is outside the 64-bit integer range"
            if value == "":
                return f"empty id in field {name!r}"
        elif not isinstance(value, str):
            return f"field {name!r} is not a string ({type(value).__name__})"
        elif not value:
            return f"empty text in field {name!r}"
    return None


Record = tuple[int, dict[str, Any], str | None]
"""(line, values, reason the row cannot be read or None)."""


def _records(file: InputFile, fields: Fields) -> Iterator[Record]:
    if file.format == "jsonl":
        return _jsonl(file.path)
    if file.format == "text":
        return _text(file.path, fields)
    if file.format == "parquet":
        return _parquet(file.path, fields)
    return _csv(file.path, fields, file.format)


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            yield number, raw.rstrip(b"\r\n")


def _jsonl(path: str) -> Iterator[Record]:
    for number, raw in _lines(path):
        if not raw.strip():
            yield number, {}, "empty line"
            continue
        try:
            values = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            yield number, {}, f"undecodable line: {exc}"
            continue
        if not isinstance(values, dict):
            yield number, {}, f"not a JSON object ({type(values).__name__})"
            continue
        yield number, values, None


def _text(path: str, fields: Fields) -> Iterator[Record]:
    for number, raw in _lines(path):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield number, {}, f"undecodable line: {exc}"
            continue
        yield number, {fields.text: text}, None


def _csv(path: str, fields: Fields, input_format: str) -> Iterator[Record]:
    start: int | None = None  # the first line of the record being read
    undecodable: str | None = None  # why the record being read cannot be used, if it cannot

    def decoded() -> Iterator[str]:
        nonlocal start, undecodable
        for number, raw in _lines(path):
            if start is None:
                start = number
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                # NOTE: the line still goes to the parser (its bad bytes replaced, which never
                # makes a quote, a separator or a newline), so that a bad line inside a quoted
                # field stays inside its record: dropped, it once cut the record short and
                # moved every later row number. The whole record is rejected instead.
                if undecodable is None:
                    where = "" if number == start else f" {number}"
                    undecodable = f"undecodable line{where}: {exc}"
                text = raw.decode("utf-8", errors="replace")
            yield text + "\n"

    # NOTE: csv.reader pulls one line at a time and never reads ahead of the record it
    # returns, so ``start`` is the line its record began on.
    reader = _csv_reader(decoded(), input_format)
    header = next(reader, None)
    if header is None:
        return
    _check_columns(path, fields, header)
    while True:
        start, undecodable = None, None
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            yield start or 0, {}, f"undecodable line: {exc}"
            continue
        if undecodable is not None:
            yield start or 0, {}, undecodable
        elif not record:
            yield start or 0, {}, "empty line"
        else:
            yield start or 0, dict(zip(header, record, strict=False)), None


def _csv_reader(lines: Iterable[str], input_format: str) -> Iterator[list[str]]:
    if csv.field_size_limit() < CSV_FIELD_LIMIT:
        csv.field_size_limit(CSV_FIELD_LIMIT)
    if input_format == "tsv":
        # TSV has no quoting convention: a field is everything between two tabs, quotes
        # included, and cannot hold a tab or a newline. With CSV's quoting, a passage that
        # began with a quote swallowed the rows after it, and quotes were dropped from text.
        return csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
    return csv.reader(lines)


def _check_columns(path: str, fields: Fields, columns: Sequence[str]) -> None:
    missing = [name for name in fields.names() if name not in columns]
    if missing:
        listed = ", ".join(columns)
        raise ReaderError(f"{path} has no column {missing[0]!r} (its columns: {listed})")


def _parquet(path: str, fields: Fields) -> Iterator[Record]:
    import pyarrow as pa

    parquet = _parquet_file(path)
    _check_columns(path, fields, parquet.schema_arrow.names)
    number = 0
    batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=fields.names())
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise ReaderError(f"{path}: cannot read the rows after row {number}: {exc}") from None
        if batch is None:
            return
        for values in batch.to_pylist():
            number += 1
            yield number, values, None


def _parquet_file(path: str) -> Any:
    """``path`` opened as Parquet; a file that is not one is a ``ReaderError`` naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ReaderError(f"{path} is not a readable Parquet file: {exc}") from None


def check_fields(files: Sequence[InputFile], fields: Fields) -> None:
    """Refuse, before anything runs, a CSV header or Parquet schema without a named field,
    and fields on plain text (which has none)."""
    for file in files:
        if file.format == "parquet":
            _check_columns(file.path, fields, _parquet_file(file.path).schema_arrow.names)
        elif file.format in ("csv", "tsv"):
            with open(file.path, encoding="utf-8-sig", errors="replace", newline="") as f:
                header = next(_csv_reader(f, file.format), [])
            _check_columns(file.path, fields, header)
        elif file.format == "text" and (fields.id is not None or fields.query is not None):
            raise ReaderError(f"{file.path} is plain text: one text per line, no fields to name")
