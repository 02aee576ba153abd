"""What the replica still owes: requests inside ``Runtime.infer`` and their open item futures.

A drain waits for this to reach zero; a soak reads the gauges to prove nothing leaked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge

from batching import Clock, MonotonicClock, Pending


class WorkTracker:
    def __init__(self, registry: CollectorRegistry, *, clock: Clock | None = None) -> None:
        self.active_requests = 0
        self._clock = clock or MonotonicClock()
        self._open: set[asyncio.Future[object]] = set()
        self._waits: set[asyncio.Future[None]] = set()
        """The waits of requests admitted in pieces (``pieces``): between two pieces such a
        request may have no open item for ``fail_open`` to end it through."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._admitted = asyncio.Event()  # set by every request; cleared by wait_quiet
        self._never = asyncio.Event()  # wait_quiet's sleep: a wait until its deadline
        self._last_end_s = self._clock.now()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._request = _Request(self)
        Gauge(
            "batchfit_active_infer_requests",
            "Inference requests admitted and not yet answered (a drain waits for 0).",
            registry=registry,
        ).set_function(lambda: self.active_requests)
        Gauge(
            "batchfit_open_items",
            "Admitted items whose future has not ended, queued or running; 0 when idle "
            "(anything else when idle is a leak).",
            registry=registry,
        ).set_function(lambda: len(self._open))
        Gauge(
            "batchfit_event_loop_tasks",
            "asyncio tasks alive on the replica's event loop (a rising idle value is a leak).",
            registry=registry,
        ).set_function(self._num_tasks)

    @property
    def open_items(self) -> int:
        return len(self._open)

    def attach(self) -> None:
        """Read task counts from the running loop."""
        self._loop = asyncio.get_running_loop()

    def answered(self) -> bool:
        """Whether every admitted request has left ``Runtime.infer`` (none in progress)."""
        return self.active_requests == 0

    def request(self) -> _Request:
        """Count one request from admission to its answer: ``with work.request(): ...``."""
        return self._request

    def _begin(self) -> None:
        self.active_requests += 1
        self._idle.clear()
        self._admitted.set()

    def _end(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._last_end_s = self._clock.now()
            self._idle.set()

    def track(self, pendings: Sequence[Pending]) -> None:
        for pending in pendings:
            self._open.add(pending.future)
            pending.future.add_done_callback(self._open.discard)

    def track_wait(self, wait: asyncio.Future[None]) -> None:
        self._waits.add(wait)
        wait.add_done_callback(self._waits.discard)

    def fail_open(self, error: Exception) -> int:
        """End every open item future, and every request admitted in pieces, with ``error``;
        return how many items there were."""
        failed = 0
        for future in list(self._open):
            if not future.done():
                future.set_exception(error)
                failed += 1
        for wait in list(self._waits):
            if not wait.done():
                wait.set_exception(error)
        return failed

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is active; False if ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def wait_quiet(self, quiet_s: float) -> None:
        """Wait until a request has been admitted since the last return, and then none has
        been in progress for ``quiet_s`` seconds. One waiter at a time.

        It sleeps until ``quiet_s`` after the latest request ended, and only then looks
        again: requests that come and go meanwhile wake nothing, so a busy replica pays a
        wake-up or two per ``quiet_s``, not one per request."""
        await self._admitted.wait()
        while True:
            if self.active_requests:
                await self._idle.wait()
                continue
            due = self._last_end_s + quiet_s
            if self._clock.now() >= due:
                self._admitted.clear()
                return
            await self._clock.wait(self._never, due)

    def _num_tasks(self) -> int:
        loop = self._loop
        if loop is None or loop.is_closed():
            return 0
        return len(asyncio.all_tasks(loop))


class _Request:
    """``WorkTracker.request()``: one object for every request (it holds no state of its
    own), entered and left as a plain context manager, without a generator per request."""

    __slots__ = ("_work",)

    def __init__(self, work: WorkTracker) -> None:
        self._work = work

    def __enter__(self) -> None:
        self._work._begin()

    def __exit__(self, *exc_info: object) -> None:
        self._work._end()
