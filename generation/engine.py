"""The step loop of one generator: schedule, run the step on the model thread, apply the
sampled tokens, and feed each sequence's stream.

One engine per generator runs on the replica's event loop. Its steps go to the replica's
``ModelThread``, which also runs the batcher's forward passes: calls run in the order they
were handed over, so a decode step and an encoder batch take turns, and the memory probe
both read sizes both. Which sequences wait and run, and how each ends, is ``roster.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

from batching import (
    Clock,
    InferenceFailed,
    MemoryProbe,
    ModelThread,
    OutOfMemory,
    ShuttingDown,
    release_host_memory,
)
from models import (
    DeviceError,
    Generator,
    ModelOutOfMemory,
    SeqChunk,
    StepRequest,
    StepResult,
)

from .config import EngineConfig
from .metrics import ModelGenerationMetrics
from .pacing import StepPacing, warm_up
from .roster import Roster
from .scheduler import StepBudget, StepPlan, schedule
from .sequence import SeqState, Sequence
from .text import SequenceText, emit

log = logging.getLogger("batchfit.generation")
RECLAIM_INTERVAL_S = 1.0
"""While waiting sequences stay out for want of memory, the allocator is trimmed at most this
often (``GenerationEngine._reclaim``)."""


class GenerationEngine(Roster):
    def __init__(
        self,
        *,
        name: str,
        model: Generator,
        model_thread: ModelThread,
        clock: Clock,
        metrics: ModelGenerationMetrics,
        config: EngineConfig,
        probe: MemoryProbe | None = None,
    ) -> None:
        super().__init__(name=name, model=model, clock=clock, metrics=metrics, config=config)
        self._thread = model_thread
        self._probe = probe
        self._prompts = model.preparer()
        self.cache_bytes = 0
        """What the store held after the latest step."""
        self.cache_slack_bytes = 0
        """Of ``cache_bytes``, what lies past its sequences' positions."""
        self.cache_growth_bytes = 0
        """What the next step would add to ``cache_bytes`` (and copy) to grow buffers."""
        self.pacing = StepPacing(config, model)
        self.healthy = True
        self.num_steps = 0
        self._reclaimed_s = -RECLAIM_INTERVAL_S
        """When ``_reclaim`` last trimmed the allocator."""

    async def warm_up(self) -> None:
        """Timed steps of a few shapes (``pacing.warm_up``), their sequences freed after."""

        async def step(request: StepRequest) -> float:
            started = self._clock.now()
            await self._thread.call(self.model.step, request)
            return self._clock.now() - started

        ran = await warm_up(step, self.pacing, self.name)
        self.cache_bytes = await self._thread.call(lambda: self.model.free(ran, forget=True))

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """Step until cancelled; then every sequence still in it ends with
        ``ShuttingDown``. A device error ends it too (after failing its step's sequences):
        the replica decides what a dead engine means."""
        error: BaseException = ShuttingDown("the server stopped before this sequence ended")
        unsent: list[tuple[Sequence, list]] = []
        try:
            while True:
                plan, request = self._plan()
                future = self._start(plan, request) if request else None
                if unsent:
                    emit(unsent, self._prompts, self._clock.now(), self.metrics, self._finish)
                    unsent = []
                if future is None:
                    await self._idle()
                    continue
                unsent = await self._outcome(plan, request, future)
        except DeviceError:
            self.healthy = False
            error = InferenceFailed("the device failed; this replica is stopping")
            raise
        except BaseException:
            self.healthy = False
            raise
        finally:
            self.stopped = True
            self.fail_all(error)

    async def _idle(self) -> None:
        self._wake.clear()
        if self.running or self.waiting:
            # Work that cannot run now (a deadline to wait for, nothing fits): look again
            # after a while, or at once when something changes.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.05)
            return
        self.pacing.idle()
        await self._wake.wait()

    def _plan(self) -> tuple[StepPlan, StepRequest | None]:
        """Drop what ended, schedule, and build the step's request (None: nothing to do)."""
        now = self._clock.now()
        self._drop_ended(now)
        budget = self._budget(now)
        plan = schedule(self.running, self.waiting, budget)
        if plan.short_of_memory and self._reclaim(now, preempting=bool(plan.preempt)):
            budget = self._budget(now, again=True)
            plan = schedule(self.running, self.waiting, budget)
        for seq in plan.preempt:
            self._preempt(seq, "memory")
        if budget.cache_bytes is not None:
            self.pacing.planned(len(plan.preempt))
        chunks = []
        for seq in plan.decode:
            # NOTE: its one pending token is its latest output, or the last of a prompt whose
            # chunks left exactly one token: read it from the sequence, not from its outputs.
            token = seq.tokens(seq.num_cached, seq.num_cached + 1)
            chunks.append(SeqChunk(seq.seq_id, token, seq.num_cached, seq.spec.sampling))
        for seq, count in plan.prefill:
            if seq.state is SeqState.WAITING:
                self._admit(seq, now)
            stop = seq.num_cached + count
            sampling = seq.spec.sampling if stop == seq.num_tokens else None
            chunks.append(SeqChunk(seq.seq_id, seq.tokens(seq.num_cached, stop),
                                   seq.num_cached, sampling, seq.num_tokens))  # fmt: skip
        if not chunks and not self._to_free:
            return plan, None
        request = StepRequest(chunks, free=self._to_free, forget=self._to_forget)
        self._to_free, self._to_forget = [], []
        return plan, request

    def _budget(self, now: float, again: bool = False) -> StepBudget:
        reading = self._probe.read() if self._probe is not None else None
        budget = self.pacing.budget(
            self.running, reading, self.cache_bytes, now, slack_bytes=self.cache_slack_bytes,
            growth_bytes=self.cache_growth_bytes, waiting=len(self.waiting), again=again,
        )  # fmt: skip
        if budget.cache_bytes is not None:
            self.metrics.cache_budget_bytes.set(budget.cache_bytes)
        return budget

    def _reclaim(self, now: float, *, preempting: bool) -> bool:
        """Short of memory: hand what the C allocator holds free back to the kernel, and say
        whether that released any (then the budget is read again). Buffers freed as sequences
        grow or end, and a step's activations, leave holes in its heap that count as used
        until trimmed: a trim released 19 MiB on average, of a 150 MiB room, in the memory
        benchmark's cgroup. Before preempting, always; while waiting sequences stay out, at
        most once every ``RECLAIM_INTERVAL_S`` (a trim took 1 to 3 ms there, and the pages
        it hands back fault in again as the next steps reuse them)."""
        if self._probe is None or (not preempting and now - self._reclaimed_s < RECLAIM_INTERVAL_S):
            return False
        self._reclaimed_s = now
        return bool(release_host_memory())

    def _admit(self, seq: Sequence, now: float) -> None:
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.state = SeqState.RUNNING
        if seq.started_s is None:
            seq.started_s = now
            self.metrics.prompt_tokens.inc(len(seq.spec.prompt_ids))
        elif seq.num_preemptions:
            self.metrics.resumed.inc()
        self._show_counts()

    def _start(self, plan: StepPlan, request: StepRequest) -> asyncio.Future[StepResult]:
        """The step on the model thread. A step that preempts for memory first frees the
        preempted sequences' cache and hands what the C allocator then holds free back to
        the kernel: a cache block below its mmap threshold, freed, stays resident (and
        counted against a cgroup's limit) until trimmed, and room is what preempting is for."""
        if not plan.preempt or not request.free:
            return self._thread.start(self.model.step, request)
        model, freed = self.model, list(request.free)

        def free_then_step() -> StepResult:
            model.free(freed)
            release_host_memory()
            return model.step(replace(request, free=()))

        return self._thread.start(free_then_step)

    def _preempt(self, seq: Sequence, reason: str) -> None:
        """Free its cache; it goes back to the waiting sequences with what it generated,
        to prefill it all again later."""
        self.running.remove(seq)
        seq.state = SeqState.WAITING
        seq.num_cached = 0
        seq.num_preemptions += 1
        self._to_free.append(seq.seq_id)
        self.waiting.append(seq)
        self.metrics.preemptions[reason].inc()
        self._show_counts()
        log.info("generator %s: preempted sequence %d (%s)", self.name, seq.seq_id, reason)

    async def _outcome(
        self, plan: StepPlan, request: StepRequest, future: asyncio.Future[StepResult]
    ) -> list[tuple[Sequence, list]]:
        """Wait for the step; apply its tokens. Returns the sequences with new tokens, for
        their streams."""
        started = self._clock.now()
        stepped = [*plan.decode, *(seq for seq, _ in plan.prefill)]
        try:
            result = await future
        except ModelOutOfMemory as exc:
            self.pacing.out_of_memory(request)
            self._out_of_memory(stepped, exc)
            return []
        except DeviceError:
            for seq in stepped:
                self._end(seq, error=InferenceFailed("the device failed; this replica is stopping"))
            raise
        except Exception:
            log.exception("generator %s: a step of %d sequences failed", self.name, len(stepped))
            for seq in stepped:
                self._end(seq, error=InferenceFailed("generation failed"))
            return []
        now = self._clock.now()
        elapsed = now - started
        self.num_steps += 1
        self.cache_bytes, self.cache_slack_bytes = result.cache_bytes, result.slack_bytes
        self.cache_growth_bytes = result.growth_bytes
        self.metrics.cache_bytes.set(result.cache_bytes)
        if request.chunks:
            self.pacing.learn(request, len(plan.decode), elapsed)
            self.metrics.step_tokens.observe(request.num_tokens)
            self.metrics.step_duration.observe(elapsed)
        for chunk, seq in zip(request.chunks, stepped, strict=True):
            if seq.state is SeqState.RUNNING:
                seq.num_cached = chunk.start + len(chunk.token_ids)
        sampled = {token.seq_id: token for token in result.tokens}
        fresh = []
        for seq in stepped:
            token = sampled.get(seq.seq_id)
            if token is None or seq.state is not SeqState.RUNNING:
                continue  # a prefill chunk short of the end, or it ended meanwhile
            seq.output_ids.append(token.token_id)
            if seq.text is None:
                seq.text = SequenceText(self._prompts, seq)
            fresh.append((seq, [token]))
            if token.token_id in self.model.defaults.eos_token_ids and not seq.spec.ignore_eos:
                seq.text.finish_reason = "stop"
                seq.text.eos = True
            elif seq.room <= 0 or seq.num_tokens >= self.model.info.max_input_tokens:
                seq.text.finish_reason = "length"
            if seq.text.finish_reason is not None:
                self._retire(seq)
        return fresh

    def _out_of_memory(self, stepped: list[Sequence], exc: ModelOutOfMemory) -> None:
        """A step ran out of memory: preempt the newer half of its sequences and let the
        next step run the rest. A lone sequence cannot be split: with tokens generated it
        ends with ``length``; a prompt that cannot be prefilled even alone gets 507."""
        live = [s for s in stepped if s.state is SeqState.RUNNING]
        if len(live) > 1:
            live.sort(key=lambda s: (s.priority, -s.arrival_s, -s.seq_id))
            half = live[: len(live) // 2]
            log.warning(
                "generator %s: a step of %d sequences ran out of memory (%s); preempting %d",
                self.name, len(live), exc, len(half),
            )  # fmt: skip
            for seq in half:
                self._preempt(seq, "out_of_memory")
            return
        for seq in live:
            if seq.output_ids:
                log.warning(
                    "generator %s: sequence %d cannot continue even alone (%s); it ends with "
                    "length", self.name, seq.seq_id, exc,
                )  # fmt: skip
                if seq.text is None:
                    seq.text = SequenceText(self._prompts, seq)
                seq.text.finish_reason = "length"
                self.metrics.oversized["length"].inc()
                self._retire(seq)
                emit([(seq, [])], self._prompts, self._clock.now(), self.metrics, self._finish)
            else:
                message = (
                    f"a prompt of {len(seq.spec.prompt_ids)} tokens does not fit in memory even "
                    f"alone ({exc})"
                )
                self.metrics.oversized["refused"].inc()
                self._end(seq, error=OutOfMemory(message, exc.requested_bytes))
