"""An API process's side of the link to the engine, over a real socket pair and pipe."""

from __future__ import annotations

import asyncio
import os
import socket

from prometheus_client import CollectorRegistry

from server import Settings
from server.engine.remote import RemoteRuntime


async def test_an_api_process_starting_up_stops_waiting_once_the_engine_is_gone():
    """An API process still starting when the engine dies (before the engine's first word)
    stops at once, not after the start-up's 30 s wait for that word."""
    engine_end, api_end = socket.socketpair()
    stdin_read, stdin_write = os.pipe()
    exits: list[int] = []
    runtime = RemoteRuntime(
        Settings(), registry=CollectorRegistry(), link_fd=api_end.detach(), index=0,
        stdin_fd=stdin_read, on_exit=exits.append,
    )  # fmt: skip
    try:
        await runtime.start()
        engine_end.close()  # the engine dies: its end of the link and the worker's stdin
        os.close(stdin_write)
        async with asyncio.timeout(5):
            await runtime.heard_from_engine(30.0)
        assert runtime.engine_lost and exits == [1]
        assert not runtime.ready
    finally:
        await runtime.stop()
        os.close(stdin_read)
