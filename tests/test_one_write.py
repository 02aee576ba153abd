"""A response's head and body leave a replica in one write (server/one_write.py).

Nginx retries on another replica only until it has read a response head; a replica that dies
between writing its head and its body cuts the client's answer off (see
tests/integration/test_nginx.py::test_a_replica_that_dies_after_its_head_cannot_be_retried).
"""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.server import ServerState

from server.one_write import CoalescingTransport, OneWriteHTTPProtocol

BODY = b'{"outputs":[[0.25,0.5]]}'


def request(connection: bytes = b"keep-alive") -> bytes:
    return (
        b"POST /v1/infer HTTP/1.1\r\nhost: replica\r\ncontent-type: application/json\r\n"
        b"connection: " + connection + b"\r\ncontent-length: 2\r\n\r\n{}"
    )


async def app(scope, receive, send) -> None:
    """Answers as Starlette's Response does: the start message, then the whole body."""
    await receive()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


class RecordingTransport(asyncio.Transport):
    """The socket's side of the transport: each write() is one send() to the kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.closed_after_answer = False

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def answer(protocol_class: type[asyncio.Protocol], data: bytes) -> RecordingTransport:
    """One request through uvicorn's protocol; returns once the whole response is written."""
    config = uvicorn.Config(app, log_config=None, lifespan="off", access_log=False)
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(data)

    async def written() -> None:
        while not b"".join(transport.writes).endswith(BODY):
            await asyncio.sleep(0)

    await asyncio.wait_for(written(), timeout=5)  # a guard against hangs
    await asyncio.sleep(0)  # a close that follows the answer comes in the same turn
    transport.closed_after_answer = transport.closed
    protocol.connection_lost(None)
    return transport


async def test_uvicorn_alone_writes_a_response_head_and_body_apart():
    # Why server/one_write.py exists: if uvicorn ever joins them itself, it can go.
    transport = await answer(AutoHTTPProtocol, request())
    assert len(transport.writes) == 2
    head, body = transport.writes
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert body == BODY


@pytest.mark.parametrize("connection", [b"keep-alive", b"close"])
async def test_a_response_head_and_body_leave_in_one_write(connection):
    transport = await answer(OneWriteHTTPProtocol, request(connection))
    (whole,) = transport.writes
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n")
    assert whole.endswith(b"\r\n\r\n" + BODY)
    assert transport.closed_after_answer == (connection == b"close")


async def test_writes_of_one_loop_turn_are_joined_and_sent_at_the_next():
    inner = RecordingTransport()
    outer = CoalescingTransport(inner, asyncio.get_running_loop())
    outer.write(b"head\r\n\r\n")
    outer.write(bytearray(b"body"))
    assert inner.writes == [] and outer.get_write_buffer_size() == 12
    await asyncio.sleep(0)
    assert inner.writes == [b"head\r\n\r\nbody"]
    outer.write(b"next")
    await asyncio.sleep(0)
    assert inner.writes == [b"head\r\n\r\nbody", b"next"]


async def test_close_sends_what_is_held_first():
    inner = RecordingTransport()
    outer = CoalescingTransport(inner, asyncio.get_running_loop())
    outer.write(b"head\r\n\r\n")
    outer.write(b"body")
    outer.close()
    assert inner.writes == [b"head\r\n\r\nbody"] and inner.closed
    await asyncio.sleep(0)
    assert inner.writes == [b"head\r\n\r\nbody"]


async def test_abort_and_a_lost_connection_drop_what_is_held():
    aborted = RecordingTransport()
    outer = CoalescingTransport(aborted, asyncio.get_running_loop())
    outer.write(b"head")
    outer.abort()
    lost = RecordingTransport()
    other = CoalescingTransport(lost, asyncio.get_running_loop())
    other.write(b"head")
    lost.closed = True  # the peer went away before the loop's next turn
    await asyncio.sleep(0)
    assert aborted.writes == [] and aborted.closed
    assert lost.writes == []


async def test_a_complete_response_leaves_at_once_rather_than_at_the_next_turn():
    seen: dict[str, list[bytes]] = {}
    transport = RecordingTransport()

    async def answering(scope, receive, send) -> None:
        await app(scope, receive, send)
        seen["when the body was sent"] = list(transport.writes)

    config = uvicorn.Config(answering, log_config=None, lifespan="off", access_log=False)
    protocol = OneWriteHTTPProtocol(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(transport)
    protocol.data_received(request())
    async with asyncio.timeout(5):  # a guard against hangs
        while "when the body was sent" not in seen:
            await asyncio.sleep(0)
    (whole,) = seen["when the body was sent"]
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n") and whole.endswith(b"\r\n\r\n" + BODY)
    protocol.connection_lost(None)
