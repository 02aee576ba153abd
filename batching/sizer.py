"""Sizers decide the budget of the next batch; the batcher reports back what each batch did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .planner import BatchBudget


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What one forward pass did, as the batcher measured it."""

    num_items: int
    padded_len: int
    elapsed_s: float
    peak_bytes: int | None = None


class Sizer(Protocol):
    def budget(self) -> BatchBudget:
        """The budget for the next batch, from what is known now."""
        ...

    def observe(self, outcome: BatchOutcome) -> None:
        """A batch ran cleanly."""
        ...

    def on_oom(self, num_items: int, padded_len: int) -> None:
        """A batch of this shape ran out of memory."""
        ...


class FixedSizer:
    """A constant budget: at most ``max_items`` items and ``max_tokens`` padded tokens."""

    def __init__(self, max_items: int, max_tokens: int) -> None:
        self._budget = BatchBudget(max_items=max_items, max_tokens=max_tokens)

    def budget(self) -> BatchBudget:
        return self._budget

    def observe(self, outcome: BatchOutcome) -> None:
        pass

    def on_oom(self, num_items: int, padded_len: int) -> None:
        pass
