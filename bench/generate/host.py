"""How busy the host was with other work while a peer was measured: the CPU time the whole
host spent (``/proc/stat``) less the peer's process tree's and the benchmark's own. On a
shared host a level's figures mean little without it."""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.servers import child_pids, process_cpu_seconds


def host_busy_seconds(stat: str | None = None) -> float:
    """CPU time of every CPU not idle or waiting on I/O since boot (user, nice, system, irq,
    softirq, steal), from ``/proc/stat``'s first line; NaN where unreadable."""
    try:
        text = stat if stat is not None else Path("/proc/stat").read_text()
        fields = [int(x) for x in text.splitlines()[0].split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    except (OSError, ValueError, IndexError):
        return math.nan
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and every descendant still running."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += process_cpu_seconds(current) or 0.0
        todo += child_pids(current)
    return total


def own_cpu_seconds() -> float:
    """This process's CPU time and that of its children it has waited for (the limit's)."""
    mine = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class OtherLoad:
    """Measures, between ``start`` and ``stop``, the CPUs (in CPU-seconds per second) that
    neither the peer (``peer_cpu``) nor the benchmark itself used."""

    peer_cpu: Callable[[], float] = lambda: 0.0
    _busy: float = math.nan
    _peer: float = 0.0
    _own: float = 0.0
    _at: float = 0.0

    def start(self) -> None:
        self._busy, self._peer = host_busy_seconds(), self.peer_cpu()
        self._own, self._at = own_cpu_seconds(), time.perf_counter()

    def stop(self) -> float:
        wall = time.perf_counter() - self._at
        busy = host_busy_seconds() - self._busy
        mine = (self.peer_cpu() - self._peer) + (own_cpu_seconds() - self._own)
        return max(0.0, busy - mine) / wall if wall > 0 else math.nan


def wait_for_quiet(
    load: OtherLoad, *, max_wait_s: float, max_other_cpus: float = 0.25, window_s: float = 2.0
) -> float:
    """Wait, in windows of ``window_s``, until other work takes at most ``max_other_cpus``
    (or ``max_wait_s`` has passed); the last window's figure."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        load.start()
        time.sleep(window_s)
        other = load.stop()
        if other <= max_other_cpus or time.perf_counter() >= deadline:
            return other
