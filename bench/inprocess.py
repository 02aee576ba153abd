"""A ``Runtime`` started in the benchmark's own process, as a replica starts one: the bench
tools that leave HTTP out (``bench.lone``, ``bench.engine``) drive it directly."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

if TYPE_CHECKING:
    from server.runtime import Runtime


@contextlib.asynccontextmanager
async def started_runtime(model: str, **settings: Any) -> AsyncIterator[Runtime]:
    """A runtime serving ``model`` with the server's settings (``settings`` override some),
    started and ready, stopped on exit; its start-up error, if any, is raised."""
    from server.heap import freeze_startup_heap
    from server.runtime import Runtime
    from server.settings import Settings

    runtime = Runtime(
        Settings(model=(model,), **settings), registry=CollectorRegistry(),
        on_ready=freeze_startup_heap,
    )  # fmt: skip
    await runtime.start()
    try:
        if runtime.startup_error is not None:
            raise runtime.startup_error
        yield runtime
    finally:
        await runtime.stop()
