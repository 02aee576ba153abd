"""Queue, batch planning, the batcher loop, memory probes and batching metrics.

Never imports a concrete model: the batcher drives anything with a ``forward`` callable.
"""

from .affinity import at_home
from .allocator import release_host_memory, tune_host_allocator
from .batcher import Batcher, BatcherConfig
from .clock import Clock, MonotonicClock
from .composite import CompositeProbe, probes_for_device
from .errors import (
    BatchingError,
    DeadlineExceeded,
    InferenceFailed,
    NeverAdmitted,
    OutOfMemory,
    QueueFull,
    ShuttingDown,
)
from .lanes import Lane
from .measure import measured_forward
from .metrics import (
    LATENCY_BUCKETS_S,
    BatchingMetrics,
    MemoryMetrics,
    ModelBatchingMetrics,
    ModelMemoryMetrics,
    latency_buckets,
    powers_of_two,
)
from .model_thread import ModelThread
from .planner import (
    BatchBudget,
    BatchPlan,
    cheapest_partition,
    cheapest_window,
    largest_batch,
    plan_batch,
    refused_alone,
    split,
)
from .probes import (
    LIMIT_SOURCES,
    HostProbe,
    MemoryLimit,
    MemoryProbe,
    MemoryReading,
    NvmlProbe,
    ProbeError,
    TorchCudaProbe,
    limit_address_space,
    limit_kills,
    refusal_room,
)
from .queue import BatchRun, Pending, RequestQueue
from .side import SideBySide, room_for_passes
from .sizer import (
    AdaptiveConfig,
    AdaptiveSizer,
    BatchOutcome,
    FixedSizer,
    PeakModel,
    Sizer,
    fit_envelope,
    prior_for,
    prior_peak_model,
)
from .timing import BatchTimeModel, fit_time_model
from .warmup import (
    WARMUP_BATCHES,
    CalibrationStep,
    WarmUp,
    WarmUpPlanner,
    WarmUpReport,
    calibration_lengths,
    scouts,
)

__all__ = [
    "LATENCY_BUCKETS_S",
    "LIMIT_SOURCES",
    "WARMUP_BATCHES",
    "AdaptiveConfig",
    "AdaptiveSizer",
    "BatchBudget",
    "BatchOutcome",
    "BatchPlan",
    "BatchRun",
    "BatchTimeModel",
    "Batcher",
    "BatcherConfig",
    "BatchingError",
    "BatchingMetrics",
    "CalibrationStep",
    "Clock",
    "CompositeProbe",
    "DeadlineExceeded",
    "FixedSizer",
    "HostProbe",
    "InferenceFailed",
    "Lane",
    "MemoryLimit",
    "MemoryMetrics",
    "MemoryProbe",
    "MemoryReading",
    "ModelBatchingMetrics",
    "ModelMemoryMetrics",
    "ModelThread",
    "MonotonicClock",
    "NeverAdmitted",
    "NvmlProbe",
    "OutOfMemory",
    "PeakModel",
    "Pending",
    "ProbeError",
    "QueueFull",
    "RequestQueue",
    "ShuttingDown",
    "SideBySide",
    "Sizer",
    "TorchCudaProbe",
    "WarmUp",
    "WarmUpPlanner",
    "WarmUpReport",
    "at_home",
    "calibration_lengths",
    "cheapest_partition",
    "cheapest_window",
    "fit_envelope",
    "fit_time_model",
    "largest_batch",
    "latency_buckets",
    "limit_address_space",
    "limit_kills",
    "measured_forward",
    "plan_batch",
    "powers_of_two",
    "prior_for",
    "prior_peak_model",
    "probes_for_device",
    "refusal_room",
    "refused_alone",
    "release_host_memory",
    "room_for_passes",
    "scouts",
    "split",
    "tune_host_allocator",
]
