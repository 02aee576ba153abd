"""The model thread on the event loop's CPU while its forward passes are light, and back on
every CPU once they are heavy: real threads, moved by the kernel (``sched_setaffinity``),
asked where they run (``sched_getcpu``)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

from batching import ModelThread, at_home
from batching.affinity import HOME, LEAVE_S
from tests.ci import unavailable

_getcpu = ctypes.CDLL(None).sched_getcpu


@pytest.fixture(autouse=True)
def loop_thread_restored():
    """The test's event loop runs on pytest's own thread: whatever a test does to it, the
    tests after it run on every CPU again."""
    if len(HOME) < 2:
        unavailable(f"moving threads between CPUs needs 2; this process may use {sorted(HOME)}")
    before = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, before)


def light() -> tuple[tuple[int, set[int]], None]:
    """A forward pass that needs almost no CPU: where it ran, and where it may run."""
    return (_getcpu(), os.sched_getaffinity(0)), None


def heavy() -> tuple[tuple[int, set[int]], None]:
    """A forward pass that needs four times ``LEAVE_S`` of its thread's CPU."""
    started = time.thread_time()
    while time.thread_time() - started < 4 * LEAVE_S:
        pass
    return (_getcpu(), os.sched_getaffinity(0)), None


async def forwards(thread: ModelThread, fn, count: int) -> tuple[int, set[int]]:
    where = None
    for _ in range(count):
        where, rest = await thread.call_then(fn)
        await rest
    assert where is not None
    return where


async def test_light_forward_passes_run_on_the_event_loops_cpu():
    thread = ModelThread("test-colocate", colocate=True)
    try:
        ran_on, allowed = await forwards(thread, light, 20)
        cpu = thread.colocation.cpu
        assert cpu is not None, thread.colocation.cpu_s
        assert os.sched_getaffinity(0) == {cpu}  # the event loop's thread
        assert allowed == {cpu} and ran_on == cpu  # the model thread, asked on it
        assert thread.colocation.num_moves == 1  # held there, not moved per call
    finally:
        thread.close()
    assert os.sched_getaffinity(0) == HOME  # closing lets the event loop go


async def test_heavy_forward_passes_send_both_threads_back_to_every_cpu():
    thread = ModelThread("test-colocate-heavy", colocate=True)
    try:
        await forwards(thread, light, 20)
        assert thread.colocation.cpu is not None
        for _ in range(10):  # the average passes LEAVE_S after a few
            await forwards(thread, heavy, 1)
            if thread.colocation.cpu_s > LEAVE_S:
                break
        _, allowed = await forwards(thread, heavy, 1)
        assert thread.colocation.cpu is None
        assert allowed == HOME and os.sched_getaffinity(0) == HOME
    finally:
        thread.close()


async def test_heavy_forward_passes_never_move_a_thread():
    thread = ModelThread("test-colocate-never", colocate=True)
    try:
        _, allowed = await forwards(thread, heavy, 10)
        assert thread.colocation.num_moves == 0 and thread.colocation.cpu is None
        assert allowed == HOME and os.sched_getaffinity(0) == HOME
    finally:
        thread.close()


async def test_other_calls_run_on_every_cpu_while_forward_passes_share_one():
    """Loading a model reads the process's CPUs for its thread count and starts OpenMP's
    threads, which would inherit one CPU."""
    thread = ModelThread("test-colocate-other", colocate=True)
    try:
        await forwards(thread, light, 20)
        cpu = thread.colocation.cpu
        assert cpu is not None
        assert await thread.call(os.sched_getaffinity, 0) == HOME
        _, allowed = await forwards(thread, light, 1)
        assert allowed == {cpu}  # and the next forward pass is back on the loop's CPU
    finally:
        thread.close()


async def test_threads_and_processes_started_from_the_held_loop_run_on_every_cpu():
    thread = ModelThread("test-colocate-spawn", colocate=True)
    later = ModelThread("test-started-later")  # started by its first call, from the loop
    try:
        await forwards(thread, light, 20)
        assert os.sched_getaffinity(0) == {thread.colocation.cpu}
        assert await later.call(os.sched_getaffinity, 0) == HOME
        with at_home():
            child = subprocess.run(
                [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
        assert child.stdout.strip() == str(sorted(HOME))
        assert os.sched_getaffinity(0) == {thread.colocation.cpu}  # held again after
    finally:
        later.close()
        thread.close()


async def test_without_colocate_nothing_moves():
    thread = ModelThread("test-no-colocate")
    try:
        _, allowed = await forwards(thread, light, 20)
        assert thread.colocation is None
        assert allowed == HOME and os.sched_getaffinity(0) == HOME
    finally:
        thread.close()


def test_close_from_another_thread_lets_the_held_thread_go():
    """The server closes the model thread from its tokenizer thread."""
    thread = ModelThread("test-colocate-close", colocate=True)

    async def run() -> int:
        await forwards(thread, light, 20)
        assert thread.colocation.cpu is not None
        closer = threading.Thread(target=thread.close)
        closer.start()
        closer.join()
        return len(os.sched_getaffinity(0))

    assert asyncio.run(run()) == len(HOME)
