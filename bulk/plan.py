"""Cut a window of tokenized inputs into batches: the in-process limit's ideal batches.

The window is sorted by length and split by ``cheapest_partition`` (the server's planner)
into runs of lengths, each run cut into equal passes as large as the budget allows. The
plan is a pure function of the window's lengths, the budget and the time model, so a rerun
over the same inputs cuts the same batches and writes the same bytes: a forward pass's
floating-point sums depend on its batch's shape, so the same input in another batch differs
in its last bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from batching import BatchBudget, cheapest_partition, largest_batch
from batching.planner import TimePredictor

# A forward pass costs as much as this many padded tokens before its first one: on a CPU, its
# weights streamed through the caches once (measured for the bundled model on 2 cores: 4.5
# ms a pass, 0.11 ms a padded token: 40 tokens); on a GPU, kernel launches against tokens
# that cost next to nothing one by one.
PASS_COST_TOKENS = {"cpu": 32.0, "cuda": 4096.0}


@dataclass(frozen=True, slots=True)
class TimePrior:
    """``seconds ∝ a + n·L + c·n·L²`` for ``n`` inputs padded to ``L`` tokens, in units of
    one padded token's linear layers: fixed by the architecture, not measured, so every run
    plans alike. ``c`` is attention's share: per layer, a token's projections and
    feed-forward cost ``8·H² + 4·H·I`` multiply-adds x2, its attention ``4·H·L``."""

    a: float
    c: float

    def predict(self, num_items: int, padded_len: int) -> float:
        tokens = num_items * padded_len
        return self.a + tokens + self.c * tokens * padded_len


def time_prior(*, hidden_size: int, intermediate_size: int, device_type: str) -> TimePrior:
    return TimePrior(
        a=PASS_COST_TOKENS.get(device_type, PASS_COST_TOKENS["cuda"]),
        c=1.0 / (2 * hidden_size + intermediate_size),
    )


def plan_window(
    costs: Sequence[int], budget: BatchBudget, predict_time: TimePredictor
) -> list[list[int]]:
    """Indices into ``costs`` grouped into batches, each sorted by length (ties by index),
    the batches shortest first. Each run of ``cheapest_partition`` is cut into the fewest
    equal passes that ``largest_batch`` admits at its longest length (the memory budget
    included: the partition itself sees only the item and token caps); an input over budget
    even alone runs alone."""
    if not costs:
        return []
    per_batch = functools.lru_cache(maxsize=None)(
        lambda length: max(1, largest_batch(budget, length))
    )
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    batches: list[list[int]] = []
    start = 0
    for _, longest in cheapest_partition(costs, budget, predict_time):
        end = start
        while end < len(order) and costs[order[end]] <= longest:
            end += 1
        run = order[start:end]
        size = math.ceil(len(run) / math.ceil(len(run) / per_batch(longest)))
        batches += [run[k : k + size] for k in range(0, len(run), size)]
        start = end
    return batches
