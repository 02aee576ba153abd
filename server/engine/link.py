"""One end of the socket between an API process and the engine: an asyncio protocol that
sends and receives ``wire`` messages.

A plain Unix socket pair, read and written by each side's event loop: a message costs one
``send`` on one side and one wake-up of the other side's loop, with no thread in between.
What is sent while the loop runs one pass goes out in one write at the end of it, so the
answers of one batch, or the requests of many clients, travel together.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

from . import wire

log = logging.getLogger("batchfit")

Handler = Callable[[bytes, Any, list[bytes]], None]
"""Called with each message's kind, unpickled header and payload frames."""


class Link(asyncio.Protocol):
    def __init__(self, on_message: Handler, on_lost: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._unframer = wire.Unframer()
        self._transport: asyncio.Transport | None = None
        self._out: list[bytes | memoryview] = []
        self._flushing = False
        self.closed = False

    @classmethod
    async def open(cls, sock: socket.socket, on_message: Handler,
                   on_lost: Callable[[], None]) -> Link:  # fmt: skip
        link = cls(on_message, on_lost)
        await asyncio.get_running_loop().connect_accepted_socket(lambda: link, sock)
        return link

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        if self._out:
            self._flush()

    def data_received(self, data: bytes) -> None:
        for kind, header, *frames in self._unframer.feed(data):
            try:
                self._on_message(kind, wire.loads(header), frames)
            except Exception:
                log.exception("bad message %r on the engine link", kind)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._out.clear()
        self._on_lost()

    # -- sending -------------------------------------------------------------------------

    def send(self, kind: bytes, header: Any, *frames: bytes | memoryview) -> None:
        """Queue one message; it leaves with the others at the end of this loop pass."""
        self.send_parts([kind, wire.dumps(header), *frames])

    def send_parts(self, parts: Sequence[bytes | memoryview]) -> None:
        if self.closed:
            return
        self._out.append(wire.frame(parts))
        self._out.extend(parts)
        if not self._flushing and self._transport is not None:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self._transport is None or self.closed or not self._out:
            return
        out, self._out = self._out, []
        self._transport.write(b"".join(out))

    def close(self) -> None:
        if self._transport is not None:
            self._flush()
            self._transport.close()
