import pytest

from batching import BatchBudget, plan_batch, split


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
