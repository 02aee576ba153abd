"""Knowing that a client went away, without a task per request to wait for it.

ASGI reports a disconnect only as a ``http.disconnect`` message from ``receive()``, so an app
that wants to know while it waits for something else needs a second task parked on
``receive()``: two task switches and a cancellation per request. Our HTTP protocol
(``server/one_write.py``) knows first, in ``connection_lost``, so it hands every request a
``ConnectionWatch`` in ``scope["extensions"]`` and calls its subscribers from there. Under
another ASGI server (or an in-process test client) the task on ``receive()`` is the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from starlette.types import Receive, Scope

from .runtime import ClientWatch

EXTENSION = "batchfit.disconnect"


def _nothing() -> None:
    pass


class ConnectionWatch:
    """One per connection (its requests run one at a time): the subscribers of the request
    in progress, called when the connection is lost before that request was answered."""

    __slots__ = ("_subscribers", "lost")

    def __init__(self) -> None:
        self._subscribers: list[Callable[[], None]] = []
        self.lost = False

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        if self.lost:
            callback()
            return _nothing
        self._subscribers.append(callback)
        return lambda: self._unsubscribe(callback)

    def _unsubscribe(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(callback)

    def connection_lost(self) -> None:
        self.lost = True
        subscribers, self._subscribers = self._subscribers, []
        for callback in subscribers:
            callback()


class ReceiveWatch:
    """The fallback: a task waiting on ``receive()`` for ``http.disconnect``, started by
    ``subscribe`` (the request's body must have been read already)."""

    __slots__ = ("_receive",)

    def __init__(self, receive: Receive) -> None:
        self._receive = receive

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        task = asyncio.ensure_future(self._wait(callback))
        return task.cancel

    async def _wait(self, callback: Callable[[], None]) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        callback()


def client_watch(scope: Scope, receive: Receive) -> ClientWatch:
    """The connection's watch where the server provides one, else the fallback."""
    watch = scope.get("extensions", {}).get(EXTENSION)
    return watch if watch is not None else ReceiveWatch(receive)
