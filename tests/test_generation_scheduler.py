"""The step scheduler is a pure function: stepped here by hand with a tiny memory budget."""

import pytest

from generation import Sequence, SequenceSpec, StepBudget, schedule
from generation.scheduler import GROWTH_TOKENS
from generation.sequence import SeqState
from generation.stream import RequestStream
from models import SamplingParams


def seq(seq_id, prompt, *, cached=0, output=0, priority=0, arrival=None, max_tokens=100):
    s = Sequence(
        seq_id=seq_id,
        spec=SequenceSpec(list(range(prompt)), max_tokens, SamplingParams(temperature=0)),
        priority=priority, arrival_s=float(seq_id if arrival is None else arrival),
        deadline_s=1e9, stream=RequestStream(),
    )  # fmt: skip
    s.output_ids = [1] * output
    s.num_cached = cached
    if cached:
        s.state = SeqState.RUNNING
    return s


def budget(**overrides):
    values = {"max_running": 8, "max_step_tokens": 256, "max_prefill_tokens": 256,
              "bytes_per_token": 1, "cache_bytes": None}  # fmt: skip
    return StepBudget(**{**values, **overrides})


def test_every_running_sequence_decodes_and_waiting_prompts_join_in_order():
    running = [seq(1, 10, cached=10, output=1), seq(2, 5, cached=7, output=3)]
    waiting = [seq(4, 30), seq(3, 20)]
    plan = schedule(running, waiting, budget())
    assert [s.seq_id for s in plan.decode] == [1, 2]
    assert [(s.seq_id, n) for s, n in plan.prefill] == [(3, 20), (4, 30)]
    assert plan.num_tokens == 52 and not plan.preempt


@pytest.mark.parametrize(
    ("prefill_tokens", "expected"),
    [(256, [(3, 100), (4, 50)]), (120, [(3, 100), (4, 20)]), (40, [(3, 40)])],
)
def test_prompts_are_prefilled_in_chunks_under_the_step_budget(prefill_tokens, expected):
    running = [seq(1, 10, cached=10, output=1)]
    plan = schedule(running, [seq(3, 100), seq(4, 50)], budget(max_prefill_tokens=prefill_tokens))
    assert [(s.seq_id, n) for s, n in plan.prefill] == expected


def test_a_prompt_part_prefilled_goes_on_before_new_ones_join():
    running = [seq(1, 100, cached=60)]
    plan = schedule(running, [seq(2, 10)], budget(max_prefill_tokens=50))
    assert [(s.seq_id, n) for s, n in plan.prefill] == [(1, 40), (2, 10)]
    assert plan.decode == ()


def test_the_step_token_cap_counts_decode_tokens():
    running = [seq(i, 4, cached=4, output=1) for i in range(1, 6)]
    plan = schedule(running, [seq(9, 100)], budget(max_step_tokens=20))
    assert len(plan.decode) == 5 and [(s.seq_id, n) for s, n in plan.prefill] == [(9, 15)]


def test_the_running_cap_holds_new_sequences_back():
    running = [seq(i, 4, cached=4, output=1) for i in range(1, 3)]
    plan = schedule(running, [seq(5, 4), seq(6, 4)], budget(max_running=3))
    assert [s.seq_id for s, _ in plan.prefill] == [5]


def test_higher_priority_joins_first_and_fifo_holds_among_equals():
    waiting = [seq(1, 10), seq(2, 10, priority=1), seq(3, 10)]
    plan = schedule([], waiting, budget(max_running=2))
    assert [s.seq_id for s, _ in plan.prefill] == [2, 1]


def test_a_prompt_that_does_not_fit_stops_the_ones_behind_it():
    """FIFO among equals: a short prompt behind a long one waits with it."""
    per = GROWTH_TOKENS
    running = [seq(1, 10, cached=10, output=1)]
    held = (10 + 1 + per) + 0
    plan = schedule(running, [seq(2, 500), seq(3, 5)], budget(cache_bytes=held + 100))
    assert plan.prefill == ()


def test_a_joining_sequence_counts_its_row_of_logits():
    running = [seq(1, 10, cached=10, output=1)]
    held = 10 + 1 + GROWTH_TOKENS
    need = 5 + GROWTH_TOKENS  # a 5-token prompt and its growth
    waiting = [seq(2, 5), seq(3, 5)]
    fits = budget(cache_bytes=held + 2 * need + 2 * 40, bytes_per_row=40)
    assert [s.seq_id for s, _ in schedule(running, waiting, fits).prefill] == [2, 3]
    short = budget(cache_bytes=held + 2 * need + 40, bytes_per_row=40)
    assert [s.seq_id for s, _ in schedule(running, waiting, short).prefill] == [2]


def test_with_nothing_running_the_first_waiting_joins_whatever_memory_says():
    plan = schedule([], [seq(2, 500)], budget(cache_bytes=10))
    assert [(s.seq_id, n) for s, n in plan.prefill] == [(2, 256)]


