"""The in-process limit: the same model, ideal batches, no HTTP and no queue."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models import Model


@dataclass(frozen=True, slots=True)
class LimitResult:
    num_inputs: int
    num_batches: int
    compute_s: float
    inputs_per_s: float
    mean_batch_size: float
    padding_ratio: float
    tokenize_s: float
    """Time to tokenize every input once, reported apart from ``compute_s``."""
    cpu_ms_per_input: float = float("nan")
    """Process CPU time per input of the timed passes."""


def ideal_batches(costs: Sequence[int], max_items: int, max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches sorted by length, each as large as the budget allows
    (``n * longest <= max_tokens`` and ``n <= max_items``); a lone over-budget item runs alone."""
    order = sorted(range(len(costs)), key=lambda i: costs[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so the candidate is the batch's longest.
        if current and (len(current) + 1 > max_items or (len(current) + 1) * costs[i] > max_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def load_bench_model(model: str | None = None) -> Model:
    """The model as a replica loads it (same defaults, same thread count)."""
    from models import ModelSpec, load_model

    return load_model(ModelSpec() if model is None else ModelSpec(model=model))


def measure_limit(
    loaded: Model,
    texts: Sequence[str],
    *,
    max_items: int,
    max_tokens: int,
    repeats: int = 1,
) -> LimitResult:
    """Tokenize ``texts``, warm up, then time ``repeats`` passes over the ideal batches."""
    started = time.perf_counter()
    items = loaded.prepare(list(texts), truncate=True)
    tokenize_s = time.perf_counter() - started
    costs = [item.cost for item in items]
    batches = [[items[i] for i in batch] for batch in ideal_batches(costs, max_items, max_tokens)]
    loaded.forward(loaded.synthetic_items(min(max_items, 8), 32))
    loaded.forward(batches[-1])  # the longest batch, so the allocator has seen the peak
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        for batch in batches:
            loaded.forward(batch)
    compute_s = (time.perf_counter() - started) / repeats
    cpu_s = (time.process_time() - cpu_started) / repeats
    padded = sum(len(b) * max(i.cost for i in b) for b in batches)
    return LimitResult(
        num_inputs=len(items),
        num_batches=len(batches),
        compute_s=compute_s,
        inputs_per_s=len(items) / compute_s,
        mean_batch_size=len(items) / len(batches),
        padding_ratio=padded / sum(costs),
        tokenize_s=tokenize_s,
        cpu_ms_per_input=cpu_s * 1e3 / len(items),
    )


class Batch1Timer:
    """Times ``forward`` of one input alone, called between the one-client requests, so the
    model's batch-1 latency and the server's are measured at the same moments of one run."""

    def __init__(self, loaded: Model, texts: Sequence[str]) -> None:
        self._model = loaded
        self._items = loaded.prepare(list(texts), truncate=True)
        self.latencies_s: list[float] = []

    def __call__(self, index: int) -> None:
        item = self._items[index]
        started = time.perf_counter()
        self._model.forward([item])
        self.latencies_s.append(time.perf_counter() - started)
