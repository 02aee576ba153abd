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
    """Settles ``future`` when every one of ``futures`` (one per input) has its result, or
    with the first input's error, ``deadline_error()`` after ``timeout_s``, or
    ``ClientDisconnected``. With ``count``, it waits for that many inputs' futures, the rest
    given to ``add`` later."""

    __slots__ = ("_remaining", "_timer", "_unsubscribe", "future")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        futures: Sequence[asyncio.Future[Any]],
        *,
        timeout_s: float,
        deadline_error: Callable[[], BaseException],
        client: ClientWatch | None = None,
        count: int | None = None,
    ) -> None:
        self.future: asyncio.Future[None] = loop.create_future()
        self._remaining = len(futures) if count is None else count
        self.add(futures)
        self._timer = loop.call_later(timeout_s, self._expire, deadline_error)
        self._unsubscribe = (
            client.subscribe(lambda: self._settle(ClientDisconnected()))
            if client is not None
            else None
        )

    def add(self, futures: Sequence[asyncio.Future[Any]]) -> None:
        """Wait for ``futures`` too: a request admitted in pieces adds each piece's as it is
        admitted, within the ``count`` it was created with."""
        for future in futures:
            future.add_done_callback(self._item_done)

    def _item_done(self, future: asyncio.Future[Any]) -> None:
        # NOTE: every item's error is retrieved, even once the wait is over, or asyncio logs
        # "exception was never retrieved" for the items that failed after the first.
        error = (
            InferenceFailed("an input was cancelled before its answer")
            if future.cancelled()
            else future.exception()
        )
        if self.future.done():
            return
        if error is not None:
            self._settle(error)
        else:
            self._remaining -= 1
            if self._remaining == 0:
                self.future.set_result(None)

    def _expire(self, deadline_error: Callable[[], BaseException]) -> None:
        self._settle(deadline_error())

    def _settle(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def close(self) -> None:
        """Stop the timer and the client watch (the wait is over, whichever way)."""
        self._timer.cancel()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if not self.future.done():
            self.future.cancel()
        elif not self.future.cancelled():
            self.future.exception()  # retrieved: no "exception was never retrieved" warning
