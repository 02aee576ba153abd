"""What a lone request costs the runtime, without HTTP: ``Runtime.infer`` called back to back.

``python -m bench.lone`` starts a ``Runtime`` serving the no-op model on a uvloop event loop
(the server's settings, the output cache off), makes one call after another, each awaited
before the next (one client's requests: every one a batch of one), and prints the wall time
and the event loop thread's CPU time per call. It measures the queue, the batcher, the
hand-off to the model thread and back and the runtime's bookkeeping, with warm caches; what a
replica adds on top (HTTP, validation, the answer's JSON) is ``bench.layers``'s and
``bench.profile``'s. ``--wait-s`` sleeps before the timed calls, to attach a profiler
(``py-spy record --pid PID``, the pid is printed).

``--bundled`` serves the bundled model instead and sets each call against the same input run
straight on the runtime's own model thread (tokenized inline, one hand-off there and back,
the model's forward pass): what the runtime adds around a real forward pass, the two taking
turns, with ``--gap-ms`` of quiet before each call as between one client's requests.
``--stages`` also times each stage of both paths (``bench.lone_stages``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import uvloop

from .comparisons import NOOP_MODEL
from .inprocess import started_runtime

if TYPE_CHECKING:
    from models import Model
    from server.runtime import Runtime

T = TypeVar("T")


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
    async with started_runtime(NOOP_MODEL, cache_bytes=0) as runtime:

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
    return LoneCalls(calls, wall / calls, cpu / calls, batches)


@dataclass(frozen=True, slots=True)
class AgainstDirect:
    runtime_s: list[float]
    """Each call's wall time through ``Runtime.infer``."""
    direct_s: list[float]
    """The same inputs' wall times straight on the model thread."""

    def describe(self) -> str:
        runtime, direct = statistics.median(self.runtime_s), statistics.median(self.direct_s)
        extra = statistics.mean(self.runtime_s) - statistics.mean(self.direct_s)
        return (
            f"{len(self.runtime_s)} lone calls of the bundled model: p50 {runtime * 1e3:.2f} ms "
            f"through the runtime, {direct * 1e3:.2f} ms straight on its model thread "
            f"({runtime / direct:.3f}); the runtime adds {extra * 1e6:.0f} us a call on average"
        )


async def in_turn(
    ours: Callable[[str], Awaitable[T]], theirs: Callable[[str], Awaitable[T]], calls: int, *,
    gap_s: float, warm_up: int,
) -> tuple[list[T], list[T]]:  # fmt: skip
    """``ours`` and ``theirs`` called in turn on the same mixed-length inputs, ``gap_s`` of
    quiet before each call as between one client's requests, after ``warm_up`` untimed turns;
    what each returned for the timed calls."""
    from .workload import WorkloadSpec, make_requests

    texts = [r[0] for r in make_requests(WorkloadSpec(), warm_up + calls, single_input=True)]
    for text in texts[:warm_up]:
        await ours(text)
        await theirs(text)
    timed: tuple[list[T], list[T]] = ([], [])
    for i, text in enumerate(texts[warm_up:]):
        # Which goes first alternates, so that neither always follows the other's pass.
        for run, results in ((ours, timed[0]), (theirs, timed[1]))[:: 1 if i % 2 else -1]:
            await asyncio.sleep(gap_s)
            results.append(await run(text))
    return timed


@contextlib.asynccontextmanager
async def bundled_runtime() -> AsyncIterator[tuple[Runtime, Model]]:
    """A runtime serving the bundled model (the output cache off), and that model."""
    from models.spec import BUNDLED_MODEL

    async with started_runtime(BUNDLED_MODEL, cache_bytes=0) as runtime:
        model = runtime.slots[next(iter(runtime.slots))].model
        assert model is not None  # loaded
        yield runtime, model


async def against_direct(calls: int, *, gap_s: float = 0.003, warm_up: int = 30) -> AgainstDirect:
    async with bundled_runtime() as (runtime, model):

        async def through_runtime(text: str) -> float:
            started = time.perf_counter()
            await runtime.infer([text], truncate=True, timeout_s=60, request_id="lone")
            return time.perf_counter() - started

        async def direct(text: str) -> float:
            started = time.perf_counter()
            items = model.prepare([text], truncate=True)
            await runtime.model_thread.call(model.forward, items)
            return time.perf_counter() - started

        ours, theirs = await in_turn(through_runtime, direct, calls, gap_s=gap_s, warm_up=warm_up)
    return AgainstDirect(ours, theirs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lone", description=__doc__)
    parser.add_argument("--calls", type=int, help="default: 20000, or 300 with --bundled")
    parser.add_argument("--wait-s", type=float, default=0.0)
    parser.add_argument("--bundled", action="store_true",
                        help="the bundled model, against its model thread directly")  # fmt: skip
    parser.add_argument("--stages", action="store_true",
                        help="with --bundled: the median of each stage of both paths")  # fmt: skip
    parser.add_argument("--gap-ms", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.stages and not args.bundled:
        parser.error("--stages goes with --bundled")
    if args.bundled:
        calls = args.calls or 300
        if args.stages:
            from .lone_stages import stages

            print(uvloop.run(stages(calls, gap_s=args.gap_ms / 1000)).describe())
            return 0
        print(uvloop.run(against_direct(calls, gap_s=args.gap_ms / 1000)).describe())
        return 0
    result = uvloop.run(lone_calls(args.calls or 20000, wait_s=args.wait_s))
    print(
        f"{result.calls} lone calls: {result.wall_s * 1e6:.0f} us each, "
        f"{result.loop_cpu_s * 1e6:.0f} us of the event loop's CPU"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
