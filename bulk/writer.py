"""Outputs to Parquet parts, written atomically, and bad rows to ``rejects.jsonl``.

A part holds an ``id`` column (int64 or string) and, by task: ``embedding`` (a fixed-size
list of float32), ``label`` and ``score`` (a classifier's top label and its probability), or
``score`` (a cross-encoder's relevance).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

if TYPE_CHECKING:
    import pyarrow as pa

# NOTE: pyarrow is imported where a part is built, not here: ``batchfit serve`` imports the
# bulk commands' parsers, and pyarrow's libraries added 62 MB of resident pages to every
# replica on a fresh install, enough that one under a 640 MiB --memory-limit refused to start.
ID_TYPES = ("int64", "string")


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def output_schema(task: str, id_type: str, dimensions: int | None) -> pa.Schema:
    import pyarrow as pa

    if id_type not in ID_TYPES:
        raise KeyError(id_type)
    fields = [pa.field("id", pa.int64() if id_type == "int64" else pa.string(), nullable=False)]
    if task == "embed":
        if dimensions is None:
            raise ValueError("an embedding part needs its dimension")
        fields.append(pa.field("embedding", pa.list_(pa.float32(), dimensions), nullable=False))
    elif task == "classify":
        fields.append(pa.field("label", pa.string(), nullable=False))
        fields.append(pa.field("score", pa.float32(), nullable=False))
    elif task == "rerank":
        fields.append(pa.field("score", pa.float32(), nullable=False))
    else:
        raise ValueError(f"unknown task {task!r}")
    return pa.schema(fields)


def output_table(schema: pa.Schema, ids: Sequence[Any], outputs: Sequence[Any]) -> pa.Table:
    """The part's table: one row per id, its output from the model (in the same order)."""
    import pyarrow as pa

    columns: list[pa.Array] = [pa.array(ids, type=schema.field("id").type)]
    names = schema.names
    if "embedding" in names:
        size = schema.field("embedding").type.list_size
        flat = np.asarray(outputs, dtype=np.float32).reshape(
            len(outputs), size if not outputs else -1
        )
        if flat.shape[1] != size:
            raise ValueError(f"embeddings of {flat.shape[1]} dimensions, expected {size}")
        # NOTE: no ``type=``: given one, pyarrow converts element by element (2.3 s for 10,000
        # x 384 floats, against a zero-copy view of the float32 array).
        values = pa.array(flat.ravel())
        columns.append(pa.FixedSizeListArray.from_arrays(values, size))
    elif "label" in names:
        columns.append(pa.array([o["label"] for o in outputs], type=pa.string()))
        columns.append(pa.array([o["score"] for o in outputs], type=pa.float32()))
    else:
        columns.append(pa.array([float(o) for o in outputs], type=pa.float32()))
    return pa.Table.from_arrays(columns, schema=schema)


@dataclass(frozen=True, slots=True)
class WrittenFile:
    name: str
    size_bytes: int
    sha256: str


def parquet_bytes(table: pa.Table) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    # Snappy: half zstd's CPU time (taken from the forward passes on a CPU host) for 11% more
    # bytes; embeddings hardly compress either way.
    pq.write_table(table, sink, compression="snappy")
    return sink.getvalue().to_pybytes()


def write_atomically(directory: Path, name: str, data: bytes) -> WrittenFile:
    """Write ``data`` as ``directory/name``: to a temporary file, flushed to disk, then
    renamed over the name, so a reader (or a rerun) sees all of the file or none of it."""
    final = directory / name
    temporary = directory / f".{name}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, final)
    sync_directory(directory)
    return WrittenFile(name, len(data), hashlib.sha256(data).hexdigest())


def sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_rejects(path: Path, records: Sequence[dict[str, Any]]) -> int:
    """Append one JSON line per record, flushed to disk; return the file's size after."""
    with open(path, "ab") as f:
        for record in records:
            f.write(orjson.dumps(record) + b"\n")
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def truncate_rejects(path: Path, size_bytes: int) -> None:
    """Drop what a killed run appended after its last finished part."""
    if not path.exists():
        if size_bytes:
            raise FileNotFoundError(f"{path} is missing; the manifest records {size_bytes} bytes")
        path.touch()
        return
    if path.stat().st_size < size_bytes:
        raise ValueError(f"{path} is shorter than the manifest records ({size_bytes} bytes)")
    os.truncate(path, size_bytes)
