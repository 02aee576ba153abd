"""The two threads beside the model loop: one reads and tokenizes parts ahead of it, one
writes the parts it finished. Bounded hand-overs keep at most two parts tokenized at once
and the model thread never waits on a file.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models import Item

from .manifest import REJECTS, Manifest, ManifestMismatch, PartRecord, rows_digest
from .readers import Reject, Row
from .runner import Reserve
from .writer import append_rejects, parquet_bytes, part_name, write_atomically

log = logging.getLogger("batchfit.bulk")

TOKENIZE_CHUNK = 1024
# Bytes a row's tokens and item take per character of its text, until the tokenizer has
# run: kept out of the batch budget while the reader prepares the next part. Measured with
# all-MiniLM-L6-v2: a part of 10,000 rows (2.0 million characters) held 61 MiB once
# tokenized, 32 bytes a character (token ids are Python lists).
RESERVE_BYTES_PER_CHAR = 40
# A part's table, its Parquet bytes and their copy, per output (a 1024-float embedding).
WRITER_BYTES_PER_OUTPUT = 3 * 4 * 1024
END = object()


class PartWriteError(Exception):
    """A finished part could not be written: its table, its file, its bad rows or its
    manifest entry (a full disk, a value its column cannot hold)."""


class StrictReject(Exception):
    """A bad row under ``--strict``."""

    def __init__(self, reject: Reject) -> None:
        super().__init__(
            f"row {reject.number} ({reject.file}, line {reject.line}): {reject.reason} "
            "(--strict stops at the first bad row)"
        )
        self.reject = reject


@dataclass
class PartInput:
    index: int
    first_row: int
    num_rows: int
    digest: str
    rows: list[Row] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    items: list[Item] | None = None
    """None: the part was finished by an earlier run and is skipped."""
    id_type: str | None = None


@dataclass
class PartOutput:
    part: PartInput
    ids: list[Any]
    outputs: list[Any]
    rejects: list[Reject]


Prepare = Callable[[Sequence[Row]], list[Item]]


class Worker(threading.Thread):
    """A daemon thread that keeps the exception it died of for the model loop to raise."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as exc:
            self.error = exc


class PartReader:
    """Splits the rows into parts of ``part_rows`` and hands each to the model loop: a part
    the manifest lists is checked against its recorded hash and skipped, any other is
    tokenized. Two parts at most are tokenized and not yet run (``release`` frees a slot)."""

    def __init__(
        self, rows: Iterator[Row | Reject], *, part_rows: int, manifest: Manifest,
        prepare: Prepare, strict: bool, reserve: Reserve, stop: threading.Event,
    ) -> None:  # fmt: skip
        self._rows = rows
        self._part_rows = part_rows
        self._manifest = manifest
        self._prepare = prepare
        self._strict = strict
        self._reserve = reserve
        self._stop = stop
        self._id_type = manifest.id_type
        self.parts: queue.Queue[Any] = queue.Queue()
        self._slots = threading.Semaphore(2)

    def release(self) -> None:
        """The model loop is done with a tokenized part."""
        self._slots.release()

    def run(self) -> None:
        rows = iter(self._rows)
        estimate = 0  # the last part's characters: what the next one will likely take
        try:
            for index in itertools.count():
                skipped = self._manifest.part(index) is not None
                if not skipped and not self._wait_for_slot():
                    return
                with self._reserve.busy("reader", estimate * RESERVE_BYTES_PER_CHAR):
                    chunk = list(itertools.islice(rows, self._part_rows))
                    if not chunk:
                        if not skipped:
                            self._slots.release()
                        return
                    part = self._part(index, chunk)
                if part.items is not None:
                    estimate = sum(len(r.text) + len(r.query or "") for r in part.rows)
                self.parts.put(part)
        finally:
            self.parts.put(END)

    def _wait_for_slot(self) -> bool:
        while not self._slots.acquire(timeout=0.5):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    def _part(self, index: int, chunk: list[Row | Reject]) -> PartInput:
        digest = rows_digest(_as_record(row) for row in chunk)
        first_row = chunk[0].number
        done = self._manifest.part(index)
        if done is not None:
            if done.input_sha256 != digest or done.first_row != first_row:
                last = first_row + len(chunk) - 1
                raise ManifestMismatch(
                    f"the inputs changed since {self._manifest.directory} was written: rows "
                    f"{first_row}-{last} (part {index}) read differently now; pass --overwrite "
                    "to start again there, or choose another --out"
                )
            return PartInput(index, first_row, len(chunk), digest)
        part = PartInput(index, first_row, len(chunk), digest, id_type=self._id_type)
        for row in chunk:
            if isinstance(row, Row):
                row = self._check_id(row)
            if isinstance(row, Reject):
                if self._strict:
                    raise StrictReject(row)
                part.rejects.append(row)
            else:
                part.rows.append(row)
        part.id_type = self._id_type
        part.items = self._tokenize(part.rows)
        return part

    def _check_id(self, row: Row) -> Row | Reject:
        """Ids are all integers (int64) or all strings, as the first row's is."""
        if self._id_type is None:
            self._id_type = "int64" if isinstance(row.id, int) else "string"
        if self._id_type == "int64" and not isinstance(row.id, int):
            reason = f"id {row.id!r} is not an integer, as the first row's id is"
            return Reject(row.number, row.file, row.line, reason)
        if self._id_type == "string" and not isinstance(row.id, str):
            return Row(row.number, str(row.id), row.text, row.query, row.file, row.line)
        return row

    def _tokenize(self, rows: list[Row]) -> list[Item]:
        remaining = sum(len(r.text) + len(r.query or "") for r in rows)
        items: list[Item] = []
        for start in range(0, len(rows), TOKENIZE_CHUNK):
            self._reserve.set("reader", max(remaining * RESERVE_BYTES_PER_CHAR, 0))
            chunk = rows[start : start + TOKENIZE_CHUNK]
            items += self._prepare(chunk)
            remaining -= sum(len(r.text) + len(r.query or "") for r in chunk)
        return items


