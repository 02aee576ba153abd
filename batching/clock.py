"""Time source for the batcher, replaceable by a fake clock in tests."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    async def wait(self, event: asyncio.Event, deadline: float) -> bool:
        """Wait until ``event`` is set (True) or ``deadline`` passes (False)."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, deadline: float) -> bool:
        timeout = deadline - time.monotonic()
        if event.is_set():
            return True
        if timeout <= 0:
            return False
        # NOTE: asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own.
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return event.is_set()
        return True
