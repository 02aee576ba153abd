"""Choose the next batch from what is waiting: a pure function of costs and a budget."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PeakPredictor = Callable[[int, int], float]
"""Predicted peak bytes of a batch of ``n`` items padded to length ``L``."""
TimePredictor = Callable[[int, int], float]
"""Predicted seconds of a forward pass over ``n`` items padded to length ``L``."""


@dataclass(frozen=True, slots=True)
class BatchBudget:
    """Limits for one batch. ``max_bytes`` applies only with a ``predict_bytes`` model."""

    max_items: int
    max_tokens: int
    max_bytes: float | None = None
    predict_bytes: PeakPredictor | None = None
    max_alone_bytes: float | None = None
    """Where going past the memory limit kills: the room one input alone must fit in, or
    it is refused before it runs (``refused_alone``). None: an input too large for the
    budget runs alone anyway and the OOM path answers it."""
    shared_bytes: float | None = None
    """The memory free for every pass running at once, less headroom (``max_bytes`` may be
    less: a ceiling on one batch), which passes side by side share. None: unknown."""

    def __post_init__(self) -> None:
        if self.max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {self.max_items}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    def fits(self, num_items: int, padded_len: int) -> bool:
        if num_items > self.max_items or num_items * padded_len > self.max_tokens:
            return False
        if self.max_bytes is None or self.predict_bytes is None:
            return True
        return self.predict_bytes(num_items, padded_len) <= self.max_bytes


@dataclass(frozen=True, slots=True)
class BatchPlan:
    indices: tuple[int, ...]
    padded_len: int
    real_tokens: int

    @property
    def num_items(self) -> int:
        return len(self.indices)

    @property
    def padded_tokens(self) -> int:
        return self.num_items * self.padded_len

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0


# Short items may join longer ones by this many tokens beyond the length ratio: one more
# forward pass costs about as much as a few padded tokens per item.
LENGTH_SLACK_TOKENS = 16


def plan_batch(
    costs: Sequence[int],
    budget: BatchBudget,
    priorities: Sequence[int] | None = None,
    *,
    max_length_ratio: float | None = None,
    predict_time: TimePredictor | None = None,
) -> BatchPlan:
    """Pick the next batch from ``costs``, given in queue order (priority, then arrival).

    The first item always goes in, even over budget, so nothing starves (the OOM path deals
    with an item too large to run). Then the items nearest in length to it join, higher
    priority first and FIFO among equals, while ``n * longest`` and the predicted peak stay
    within the budget. Items that do not fit are skipped, not reordered. Padding a short
    item to a long one's length can cost more compute than running it in another pass, so
    only some lengths may join: with ``predict_time``, those of the first item's batch in the
    cheapest partition of the queue (``cheapest_window``); without it, with
    ``max_length_ratio``, those that keep the batch's longest item within that ratio of its
    shortest (plus ``LENGTH_SLACK_TOKENS``).
    """
    if not costs:
        return BatchPlan(indices=(), padded_len=0, real_tokens=0)
    if len(costs) == 1:  # nothing to choose (an idle server's every batch): no partition
        return BatchPlan(indices=(0,), padded_len=costs[0], real_tokens=costs[0])
    anchor = costs[0]
    shortest_allowed, longest_allowed = 0, math.inf
    if predict_time is not None:
        shortest_allowed, longest_allowed = cheapest_window(costs, budget, predict_time)
    if priorities is None:
        order = sorted(range(1, len(costs)), key=lambda i: (abs(costs[i] - anchor), i))
    else:
        order = sorted(
            range(1, len(costs)), key=lambda i: (-priorities[i], abs(costs[i] - anchor), i)
        )
    chosen = [0]
    padded_len = shortest = anchor
    for i in order:
        if len(chosen) >= budget.max_items:
            break
        if not shortest_allowed <= costs[i] <= longest_allowed:
            continue
        candidate_len = max(padded_len, costs[i])
        if (
            predict_time is None
            and max_length_ratio is not None
            and candidate_len > (max_length_ratio * min(shortest, costs[i]) + LENGTH_SLACK_TOKENS)
        ):
            continue
        if budget.fits(len(chosen) + 1, candidate_len):
            chosen.append(i)
            padded_len = candidate_len
            shortest = min(shortest, costs[i])
    chosen.sort()
    return BatchPlan(
        indices=tuple(chosen),
        padded_len=padded_len,
        real_tokens=sum(costs[i] for i in chosen),
    )


def cheapest_partition(
    costs: Sequence[int], budget: BatchBudget, predict_time: TimePredictor
) -> list[tuple[int, int]]:
    """Everything waiting split, in length order, into the runs of lengths with the least
    predicted time in all; each run as ``(shortest, longest)``, shortest run first.

    A dynamic programme over the distinct lengths (all items of one length share a run): a
    run costs one pass padded to its longest, or ``k`` passes if the budget takes at most
    ``1/k`` of its items at once. Runs over several lengths are capped at one full batch
    (more would be better split by length), so it costs O(lengths x items per batch).
    With every length distinct this is the cheapest of all ways to batch the queue; with
    repeated lengths it is the cheapest that keeps each length in one run (a window of
    lengths cannot send some items of a length to one batch and the rest to another, which
    can save a pass).
    """
    counts: dict[int, int] = {}
    for cost in costs:
        counts[cost] = counts.get(cost, 0) + 1
    lengths = sorted(counts)
    best = [0.0] * (len(lengths) + 1)
    start = [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        longest = lengths[end - 1]
        per_batch = max(1, min(budget.max_items, budget.max_tokens // longest))
        best[end], start[end] = math.inf, end - 1
        num_items = 0
        for first in range(end - 1, -1, -1):
            num_items += counts[lengths[first]]
            if first < end - 1 and num_items > per_batch:
                break
            passes = -(-num_items // per_batch)
            total = best[first] + passes * predict_time(-(-num_items // passes), longest)
            if total < best[end]:
                best[end], start[end] = total, first
    runs = []
    end = len(lengths)
    while end > 0:
        runs.append((lengths[start[end]], lengths[end - 1]))
        end = start[end]
    return runs[::-1]


def cheapest_window(
    costs: Sequence[int], budget: BatchBudget, predict_time: TimePredictor
) -> tuple[int, int]:
    """The lengths ``(shortest, longest)`` that the batch of ``costs[0]`` should span: its
    run in ``cheapest_partition`` of everything waiting."""
    return next(
        run for run in cheapest_partition(costs, budget, predict_time)
        if run[0] <= costs[0] <= run[1]
    )  # fmt: skip


def refused_alone(cost: int, budget: BatchBudget) -> float | None:
    """The predicted peak of one input of ``cost`` tokens run alone, where it exceeds the
    budget's ``max_alone_bytes`` (the planner would put it in a batch of its own, and it
    must not run); None where it may run."""
    if budget.max_alone_bytes is None or budget.predict_bytes is None:
        return None
    predicted = budget.predict_bytes(1, cost)
    return predicted if predicted > budget.max_alone_bytes else None


def split(items: Sequence[object]) -> tuple[Sequence[object], Sequence[object]]:
    """Halve a batch for OOM bisection: the first half gets the smaller share."""
    middle = len(items) // 2
    return items[:middle], items[middle:]


def largest_batch(budget: BatchBudget, padded_len: int) -> int:
    """Most items of length ``padded_len`` the budget admits (0 if not even one)."""
    low, high = 0, budget.max_items
    while low < high:
        middle = (low + high + 1) // 2
        if budget.fits(middle, padded_len):
            low = middle
        else:
            high = middle - 1
    return low
