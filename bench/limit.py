"""The in-process limit: the same model, ideal batches, no HTTP and no queue.

Each batch runs as any user's script would run it, with plain transformers calls (``plain.py``:
the tokenizer, the model, mean pooling), never the server's own forward pass, so a slower
product forward shows in the ratios instead of in both of their terms. Two plans of ideal
batches over every input of a load level, known in advance, and the faster one is the limit:
the largest batches the budget allows (sorted by length), and the cheapest split by a time
model fitted to the first plan's batches (``cheapest_partition``, the planner's own rule with
the whole workload in view). On a CPU the second wins: big batches are no cheaper per token,
so padding is what counts.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from batching import BatchBudget, cheapest_partition, fit_time_model
from batching.planner import TimePredictor
from batching.timing import predict_seconds

from .plain import PlainEncoder

LARGEST, CHEAPEST = "largest batches", "cheapest split"


@dataclass(frozen=True, slots=True)
class LimitResult:
    num_inputs: int
    num_batches: int
    compute_s: float
    inputs_per_s: float
    mean_batch_size: float
    padding_ratio: float
    tokenize_s: float
    """Time to count every input's tokens once, for the plans (``compute_s`` tokenizes each
    batch again, as a script does)."""
    cpu_ms_per_input: float = float("nan")
    """Process CPU time per input of the timed passes."""
    plan: str = LARGEST
    """Which plan of ideal batches was faster (the figures above are its own)."""
    other_plan_inputs_per_s: float = float("nan")
    """Throughput of the slower plan (NaN if it could not be made)."""
    num_threads: int = 0
    """torch intra-op threads of the timed passes."""


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


def cheapest_batches(
    costs: Sequence[int], max_items: int, max_tokens: int, predict_time: TimePredictor
) -> list[list[int]]:
    """Indices grouped by ``cheapest_partition``: each run sorted by length, cut into equal
    passes where the budget cannot take it at once."""
    budget = BatchBudget(max_items=max_items, max_tokens=max_tokens)
    order = sorted(range(len(costs)), key=lambda i: costs[i])
    batches: list[list[int]] = []
    for shortest, longest in cheapest_partition(costs, budget, predict_time):
        run = [i for i in order if shortest <= costs[i] <= longest]
        per_batch = max(1, min(max_items, max_tokens // longest))
        size = math.ceil(len(run) / math.ceil(len(run) / per_batch))
        batches += [run[k : k + size] for k in range(0, len(run), size)]
    return batches


def measure_limit(
    encoder: PlainEncoder,
    texts: Sequence[str],
    *,
    max_items: int,
    max_tokens: int,
    repeats: int = 1,
) -> LimitResult:
    """Count every input's tokens, warm up, then time ``repeats`` passes over each plan's
    batches (each batch tokenized, run and pooled as a script does)."""
    import torch

    texts = list(texts)
    started = time.perf_counter()
    costs = encoder.token_counts(texts)
    tokenize_s = time.perf_counter() - started
    largest = ideal_batches(costs, max_items, max_tokens)
    encoder.encode(texts[: min(max_items, 8)])
    encoder.encode([texts[i] for i in largest[-1]])  # the allocator has seen the peak
    samples: list[tuple[int, int, float]] = []
    results = [_time_plan(encoder, texts, costs, largest, repeats, samples)]
    for length in (min(costs), max(costs)):
        # Lone inputs too, so the fit can tell the per-pass cost from the per-token one.
        lone = [texts[costs.index(length)]]
        started = time.perf_counter()
        encoder.encode(lone)
        samples.append((1, length, time.perf_counter() - started))
    coefficients = fit_time_model(samples)
    if coefficients is not None:
        predict = functools.partial(predict_seconds, coefficients)
        plan = cheapest_batches(costs, max_items, max_tokens, predict)
        results.append(_time_plan(encoder, texts, costs, plan, repeats, None))
    best = min(results, key=lambda r: r[0])
    compute_s, cpu_s, batches = best
    padded = sum(len(b) * max(costs[i] for i in b) for b in batches)
    other = [r for r in results if r is not best]
    return LimitResult(
        num_inputs=len(texts),
        num_batches=len(batches),
        compute_s=compute_s,
        inputs_per_s=len(texts) / compute_s,
        mean_batch_size=len(texts) / len(batches),
        padding_ratio=padded / sum(costs),
        tokenize_s=tokenize_s,
        cpu_ms_per_input=cpu_s * 1e3 / len(texts),
        plan=LARGEST if best is results[0] else CHEAPEST,
        other_plan_inputs_per_s=len(texts) / other[0][0] if other else math.nan,
        num_threads=torch.get_num_threads(),
    )


def _time_plan(
    encoder: PlainEncoder,
    texts: Sequence[str],
    costs: Sequence[int],
    batches: list[list[int]],
    repeats: int,
    samples: list[tuple[int, int, float]] | None,
) -> tuple[float, float, list[list[int]]]:
    """Wall and CPU seconds of one pass over ``batches`` (mean of ``repeats``); each batch's
    shape and time go to ``samples`` when given."""
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        for batch in batches:
            chunk = [texts[i] for i in batch]
            batch_started = time.perf_counter()
            encoder.encode(chunk)
            if samples is not None:
                elapsed = time.perf_counter() - batch_started
                samples.append((len(chunk), max(costs[i] for i in batch), elapsed))
    wall = (time.perf_counter() - started) / repeats
    return wall, (time.process_time() - cpu_started) / repeats, batches


class Batch1Timer:
    """Times one input alone through the plain calls, called between the one-client requests,
    so the model's batch-1 latency and the server's are measured at the same moments of one
    run."""

    def __init__(self, encoder: PlainEncoder, texts: Sequence[str]) -> None:
        self._encoder = encoder
        self._texts = list(texts)
        self.latencies_s: list[float] = []

    def __call__(self, index: int) -> None:
        text = self._texts[index]
        started = time.perf_counter()
        self._encoder.encode([text])
        self.latencies_s.append(time.perf_counter() - started)
