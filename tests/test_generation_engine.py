"""The engine's step loop with a scripted generator: who joins and leaves which step, what an
OOM or a failed step does, cancellation, deadlines, drains and a full waiting queue."""

import asyncio
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

import generation.engine as engine_module
from batching import (
    DeadlineExceeded,
    InferenceFailed,
    MemoryReading,
    ModelThread,
    MonotonicClock,
    OutOfMemory,
    QueueFull,
    ShuttingDown,
)
from generation import EngineConfig, GenerationEngine, GenerationMetrics, SequenceSpec
from models import (
    ArchitectureShape,
    GenerationDefaults,
    ModelInfo,
    ModelOutOfMemory,
    SampledToken,
    SamplingParams,
    StepRequest,
    StepResult,
)
from tests.fakes import FakeClock

GREEDY = SamplingParams(temperature=0)
EOS = 0
SHAPE = ArchitectureShape(
    hidden_size=8, num_layers=1, num_heads=1, intermediate_size=8, element_bytes=4,
    parameter_bytes=0, architecture="decoder",
)  # fmt: skip


class Pieces:
    """A detokenizer whose text for token ``t`` is ``<t>``."""

    def add(self, token: int) -> str:
        return f"<{token}>"


class ScriptedPrompts:
    def detokenizer(self, prompt_ids: Sequence[int]) -> Pieces:
        return Pieces()

    def token_text(self, token: int) -> str:
        return f"<{token}>"


class ScriptedGenerator:
    """The token after position p of a sequence is ``10 + p`` (``EOS`` at ``eos_at``), so a
    sequence preempted and prefilled again goes on with the same tokens. Records every
    step's chunks as ``(seq_id, start, tokens)``; fails steps as told."""

    cache_bytes_per_token = 10
    cache_window_bytes_per_token = 0
    cache_window_tokens = 0

    def __init__(self, *, oom_above: int | None = None, fail_steps: Sequence[int] = (),
                 eos_at: int | None = None) -> None:  # fmt: skip
        self.info = ModelInfo(
            name="scripted", task="generate", device="cpu", dtype="float32",
            max_input_tokens=1000, num_parameters=0, output_dim=None, shape=SHAPE,
        )  # fmt: skip
        self.defaults = GenerationDefaults(eos_token_ids=frozenset({EOS}))
        self.steps: list[list[tuple[int, int, int]]] = []
        self.freed: list[list[int]] = []
        self.cached: dict[int, int] = {}
        self.oom_above = oom_above
        self.fail_steps = set(fail_steps)
        self.eos_at = eos_at

    def preparer(self) -> ScriptedPrompts:
        return ScriptedPrompts()

    def step_bytes(self, num_tokens: int, attended: int, num_sampled: int) -> int:
        return 0

    def free(self, seq_ids: Sequence[int], *, forget: bool = False) -> int:
        for seq_id in seq_ids:
            self.cached.pop(seq_id, None)
        return self.held

    @property
    def held(self) -> int:
        return sum(self.cached.values()) * self.cache_bytes_per_token

    def step(self, request: StepRequest) -> StepResult:
        self.freed.append(list(request.free))
        self.free(request.free)
        number = len(self.steps)
        self.steps.append([(c.seq_id, c.start, len(c.token_ids)) for c in request.chunks])
        if number in self.fail_steps:
            raise RuntimeError("a scripted failure")
        if self.oom_above is not None and len(request.chunks) > self.oom_above:
            raise ModelOutOfMemory("scripted: can't allocate memory", 1 << 20)
        tokens = []
        for chunk in request.chunks:
            end = chunk.start + len(chunk.token_ids)
            self.cached[chunk.seq_id] = end
            if chunk.sampling is not None:
                token = EOS if self.eos_at is not None and end == self.eos_at else 10 + end
                tokens.append(SampledToken(chunk.seq_id, token))
        return StepResult(tokens, self.held)


@pytest.fixture
async def thread():
    thread = ModelThread("batchfit-test-model")
    yield thread
    thread.close()


