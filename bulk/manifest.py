"""The job's record in its output folder: what it is, and which parts are finished.

``manifest.json`` names the job (task, model and its fingerprint, everything that changes
the outputs) and its inputs (paths and sizes), and lists each finished part with a hash of
the rows it was made from and of the file written. It is rewritten atomically after each
part. A rerun with the same job and inputs skips the parts listed; a rerun with another job
or other inputs is refused (``ManifestMismatch``) unless asked to start again.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from .writer import sync_directory, truncate_rejects, write_atomically

log = logging.getLogger("batchfit.bulk")

FORMAT = "batchfit-bulk/1"
MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
LOCK = ".batchfit-bulk.lock"


class ManifestMismatch(Exception):
    """The output folder holds another job's results."""


@dataclass(frozen=True, slots=True)
class PartRecord:
    index: int
    file: str | None
    """None: every row of the part was rejected, and no file was written."""
    first_row: int
    rows: int
    """Input rows the part covers, bad ones included."""
    outputs: int
    rejects: int
    input_sha256: str
    size_bytes: int
    sha256: str | None
    rejects_bytes: int
    """Size of ``rejects.jsonl`` once this part's bad rows were in it."""


def rows_digest(rows: Iterator[Any]) -> str:
    """A hash of a part's rows as read (numbers, ids, texts, reasons for bad ones)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(orjson.dumps(row) + b"\n")
    return digest.hexdigest()


class Manifest:
    """One output folder's manifest. Holds an exclusive lock on the folder while open, so
    two jobs never write into one folder."""

    def __init__(self, directory: Path, data: dict[str, Any], lock_fd: int) -> None:
        self.directory = directory
        self.data = data
        self._lock_fd = lock_fd
        self.parts = [PartRecord(**record) for record in data["parts"]]

    @classmethod
    def open(
        cls, directory: Path, job: dict[str, Any], inputs: list[dict[str, Any]], *,
        overwrite: bool = False,
    ) -> Manifest:  # fmt: skip
        """The folder's manifest for ``job`` over ``inputs``: the existing one if it is this
        job's (its unfinished work discarded), a new one if there is none or ``overwrite``."""
        directory.mkdir(parents=True, exist_ok=True)
        lock_fd = _lock(directory)
        try:
            path = directory / MANIFEST
            if overwrite:
                _clear(directory)
            if path.exists():
                data = orjson.loads(path.read_bytes())
                _check_same(data, job, inputs, directory)
            else:
                leftovers = sorted(p.name for p in directory.glob("part-*.parquet"))
                if leftovers:
                    raise ManifestMismatch(
                        f"{directory} holds {len(leftovers)} part files but no {MANIFEST}; "
                        "pass --overwrite to start again there, or choose another --out"
                    )
                data = {
                    "format": FORMAT, "job": job, "inputs": inputs, "id_type": None,
                    "parts": [], "complete": False, "rows": None,
                }  # fmt: skip
            manifest = cls(directory, data, lock_fd)
            manifest._drop_unfinished()
            manifest.save()
            return manifest
        except BaseException:
            os.close(lock_fd)
            raise

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    @property
    def id_type(self) -> str | None:
        return self.data["id_type"]

    @id_type.setter
    def id_type(self, value: str) -> None:
        self.data["id_type"] = value

    @property
    def rejects_bytes(self) -> int:
        return self.parts[-1].rejects_bytes if self.parts else 0

    def part(self, index: int) -> PartRecord | None:
        return self.parts[index] if index < len(self.parts) else None

    def record(self, part: PartRecord) -> None:
        """``part`` is written: list it, after every part before it."""
        if part.index != len(self.parts):
            raise RuntimeError(f"part {part.index} recorded after {len(self.parts)} parts")
        self.parts.append(part)
        self.data["parts"].append(asdict(part))
        self.save()

    def finish(self, rows: int) -> None:
        self.data["complete"] = True
        self.data["rows"] = rows
        self.save()

    def save(self) -> None:
        data = orjson.dumps(self.data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        write_atomically(self.directory, MANIFEST, data + b"\n")

    def _drop_unfinished(self) -> None:
        """Keep the listed parts whose files are intact, up to the first that is not; drop
        the rest, the rejects written after them and temporary files of a killed run."""
        for temporary in self.directory.glob(".*.tmp"):
            temporary.unlink()
        for kept, part in enumerate(self.parts):
            if part.file is not None and not _intact(self.directory / part.file, part):
                log.warning("part %d (%s) is missing or damaged; it is redone", kept, part.file)
                self.parts = self.parts[:kept]
                self.data["parts"] = self.data["parts"][:kept]
                self.data["complete"] = False
                break
        listed = {part.file for part in self.parts if part.file is not None}
        for stray in self.directory.glob("part-*.parquet"):
            if stray.name not in listed:
                stray.unlink()
        truncate_rejects(self.directory / REJECTS, self.rejects_bytes)


def _intact(path: Path, part: PartRecord) -> bool:
    """Whether ``path`` is the file ``part`` lists: its size, then its SHA-256.
    NOTE: the hash as well as the size: a part damaged in place (a bad block, a stray write,
    a copy cut short and padded) keeps its size, and a part kept is never read again by the
    job, so its damage would reach whoever reads the outputs. Hashing reads the parts once
    per rerun, about 0.6 s a GB on a 2-CPU host, little beside the passes that computed them."""
    if not path.is_file() or path.stat().st_size != part.size_bytes:
        return False
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest() == part.sha256


def _lock(directory: Path) -> int:
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ManifestMismatch(f"another job is writing to {directory}") from None
    return fd


def _clear(directory: Path) -> None:
    for pattern in (MANIFEST, REJECTS, "part-*.parquet", "ray-part-*", ".*.tmp"):
        for path in directory.glob(pattern):
            path.unlink()
    sync_directory(directory)


def _check_same(
    data: dict[str, Any], job: dict[str, Any], inputs: list[dict[str, Any]], directory: Path
) -> None:
    if data.get("format") != FORMAT:
        raise ManifestMismatch(
            f"{directory / MANIFEST} is not a batchfit bulk manifest ({FORMAT}); pass "
            "--overwrite to start again there, or choose another --out"
        )
    changes = [
        f"{key}: {_show(data['job'].get(key))} then, {_show(job.get(key))} now"
        for key in sorted(set(data["job"]) | set(job))
        if data["job"].get(key) != job.get(key)
    ]
    if changes:
        raise ManifestMismatch(
            f"{directory} holds the results of another job ({'; '.join(changes)}); pass "
            "--overwrite to start again there, or choose another --out"
        )
    before = [(i["path"], i["size_bytes"]) for i in data["inputs"]]
    now = [(i["path"], i["size_bytes"]) for i in inputs]
    if before != now:
        raise ManifestMismatch(
            f"the inputs changed since {directory} was written ({_input_changes(before, now)});"
            " pass --overwrite to start again there, or choose another --out"
        )


def _show(value: Any) -> str:
    return orjson.dumps(value).decode() if isinstance(value, dict) else repr(value)


def _input_changes(before: list[tuple[str, int]], now: list[tuple[str, int]]) -> str:
    old, new = dict(before), dict(now)
    notes = [f"{path} is gone" for path in old if path not in new]
    notes += [f"{path} is new" for path in new if path not in old]
    notes += [
        f"{path} was {old[path]} bytes, now {new[path]}"
        for path in new
        if path in old and old[path] != new[path]
    ]
    return "; ".join(notes) or "their order differs"
