"""The warm-up planner, stepped by hand: which calibration batches run, within the memory
budget read before each and the time bound."""

import pytest

from batching import BatchBudget, CalibrationStep, WarmUpPlanner, calibration_lengths
from batching.warmup import MIN_BOUND_S, seconds_at_most

MiB = 2**20


@pytest.mark.parametrize(
    ("max_length", "lengths"),
    [
        (32768, [32, 128, 512, 2048, 8192, 32768]),
        (8192, [32, 128, 512, 2048, 8192]),
        (256, [32, 128, 256]),
        (100, [32, 100]),
        (16, [16]),
    ],
)
def test_the_ladder_of_lengths(max_length, lengths):
    assert calibration_lengths(max_length) == lengths


def budget(max_bytes=None, *, per_token=1024.0, max_items=128, max_tokens=4096):
    return BatchBudget(
        max_items=max_items, max_tokens=max_tokens, max_bytes=max_bytes,
        predict_bytes=lambda n, length: n * length * per_token,
    )  # fmt: skip


def run(planner, budgets, seconds=lambda step: 0.001 * step.num_items * step.length, oom=()):
    """Step the planner to the end: each step's budget from ``budgets(step_index)``, its
    time from ``seconds``; shapes in ``oom`` run out of memory. Returns the steps."""
    steps, elapsed = [], 0.0
    while (step := planner.next_step(budgets(len(steps)), elapsed_s=elapsed)) is not None:
        steps.append(step)
        assert len(steps) < 100, f"warm-up never ends: {shapes(steps[-5:])}"
        if (step.num_items, step.length) in oom:
            planner.ran_out_of_memory(step)
            continue
        took = seconds(step)
        elapsed += took
        planner.ran(step, took)
    return steps


def shapes(steps):
    return [(s.num_items, s.length, s.kind) for s in steps]


def test_a_long_context_model_climbs_to_its_maximum_when_nothing_stops_it():
    """The token cap sets the batches; past it one input runs alone, after one alone at the
    last batched length, so a lone input's line is measured before it is extrapolated."""
    planner = WarmUpPlanner(max_length=32768, max_items=128, timeout_s=10**6)
    steps = run(planner, lambda _: budget())
    assert shapes(steps) == [
        (32, 32, "scout"), (128, 32, "batch"), (32, 128, "batch"), (8, 512, "batch"),
        (2, 2048, "batch"), (1, 2048, "alone"), (1, 8192, "batch"), (1, 32768, "batch"),
    ]  # fmt: skip
    report = planner.report(1.0)
    assert report.proven_length == 32768 and report.stopped is None
    assert report.describe() == "longest proven input 32768 tokens of 32768"


def test_the_time_bound_stops_the_ladder_and_the_model_is_still_ready():
    """Each step is priced from the one before (quadratic at worst): 1 x 32768 may take 16
    times 1 x 8192, past the bound, so warm-up ends at 8192."""
    planner = WarmUpPlanner(max_length=32768, max_items=128, timeout_s=30)
    steps = run(
        planner, lambda _: budget(), seconds=lambda step: 2.0 if step.length >= 8192 else 0.5
    )
    assert steps[-1] == CalibrationStep(1, 8192)
    report = planner.report(5.0)
    assert report.proven_length == 8192
    assert report.describe() == "longest proven input 8192 tokens of 32768"
    assert "may take up to 32.0s, past the 30s warm-up bound (5.0s spent)" in report.stopped


def test_the_default_bound_is_twenty_first_batches_and_at_least_ten_seconds():
    planner = WarmUpPlanner(max_length=512, max_items=128)
    planner.ran(CalibrationStep(32, 32, "scout"), 0.1)
    assert planner.bound_s is None  # a scout is not a full batch
    planner.ran(CalibrationStep(128, 32), 2.0)
    assert planner.bound_s == 40.0
    quick = WarmUpPlanner(max_length=512, max_items=128)
    quick.ran(CalibrationStep(128, 32), 0.01)
    assert quick.bound_s == MIN_BOUND_S


def test_the_budget_read_before_each_step_sets_its_size_and_stops_what_cannot_fit():
    """1 KiB per token; 6 MiB: 3 x 2048 fits, 1 x 8192 (8 MiB) does not. The stop still
    runs one input alone at the longest proven length: a lone input's line is measured."""
    planner = WarmUpPlanner(max_length=32768, max_items=128, timeout_s=10**6)
    steps = run(planner, lambda _: budget(6 * MiB, max_tokens=10**6))
    assert shapes(steps)[:3] == [(32, 32, "scout"), (128, 32, "batch"), (48, 128, "batch")]
    assert shapes(steps)[-2:] == [(3, 2048, "batch"), (1, 2048, "alone")]
    assert planner.proven_length == 2048
    assert (
        planner.stopped
        == "one input of 8192 tokens is predicted to need 8 MiB, more than the 6 MiB budget"
    )