class PartWriter:
    """Writes each finished part (its file, then its bad rows, then the manifest entry) in
    the order the model loop finished them."""

    def __init__(
        self, manifest: Manifest, make_table: Callable[[PartOutput], Any], reserve: Reserve
    ) -> None:
        self._manifest = manifest
        self._reserve = reserve
        self._make_table = make_table
        self.parts: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.written = 0

    def run(self) -> None:
        while (output := self.parts.get()) is not END:
            self._write(output)

    def _write(self, output: PartOutput) -> None:
        with self._reserve.busy("writer", WRITER_BYTES_PER_OUTPUT * len(output.ids)):
            try:
                self._write_part(output)
            except Exception as exc:
                # One line for the command line; the traceback only in a debug log.
                part = output.part
                log.debug("part %d could not be written", part.index, exc_info=True)
                raise PartWriteError(
                    f"part {part.index} (rows {part.first_row}-"
                    f"{part.first_row + part.num_rows - 1}) could not be written: "
                    f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                ) from exc

    def _write_part(self, output: PartOutput) -> None:
        part = output.part
        directory = self._manifest.directory
        file: str | None = None
        size_bytes, sha256 = 0, None
        # NOTE: a part without outputs (every row rejected) writes no file, only its manifest
        # entry: its id column's type would be a guess before any good row fixed it, and an
        # int64 guess beside later parts' string ids made the parts unreadable as one table.
        if output.ids:
            written = write_atomically(
                directory, part_name(part.index), parquet_bytes(self._make_table(output))
            )
            file, size_bytes, sha256 = written.name, written.size_bytes, written.sha256
        rejects_bytes = append_rejects(
            Path(directory) / REJECTS, [r.record() for r in output.rejects]
        )
        if part.id_type is not None:
            self._manifest.id_type = part.id_type
        self._manifest.record(
            PartRecord(
                index=part.index, file=file, first_row=part.first_row, rows=part.num_rows,
                outputs=len(output.ids), rejects=len(output.rejects), input_sha256=part.digest,
                size_bytes=size_bytes, sha256=sha256, rejects_bytes=rejects_bytes,
            )
        )  # fmt: skip
        self.written += 1
        log.info(
            "part %d written: %s, %d outputs, %d rejects (rows %d-%d)",
            part.index, file or "no file", len(output.ids), len(output.rejects),
            part.first_row, part.first_row + part.num_rows - 1,
        )  # fmt: skip


def _as_record(row: Row | Reject) -> tuple[Any, ...]:
    if isinstance(row, Reject):
        return (row.number, row.reason)
    return (row.number, row.id, row.text, row.query)
