"""The model thread's ``busy``: what a stop during start-up asks before it decides not to wait
for a forward pass that cannot be interrupted."""

import asyncio
import threading

import pytest

from batching import ModelThread


async def test_busy_while_a_call_runs_even_once_its_caller_is_cancelled():
    thread = ModelThread("test-busy")
    started, release = threading.Event(), threading.Event()

    def forward() -> bool:
        started.set()
        return release.wait(10)

    try:
        assert not thread.busy
        call = asyncio.ensure_future(thread.call(forward))
        await asyncio.sleep(0)
        assert thread.busy  # queued
        # NOTE: running, not only queued: a call still queued when its caller is cancelled
        # is skipped, and the thread is no longer busy with it.
        assert await asyncio.to_thread(started.wait, 10)
        call.cancel()  # a forward pass in progress runs on
        await asyncio.sleep(0)
        assert thread.busy
        release.set()
        await thread.call(int)  # runs after the first one ended
        assert not thread.busy
    finally:
        release.set()
        thread.close()


async def test_a_call_in_two_parts_answers_before_its_second_part_ends():
    thread = ModelThread("test-then")
    release = threading.Event()
    try:
        answer, rest = await asyncio.wait_for(
            thread.call_then(lambda: ("answer", lambda: release.wait(10) and "rest")), 10
        )
        assert answer == "answer"
        assert not rest.done() and thread.busy  # the second part runs on
        release.set()
        assert await asyncio.wait_for(rest, 10) == "rest"
        assert not thread.busy
    finally:
        release.set()
        thread.close()


async def test_a_call_in_two_parts_without_a_second_part_settles_both_at_once():
    thread = ModelThread("test-then-none")
    try:
        answer, rest = await thread.call_then(lambda: ("answer", None))
        assert answer == "answer"
        await asyncio.sleep(0)  # settled in the same hand-back, not a later one
        assert rest.done() and rest.result() is None
    finally:
        thread.close()


async def test_a_call_in_two_parts_hands_back_each_parts_exception():
    thread = ModelThread("test-then-errors")

    def first_fails():
        raise ValueError("first")

    def second_fails():
        raise KeyError("second")

    try:
        with pytest.raises(ValueError, match="first"):
            await thread.call_then(first_fails)
        answer, rest = await thread.call_then(lambda: ("answer", second_fails))
        assert answer == "answer"
        with pytest.raises(KeyError, match="second"):
            await asyncio.wait_for(rest, 10)
        assert await thread.call(int) == 0  # the thread carries on
    finally:
        thread.close()


async def test_running_for_counts_the_call_in_progress_both_its_parts_and_no_other_time():
    thread = ModelThread("test-running")
    finish = threading.Event()

    def first() -> tuple[str, object]:
        return "answer", lambda: finish.wait(10)

    try:
        assert thread.running_for() == 0.0
        await thread.call(int)
        await asyncio.sleep(0.05)
        assert thread.running_for() == 0.0  # idle after a call: nothing runs
        answer, rest = await thread.call_then(first)
        assert answer == "answer"
        await asyncio.sleep(0.05)
        assert thread.running_for() >= 0.05  # its second part still runs
        finish.set()
        await rest
        await asyncio.sleep(0.05)  # the thread notes the end just after handing it back
        assert thread.running_for() == 0.0
    finally:
        finish.set()
        thread.close()
