"""A request with more inputs than one piece (a rerank over thousands of documents) enters the
queue a piece at a time, as room frees: its inputs are ordinary queue items, batched with
everyone else's, but it never holds more than two pieces of the queue at once, so other
requests are still admitted beside it and queue between its pieces (FIFO among equals).

A piece is ``--max-inputs-per-request`` inputs: the most any request may bring at once, which
the settings guarantee the queue (and one model's share of it) can hold. The first piece is
admitted or refused (429) as a whole request is; a later one waits for room instead, within
the request's deadline, as long as the request's wait has not ended (an error, the deadline,
the client gone, a drain's end)."""

from __future__ import annotations

import asyncio
from typing import Any

from batching import Pending, RequestQueue


class PieceFeeder:
    """Says when the next piece of one request may enter ``queue``: once at most one piece
    of its own is still unanswered (the next is queued while the last runs) and the queue
    has room for it."""

    __slots__ = ("_model", "_outstanding", "_piece", "_queue", "_wake")

    def __init__(self, queue: RequestQueue, *, model: str, piece: int) -> None:
        self._queue = queue
        self._model = model
        self._piece = piece
        self._outstanding = 0
        self._wake: asyncio.Future[None] | None = None

    def fed(self, pendings: list[Pending]) -> None:
        """``pendings`` entered the queue; count them until they end."""
        self._outstanding += len(pendings)
        for pending in pendings:
            pending.future.add_done_callback(self._item_done)

    def _item_done(self, _: Any) -> None:
        self._outstanding -= 1
        wake = self._wake
        if wake is not None and self._outstanding <= self._piece and not wake.done():
            wake.set_result(None)

    async def ready(self, count: int, over: asyncio.Future[Any]) -> bool:
        """Wait until ``count`` more inputs may enter the queue (True), or ``over`` (the
        request's wait) ends first (False)."""
        loop = asyncio.get_running_loop()
        while not over.done():
            if self._outstanding > self._piece:
                self._wake = signal = loop.create_future()
            elif self._queue.has_room(count, self._model):
                return True
            else:
                signal = self._queue.room_freed()
            try:
                await asyncio.wait((over, signal), return_when=asyncio.FIRST_COMPLETED)
            finally:
                signal.cancel()
                self._wake = None
        return False
