"""The step time model: fitted to steps of known cost, it predicts them and says how many
prompt tokens a decode step may take beside its decode tokens; and the memory a step's budget
leaves the cache."""

import pytest

from batching import MemoryReading
from generation import EngineConfig, StepTimeModel
from generation.pacing import GROWTH_SHARE_DOWN, GROWTH_SHARE_START, GROWTH_SHARE_UP, StepPacing
from generation.timing import MIN_STEPS, PrefillPacer, attended
from tests.test_generation_scheduler import seq


def cost(tokens: int, pairs: int, seqs: int) -> float:
    return 0.050 + 0.001 * tokens + 0.000001 * pairs + 0.0002 * seqs


def observe(model: StepTimeModel, tokens: int, pairs: int, seqs: int) -> None:
    model.observe(tokens, pairs, seqs, cost(tokens, pairs, seqs))


def test_unfitted_it_predicts_nothing():
    model = StepTimeModel()
    for i in range(MIN_STEPS - 1):
        observe(model, i + 1, 10 * i, 1)
    assert model.predict(10, 0, 1) is None and model.token_cost(0) is None
    assert PrefillPacer(model).tokens(model.predict(1, 0, 1), 2.0) is None


def fitted() -> StepTimeModel:
    model = StepTimeModel()
    for tokens, pairs, seqs in [(1, 100, 1), (16, 3000, 16), (64, 9000, 64), (200, 20000, 3),
                                (40, 900, 8), (512, 131000, 2), (8, 800, 8), (100, 50000, 50),
                                (1024, 524000, 1), (3, 30, 3), (64, 64 * 900, 2)]:  # fmt: skip
        observe(model, tokens, pairs, seqs)
    return model


def test_fitted_it_predicts_steps_and_what_a_prompt_token_costs_at_a_depth():
    model = fitted()
    assert model.predict(32, 5000, 32) == pytest.approx(cost(32, 5000, 32), rel=1e-6)
    assert model.token_cost(0) == pytest.approx(0.001)
    assert model.token_cost(2000) == pytest.approx(0.001 + 2000 * 0.000001)


def test_the_pacer_sizes_chunks_from_what_steps_beside_decode_tokens_took():
    """Until such a step has run, the time model's cost of a token; then what the steps took
    past their decode tokens' alone, a token: within ``factor`` of that alone."""
    model = fitted()
    pacer = PrefillPacer(model)
    alone = pacer.alone(1, 101)
    assert alone == pytest.approx(cost(1, 101, 1))  # no decode step seen: the model's
    assert pacer.tokens(alone, 1.8) == int(0.8 * alone / 0.001)
    pacer.observe_alone(1, 0.060)
    assert pacer.alone(1, 101) == pytest.approx(0.060)
    pacer.observe(elapsed_s=0.100, alone_s=0.060, prefill_tokens=10)  # 4 ms a token
    assert pacer.token_cost_s == pytest.approx(0.004)
    assert pacer.tokens(0.060, 1.8) in (11, 12)  # 48 ms of room, 4 ms a token
    pacer.observe(elapsed_s=0.080, alone_s=0.060, prefill_tokens=10)  # then 2 ms
    assert pacer.token_cost_s == pytest.approx(0.004 + 0.3 * (0.002 - 0.004))


def test_a_term_that_fits_negative_is_dropped():
    model = StepTimeModel()
    for tokens in [1, 2, 4, 8, 16, 32, 64, 128]:
        model.observe(tokens, tokens * tokens, 1, 0.01 + 0.002 * tokens)
    a, b, c, d = model.coefficients
    assert c == pytest.approx(0, abs=1e-12) and d == pytest.approx(0, abs=1e-12)
    assert a == pytest.approx(0.01, abs=1e-9) and b == pytest.approx(0.002)


def test_decode_steps_alone_fit_tokens_not_sequences():
    """Decode steps feed as many tokens as sequences: the two cannot be told apart, and the
    cost goes to tokens (a split between them would halve the cost of a prompt token)."""
    model = StepTimeModel()
    for n, depth in [(1, 10), (2, 300), (4, 20), (8, 900), (16, 50), (32, 7), (64, 400), (3, 3)]:
        model.observe(n, n * depth, n, cost(n, n * depth, n))
    a, b, c, d = model.coefficients
    assert d == 0 and b == pytest.approx(0.0012) and a == pytest.approx(0.05)
    assert c == pytest.approx(0.000001)


