"""What one request went through, for the access log, the timing headers and the trace spans:
sizes and times, never the text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from batching import Pending


class BatchTiming(NamedTuple):
    """One forward pass that answered inputs of a request, as the request saw it."""

    start_after_s: float
    """From the request's admission (its items queued) until the pass started."""
    duration_s: float
    number: int
    """The engine's count of passes: the same pass in every request that had items in it."""
    size: int
    tokens: int
    padded_tokens: int


@dataclass(slots=True)
class RequestTrace:
    inputs: int = 0
    tokens: int = 0
    queue_wait_s: float | None = None
    """From admission until the last of its inputs started running."""
    cache_hits: int = 0
    """Inputs answered from the output cache."""
    batch_sizes: list[int] = field(default_factory=list)
    """Items in each forward pass that answered one of its inputs, in order."""
    generated_tokens: int | None = None
    """A generation request's tokens generated, over all its choices (``tokens``: its
    prompts')."""
    tokenize_s: float | None = None
    """Tokenizing its inputs, the wait for the tokenizer thread included."""
    batches: list[BatchTiming] = field(default_factory=list)
    """The forward passes that answered its inputs, in order."""
    called_s: float | None = None
    """``time.perf_counter()`` as the route handed the inputs over (tokenizing starts)."""
    answered_s: float | None = None
    """``time.perf_counter()`` as every output was back in the route (None: it failed)."""

    def record(self, pendings: Sequence[Pending], admitted_s: float | None = None) -> None:
        """What its queued items went through; ``admitted_s``: when they were queued (the
        clock of their ``arrival_s``), which the batches' times count from."""
        waits = [p.started_s - p.arrival_s for p in pendings if p.started_s is not None]
        self.queue_wait_s = max(waits) if waits else None
        batches = sorted({p.batch for p in pendings if p.batch is not None})
        self.batch_sizes = [size for _, size in batches]
        if admitted_s is None:
            return
        runs = {}
        for pending in pendings:
            run = pending.run
            if run is not None and run.finished_s is not None:
                runs[run.number] = run
        self.batches = [
            BatchTiming(
                run.started_s - admitted_s,
                run.finished_s - run.started_s,
                number,
                run.size,
                run.tokens,
                run.padded_tokens,
            )
            for number, run in sorted(runs.items())
        ]

    @property
    def inference_s(self) -> float:
        """Time in the forward passes that answered it (0: all from the cache)."""
        total = 0.0
        for batch in self.batches:
            total += batch.duration_s
        return total

    def timing_headers(self) -> list[tuple[bytes, bytes]]:
        """``x-batchfit-{tokenize,queue,inference}-time``: milliseconds, as TEI's
        ``x-*-time``, with microseconds (a small model's pass often takes under one)."""
        return [
            (b"x-batchfit-tokenize-time", b"%.3f" % ((self.tokenize_s or 0.0) * 1e3)),
            (b"x-batchfit-queue-time", b"%.3f" % ((self.queue_wait_s or 0.0) * 1e3)),
            (b"x-batchfit-inference-time", b"%.3f" % (self.inference_s * 1e3)),
        ]
