"""How a replica starts once ``Runtime.start`` is called: every model loaded, the threads
that run them started before a memory limit caps the address space, generators and encoders
warmed up, the batcher running, then ready.

``RuntimeStart`` is a base of ``Runtime`` (``runtime.py``), whose ``__init__`` makes every
attribute it sets as it goes: a stop part-way through finds what has started. The steps that
set one thing each are in ``startup.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from batching import (
    Batcher,
    ModelThread,
    probes_for_device,
    release_host_memory,
    room_for_passes,
)
from models import DeviceError, ModelOutOfMemory, set_cpu_threads

from ..watchdog import exit_when_forward_hangs
from .announce import ready_line
from .contention import ThreadGuard
from .slot import ModelSlot, by_name, make_sizer
from .startup import bound_cache, limit_host_memory, load, log_memory_limit, place_tokenizing
from .threads import AFFINITY, QUOTA, side_shape, thread_count

log = logging.getLogger("batchfit")


class RuntimeStart:
    """``Runtime``'s start-up sequence (``_start``) and the tasks it leaves running."""

    async def _start(self) -> None:
        started = time.perf_counter()
        threads = thread_count(self.settings.num_threads)
        for slot in self._slots:
            self.phase = f"loading model {slot.given_name or slot.spec.model}"
            await load(slot, self.model_thread, self.metrics, threads.num_threads)
        self.phase = "starting the model thread"
        self.slots = by_name(self._slots)
        info = self._slots[0].info  # every model shares the device
        encoders = [slot for slot in self._slots if slot.info.task != "generate"]
        generators = [slot for slot in self._slots if slot.info.task == "generate"]
        if info.device == "cpu":
            log.info("%s", threads.describe())
            self.metrics.model_threads.set(threads.num_threads)
            # NOTE: a count the operator chose (the flag, OMP_NUM_THREADS) is kept as it is.
            if threads.source in (AFFINITY, QUOTA) and threads.num_threads > 1:
                self.thread_guard = ThreadGuard(
                    threads.num_threads, set_cpu_threads, gauge=self.metrics.model_threads,
                    judging=False,
                )  # fmt: skip
        if self.probe is None:
            self.probe = probes_for_device(
                info.device, memory_limit_bytes=self.settings.memory_limit
            )
        for slot in encoders:
            slot.probe = self.probe
            if slot.sizer is None:
                slot.sizer = make_sizer(self.settings, slot.info)
            # The first forward pass starts torch's thread pool; start every thread before a
            # memory limit caps the address space.
            await self.model_thread.call(slot.model.forward, slot.model.synthetic_items(1, 8))
        for slot in generators:
            self.phase = f"warming up generator {slot.name}"
            engine = self.generators.add(
                slot.name, slot.model, model_thread=self.model_thread,  # type: ignore[arg-type]
                config=self.settings.engine_config(), probe=self.probe,
            )  # fmt: skip
            await engine.warm_up()
        passes, threads_each = (
            side_shape(threads.num_threads, self.settings.cpu_passes)
            if info.device == "cpu" else (1, 0)
        )  # fmt: skip
        for number in range(1, passes):
            thread = ModelThread(f"batchfit-side-{number}")
            await thread.call(set_cpu_threads, threads_each)
            if threads_each > 1:  # its own pool of torch threads, started as above
                for slot in encoders:
                    await thread.call(slot.model.forward, slot.model.synthetic_items(1, 8))
            self.side_threads.append(thread)
        await self.tokenizer_thread.call(int)
        for slot in encoders:
            await place_tokenizing(slot, self.tokenizer_thread)
        if self.settings.memory_limit is not None and info.device == "cpu":
            limit_host_memory(self.probe, self.settings.memory_limit)
        log_memory_limit(self.probe, self.memory_metrics)
        bound_cache(self.inputs, self.settings, encoders, self.probe, on_host=info.device == "cpu")
        if encoders:
            await self._start_batcher(encoders, threads_each)
        self.generators.start(self._batcher_done)
        self.phase = "starting the batcher"
        if self.settings.memory_release_idle_s > 0:
            self._release_task = asyncio.create_task(
                self._release_memory_when_quiet(self.settings.memory_release_idle_s),
                name="batchfit-release-memory",
            )
        if exit_s := self.settings.forward_exit_after_s:
            self._forward_watch = asyncio.create_task(
                exit_when_forward_hangs(self.running_for, exit_s),
                name="batchfit-forward-watch",
            )
        if self.thread_guard is not None:
            self.thread_guard.begin()
        if self._on_ready is not None:
            self._on_ready()  # before readiness: nothing is in flight yet
        self._started = True
        self.phase = "ready"
        self.metrics.ready.set(1)
        log.info("%s", ready_line(self, time.perf_counter() - started))

    async def _start_batcher(self, encoders: list[ModelSlot], threads_each: int) -> None:
        """The batcher over the models that are not generators, warmed up."""
        self.batcher = Batcher(
            queue=self.queue,
            lanes=[
                slot.lane(
                    self.profiler,
                    self.thread_guard,
                    threads_beside=threads_each if self.side_threads else None,
                )
                for slot in encoders
            ],
            model_thread=self.model_thread,
            clock=self.clock,
            metrics=self.batching_metrics,
            config=self.settings.batcher_config(),
            oom_errors=(ModelOutOfMemory,),
            fatal_errors=(DeviceError,),
            probe=self.probe,
            memory_metrics=self.memory_metrics,
            answered=self.work.answered,
        )
        log.info("warming up: the largest batches the memory budget and the time bound allow")
        for slot in encoders:
            if len(self._slots) > 1:
                log.info("warming up model %s", slot.name)
            self.phase = f"warming up model {slot.name}"
            self._warming = slot
            report = await slot.warm_up(self.batcher)
            self._warming = None
            if report.proven_length is not None:
                self.memory_metrics.for_model(slot.name).proven_length.set(report.proven_length)
        self.batcher.record_ceilings()
        if self.side_threads:
            self._choose_side_by_side(threads_each, encoders)
        self._task = asyncio.create_task(self.batcher.run(), name="batchfit-batcher")
        self._task.add_done_callback(self._batcher_done)

    def _choose_side_by_side(self, threads_each: int, encoders: list[ModelSlot]) -> None:
        """Passes side by side where memory cannot bind them (``room_for_passes``, as the
        sizers predict after warm-up); else the side threads end and passes run one at a
        time."""
        assert self.batcher is not None and self.probe is not None
        passes = 1 + len(self.side_threads)
        reading = self.probe.read()
        roomy = all(
            room_for_passes(slot.sizer.budget(reading), passes, slot.info.max_input_tokens)
            for slot in encoders
            if slot.sizer is not None
        )
        if roomy:
            self.batcher.run_side_by_side(self.side_threads)
            log.info(
                "forward passes: up to %d at a time while work waits, %d torch thread%s each "
                "(memory cannot bind them); alone on every thread otherwise",
                passes, threads_each, "s" * (threads_each > 1),
            )  # fmt: skip
            return
        log.info("forward passes: one at a time (memory may bind %d at once)", passes)
        for thread in self.side_threads:
            thread.close(wait=False)
        self.side_threads = []

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
