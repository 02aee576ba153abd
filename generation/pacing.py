"""What the next step may spend, and what each step teaches about it: the caps (lowered by
an OOM, ``ceiling.py``), the prompt tokens beside its decode tokens (``timing.py``), and the
memory its cache may take (what it holds and the free memory read before it, less the
headroom and its activations); and a generator's warm-up, whose timed steps seed them."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from collections.abc import Sequence as Seq

from batching import MemoryReading
from models import Generator, SamplingParams, SeqChunk, StepRequest

from .ceiling import StepCeiling
from .config import EngineConfig
from .scheduler import StepBudget
from .sequence import Sequence
from .timing import PrefillPacer, StepTimeModel, attended

log = logging.getLogger("batchfit.generation")
GROWTH_SHARE_START = 0.5
GROWTH_SHARE_UP = 0.1
"""Added to the growth share by each step that preempts for memory ..."""
GROWTH_SHARE_DOWN = 0.001
"""... and taken off it by each step that does not."""
WIDE_SHARE = 0.05
"""Wider prompt chunks (sequences waiting beside few decoding ones) only where what they take
besides, with what other processes would take meanwhile, is at most this share of the free
memory."""


def _nothing(step_s: float | None) -> float:
    return 0.0


def _factor(factor: float, decoding: int, waiting: int) -> float:
    """The step time factor where ``waiting`` sequences wait for their first token beside
    ``decoding`` ones: the room for prompt tokens, ``factor - 1`` a step, grows by the
    waiting sequences per decoding one. A lone stream keeps its pace while one prompt joins
    it; a burst of new requests is not fed to a few streams a sliver at a time (15 prompts
    of 250 tokens took 9 s beside one stream at 1.8)."""
    return 1.0 + (factor - 1.0) * max(1.0, waiting / max(1, decoding))


class StepPacing:
    def __init__(self, config: EngineConfig, model: Generator) -> None:
        self.config = config
        self._model = model
        self.time_model = StepTimeModel()
        self.pacer = PrefillPacer(self.time_model)
        self.ceiling = StepCeiling()
        """Lowered by an OOM inside a step, raised back by clean steps."""
        self.growth_share = GROWTH_SHARE_START
        """The share of the tokens each running sequence may still make that admission keeps
        room for. Sequences that end early (an end-of-sequence token, a stop) need less than
        their ``max_tokens``; running ones that outgrow the room are preempted and make
        their tokens again. So it rises with every step that preempts and falls slowly with
        every step that does not, towards the share at which preemption is rare."""
        self._last_read: tuple[float, int, int] | None = None
        """When memory was last read: the time, what was free, what this process used."""
        self._taking: Callable[[float | None], float] = _nothing
        """What others take while a step runs, from the latest reading (``_others_taking``)."""

    def budget(
        self, running: Seq[Sequence], reading: MemoryReading | None, cache_bytes: int,
        now: float, slack_bytes: int = 0, growth_bytes: int = 0, waiting: int = 0,
        again: bool = False,
    ) -> StepBudget:  # fmt: skip
        """The next step's budget: with sequences decoding, prompt tokens beside them within
        ``prefill_time_factor`` of their own step (the first of them deeper into a prompt
        costing more; more where more sequences wait for their first token than decode, as
        memory allows: ``_factor``); without, up to ``max_step_tokens``. ``cache_bytes``:
        what the store holds now; ``slack_bytes``: of that, what lies past its sequences'
        positions; ``growth_bytes``: what the next step takes besides to grow its buffers;
        ``waiting``: the sequences not yet running; ``again``: ``reading`` was taken again,
        at once, after this process handed memory back (what others take keeps the rate
        read before it)."""
        config = self.config
        decoding = [s for s in running if s.num_pending <= 1]
        ceiling = self.ceiling
        step_tokens = min(config.max_step_tokens, ceiling.max_tokens or config.max_step_tokens)
        # (prefill tokens, the step's predicted time) at the configured factor, and at the
        # factor that the sequences waiting for their first token allow.
        paces: list[tuple[int, float | None]] = []
        if decoding:
            # The next prompt chunk starts where the first still prefilling stopped (a new
            # prompt: at 0); how deep it is sets what its attention costs.
            prefilling = [s for s in running if s.num_pending > 1]
            depth = prefilling[0].num_cached if prefilling else 0
            alone = self.pacer.alone(len(decoding), sum(s.num_cached + 1 for s in decoding))
            base = max(1.0, config.prefill_time_factor)
            for factor in dict.fromkeys(
                (base, _factor(base, len(decoding), waiting + len(prefilling)))
            ):
                tokens = self.pacer.tokens(alone, factor, depth=depth)
                prefill = config.default_prefill_tokens if tokens is None else max(tokens, 1)
                paces.append((min(prefill, step_tokens), None if alone is None else alone * factor))
        else:
            prefill = step_tokens
            paces.append((prefill, self.time_model.predict(prefill, attended(0, prefill), 1)))
        prefill = paces[-1][0]
        limit = None
        if reading is not None and reading.free_bytes is not None:
            # The activations of the step this budget allows: its tokens, and a row of logits
            # for every running sequence (each sequence that joins adds its own row, which
            # the scheduler counts as it admits it); and what the store takes to grow its
            # buffers (the step that grows one holds the old one while it copies).
            # The headroom is a share of all the cache could hold (what it holds and what is
            # free), not of what is free now: memory others take between two steps (a process
            # beside this one under the same cgroup) finds it still there when free runs low.
            could = cache_bytes + reading.free_bytes
            taking = self._taking if again else self._others_taking(reading, now)
            self._taking = taking
            limits = []
            for chunk, step_s in paces:
                tokens = min(step_tokens, len(decoding) + chunk)
                reserve = self._model.step_bytes(tokens, 0, len(running)) + growth_bytes
                kept = could * (1 - config.headroom_fraction) - reserve - taking(step_s)
                limits.append(max(0.0, kept))
            limit = limits[-1]
            if len(paces) > 1 and (
                limits[0] - limits[1] + taking(paces[1][1]) > WIDE_SHARE * reading.free_bytes
            ):
                # Memory is not ample: what the wider step takes besides, and what others
                # would take while it runs, pass a small share of what is free (under a
                # cgroup's limit, a wider step's activations, which the allocator may keep,
                # crowd the cache and what runs beside it): prompts go on in narrower chunks.
                prefill, limit = paces[0][0], limits[0]
        return StepBudget(
            max_running=min(config.max_running, ceiling.max_sequences or config.max_running),
            max_step_tokens=step_tokens,
            max_prefill_tokens=prefill,
            bytes_per_token=self._model.cache_bytes_per_token,
            bytes_per_row=self._model.step_bytes(0, 0, 2) - self._model.step_bytes(0, 0, 1),
            window_bytes_per_token=self._model.cache_window_bytes_per_token,
            window_tokens=self._model.cache_window_tokens,
            cache_bytes=limit,
            growth_share=self.growth_share,
            slack_bytes=slack_bytes,
            now=now,
            priority_aging_s=config.priority_aging_s,
        )

    def _others_taking(self, reading: MemoryReading, now: float) -> Callable[[float | None], float]:
        """What others are likely to take while the next step runs, as a function of its
        predicted seconds: what they took since the last reading (free memory's fall less
        this process's own growth: a cache that grew, a heap that kept a step's
        activations), at that rate for as long as the next step takes (``step_s``, the time
        model's, within one and ``prefill_time_factor`` times the interval it was read over:
        a rate read over a short interval is too noisy to carry far). Only the latest
        interval counts: once others stop taking, the next budget keeps nothing back for
        them."""
        free = reading.free_bytes or 0
        ours = reading.allocated_bytes if reading.allocated_bytes is not None else (
            reading.used_bytes or 0)  # fmt: skip
        last, self._last_read = self._last_read, (now, free, ours)
        if last is None:
            return _nothing
        then, free_then, ours_then = last
        interval = now - then
        taken = (free_then - free) - (ours - ours_then)
        if interval <= 0 or taken <= 0:
            return _nothing
        factor = max(1.0, self.config.prefill_time_factor)
        return lambda step_s: (
            taken / interval * max(interval, min(step_s or interval, factor * interval))
        )

    def idle(self) -> None:
        """Nothing runs or waits: the reading taken last is no base for a rate over the wait."""
        self._last_read = None

    def planned(self, num_preempted: int) -> None:
        """A step was planned, ``num_preempted`` sequences preempted for memory by it."""
        if num_preempted:
            self.growth_share = min(1.0, self.growth_share + GROWTH_SHARE_UP)
        else:
            self.growth_share = max(0.0, self.growth_share - GROWTH_SHARE_DOWN)

    def learn(self, request: StepRequest, num_decode: int, elapsed_s: float) -> None:
        """A step ran: its time, for the time model; for the pacer too (its first
        ``num_decode`` chunks decode); a clean step for the ceiling."""
        chunks = request.chunks
        if not chunks:
            return
        config = self.config
        self.ceiling.ran(len(chunks), request.num_tokens, max_running=config.max_running,
                         max_step_tokens=config.max_step_tokens)  # fmt: skip
        sampled = sum(chunk.sampling is not None for chunk in chunks)
        self.time_model.observe(request.num_tokens, _attended(chunks), sampled, elapsed_s)
        if num_decode == len(chunks):
            self.pacer.observe_alone(num_decode, elapsed_s)
        elif num_decode:
            alone = self.pacer.alone(num_decode, _attended(chunks[:num_decode]))
            if alone is not None:
                self.pacer.observe(elapsed_s, alone, request.num_tokens - num_decode)

    def out_of_memory(self, request: StepRequest) -> None:
        self.ceiling.out_of_memory(len(request.chunks), request.num_tokens)


async def warm_up(
    step: Callable[[StepRequest], Awaitable[float]], pacing: StepPacing, name: str
) -> list[int]:
    """Run the model's first passes (so that the first request does not pay for them), then
    steps of a few shapes, timed, from which the step time model and the pacer size prefill
    chunks from the first request on. ``step`` runs one and returns its seconds. Returns the
    warm-up's sequences, to free."""
    greedy = SamplingParams(temperature=0.0)
    await step(StepRequest([SeqChunk(-1, list(range(1, 65)), 0, greedy)]))
    await step(StepRequest([SeqChunk(-1, [1], 64, greedy)]))
    lengths = {-1: 65}
    # New prompts (id: (tokens, depth)), each followed by decode steps of every sequence:
    # steps of 1 to 260 tokens over 1 to 5 sequences, chunks at the start of a prompt and
    # deep into one, so that the fit tells its terms apart. The last, a short chunk beside
    # decode tokens, is what pacing steps feed.
    shapes = (
        ({}, 3), ({-2: (16, 0), -3: (16, 0), -4: (16, 0)}, 3), ({-5: (256, 0)}, 2),
        ({-6: (128, 320)}, 1), ({-7: (32, 200)}, 0),
    )  # fmt: skip
    for prompts, decode_steps in shapes:
        for number in range(decode_steps + 1):
            chunks = [SeqChunk(i, [1], n, greedy) for i, n in lengths.items()]
            decoding = len(chunks)
            if number == 0:
                chunks += [SeqChunk(i, [1] * n, depth, greedy)
                           for i, (n, depth) in prompts.items()]  # fmt: skip
            request = StepRequest(chunks)
            pacing.learn(request, decoding, await step(request))
            lengths = {c.seq_id: c.start + len(c.token_ids) for c in chunks}
    if pacing.time_model.coefficients is not None:
        a, b, c, d = pacing.time_model.coefficients
        log.info(
            "generator %s warmed up: a step takes %.1f ms, and %.2f ms more a token, %.2f ms "
            "a thousand query-key pairs, %.2f ms a row through the LM head",
            name, a * 1e3, b * 1e3, c * 1e6, d * 1e3,
        )  # fmt: skip
    return list(lengths)


def _attended(chunks: Seq[SeqChunk]) -> int:
    return sum(attended(chunk.start, len(chunk.token_ids)) for chunk in chunks)
