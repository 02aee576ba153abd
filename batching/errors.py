"""Errors of the batching layer; the server maps each to one HTTP status."""

from __future__ import annotations


class BatchingError(Exception):
    """Base class for errors a request's future can end with in the batching layer."""


class QueueFull(BatchingError):
    def __init__(
        self, depth: int, capacity: int, retry_after_s: float, *, model: str | None = None
    ) -> None:
        if model is None:
            message = f"queue is full ({depth} of {capacity} items waiting); retry later"
        else:
            message = (
                f"model {model!r} holds its share of the queue ({depth} of {capacity} items "
                "waiting); retry later"
            )
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NeverAdmitted(BatchingError):
    """A request with more items than the queue could ever hold for it: unlike ``QueueFull``,
    retrying cannot help."""

    def __init__(self, num_items: int, capacity: int, *, model: str | None = None) -> None:
        if model is None:
            why = f"the queue holds at most {capacity} items"
        else:
            why = f"model {model!r} may hold at most {capacity} of the queue's items"
        super().__init__(f"{num_items} inputs can never be admitted: {why}; send fewer per request")
        self.num_items = num_items
        self.capacity = capacity


class DeadlineExceeded(BatchingError):
    def __init__(self, waited_s: float) -> None:
        super().__init__(f"deadline passed after {waited_s:.3f}s in the queue, before compute")


class InferenceFailed(BatchingError):
    """The model failed a batch for a reason that is not memory."""


class OutOfMemory(BatchingError):
    """One input could not run even alone."""

    def __init__(self, message: str, needed_bytes: int | None = None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


class ShuttingDown(BatchingError):
    """The batcher stopped before this item ran."""
