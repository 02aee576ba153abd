"""Graceful drain on SIGTERM: a uvicorn server that drains the replica before it stops.

uvicorn's own handler closes the listening socket at once, so Nginx would see refused
connections and the work queued here would be cut off. This one, on the first SIGTERM or
SIGINT, keeps listening while the runtime drains (readiness 503, new requests 503 ``draining``,
admitted work finishes), and only then lets uvicorn shut down. uvicorn then lets answers in
progress finish, for a short bounded time (``timeout_graceful_shutdown``, server/cli.py); a
request whose body is still arriving (a stalled client) is answered 503 ``draining`` at once
and its connection closed (``OneWriteHTTPProtocol.shutdown``, server/one_write.py). A second
signal answers what is left with 503 at once and stops without waiting.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger("batchfit")


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        *,
        drain: Callable[[], Awaitable[object]],
        abort: Callable[[], object],
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._abort = abort
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._drain_requested = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: deliberately not uvicorn's handler: it re-raises the signal after shutdown,
        # which turns a clean drain into death by SIGTERM instead of exit status 0.
        if self._drain_requested:
            if self.should_exit:
                self.force_exit = True  # a third signal: uvicorn stops waiting for anything
            log.warning("second signal: answering what is left with 503 and stopping")
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._abort)
            self.should_exit = True
            return
        if self._loop is None or self._loop.is_closed():
            self.should_exit = True
            return
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(
            self._drain_then_exit(), name="batchfit-drain"
        )

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            log.exception("drain failed; stopping anyway")
        finally:
            self.should_exit = True
