"""The replica's moving parts and their lifetimes: model, model thread, queue, batcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from batching import (
    Batcher,
    BatchingMetrics,
    Clock,
    FixedSizer,
    ModelThread,
    MonotonicClock,
    Pending,
    RequestQueue,
    ShuttingDown,
    Sizer,
)
from models import DeviceError, Model, ModelOutOfMemory, load_model

from .errors import ApiError, draining, not_ready
from .metrics import ServerMetrics
from .settings import Settings
from .tracking import WorkTracker

log = logging.getLogger("batchfit")

# Requests with more text than this are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 4096


class Runtime:
    """Owns one replica's model, model thread, queue and batcher task."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry,
        model: Model | None = None,
        clock: Clock | None = None,
        sizer: Sizer | None = None,
        on_fatal: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.config = settings.server_config()
        self.model = model
        self.clock = clock or MonotonicClock()
        self.sizer = sizer or FixedSizer(settings.max_batch_size, settings.max_batch_tokens)
        self.metrics = ServerMetrics(registry)
        self.batching_metrics = BatchingMetrics(
            registry,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
        )
        self.queue = RequestQueue(
            settings.max_queue_items, priority_aging_s=settings.priority_aging_s
        )
        self.work = WorkTracker(registry)
        self.draining = False
        self._aborted = False
        self.batcher_error: BaseException | None = None
        self.model_thread = ModelThread()
        self.batcher: Batcher | None = None
        self.startup_error: BaseException | None = None
        self._on_fatal = on_fatal
        self._task: asyncio.Task[None] | None = None
        self._started = False

    @property
    def ready(self) -> bool:
        return (
            self._started
            and not self.draining
            and self.batcher is not None
            and self.batcher.healthy
            and self._task is not None
            and not self._task.done()
        )

    async def start(self) -> None:
        """Load the model, warm it up, start the batcher; on failure, report it as fatal."""
        self.work.attach()
        try:
            await self._start()
        except Exception as exc:
            self.startup_error = exc
            log.exception("start-up failed")
            if self._on_fatal is not None:
                self._on_fatal()

    async def _start(self) -> None:
        started = time.perf_counter()
        if self.model is None:
            self.model = await self.model_thread.call(load_model, self.settings.model_spec())
        info = self.model.info
        log.info(
            "model %s loaded: task=%s device=%s dtype=%s parameters=%d max_input_tokens=%d (%.1fs)",
            info.name, info.task, info.device, info.dtype, info.num_parameters,
            info.max_input_tokens, time.perf_counter() - started,
        )  # fmt: skip
        self.metrics.model.info(
            {"name": info.name, "task": info.task, "device": info.device, "dtype": info.dtype}
        )
        await self._warm_up()
        self.batcher = Batcher(
            queue=self.queue,
            forward=self.model.forward,
            model_thread=self.model_thread,
            sizer=self.sizer,
            clock=self.clock,
            metrics=self.batching_metrics,
            config=self.settings.batcher_config(),
            oom_errors=(ModelOutOfMemory,),
            fatal_errors=(DeviceError,),
        )
        self._task = asyncio.create_task(self.batcher.run(), name="batchfit-batcher")
        self._task.add_done_callback(self._batcher_done)
        self._started = True
        self.metrics.ready.set(1)
        log.info("ready in %.1fs", time.perf_counter() - started)

    async def _warm_up(self) -> None:
        """Run the largest batch the sizer would plan, so a memory problem fails at boot."""
        assert self.model is not None
        budget = self.sizer.budget()
        length = min(
            self.model.info.max_input_tokens, max(2, budget.max_tokens // budget.max_items)
        )
        num_items = max(1, min(budget.max_items, budget.max_tokens // length))
        items = self.model.synthetic_items(num_items, length)
        started = time.perf_counter()
        await self.model_thread.call(self.model.forward, items)
        log.info(
            "warm-up batch of %d x %d tokens took %.3fs",
            num_items, length, time.perf_counter() - started,
        )  # fmt: skip

    def _batcher_done(self, task: asyncio.Task[None]) -> None:
        """The batcher only ends on its own by crashing. Policy: its requests got 500, the
        replica turns not ready and the process exits non-zero (``on_fatal``) so that the
        supervisor restarts it; a loop that failed once may fail again, so no in-place retry."""
        self.metrics.ready.set(0)
        if task.cancelled() or task.exception() is None:
            return
        self.batcher_error = task.exception()
        log.error("the batcher crashed; stopping the replica", exc_info=self.batcher_error)
        if self._on_fatal is not None:
            self._on_fatal()

    def begin_drain(self) -> None:
        """Refuse new work (503 ``draining``) and turn not ready; admitted work carries on."""
        if self.draining:
            return
        self.draining = True
        self.metrics.draining.set(1)
        self.metrics.ready.set(0)
        log.info(
            "draining: %d requests with %d items in progress",
            self.work.active_requests, self.work.open_items,
        )  # fmt: skip

    async def drain(self, timeout_s: float) -> bool:
        """Let admitted work finish for up to ``timeout_s``; then fail what is left with 503.
        Returns whether everything finished in time."""
        self.begin_drain()
        if await self.work.wait_idle(timeout_s):
            log.info("drained: every admitted request was answered")
            return True
        left = self.abort()
        log.warning("drain timeout of %gs passed; %d items got 503", timeout_s, left)
        await self.work.wait_idle(5.0)
        return False

    def abort(self) -> int:
        """Answer every admitted item now with 503 (a running batch's results are dropped)."""
        self.begin_drain()
        self._aborted = True
        return self.work.fail_open(ShuttingDown("the server stopped before this input ran"))

    async def stop(self) -> None:
        self.metrics.ready.set(0)
        if self._task is not None:
            self._task.cancel()
            # A crashed batcher's exception was logged when it ended.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.batcher is not None:
            self.batcher.fail_waiting(ShuttingDown("the server stopped before this input ran"))
        if self._aborted:
            self.model_thread.close(wait=False)  # the forward in progress ends on its own
        else:
            await asyncio.to_thread(self.model_thread.close)

    async def infer(
        self,
        inputs: Sequence[str],
        *,
        truncate: bool,
        timeout_s: float,
        request_id: str,
        priority: int = 0,
    ) -> tuple[list[Any], int]:
        """Queue every input as one item and wait for all of them; return outputs and tokens."""
        if self.draining:
            raise draining()
        if not self.ready or self.model is None:
            raise not_ready()
        with self.work.request():
            return await self._infer(
                inputs, truncate=truncate, timeout_s=timeout_s, request_id=request_id,
                priority=priority,
            )  # fmt: skip

    async def _infer(
        self, inputs: Sequence[str], *, truncate: bool, timeout_s: float, request_id: str,
        priority: int,
    ) -> tuple[list[Any], int]:  # fmt: skip
        if sum(len(text) for text in inputs) > INLINE_TOKENIZE_CHARS:
            items = await asyncio.to_thread(self.model.prepare, inputs, truncate=truncate)
        else:
            items = self.model.prepare(inputs, truncate=truncate)
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        deadline = now + timeout_s
        pendings = [
            Pending(
                item=item,
                future=loop.create_future(),
                arrival_s=now,
                deadline_s=deadline,
                priority=priority,
                request_id=request_id,
                index=index,
            )
            for index, item in enumerate(items)
        ]
        self.queue.put_many(pendings)
        self.work.track(pendings)
        self.batching_metrics.queue_depth.set(len(self.queue))
        try:
            async with asyncio.timeout(timeout_s):
                outputs = await asyncio.gather(*(p.future for p in pendings))
        except TimeoutError:
            raise ApiError(
                504, "deadline_exceeded", f"no answer within the deadline of {timeout_s:g}s"
            ) from None
        except asyncio.CancelledError:
            # The client went away: its waiting items leave the queue now and never run.
            self.batching_metrics.cancelled.labels("queued").inc(self.queue.discard(pendings))
            raise
        finally:
            for pending in pendings:
                if not pending.future.done():
                    pending.future.cancel()
            self.queue.discard(pendings)
            self.batching_metrics.queue_depth.set(len(self.queue))
        return outputs, sum(item.cost for item in items)