@pytest.mark.parametrize(
    ("bound_s", "expected"),
    [
        # 128 x 128 may take 16 x 4.1s, past 30s; one alone at 32 (at most 4.1s) still fits.
        (30, [(32, 32, "scout"), (128, 32, "batch"), (1, 32, "alone")]),
        # 5.1s spent: not even that one fits within 8s.
        (8, [(32, 32, "scout"), (128, 32, "batch")]),
    ],
)
def test_a_stop_on_the_time_bound_runs_one_input_alone_only_within_the_bound(bound_s, expected):
    planner = WarmUpPlanner(max_length=2048, max_items=128, timeout_s=bound_s)
    steps = run(planner, lambda _: budget(max_tokens=10**6))
    assert shapes(steps) == expected
    assert planner.proven_length == 32
    assert "past the" in planner.stopped and "128 x 128 tokens" in planner.stopped


def test_one_input_alone_that_runs_out_of_memory_after_a_stop_ends_warm_up():
    planner = WarmUpPlanner(max_length=32768, max_items=128, timeout_s=10**6)
    steps = run(planner, lambda _: budget(6 * MiB, max_tokens=10**6), oom={(1, 2048)})
    assert shapes(steps)[-2:] == [(3, 2048, "batch"), (1, 2048, "alone")]
    assert planner.proven_length == 2048
    assert planner.stopped == "one input of 2048 tokens ran out of memory"


def test_where_the_limit_kills_a_quarter_batch_scouts_each_length_memory_sets():
    planner = WarmUpPlanner(max_length=128, max_items=1024, timeout_s=10**6)
    steps, elapsed = [], 0.0
    while step := planner.next_step(
        budget(2 * MiB, max_tokens=10**6), elapsed_s=elapsed, scout=True
    ):
        steps.append(step)
        planner.ran(step, 0.01)
    assert shapes(steps) == [
        (16, 32, "scout"), (64, 32, "batch"), (4, 128, "scout"), (16, 128, "batch"),
        (1, 128, "alone"),
    ]  # fmt: skip


def test_where_the_token_cap_sets_the_batch_no_scout_runs_past_the_first_length():
    """Memory far from binding (the token cap sets every batch): a scout would only cost
    time, even where going past the limit kills."""
    planner = WarmUpPlanner(max_length=256, max_items=128, timeout_s=10**6)
    steps, elapsed = [], 0.0
    while step := planner.next_step(budget(2**40), elapsed_s=elapsed, scout=True):
        steps.append(step)
        planner.ran(step, 0.01)
    assert shapes(steps) == [
        (32, 32, "scout"), (128, 32, "batch"), (32, 128, "batch"), (16, 256, "batch"),
        (1, 256, "alone"),
    ]  # fmt: skip


def test_an_oom_halves_the_batch_and_a_lone_one_ends_warm_up():
    planner = WarmUpPlanner(max_length=8192, max_items=128, timeout_s=10**6)
    steps = run(planner, lambda _: budget(), oom={(8, 512), (1, 8192)})
    assert shapes(steps)[3:] == [
        (8, 512, "batch"), (4, 512, "batch"), (2, 2048, "batch"), (1, 2048, "alone"),
        (1, 8192, "batch"),
    ]  # fmt: skip
    assert planner.proven_length == 2048
    assert planner.stopped == "one input of 8192 tokens ran out of memory"


def test_the_first_length_runs_even_when_the_prior_says_nothing_fits():
    planner = WarmUpPlanner(max_length=512, max_items=128, timeout_s=10**6)
    assert planner.next_step(budget(1.0), elapsed_s=0) == CalibrationStep(1, 32)


@pytest.mark.parametrize(
    ("ran", "step", "at_most"),
    [
        ((128, 32, 1.0), CalibrationStep(32, 128), 4.0),  # same tokens, 4x the length
        ((2, 2048, 1.0), CalibrationStep(1, 8192), 8.0),
        ((1, 8192, 2.0), CalibrationStep(1, 32768), 32.0),
        ((128, 32, 1.0), CalibrationStep(32, 32), 1.0),  # smaller: never less than it took
    ],
)
def test_a_steps_time_is_bounded_by_the_quadratic_term(ran, step, at_most):
    assert seconds_at_most(ran, step) == pytest.approx(at_most)
