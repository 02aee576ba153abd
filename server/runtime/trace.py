"""What one request went through, for the access log: sizes and times, never the text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from batching import Pending


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

    def record(self, pendings: Sequence[Pending]) -> None:
        waits = [p.started_s - p.arrival_s for p in pendings if p.started_s is not None]
        self.queue_wait_s = max(waits) if waits else None
        batches = sorted({p.batch for p in pendings if p.batch is not None})
        self.batch_sizes = [size for _, size in batches]
