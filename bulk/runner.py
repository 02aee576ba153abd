"""The model loop of a bulk job: warm-up, then each window's batches, on the calling thread
(and, on a CPU where memory cannot bind them, its lanes beside it: ``lanes.py``).

Not the server's ``Batcher``: that one serves a queue of requests that arrive over time
(deadlines, priorities, futures, the oldest item first). A bulk job knows a whole window in
advance, so it plans every batch of the window at once (``plan_window``) and runs them in
turn, with the server's sizer, memory probe, warm-up and OOM split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from batching import (
    AdaptiveConfig,
    AdaptiveSizer,
    BatchBudget,
    BatchOutcome,
    MemoryProbe,
    MemoryReading,
    WarmUp,
    WarmUpReport,
    measured_forward,
    prior_for,
    probes_for_device,
    refused_alone,
    split,
    tune_host_allocator,
)
from models import Item, Model, ModelOutOfMemory

from .hang import PassWatch
from .lanes import Lanes, lane_shape, torch_threads
from .plan import plan_window, time_prior

log = logging.getLogger("batchfit.bulk")

MiB = 2**20
# A batch's measured peak above its prediction by less than this is not evidence that the
# memory model is wrong: the heap growing by an arena, an allocator's first block of a new
# size. Uncorrected, a first batch of 98 x 3 tokens (19.7 MiB measured, 5.7 predicted) tripled
# the bytes per token and split every long batch after it.
PEAK_NOISE_BYTES = 16 * MiB
# Warm-up runs only where memory could set a batch's size: where the largest batch the item
# and token caps allow, as the (generous) prior predicts it, needs more than this share of
# the memory budget. Below it the caps alone decide every batch, warm-up would prove nothing
# the plan uses, and it cost a quick job 15% of its time (2.7 s of 18 s for 1,500 inputs on
# 2 cores); the share left covers the reader's and writer's parts and a prior off by 4x.
WARM_UP_MEMORY_SHARE = 0.25
# Longest an input that does not fit waits for the reader and the writer before it is
# rejected for memory: the next part's tokenizing or the last one's writing, a few seconds.
ROOM_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class OutOfMemoryInput:
    """In place of an output: this input did not fit in memory even alone."""

    reason: str


class Reserve:
    """What the job's other threads (the reader, the writer) are doing to memory while the
    model thread runs: bytes they are about to allocate, kept out of every batch's budget
    (the probe cannot see them yet), and whether they were busy at all during a batch, whose
    measured peak (a whole process's) then says nothing about the batch alone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}
        self._busy = 0
        self._changes = 0

    def set(self, owner: str, num_bytes: int) -> None:
        with self._lock:
            self._bytes[owner] = max(0, num_bytes)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())

    @contextlib.contextmanager
    def busy(self, owner: str, num_bytes: int = 0) -> Iterator[None]:
        """``owner`` allocates for a while, about ``num_bytes`` (``set`` updates it)."""
        with self._lock:
            self._busy += 1
            self._changes += 1
            self._bytes[owner] = max(0, num_bytes)
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._changes += 1
                self._bytes[owner] = 0

    def state(self) -> tuple[int, int]:
        """(busy threads, changes so far): equal before and after a batch, with none busy,
        means nothing else allocated meanwhile."""
        with self._lock:
            return self._busy, self._changes


@dataclass
class RunStats:
    """What the model loop did, for the progress line and the summary."""

    inputs: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    oom_splits: int = 0
    budget_splits: int = 0
    out_of_memory: int = 0
    peak_bytes: int = 0
    """The most memory the process held (resident on a CPU, allocated on a GPU)."""
    budget: BatchBudget | None = None
    """The budget of the last window's plan."""


def build_runner(
    model: Model, *, max_items: int, max_tokens: int, headroom: float,
    memory_limit: int | None = None, reserve: Reserve | None = None,
) -> Runner:  # fmt: skip
    """A runner for ``model`` with the server's sizer and memory probe for its device. Call
    on the model thread; it runs one small pass, which starts torch's threads."""
    probe = probes_for_device(model.info.device, memory_limit_bytes=memory_limit)
    sizer = make_sizer(model, max_items=max_items, max_tokens=max_tokens, headroom=headroom)
    model.forward(model.synthetic_items(1, 8))
    return Runner(model, sizer, probe, reserve=reserve)


