"""The benchmark of the thread and spin defaults: its busy neighbours spin while it runs and
are gone after."""

from __future__ import annotations

import os
import time

from bench.defaults import busy_cpus


def children_cpu_seconds() -> dict[int, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for task in os.listdir("/proc"):
        if not task.isdigit():
            continue
        try:
            with open(f"/proc/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():  # the parent's pid
            found[int(task)] = (int(fields[11]) + int(fields[12])) / ticks
    return found


def test_busy_cpus_spin_until_the_block_ends():
    before = set(children_cpu_seconds())
    with busy_cpus(2):
        time.sleep(1.0)
        spinning = {pid: s for pid, s in children_cpu_seconds().items() if pid not in before}
        assert len(spinning) == 2
        assert all(seconds >= 0.3 for seconds in spinning.values()), spinning
    assert not set(children_cpu_seconds()) & set(spinning)