async def started(model, thread, **config):
    engine = GenerationEngine(
        name="m", model=model, model_thread=thread, clock=MonotonicClock(),
        metrics=GenerationMetrics(CollectorRegistry(), max_step_tokens=2048).for_model("m"),
        config=EngineConfig(**config),
    )  # fmt: skip
    task = asyncio.create_task(engine.run())
    return engine, task


async def read_all(stream):
    events = []
    while True:
        try:
            events.extend(await asyncio.wait_for(stream.next_events(), 10))
        except EOFError:
            return events


def spec(prompt, max_tokens, **kw):
    return SequenceSpec(list(range(1, prompt + 1)), max_tokens, GREEDY, **kw)


async def stop(engine, task):
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_request_joins_at_the_next_step_and_a_finished_one_leaves_at_once(thread):
    model = ScriptedGenerator()
    engine, task = await started(model, thread)
    first, (a,) = engine.submit([spec(4, 3)], timeout_s=10)
    events = await first.next_events()  # its first token
    second, (b,) = engine.submit([spec(2, 5)], timeout_s=10)
    await read_all(first)
    await read_all(second)
    await stop(engine, task)
    steps = [[seq_id for seq_id, _, _ in step] for step in model.steps]
    joined = next(i for i, step in enumerate(steps) if b.seq_id in step)
    assert a.seq_id in steps[joined]  # decoding beside b's prompt
    last_a = max(i for i, step in enumerate(steps) if a.seq_id in step)
    assert all(a.seq_id not in step for step in steps[last_a + 1 :])
    assert a.seq_id in model.freed[last_a + 1]  # its cache went with the next step
    assert [e.text for e in events] == ["<14>"]
    assert a.output_ids == [14, 15, 16] and b.finish_reason == "length"


async def test_events_carry_text_tokens_and_the_end_and_eos_ends_with_stop(thread):
    model = ScriptedGenerator(eos_at=6)
    engine, task = await started(model, thread)
    stream, _ = engine.submit([spec(4, 10), spec(3, 2)], timeout_s=10)
    events = await read_all(stream)
    await stop(engine, task)
    by_choice = {0: [], 1: []}
    for event in events:
        by_choice[event.index].append(event)
    assert "".join(e.text for e in by_choice[0]) == "<14><15>"  # then EOS, which has no text
    assert by_choice[0][-1].finish_reason == "stop" and by_choice[0][-1].num_output_tokens == 3
    assert by_choice[1][-1].finish_reason == "length"
    assert "".join(e.text for e in by_choice[1]) == "<13><14>"


async def test_a_stop_string_ends_the_sequence_and_the_text_before_it_goes_out(thread):
    model = ScriptedGenerator()
    engine, task = await started(model, thread)
    stream, (seq,) = engine.submit([spec(2, 20, stop=("<15>",))], timeout_s=10)
    events = await read_all(stream)
    await stop(engine, task)
    assert "".join(e.text for e in events) == "<12><13><14>"
    assert events[-1].finish_reason == "stop"
    assert seq.finish_reason == "stop"


async def test_a_cancelled_sequence_leaves_by_the_next_step_and_its_cache_is_freed(thread):
    model = ScriptedGenerator()
    engine, task = await started(model, thread)
    stream, (seq,) = engine.submit([spec(3, 1000)], timeout_s=10)
    await stream.next_events()
    engine.cancel([seq])
    for _ in range(100):
        if seq.seq_id not in model.cached:
            break
        await asyncio.sleep(0.01)
    await stop(engine, task)
    assert seq.seq_id not in model.cached and engine.running == []
    cancelled_at = next(i for i, freed in enumerate(model.freed) if seq.seq_id in freed)
    assert all(seq.seq_id not in {c for c, _, _ in s} for s in model.steps[cancelled_at:])


