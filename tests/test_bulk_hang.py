"""A bulk job's passes under watch (``bulk.hang``): the longest-running pass on any thread, the
hang called once past the bound or ten times the pass's expected time, what the runner expects
of each pass, and the job's option."""

import threading
import time

import pytest

import bulk.ray
from bulk import JobError, JobSpec
from bulk.attempts import BatchAttempts
from bulk.hang import PassWatch
from bulk.runner import Runner, make_sizer
from tests.bulk_fakes import FakeEmbedder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_longest_running_pass_on_any_thread_is_what_counts():
    clock, hangs = Clock(), []
    watch = PassWatch(10.0, lambda *hang: hangs.append(hang), clock=clock)
    assert watch.running_for() == 0.0
    inside, leave = threading.Event(), threading.Event()

    def other_pass() -> None:
        with watch.passing():
            inside.set()
            leave.wait()

    other = threading.Thread(target=other_pass)
    other.start()
    inside.wait()
    clock.now += 6
    with watch.passing():
        clock.now += 3
        assert watch.running_for() == 9.0  # the other thread's, started first
        assert not watch.check()
    leave.set()
    other.join()
    assert watch.running_for() == 0.0
    with watch.passing():
        clock.now += 9.9
        assert not watch.check() and hangs == []
        clock.now += 0.1
        assert watch.check()
    assert hangs == [(10.0, 10.0)]


def test_the_watch_thread_calls_a_hang_once_and_ends():
    hangs, hung = [], threading.Event()

    def on_hang(running_s: float, bound_s: float) -> None:
        hangs.append(running_s)
        hung.set()

    watch = PassWatch(0.05, on_hang, poll_s=0.01)
    watch.start()
    with watch.passing():
        assert hung.wait(5)
        time.sleep(0.05)  # more polls, still within the same pass
    watch.close()
    assert len(hangs) == 1 and hangs[0] >= 0.05


def test_a_watch_that_sees_no_hang_stops_on_close():
    watch = PassWatch(60.0, lambda *hang: pytest.fail("no pass hung"), poll_s=0.01)
    watch.start()
    with watch.passing():
        time.sleep(0.03)
    watch.close()
    assert not watch._thread.is_alive()


def test_a_pass_expected_to_be_long_is_bounded_by_ten_times_that_instead():
    clock, hangs = Clock(), []
    watch = PassWatch(10.0, lambda *hang: hangs.append(hang), clock=clock)
    with watch.passing(expected_s=0.5):  # 10 x 0.5 s: below the bound of 10 s
        clock.now += 10
        assert watch.check()
    with watch.passing(expected_s=3.0):
        clock.now += 29.9
        assert not watch.check()
        clock.now += 0.1
        assert watch.check()
    assert hangs == [(10.0, 10.0), (30.0, 30.0)]


def test_each_pass_of_the_runner_is_expected_to_take_as_long_as_the_slowest_so_far_did(
    monkeypatch,
):
    """Per unit of the time prior: the first pass, at 2 ms a unit, sets what every later one
    is expected to take (they take 1 ms a unit)."""
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    passes = []  # (units, expected seconds)

    class Recording(PassWatch):
        def passing(self, expected_s=0.0):
            passes.append([None, expected_s])
            return super().passing(expected_s)

    class Timed(FakeEmbedder):
        def forward(self, items):
            units = runner.time_prior.predict(len(items), max(item.cost for item in items))
            passes[-1][0] = units
            clock.now += (0.002 if len(passes) == 1 else 0.001) * units
            return super().forward(items)

    model = Timed()
    sizer = make_sizer(model, max_items=2, max_tokens=4096, headroom=0.0)
    runner = Runner(model, sizer, None)
    runner.watch = Recording(60.0, lambda *hang: None, clock=clock)
    texts = [" ".join(["w"] * n) for n in (1, 5, 9, 2, 30, 3, 7, 4, 12, 6)]
    assert len(runner.run(model.prepare(texts, truncate=True))) == 10
    assert len(passes) >= 3
    assert passes[0][1] == 0.0  # nothing to go by yet
    for units, expected_s in passes[1:]:
        assert expected_s == pytest.approx(0.002 * units)
    assert runner.watch.running_for() == 0.0


def test_the_bound_is_zero_for_never_or_positive():
    assert JobSpec(("in.jsonl",), "out", forward_timeout_s=0).forward_timeout_s == 0
    with pytest.raises(JobError, match="--forward-timeout-s must be 0 or more"):
        JobSpec(("in.jsonl",), "out", forward_timeout_s=-1)
    with pytest.raises(ValueError, match="positive"):
        PassWatch(0, lambda *hang: None)
    with pytest.raises(ValueError, match="forward_timeout_s must be 0 or more"):
        bulk.ray.embed(None, forward_timeout_s=-1)  # refused before Ray is asked anything


def test_an_attempt_left_unfinished_names_the_actor_whose_process_ended_in_it(tmp_path):
    folder = tmp_path / "attempts"
    first, second = BatchAttempts(folder, "run", "node:1"), BatchAttempts(folder, "run", "node:2")
    with first.attempt("batch"):
        assert first.ended("batch") == ["node:1"]
        assert BatchAttempts(folder, "another run").ended("batch") == []
    assert first.ended("batch") == [] and list(folder.iterdir()) == []
    with pytest.raises(RuntimeError), first.attempt("batch"):
        raise RuntimeError("a batch that raises ends its attempt")
    assert first.ended("batch") == []
    died = first.attempt("batch")
    died.__enter__()  # and never left: the process ended inside it
    with second.attempt("batch"):
        assert second.ended("batch") == ["node:1", "node:2"]
    assert second.ended("batch") == ["node:1"]
    assert second.ended("other") == []
    BatchAttempts(folder, "another run").forget()  # the other call's files stay
    assert second.ended("batch") == ["node:1"]
    second.forget()
    assert not folder.exists()