def test_the_newest_of_the_lowest_priority_are_preempted_when_the_step_would_not_fit():
    running = [
        seq(1, 100, cached=100, output=1),
        seq(2, 100, cached=100, output=1, priority=1, arrival=5),
        seq(3, 100, cached=100, output=1, arrival=3),
    ]
    each = 100 + 1 + GROWTH_TOKENS
    plan = schedule(running, [], budget(cache_bytes=2 * each))
    assert [s.seq_id for s in plan.preempt] == [3]
    assert sorted(s.seq_id for s in plan.decode) == [1, 2]
    plan = schedule(running, [], budget(cache_bytes=each))
    assert [s.seq_id for s in plan.preempt] == [3, 1]


def test_a_lone_sequence_is_never_preempted():
    plan = schedule([seq(1, 100, cached=100, output=1)], [], budget(cache_bytes=1))
    assert plan.preempt == () and len(plan.decode) == 1


def test_aging_lets_an_old_low_priority_sequence_join_before_newer_high_ones():
    old = seq(1, 10, priority=0, arrival=0.0)
    new = seq(2, 10, priority=2, arrival=9.0)
    plan = schedule([], [new, old], budget(max_running=1, now=10.0, priority_aging_s=2.0))
    assert [s.seq_id for s, _ in plan.prefill] == [1]


def test_sliding_window_layers_count_a_long_sequence_up_to_their_window_only():
    """6 bytes a token, 5 of them in sliding-window layers held for 64 tokens at most: a
    sequence of 1,000 tokens holds 1,000 + 5 x 64, not 6,000."""
    running = [seq(1, 1000, cached=1000, output=1), seq(2, 1000, cached=1000, output=1)]
    tokens = 1000 + 1 + GROWTH_TOKENS
    each = tokens + 5 * 64
    windowed = {"bytes_per_token": 6, "window_bytes_per_token": 5, "window_tokens": 64}
    plan = schedule(running, [], budget(cache_bytes=2 * each, **windowed))
    assert plan.preempt == () and len(plan.decode) == 2
    plan = schedule(running, [], budget(cache_bytes=2 * each - 1, **windowed))
    assert [s.seq_id for s in plan.preempt] == [2]
    # Without the window, the same budget holds far less than one of them.
    plan = schedule(running, [], budget(cache_bytes=2 * each, bytes_per_token=6))
    assert [s.seq_id for s in plan.preempt] == [2]
    assert 6 * tokens > 2 * each


def test_what_the_store_holds_past_its_positions_counts_against_the_budget():
    """Buffers are held a little ahead of their tokens: that slack is memory the cache holds,
    so it leaves less for tokens, as admission and preemption see it."""
    running = [seq(1, 10, cached=10, output=1), seq(2, 10, cached=10, output=1)]
    each = 10 + 1 + GROWTH_TOKENS
    need = 5 + GROWTH_TOKENS
    fits = budget(cache_bytes=2 * each + need)
    assert [s.seq_id for s, _ in schedule(running, [seq(3, 5)], fits).prefill] == [3]
    slack = budget(cache_bytes=2 * each + need, slack_bytes=1)
    assert schedule(running, [seq(3, 5)], slack).prefill == ()
    # Past the budget with it: the newest running sequence gives way.
    plan = schedule(running, [], budget(cache_bytes=2 * each, slack_bytes=1))
    assert [s.seq_id for s in plan.preempt] == [2]


def test_admission_keeps_room_for_the_growth_share_of_what_each_may_still_make():
    """With a growth share of a half, a running sequence that may make 100 more tokens keeps
    room for 50, and a joining one for half its own; preemption still asks only for
    ``GROWTH_TOKENS``."""
    running = [seq(1, 10, cached=10, output=1, max_tokens=101)]  # 100 still to make
    joining = seq(2, 20, max_tokens=60)
    need = 20 + 30 + 0  # its prompt and half its 60
    held = 10 + 1 + 50
    fits = budget(cache_bytes=held + need, growth_share=0.5)
    assert [s.seq_id for s, _ in schedule(running, [joining], fits).prefill] == [2]
    short = budget(cache_bytes=held + need - 1, growth_share=0.5)
    plan = schedule(running, [joining], short)
    assert plan.prefill == () and plan.preempt == ()
    # A share of 0 keeps GROWTH_TOKENS each, and a sequence near its end no more than it has.
    assert schedule(running, [joining], budget(cache_bytes=(11 + 16) + (20 + 16))).prefill
    ending = seq(3, 10, cached=107, output=98, max_tokens=100)  # 2 still to make
    tight = budget(cache_bytes=(108 + 2) + (20 + 30), growth_share=0.5)
    assert [s.seq_id for s, _ in schedule([ending], [joining], tight).prefill] == [2]