async def test_an_oom_preempts_the_newer_half_and_every_sequence_still_ends_right(thread):
    model = ScriptedGenerator(oom_above=2)
    engine, task = await started(model, thread)
    streams = [engine.submit([spec(5 + i, 4)], timeout_s=10) for i in range(4)]
    results = [await read_all(stream) for stream, _ in streams]
    await stop(engine, task)
    for (_, (seq,)), events in zip(streams, results, strict=True):
        prompt = len(seq.spec.prompt_ids)
        assert seq.output_ids == [10 + prompt + k for k in range(4)]
        assert "".join(e.text for e in events) == "".join(f"<{t}>" for t in seq.output_ids)
    assert all(len(step) <= 4 for step in model.steps)
    assert engine.metrics.preemptions["out_of_memory"]._value.get() >= 2


class ScriptedProbe:
    """Free memory as a function of the steps the model has run: none between ``tight``'s
    steps, plenty before and after."""

    name = "scripted"

    def __init__(self, model: ScriptedGenerator, tight: range) -> None:
        self.model = model
        self.tight = tight

    def read(self) -> MemoryReading:
        free = 0 if len(self.model.steps) in self.tight else 1 << 30
        return MemoryReading(free_bytes=free)


async def test_a_shrinking_budget_preempts_the_newest_and_they_resume_without_a_repeat(
    thread, monkeypatch
):
    released: list[int] = []
    model = ScriptedGenerator()
    # A trim that releases nothing: the budget is not read again.
    monkeypatch.setattr(engine_module, "release_host_memory",
                        lambda: released.append(len(model.steps)))  # fmt: skip
    monkeypatch.setattr(engine_module, "RECLAIM_INTERVAL_S", 1e9)
    engine = GenerationEngine(
        name="m", model=model, model_thread=thread, clock=MonotonicClock(),
        metrics=GenerationMetrics(CollectorRegistry(), max_step_tokens=2048).for_model("m"),
        config=EngineConfig(), probe=ScriptedProbe(model, tight=range(6, 16)),
    )  # fmt: skip
    task = asyncio.create_task(engine.run())
    streams = [engine.submit([spec(5, 30)], timeout_s=10) for _ in range(4)]
    results = [await read_all(stream) for stream, _ in streams]
    await stop(engine, task)
    sequences = [seq for _, (seq,) in streams]
    # Through the tight steps only the oldest ran; the three newer ones were preempted.
    assert [seq.num_preemptions for seq in sequences] == [0, 1, 1, 1]
    assert all({c for c, _, _ in step} == {sequences[0].seq_id} for step in model.steps[7:16])
    for seq, events in zip(sequences, results, strict=True):
        # Resumed by prefilling prompt and outputs from position 0, its stream goes on where
        # it stopped: every token once, the same as without the pressure.
        assert seq.output_ids == [10 + 5 + k for k in range(30)]
        assert "".join(e.text for e in events) == "".join(f"<{t}>" for t in seq.output_ids)
        assert events[-1].finish_reason == "length"
    for seq in sequences[1:]:
        # Its cache was freed: it was fed from position 0 twice (its prompt, then all again).
        starts = [start for step in model.steps for c, start, _ in step if c == seq.seq_id]
        assert starts.count(0) == 2, starts
    assert engine.metrics.preemptions["memory"]._value.get() == 3
    assert engine.metrics.resumed._value.get() == 3
    # Before the three were preempted, the C allocator's free memory went back to the
    # kernel (it released none here); the step that preempted them freed their cache, then
    # did so again before its own forward pass.
    assert released == [6, 6]


class TrimmedProbe:
    """None free between ``tight``'s steps, held by this process's allocator (its resident
    memory up by as much), unless it was trimmed as the step was planned: then plenty, as
    outside them."""

    name = "scripted"

    def __init__(self, model: ScriptedGenerator, tight: range) -> None:
        self.model = model
        self.tight = tight
        self.trimmed_at: list[int] = []

    def trim(self) -> int:
        self.trimmed_at.append(len(self.model.steps))
        return 64 << 20

    def read(self) -> MemoryReading:
        steps = len(self.model.steps)
        short = steps in self.tight and steps not in self.trimmed_at
        held = 1 << 30 if short else 0
        return MemoryReading(free_bytes=(1 << 30) - held, used_bytes=(1 << 28) + held)


