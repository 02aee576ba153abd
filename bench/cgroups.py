"""A child memory (or cpu) cgroup under this process's own: a real kernel limit to run a
replica in."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from batching.procfs import find_cgroup, stat_field


@dataclass
class ChildCgroup:
    directory: Path
    version: int
    path: str  # as the hierarchy names it (what /proc/<pid>/cgroup shows)
    _peak_fd: int | None = field(default=None, repr=False)

    def _name(self, v1: str, v2: str) -> Path:
        return self.directory / (v1 if self.version == 1 else v2)

    def join(self) -> None:
        """Move the calling process in (use as ``preexec_fn``: the child joins before exec)."""
        (self.directory / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        return [int(pid) for pid in (self.directory / "cgroup.procs").read_text().split()]

    def set_limit(self, limit_bytes: int) -> None:
        self._name("memory.limit_in_bytes", "memory.max").write_text(str(limit_bytes))

    def set_cpu_quota(self, cpus: float, period_us: int = 100_000) -> None:
        """A CFS bandwidth limit of ``cpus`` CPUs' worth of time per period (cpu controller)."""
        quota_us = str(round(cpus * period_us))
        if self.version == 1:
            (self.directory / "cpu.cfs_period_us").write_text(str(period_us))
            (self.directory / "cpu.cfs_quota_us").write_text(quota_us)
        else:
            (self.directory / "cpu.max").write_text(f"{quota_us} {period_us}")

    def usage(self) -> int:
        return int(self._name("memory.usage_in_bytes", "memory.current").read_text())

    def resident(self) -> int:
        """Usage less the page cache the kernel can drop at will (file pages no process
        maps): what a limit set this far above is really room for; usage itself counts
        every file the replica read, which the kernel reclaims before anything is short."""
        stat = (self.directory / "memory.stat").read_bytes()
        prefix, mapped = (
            (b"total_", b"total_mapped_file") if self.version == 1 else (b"", b"file_mapped")
        )
        fields = [
            stat_field(stat, prefix + name) or 0 for name in (b"inactive_file", b"active_file")
        ]
        return self.usage() - max(0, sum(fields) - (stat_field(stat, mapped) or 0))

    def reset_peak(self) -> None:
        """The peak counter restarts from the usage now (v2: as read through this fd)."""
        if self.version == 1:
            (self.directory / "memory.max_usage_in_bytes").write_text("0")
            return
        if self._peak_fd is None:
            self._peak_fd = os.open(self.directory / "memory.peak", os.O_RDWR)
        os.write(self._peak_fd, b"reset")

    def peak(self) -> int:
        if self.version == 1:
            return int((self.directory / "memory.max_usage_in_bytes").read_text())
        assert self._peak_fd is not None, "reset_peak first"
        return int(os.pread(self._peak_fd, 64, 0))

    def oom_kills(self) -> int:
        text = self._name("memory.oom_control", "memory.events").read_bytes()
        return stat_field(text, b"oom_kill") or 0

    def limit_hits(self) -> int | None:
        """v1's failcnt: how often usage reached the limit (page cache reclaim included)."""
        if self.version != 1:
            return None
        return int((self.directory / "memory.failcnt").read_text())

    def remove(self, timeout_s: float = 30) -> None:
        """Kill whatever is still inside (only processes the test started), then rmdir."""
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                self.directory.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


CONTROL_FILES = {"memory": ("memory.limit_in_bytes", "memory.max"),
                 "cpu": ("cpu.cfs_quota_us", "cpu.max")}  # fmt: skip


def make_child_cgroup(
    name: str, controller: str = "memory", parent: ChildCgroup | None = None
) -> ChildCgroup:
    """A new child of this process's ``controller`` cgroup (or of ``parent``, one made
    here); OSError where none can be made."""
    if parent is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError as exc:
            raise OSError(f"cannot read this process's cgroups: {exc}") from exc
        own = find_cgroup(controller, proc_cgroup, mountinfo)
        if own is None:
            raise OSError(
                f"no {controller} cgroup found in /proc/self/cgroup and /proc/self/mountinfo"
            )
        base, version, path = Path(own.levels[0][1]), own.version, own.path
        leaf = f"batchfit-{os.getpid()}-{name}"
    else:
        base, version, path, leaf = parent.directory, parent.version, parent.path, name
    directory = base / leaf
    directory.mkdir()
    cgroup = ChildCgroup(directory, version, path.rstrip("/") + "/" + leaf)
    v1_file, v2_file = CONTROL_FILES[controller]
    if not cgroup._name(v1_file, v2_file).exists():
        cgroup.remove()
        raise OSError(f"the {controller} controller is not enabled for {directory}")
    return cgroup
