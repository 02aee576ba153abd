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


def brute_force_total(costs, per_batch, predict):
    """The least total time over every split of the distinct lengths into runs (a run of
    several lengths holds one batch at most; one length may take several passes)."""
    lengths = sorted(set(costs))

    def best(start):
        if start == len(lengths):
            return 0.0
        options = []
        for end in range(start + 1, len(lengths) + 1):
            n = sum(1 for c in costs if lengths[start] <= c <= lengths[end - 1])
            if end - start > 1 and n > per_batch:
                break
            passes = -(-n // per_batch)
            options.append(passes * predict(-(-n // passes), lengths[end - 1]) + best(end))
        return min(options)

    return best(0)


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
def test_cheapest_partition_is_optimal(seed):
    rng = random.Random(seed)
    costs = [rng.choice([rng.randint(8, 26)] * 3 + [rng.randint(57, 104)]) for _ in range(10)]
    runs = cheapest_partition(costs, budget(items=4, tokens=4096), cpu_time)
    # Disjoint runs, in order, covering every length.
    assert all(prev[1] < run[0] for prev, run in itertools.pairwise(runs))
    assert all(any(a <= c <= b for a, b in runs) for c in costs)
    total = 0.0
    for shortest, longest in runs:
        n = sum(1 for c in costs if shortest <= c <= longest)
        passes = -(-n // 4)
        total += passes * cpu_time(-(-n // passes), longest)
    assert total == pytest.approx(brute_force_total(costs, 4, cpu_time))
    window = cheapest_window(costs, budget(items=4, tokens=4096), cpu_time)
    assert window in runs and window[0] <= costs[0] <= window[1]


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
