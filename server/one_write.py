"""One write per response: uvicorn's HTTP protocol over a transport that coalesces writes.

uvicorn writes a response's status line and headers when the app sends
``http.response.start``, and the body as a second write. A replica frozen or killed between
the two has handed Nginx a response head without its body. Nginx picks another replica only
until it has read a response head (``proxy_next_upstream``, even with ``non_idempotent`` and
buffering on), so that client got a 200 cut off after the head. Here everything written to a
connection in one turn of the event loop leaves in one ``send()`` at the start of the next, or
at once when the response is complete, and the app sends a response's head and body in the same
turn: a replica that dies has sent Nginx either nothing of a response (retried elsewhere) or
all of it: the kernel still delivers what one ``send()`` took after a SIGKILL (the request was
read, so the close is a FIN, not a reset).
Only an answer larger than the socket's free send buffer still goes in parts (on loopback a
1.2 MB answer, 256 inputs, went in one).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .disconnect import EXTENSION, ConnectionWatch
from .errors import draining


class CoalescingTransport(asyncio.Transport):
    """Forwards to ``transport``, holding writes until the loop's next turn and joining them."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Send what is held now, in one write."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        # NOTE: after the connection is lost the bytes have nowhere to go; asyncio would only
        # count the write and warn.
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class BodiesUntilShutdown:
    """The app as a connection runs it: once ``refusing`` (the server shuts down), a
    ``receive()`` that returns part of a body raises 503 ``draining`` instead, which the app
    answers as it answers any other."""

    __slots__ = ("app", "refusing")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.refusing = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_until_shutdown() -> Message:
            message = await receive()
            if self.refusing and message.get("more_body", False):
                raise draining()
            return message

        await self.app(scope, receive_until_shutdown, send)


class OneWriteHTTPProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools, else h11) writing through a CoalescingTransport.

    With httptools it also gives each request's scope the connection's ``ConnectionWatch``
    (``server/disconnect.py``), told when the connection is lost. When the server shuts down
    (after the drain), a request whose body is still coming is answered 503 ``draining``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = self._bodies = BodiesUntilShutdown(self.app)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.watch = ConnectionWatch()
        super().connection_made(CoalescingTransport(transport, asyncio.get_running_loop()))

    def on_message_begin(self) -> None:
        # NOTE: a callback of httptools' parser, which h11's protocol does not have: there
        # requests carry no watch and the app falls back to waiting on receive().
        super().on_message_begin()  # type: ignore[misc]
        self.scope["extensions"] = {EXTENSION: self.watch}

    def on_message_complete(self) -> None:
        super().on_message_complete()  # type: ignore[misc]
        # NOTE: uvicorn stops reading the socket while more than 64 KiB of body waits for the
        # app, and reads on only when the app asks for more; after the body's last bytes it
        # never asks, so a client that sent more than about 256 KiB and then went away was
        # never seen to go (its FIN unread, no connection_lost, every input computed). The
        # body is all here: read on, so that a close reaches connection_lost and the watch.
        # A pipelined request (queued behind the one running) keeps reading paused until
        # that one is answered, as uvicorn has it. h11's protocol has no such callback (it
        # pauses after every request and its receive(), the watch's fallback, reads on).
        if not self.pipeline:
            self.flow.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.watch.connection_lost()

    def on_response_complete(self) -> None:
        # The response's last body message was just written: head and body are all held, so
        # they leave now, in one write, rather than at the loop's next turn.
        self.transport.flush()
        super().on_response_complete()

    def shutdown(self) -> None:
        """Called by uvicorn for every connection once it stops (after the drain): a
        request whose body is still coming (a client that stalled half-way) is answered 503
        ``draining`` through the app, and its connection closed after it. uvicorn alone
        would wait for that body until its graceful-shutdown timeout, then cancel the task
        and answer a plain-text 500."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            self._bodies.refusing = True
            cycle.message_event.set()  # wakes a receive() waiting for more of the body
        super().shutdown()  # the answer in progress is the connection's last
