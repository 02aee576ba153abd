"""A window cut into batches: every input once, sorted by length, within the budget, the same
cut every time."""

import random

import pytest

from batching import BatchBudget, cheapest_partition
from bulk.plan import PASS_COST_TOKENS, TimePrior, plan_window, time_prior

PRIOR = time_prior(hidden_size=384, intermediate_size=1536, device_type="cpu")


def kib_per_token(num_items: int, padded_len: int) -> float:
    return num_items * padded_len * 1024


def window(seed: int, size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(3, 20), rng.randint(20, 80), rng.randint(200, 256)])
            for _ in range(size)]  # fmt: skip


@pytest.mark.parametrize(
    "budget",
    [
        BatchBudget(max_items=128, max_tokens=4096),
        BatchBudget(max_items=8, max_tokens=10**6),
        # Memory decides: 1 KiB a token, 256 KiB for the batch.
        BatchBudget(10**4, 10**6, max_bytes=256 * 1024, predict_bytes=kib_per_token),
    ],
)  # fmt: skip
def test_every_input_once_sorted_and_within_budget(budget):
    costs = window(1, 3000)
    batches = plan_window(costs, budget, PRIOR.predict)
    assert sorted(i for batch in batches for i in batch) == list(range(len(costs)))
    flat = [costs[i] for batch in batches for i in batch]
    assert flat == sorted(costs), "batches run shortest first, each sorted by length"
    for batch in batches:
        assert budget.fits(len(batch), max(costs[i] for i in batch)), batch
        assert batch == sorted(batch, key=lambda i: (costs[i], i))


def test_the_cut_is_the_same_for_the_same_window():
    costs = window(2, 2000)
    budget = BatchBudget(max_items=128, max_tokens=4096)
    assert plan_window(costs, budget, PRIOR.predict) == plan_window(
        list(costs), budget, PRIOR.predict
    )


def test_batches_follow_the_cheapest_partition_with_equal_passes():
    costs = window(3, 1500)
    budget = BatchBudget(max_items=128, max_tokens=4096)
    batches = plan_window(costs, budget, PRIOR.predict)
    runs = cheapest_partition(costs, budget, PRIOR.predict)
    spans = [(min(costs[i] for i in b), max(costs[i] for i in b)) for b in batches]
    for shortest, longest in runs:
        inside = [
            b
            for b, (lo, hi) in zip(batches, spans, strict=True)
            if shortest <= lo and hi <= longest
        ]
        sizes = [len(b) for b in inside]
        assert sum(sizes) == sum(shortest <= c <= longest for c in costs)
        assert max(sizes) - min(sizes) <= 1, sizes  # equal passes, not one full and a tail


def test_an_input_over_budget_even_alone_runs_alone():
    costs = [300, 5, 5]
    batches = plan_window(costs, BatchBudget(max_items=8, max_tokens=100), PRIOR.predict)
    assert batches == [[1, 2], [0]]


def test_the_time_prior_from_the_architecture():
    prior = time_prior(hidden_size=384, intermediate_size=1536, device_type="cpu")
    assert prior == TimePrior(a=PASS_COST_TOKENS["cpu"], c=1 / 2304)
    # A pass of 10 x 100 tokens: the pass, 1000 tokens, attention's 1000 x 100 / 2304.
    assert prior.predict(10, 100) == pytest.approx(32 + 1000 + 1000 * 100 / 2304)
    assert time_prior(hidden_size=8, intermediate_size=8, device_type="cuda:1").a == 4096
