"""The batcher loop: wait for work, plan a batch, run it on the model thread, resolve futures.

One batcher serves every model of a replica (its ``lanes``): the oldest waiting item, by
effective priority then arrival, picks the model that runs next; its batch-mates come from the
same model, sized by that model's sizer against the memory read just before the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .clock import Clock
from .errors import DeadlineExceeded, InferenceFailed, OutOfMemory, ShuttingDown
from .lanes import Lane, LaneState, Planned
from .metrics import BatchingMetrics, MemoryMetrics
from .model_thread import ModelThread
from .planner import BatchBudget, BatchPlan, plan_batch, refused_alone, split
from .probes import MemoryProbe, MemoryReading
from .queue import BatchRun, Pending, RequestQueue
from .readings import Measurement, MemoryWatch, closed_gate, open_gate
from .side import SideBySide
from .sizer import BatchOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    max_wait_s: float = 0.002
    plan_window: int = 1024
    """How many of the oldest waiting items the planner considers."""
    oom_split: bool = True
    """Retry a batch that ran out of memory as two halves; off fails the whole batch."""
    max_length_ratio: float | None = None
    """Longest / shortest item in one batch (see ``plan_batch``); None: no bound."""
    plan_by_time: bool = False
    """Fit a ``BatchTimeModel`` to the batches that ran and plan with it once fitted."""
    max_reading_age_s: float = 0.1
    """The latest memory reading (the model thread's, taken right after a batch) sizes the
    next batch if that one is planned within this long; otherwise the event loop reads anew."""
    min_reading_interval_s: float = 0.0
    """The model thread reads memory after a batch only if the latest reading is at least
    this old; a batch in between is sized from the latest. 0: after every batch."""
    max_reading_share: float | None = None
    """Also space the model thread's readings so that they take at most this share of its
    time (each reading's own duration, averaged, over this share), but never further apart
    than half of ``max_reading_age_s``: under steady load the loop never has to read. None:
    ``min_reading_interval_s`` alone."""


class Batcher:
    """Forms batches from ``queue`` and runs each through its lane's ``forward`` on
    ``model_thread``.

    Only OOM errors (``oom_errors``) take the bisection path; the model layer turns torch's
    errors into those. ``fatal_errors`` fail their batch and end ``run``.
    """

    def __init__(
        self,
        *,
        queue: RequestQueue,
        lanes: Sequence[Lane],
        model_thread: ModelThread,
        clock: Clock,
        metrics: BatchingMetrics,
        config: BatcherConfig,
        oom_errors: tuple[type[BaseException], ...] = (),
        fatal_errors: tuple[type[BaseException], ...] = (),
        probe: MemoryProbe | None = None,
        memory_metrics: MemoryMetrics | None = None,
        answered: Callable[[], bool] | None = None,
    ) -> None:
        if not lanes or len({lane.name for lane in lanes}) != len(lanes):
            raise ValueError(f"lanes need distinct names, got {[lane.name for lane in lanes]}")
        self.queue = queue
        self.clock = clock
        self.metrics = metrics
        self.config = config
        self.lanes = {
            lane.name: LaneState(
                lane,
                metrics=metrics.for_model(lane.name),
                memory_metrics=memory_metrics.for_model(lane.name) if memory_metrics else None,
                plan_by_time=config.plan_by_time,
            )
            for lane in lanes
        }
        self._model_thread = model_thread
        self._answered = answered
        """Whether every caller the batches settled has its answer (the server: none in
        progress); the measurement after a lone batch waits for it (``MemoryWatch``)."""
        self._oom_errors = oom_errors
        self._fatal_errors = fatal_errors
        self.memory = MemoryWatch(
            probe, clock=clock, metrics=memory_metrics, oom_errors=oom_errors,
            max_age_s=config.max_reading_age_s, min_interval_s=config.min_reading_interval_s,
            max_share=config.max_reading_share,
        )  # fmt: skip
        self.healthy = True
        self._in_flight: dict[ModelThread, Sequence[Pending]] = {}
        """The batch each thread runs (left set if cancelled, so ``run`` can fail them)."""
        self.side_by_side: SideBySide | None = None
        """Passes side by side, each on its own thread (``side.py``); None: one at a time."""
        self.num_batches = 0
        metrics.queue_capacity.set(queue.max_items)
        # Read when scraped: a gauge set on every admission and every batch cost each request
        # several metric updates on the event loop.
        metrics.queue_depth.set_function(queue.__len__)
        queue.on_drop = self._count_dropped

    def run_side_by_side(self, side_threads: Sequence[ModelThread]) -> None:
        """From ``run`` on, run passes side by side on the model thread and ``side_threads``
        while work waits (``side.py``); before ``run``."""
        self.side_by_side = SideBySide(self, self._model_thread, side_threads)

    async def run(self) -> None:
        """Step forever. When stopped, whatever is queued or running fails with
        ``ShuttingDown``; when the loop itself crashes, or a forward pass raises one of
        ``fatal_errors`` (a device that cannot be trusted again), with ``InferenceFailed``
        (then re-raised: the owner decides what a dead batcher means)."""
        error: Exception = ShuttingDown("the server stopped before this input ran")
        try:
            if self.side_by_side is not None:
                await self.side_by_side.run()
            else:
                while True:
                    await self.step()
        except Exception as exc:
            self.healthy = False
            what = "the device" if isinstance(exc, self._fatal_errors) else "the batcher"
            error = InferenceFailed(f"{what} failed; this replica is stopping")
            raise
        finally:
            for batch in self._in_flight.values():
                for pending in batch:
                    _fail(pending, error)
            self.fail_waiting(error)

    async def step(self) -> int:
        """Run one batch; return how many items it held."""
        planned = await self.next_batch()
        if planned is None:
            return 0
        await self.run_in_flight(planned, self._model_thread)
        return len(planned.batch)

    async def run_in_flight(
        self, planned: Planned, thread: ModelThread, *, side: bool = False
    ) -> None:
        """``run_batch``, its items failed by ``run`` if this is cancelled meanwhile."""
        batch = planned.batch
        self._in_flight[thread] = batch  # NOTE: left set if cancelled, so run() fails these.
        await self.run_batch(planned.lane, batch, thread, side=side, plan=planned.plan)
        del self._in_flight[thread]

    async def next_batch(self, *, beside_bytes: float | None = None) -> Planned | None:
        """Wait for work, then plan the next batch and take it out of the queue (None: what
        waited expired or was refused). ``beside_bytes``: the predicted peaks of passes
        still running, kept out of its memory budget (None, too, where even the first
        waiting item does not fit beside them, or the budget has no memory model: it is
        left queued)."""
        await self.queue.wait_not_empty()
        lane = self._next_lane()
        if lane is None:
            return None
        reading = self.memory.latest()
        budget = lane.sizer.budget(reading)
        lane.record_budget(budget)
        await self._fill(lane, budget.max_items, budget.max_tokens)

        now = self.clock.now()
        waiting = self.queue.waiting(self.config.plan_window, now=now, model=lane.name)
        waiting = self._drop_expired(waiting)
        if not waiting:
            return None
        priorities = [self.queue.effective_priority(p, now) for p in waiting]
        # The planner's anchor, the first waiting item, runs whatever the budget says:
        # unless it cannot fit alone where the limit kills.
        predicted = refused_alone(waiting[0].cost, budget)
        if predicted is not None:
            self._refuse(lane, waiting[0], predicted, budget, reading)
            return None
        if beside_bytes is not None:
            shared, predict = budget.shared_bytes, budget.predict_bytes
            if shared is None or predict is None:
                return None
            room = shared - beside_bytes
            if budget.max_bytes is not None:
                room = min(room, budget.max_bytes)
            if predict(1, waiting[0].cost) > room:
                return None  # not beside the passes running: after them
            budget = dataclasses.replace(budget, max_bytes=room)
        time_model = lane.time_model
        if beside_bytes is not None and lane.side_time_model and lane.side_time_model.coefficients:
            time_model = lane.side_time_model
        plan = plan_batch(
            [p.cost for p in waiting],
            budget,
            priorities if len(set(priorities)) > 1 else None,
            max_length_ratio=self.config.max_length_ratio,
            predict_time=time_model.predict if time_model and time_model.coefficients else None,
        )
        batch = [waiting[i] for i in plan.indices]
        self.queue.remove(batch)
        return Planned(lane, batch, plan)

    def _refuse(
        self, lane: LaneState, pending: Pending, predicted: float, budget: BatchBudget,
        reading: MemoryReading | None,
    ) -> None:  # fmt: skip
        """Fail one input that cannot fit alone under a limit that kills; the rest of the
        queue is planned from the next step on, as if it had never been there."""
        self.queue.remove([pending])
        room = budget.max_alone_bytes or 0.0
        where = reading.enforced.describe() if reading and reading.enforced else "a limit"
        log.warning(
            "refused an input of %d tokens: predicted peak %.1f MiB alone, %.1f MiB available "
            "under %s", pending.cost, predicted / 2**20, room / 2**20, where,
        )  # fmt: skip
        if lane.memory_metrics is not None:
            lane.memory_metrics.refused.inc()
        message = (
            f"input {pending.index} ({pending.cost} tokens) cannot fit in memory even alone: "
            f"its predicted peak of {predicted:.0f} bytes ({predicted / 2**20:.1f} MiB) exceeds "
            f"the {room:.0f} bytes ({room / 2**20:.1f} MiB) available under {where}, past "
            "which the process is killed rather than failing an allocation; it was not run"
        )
        _fail(pending, OutOfMemory(message, int(predicted)))

    def _next_lane(self) -> LaneState | None:
        """The lane of the oldest waiting item by effective priority, then arrival: no model
        starves another, since every model's oldest item is served in turn."""
        head = self.queue.waiting(1, now=self.clock.now())
        if not head:
            return None
        lane = self.lanes.get(head[0].model)
        if lane is None:
            # A tag no lane serves is a bug upstream; fail those items rather than the loop.
            stray = self.queue.waiting(model=head[0].model)
            self.queue.remove(stray)
            for pending in stray:
                _fail(pending, InferenceFailed(f"no model named {head[0].model!r}"))
        return lane

    @property
    def num_loop_readings(self) -> int:
        """Memory readings taken on the event loop (the rest come with a batch's results)."""
        return self.memory.num_loop_readings

    async def run_calibration(self, items: Sequence[Any], model: str) -> BatchOutcome:
        """Run a synthetic batch (warm-up) through ``model``'s lane and measure it; OOM
        errors propagate."""
        lane = self.lanes[model]
        padded_len = max(item.cost for item in items)
        started = self.clock.now()
        _, peak = await self._model_thread.call(
            self.memory.calibration_forward, lane.forward, items
        )
        elapsed = self.clock.now() - started
        if lane.time_model is not None:
            lane.time_model.observe(len(items), padded_len, elapsed)
        return BatchOutcome(len(items), padded_len, elapsed, peak)

    def record_ceilings(self) -> None:
        """Show every model's ceiling now (after warm-up, before any batch has run)."""
        for lane in self.lanes.values():
            lane.record_ceiling()

    def fail_waiting(self, error: Exception) -> None:
        waiting = self.queue.waiting()
        self.queue.remove(waiting)
        for pending in waiting:
            _fail(pending, error)

    async def _fill(self, lane: LaneState, max_items: int, max_tokens: int) -> None:
        """Wait up to ``max_wait_s`` from the lane's oldest item's arrival for a full batch."""
        oldest = self.queue.waiting(1, model=lane.name)
        if not oldest:
            return
        deadline = oldest[0].arrival_s + self.config.max_wait_s
        while self.clock.now() < deadline:
            waiting = self.queue.waiting(max_items, model=lane.name)
            if len(waiting) >= max_items or sum(p.cost for p in waiting) >= max_tokens:
                return
            self.queue.changed.clear()
            if not await self.clock.wait(self.queue.changed, deadline):
                return

    def _drop_expired(self, waiting: list[Pending]) -> list[Pending]:
        now = self.clock.now()
        expired = [p for p in waiting if p.deadline_s <= now]
        if not expired:
            return waiting
        self.queue.remove(expired)
        for pending in expired:
            _fail(pending, DeadlineExceeded(now - pending.arrival_s))
        return [p for p in waiting if p.deadline_s > now]

    async def run_batch(
        self, lane: LaneState, batch: Sequence[Pending], thread: ModelThread, *,
        side: bool = False, plan: BatchPlan | None = None,
    ) -> None:  # fmt: skip
        """Run ``batch`` on ``thread``; on OOM split it in two and run each half, down to one
        item. ``side``: a pass beside others (``lane.side_forward``), its peak not measured
        (it is the process's) and its time learnt by the lane's side time model. ``plan``:
        the plan that took ``batch`` out of the queue, recorded once its pass has started."""
        live = [p for p in batch if not p.cancelled]
        if len(live) < len(batch):
            self.metrics.cancelled.labels("queued").inc(len(batch) - len(live))
        if not live:
            return
        gate = closed_gate()  # the model thread's measurement after the outputs waits
        try:
            await self._run_batch(lane, live, thread, side, plan, gate)
        finally:
            open_gate(gate)  # on every path: nothing else opens it

    async def _run_batch(
        self, lane: LaneState, live: list[Pending], thread: ModelThread, side: bool,
        plan: BatchPlan | None, gate: threading.Lock,
    ) -> None:  # fmt: skip
        padded_len = max(p.cost for p in live)
        items = [p.item for p in live]
        started = self.clock.now()
        predicted: float | None = None
        later: asyncio.Future[Measurement | None] | None = None
        try:
            if side:
                assert lane.side_forward is not None
                answer: asyncio.Future[Any] = thread.start(
                    self.memory.unmeasured, lane.side_forward, items
                )
            else:
                answer, later = thread.start_then(
                    self.memory.forward, lane.forward, items, self.queue, gate
                )
            # What the pass does not need is recorded while the model runs it.
            predicted = self._record_start(lane, live, padded_len, started, plan)
            outputs, measured = (await answer, None) if side else await answer
        except self._oom_errors as exc:
            self.memory.forget()  # the next plan reads what the failed batch left
            lane.sizer.on_oom(len(live), padded_len)
            if len(live) == 1 or not self.config.oom_split:
                lane.count_oom("failed")
                log.warning("batch of %d x %d tokens does not fit in memory", len(live), padded_len)
                for pending in live:
                    message = _oom_message(pending, exc, len(live), predicted)
                    error = OutOfMemory(message, _needed_bytes(exc))
                    _fail(pending, error)
                return
            lane.count_oom("split")
            first, second = split(live)
            log.info(
                "batch of %d x %d tokens ran out of memory (%s); splitting",
                len(live), padded_len, exc,
            )  # fmt: skip
            await self.run_batch(lane, first, thread, side=side)
            await self.run_batch(lane, second, thread, side=side)
            return
        except Exception as exc:
            self.memory.forget()
            lane.metrics.batch_failures.inc()
            if isinstance(exc, self._fatal_errors):
                # NOTE: a device error leaves the device (and any batch after this one) in a
                # state nobody can vouch for: fail this batch, then end the loop, which fails
                # everything queued and lets the owner stop the process for a restart.
                self.healthy = False
                log.error("device error in a batch of %d items: %s", len(live), exc)
                for pending in live:
                    _fail(pending, InferenceFailed("the device failed; this replica is stopping"))
                raise
            log.exception("batch of %d items failed", len(live))
            for pending in live:
                _fail(pending, InferenceFailed("inference failed"))
            return
        elapsed = self.clock.now() - started
        lane.metrics.batch_duration.observe(elapsed)
        if len(outputs) != len(live):
            log.error("model returned %d outputs for %d inputs", len(outputs), len(live))
            for pending in live:
                _fail(pending, InferenceFailed("model returned the wrong number of outputs"))
            return
        run = live[0].run
        if run is not None:
            run.finished_s = started + elapsed
        orphans = 0
        for pending, output in zip(live, outputs, strict=True):
            if pending.future.done():
                orphans += 1
            else:
                pending.future.set_result(output)
        if orphans:
            self.metrics.cancelled.labels("running").inc(orphans)
        if side:
            # No peak: the process's, not this pass's. Its time still counts toward a latency
            # target, and a clean pass still lets a ceiling lowered by an OOM climb back.
            lane.sizer.observe(BatchOutcome(len(live), padded_len, elapsed, None))
            if lane.side_time_model is not None:
                lane.side_time_model.observe(len(live), padded_len, elapsed)
            return
        # NOTE: the requests waiting on these futures resume only once this task yields. Where
        # work waited as the batch ended, its measurement came back with the outputs, and this
        # task yields only once the sizer and the time model have learnt from it (the next
        # plan needs them) and the next batch is on the model thread: the answers are encoded
        # while the model runs it, not with the model idle. Where none waited, the requests
        # resume here, while the model thread measures.
        assert later is not None or measured is not None
        if measured is None:
            measured = await self.memory.measurement(later, gate, self._answered, self.queue)
        peak, reading = measured
        self.memory.keep(reading, started + elapsed)
        lane.sizer.observe(BatchOutcome(len(live), padded_len, elapsed, peak))
        if lane.time_model is not None:
            lane.time_model.observe(len(live), padded_len, elapsed)
        lane.record_peak(predicted, peak)

    def _record_start(
        self, lane: LaneState, live: Sequence[Pending], padded_len: int, started: float,
        plan: BatchPlan | None,
    ) -> float | None:  # fmt: skip
        """A pass has started: its metrics and its items' tags; its predicted peak."""
        if plan is not None:
            lane.record_dispatch(live, plan, started)
        lane.metrics.batch_size.observe(len(live))
        lane.metrics.batch_tokens.observe(len(live) * padded_len)
        self.num_batches += 1
        run = BatchRun(
            self.num_batches, len(live), sum(p.cost for p in live), len(live) * padded_len,
            started,
        )  # fmt: skip
        for pending in live:
            if pending.started_s is None:
                pending.started_s = started
            pending.batch = (self.num_batches, len(live))
            pending.run = run
        return lane.record_prediction(len(live), padded_len)

    def _count_dropped(self, dropped: Sequence[Pending]) -> None:
        """Items whose request went away (disconnect, deadline) while they were queued."""
        self.metrics.cancelled.labels("queued").inc(len(dropped))


def _fail(pending: Pending, error: Exception) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)


def _needed_bytes(exc: BaseException) -> int | None:
    return getattr(exc, "requested_bytes", None)


def _oom_message(
    pending: Pending, exc: BaseException, batch_size: int, predicted: float | None
) -> str:
    needs = []
    if predicted:
        needs.append(f"predicted peak {predicted / 2**20:.1f} MiB")
    if (requested := _needed_bytes(exc)) is not None:
        needs.append(f"the failed allocation was {requested / 2**20:.1f} MiB")
    where = "even alone" if batch_size == 1 else f"in a batch of {batch_size}"
    detail = f" ({'; '.join(needs)})" if needs else ""
    return f"input {pending.index} ({pending.cost} tokens) does not fit in memory {where}{detail}"
