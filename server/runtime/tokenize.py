"""Where a model's requests are tokenized: inline on the event loop, or on the tokenizer thread.

Handing a request to the tokenizer thread and back costs the event loop a fixed amount (the
hand-off); tokenizing inline costs it the whole encode, which grows with the text. Measured on
2 vCPUs with the bundled model (``python -m bench.tokenize``): the hand-off 9-14 us of the
loop, the encode 40-60 us already for a 64-character sentence, 2 ms at 4,096 characters. So
the limit is measured for each model at start-up, on the host it serves from: requests of up
to the largest size whose encode costs the loop at most two hand-offs are tokenized inline.
A model whose ``prepare`` is nearly free (a no-op) stays inline; a real tokenizer moves off
the loop for all but the shortest texts.

That limit is for a loop with other requests to serve. A request that is the only one in
progress is tokenized inline up to a larger size, whose encode costs the loop at most
``IDLE_INLINE_BUDGET_S``: nothing waits for the loop meanwhile, and the hand-off costs the
request two thread wake-ups, which after an idle spell cost a VM more than the encode
(docs/frontend.md).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

SIZES_CHARS = (16, 64, 256, 1024, 4096)
HANDOFF_FACTOR = 2.0
IDLE_INLINE_BUDGET_S = 0.001
"""A lone request's encode may hold the loop this long (a request arriving meanwhile waits)."""
REPEATS = 7
_WORDS = "the quick brown fox jumps over a lazy dog while the model reads every sentence "


def inline_limit(
    costs_s: Mapping[int, float], handoff_s: float, factor: float = HANDOFF_FACTOR
) -> float:
    """The largest size (characters) whose inline cost is at most ``factor`` hand-offs, with
    every smaller size's too: 0 if even the smallest costs more, infinite if the largest
    does not (then nothing is worth handing off)."""
    limit = 0.0
    for chars in sorted(costs_s):
        if costs_s[chars] > factor * handoff_s:
            return limit
        limit = chars
    return math.inf


def idle_inline_limit(
    costs_s: Mapping[int, float], busy_limit: float, budget_s: float = IDLE_INLINE_BUDGET_S
) -> float:
    """Up to how much text a request alone is tokenized inline: the largest size whose encode
    costs at most ``budget_s`` (with every smaller size's), never above the largest size
    measured unless ``busy_limit`` itself is unbounded, never below ``busy_limit``."""
    if busy_limit == math.inf:
        return math.inf
    limit = inline_limit(costs_s, budget_s, factor=1.0)
    if limit == math.inf:
        limit = max(costs_s)
    return max(limit, busy_limit)


def text_of(chars: int) -> str:
    return (_WORDS * (chars // len(_WORDS) + 1))[:chars]


async def measure_inline_limit(
    prepare: Callable[[list[str]], Any],
    handoff: Callable[[], Awaitable[Any]],
    *,
    sizes: tuple[int, ...] = SIZES_CHARS,
    clock: Callable[[], float] = time.thread_time,
) -> tuple[float, dict[int, float], float]:
    """Time ``prepare`` of one text of each size inline and ``handoff`` (a no-op sent to the
    tokenizer thread and back), both in the calling thread's CPU time, median of a few
    runs; return the limit, the costs by size and the hand-off's cost."""

    def inline_cost(text: str) -> float:
        runs = []
        for _ in range(REPEATS):
            started = clock()
            prepare([text])
            runs.append(clock() - started)
        return statistics.median(runs)

    runs = []
    for _ in range(REPEATS):
        started = clock()
        await handoff()
        runs.append(clock() - started)
    handoff_s = statistics.median(runs)
    costs = {chars: inline_cost(text_of(chars)) for chars in sizes}
    return inline_limit(costs, handoff_s), costs, handoff_s