async def test_what_the_allocator_holds_free_goes_back_before_a_sequence_is_preempted(
    thread, monkeypatch
):
    model = ScriptedGenerator()
    probe = TrimmedProbe(model, tight=range(6, 16))
    monkeypatch.setattr(engine_module, "release_host_memory", probe.trim)
    engine = GenerationEngine(
        name="m", model=model, model_thread=thread, clock=MonotonicClock(),
        metrics=GenerationMetrics(CollectorRegistry(), max_step_tokens=2048).for_model("m"),
        config=EngineConfig(), probe=probe,
    )  # fmt: skip
    task = asyncio.create_task(engine.run())
    streams = [engine.submit([spec(5, 30)], timeout_s=10) for _ in range(4)]
    results = [await read_all(stream) for stream, _ in streams]
    await stop(engine, task)
    # Every tight step was planned again after a trim, and found the room it released.
    assert probe.trimmed_at == list(range(6, 16))
    assert engine.metrics.preemptions["memory"]._value.get() == 0
    for (_, (seq,)), events in zip(streams, results, strict=True):
        assert seq.num_preemptions == 0
        assert seq.output_ids == [10 + 5 + k for k in range(30)]
        assert "".join(e.text for e in events) == "".join(f"<{t}>" for t in seq.output_ids)


class FallingProbe:
    """Plenty of free memory at the first reading, little (but enough) at every later one."""

    name = "scripted"

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> MemoryReading:
        self.reads += 1
        return MemoryReading(free_bytes=1 << 30 if self.reads == 1 else 10_000)


async def test_memory_others_took_while_the_engine_idled_is_not_read_as_still_falling(thread):
    """The room fell while nothing ran: that is where memory stands, not a rate at which
    others keep taking it, so a burst after the wait joins in one step."""
    model = ScriptedGenerator()
    engine = GenerationEngine(
        name="m", model=model, model_thread=thread, clock=MonotonicClock(),
        metrics=GenerationMetrics(CollectorRegistry(), max_step_tokens=2048).for_model("m"),
        config=EngineConfig(), probe=FallingProbe(),
    )  # fmt: skip
    task = asyncio.create_task(engine.run())
    await asyncio.sleep(0.05)  # it read memory once, and waits for work
    streams = [engine.submit([spec(5, 30)], timeout_s=10) for _ in range(4)]
    for stream, _ in streams:
        await read_all(stream)
    await stop(engine, task)
    assert len(model.steps[0]) == 4


async def test_a_lone_sequence_that_cannot_run_ends_with_length_or_507(thread):
    model = ScriptedGenerator()
    engine, task = await started(model, thread)
    stream, (seq,) = engine.submit([spec(3, 100)], timeout_s=10)
    await stream.next_events()
    model.oom_above = 0  # from now on, every step fails its allocation
    events = await read_all(stream)
    assert events[-1].finish_reason == "length" and seq.finish_reason == "length"
    stream, _ = engine.submit([spec(3, 100)], timeout_s=10)
    with pytest.raises(OutOfMemory, match="does not fit in memory even alone"):
        await read_all(stream)
    await stop(engine, task)
    ended = engine.metrics.oversized
    assert ended["length"]._value.get() == 1 and ended["refused"]._value.get() == 1


async def test_a_failed_step_fails_its_sequences_and_the_engine_carries_on(thread):
    model = ScriptedGenerator(fail_steps=[0])
    engine, task = await started(model, thread)
    stream, _ = engine.submit([spec(3, 3)], timeout_s=10)
    with pytest.raises(InferenceFailed):
        await read_all(stream)
    stream, (seq,) = engine.submit([spec(3, 3)], timeout_s=10)
    await read_all(stream)
    assert seq.output_ids == [13, 14, 15] and engine.healthy
    await stop(engine, task)


