"""Small /proc and cgroup files, read often and cheaply: the host probe's sources."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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


def _read_text(path: str) -> str:
    return Path(path).read_text()


# --- the process's own cgroups ---
#
# The kernel enforces the limit of every cgroup on the path from the process's own cgroup up
# to the root, each against that level's usage: past a memory limit it kills the process,
# past a CPU quota it throttles it. Which hierarchy holds a controller, and where its files
# are, comes from /proc/self/cgroup (controller -> path) and /proc/self/mountinfo (where each
# hierarchy, or a subtree of it, is mounted).


@dataclass(frozen=True, slots=True)
class CgroupMount:
    version: int  # 1 or 2
    root: str  # the mounted subtree's path inside its hierarchy (mountinfo's 4th field)
    mount_point: str
    options: frozenset[str]  # the super options; v1 names its controllers there


@dataclass(frozen=True, slots=True)
class Cgroup:
    """Where this process's cgroup of one controller and each ancestor visible under the
    mount live."""

    version: int
    levels: tuple[tuple[str, str], ...]  # (cgroup path, directory): own first, then up

    @property
    def path(self) -> str:
        return self.levels[0][0]


MemoryCgroup = Cgroup


@dataclass(frozen=True, slots=True)
class CgroupLimit:
    """One level's limit and its usage as the kernel's OOM decision counts it."""

    limit_bytes: int
    working_set_bytes: int
    path: str

    @property
    def room_bytes(self) -> int:
        return max(0, self.limit_bytes - self.working_set_bytes)


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller -> path; the unified (v2) entry's key is ``""``."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            paths[""] = path
        for controller in filter(None, controllers.split(",")):
            paths[controller] = path
    return paths


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup (v1) and cgroup2 mounts in ``/proc/self/mountinfo``, in its order."""
    mounts = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or not rest or rest[0] not in ("cgroup", "cgroup2"):
            continue
        options = frozenset(rest[2].split(",")) if len(rest) > 2 else frozenset()
        version = 2 if rest[0] == "cgroup2" else 1
        mounts.append(CgroupMount(version, _unescape(fields[3]), _unescape(fields[4]), options))
    return mounts


def cgroup_levels(path: str, mount: CgroupMount) -> tuple[tuple[str, str], ...] | None:
    """The cgroup at ``path`` and its ancestors up to the mount's root, with the directory of
    each under the mount point; None where the mount does not hold ``path``."""
    root = mount.root.rstrip("/")
    path = path.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    names = [name for name in path[len(root) :].split("/") if name]
    levels = []
    for depth in range(len(names), -1, -1):
        below = "/".join(names[:depth])
        directory = mount.mount_point.rstrip("/") + ("/" + below if below else "")
        levels.append(((root + "/" + below).rstrip("/") or "/", directory or "/"))
    return tuple(levels)


def find_cgroup(
    controller: str, proc_cgroup: str, mountinfo: str, read: Callable[[str], str] = _read_text
) -> Cgroup | None:
    """This process's cgroup for ``controller`` (``memory``, ``cpu``): the v1 hierarchy that
    mounts it where there is one (v1 and hybrid hosts), else the unified one if the
    controller is on there; None: neither."""
    paths = parse_proc_cgroup(proc_cgroup)
    mounts = parse_mountinfo(mountinfo)
    if controller in paths:
        for mount in mounts:
            if mount.version == 1 and controller in mount.options:
                levels = cgroup_levels(paths[controller], mount)
                if levels is not None:
                    return Cgroup(1, levels)
    if "" in paths:
        for mount in mounts:
            if mount.version != 2:
                continue
            levels = cgroup_levels(paths[""], mount)
            if levels is None:
                continue
            try:
                controllers = read(levels[0][1] + "/cgroup.controllers").split()
            except OSError:
                continue
            if controller in controllers:
                return Cgroup(2, levels)
    return None


def find_memory_cgroup(
    proc_cgroup: str, mountinfo: str, read: Callable[[str], str] = _read_text
) -> Cgroup | None:
    """This process's memory cgroup (``find_cgroup`` of ``memory``)."""
    return find_cgroup("memory", proc_cgroup, mountinfo, read)


def _own_cgroup(controller: str, proc: Path) -> Cgroup | None:
    try:
        proc_cgroup = (proc / "self" / "cgroup").read_text()
        mountinfo = (proc / "self" / "mountinfo").read_text()
    except OSError:
        return None
    return find_cgroup(controller, proc_cgroup, mountinfo)


def own_memory_cgroup(proc: Path = Path("/proc")) -> Cgroup | None:
    """``find_memory_cgroup`` for this process; None where /proc cannot say."""
    return _own_cgroup("memory", proc)


def parse_limit(text: bytes) -> int | None:
    """A cgroup limit file's value; None for no limit (``max``, or v1's huge "unlimited")."""
    text = text.strip()
    if text == b"max" or not text:
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def stat_field(text: bytes, name: bytes) -> int | None:
    """One ``name value`` line of a cgroup's ``memory.stat``."""
    lines = b"\n" + text
    key = b"\n" + name + b" "
    start = lines.find(key)
    if start < 0:
        return None
    end = lines.find(b"\n", start + 1)
    value = lines[start + len(key) : end if end >= 0 else None].strip()
    return int(value) if value.isdigit() else None