def make_sizer(model: Model, *, max_items: int, max_tokens: int, headroom: float) -> AdaptiveSizer:
    config = AdaptiveConfig(max_items=max_items, max_tokens=max_tokens, headroom_fraction=headroom)
    return AdaptiveSizer(prior_for(model.info.shape), config)


class Runner:
    """Runs windows of items through ``model.forward`` on the calling thread, which must be
    the only one that ever runs a forward pass, apart from the runner's own lanes."""

    def __init__(
        self,
        model: Model,
        sizer: AdaptiveSizer,
        probe: MemoryProbe | None,
        *,
        reserve: Reserve | None = None,
        oom_split: bool = True,
    ) -> None:
        self.model = model
        self.sizer = sizer
        self.probe = probe
        self.reserve = reserve or Reserve()
        self.oom_split = oom_split
        self.stats = RunStats()
        self.lanes: Lanes | None = None
        """Passes side by side (``use_lanes``); None: one at a time, on the calling thread."""
        self.watch: PassWatch | None = None
        """Watches every pass for a hang (``bulk.hang``); None: none is watched."""
        self._seconds_per_unit = 0.0  # the slowest pass so far, per unit of ``time_prior``
        self._guard = threading.RLock()  # the sizer and the stats, between lanes
        info = model.info
        self.device_type = info.device.partition(":")[0]
        self.time_prior = time_prior(
            hidden_size=info.shape.hidden_size,
            intermediate_size=info.shape.intermediate_size,
            device_type=self.device_type,
        )

    def read(self) -> MemoryReading | None:
        """What is free now, less what the job's other threads are about to take."""
        if self.probe is None:
            return None
        reading = self.probe.read()
        self._note_peak(reading)
        reserved = self.reserve.bytes
        if reserved and reading.free_bytes is not None:
            reading = dataclasses.replace(reading, free_bytes=max(0, reading.free_bytes - reserved))
        if reserved and reading.enforced_free_bytes is not None:
            reading = dataclasses.replace(
                reading, enforced_free_bytes=max(0, reading.enforced_free_bytes - reserved)
            )
        return reading

    def release_memory(self) -> None:
        """Collect garbage and hand the allocator's free memory back to the kernel: what a
        finished part's items leave behind would otherwise stay resident, in holes."""
        gc.collect()
        settle = getattr(self.probe, "settle", None)
        if settle is not None:
            settle()

    def _room_for(self, padded_len: int) -> bool:
        """Before one input is rejected for memory: wait for the reader and the writer to be
        done with what they hold (at most ``ROOM_WAIT_S``), release memory, and read again.
        A squeeze that passes (the next part being tokenized, the last one being written)
        delays the input instead of rejecting it."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while self.reserve.state()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        self.release_memory()
        with self._guard:
            budget = self.sizer.budget(self.read())
        return refused_alone(padded_len, budget) is None

    def _note_peak(self, reading: MemoryReading, batch_peak: int | None = None) -> None:
        """The host's resident peak since start; on a device, allocated plus a batch's peak."""
        if reading.resident_peak_bytes is not None:
            peak = reading.resident_peak_bytes
        elif reading.allocated_bytes is not None:
            peak = reading.allocated_bytes + (batch_peak or 0)
        else:
            return
        self.stats.peak_bytes = max(self.stats.peak_bytes, peak)

    def warm_up(self) -> WarmUpReport:
        """The server's warm-up (``WarmUp``): the largest batches the budget allows, on a
        ladder of lengths within the time bound; returns what it proved. Skipped where the
        caps, not memory, bound every batch (``caps_bind``): each batch is still checked
        against the memory free just before it runs, and its peak corrects the model."""
        skip = self.caps_bind(self.read())
        if skip is not None:
            log.info("warm-up skipped: %s", skip)
            max_length = self.model.info.max_input_tokens
            return WarmUpReport(None, max_length, 0.0, None, stopped=skip)
        on_host = self.device_type == "cpu"
        if on_host:
            tune_host_allocator(measuring=True)
        started = time.perf_counter()
        try:
            warm_up = WarmUp(
                self.sizer,
                max_input_tokens=self.model.info.max_input_tokens,
                max_items=self.sizer.config.max_items,
            )
            while (
                step := warm_up.next_batch(self.read(), elapsed_s=time.perf_counter() - started)
            ) is not None:
                items = self.model.synthetic_items(step.num_items, step.length)
                batch_started = time.perf_counter()
                try:
                    _, peak = self._forward(items, settle=True)
                except ModelOutOfMemory:
                    warm_up.out_of_memory()
                    continue
                elapsed = time.perf_counter() - batch_started
                warm_up.ran(BatchOutcome(step.num_items, step.length, elapsed, peak))
            report = warm_up.finish(time.perf_counter() - started)
        finally:
            if on_host:
                tune_host_allocator(measuring=False, reading=self.read())
        log.info("warm-up: %s in %.1fs", report.describe(), report.elapsed_s)
        return report

    def use_lanes(self, num_threads: int | None = None) -> str | None:
        """On a CPU, run passes side by side (``lanes``) where memory cannot bind even the
        largest batch the caps allow once per lane; say how, or None where they do not run.
        ``num_threads``: what the passes may use (default: torch's thread count)."""
        num_lanes, per_lane = lane_shape(num_threads or torch_threads())
        if self.device_type != "cpu" or num_lanes < 2:
            return None
        if self.caps_bind(self.read(), batches=num_lanes) is None:
            return None
        self.lanes = Lanes(num_lanes, per_lane)
        return f"{num_lanes} passes at a time, {per_lane} torch thread{'s' * (per_lane > 1)} each"

    def close(self) -> None:
        if self.lanes is not None:
            self.lanes.close()

    def caps_bind(self, reading: MemoryReading | None, *, batches: int = 1) -> str | None:
        """Why memory cannot bind any batch (None where it may, or no probe can tell): the
        largest batch the caps allow at any length, as the sizer predicts its peak, is
        within ``WARM_UP_MEMORY_SHARE`` of the memory budget now (``batches`` of them at
        once, for lanes)."""
        if reading is None or reading.free_bytes is None:
            return None
        free = reading.free_bytes
        if reading.enforced_free_bytes is not None:
            free = min(free, reading.enforced_free_bytes)
        budget = self.sizer.memory_budget(free)
        if budget is None:
            return None
        config = self.sizer.config
        peak, shape = max(
            (self.sizer.predict(n, length), (n, length))
            for length in range(1, self.model.info.max_input_tokens + 1)
            for n in [max(1, min(config.max_items, config.max_tokens // length))]
        )
        if batches * peak > WARM_UP_MEMORY_SHARE * budget:
            return None
        return (
            f"the largest batch the caps allow ({shape[0]} x {shape[1]} tokens) is predicted "
            f"at {peak / MiB:.0f} MiB, within {WARM_UP_MEMORY_SHARE:.0%} of the "
            f"{budget / MiB:.0f} MiB budget"
        )

    def _forward(self, items: Sequence[Item], *, settle: bool = False) -> tuple[list[Any], Any]:
        # Side by side, a pass's peak is the process's, its neighbour's included: not measured.
        probe = self.probe if self.lanes is None else None
        return measured_forward(
            self._timed_forward, items, probe=probe, oom_errors=(ModelOutOfMemory,),
            settle=settle,
        )  # fmt: skip

    def _timed_forward(self, items: Sequence[Item]) -> list[Any]:
        """``model.forward``, watched (``watch``) and timed: the slowest pass so far, in
        seconds per unit of the time prior, says how long the next one should take."""
        units = self.time_prior.predict(len(items), max((item.cost for item in items), default=1))
        watch = self.watch
        started = time.perf_counter()
        expected_s = self._seconds_per_unit * units
        with watch.passing(expected_s) if watch is not None else contextlib.nullcontext():
            outputs = self.model.forward(items)
        rate = (time.perf_counter() - started) / units
        with self._guard:
            self._seconds_per_unit = max(self._seconds_per_unit, rate)
        return outputs

    def run(
        self, items: Sequence[Item], on_batch: Callable[[int, int], None] | None = None
    ) -> list[Any]:
        """One output per item, in order (an ``OutOfMemoryInput`` where one could not fit).
        ``on_batch(inputs, tokens)`` is called after each batch."""
        outputs: list[Any] = [None] * len(items)
        costs = [item.cost for item in items]
        budget = self.sizer.budget(self.read())
        self.stats.budget = budget
        batches = plan_window(costs, budget, self.time_prior.predict)
        if self.lanes is not None:
            self.lanes.run(batches, lambda batch: self._run(items, batch, outputs, on_batch))
            return outputs
        for batch in batches:
            self._run(items, batch, outputs, on_batch)
        return outputs

    def _run(
        self,
        items: Sequence[Item],
        batch: list[int],
        outputs: list[Any],
        on_batch: Callable[[int, int], None] | None,
    ) -> None:
        """Run ``batch`` (indices into ``items``); split it first where memory has shrunk
        since the window was planned, and on OOM, down to one input."""
        padded_len = max(items[i].cost for i in batch)
        with self._guard:
            reading = self.read()
            budget = self.sizer.budget(reading)
            fits = budget.fits(len(batch), padded_len)
        if not fits:
            if len(batch) > 1:
                with self._guard:
                    self.stats.budget_splits += 1
                for half in split(batch):
                    self._run(items, list(half), outputs, on_batch)
                return
            if refused_alone(padded_len, budget) is not None and not self._room_for(padded_len):
                # Past a cgroup's limit the kernel kills the job, and the window with it.
                with self._guard:
                    self._fail(batch, outputs, f"{padded_len} tokens: predicted to exceed memory")
                return
        started = time.perf_counter()
        before = self.reserve.state()
        try:
            results, peak = self._forward([items[i] for i in batch])  # the lanes' one overlap
        except ModelOutOfMemory:
            with self._guard:
                self.sizer.on_oom(len(batch), padded_len)
            if len(batch) == 1 or not self.oom_split:
                log.warning(
                    "batch of %d x %d tokens does not fit in memory", len(batch), padded_len
                )
                with self._guard:
                    self._fail(batch, outputs, f"{padded_len} tokens: out of memory even alone")
                return
            with self._guard:
                self.stats.oom_splits += 1
            log.info("batch of %d x %d tokens ran out of memory; splitting", len(batch), padded_len)
            for half in split(batch):
                self._run(items, list(half), outputs, on_batch)
            return
        elapsed = time.perf_counter() - started
        if len(results) != len(batch):
            raise RuntimeError(f"the model returned {len(results)} outputs for {len(batch)} inputs")
        for index, result in zip(batch, results, strict=True):
            outputs[index] = result
        with self._guard:
            self._observed(reading, before, peak, len(batch), padded_len, elapsed)
            tokens = sum(items[i].cost for i in batch)
            stats = self.stats
            stats.batches += 1
            stats.inputs += len(batch)
            stats.tokens += tokens
            stats.padded_tokens += len(batch) * padded_len
            if on_batch is not None:
                on_batch(len(batch), tokens)

    def _observed(
        self, reading: MemoryReading | None, before: tuple[int, int], peak: int | None,
        num_items: int, padded_len: int, elapsed: float,
    ) -> None:  # fmt: skip
        if reading is not None:
            self._note_peak(reading, peak)
        evidence = self._evidence(before, peak, num_items, padded_len)
        self.sizer.observe(BatchOutcome(num_items, padded_len, elapsed, evidence))

    def _evidence(
        self, before: tuple[int, int], peak: int | None, num_items: int, padded_len: int
    ) -> int | None:
        """The batch's peak, where it can correct the memory model: nothing else in the job
        allocated meanwhile, and it passes the prediction by more than noise."""
        busy, changes = before
        if peak is None or busy or self.reserve.state() != (0, changes):
            return None
        if peak <= self.sizer.model.predict(num_items, padded_len) + PEAK_NOISE_BYTES:
            return None
        return peak

    def _fail(self, batch: list[int], outputs: list[Any], reason: str) -> None:
        for index in batch:
            outputs[index] = OutOfMemoryInput(f"out of memory: {reason}")
        self.stats.out_of_memory += len(batch)
