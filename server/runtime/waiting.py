"""One request's wait for its items, without a task of its own.

The request's handler awaits one future. The last item's result settles it, and so does the
first failure, the deadline (a timer on the loop) or the client going away (a callback from
the connection): whichever comes first. Nothing else is scheduled per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from batching import InferenceFailed


class ClientDisconnected(Exception):
    """The client went away before its answer; its queued items were dropped."""


class ClientWatch(Protocol):
    """Tells whoever subscribes that the client of one request has gone away."""

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (on the event loop) once the client is gone, at once if it
        already is; return a function that cancels the subscription."""
        ...


class RequestWait:
    """Settles ``future`` when every one of a request's inputs has its result, or with the
    first input's error, ``deadline_error()`` after ``timeout_s``, or
    ``ClientDisconnected``.

    Made before the inputs are admitted, so that each input's future is passed to
    ``item_done`` in the turn of the loop that ends it (``InputCache.admit``'s ``on_done``):
    the request resumes one turn after the batcher settles its last input, not three. ``start``
    then counts the futures not done yet (a cache hit's is) and arms the deadline and the
    client watch."""

    __slots__ = ("_remaining", "_timer", "_unsubscribe", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[None] = loop.create_future()
        self._remaining = 0
        self._timer: asyncio.TimerHandle | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def start(
        self,
        futures: Sequence[asyncio.Future[Any]],
        *,
        timeout_s: float,
        deadline_error: Callable[[], BaseException],
        client: ClientWatch | None = None,
    ) -> None:
        """Wait for ``futures`` (one per input): each not done now must reach ``item_done``
        once it is."""
        for future in futures:
            if future.done():
                self._check(future)
            else:
                self._remaining += 1
        if self._remaining == 0 and not self.future.done():
            self.future.set_result(None)
        loop = self.future.get_loop()
        self._timer = loop.call_later(timeout_s, self._expire, deadline_error)
        if client is not None:
            self._unsubscribe = client.subscribe(lambda: self._settle(ClientDisconnected()))

    def item_done(self, future: asyncio.Future[Any]) -> None:
        """One input's future has ended (``start`` found it not done)."""
        if self._check(future) and not self.future.done():
            self._remaining -= 1
            if self._remaining == 0:
                self.future.set_result(None)

    def _check(self, future: asyncio.Future[Any]) -> bool:
        """Whether ``future`` has its result; its error, if any, settles the wait."""
        # NOTE: every item's error is retrieved, even once the wait is over, or asyncio logs
        # "exception was never retrieved" for the items that failed after the first.
        error = (
            InferenceFailed("an input was cancelled before its answer")
            if future.cancelled()
            else future.exception()
        )
        if error is not None:
            self._settle(error)
        return error is None

    def _expire(self, deadline_error: Callable[[], BaseException]) -> None:
        self._settle(deadline_error())

    def _settle(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def close(self) -> None:
        """Stop the timer and the client watch (the wait is over, whichever way)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if not self.future.done():
            self.future.cancel()
        elif not self.future.cancelled():
            self.future.exception()  # retrieved: no "exception was never retrieved" warning
