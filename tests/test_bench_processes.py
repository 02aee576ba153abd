"""``python -m bench.processes``: CPU per request split by process, and its table."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.processes import CpuSplit, ProcessRun, cpu_split, held, render

# A parent that burns CPU on a second thread, and a child that burns CPU itself.
TREE = """
import subprocess, sys, threading, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
child = subprocess.Popen([sys.executable, "-c",
    "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\n"
    "time.sleep(30)"])
threading.Thread(target=lambda: (burn(0.4), time.sleep(30)), daemon=True).start()
print("ready", flush=True)
time.sleep(30)
"""


def test_the_split_tells_the_event_loop_other_threads_and_child_processes_apart():
    with subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True) as tree:
        try:
            assert tree.stdout is not None and tree.stdout.readline().strip() == "ready"
            time.sleep(1.5)  # both burners done (0.4 s and 0.6 s of CPU)
            split = cpu_split(tree.pid)
        finally:
            for pid in (*cpu_split(tree.pid).children_s, tree.pid):
                os.kill(pid, 9)
    assert split.other_s >= 0.3  # the parent's second thread
    assert split.loop_s < 0.3  # the main thread started them and slept
    [child_s] = split.children_s.values()
    assert child_s >= 0.5


def test_time_since_counts_a_child_started_meanwhile_whole():
    before = CpuSplit(1.0, 2.0, {10: 0.5})
    after = CpuSplit(1.5, 2.25, {10: 0.75, 11: 0.25})  # 11 started after ``before``
    assert after.since(before) == (0.5, 0.25, 0.5)


def test_holding_the_process_to_cpus_ends_with_the_block():
    before = os.sched_getaffinity(0)
    one = {min(before)}
    with held(one):
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == before
    with held(None):
        assert os.sched_getaffinity(0) == before


def test_the_table_gives_each_replica_s_median_over_the_rounds():
    rounds = [
        [
            ProcessRun(1, 1, rate, mean_s, 250e-6, 25e-6, 0.0),
            ProcessRun(2, 1, rate / 2, 2 * mean_s, 200e-6, 25e-6, 230e-6),
        ]
        for rate, mean_s in ((3000.0, 300e-6), (3400.0, 340e-6), (3200.0, 320e-6))
    ]
    table = render(rounds)
    assert "| 1 | 1 | 3,200 | 320 | 250 | 25 | 0 | 275 |" in table
    assert "| 2 | 1 | 1,600 | 640 | 200 | 25 | 230 | 455 |" in table
