"""What a lone request costs the runtime, without HTTP: ``Runtime.infer`` called back to back.

``python -m bench.lone`` starts a ``Runtime`` serving the no-op model on a uvloop event loop
(the server's settings, the output cache off), makes one call after another, each awaited
before the next (one client's requests: every one a batch of one), and prints the wall time
and the event loop thread's CPU time per call. It measures the queue, the batcher, the
hand-off to the model thread and back and the runtime's bookkeeping, with warm caches; what a
replica adds on top (HTTP, validation, the answer's JSON) is ``bench.layers``'s and
``bench.profile``'s. ``--wait-s`` sleeps before the timed calls, to attach a profiler
(``py-spy record --pid PID``, the pid is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

import uvloop
from prometheus_client import CollectorRegistry

from .comparisons import NOOP_MODEL


@dataclass(frozen=True, slots=True)
class LoneCalls:
    calls: int
    wall_s: float
    """Per call."""
    loop_cpu_s: float
    """Per call, on the event loop's thread."""
    batches: int
    """Batches the timed calls ran in (one each: every call ran alone)."""


async def lone_calls(calls: int, *, warm_up: int = 500, wait_s: float = 0.0) -> LoneCalls:
    from server.heap import freeze_startup_heap
    from server.runtime import Runtime
    from server.settings import Settings

    settings = Settings(model=(NOOP_MODEL,), cache_bytes=0)
    runtime = Runtime(settings, registry=CollectorRegistry(), on_ready=freeze_startup_heap)
    await runtime.start()
    try:
        if runtime.startup_error is not None:
            raise runtime.startup_error

        async def one() -> None:
            await runtime.infer(["hello world"], truncate=True, timeout_s=10, request_id="lone")

        for _ in range(warm_up):
            await one()
        if wait_s:
            print(f"pid {os.getpid()}; timed calls in {wait_s:g} s", flush=True)
            await asyncio.sleep(wait_s)
        assert runtime.batcher is not None  # started
        batches = runtime.batcher.num_batches
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(calls):
            await one()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        batches = runtime.batcher.num_batches - batches
    finally:
        await runtime.stop()
    return LoneCalls(calls, wall / calls, cpu / calls, batches)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lone", description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--wait-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    result = uvloop.run(lone_calls(args.calls, wait_s=args.wait_s))
    print(
        f"{result.calls} lone calls: {result.wall_s * 1e6:.0f} us each, "
        f"{result.loop_cpu_s * 1e6:.0f} us of the event loop's CPU"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
