"""The replica's moving parts and their lifetimes: models, model thread, queue, batcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from batching import (
    Batcher,
    BatchingMetrics,
    Clock,
    MemoryMetrics,
    MemoryProbe,
    ModelThread,
    MonotonicClock,
    RequestQueue,
    ShuttingDown,
    Sizer,
)
from generation import SequenceSpec
from models import BatchProfiler, DeviceError, Item, Model, ModelLoadError

from ..cache import InputCache
from ..errors import ApiError, draining, model_not_found, not_ready
from ..metrics import ServerMetrics
from ..settings import Settings
from .contention import ThreadGuard
from .generating import GenerationRun, Generators
from .requests import RequestPath
from .slot import ModelSlot, make_slots
from .starting import RuntimeStart
from .trace import RequestTrace
from .tracking import WorkTracker
from .waiting import ClientWatch

log = logging.getLogger("batchfit")


class Runtime(RuntimeStart):
    """Owns one replica's models (one ``ModelSlot`` each), model thread, queue and batcher.

    ``model`` (and ``sizer``) replace the default model's loading (tests, custom wiring);
    ``models`` replaces every model, by name, in the order given. ``on_ready`` runs once,
    just before the replica turns ready; ``on_fatal`` when it cannot go on. What ``start``
    runs, from loading to the batcher, is ``RuntimeStart``'s (``starting.py``).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry,
        model: Model | None = None,
        models: Mapping[str, Model] | None = None,
        clock: Clock | None = None,
        sizer: Sizer | None = None,
        probe: MemoryProbe | None = None,
        on_fatal: Callable[[], None] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.config = settings.server_config()
        self._slots = make_slots(settings, model=model, models=models, sizer=sizer)
        self.slots: dict[str, ModelSlot] = {}
        """Every model by name, the default first; filled once all of them have loaded."""
        self.clock = clock or MonotonicClock()
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
            settings.max_queue_items,
            priority_aging_s=settings.priority_aging_s,
            max_items_per_model=settings.max_items_per_model(len(self._slots)),
        )
        self.work = WorkTracker(registry, clock=self.clock)
        self.generators = Generators(
            registry, max_step_tokens=settings.max_step_tokens,
            max_latency_s=settings.max_timeout_s, clock=self.clock, work=self.work,
        )  # fmt: skip
        """One generation engine per generating model (``--task generate``)."""
        self.inputs = InputCache(
            registry, max_bytes=int(settings.cache_bytes or 0),
            deduplicate=settings.deduplicate, queue=self.queue,
        )  # fmt: skip
        """Outputs per input and the computations in flight (``server/cache/``)."""
        self.draining = False
        self._aborted = False
        self.batcher_error: BaseException | None = None
        self.model_thread = ModelThread(colocate=True)
        self.side_threads: list[ModelThread] = []
        """On a CPU: the threads that run passes beside the model thread's (``--cpu-passes``)."""
        # Tokenizes large requests off the event loop; one thread, started before any
        # memory limit applies (a capped address space may have no room for a new stack).
        self.tokenizer_thread = ModelThread("batchfit-tokenize")
        self.requests = RequestPath(
            queue=self.queue, inputs=self.inputs, clock=self.clock, work=self.work,
            tokenizer_thread=self.tokenizer_thread, metrics=self.batching_metrics,
            piece_items=settings.max_inputs_per_request,
        )  # fmt: skip
        # Wraps the batcher's forward calls, so traces are recorded on the model thread.
        self.profiler = BatchProfiler(Path(settings.profile_dir))
        self.batcher: Batcher | None = None
        self.thread_guard: ThreadGuard | None = None
        """On a CPU with the thread count the server chose: one thread while the host is busy."""
        self.startup_error: BaseException | None = None
        self._on_fatal = on_fatal
        self._on_ready = on_ready
        self._task: asyncio.Task[None] | None = None
        self._release_task: asyncio.Task[None] | None = None
        self._forward_watch: asyncio.Task[None] | None = None
        self._started = False
        self.phase = "starting"
        """Where start-up is, as the log says it if the replica is stopped there."""
        self._warming: ModelSlot | None = None

    @property
    def model(self) -> Model | None:
        """The default model (None until it has loaded)."""
        return self._slots[0].model

    @property
    def sizer(self) -> Sizer | None:
        """The default model's sizer."""
        return self._slots[0].sizer

    def slot(self, name: str | None = None, *, task: str | None = None) -> ModelSlot:
        """The model called ``name``; 404 ``model_not_found`` if none is, 503 before the
        models have loaded. Without a name: the default model, or with ``task`` the first
        model of that task (the default if it has it)."""
        if not self.slots:
            raise not_ready()
        if name is None:
            slots = list(self.slots.values())
            of_task = [s for s in slots if task is not None and s.info.task == task]
            return (of_task or slots)[0]
        found = self.slots.get(name)
        if found is None:
            raise model_not_found(name, list(self.slots))
        return found

    def liveness_problem(self) -> ApiError | None:
        """Why this replica is alive but hung (None: it is not). That the event loop answers
        at all proves it runs; the model thread is hung once, after start-up, one call on it
        has run for ``forward_timeout_s`` (a device or a model that never returns: the
        requests it holds end at their deadlines, the ones after them wait in vain)."""
        limit = self.settings.forward_timeout_s
        if not limit or not self._started:
            return None
        running_s = self.running_for()
        if running_s < limit:
            return None
        return ApiError(
            503, "model_hung",
            f"a forward pass has been running for {running_s:.0f}s (--forward-timeout-s "
            f"{limit:g}): the device or the model is hung",
            retry_after_s=1,
        )  # fmt: skip

    @property
    def ready(self) -> bool:
        return (
            self._started
            and not self.draining
            and (self.batcher is None or self.batcher.healthy)
            and (self._task is None or not self._task.done())
            and self.generators.healthy
        )

    async def start(self) -> None:
        """Load the model, warm it up, start the batcher; on failure, report it as fatal."""
        self.work.attach()
        try:
            await self._start()
        except Exception as exc:
            self.startup_error = exc
            if isinstance(exc, ModelLoadError):
                # What to serve is wrong (a missing folder, refused weights): the message says
                # what and how to fix it; a traceback would bury it.
                log.error("start-up failed: %s", exc)
            else:
                log.exception("start-up failed")
            if self._on_fatal is not None:
                self._on_fatal()

    def running_for(self) -> float:
        """How long the longest forward pass in progress has run (0: none runs)."""
        return max(thread.running_for() for thread in (self.model_thread, *self.side_threads))

    def _batcher_done(self, task: asyncio.Task[None]) -> None:
        """The batcher only ends on its own by crashing or on a device error. Policy: its
        requests got 500, the replica turns not ready and the process exits non-zero
        (``on_fatal``) so that the supervisor (the kubelet, ``batchfit up``) restarts it; a
        loop that failed once may fail again, and a device that failed cannot be trusted, so
        no in-place retry."""
        self.metrics.ready.set(0)
        if task.cancelled() or task.exception() is None:
            return
        self.batcher_error = error = task.exception()
        if isinstance(error, DeviceError):
            log.error("device error: %s; stopping the replica for a restart", error)
        else:
            log.error("the batcher crashed; stopping the replica", exc_info=error)
        if self._on_fatal is not None:
            self._on_fatal()

    def begin_drain(self) -> None:
        """Refuse new work (503 ``draining``) and turn not ready; admitted work carries on,
        but for the generation requests still waiting to start: they get 503 at once."""
        if self.draining:
            return
        self.draining = True
        self.generators.fail_waiting(ShuttingDown("the server is draining; retry elsewhere"))
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
        stopped = ShuttingDown("the server stopped before this input ran")
        for engine in self.generators.engines.values():
            engine.fail_all(stopped)
        return self.work.fail_open(stopped)

    def where(self) -> str:
        """Where start-up is now: ``warming up model m (a batch of 1 x 8192 tokens running)``."""
        slot = self._warming
        step = slot.step if slot is not None else None
        if step is None:
            return self.phase
        return f"{self.phase} (a batch of {step.num_items} x {step.length} tokens running)"

    async def stop(self) -> None:
        self.metrics.ready.set(0)
        if not self._started and self.startup_error is None:
            # NOTE: a load or a forward pass in progress on the model thread cannot be
            # interrupted, and may take minutes: the replica stops without waiting for it
            # (the command line then exits the process; see server/cli.py).
            busy = self.model_thread.busy
            log.warning(
                "stopped while %s%s", self.where(),
                "; not waiting for the model thread" if busy else "",
            )  # fmt: skip
            if busy:
                self._aborted = True
        for task in (self._release_task, self._forward_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._task is not None:
            self._task.cancel()
            # A crashed batcher's exception was logged when it ended.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.generators.stop()
        if self.batcher is not None:
            self.batcher.fail_waiting(ShuttingDown("the server stopped before this input ran"))
        threads = (self.model_thread, *self.side_threads)
        if self._aborted:
            for thread in threads:
                thread.close(wait=False)  # the forward in progress ends on its own
        else:
            if self._started:
                await self.model_thread.call(self.profiler.finish)
            # Waits for a running forward pass on an existing thread (no new one under a
            # memory limit).
            for thread in threads:
                await self.tokenizer_thread.call(thread.close)
        self.tokenizer_thread.close(wait=False)

    async def infer(
        self,
        inputs: Sequence[str],
        *,
        truncate: bool,
        timeout_s: float,
        request_id: str,
        priority: int = 0,
        model: str | None = None,
        query: str | None = None,
        trace: RequestTrace | None = None,
        prompt: str | None = None,
        truncation_direction: str | None = None,
        client: ClientWatch | None = None,
        dimensions: int | None = None,
        max_tokens_per_doc: int | None = None,
        chunk: bool = False,
        late_chunks: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> tuple[list[Any], int]:
        """Queue every input as one item of ``model`` (None: the default) and wait for all of
        them; return outputs and tokens. With ``query``, each input is a document paired with
        it (reranking). ``prompt`` goes in front of each input (of the query, for pairs);
        ``truncation_direction`` (None: the model's own) is the end over-long inputs are cut
        from. ``trace``, if given, is filled in with what the request went through. ``client``
        tells when the client has gone: its items then leave the queue and this raises
        ``ClientDisconnected``. ``dimensions`` cuts each embedding to its first values
        (renormalised when the model normalises); ``max_tokens_per_doc`` cuts each document
        (reranking) to that many tokens. Inputs found in the output cache are answered from
        it, and an input equal to one in flight waits for that one. ``chunk`` cuts over-long
        inputs into windows, queued as inputs and answered pooled; ``late_chunks`` answers
        each input's character spans (``server/long_inputs.py``)."""
        slot = self._admit(model)
        with self.work.request():
            return await self.requests.infer(
                slot, inputs, truncate=truncate, timeout_s=timeout_s, request_id=request_id,
                priority=priority, query=query, prompt=prompt,
                trace=trace if trace is not None else RequestTrace(), client=client,
                truncation_direction=truncation_direction,
                dimensions=dimensions, max_tokens_per_doc=max_tokens_per_doc, chunk=chunk,
                late_chunks=late_chunks,
            )  # fmt: skip

    def _admit(self, model: str | None) -> ModelSlot:
        """The slot of a request for ``model`` (None: the default), refused while draining
        or not ready. The caller counts it in ``work.request()`` while it runs."""
        if self.draining:
            raise draining()
        if not self.ready:
            raise not_ready()
        return self.slot(model)

    async def infer_items(
        self,
        items: Sequence[Item],
        *,
        timeout_s: float,
        request_id: str,
        priority: int = 0,
        model: str | None = None,
        trace: RequestTrace | None = None,
        client: ClientWatch | None = None,
        dimensions: int | None = None,
    ) -> tuple[list[Any], int]:
        """As ``infer``, for inputs already prepared (tokenized) elsewhere: the API processes
        in front of this engine (``server/engine/``). The output cache and the sharing of
        computations in flight apply as in ``infer``: they live here, with the queue."""
        slot = self._admit(model)
        with self.work.request():
            return await self.requests.answer(
                slot, items, timeout_s=timeout_s, request_id=request_id, priority=priority,
                trace=trace if trace is not None else RequestTrace(), client=client,
                dimensions=dimensions,
            )  # fmt: skip

    def generate(
        self, specs: Sequence[SequenceSpec], *, model: str, priority: int, timeout_s: float,
        client: ClientWatch | None = None,
    ) -> GenerationRun:  # fmt: skip
        """Admit one generation request's sequences (its choices) to ``model``'s engine:
        ``QueueFull`` (429) where its waiting sequences are too many, 503 while draining or
        not ready. The run's stream carries their tokens; ``close`` it when done."""
        slot = self._admit(model)
        return self.generators.generate(
            slot.name, specs, priority=priority, timeout_s=timeout_s, client=client
        )
