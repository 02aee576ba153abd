"""The replica's moving parts and their lifetimes: model, model thread, queue, batcher."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from batching import (
    AdaptiveSizer,
    Batcher,
    BatchingMetrics,
    Clock,
    FixedSizer,
    MemoryMetrics,
    MemoryProbe,
    MemoryReading,
    ModelThread,
    MonotonicClock,
    Pending,
    RequestQueue,
    ShuttingDown,
    Sizer,
    largest_batch,
    limit_address_space,
    prior_peak_model,
    probes_for_device,
    release_host_memory,
    tune_host_allocator,
)
from models import BatchProfiler, DeviceError, Model, ModelInfo, ModelOutOfMemory, load_model

from ..errors import ApiError, draining, not_ready
from ..metrics import ServerMetrics
from ..settings import Settings
from .announce import ready_line
from .trace import RequestTrace
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
        probe: MemoryProbe | None = None,
        on_fatal: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.config = settings.server_config()
        self.model = model
        self.clock = clock or MonotonicClock()
        self.sizer = sizer  # built from the model's shape once it is loaded, unless given
        self.probe = probe
        # Latency buckets reach the longest deadline a request can ask for.
        self.metrics = ServerMetrics(registry, max_latency_s=settings.max_timeout_s)
        self.memory_metrics = MemoryMetrics(registry)
        self.batching_metrics = BatchingMetrics(
            registry,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_latency_s=settings.max_timeout_s,
        )
        self.queue = RequestQueue(
            settings.max_queue_items, priority_aging_s=settings.priority_aging_s
        )
        self.work = WorkTracker(registry, clock=self.clock)
        self.draining = False
        self._aborted = False
        self.batcher_error: BaseException | None = None
        self.model_thread = ModelThread()
        # Tokenizes large requests off the event loop; one thread, started before any
        # memory limit applies (a capped address space may have no room for a new stack).
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="batchfit-tokenize")
        # Wraps the batcher's forward calls, so traces are recorded on the model thread.
        self.profiler = BatchProfiler(Path(settings.profile_dir))
        self.batcher: Batcher | None = None
        self.startup_error: BaseException | None = None
        self._on_fatal = on_fatal
        self._task: asyncio.Task[None] | None = None
        self._release_task: asyncio.Task[None] | None = None
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
        if self.probe is None:
            self.probe = probes_for_device(
                info.device, memory_limit_bytes=self.settings.memory_limit
            )
        if self.sizer is None:
            self.sizer = make_sizer(self.settings, info)
        # The first forward pass starts torch's thread pool; start every thread before a
        # memory limit caps the address space.
        await self.model_thread.call(self.model.forward, self.model.synthetic_items(1, 8))
        await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, int)
        if self.settings.memory_limit is not None and info.device == "cpu":
            self._limit_host_memory(self.settings.memory_limit)
        self._log_memory_limit()
        self.batcher = Batcher(
            queue=self.queue,
            forward=self.profiler.wrap(self.model.forward),
            model_thread=self.model_thread,
            sizer=self.sizer,
            clock=self.clock,
            metrics=self.batching_metrics,
            config=self.settings.batcher_config(),
            oom_errors=(ModelOutOfMemory,),
            fatal_errors=(DeviceError,),
            probe=self.probe,
            memory_metrics=self.memory_metrics,
        )
        log.info("warming up: the largest batches the memory budget allows")
        await self._warm_up(self.batcher)
        self._task = asyncio.create_task(self.batcher.run(), name="batchfit-batcher")
        self._task.add_done_callback(self._batcher_done)
        if self.settings.memory_release_idle_s > 0:
            self._release_task = asyncio.create_task(
                self._release_memory_when_quiet(self.settings.memory_release_idle_s),
                name="batchfit-release-memory",
            )
        self._started = True
        self.metrics.ready.set(1)
        log.info("%s", ready_line(self, time.perf_counter() - started))

    def _limit_host_memory(self, limit_bytes: int) -> None:
        assert self.probe is not None
        resident = self.probe.read().used_bytes or 0
        if resident >= limit_bytes:
            raise RuntimeError(
                f"memory_limit ({limit_bytes} bytes) is below what the loaded model already "
                f"uses ({resident} bytes)"
            )
        set_to = limit_address_space(limit_bytes - resident)
        log.info(
            "memory limit %d MiB: address space capped at %d MiB (%d MiB above the model)",
            limit_bytes >> 20, set_to >> 20, (limit_bytes - resident) >> 20,
        )  # fmt: skip

    def _log_memory_limit(self) -> None:
        """Say which limit binds before the first batch: warm-up runs under it too."""
        reading = self.probe.read() if self.probe is not None else None
        if reading is None or reading.limit is None:
            log.info("memory limit: none read (no memory probe)")
            return
        self.memory_metrics.set_limit(reading.limit)
        log.info(
            "memory limit: %s, %d MiB free under it",
            reading.limit.describe(), (reading.free_bytes or 0) >> 20,
        )  # fmt: skip

    async def _warm_up(self, batcher: Batcher) -> None:
        """Run the largest batches the sizer would plan (short and longest inputs), lowering
        the ceiling after each OOM until they pass, so the server never says ready with a
        budget it cannot run. The adaptive sizer calibrates its memory model on them."""
        assert self.model is not None and self.sizer is not None
        on_host = self.model.info.device == "cpu"
        if on_host:
            tune_host_allocator(measuring=True)
        try:
            await self._calibrate(batcher)
        finally:
            if on_host:
                tune_host_allocator(measuring=False)

    async def _calibrate(self, batcher: Batcher) -> None:
        assert self.model is not None and self.sizer is not None
        max_len = self.model.info.max_input_tokens
        lengths = sorted({min(max_len, 32), max_len})
        if not isinstance(self.sizer, AdaptiveSizer):
            budget = self.sizer.budget()
            lengths = [min(max_len, max(2, budget.max_tokens // budget.max_items))]
        for length in lengths:
            cap = self.settings.max_batch_size
            scouted = False
            while True:
                reading = self.probe.read() if self.probe else None
                budget = self.sizer.budget(reading)
                fits = largest_batch(budget, length)
                num_items = max(1, min(cap, fits))
                # NOTE: past a cgroup's limit (or the host's memory) the kernel kills the
                # process: no error comes back to lower the ceiling on. Where memory, not a
                # cap, sets this batch's size, a quarter of it runs first, so the full one is
                # planned by a model corrected at this length, not by the prior alone.
                scout = not scouted and fits < cap and num_items >= 4 and _kills(reading)
                if scout:
                    num_items //= 4
                items = self.model.synthetic_items(num_items, length)
                try:
                    outcome = await batcher.run_calibration(items)
                except ModelOutOfMemory:
                    self.sizer.on_oom(num_items, length)
                    if num_items == 1:
                        log.warning("one input of %d tokens does not fit in memory", length)
                        break
                    log.info("warm-up batch of %d x %d ran out of memory", num_items, length)
                    cap = num_items // 2  # a fixed sizer has no ceiling to lower
                    continue
                if isinstance(self.sizer, AdaptiveSizer):
                    self.sizer.calibrate(outcome)
                log.info(
                    "warm-up batch of %d x %d tokens: %.3fs, peak %s",
                    num_items, length, outcome.elapsed_s,
                    f"{outcome.peak_bytes / 2**20:.1f} MiB" if outcome.peak_bytes else "n/a",
                )  # fmt: skip
                if scout:
                    scouted = True
                    continue
                break
        if isinstance(self.sizer, AdaptiveSizer):
            self.sizer.finish_warm_up()
            model = self.sizer.model
            ceiling = self.sizer.ceiling_bytes
            log.info(
                "memory model: %.0f bytes/token + %.1f bytes/token x length; ceiling %s",
                model.alpha, model.beta,
                "none" if ceiling == float("inf") else f"{ceiling / 2**20:.0f} MiB",
            )  # fmt: skip

    async def _release_memory_when_quiet(self, quiet_s: float) -> None:
        """After each busy spell, once quiet for ``quiet_s``, return the allocator's free
        memory to the OS. On the model thread: it never blocks the event loop, and a batch
        that arrives meanwhile waits the few milliseconds instead of racing it for the heap."""
        while True:
            await self.work.wait_quiet(quiet_s)
            released = await self.model_thread.call(release_host_memory)
            if released is None:
                log.info("no glibc: free heap memory is not handed back when quiet")
                return
            self.memory_metrics.host_released.inc(released)
            self.memory_metrics.host_last_release.set_to_current_time()

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
        if self._release_task is not None:
            self._release_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._release_task
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
            # Waits for a running forward pass on an existing thread (no new one under a
            # memory limit).
            await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_thread, self.model_thread.close
            )
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def infer(
        self,
        inputs: Sequence[str],
        *,
        truncate: bool,
        timeout_s: float,
        request_id: str,
        priority: int = 0,
        trace: RequestTrace | None = None,
    ) -> tuple[list[Any], int]:
        """Queue every input as one item and wait for all of them; return outputs and tokens.
        ``trace``, if given, is filled in with what the request went through."""
        if self.draining:
            raise draining()
        if not self.ready or self.model is None:
            raise not_ready()
        with self.work.request():
            return await self._infer(
                inputs, truncate=truncate, timeout_s=timeout_s, request_id=request_id,
                priority=priority, trace=trace if trace is not None else RequestTrace(),
            )  # fmt: skip

    async def _infer(
        self, inputs: Sequence[str], *, truncate: bool, timeout_s: float, request_id: str,
        priority: int, trace: RequestTrace,
    ) -> tuple[list[Any], int]:  # fmt: skip
        loop = asyncio.get_running_loop()
        if sum(len(text) for text in inputs) > INLINE_TOKENIZE_CHARS:
            prepare = functools.partial(self.model.prepare, inputs, truncate=truncate)
            items = await loop.run_in_executor(self.tokenizer_thread, prepare)
        else:
            items = self.model.prepare(inputs, truncate=truncate)
        trace.inputs, trace.tokens = len(items), sum(item.cost for item in items)
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
            trace.record(pendings)
        return outputs, trace.tokens


def _kills(reading: MemoryReading | None) -> bool:
    """Whether the binding limit is one the kernel enforces by killing (cgroup, host memory)
    rather than one that fails an allocation (address space, device)."""
    return reading is not None and reading.limit is not None and reading.limit.source in (
        "cgroup", "host",
    )  # fmt: skip


def make_sizer(settings: Settings, info: ModelInfo) -> Sizer:
    if settings.sizer == "fixed":
        return FixedSizer(settings.max_batch_size, settings.max_batch_tokens)
    shape = info.shape
    prior = prior_peak_model(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_heads=shape.num_heads,
        element_bytes=shape.element_bytes,
    )
    return AdaptiveSizer(prior, settings.adaptive_config())