def test_attended_pairs_of_a_causal_chunk():
    assert attended(0, 1) == 1 and attended(10, 1) == 11
    assert attended(0, 4) == 1 + 2 + 3 + 4 and attended(100, 2) == 101 + 102
    assert attended(1000, 2, window=16) == 32


class Activations:
    """A generator whose step activations are 1,000 bytes a token and 10 a sampled row."""

    cache_bytes_per_token = 100
    cache_window_bytes_per_token = 0
    cache_window_tokens = 0

    def step_bytes(self, num_tokens: int, attended: int, num_sampled: int) -> int:
        return 1000 * num_tokens + 10 * num_sampled


def test_the_budget_keeps_room_for_the_step_it_allows_not_the_largest_step():
    """What the cache holds and the free memory, less the headroom's share of both, less the
    activations of this step (its decode tokens, its prompt tokens and a logits row per
    running sequence) is what the cache may hold."""
    config = EngineConfig(max_step_tokens=2048, default_prefill_tokens=64, headroom_fraction=0.5)
    pacing = StepPacing(config, Activations())
    running = [seq(i, 10, cached=10, output=1) for i in range(3)]
    free = 1_000_000
    budget = pacing.budget(running, MemoryReading(free_bytes=free), 5000, now=0.0)
    tokens = 3 + 64  # three decode tokens and the default prefill chunk beside them
    assert budget.cache_bytes == (5000 + free) * 0.5 - (1000 * tokens + 10 * 3)
    assert budget.bytes_per_row == 10 and budget.max_prefill_tokens == 64
    growing = StepPacing(config, Activations()).budget(
        running, MemoryReading(free_bytes=free), 5000, now=0.0, growth_bytes=700
    )
    assert growing.cache_bytes == budget.cache_bytes - 700
    alone = StepPacing(config, Activations()).budget([], MemoryReading(free_bytes=free), 0, 0.0)
    assert alone.cache_bytes == 0  # nothing decodes: a whole step, more than the room
    roomy = StepPacing(config, Activations()).budget(
        [], MemoryReading(free_bytes=10 * free), 0, now=0.0
    )
    assert roomy.cache_bytes == 10 * free * 0.5 - 1000 * 2048


def test_the_growth_share_rises_with_steps_that_preempt_and_falls_slowly_without():
    """Admission keeps room for running sequences to make this share of their remaining
    tokens: each step that preempts for memory raises it, each that does not lowers it a
    little, within 0 and 1; the budget carries it to the scheduler."""
    pacing = StepPacing(EngineConfig(), Activations())

    def share() -> float:
        return pacing.budget([], MemoryReading(free_bytes=10**9), 0, now=0.0).growth_share

    assert share() == GROWTH_SHARE_START
    pacing.planned(2)
    assert share() == pytest.approx(GROWTH_SHARE_START + GROWTH_SHARE_UP)
    for _ in range(10):
        pacing.planned(0)
    assert share() == pytest.approx(GROWTH_SHARE_START + GROWTH_SHARE_UP - 10 * GROWTH_SHARE_DOWN)
    for _ in range(20):
        pacing.planned(1)
    assert share() == 1.0
    for _ in range(round(1 / GROWTH_SHARE_DOWN) + 10):
        pacing.planned(0)
    assert share() == 0.0


def test_while_others_take_memory_the_budget_keeps_back_what_they_take_in_a_step():
    """Free memory fell by ``taken`` over the last second while this process used no more:
    the next budget keeps that much more back (the step it allows takes no longer than a
    second here). Once free memory stops falling, when the fall was this process's own
    growth, or after an idle wait, it keeps nothing back."""
    config = EngineConfig(max_step_tokens=2048, default_prefill_tokens=64, headroom_fraction=0.5)
    pacing = StepPacing(config, Activations())
    running = [seq(i, 10, cached=10, output=1) for i in range(3)]
    free, used, taken = 10_000_000, 50_000_000, 1_000_000

    def limit(now: float, free_bytes: int, used_bytes: int = used) -> float:
        reading = MemoryReading(free_bytes=free_bytes, used_bytes=used_bytes)
        return pacing.budget(running, reading, 5000, now=now).cache_bytes

    steady = limit(0.0, free)
    assert limit(1.0, free - taken) == pytest.approx(steady - taken * 0.5 - taken)
    assert limit(2.0, free - taken) == pytest.approx(steady - taken * 0.5)
    assert limit(3.0, free) == pytest.approx(steady)  # others gave memory back
    assert limit(4.0, free - taken, used + taken) == pytest.approx(steady - taken * 0.5)
    assert limit(5.0, free - 2 * taken, used + taken) == pytest.approx(steady - 2 * taken)
    pacing.idle()
    assert limit(60.0, free - 3 * taken) == pytest.approx(steady - taken * 1.5)


