"""What an API process's routes hold of the engine besides ``RemoteRuntime`` itself: a
model it serves (``RemoteSlot``), its queue's depth, a generation request sent to it
(``RemoteGeneration``), and the errors of an engine that is gone or late.

A generation request's tokens come back as they are generated: one ``TOKENS`` message per
batch of events the engine read from its stream, then ``END``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from generation import RequestStream, SequenceSpec, TokenEvent
from models import ModelInfo

from ..errors import ApiError
from ..runtime import ClientDisconnected, ClientWatch
from . import wire

if TYPE_CHECKING:
    from .remote import RemoteRuntime

DEADLINE_GRACE_S = 5.0
"""The engine answers 504 at a request's deadline; this long after it, we do."""
ENGINE_LATE = "the engine did not answer in time"


def engine_gone() -> ApiError:
    return ApiError(
        503, "engine_unavailable", "the engine process of this replica stopped; retry",
        retry_after_s=1,
    )  # fmt: skip


class RemoteSlot:
    """A model served by the engine: what the routes read of a ``ModelSlot``."""

    def __init__(
        self, name: str, card: dict[str, Any], preparer: Any, inline: float, idle_inline: float
    ) -> None:
        self.name = name
        self._card = card
        self.model = preparer
        self.inline_tokenize_chars = inline
        self.idle_inline_chars = idle_inline

    @property
    def info(self) -> ModelInfo:
        return self.model.info

    def card(self) -> dict[str, Any]:
        return dict(self._card)


class QueueDepth:
    """``len()`` of the engine's queue, as last reported (the status page reads it)."""

    def __init__(self) -> None:
        self.depth = 0

    def __len__(self) -> int:
        return self.depth


class RemoteGeneration:
    """One generation request sent to the engine, as ``GenerationRun`` to the routes: its
    events as they come (``TOKENS``), until the engine's ``END`` or an error: the engine's
    (``ERROR``), the client gone, no first event ``DEADLINE_GRACE_S`` past the deadline, or
    the engine lost. ``close`` it when done: the engine is told to cancel what still runs."""

    def __init__(self, runtime: RemoteRuntime, number: int, model: str) -> None:
        self.model = model
        self.number = number
        self._runtime = runtime
        self.stream = RequestStream(num_sequences=None)
        """The engine's events for it; closed by ``END`` (after them), or by an error."""
        self._sent = False
        self._engine_done = False  # the engine has forgotten it (END, ERROR, or our CANCEL)
        self._timer: asyncio.TimerHandle | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._closed = False

    def start(
        self, specs: Sequence[SequenceSpec], *, priority: int, timeout_s: float,
        client: ClientWatch | None,
    ) -> None:  # fmt: skip
        # NOTE: as ``_call``: a client gone already fails the run here, and the engine hears
        # nothing of it.
        if client is not None:
            self._unsubscribe = client.subscribe(lambda: self.fail(ClientDisconnected()))
        if self.stream.failed:
            return
        self._runtime._send(
            wire.GENERATE, (self.number, self.model, priority, timeout_s), wire.dumps(list(specs))
        )
        self._sent = True
        # Only the first event has a deadline: a generation may then run for minutes.
        self._timer = asyncio.get_running_loop().call_later(
            timeout_s + DEADLINE_GRACE_S,
            self.fail, ApiError(504, "deadline_exceeded", ENGINE_LATE),
        )  # fmt: skip

    # -- from the engine -----------------------------------------------------------------

    def put(self, events: list[TokenEvent]) -> None:
        self._heard()
        for event in events:
            self.stream.put(event)

    def end(self, error: BaseException | None = None) -> None:
        """The engine's ``END`` (None) or ``ERROR``."""
        self._heard()
        self._engine_done = True
        if error is not None:
            self.fail(error)
        else:
            self.stream.end()

    def _heard(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- ends here -----------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` after the events already in it; the engine is told
        to cancel (where it is still there to hear it)."""
        if self.stream.closed:
            return
        self.stream.fail(error)
        self._heard()
        self._cancel()

    def _cancel(self) -> None:
        if self._sent and not self._engine_done:
            self._engine_done = True  # it ignores a CANCEL for a number it has forgotten
            self._runtime._send(wire.CANCEL, (self.number,))

    async def next_events(self) -> list[TokenEvent]:
        """As ``RequestStream.next_events``."""
        return await self.stream.next_events()

    def close(self) -> None:
        """Done with it: the engine cancels any sequence that still runs."""
        if self._closed:
            return
        self._closed = True
        self._heard()
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._cancel()
        self._runtime._generations.pop(self.number, None)