async def test_no_first_token_by_the_deadline_is_504(thread):
    model = ScriptedGenerator()
    engine, task = await started(model, thread)
    stream, _ = engine.submit([spec(3, 3)], timeout_s=0)
    with pytest.raises(DeadlineExceeded):
        await read_all(stream)
    await stop(engine, task)
    assert model.cached == {}


async def test_a_drain_fails_the_sequences_that_have_not_started_and_lets_running_ones_finish(
    thread,
):
    model = ScriptedGenerator()
    engine, task = await started(model, thread, max_running=1)
    running, (first,) = engine.submit([spec(3, 20)], timeout_s=10)
    await running.next_events()
    waiting, _ = engine.submit([spec(3, 20)], timeout_s=10)
    assert engine.fail_waiting(ShuttingDown("draining")) == 1
    with pytest.raises(ShuttingDown):
        await read_all(waiting)
    events = await read_all(running)
    await stop(engine, task)
    assert events[-1].finish_reason == "length" and len(first.output_ids) == 20


async def test_a_full_waiting_queue_refuses_the_whole_request(thread):
    model = ScriptedGenerator()
    engine, task = await started(model, thread, max_waiting=3)
    engine.submit([spec(3, 3), spec(3, 3)], timeout_s=10)
    with pytest.raises(QueueFull):
        engine.submit([spec(3, 3), spec(3, 3)], timeout_s=10)
    await stop(engine, task)


async def test_stopping_ends_every_stream(thread):
    model = ScriptedGenerator()
    engine, task = await started(model, thread)
    stream, _ = engine.submit([spec(3, 10_000)], timeout_s=10)
    await stream.next_events()
    await stop(engine, task)
    with pytest.raises(ShuttingDown):
        await read_all(stream)


async def test_a_prompt_whose_chunks_leave_one_token_goes_on_with_that_token(thread):
    """Chunks of 9 over a 10-token prompt leave its last token: the step after feeds it (a
    sequence with one token pending and no output yet) and samples the first token."""
    model = ScriptedGenerator()
    engine, task = await started(
        model, thread, max_step_tokens=9, default_prefill_tokens=9, max_running=4
    )
    streams = [engine.submit([spec(10, 3)], timeout_s=10) for _ in range(3)]
    results = [await read_all(stream) for stream, _ in streams]
    await stop(engine, task)
    for (_, (seq,)), events in zip(streams, results, strict=True):
        assert seq.output_ids == [20, 21, 22] and events[-1].finish_reason == "length"
    fed = [(c[1], c[2]) for step in model.steps for c in step if c[0] == streams[0][1][0].seq_id]
    assert fed[:2] == [(0, 9), (9, 1)]


class TimedScriptedGenerator(ScriptedGenerator):
    """A ``ScriptedGenerator`` whose steps take ``2 ms + 0.05 ms`` a token on ``clock``: the
    scripted model's own time is scheduler noise, which a fit may find no per-token cost in."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def step(self, request: StepRequest) -> StepResult:
        self.clock.advance(2e-3 + 5e-5 * request.num_tokens)
        return super().step(request)


async def test_warm_up_fits_the_step_time_model_and_frees_what_it_ran(thread):
    clock = FakeClock()
    model = TimedScriptedGenerator(clock)
    engine = GenerationEngine(
        name="m", model=model, model_thread=thread, clock=clock,
        metrics=GenerationMetrics(CollectorRegistry(), max_step_tokens=2048).for_model("m"),
        config=EngineConfig(),
    )  # fmt: skip
    await engine.warm_up()
    assert engine.pacing.time_model.coefficients is not None
    assert model.cached == {} and engine.cache_bytes == 0
    assert max(sum(n for _, _, n in step) for step in model.steps) >= 256


def test_the_metrics_take_a_deadline_past_ten_minutes():
    metrics = GenerationMetrics(CollectorRegistry(), max_step_tokens=2048, max_latency_s=900)
    assert metrics.for_model("m") is not None
