import itertools
import random

import pytest

from batching import BatchBudget, cheapest_partition, cheapest_window, plan_batch, split


def budget(items=8, tokens=1000, max_bytes=None, per_token=None):
    predict = (lambda n, length: n * length * per_token) if per_token else None
    return BatchBudget(
        max_items=items, max_tokens=tokens, max_bytes=max_bytes, predict_bytes=predict
    )


@pytest.mark.parametrize(
    ("costs", "limits", "expected"),
    [
        ([], budget(), ()),
        ([10], budget(), (0,)),
        ([500], budget(tokens=100), (0,)),
        # Everything fits.
        ([10, 10, 10], budget(), (0, 1, 2)),
        # Item cap.
        ([5] * 10, budget(items=4), (0, 1, 2, 3)),
        # Token cap counts padding: 3 x 100 > 250, so only two.
        ([100, 100, 100], budget(tokens=250), (0, 1)),
        # Nearest in length to the oldest joins first; the long ones wait.
        ([10, 200, 12, 11, 190], budget(items=3), (0, 2, 3)),
        # The oldest always goes in, even when it alone is over budget.
        ([500, 10, 10], budget(tokens=100), (0,)),
        # A long item that would blow the token budget is skipped; shorter ones still join.
        ([50, 10, 60, 45], budget(tokens=160), (0, 3, 1)),
        # Predicted bytes cap: 10 bytes/token, 1000 bytes -> at most 100 padded tokens.
        ([20, 20, 20, 20, 20, 20], budget(max_bytes=1000, per_token=10), (0, 1, 2, 3, 4)),
        # FIFO among equals: the earliest of equal-length items are taken.
        ([7, 7, 7, 7, 7], budget(items=3), (0, 1, 2)),
    ],
)
def test_plan_batch(costs, limits, expected):
    plan = plan_batch(costs, limits)
    assert set(plan.indices) == set(expected)
    assert list(plan.indices) == sorted(plan.indices)
    if costs:
        assert 0 in plan.indices
        assert plan.padded_len == max(costs[i] for i in plan.indices)


def test_a_lone_item_is_planned_without_the_time_model():
    # An idle server plans every batch from one item: no partition of the queue to weigh.
    def boom(num_items, padded_len):
        raise AssertionError("predicted a batch of one")

    plan = plan_batch([40], budget(), predict_time=boom)
    assert plan.indices == (0,) and plan.padded_len == 40 and plan.real_tokens == 40


def test_plan_prefers_higher_priority_batch_mates():
    costs = [10, 10, 30, 10]
    priorities = [5, 0, 5, 0]
    plan = plan_batch(costs, budget(items=2), priorities)
    assert plan.indices == (0, 2)


def test_plan_reports_padding_efficiency():
    plan = plan_batch([10, 20], budget())
    assert plan.padded_tokens == 40
    assert plan.real_tokens == 30
    assert plan.padding_efficiency == pytest.approx(0.75)


@pytest.mark.parametrize(("n", "halves"), [(2, (1, 1)), (5, (2, 3)), (32, (16, 16)), (7, (3, 4))])
def test_split_halves(n, halves):
    first, second = split(list(range(n)))
    assert (len(first), len(second)) == halves
    assert [*first, *second] == list(range(n))


@pytest.mark.parametrize(("items", "tokens"), [(0, 10), (10, 0), (-1, 5)])
def test_budget_rejects_nonsense(items, tokens):
    with pytest.raises(ValueError, match="at least 1"):
        BatchBudget(max_items=items, max_tokens=tokens)


@pytest.mark.parametrize(
    ("costs", "ratio", "expected"),
    [
        # 15 short items and one long: the long one waits for the next batch.
        ([20] * 15 + [230], 2.0, tuple(range(15))),
        ([20] * 15 + [230], None, tuple(range(16))),
        # Within ratio x shortest + 16 tokens of slack.
        ([10, 36, 37, 20], 2.0, (0, 1, 3)),
        ([100, 40, 217, 180], 2.0, (0, 3)),
        # The anchor always runs, even alone.
        ([230, 10, 12], 2.0, (0,)),
    ],
)
def test_length_ratio_bounds_padding(costs, ratio, expected):
    plan = plan_batch(costs, budget(items=32, tokens=4096), max_length_ratio=ratio)
    assert plan.indices == expected
    if ratio is not None:
        assert plan.padded_len <= ratio * min(costs[i] for i in plan.indices) + 16


# --- planning with a time model: the cheapest partition of the queue ---


# The bundled model on our 2-core host: 13 ms a pass, 0.25 ms a padded token.
def cpu_time(n, length):
    return 0.013 + 0.00025 * n * length + 0.0000004 * n * length * length


