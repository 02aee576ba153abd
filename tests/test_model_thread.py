"""The model thread's ``busy`` (what a stop during start-up asks before it decides not to wait
for a forward pass that cannot be interrupted) and a call's ``first``."""

import asyncio
import threading

import pytest

from batching import ModelThread


async def test_busy_while_a_call_runs_even_once_its_caller_is_cancelled():
    thread = ModelThread("test-busy")
    release = threading.Event()
    try:
        assert not thread.busy
        call = asyncio.ensure_future(thread.call(release.wait, 10))
        await asyncio.sleep(0)
        assert thread.busy
        call.cancel()  # a forward pass in progress runs on
        await asyncio.sleep(0)
        assert thread.busy
        release.set()
        await thread.call(int)  # runs after the first one ended
        assert not thread.busy
    finally:
        release.set()
        thread.close()


async def test_first_gets_the_result_before_the_caller_resumes_and_its_errors_are_dropped():
    thread = ModelThread("test-first")
    seen = []

    def first(result):
        seen.append(result)
        raise ValueError("dropped")

    try:
        assert await thread.call(int, "7", first=first) == 7
        assert seen == [7]
        # A call that fails does not reach ``first``.
        with pytest.raises(ValueError, match="invalid literal"):
            await thread.call(int, "x", first=first)
        assert seen == [7]
    finally:
        thread.close()
