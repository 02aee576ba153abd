"""Which of a process's threads burn CPU while some work runs: the threads its torch really
computes with, counted by the kernel (``/proc/PID/task/TID/stat``), not by what it says."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _task_files(pid: int, name: str) -> Iterator[tuple[int, str]]:
    """Each of the process's threads' ``/proc/PID/task/TID/<name>``, with its id."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            yield int(task.name), (task / name).read_text()
        except OSError:  # the thread ended meanwhile
            continue


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each of the process's threads."""
    found = {}
    for tid, stat in _task_files(pid, "stat"):
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
        found[tid] = (int(fields[11]) + int(fields[12])) * TICK_S
    return found


def busy_threads(pid: int, work: Callable[[], object], share: float = 0.5) -> tuple[int, float]:
    """How many threads spent at least ``share`` of the busiest one's CPU time on ``work``,
    and the busiest one's seconds. OpenMP shares a forward pass out evenly, so every thread
    of torch's pool is about as busy as the others, while the event loop and the other
    helpers of a replica use a small fraction of that."""
    before = thread_cpu_s(pid)
    work()
    after = thread_cpu_s(pid)
    used = [seconds - before.get(tid, 0.0) for tid, seconds in after.items()]
    busiest = max(used, default=0.0)
    return sum(1 for seconds in used if seconds >= share * busiest), busiest


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """The CPUs each of the process's threads may run on (``Cpus_allowed_list``)."""
    found = {}
    for tid, status in _task_files(pid, "status"):
        line = next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list:"))
        cpus: set[int] = set()
        for part in line.split(":", 1)[1].strip().split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
        found[tid] = frozenset(cpus)
    return found


def held_threads(pid: int) -> dict[int, frozenset[int]]:
    """The threads of ``pid`` (a child of this process, which inherited its CPUs) held to
    fewer CPUs than this process may use."""
    home = frozenset(os.sched_getaffinity(0))
    return {tid: cpus for tid, cpus in thread_cpus(pid).items() if cpus != home}