def test_what_others_take_is_carried_over_the_next_step_but_no_further_than_the_factor():
    """A decode step of these sequences alone takes 5 s, so the next step may take 10: what
    others took over the last second is kept back for at most ``prefill_time_factor`` (2)
    such seconds, as a rate read over a short interval is too noisy to carry far."""
    config = EngineConfig(max_step_tokens=2048, default_prefill_tokens=64, headroom_fraction=0.5,
                          prefill_time_factor=2.0)  # fmt: skip
    pacing = StepPacing(config, Activations())
    pacing.pacer.observe_alone(3, 5.0)
    running = [seq(i, 10, cached=10, output=1) for i in range(3)]
    free, taken = 10_000_000, 1_000_000

    def limit(now: float, free_bytes: int) -> float:
        reading = MemoryReading(free_bytes=free_bytes, used_bytes=0)
        return pacing.budget(running, reading, 5000, now=now).cache_bytes

    steady = limit(0.0, free)
    assert limit(1.0, free - taken) == pytest.approx(steady - taken * 0.5 - 2 * taken)


def test_prompts_waiting_beside_few_streams_get_wider_chunks_as_memory_allows():
    """One stream decoding and one prompt joining: chunks within the factor. Fifteen
    prompts waiting beside it: the room for prompt tokens grows fifteenfold (a burst is not
    fed a sliver at a time), where what the wider chunk takes besides is a small share of
    the free memory."""
    config = EngineConfig(max_step_tokens=2048, prefill_time_factor=1.8, headroom_fraction=0.5)
    pacing = StepPacing(config, Activations())
    pacing.pacer.observe_alone(1, 0.050)
    pacing.pacer.observe(elapsed_s=0.060, alone_s=0.050, prefill_tokens=10)  # 1 ms a token
    running = [seq(0, 10, cached=10, output=1)]

    def chunk(waiting: int, free: int | None = None) -> tuple[int, float | None]:
        reading = None if free is None else MemoryReading(free_bytes=free)
        budget = pacing.budget(running, reading, 5000, now=0.0, waiting=waiting)
        return budget.max_prefill_tokens, budget.cache_bytes

    assert chunk(1)[0] == 40  # 0.8 of a 50 ms step, 1 ms a token
    assert chunk(0)[0] == 40
    assert chunk(15)[0] == 600  # 0.8 * 15 of it
    assert chunk(100)[0] == 2048  # within max_step_tokens
    wide, limit = chunk(15, free=20_000_000)  # 560 kB more: within 5% of what is free
    assert wide == 600 and limit == (5000 + 20_000_000) * 0.5 - (1000 * 601 + 10)
    narrow, limit = chunk(15, free=10_000_000)  # past 5% of it
    assert narrow == 40 and limit == (5000 + 10_000_000) * 0.5 - (1000 * 41 + 10)


def test_while_others_take_memory_prompts_stay_in_the_narrower_chunks():
    config = EngineConfig(max_step_tokens=2048, prefill_time_factor=1.8, headroom_fraction=0.5)
    pacing = StepPacing(config, Activations())
    pacing.pacer.observe_alone(1, 0.050)
    pacing.pacer.observe(elapsed_s=0.060, alone_s=0.050, prefill_tokens=10)
    running = [seq(0, 10, cached=10, output=1)]
    free = 1_000_000_000

    def chunk(free: int, now: float) -> int:
        reading = MemoryReading(free_bytes=free, used_bytes=1000)
        return pacing.budget(running, reading, 5000, now=now, waiting=15).max_prefill_tokens

    assert chunk(free, 0.0) == 600
    assert chunk(free - 1_000_000, 0.1) == 600  # another process took 1 MB in 100 ms
    assert chunk(free - 101_000_000, 0.2) == 40  # then 100 MB: 180 MB over a step
    assert chunk(free - 101_000_000, 0.3) == 600  # and stopped
