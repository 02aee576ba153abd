"""Small /proc and cgroup files, read often and cheaply: the host probe's sources."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

UNLIMITED = 2**60  # cgroup and rlimit "no limit" values are at or above this


class OpenFiles:
    """Small /proc and /sys files, opened once and re-read from offset 0 with ``pread``.

    Opening a procfs path costs several times reading it, and the batcher reads these before
    every batch. Safe to share between threads: ``pread`` has no shared offset. The
    descriptors close when this object is collected.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_fds, self._fds)

    def _fd(self, path: str, flags: int) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, flags | os.O_CLOEXEC)
        return fd

    def read(self, path: str) -> bytes:
        return os.pread(self._fd(path, os.O_RDONLY), 1 << 16, 0)

    def write(self, path: str, data: bytes) -> None:
        os.write(self._fd(path, os.O_WRONLY), data)


def _read_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def _close_fds(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)


def kib_field(text: bytes, name: bytes) -> int | None:
    """One ``Name:   123 kB`` field of /proc/meminfo or /proc/self/status, in bytes."""
    lines = b"\n" + text
    key = b"\n" + name + b":"
    start = lines.find(key)
    if start < 0:
        return None
    end = lines.find(b"\n", start + 1)
    parts = lines[start + len(key) : end if end >= 0 else None].split()
    if len(parts) != 2 or parts[1] != b"kB" or not parts[0].isdigit():
        return None
    return int(parts[0]) * 1024


def _read_int(path: str, read: Callable[[str], bytes]) -> int | None:
    try:
        text = read(path).strip()
    except OSError:
        return None
    if text == b"max":
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def cgroup_files(root: Path = Path("/sys/fs/cgroup")) -> tuple[str, str] | None:
    """This cgroup's memory limit and usage files (v2, else v1); None where there are none."""
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        if limit_file.exists():
            return str(limit_file), str(usage_file)
    return None


def cgroup_room(
    files: tuple[str, str] | None, read: Callable[[str], bytes] = _read_bytes
) -> int | None:
    """Bytes left under the memory limit in ``files`` (see ``cgroup_files``); None: no limit."""
    if files is None:
        return None
    limit = _read_int(files[0], read)
    if limit is None:
        return None
    return max(0, limit - (_read_int(files[1], read) or 0))