def working_set(usage_bytes: int, inactive_file_bytes: int) -> int:
    """Usage less the page cache the kernel drops first, as kubelet counts it: what a
    cgroup's OOM decision cannot get back by reclaim."""
    return max(0, usage_bytes - inactive_file_bytes)


def v1_level(stat: bytes, usage: Callable[[], bytes], path: str) -> CgroupLimit | None:
    """A v1 level: ``hierarchical_memory_limit`` (already the smallest over its ancestors,
    those above the mount included) against its usage less ``total_inactive_file``. Usage
    is only read where there is a limit."""
    limit = stat_field(stat, b"hierarchical_memory_limit")
    if limit is None or limit >= UNLIMITED:
        return None
    inactive = stat_field(stat, b"total_inactive_file") or 0
    return CgroupLimit(limit, working_set(int(usage()), inactive), path)


def v2_level(
    memory_max: bytes, memory_high: bytes, current: Callable[[], bytes],
    stat: Callable[[], bytes], path: str,
) -> CgroupLimit | None:  # fmt: skip
    """A v2 level: the lower of ``memory.max`` and ``memory.high`` (above it the kernel
    throttles hard) against ``memory.current`` less ``inactive_file``. Usage is only read
    where there is a limit."""
    limits = [v for v in (parse_limit(memory_max), parse_limit(memory_high)) if v is not None]
    if not limits:
        return None
    inactive = stat_field(stat(), b"inactive_file") or 0
    return CgroupLimit(min(limits), working_set(int(current()), inactive), path)


def tightest(limits: Iterable[CgroupLimit | None]) -> CgroupLimit | None:
    """The level with the least room: the limit that binds."""
    found = [limit for limit in limits if limit is not None]
    return min(found, key=lambda limit: limit.room_bytes) if found else None


_V1_FILES = ("memory.stat", "memory.usage_in_bytes")
_V2_FILES = ("memory.max", "memory.high", "memory.current", "memory.stat")


class CgroupMemory:
    """Reads the binding limit of a ``MemoryCgroup``: its files are resolved once (levels
    without them, such as the v2 root, are left out) and read through ``OpenFiles``."""

    def __init__(self, cgroup: MemoryCgroup, files: OpenFiles) -> None:
        self.cgroup = cgroup
        self._files = files
        names = _V1_FILES if cgroup.version == 1 else _V2_FILES
        self._levels = tuple(
            (path, tuple(f"{directory}/{name}" for name in names))
            for path, directory in cgroup.levels
            if all(os.path.exists(f"{directory}/{name}") for name in names)
        )

    def read(self) -> CgroupLimit | None:
        read = self._files.read
        if self.cgroup.version == 1:
            found = []
            for path, (stat, usage) in self._levels:
                level = v1_level(read(stat), lambda f=usage: read(f), path)
                if level is None:
                    break  # no limit here, so none above: the limit is hierarchical
                found.append(level)
            return tightest(found)
        levels = []
        for path, (memory_max, memory_high, current, stat) in self._levels:
            usage, stats = (lambda f=current: read(f)), (lambda f=stat: read(f))
            levels.append(v2_level(read(memory_max), read(memory_high), usage, stats, path))
        return tightest(levels)


# --- the CPU quota ---


@dataclass(frozen=True, slots=True)
class CpuQuota:
    """The CFS bandwidth limit that binds: ``cpus`` CPUs' worth of time per period."""

    cpus: float
    path: str


def parse_cpu_max(text: str) -> float | None:
    """v2 ``cpu.max`` (``"max 100000"`` or ``"150000 100000"``) as CPUs; None: no quota."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100000
    return int(parts[0]) / period if period > 0 else None


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` as CPUs; None: no quota (-1)."""
    quota_us, period_us = int(quota), int(period)
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cpu_quota(cgroup: Cgroup, read: Callable[[str], str] = _read_text) -> CpuQuota | None:
    """The smallest quota over the cgroup and its ancestors under the mount: each level's
    quota caps everything below it, and v1 has no file that folds them together. Levels
    without the files (the v2 root) or with unreadable ones count as no quota."""
    found: list[CpuQuota] = []
    for path, directory in cgroup.levels:
        try:
            if cgroup.version == 1:
                cpus = parse_cfs_quota(
                    read(f"{directory}/cpu.cfs_quota_us"), read(f"{directory}/cpu.cfs_period_us")
                )
            else:
                cpus = parse_cpu_max(read(f"{directory}/cpu.max"))
        except (OSError, ValueError):
            continue
        if cpus is not None:
            found.append(CpuQuota(cpus, path))
    return min(found, key=lambda quota: quota.cpus) if found else None


def own_cpu_quota(proc: Path = Path("/proc")) -> CpuQuota | None:
    """``cpu_quota`` of this process's cpu cgroup; None: no quota, or no cpu controller."""
    cgroup = _own_cgroup("cpu", proc)
    return cpu_quota(cgroup) if cgroup is not None else None
