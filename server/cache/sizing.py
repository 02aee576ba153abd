"""How many bytes the output cache may hold by default."""

from __future__ import annotations

from pathlib import Path

from batching.procfs import CgroupMemory, OpenFiles, kib_field, own_memory_cgroup

DEFAULT_SHARE = 0.05
"""Of the host memory the replica may use."""


def host_memory_bytes(
    memory_limit_bytes: int | None, *, on_host: bool, proc: Path = Path("/proc")
) -> int | None:
    """The host memory this replica may use: the smallest of the host's total (MemTotal),
    its memory cgroup's limit (and its ancestors') and, where the model runs on the CPU,
    ``--memory-limit``. None where /proc cannot say."""
    found: list[int] = []
    try:
        total = kib_field((proc / "meminfo").read_bytes(), b"MemTotal")
    except OSError:
        total = None
    if total:
        found.append(total)
    cgroup = own_memory_cgroup(proc)
    if cgroup is not None:
        try:
            limit = CgroupMemory(cgroup, OpenFiles()).read()
        except (OSError, ValueError):
            limit = None
        if limit is not None:
            found.append(limit.limit_bytes)
    if on_host and memory_limit_bytes is not None:
        found.append(memory_limit_bytes)
    return min(found) if found else None


def default_cache_bytes(host_bytes: int | None, share: float = DEFAULT_SHARE) -> int:
    """``share`` of ``host_bytes``, in whole MiB; 0 (no store) where that is unknown."""
    if not host_bytes:
        return 0
    return int(host_bytes * share) >> 20 << 20
