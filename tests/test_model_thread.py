"""The model thread's ``busy``: what a stop during start-up asks before it decides not to wait
for a forward pass that cannot be interrupted."""

import asyncio
import threading

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
