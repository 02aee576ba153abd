"""Forward passes side by side on a CPU, each on its own model thread and its share of the cores.

On a CPU, one pass on every core loses to the same cores split between passes that run at
once: a pass on one thread needs no barrier between its threads after each operator, where
every thread of a pass on all of them waits at each barrier for any one that other work (the
event loop, a neighbour) has taken off its CPU. So while work waits, ``SideBySide`` runs up
to one pass per thread it was given, each through its lane's ``side_forward`` (its share of
the cores), and a batch planned while nothing runs and nothing else waits runs alone on the
model thread, on every core, as without it: one client's latency does not change.

Memory: a pass beside others is planned within the memory they share (free memory less
headroom) less the predicted peaks of the passes running, and is not measured (its peak is
the whole process's); only passes alone correct the memory model. Passes beside others are
timed by a time model of their own. It is meant for a host where memory cannot bind
(``room_for_passes``), and for heavy passes only: while the model thread's passes are light
enough to share the event loop's CPU (``affinity``), every pass runs alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .model_thread import ModelThread
from .planner import BatchBudget

if TYPE_CHECKING:
    from .batcher import Batcher
    from .lanes import LaneState

SIDE_MEMORY_SHARE = 0.5
"""Passes side by side only where that many of the largest batch the caps allow fit within
this share of the memory budget."""


def room_for_passes(budget: BatchBudget, passes: int, max_len: int) -> bool:
    """Whether ``passes`` of the largest batch the caps allow, at any length up to
    ``max_len``, are predicted to fit within ``SIDE_MEMORY_SHARE`` of the memory they would
    share (False where the budget has no memory model to tell)."""
    if budget.shared_bytes is None or budget.predict_bytes is None:
        return False
    peak = max(
        budget.predict_bytes(max(1, min(budget.max_items, budget.max_tokens // length)), length)
        for length in range(1, max_len + 1)
    )
    return passes * peak <= SIDE_MEMORY_SHARE * budget.shared_bytes


class SideBySide:
    """Runs the batcher's passes on ``main`` and ``others`` (one pass each at a time)."""

    def __init__(self, batcher: Batcher, main: ModelThread, others: Sequence[ModelThread]) -> None:
        self._batcher = batcher
        self._main = main
        self._free = [*others, main]  # free threads; a pass alone runs on ``main``
        self._running: dict[asyncio.Task[None], tuple[ModelThread, float]] = {}
        self._error: BaseException | None = None
        batcher.metrics.passes_at_once.set(len(self._free))

    async def run(self) -> None:
        """Plan and start passes for ever; a pass's unexpected error (a device error) ends
        this, and every pass still running is cancelled (its items fail in ``Batcher.run``)."""
        queue = self._batcher.queue
        try:
            while True:
                if self._error is not None:
                    raise self._error
                queue.changed.clear()
                if self._free and queue.waiting(1) and await self._start():
                    continue
                await queue.changed.wait()
        finally:
            tasks = list(self._running)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _can_go_beside(self, lane: LaneState | None) -> bool:
        """Whether ``lane``'s next batch may run beside others: it has a side forward, its
        budget tells the memory passes share (none planned yet: ``next_batch`` tells), and
        the passes are heavy."""
        if lane is None or lane.side_forward is None:
            return False
        colocation = self._main.colocation
        if colocation is not None and colocation.light:
            return False
        budget = lane.budget
        return budget is None or (
            budget.shared_bytes is not None and budget.predict_bytes is not None
        )

    async def _start(self) -> bool:
        """Plan the next batch and start its pass; False where none could start now (the
        caller waits for a change: a pass ending, more work)."""
        batcher = self._batcher
        head = batcher.queue.waiting(1, now=batcher.clock.now())
        lane = batcher.lanes.get(head[0].model) if head else None
        beside = self._can_go_beside(lane)
        if self._running and not beside:
            return False
        beside_bytes = sum(predicted for _, predicted in self._running.values())
        planned = await batcher.next_batch(beside_bytes=beside_bytes if self._running else None)
        if planned is None:
            # Expired or refused items left the queue (plan again), or nothing fits beside
            # the passes running (wait for one to end).
            return not self._running
        if not self._running and (not beside or not batcher.queue.waiting(1)):
            # Alone: nothing may start beside it, so it runs here, as ``Batcher.step`` runs
            # every pass (a lone request's path has no task more).
            await batcher.run_in_flight(planned, self._main)
            return True
        thread = self._free.pop()
        budget, batch = planned.lane.budget, planned.batch
        predicted = 0.0
        if budget is not None and budget.predict_bytes is not None:
            predicted = budget.predict_bytes(len(batch), max(p.cost for p in batch))
        task = asyncio.create_task(batcher.run_in_flight(planned, thread, side=True))
        self._running[task] = (thread, predicted)
        batcher.metrics.side_by_side.inc()
        task.add_done_callback(self._ended)
        return True

    def _ended(self, task: asyncio.Task[Any]) -> None:
        thread, _ = self._running.pop(task)
        self._free.append(thread)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
        self._batcher.queue.changed.set()
