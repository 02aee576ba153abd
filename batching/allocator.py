"""glibc malloc's thresholds and trim: how the host's allocator is tuned so that warm-up
measures a batch's real footprint and serving pays few page faults, and how a quiet replica
hands its free memory back (docs/memory.md)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

from .procfs import kib_field

if TYPE_CHECKING:
    from .probes import MemoryReading

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
SERVING_MMAP_THRESHOLD = 32 * 2**20
"""Blocks up to this size come from the heap while serving where only the host's memory
bounds the process: the most glibc's own threshold rises to as a program frees large
blocks."""
CONFINED_MMAP_THRESHOLD = 4 * 2**20
"""The same under a limit of the process's own (a cgroup's, the address-space limit)."""
SERVING_TRIM_THRESHOLD = 4 * 2**20


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def tune_host_allocator(*, measuring: bool, reading: MemoryReading | None = None) -> bool:
    """Set glibc malloc's thresholds: while ``measuring``, so that RSS peaks measure a batch;
    afterwards, so that serving pays few page faults where memory allows (``reading``, the
    latest: ``serving_mmap_threshold``).

    While ``measuring`` (warm-up calibration), blocks of 1 MiB and more are mmapped and
    unmapped on free, and the heap's top is trimmed past 1 MiB, so VmHWM minus the baseline
    is the batch's real footprint. Afterwards the heap's top goes back to the kernel past 4
    MiB: at glibc's own steady state (32 MiB mmap, 64 MiB trim) a soak's RSS kept climbing,
    +130 MiB over 6000 requests, where with both at 4 MiB it levelled off 70 MiB up.
    Returns False where there is no glibc (nothing changed).
    """
    libc = _glibc()
    if libc is None:
        return False
    mmap_threshold, trim_threshold = (
        (2**20, 2**20) if measuring else (serving_mmap_threshold(reading), SERVING_TRIM_THRESHOLD)
    )
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def serving_mmap_threshold(reading: MemoryReading | None) -> int:
    """The largest block served from the heap while serving.

    Where only the host's memory bounds the process, ``SERVING_MMAP_THRESHOLD`` (32 MiB): a
    mapped block costs a page fault per page every time a batch allocates it, and a forward
    pass's activations are several MiB each (the bundled model's feed-forward output at
    4096 padded tokens is 24 MiB). Under a limit of its own (``reading.enforced``: a
    cgroup's, the address-space limit) or where it is unknown, ``CONFINED_MMAP_THRESHOLD``
    (4 MiB): a heap that cannot fit a large block in the holes earlier batches left grows
    instead, and what it holds counts against the limit, past what the sizer predicts
    (docs/memory.md has both sides' figures)."""
    enforced = reading.enforced if reading is not None else None
    if enforced is not None and enforced.source == "host":
        return SERVING_MMAP_THRESHOLD
    return CONFINED_MMAP_THRESHOLD


def release_host_memory(proc: Path = Path("/proc")) -> int | None:
    """Hand the free memory glibc's malloc holds back to the kernel (``malloc_trim(0)``: the
    free pages inside every arena, not only a heap's top, which is all the trim threshold
    returns); return how much resident memory that released, or None where there is no
    glibc. Holes that batches of many shapes leave in the heap otherwise stay resident
    (docs/memory.md has the soak's figures)."""
    libc = _glibc()
    if libc is None:
        return None
    status = proc / "self" / "status"
    before = kib_field(status.read_bytes(), b"VmRSS") or 0
    libc.malloc_trim(0)
    after = kib_field(status.read_bytes(), b"VmRSS") or 0
    return max(0, before - after)