def set_partitions(items):
    """Every way to split ``items`` into non-empty batches (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def best_set_partition_total(costs, limits, predict):
    """The least total time over every set partition of the queue whose batches fit."""
    return min(
        sum(predict(len(batch), max(batch)) for batch in partition)
        for partition in set_partitions(list(costs))
        if all(limits.fits(len(batch), max(batch)) for batch in partition)
    )


def runs_total(costs, runs, per_batch, predict):
    """The time ``cheapest_partition`` counts for its runs: one pass for a run, or ``k``
    equal passes for a run of one length that holds more than a batch."""
    total = 0.0
    for shortest, longest in runs:
        n = sum(1 for c in costs if shortest <= c <= longest)
        passes = -(-n // per_batch)
        total += passes * predict(-(-n // passes), longest)
    return total


def best_length_runs_total(costs, per_batch, predict):
    """The least ``runs_total`` over every way to cut the sorted distinct lengths into runs
    (all 2^(d-1) of them), where a run of several lengths holds one batch at most."""
    lengths = sorted(set(costs))
    totals = []
    for cuts in itertools.product((False, True), repeat=len(lengths) - 1):
        runs, first = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                runs.append((lengths[first], lengths[i - 1]))
                first = i
        runs.append((lengths[first], lengths[-1]))
        if all(a == b or sum(1 for c in costs if a <= c <= b) <= per_batch for a, b in runs):
            totals.append(runs_total(costs, runs, per_batch, predict))
    return min(totals)


@pytest.mark.parametrize(
    ("costs", "window"),
    [
        ([10], (10, 10)),
        # Two short ones and two long ones: two passes beat padding the short ones to 35.
        ([10, 10, 12, 30, 35], (10, 12)),
        # The oldest is long: it goes with the other long one, not the short ones.
        ([200, 10, 11, 190, 220], (190, 200)),
        # Similar lengths share one pass: a second pass costs more than the padding.
        ([10, 14, 12, 16], (10, 16)),
    ],
)
def test_cheapest_window(costs, window):
    assert cheapest_window(costs, budget(items=32, tokens=4096), cpu_time) == window


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("items", "tokens"), [(3, 4096), (4, 250), (8, 300)])
def test_cheapest_partition_is_optimal_over_every_set_partition_of_distinct_lengths(
    seed, items, tokens
):
    """With no two items of one length, no way at all to batch the queue (within the
    budget) is cheaper than the runs the planner picks."""
    rng = random.Random(seed)
    costs = rng.sample([*range(8, 27), *range(57, 105)], 8)
    limits = budget(items=items, tokens=tokens)
    runs = cheapest_partition(costs, limits, cpu_time)
    assert all(prev[1] < run[0] for prev, run in itertools.pairwise(runs))
    assert sorted(c for c in costs if any(a <= c <= b for a, b in runs)) == sorted(costs)
    total = sum(cpu_time(sum(1 for c in costs if a <= c <= b), b) for a, b in runs)
    assert all(limits.fits(sum(1 for c in costs if a <= c <= b), b) for a, b in runs)
    assert total == pytest.approx(best_set_partition_total(costs, limits, cpu_time), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_cheapest_partition_is_the_best_split_into_length_runs(seed):
    """With repeated lengths, the planner keeps every length in one run (a window of
    lengths is all a batch can be asked to take): the best of those splits, found by
    trying every one."""
    rng = random.Random(seed)
    lengths = [*rng.sample(range(8, 27), 3), *rng.sample(range(57, 105), 2)]
    costs = [rng.choice(lengths) for _ in range(14)]  # some lengths fill more than a batch
    runs = cheapest_partition(costs, budget(items=4, tokens=4096), cpu_time)
    # Disjoint runs, in order, covering every length.
    assert all(prev[1] < run[0] for prev, run in itertools.pairwise(runs))
    assert all(any(a <= c <= b for a, b in runs) for c in costs)
    total = runs_total(costs, runs, 4, cpu_time)
    assert total == pytest.approx(best_length_runs_total(costs, 4, cpu_time), rel=1e-12)
    window = cheapest_window(costs, budget(items=4, tokens=4096), cpu_time)
    assert window in runs and window[0] <= costs[0] <= window[1]


def test_length_runs_can_miss_a_split_of_one_length():
    """The limit of the claim: splitting one length between two batches can save a pass."""
    costs = [12, 12, 15, 15, 16, 16, 58, 85]
    limits = budget(items=3, tokens=4096)
    runs = cheapest_partition(costs, limits, cpu_time)
    assert runs == [(12, 12), (15, 15), (16, 16), (58, 85)]
    best = best_set_partition_total(costs, limits, cpu_time)  # {12,12,15} {15,16,16} {58,85}
    assert best == pytest.approx(cpu_time(3, 15) + cpu_time(3, 16) + cpu_time(2, 85), rel=1e-12)
    assert runs_total(costs, runs, 3, cpu_time) > best


def test_plan_batch_with_a_time_model_takes_only_the_window():
    costs = [10, 30, 12, 35, 10]
    plan = plan_batch(costs, budget(items=32, tokens=4096), predict_time=cpu_time)
    assert plan.indices == (0, 2, 4)
    assert plan.padded_len == 12
    # Without one, the length-ratio rule pads them all to 35 (2 x 10 + 16 tokens of slack).
    ratio_plan = plan_batch(costs, budget(items=32, tokens=4096), max_length_ratio=2)
    assert ratio_plan.indices == (0, 1, 2, 3, 4)


def test_plan_batch_with_a_time_model_keeps_the_budget_and_the_oldest():
    costs = [20] * 10
    plan = plan_batch(costs, budget(items=4, tokens=4096), predict_time=cpu_time)
    assert plan.indices == (0, 1, 2, 3)
    # The oldest goes in even when it alone is over the token budget.
    assert plan_batch([500, 10], budget(tokens=100), predict_time=cpu_time).indices == (0,)
