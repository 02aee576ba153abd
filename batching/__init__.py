"""Queue, batch planning, the batcher loop, memory probes and batching metrics.

Never imports a concrete model: the batcher drives anything with a ``forward`` callable.
"""

from .batcher import Batcher, BatcherConfig, ModelThread
from .clock import Clock, MonotonicClock
from .errors import (
    BatchingError,
    DeadlineExceeded,
    InferenceFailed,
    OutOfMemory,
    QueueFull,
    ShuttingDown,
)
from .metrics import BatchingMetrics, powers_of_two
from .planner import BatchBudget, BatchPlan, plan_batch, split
from .queue import Pending, RequestQueue
from .sizer import BatchOutcome, FixedSizer, Sizer

__all__ = [
    "BatchBudget",
    "BatchOutcome",
    "BatchPlan",
    "Batcher",
    "BatcherConfig",
    "BatchingError",
    "BatchingMetrics",
    "Clock",
    "DeadlineExceeded",
    "FixedSizer",
    "InferenceFailed",
    "ModelThread",
    "MonotonicClock",
    "OutOfMemory",
    "Pending",
    "QueueFull",
    "RequestQueue",
    "ShuttingDown",
    "Sizer",
    "plan_batch",
    "powers_of_two",
    "split",
]
