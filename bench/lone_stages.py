"""Where a lone request's time goes, stage by stage: ``python -m bench.lone --bundled --stages``.

The same calls as ``bench.lone``'s ``--bundled`` (each input through ``Runtime.infer``, and in
turn tokenized and run straight on the runtime's model thread), with a timestamp taken at
each boundary of a request's way: wrappers put around the runtime's own objects for the run
(the queue, the batcher, the model thread, the memory probe, the model's forward pass, the
request's wait), nothing changed in the server's code. The median of each stage is printed
for both paths; what the runtime adds is the difference between the two totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .lone import bundled_runtime, in_turn

if TYPE_CHECKING:
    from server.runtime import Runtime

RUNTIME_STAGES = (
    ("start", "queued", "tokenized and admitted"),
    ("queued", "woke", "until the batcher wakes"),
    ("woke", "planned", "planning"),
    ("planned", "dispatched", "dispatch"),
    ("dispatched", "baseline", "to the model thread"),
    ("baseline", "forward", "the memory baseline"),
    ("forward", "forwarded", "the forward pass"),
    ("forwarded", "back", "back to the event loop"),
    ("back", "settled", "the batch's futures settled"),
    ("settled", "answered", "to the caller"),
)
"""(from, to, what) of ``Runtime.infer``'s way."""
DIRECT_STAGES = (
    ("start", "tokenized", "tokenized"),
    ("tokenized", "forward", "to the model thread"),
    ("forward", "forwarded", "the forward pass"),
    ("forwarded", "back", "back to the event loop"),
    ("back", "answered", "to the caller"),
)
"""The same input tokenized and run straight on the model thread."""


class _Marks:
    """One call's timestamps, the first of each name (both threads write them)."""

    def __init__(self) -> None:
        self.times: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.times.setdefault(name, time.perf_counter_ns())

    def take(self) -> dict[str, int]:
        times, self.times = self.times, {}
        return times


@contextlib.contextmanager
def _hooked(runtime: Runtime, marks: _Marks) -> Iterator[Callable[..., Any]]:
    """Wrap the runtime's objects so that a call marks each boundary; yields the timed
    forward pass (the lane's: the model's, behind the thread guard where there is one), which
    the direct path calls too. Everything is restored on exit."""
    import batching.model_thread as model_thread_module
    from server.runtime.waiting import RequestWait

    batcher = runtime.batcher
    assert batcher is not None  # started
    (lane,) = batcher.lanes.values()
    probe = batcher.memory.probe
    assert probe is not None
    forward, queue, thread = lane.forward, batcher.queue, runtime.model_thread
    settle, item_done = model_thread_module._settle, RequestWait._item_done
    wait_not_empty, run_in_flight = queue.wait_not_empty, batcher.run_in_flight
    put_many, start_then, start_batch = queue.put_many, thread.start_then, probe.start_batch

    def timed_forward(items: Any) -> Any:
        marks.mark("forward")
        outputs = forward(items)
        marks.mark("forwarded")
        return outputs

    def timed_put_many(pendings: Any) -> None:
        marks.mark("queued")
        put_many(pendings)

    async def timed_wait_not_empty() -> None:
        await wait_not_empty()
        marks.mark("woke")

    async def timed_run_in_flight(planned: Any, on: Any, **kwargs: Any) -> None:
        marks.mark("planned")
        await run_in_flight(planned, on, **kwargs)

    def timed_start_then(*args: Any) -> Any:
        futures = start_then(*args)
        marks.mark("dispatched")
        return futures

    def timed_start_batch() -> int | None:
        marks.mark("baseline")
        return start_batch()

    def timed_settle(*args: Any) -> None:
        if "forwarded" in marks.times:
            marks.mark("back")
        settle(*args)

    def timed_item_done(self: RequestWait, future: asyncio.Future[Any]) -> None:
        marks.mark("settled")
        item_done(self, future)

    lane.forward = timed_forward
    queue.put_many = timed_put_many  # type: ignore[method-assign]
    queue.wait_not_empty = timed_wait_not_empty  # type: ignore[method-assign]
    batcher.run_in_flight = timed_run_in_flight  # type: ignore[method-assign]
    thread.start_then = timed_start_then  # type: ignore[method-assign]
    probe.start_batch = timed_start_batch  # type: ignore[method-assign]
    model_thread_module._settle = timed_settle
    RequestWait._item_done = timed_item_done  # type: ignore[method-assign]
    try:
        yield timed_forward
    finally:
        lane.forward = forward
        del queue.put_many, queue.wait_not_empty, batcher.run_in_flight
        del thread.start_then, probe.start_batch
        model_thread_module._settle = settle
        RequestWait._item_done = item_done  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class Stages:
    runtime: list[dict[str, int]]
    """Each call through ``Runtime.infer``: its timestamps (ns) by boundary."""
    direct: list[dict[str, int]]
    """Each call straight on the model thread."""

    @staticmethod
    def medians(
        calls: list[dict[str, int]], stages: tuple[tuple[str, str, str], ...]
    ) -> list[tuple[str, float, int]]:
        """(what, median in us, calls that marked both ends) of each stage, then the total."""
        rows = []
        for start, end, what in stages:
            took = [c[end] - c[start] for c in calls if start in c and end in c]
            rows.append((what, statistics.median(took) / 1e3 if took else float("nan"), len(took)))
        total = [c["answered"] - c["start"] for c in calls]
        rows.append(("total", statistics.median(total) / 1e3, len(total)))
        return rows

    def describe(self) -> str:
        lines = []
        for name, calls, stages in (
            ("through the runtime", self.runtime, RUNTIME_STAGES),
            ("straight on the model thread", self.direct, DIRECT_STAGES),
        ):
            lines.append(f"{len(calls)} lone calls {name}, median us:")
            for what, us, n in self.medians(calls, stages):
                where = "" if n == len(calls) else f" ({n} calls)"
                lines.append(f"  {what:<30} {us:9.0f}{where}")
        return "\n".join(lines)


async def stages(calls: int, *, gap_s: float = 0.003, warm_up: int = 30) -> Stages:
    marks = _Marks()
    async with bundled_runtime() as (runtime, model):
        with _hooked(runtime, marks) as forward:

            async def through_runtime(text: str) -> dict[str, int]:
                marks.take()
                marks.mark("start")
                await runtime.infer([text], truncate=True, timeout_s=60, request_id="lone")
                marks.mark("answered")
                return marks.take()

            async def direct(text: str) -> dict[str, int]:
                marks.take()
                marks.mark("start")
                items = model.prepare([text], truncate=True)
                marks.mark("tokenized")
                await runtime.model_thread.call(forward, items)
                marks.mark("answered")
                return marks.take()

            ours, theirs = await in_turn(
                through_runtime, direct, calls, gap_s=gap_s, warm_up=warm_up
            )
    return Stages(ours, theirs)
