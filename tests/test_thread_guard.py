"""The model's intra-op threads on a busy host: one thread while the passes on every thread
wait for a CPU and one thread proves faster, every thread otherwise. The decisions against a
scripted clock and run delay; the run delay itself read from the kernel, for a thread that
really shares its CPU with a busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, Gauge

from server.runtime.contention import RunDelay, ThreadGuard
from tests.ci import unavailable


@dataclass
class Item:
    cost: int


class Host:
    """A scripted clock and run delay: each pass takes ``pass_s`` on every thread and
    ``one_thread_s`` on one, and waits ``busy_share`` of it for a CPU on every thread."""

    def __init__(self, *, pass_s: float, one_thread_s: float, busy_share: float) -> None:
        self.now = 0.0
        self.delay = 0.0
        self.pass_s, self.one_thread_s, self.busy_share = pass_s, one_thread_s, busy_share
        self.threads_seen: list[int] = []
        self.guard: ThreadGuard | None = None

    def forward(self, items: list[Item]) -> list[str]:
        assert self.guard is not None
        threads = self.guard.threads
        self.threads_seen.append(threads)
        took = self.pass_s if threads > 1 else self.one_thread_s
        self.now += took
        if threads > 1:
            self.delay += took * self.busy_share
        return ["out"] * len(items)

    def idle(self, seconds: float) -> None:
        self.now += seconds


def guarded(host: Host, **kwargs) -> tuple[ThreadGuard, object, list[int], Gauge]:
    applied: list[int] = []
    gauge = Gauge("model_threads", "threads", registry=CollectorRegistry())
    guard = ThreadGuard(
        2, applied.append, run_delay=lambda: host.delay, clock=lambda: host.now,
        window_s=0.5, busy_share=0.15, hold_s=10.0, gauge=gauge, **kwargs,
    )  # fmt: skip
    host.guard = guard
    return guard, guard.wrap(host.forward), applied, gauge


def run(forward, host: Host, seconds: float, items: int = 1) -> None:
    until = host.now + seconds
    while host.now < until:
        assert forward([Item(cost=10)] * items) == ["out"] * items


def test_on_a_quiet_host_every_pass_runs_on_every_thread():
    host = Host(pass_s=0.02, one_thread_s=0.03, busy_share=0.01)
    _, forward, applied, gauge = guarded(host)
    run(forward, host, 30.0)
    assert applied == []
    assert set(host.threads_seen) == {2}
    assert gauge.collect()[0].samples[0].value == 2


def test_on_a_busy_host_passes_stay_on_one_thread_where_it_is_faster():
    host = Host(pass_s=0.04, one_thread_s=0.03, busy_share=0.35)
    guard, forward, applied, gauge = guarded(host)
    run(forward, host, 0.5)  # a window on every thread: busy
    assert applied == [1]
    run(forward, host, 0.5)  # a window on one thread: faster
    assert guard.threads == 1 and guard.num_fallbacks == 1
    assert gauge.collect()[0].samples[0].value == 1
    run(forward, host, 9.0)  # held
    assert applied == [1]
    host.idle(1.0)
    run(forward, host, 0.04)  # the hold is over: every thread again, measured again
    assert applied[:2] == [1, 2]
    run(forward, host, 1.1)  # still busy, and one thread still faster
    assert applied == [1, 2, 1]
    assert guard.num_fallbacks == 2


def test_passes_side_by_side_end_a_trial_and_the_passes_alone_after_them_hold_every_thread():
    """What passes alone showed before or during a spell of passes side by side does not
    hold after it: the next pass alone runs on every thread, and none tries one thread again
    for the hold."""
    host = Host(pass_s=0.04, one_thread_s=0.03, busy_share=0.35)
    guard, forward, applied, gauge = guarded(host)
    run(forward, host, 0.5)  # busy: trying one thread
    assert applied == [1]
    guard.interrupt()  # passes side by side ran (they call it from their own threads)
    assert applied == [1]  # applied on the model thread, before its next pass alone
    run(forward, host, 0.04)
    assert applied == [1, 2] and host.threads_seen[-1] == 2
    assert gauge.collect()[0].samples[0].value == 2
    run(forward, host, 9.0)  # still busy, but no trial within the hold
    assert applied == [1, 2] and set(host.threads_seen[-200:]) == {2}
    run(forward, host, 2.0)  # the hold is over: a new trial; one thread proves faster
    assert applied == [1, 2, 1] and guard.num_fallbacks == 1
    guard.interrupt()
    run(forward, host, 0.04)  # that choice dropped too: every thread
    assert applied == [1, 2, 1, 2] and host.threads_seen[-1] == 2


def test_until_it_begins_a_guard_judges_nothing_however_busy_the_host():
    host = Host(pass_s=0.04, one_thread_s=0.03, busy_share=0.35)
    reads: list[float] = []
    guard, forward, applied, _ = guarded(host, judging=False)
    guard._run_delay = lambda: reads.append(host.delay) or host.delay
    run(forward, host, 5.0)  # warm-up's passes: every thread, no read, no trial
    assert applied == [] and set(host.threads_seen) == {2} and reads == []
    guard.begin()
    run(forward, host, 1.0)
    assert applied[:1] == [1] and reads  # judged from then on: busy, so one thread is tried


async def test_a_replica_s_guard_judges_no_pass_of_its_warm_up(tmp_path, registry, monkeypatch):
    from models.testing import save_tiny_model
    from server.runtime import starting as starting_module
    from server.runtime.contention import RunDelay
    from server.runtime.runtime import Runtime
    from server.runtime.threads import AFFINITY, ThreadCount
    from server.settings import Settings

    folder = save_tiny_model(tmp_path / "m")
    # Two threads from the CPU affinity, as on a host of two CPUs or more: a guard is made.
    monkeypatch.setattr(starting_module, "thread_count", lambda flag: ThreadCount(2, AFFINITY))
    passes: list[str] = []  # the phase of every guarded pass
    reads: list[str] = []  # and of every read of the run delay
    read, wrap = RunDelay.__call__, ThreadGuard.wrap
    monkeypatch.setattr(
        RunDelay, "__call__", lambda self: reads.append(runtime.phase) or read(self)
    )

    def counted(guard, forward):
        guarded = wrap(guard, forward)
        return lambda items: passes.append(runtime.phase) or guarded(items)

    monkeypatch.setattr(ThreadGuard, "wrap", counted)
    runtime = Runtime(Settings(model=(str(folder),), device="cpu"), registry=registry)
    await runtime.start()
    try:
        assert runtime.startup_error is None and runtime.thread_guard is not None
        assert any(phase.startswith("warming up") for phase in passes)
        assert reads == []  # warm-up's passes ran through the guard, unjudged
        await runtime.infer(["a few words"], truncate=True, timeout_s=30, request_id="t")
        assert reads and set(reads) == {"ready"}
    finally:
        await runtime.stop()


def test_while_a_choice_holds_the_passes_run_untimed():
    """Nothing a pass shows during a hold is judged, so none reads its wait for a CPU."""
    host = Host(pass_s=0.04, one_thread_s=0.03, busy_share=0.35)
    reads: list[float] = []
    guard, forward, applied, _ = guarded(host)
    guard._run_delay = lambda: reads.append(host.delay) or host.delay
    run(forward, host, 1.2)  # busy: one thread tried for a window, and it holds
    assert applied == [1] and guard.num_fallbacks == 1
    held = len(reads)
    run(forward, host, 9.0)
    assert len(reads) == held and set(host.threads_seen[-200:]) == {1}
    run(forward, host, 1.0)  # the hold is over: every thread again, judged (busy: a trial)
    assert len(reads) > held and applied[:2] == [1, 2]
    guard.interrupt()
    run(forward, host, 0.04)
    held = len(reads)
    run(forward, host, 9.0)  # the hold after passes side by side: untimed too
    assert len(reads) == held


def test_on_a_busy_host_passes_go_back_to_every_thread_where_one_is_slower():
    """A batch large enough to gain from every thread even while it waits for a CPU."""
    host = Host(pass_s=0.4, one_thread_s=0.7, busy_share=0.35)
    guard, forward, applied, _ = guarded(host)
    run(forward, host, 1.2, items=32)
    assert applied == [1, 2]  # tried one thread for a window, went back
    assert guard.num_fallbacks == 0
    run(forward, host, 8.0, items=32)
    assert applied == [1, 2]  # and tries again no sooner than the hold
    run(forward, host, 3.0, items=32)
    assert applied[2:3] == [1]


def test_short_passes_are_not_counted():
    host = Host(pass_s=0.0005, one_thread_s=0.0001, busy_share=0.9)
    _, forward, applied, _ = guarded(host)
    run(forward, host, 5.0)
    assert applied == []


def test_after_a_short_pass_the_next_is_only_timed():
    """A model that does almost no work pays two clock reads a pass, not two file reads; a
    long pass after short ones is counted from the next one on."""
    host = Host(pass_s=0.0005, one_thread_s=0.0001, busy_share=0.9)
    reads = []
    guard = ThreadGuard(2, lambda n: None, run_delay=lambda: reads.append(1) or host.delay,
                        clock=lambda: host.now, window_s=0.5)  # fmt: skip
    host.guard = guard
    forward = guard.wrap(host.forward)
    for _ in range(100):
        forward([Item(cost=1)])
    assert len(reads) == 1  # the first pass's, before it
    host.pass_s = 0.01
    forward([Item(cost=1)])
    assert len(reads) == 1
    forward([Item(cost=1)])
    assert len(reads) == 3


def test_a_pass_that_raises_still_counts_and_the_error_goes_through():
    host = Host(pass_s=0.6, one_thread_s=0.1, busy_share=0.5)
    guard, _, applied, _ = guarded(host)

    def failing(items):
        host.forward(items)
        raise MemoryError("out of memory")

    forward = guard.wrap(failing)
    with pytest.raises(MemoryError):
        forward([Item(cost=10)])
    assert applied == [1]


def test_an_unreadable_run_delay_leaves_the_threads_alone(caplog):
    def unreadable() -> float:
        raise OSError("no schedstat")

    applied: list[int] = []
    guard = ThreadGuard(2, applied.append, run_delay=unreadable)
    forward = guard.wrap(lambda items: ["out"] * len(items))
    for _ in range(3):
        assert forward([Item(cost=1)]) == ["out"]
    assert applied == [] and guard.threads == 2
    assert sum("cannot read this thread's wait for a CPU" in r.message for r in caplog.records) == 1


def test_a_run_delay_that_stops_reading_on_one_thread_gives_every_thread_back():
    host = Host(pass_s=0.6, one_thread_s=0.1, busy_share=0.5)
    guard, forward, applied, _ = guarded(host)
    forward([Item(cost=10)])
    assert applied == [1]

    def unreadable() -> float:
        raise OSError("gone")

    guard._run_delay = unreadable
    assert forward([Item(cost=10)]) == ["out"]
    assert applied == [1, 2] and guard.threads == 2


def test_one_thread_has_nothing_to_fall_back_from():
    with pytest.raises(ValueError, match="2 threads or more"):
        ThreadGuard(1, lambda n: None)


def busy_process(cpu: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )


def test_the_run_delay_is_the_threads_own_wait_for_a_cpu():
    """A thread that spins on the same single CPU as a busy process waits for it about half
    of the time; on a CPU of its own, far less."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        unavailable(f"a CPU of its own for each case needs 2; this process may use {cpus}")
    shared, own = cpus[0], cpus[1]
    read = RunDelay()
    shares: dict[str, float] = {}

    def spin(name: str, cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})
        before, started = read(), time.monotonic()
        while time.monotonic() - started < 1.0:
            pass
        shares[name] = (read() - before) / (time.monotonic() - started)

    hog = busy_process(shared)
    try:
        time.sleep(0.2)  # the busy process is spinning
        thread = threading.Thread(target=spin, args=("shared", shared))
        thread.start()
        thread.join(30)
    finally:
        hog.kill()
        hog.wait()
    thread = threading.Thread(target=spin, args=("own", own))
    thread.start()
    thread.join(30)
    assert shares["shared"] > 0.3, shares
    assert shares["shared"] > shares["own"] + 0.2, shares
