"""Computations in flight, each shared by every input that waits for the same key.

One ``Flight`` is one queued (or running) ``Pending`` of the model's, owned by the table and
not by any request: a request's inputs get futures of their own that the flight settles.
So a requester that goes away (a disconnect, its deadline) only takes its own futures with
it; the computation carries on while any other waiter remains, and leaves the queue (or has
its result dropped, if it is running) once none does. A waiter that joins raises the
computation's priority and deadline to its own when they are higher, so joining never makes
a request wait longer than it would have alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from batching import InferenceFailed, Pending

from .key import CacheKey

log = logging.getLogger("batchfit")


class Flight:
    """One computation and the futures waiting for its (finished) output."""

    __slots__ = ("_finish", "_on_value", "_settled", "_table", "key", "pending", "waiters")

    def __init__(
        self, key: CacheKey | None, pending: Pending, *,
        finish: Callable[[Any], Any], on_value: Callable[[CacheKey, Any], None] | None,
        table: dict[CacheKey, Flight] | None,
    ) -> None:  # fmt: skip
        self.key = key
        self.pending = pending
        self.waiters: list[asyncio.Future[Any]] = []
        self._finish = finish
        self._on_value = on_value
        self._table = table
        self._settled = False
        pending.future.add_done_callback(self._done)

    @property
    def open(self) -> bool:
        """A new waiter may still join: its waiters are not settled yet and the computation
        was not cancelled. A computation that has just finished stays open until the loop
        runs its done callback, which hands the output to every waiter joined by then (an
        equal input arriving in that gap would otherwise run again)."""
        return not self._settled and not self.pending.future.cancelled()

    def join(self, waiter: asyncio.Future[Any], *, priority: int, deadline_s: float) -> bool:
        """Add ``waiter``; return whether the priority rose (the queue must re-sort it)."""
        self.waiters.append(waiter)
        pending = self.pending
        pending.deadline_s = max(pending.deadline_s, deadline_s)
        return priority > pending.priority

    def leave(self, waiter: asyncio.Future[Any]) -> bool:
        """Drop ``waiter`` (its request is over); True if the computation was cancelled,
        having no waiter left."""
        try:
            self.waiters.remove(waiter)
        except ValueError:
            return False
        if not self.waiters and not self.pending.future.done():
            self.pending.future.cancel()
            return True
        return False

    def _done(self, future: asyncio.Future[Any]) -> None:
        self._settled = True
        if self._table is not None and self._table.get(self.key) is self:  # type: ignore[arg-type]
            del self._table[self.key]  # type: ignore[arg-type]
        waiters, self.waiters = self.waiters, []
        if future.cancelled():
            for waiter in waiters:
                waiter.cancel()
            return
        error = future.exception()
        if error is None:
            try:
                value = self._finish(future.result())
            except Exception:  # a bug in shaping must still end every waiter
                log.exception("shaping an output failed")
                error = InferenceFailed("inference failed")
            else:
                if self._on_value is not None and self.key is not None:
                    self._on_value(self.key, value)
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(value)
                return
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)
