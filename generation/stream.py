"""What a sequence sends its request: token events, then an end.

The sequences of one request share one ``RequestStream``; the engine puts events into it on
the event loop and the request's handler reads them. A stream always ends: with every
sequence's event whose ``finish_reason`` is set, or with an error (``fail``).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()
    """The likeliest tokens at that position: id, text, log probability."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New output of one sequence: ``text`` (may be "" while a character or a possible stop
    string is held back), the ``token_ids`` it came from, their log probabilities where asked
    for, and ``finish_reason`` (``stop`` or ``length``) on its last event."""

    index: int
    """The choice this sequence is, within its request."""
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    """Tokens generated so far (the prompt and the output of usage)."""
    extra: dict[str, object] = field(default_factory=dict)


class RequestStream:
    """The events of one request's sequences (its choices), each tagged with its ``index``:
    a queue with one reader, which never blocks the writer. It ends once every sequence has
    put its end event, or at the first error (``fail``)."""

    __slots__ = ("_ended", "_error", "_events", "_waiter", "closed", "num_sequences")

    def __init__(self, num_sequences: int | None = 1) -> None:
        """``num_sequences`` None: ended by ``end`` or ``fail`` only (a relayed stream)."""
        self.num_sequences = num_sequences
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._error: BaseException | None = None
        self._ended = 0
        self.closed = False
        """Nothing more goes in: every sequence ended, or one failed."""
        self._waiter: asyncio.Future[None] | None = None

    def put(self, event: TokenEvent) -> None:
        if self.closed:
            return
        self._events.append(event)
        if event.finish_reason is not None and self.num_sequences is not None:
            self._ended += 1
            self.closed = self._ended >= self.num_sequences
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` after the events already in it."""
        if self.closed:
            return
        self._error = error
        self.closed = True
        self._wake()

    def end(self) -> None:
        """Nothing more goes in (a stream relayed from elsewhere, whose source said so)."""
        if not self.closed:
            self.closed = True
            self._wake()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_events(self) -> list[TokenEvent]:
        """Every event waiting (at least one); raises the stream's error once the events
        before it are read, and ``EOFError`` once every end event was read."""
        while not self._events:
            if self._error is not None:
                raise self._error
            if self.closed:
                raise EOFError
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = list(self._events)
        self._events.clear()
        return events
